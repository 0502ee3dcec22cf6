"""What a shard task pays to know its images' manifest rows, at corpus sizes no round runs at here:
reading the whole manifest to find them (what every shard task did until 2026-12-04) against the
rows its flow hands it (:func:`flows.wsss.handing`, :func:`tasks.store.shard_records`).

    python tools/bench_shard_rows.py --sizes 100000 1000000 --shard 500 --out runs/shard_rows.json

For each size, a corpus manifest of that many rows (ids, tags, hashes and source paths shaped like
an ingested corpus's) is written with the store's own writer; then, in a fresh process each (so
that one measurement's memory does not count in the next): the seconds and the peak memory added
(VmHWM, over the process's after its imports) of ``records_by_id(store.manifest(), ids)`` for the
shard's ids, and of unpickling the shard's handed rows (what a worker does with a task's arguments),
with the pickled size a task carries. Prints a table and writes ``--out``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_MEASURE = r"""
import json, pickle, sys, time
sys.path.insert(0, sys.argv[1])
from wsseg.tasks.store import Store, records_by_id
from wsseg.tasks.runtime.memory import rss_mb
import wsseg.tasks.store.run  # everything imported before the baseline
mode, run, shard = sys.argv[2], sys.argv[3], int(sys.argv[4])
store = Store(run)
ids = [f"img{i:08d}" for i in range(shard)]
if mode == "handed":
    blob = open(sys.argv[5], "rb").read()
base = rss_mb("VmHWM")
t = time.perf_counter()
recs = records_by_id(store.manifest(), ids) if mode == "manifest" else pickle.loads(blob)
seconds = time.perf_counter() - t
assert [r.image_id for r in recs] == ids
print(json.dumps({"seconds": seconds, "peak_added_mb": rss_mb("VmHWM") - base}))
"""


def write_manifest(root: Path, n: int) -> None:
    from wsseg.tasks.store import ClassSpec, ImageRecord, Store

    classes = ClassSpec(tuple(f"class{c:02d}" for c in range(20)), None)
    recs = [ImageRecord(image_id=f"img{i:08d}", height=480, width=640,
                        tags=(f"class{i % 20:02d}", f"class{(i * 7 + 3) % 20:02d}"), sha256=f"{i:064x}",
                        split="train", source=f"/data/corpora/photos/batch{i // 10000:04d}/img{i:08d}.jpg",
                        has_mask=False) for i in range(n)]
    Store(root).write_corpus(recs, classes)


def measure(mode: str, run: Path, shard: int, blob: Path | None = None) -> dict:
    argv = [sys.executable, "-c", _MEASURE, str(Path(__file__).resolve().parents[1]), mode, str(run), str(shard)]
    out = subprocess.run(argv + ([str(blob)] if blob else []), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="manifest rows")
    ap.add_argument("--shard", type=int, default=500, help="images of one shard (default 500, the shard size "
                    "at 10^6 images)")
    ap.add_argument("--out", help="JSON file for the figures")
    a = ap.parse_args(argv)
    import pickle

    from wsseg.tasks.store import Store

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            run = Path(tmp) / f"n{n}"
            t = time.perf_counter()
            write_manifest(run, n)
            print(f"  {n:,} rows written ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
            blob = run / "handed.pickle"
            handed = Store(run).manifest()[:a.shard]
            blob.write_bytes(pickle.dumps(handed))
            read, got = measure("manifest", run, a.shard), measure("handed", run, a.shard, blob)
            rows.append({"images": n, "shard": a.shard,
                         "manifest_mb": (run / "corpus" / "manifest.parquet").stat().st_size / 2 ** 20,
                         "read_seconds": read["seconds"], "read_peak_added_mb": read["peak_added_mb"],
                         "handed_kb": blob.stat().st_size / 1024, "handed_seconds": got["seconds"],
                         "handed_peak_added_mb": got["peak_added_mb"]})
    print(f"a shard task's {a.shard} manifest rows: the whole manifest read against the rows handed to it")
    print("| images | manifest | read whole: seconds, peak memory added | handed: pickled size, seconds, "
          "peak memory added |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['images']:,} | {r['manifest_mb']:.1f} MB | {r['read_seconds']:.2f} s, "
              f"{r['read_peak_added_mb']:.0f} MB | {r['handed_kb']:.0f} KB, {r['handed_seconds'] * 1000:.1f} ms, "
              f"{r['handed_peak_added_mb']:.0f} MB |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"shard": a.shard, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

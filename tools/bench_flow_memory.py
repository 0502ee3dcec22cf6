"""What the flow holds to submit a stage's shard tasks, at corpus sizes no round runs at here: the
whole manifest read and every shard's rows handed at once (what ``run_shards`` did until
2026-12-06) against the split's rows streamed by shard and submitted in waves (issue 54).

    python tools/bench_flow_memory.py --sizes 10000 100000 1000000 --out runs/flow_memory.json

For each size a corpus manifest of that many rows (one split, shaped like an ingested corpus's:
``tools/bench_shard_rows.py``'s) is written with the store's own writer. Then, in a fresh process
each (so that one measurement's memory does not count in the next), the seconds and the peak
memory added (VmHWM over the process's after its imports) of one stage's submission without Dask,
each shard's task arguments pickled as Prefect and Dask pickle them:

* ``old``: ``store.manifest(split)``, ``shards_of`` and every shard's handed rows pickled and
  held at once (the Dask scheduler held them all while the stage's tasks waited; with a local
  cluster it lives in the command's process);
* ``new``: ``flows.wsss.stream_shards`` of ``store.split_rows`` (the rows read a Parquet batch at
  a time), one pass for the finished shards' markers (``pending_shards``), then the shards made
  one at a time with at most ``--wave`` (``flows.wsss.wave_size``'s) shards held, the oldest
  dropped as the next one comes (a task finishing).

Each shard held counts twice, as in a run: its rows as the task's arguments (its future keeps
them) and pickled (what the Dask scheduler keeps until the task runs).

Prints a Markdown table and writes ``--out``. The figures are what the flow and a local cluster's
scheduler hold for the shard stages; the trainers' rows (every image unless ``train_images``) come
on top of both.
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
import collections, json, pickle, sys, time
sys.path.insert(0, sys.argv[1])
from wsseg.flows.wsss import handing, pending_shards, shards_of, stream_shards, wave_size
from wsseg.tasks.runtime.memory import rss_mb
from wsseg.tasks.store import Store
import pyarrow.compute  # noqa: F401  (imported by the streamed read: everything imported before the baseline)
mode, run, size, max_shards, wave = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = Store(run)
base = rss_mb("VmHWM")
t = time.perf_counter()
images = shards = 0
if mode == "old":
    records = store.manifest("train")
    cut = shards_of(records, size, max_shards)
    per_shard = handing(records)
    held = [(per_shard(ids), pickle.dumps({"ids": ids, **per_shard(ids)})) for ids in cut]  # every task at once
    images, shards = sum(len(s) for s in cut), len(held)
else:
    todo, _ = pending_shards(store, 0, "pseudo", stream_shards(store.split_rows("train"), size, max_shards))
    wave = wave or wave_size(todo.size)  # run_shards's outside a flow: no cluster threads to count
    per_shard, held = handing(), collections.deque(maxlen=wave)  # in flight: the oldest ends as one more starts
    for shard in todo:  # a task's rows (its future keeps its arguments) and their pickled copy (the scheduler's)
        held.append((per_shard(shard), pickle.dumps({"ids": [r.image_id for r in shard], **per_shard(shard)})))
        images, shards = images + len(shard), shards + 1
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_added_mb": rss_mb("VmHWM") - base, "images": images, "shards": shards,
                  "wave": wave if mode == "new" else shards}))
"""


def measure(mode: str, run: Path, size: int, max_shards: int, wave: int) -> dict:
    argv = [sys.executable, "-c", _MEASURE, str(Path(__file__).resolve().parents[1]), mode, str(run), str(size),
            str(max_shards), str(wave)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="manifest rows")
    ap.add_argument("--shard-size", type=int, default=64, help="shard_size (default 64, the configuration's)")
    ap.add_argument("--max-shards", type=int, default=2000, help="max_shards (default 2000, the configuration's)")
    ap.add_argument("--wave", type=int, default=0, help="shard tasks in flight (default: flows.wsss.wave_size's "
                    "for the shard size, without a cluster's threads to count)")
    ap.add_argument("--out", help="JSON file for the figures")
    a = ap.parse_args(argv)
    from bench_shard_rows import write_manifest

    from wsseg.tasks.config import shard_size_for

    wave = a.wave
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            run = Path(tmp) / f"n{n}"
            t = time.perf_counter()
            write_manifest(run, n)
            print(f"  {n:,} rows written ({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
            old, new = (measure(m, run, a.shard_size, a.max_shards, wave) for m in ("old", "new"))
            assert old["images"] == new["images"] == n and old["shards"] == new["shards"], (old, new)
            rows.append({"images": n, "shard_size": shard_size_for(n, a.shard_size, a.max_shards),
                         "shards": old["shards"], "wave": new["wave"], "old": old, "new": new})
    print(f"the flow's peak memory added by one stage's submission (shards of {a.shard_size}, at most {a.max_shards})")
    print("| images | shard size, tasks | whole manifest, every shard submitted: peak added, seconds "
          "| streamed by shard, in waves: tasks in flight, peak added, seconds |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['images']:,} | {r['shard_size']}, {r['shards']:,} | {r['old']['peak_added_mb']:.0f} MB, "
              f"{r['old']['seconds']:.2f} s | {r['wave']}, {r['new']['peak_added_mb']:.0f} MB, "
              f"{r['new']['seconds']:.2f} s |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The store alone at a size no round runs at here: files, listing, `wsseg status` and random reads,
the per-image layout (one array per image and part, as before the packs) against packs by shard.

    python tools/bench_store.py --from runs/q0 --images 16000 --out runs/store16k [--shard 64] [--reads 300]

Takes the corpus images, feature-cache entries, round-0 preliminary results and pseudo-labels of
a finished run (``--from``; any layout) and writes ``--images`` copies of them (new ids and content
hashes, the same arrays) into two fresh run directories, ``OUT/per-image`` (the older layout,
written the way it was: one single-chunk Zarr array per image and part) and ``OUT/packs`` (the
shard tasks' and ingest's layout now, the corpus's images packed by shard too). Then, for each:
the files and the seconds to list them all, the seconds of `wsseg status --json` (the command,
and its work in-process), and the mean
ms of ``--reads`` random reads of a pseudo-label, a preliminary result and a feature-cache entry,
in a new process (the first read, which loads a group's index, counted apart). Prints a table
and writes ``OUT/store.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wsseg.tasks.config import WSSSConfig  # noqa: E402
from wsseg.tasks.corpus.resume import round_inputs  # noqa: E402
from wsseg.tasks.store import ImageRecord, Store, chunked  # noqa: E402
from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE  # noqa: E402


def _group(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "zarr.json").exists():
        (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))


def source_arrays(src: Store, k: int) -> tuple[list, str, dict]:
    """Up to ``k`` images of ``src`` with all their per-image arrays."""
    recs = [r for r in src.manifest(src.read_config().get("split", "train")) if src.has_pseudo(0, r.image_id)][:k]
    key = next(p.name.split("-", 1)[1] for p in (src.root / "cache").iterdir() if p.name.startswith(FEATURE_STAGE))
    classes = src.classes()
    out = []
    for r in recs:
        prelim = src.prelim(0, r.image_id, classes.n)
        idx = np.flatnonzero(prelim.reshape(classes.n, -1).max(1) > 0)
        out.append({"rec": r, "image": src.image(r.image_id), "pseudo": src.pseudo(0, r.image_id),
                    "prelim": (prelim[idx], idx), "features": src.cached(FEATURE_STAGE, key, r.sha256)})
    return out, key, {"classes": classes}


def write_run(root: Path, layout: str, items: list, key: str, classes, n: int, shard: int) -> dict:
    """``n`` images cycling through ``items``: corpus, features, round-0 prelim and pseudo."""
    store = Store(root)
    recs = []
    t0 = time.perf_counter()
    for start in range(0, n, shard):
        ids = [f"c{i:07d}" for i in range(start, min(n, start + shard))]
        for i, iid in enumerate(ids, start):
            it = items[i % len(items)]
            sha = f"{i:016x}" + it["rec"].sha256[16:]
            r = it["rec"]
            recs.append(ImageRecord(iid, r.height, r.width, r.tags, sha, "train", "copy", False))
        if layout == "packs":
            with store.packing(Store.shard_name(ids)):  # the corpus by shard, as ingest writes it
                for i, iid in enumerate(ids, start):
                    store.put_image(iid, items[i % len(items)]["image"], recs[i].sha256)
            with store.packing(Store.shard_name(ids)):
                for i, iid in enumerate(ids, start):
                    it = items[i % len(items)]
                    store.put_cached(FEATURE_STAGE, key, recs[i].sha256, it["features"])
            with store.packing(Store.shard_name(ids)):
                for i, iid in enumerate(ids, start):
                    it = items[i % len(items)]
                    store.write_prelim(0, iid, it["prelim"][0], it["prelim"][1])
                    store.write_pseudo(0, iid, it["pseudo"])
        else:  # the per-image layout, as wsseg wrote it before the packs
            base = store.cache_dir(FEATURE_STAGE, key)
            _group(base)
            _group(store.corpus_dir / "images.zarr")
            for i, iid in enumerate(ids, start):
                chunked.write(store.corpus_dir / "images.zarr" / iid,
                              np.ascontiguousarray(items[i % len(items)]["image"]),
                              {"sha256": recs[i].sha256, "complete": True})
            _group(store.round_dir(0) / "prelim.zarr")
            _group(store.round_dir(0) / "pseudo.zarr")
            for i, iid in enumerate(ids, start):
                it = items[i % len(items)]
                sha = recs[i].sha256[:24]
                for name, arr in it["features"].items():
                    chunked.write(base / f"{sha}.{name}", np.ascontiguousarray(arr))
                chunked.write(base / sha, np.zeros(1, np.uint8), {"parts": sorted(it["features"]), "complete": True})
                q = np.clip(np.rint(it["prelim"][0] * 255.0), 0, 255).astype(np.uint8)
                chunked.write(store.round_dir(0) / "prelim.zarr" / iid, q,
                              {"classes": [int(c) for c in it["prelim"][1]], "complete": True})
                chunked.write(store.round_dir(0) / "pseudo.zarr" / iid, it["pseudo"], {"complete": True})
        for stage in ("prelim", "pseudo"):
            store.mark_shard_done(0, stage, Store.shard_name(ids), {"images": len(ids)})
        if start // shard % 25 == 0:
            print(f"  {layout}: {start + len(ids)}/{n} images written", file=sys.stderr, flush=True)
    store.write_corpus(recs, classes)
    store.write_config({"split": "train", "shard_size": shard})
    # what the round was computed from, as `wsseg train` records it: status finds nothing changed
    store.write_round_inputs(0, round_inputs(classes, recs, WSSSConfig(split="train", shard_size=shard)))
    store.write_round(0, {"round": 0})
    return {"write_seconds": time.perf_counter() - t0}


READER = r"""
import json, random, sys, time
from wsseg.tasks.store import Store
from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE
root, key, k, n_classes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from wsseg.tasks.report.status import run_status
t = time.perf_counter(); run_status(Store(root)); status_s = time.perf_counter() - t
store = Store(root)
t = time.perf_counter(); recs = store.manifest(); manifest_s = time.perf_counter() - t
picks = random.Random(0).sample(recs, k)
out = {"manifest_seconds": manifest_s, "status_inprocess_seconds": status_s}
for what, read in (("pseudo_label", lambda r: store.pseudo(0, r.image_id)),
                   ("prelim", lambda r: store.prelim(0, r.image_id, n_classes)),
                   ("features", lambda r: store.cached(FEATURE_STAGE, key, r.sha256)),
                   ("image", lambda r: store.image(r.image_id))):
    t = time.perf_counter(); read(picks[0]); first = time.perf_counter() - t
    t = time.perf_counter()
    for r in picks[1:]:
        assert read(r) is not None
    out[what] = {"first_ms": 1000 * first, "mean_ms": 1000 * (time.perf_counter() - t) / (k - 1)}
print(json.dumps(out))
"""


def measure(root: Path, key: str, reads: int, n_classes: int) -> dict:
    t = time.perf_counter()
    files = sum(len(names) for _, _, names in os.walk(root))
    list_s = time.perf_counter() - t
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wsseg", "status", str(root), "--json"], check=True,
                   stdout=subprocess.DEVNULL, env=env)
    status_s = time.perf_counter() - t
    got = subprocess.run([sys.executable, "-c", READER, str(root), key, str(reads), str(n_classes)], check=True,
                         capture_output=True, text=True, env=env)
    parts = {p: sum(len(names) for _, _, names in os.walk(root / p)) for p in ("corpus", "cache", "rounds")}
    return {"files": files, "files_by_part": parts, "list_seconds": list_s, "status_seconds": status_s,
            **json.loads(got.stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", required=True, help="a finished run directory to copy arrays from")
    ap.add_argument("--images", type=int, default=16000, help="images in each run directory (default 16000)")
    ap.add_argument("--out", required=True, help="folder of the two run directories and store.json")
    ap.add_argument("--shard", type=int, default=64, help="images per shard (default 64, the pipeline's)")
    ap.add_argument("--reads", type=int, default=300, help="random reads per kind of array (default 300)")
    ap.add_argument("--distinct", type=int, default=200, help="source images to cycle through (default 200)")
    ap.add_argument("--again", action="store_true",
                    help="measure the run directories of an earlier --out again instead of writing them")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.again:
        print(f"bench_store: error: {out} exists; give a new --out (or --again to measure it again)", file=sys.stderr)
        return 2
    items, key, extra = source_arrays(Store(args.source), 1 if args.again else args.distinct)
    before = json.loads((out / "store.json").read_text()) if args.again else {}
    res = {"images": args.images, "shard": args.shard, "source": str(args.source), "layouts": {}}
    for layout in ("per-image", "packs"):
        if args.again:
            w = {"write_seconds": before["layouts"][layout]["write_seconds"]}
            st = Store(out / layout)
            st.write_round_inputs(0, round_inputs(extra["classes"], st.manifest("train"),
                                                  WSSSConfig(split="train", shard_size=args.shard)))
        else:
            w = write_run(out / layout, layout, items, key, extra["classes"], args.images, args.shard)
        res["layouts"][layout] = {**w, **measure(out / layout, key, args.reads, extra["classes"].n)}
    (out / "store.json").write_text(json.dumps(res, indent=1))
    print(f"\n{args.images} images, shards of {args.shard}; reads: mean ms over {args.reads} random images "
          "(first read: ms)")
    print(f"{'layout':<10} {'files':>8} {'cache':>8} {'rounds':>8} {'list s':>7} {'status s':>9} "
          f"{'(in-process)':>12} {'label':>12} {'prelim':>12} {'features':>14} {'image':>6}")
    for layout, m in res["layouts"].items():
        f = lambda k: f"{m[k]['mean_ms']:.2f} ({m[k]['first_ms']:.0f})"  # noqa: E731
        print(f"{layout:<10} {m['files']:>8} {m['files_by_part']['cache']:>8} {m['files_by_part']['rounds']:>8} "
              f"{m['list_seconds']:>7.2f} {m['status_seconds']:>9.2f} {m['status_inprocess_seconds']:>12.3f} "
              f"{f('pseudo_label'):>12} {f('prelim'):>12} "
              f"{f('features'):>14} {m['image']['mean_ms']:>6.2f}")
    a, b = res["layouts"]["per-image"], res["layouts"]["packs"]
    print("packs / per-image: " + ", ".join(f"{k} {b[k]['mean_ms'] / a[k]['mean_ms']:.2f}x"
                                             for k in ("pseudo_label", "prelim", "features")) +
          f"; files {b['files'] / a['files']:.3f}x; status in-process "
          f"{b['status_inprocess_seconds'] / a['status_inprocess_seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

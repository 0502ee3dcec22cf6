"""The scale table of docs/large-corpora.md, computed from measured figures: store files, manifest
size, tasks per stage, flow and worker memory, and one round's wall time on 2, 16 and 128 workers
with the store on S3-compatible storage, at 10^5, 10^6 and 10^7 images.

    python tools/scale_table.py --pipeline runs/bp/pipeline.json --object-store runs/s3.json \\
        [--sizes 100000 1000000 10000000] [--gets-per-image 8] [--record-bytes 630] [--train-images N]

``--pipeline``: `wsseg bench pipeline`'s JSON at two sizes (per-image core-ms of the CPU stages,
parallel efficiency, peak memory, trainer seconds, files by part); ``--object-store``:
`tools/bench_object_store.py --out`'s (ms per request on moto's server). Every line of the model
is printed with the table. Memory: the larger measured size's peak plus what is held per image
beyond it: in the flow, the manifest's records (``--record-bytes``, measured with tracemalloc),
12 bytes a name of each pack group's index, 8 of an epoch's shuffled order and the rows handed to a
stage's shard tasks (``--handed-bytes`` pickled, held by the Dask scheduler, which a local cluster
runs in the command's process, while the tasks wait: a stage submits them all); in each worker,
the records of its shard, which the flow hands each shard task (no task reads the manifest). Trainer time is a straight
line through the two measured sizes, at the corpus's size or, with ``--train-images`` (the run's
``train_images``), at the sample's. The CPU stages scale by the measured 2-worker efficiency (assumed to hold at 16 and 128
workers, which nothing here measured), each image costs ``--gets-per-image`` object reads a round
(the image in each of three stages, its feature-cache entry twice, its preliminary result, its
previous labels) at the measured ranged-GET latency, serial within a single-threaded worker, and
each shard task 0.2 s (docs/benchmarks.md#shard-task-cost).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wsseg.tasks.config import shard_size_for  # noqa: E402

STAGES = ("features", "preliminary", "pseudo_labels")
ROUNDS = 3  # the default round budget


def line(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def human_time(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", required=True, help="`wsseg bench pipeline`'s JSON (two sizes)")
    ap.add_argument("--object-store", required=True, help="`tools/bench_object_store.py --out`'s JSON")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10 ** 5, 10 ** 6, 10 ** 7], help="corpus sizes")
    ap.add_argument("--gets-per-image", type=float, default=8, help="object reads per image and round (default 8)")
    ap.add_argument("--record-bytes", type=float, default=630, help="bytes of one manifest record in memory "
                    "(default 630, measured at 4000 images)")
    ap.add_argument("--handed-bytes", type=float, default=198, help="bytes of one manifest row pickled as a "
                    "shard task's argument (default 198, measured on bench pipeline's corpus)")
    ap.add_argument("--train-images", type=int, default=None, help="train_images: the trainers learn from at "
                    "most this many images (default: all)")
    ap.add_argument("--shard-size", type=int, default=64, help="shard_size (default 64)")
    ap.add_argument("--max-shards", type=int, default=2000, help="max_shards (default 2000)")
    args = ap.parse_args(argv)
    p = json.loads(Path(args.pipeline).read_text())
    s3 = json.loads(Path(args.object_store).read_text())
    n1, n2 = (int(n) for n in p["sizes"][:2])
    core_ms = sum(p["stages"][s]["core_ms_per_image"] for s in STAGES)
    eff = min(1.0, p["parallel_efficiency"])  # above 1 on 2 cores (the flow shared the one-worker run): not assumed
    rss = p["peak_rss_mb"]
    tr1, tr2 = (sum(v for v in p["trainer_seconds"][str(n)].values()) for n in (n1, n2))
    listing = p["store_listing"][str(n2)]
    corpus_per_image = listing["objects"].get("corpus", 0) / n2
    manifest = Path(p["run_dir"]) / f"n{n2}" / "run" / "corpus" / "manifest.parquet"
    manifest_per_row = manifest.stat().st_size / n2 if manifest.exists() else None
    get_ms = s3["ranged_get_20kb_ms"]
    slope = (rss[str(n2)]["flow"] - rss[str(n1)]["flow"]) / (n2 - n1) * 1024
    print(f"measured: flow peak {rss[str(n1)]['flow']:.0f} -> {rss[str(n2)]['flow']:.0f} MB, {slope:.0f} KB an image "
          f"between the sizes (a straight line would give {(rss[str(n2)]['flow'] + slope * (10 ** 6 - n2) / 1024) / 1024:.0f}"
          f" GB at 10^6); workers {rss[str(n1)]['worker']:.0f} -> {rss[str(n2)]['worker']:.0f} MB")
    print(f"model: CPU stages {core_ms:.0f} core-ms an image (features + preliminary + pseudo-labels, N = {n1}); "
          f"parallel efficiency {eff:.2f} (1 -> 2 workers, assumed at 16 and 128); {args.gets_per_image:g} object "
          f"reads an image a round at {get_ms:.1f} ms (moto); 0.2 s a shard task; trainers {tr1:.0f} s at {n1} "
          f"and {tr2:.0f} s at {n2} images on the benchmark's budget, in the command's process"
          f"{f', on at most {args.train_images:,} images (train_images)' if args.train_images else ''}; corpus "
          f"{corpus_per_image:.2f} files an image; manifest {manifest_per_row or 0:.0f} bytes a row; packs 3 files "
          f"a shard and group (cache 1, rounds 3 in round 0 and 2 after) plus 3 markers and tables a shard and round")
    print()
    print("| images | shard size, tasks a stage | store files (one round) | manifest | flow / worker memory "
          "| a round's CPU stages on 2 / 16 / 128 workers | trainers (one process) |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        size = shard_size_for(n, args.shard_size, args.max_shards)
        shards = math.ceil(n / size)
        files = corpus_per_image * n + (3 * shards + 1) * (1 + 3) + 3 * shards
        names = 8 + 3 * ROUNDS  # feature-cache parts, and a preliminary result, label and CAM label a round
        flow = (rss[str(n2)]["flow"] * 2 ** 20 + (n - n2) * (args.record_bytes + 12 * names + 8 + args.handed_bytes)) / 2 ** 30
        worker = (rss[str(n2)]["worker"] * 2 ** 20 + size * args.record_bytes) / 2 ** 30
        walls = []
        for w in (2, 16, 128):
            cpu = n * core_ms / 1000 / (w * eff)
            io = n * args.gets_per_image * get_ms / 1000 / w
            tasks = 3 * shards * 0.2 / w
            walls.append(human_time(cpu + io + tasks))
        trainers = line(n1, tr1, n2, tr2, min(n, args.train_images or n))
        print(f"| {n:,} | {size}, {shards:,} | {files:,.0f} | {(manifest_per_row or 0) * n / 2 ** 20:,.0f} MB "
              f"| {flow:,.1f} / {worker:,.1f} GB | {' / '.join(walls)} | {human_time(trainers)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

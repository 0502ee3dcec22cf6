"""The 10^5 to 10^7 table of docs/large-corpora.md, computed from `wsseg bench scale`'s measurements
at two corpus sizes: store files and bytes, memory of the flow, a worker and the scheduler, ingest,
a round's shard stages on 2, 16 and 128 workers, the trainers and export.

    python tools/scale_table.py --scale runs/bs/scale.json [--object-store runs/s3.json] \\
        [--sizes 100000 1000000 10000000] [--train-images 10000] [--rounds 3]

``--scale``: `wsseg bench scale --out`'s JSON with two sizes (its smallest and largest are used).
Every figure that grows is a straight line through the two measured sizes (one that did not grow
stays at the larger size's): by shard (tasks a stage, at most ``max_shards``) for the store's files
and the scheduler, whose growth follows the packs and the task states; by image for the bytes and
the flows of ingest (which holds every record of the corpus) and train; both for a worker, whose
growth between the sizes is not explained; the shard stages' CPU per image is the larger size's, over every round the benchmark ran, at the parallel efficiency its two workers reached
(assumed to hold at 16 and 128 workers, which nothing here measured), plus 0.2 s a shard task
(docs/benchmarks.md#shard-task-cost). The trainers learned from the benchmark's sample
(``train_images`` of its ``--set``); their time per sampled image is carried to ``--train-images``
(the default bound) in a straight line from zero, which is extrapolated. With ``--object-store``
(`tools/bench_object_store.py --out`'s JSON), each image costs ``--gets-per-image`` ranged reads a
round at the measured latency, serial within a single-threaded worker. Every line of the model is
printed with the table, and each column says whether it is measured or extrapolated.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wsseg.tasks.config import TRAIN_IMAGES, shard_size_for  # noqa: E402

STAGES = ("features", "preliminary", "pseudo_labels", "evaluate")


def human_time(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"


def line(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def grown(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    """A straight line through two measurements, or the larger size's value where it did not grow."""
    return line(x1, y1, x2, y2, x) if y2 > y1 else y2


def _peak(size: dict, who: str) -> float:
    vals = [(s.get("peak_rss_mb") or {}).get(who) for s in size["steps"].values()]
    return max(v for v in vals if v is not None)


def model(scale: dict) -> dict:
    """The measured inputs of the table, read from bench scale's JSON."""
    per = scale["per_size"]
    n1, n2 = sorted(int(n) for n in per)[0], sorted(int(n) for n in per)[-1]
    small, large = per[str(n1)], per[str(n2)]
    workers = large["workers"]
    train = large["steps"]["train"]
    bd = train["breakdown"]
    rounds = len(bd["rounds"])
    core = sum(bd["totals"][s]["core_seconds"] for s in STAGES if s in bd["totals"])
    wall = sum(e["wall_seconds"] or 0.0 for k, e in bd["stages"].items() if k.split(".", 1)[-1] in STAGES)
    argv = train.get("argv") or []
    sample = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("train_images=")), None)
    win = bd["windows"]
    classifier = win["classifier"]["wall_seconds"]
    per_round = sum(v["wall_seconds"] for k, v in win.items() if k.startswith("r")) / rounds
    files = [(s["steps"]["rerun"]["store"]["files"], s["steps"]["rerun"]["store"]["bytes"]) for s in (small, large)]
    return {
        "sizes": (n1, n2), "workers": workers, "rounds": rounds, "train_sample": sample,
        # the features are computed once a run, the other stages every round
        "features_core_ms": bd["totals"]["features"]["core_ms_per_image"],
        "round_core_ms": sum(bd["totals"][s]["core_ms_per_image"] for s in STAGES[1:] if s in bd["totals"]),
        "stages_core_ms": {s: bd["totals"][s]["core_ms_per_image"] for s in STAGES if s in bd["totals"]},
        "efficiency": core / (wall * workers) if wall else 1.0,
        "classifier_s": classifier, "round_trainers_s": per_round,
        "ingest_core_ms": large["steps"]["ingest"]["core_ms_per_image"],
        "ingest_wall_ms": 1000.0 * large["steps"]["ingest"]["wall_seconds"] / n2,
        "export_wall_ms": 1000.0 * large["steps"]["export"]["wall_seconds"] / n2,
        "flow_mb": tuple(max(s["steps"][k]["peak_rss_mb"]["flow"] for k in ("train", "rerun")) for s in (small, large)),
        "ingest_flow_mb": tuple(s["steps"]["ingest"]["peak_rss_mb"]["flow"] for s in (small, large)),
        "worker_mb": (_peak(small, "worker"), _peak(large, "worker")),
        "scheduler_mb": (_peak(small, "scheduler"), _peak(large, "scheduler")),
        "shards": tuple(s["steps"]["train"]["breakdown"]["stages"]["features"]["tasks"] for s in (small, large)),
        "files": files, "status_s": max(s["steps"]["status"]["wall_seconds"] for s in (small, large)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", required=True, help="`wsseg bench scale --out`'s JSON (two sizes)")
    ap.add_argument("--object-store", default=None, help="`tools/bench_object_store.py --out`'s JSON: adds the "
                    "object reads' latency to the shard stages (default: a local or shared filesystem)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10 ** 5, 10 ** 6, 10 ** 7], help="corpus sizes")
    ap.add_argument("--gets-per-image", type=float, default=8, help="object reads per image and round with "
                    "--object-store (default 8)")
    ap.add_argument("--train-images", type=int, default=TRAIN_IMAGES, help=f"train_images, the trainers' bound "
                    f"(default {TRAIN_IMAGES:,}, wsseg's)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a run computes (default 3, max_rounds')")
    ap.add_argument("--shard-size", type=int, default=64, help="shard_size (default 64)")
    ap.add_argument("--max-shards", type=int, default=2000, help="max_shards (default 2000)")
    args = ap.parse_args(argv)
    m = model(json.loads(Path(args.scale).read_text()))
    n1, n2 = m["sizes"]
    get_ms = json.loads(Path(args.object_store).read_text())["ranged_get_20kb_ms"] if args.object_store else 0.0
    f1, f2 = m["flow_mb"]
    i1, i2 = m["ingest_flow_mb"]
    (files1, bytes1), (files2, bytes2) = m["files"]
    sample = m["train_sample"] or n2
    print(f"measured (bench scale, N = {n1:,} and {n2:,}, {m['workers']} single-threaded workers, {m['rounds']} "
          f"rounds): shard stages at N = {n2:,}, core-ms an image: features {m['features_core_ms']:.0f} once, then "
          f"{m['round_core_ms']:.0f} a round ({', '.join(f'{k} {v:.0f}' for k, v in m['stages_core_ms'].items() if k != 'features')}); parallel efficiency {m['efficiency']:.2f} on {m['workers']} workers; ingest {m['ingest_core_ms']:.0f}"
          f" core-ms an image; export {m['export_wall_ms']:.1f} ms an image; peak memory: flow of ingest {i1:.0f} -> {i2:.0f} MB, "
          f"of train {f1:.0f} -> {f2:.0f} MB, worker {m['worker_mb'][0]:.0f} -> {m['worker_mb'][1]:.0f} MB, scheduler {m['scheduler_mb'][0]:.0f} "
          f"-> {m['scheduler_mb'][1]:.0f} MB; store after the rerun {files1:,} -> {files2:,} files, "
          f"{bytes1 / 2 ** 30:.2f} -> {bytes2 / 2 ** 30:.2f} GB; trainers on a sample of {sample:,} images: "
          f"classifier {m['classifier_s']:.0f} s, {m['round_trainers_s']:.0f} s a round; status at most "
          f"{m['status_s']:.2f} s")
    per_img_trainers = (m["classifier_s"] / args.rounds + m["round_trainers_s"]) / sample
    print(f"extrapolated: straight lines through the two sizes; the shard stages at the measured efficiency on 16 and "
          f"128 workers, 0.2 s a shard task{f', {args.gets_per_image:g} reads an image a round at {get_ms:.1f} ms' if get_ms else ''}; "
          f"the trainers at {per_img_trainers:.2f} s a round per sampled image (the classifier's time spread over "
          f"{args.rounds} rounds), on train_images = {args.train_images:,} images")
    print()
    print("| images | shard size, tasks a stage | store files (by shard), GB (by image; measured at "
          f"{n1:,} and {n2:,}) | peak memory: flow of ingest / of train, worker, scheduler | ingest on 2 / 16 / 128 workers "
          f"| a round's shard stages on 2 / 16 / 128 workers (the features spread over {args.rounds} rounds) | trainers a round | export |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        size = shard_size_for(n, args.shard_size, args.max_shards)
        shards = math.ceil(n / size)
        s1, s2 = m["shards"]
        files = line(s1, files1, s2, files2, shards)  # packs, indexes and markers: by shard
        gb = line(n1, bytes1, n2, bytes2, n) / 2 ** 30
        flow = grown(n1, f1, n2, f2, n) / 1024
        ingest_flow = grown(n1, i1, n2, i2, n) / 1024  # it holds every record of the corpus: by image
        worker_n = grown(n1, m["worker_mb"][0], n2, m["worker_mb"][1], n) / 1024
        worker_s = grown(s1, m["worker_mb"][0], s2, m["worker_mb"][1], shards) / 1024
        sched = grown(s1, m["scheduler_mb"][0], s2, m["scheduler_mb"][1], shards) / 1024  # task states: by task
        ingest, stages = [], []
        for w in (2, 16, 128):
            ingest.append(human_time(n * m["ingest_core_ms"] / 1000 / (w * m["efficiency"]) + shards * 0.2 / w))
            per_image = m["features_core_ms"] / args.rounds + m["round_core_ms"]  # the features spread over the rounds
            cpu = n * per_image / 1000 / (w * m["efficiency"])
            io = n * args.gets_per_image * get_ms / 1000 / w
            stages.append(human_time(cpu + io + len(STAGES) * shards * 0.2 / w))
        trainers = per_img_trainers * min(n, args.train_images)
        print(f"| {n:,} | {size}, {shards:,} | {files:,.0f}, {gb:,.0f} | {ingest_flow:.1f} / {flow:.1f}, {worker_s:.1f} (by shard) or {worker_n:.1f} (by image), {sched:.1f} GB "
              f"| {' / '.join(ingest)} | {' / '.join(stages)} | {human_time(trainers)} "
              f"| {human_time(n * m['export_wall_ms'] / 1000)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

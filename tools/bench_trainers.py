"""Each corpus-wide trainer of round 0 alone, in a process of its own, on run directories of
different sizes: wall seconds, peak RSS and the process's memory before training, so that what
grows with the corpus shows trainer by trainer.

    python tools/bench_trainers.py RUN_N RUN_4N [--trainers mil ...] [--profile DIR]

The run directories are `wsseg bench pipeline`'s (``RUN/n<N>/run``, round 0 finished). Each
trainer writes its checkpoint into a copy-free scratch run directory that links the original's
corpus, feature cache, classifier and round-0 preliminary results, so the originals are not
touched; each run directory's own configuration (the benchmark's, its ``--set``s included)
is used. ``--profile DIR`` writes a cProfile of each trainer there (``<trainer>-<N>.prof``).
Prints a table and the 4N / N ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("classifier", "mil", "proposal_classifier", "segmenter")

CHILD = r"""
import json, resource, sys, time, cProfile
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store import Store
from wsseg.tasks.wsss.feature_cache import feature_key
src, scratch, which, prof = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
main = Store(src)
config = WSSSConfig.model_validate(main.read_config())
store = Store(scratch)
store.share_from(main, ("corpus", "cache", "classifier"))
store.share_round_from(main, 0, ("prelim", "cam", "pseudo"), ())
needs = {"proposal_classifier": ("mil",), "segmenter": ("mil", "proposal_classifier")}.get(which, ())
for kind in needs:  # the round's earlier classifiers, as the trainer finds them in a round
    p = main.checkpoint_path(kind, 0)
    q = store.checkpoint_path(kind, 0)
    if p.exists() and not q.exists():
        q.parent.mkdir(parents=True, exist_ok=True); q.symlink_to(p)
records = store.manifest(config.split)
key = feature_key(config.features)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def run():
    if which == "classifier":
        from wsseg.tasks.wsss.classifier import train_image_classifier
        store.checkpoint_path("classifier").unlink()
        train_image_classifier(store, records, config.classifier, seed=config.seed, device=config.device)
    elif which == "mil":
        from wsseg.tasks.wsss import mil
        mil.train_round(store, 0, records, key, config.mil, seed=config.seed)
    elif which == "proposal_classifier":
        from wsseg.tasks.wsss import proposal_classifier
        proposal_classifier.train_round(store, 0, records, key, config.proposals,
                                        mil_prior_weight=config.mil.prior_weight, seed=config.seed)
    else:
        from wsseg.tasks.wsss.segmenter import train_segmenter
        train_segmenter(store, records, key, config, r=0, label_round=0)
t = time.perf_counter()
if prof:
    cProfile.run("run()", prof)
else:
    run()
print(json.dumps({"seconds": time.perf_counter() - t, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "before_mb": before, "images": len(records)}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories of `wsseg bench pipeline` (RUN/n<N>/run), smallest first")
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS, help="which (default: all)")
    ap.add_argument("--profile", default="", help="a folder for a cProfile of each trainer (default: none)")
    args = ap.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res: dict[str, dict] = {}
    for run in args.runs:
        for which in args.trainers:
            with tempfile.TemporaryDirectory(prefix="wsseg-trainer-") as scratch:
                prof = str(Path(args.profile) / f"{which}-{Path(run).parent.name}.prof") if args.profile else ""
                if prof:
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                out = subprocess.run([sys.executable, "-c", CHILD, run, str(Path(scratch) / "run"), which, prof],
                                     capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    print(out.stderr[-3000:], file=sys.stderr)
                    return 1
                got = json.loads(out.stdout.strip().splitlines()[-1])
                res.setdefault(which, {})[run] = got
                print(f"{which:<20} {got['images']:>6} images {got['seconds']:8.1f} s  peak {got['peak_mb']:7.0f} MB "
                      f"(before training {got['before_mb']:.0f})", flush=True)
    if len(args.runs) > 1:
        a, b = args.runs[0], args.runs[-1]
        for which, v in res.items():
            print(f"{which:<20} {v[b]['images'] / v[a]['images']:.1f}x images: time {v[b]['seconds'] / v[a]['seconds']:.2f}x, "
                  f"peak {v[b]['peak_mb'] / v[a]['peak_mb']:.2f}x, above the start "
                  f"{(v[b]['peak_mb'] - v[b]['before_mb']) / max(1, v[a]['peak_mb'] - v[a]['before_mb']):.2f}x")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

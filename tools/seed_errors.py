"""Where a class's wrong pixels come from in a round's pseudo-labels: the seeds (the near-object
zone of the fused proposal evidence, forced into the label) or the seeded segmentation of the
ambiguous area. Each image of the class is labelled again from the round's stored preliminary
result and classifiers (checked equal to the stored label), with the seed map kept aside
(how docs/benchmarks.md#msrc21-bench-quality located the small objects' over-extension).
Images with one tag and no implicit background (wholly that class) are left out and counted; not
for the foreground path (its GrabCut has no seed map).

    python tools/seed_errors.py RUN_DIR ROUND CLASS [CLASS ...] [--split train]
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from wsseg.tasks.config import WSSSConfig  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402
from wsseg.tasks.wsss import fusion  # noqa: E402
from wsseg.tasks.wsss import pipeline as pl  # noqa: E402
from wsseg.tasks.wsss.feature_cache import load_features  # noqa: E402
from wsseg.tasks.wsss.proposal_classifier import round_mil_model  # noqa: E402


@contextmanager
def seed_maps(kept: dict):
    """While active, every seed map that step 7 receives is kept in ``kept["seeds"]``."""
    solve = fusion.seeded_segmentation

    def keeping(image, seeds, **options):
        kept["seeds"] = np.array(seeds, copy=True)
        return solve(image, seeds, **options)

    fusion.seeded_segmentation = keeping
    try:
        yield kept
    finally:
        fusion.seeded_segmentation = solve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a finished run directory whose corpus has masks (not on the foreground path)")
    p.add_argument("round", type=int, help="the round whose labels are examined")
    p.add_argument("classes", nargs="+", metavar="CLASS", help="classes to examine")
    p.add_argument("--split", default="train", help="split (default train)")
    args = p.parse_args(argv)
    pl._worker_setup()  # one thread, as on the workers that made the labels
    store = Store(args.run_dir)
    spec = store.classes()
    missing = [c for c in args.classes if c not in spec.names]
    if missing:
        print(f"{args.run_dir}: no class {', '.join(missing)}", file=sys.stderr)
        return 1
    config = WSSSConfig.model_validate(store.read_config())
    key = store.read_summary()["feature_key"]
    r = args.round
    clf = store.read_classifier("proposal_classifier", r)["model"]
    mil = round_mil_model(store, r)
    print(f"{'class':10s} {'labelled':>9s} {'seeded':>8s} {'wrong':>8s} {'of them seeded':>15s} "
          f"{'seeds wrong':>12s} {'decided wrong':>14s}")
    for name in args.classes:
        c = spec.index(name)
        n = {"seeded": 0, "decided": 0, "seeded_wrong": 0, "decided_wrong": 0, "whole": 0}
        for rec in store.manifest(args.split):
            mask = store.mask(rec.image_id)
            if mask is None or not (mask == c).any():
                continue
            with seed_maps({}) as kept:
                label = pl.image_pseudo_label(
                    store.image(rec.image_id), load_features(store, rec, key), store.prelim(r, rec.image_id, spec.n),
                    clf, mil, spec.tag_vector(rec.tags), spec, rec.tags, config.proposals, config.seed,
                    config.mil.prior_weight, None)
            stored = store.pseudo(r, rec.image_id)
            if stored is None or not np.array_equal(label, stored):
                print(f"{rec.image_id}: labelled again, it differs from round {r}'s stored label "
                      "(another configuration or the foreground path)", file=sys.stderr)
                return 1
            if "seeds" not in kept:  # one tag and no implicit background: the whole image is that class
                n["whole"] += 1
                continue
            seeded = kept["seeds"] > 0
            on = (label == c) & (mask != 255)
            wrong = on & (mask != c)
            n["seeded"] += int(np.count_nonzero(on & seeded))
            n["decided"] += int(np.count_nonzero(on & ~seeded))
            n["seeded_wrong"] += int(np.count_nonzero(wrong & seeded))
            n["decided_wrong"] += int(np.count_nonzero(wrong & ~seeded))
        labelled, wrong = n["seeded"] + n["decided"], n["seeded_wrong"] + n["decided_wrong"]
        print(f"{name:10s} {labelled:9d} {n['seeded'] / max(labelled, 1):8.2f} {wrong / max(labelled, 1):8.2f} "
              f"{n['seeded_wrong'] / max(wrong, 1):15.2f} {n['seeded_wrong'] / max(n['seeded'], 1):12.2f} "
              f"{n['decided_wrong'] / max(n['decided'], 1):14.2f}"
              + (f"  ({n['whole']} one-tag images left out)" if n["whole"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

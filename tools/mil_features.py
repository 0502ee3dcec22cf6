"""Which superpixel feature columns the superpixel MIL should learn from: the round's MIL trained
again on the run's cached features, restricted to each named set of column groups, and its
superpixel labels (the argmax over the tags of its evidence, as step 3 receives it) scored against
the masks, area-weighted. Groups: ``hand`` (the 94 colour and texture columns) and ``s8``, ``s16``,
``s32`` (the encoder's maps at those strides, as far as the run pooled them:
``features.deep_strides``). How docs/benchmarks.md#superpixel-features-without-context found that
the stride-32 map teaches the MIL the CAM's co-occurrence.

    python tools/mil_features.py RUN_DIR ROUND [--sets hand hand+s8+s16 ...] [--classes bird boat]
    python tools/mil_features.py RUN_DIR ROUND --sets hand+s8+s16 --min-shares 0.15 0   # the MIL's least share
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from wsseg.tasks.common.metrics import iou_from_confusion  # noqa: E402
from wsseg.tasks.config import FeatureConfig, WSSSConfig  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402
from wsseg.tasks.wsss import superpixels as spx  # noqa: E402
from wsseg.tasks.wsss.deep_features import deep_feature_dim  # noqa: E402
from wsseg.tasks.wsss.feature_cache import load_superpixel_features  # noqa: E402
from wsseg.tasks.wsss.features import FEATURE_NAMES  # noqa: E402
from wsseg.tasks.wsss.mil import hard_targets, refine  # noqa: E402
from wsseg.tasks.wsss.proposal_classifier import evidence  # noqa: E402

#: what a run recorded before ``features.deep_strides`` existed pooled all three
OLDER_STRIDES = (8, 16, 32)


def column_groups(channels: dict[int, int], strides: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Column indices of each group in a cached superpixel feature row: the hand-made columns
    first, then the encoder's, stride by stride in ``strides`` order (``channels``: stride ->
    channel count)."""
    groups, start = {"hand": np.arange(len(FEATURE_NAMES))}, len(FEATURE_NAMES)
    for s in strides:
        groups[f"s{s}"] = np.arange(start, start + channels[s])
        start += channels[s]
    return groups


def superpixel_confusion(pred: np.ndarray, truth: np.ndarray, n: int) -> np.ndarray:
    """(n, n) confusion (rows truth, columns prediction, as :func:`tasks.common.metrics.confusion_matrix`)
    of superpixel labels ``pred`` (S,) weighted by ``truth`` (S, n + 1), each superpixel's pixel
    count per true class (last column: ignored, counted nowhere)."""
    conf = np.zeros((n, n))
    for c in range(n):
        conf[c] = np.bincount(pred, weights=truth[:, c], minlength=n)
    return conf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory whose corpus has masks")
    p.add_argument("round", type=int, help="the round whose preliminary result the MIL starts from")
    p.add_argument("--sets", nargs="+", default=None, metavar="G+G",
                   help="column sets, groups joined by + (default: every group alone and all together)")
    p.add_argument("--classes", nargs="*", default=["bird", "boat"], help="classes whose area is printed")
    p.add_argument("--split", default="train", help="split (default train)")
    p.add_argument("--min-shares", nargs="+", type=float, default=None, metavar="S",
                   help="train with each of these MIL least shares (mil.min_share) instead of the run's; each "
                        "set is run once per value (the background's IoU is printed where the corpus has one)")
    args = p.parse_args(argv)
    store = Store(args.run_dir)
    spec = store.classes()
    recorded = store.read_config()
    config = WSSSConfig.model_validate(recorded)
    fc = FeatureConfig.model_validate(recorded.get("features", {}))
    strides = tuple(recorded.get("features", {}).get("deep_strides", OLDER_STRIDES))
    if fc.deep_features == "none":
        strides = ()
    channels = {s: deep_feature_dim(fc.deep_features, (s,)) for s in strides}
    groups = column_groups(channels, strides)
    sets = args.sets or [*groups, "+".join(groups)]
    unknown = sorted({g for s in sets for g in s.split("+")} - set(groups))
    if unknown:
        print(f"{args.run_dir}: no column group {', '.join(unknown)} (it has {', '.join(groups)})", file=sys.stderr)
        return 1
    key, r, mil = store.read_summary()["feature_key"], args.round, config.mil
    x, prelim, tags, areas, truth = [], [], [], [], []
    for rec in store.manifest(args.split):
        mask = store.mask(rec.image_id)
        if mask is None:
            continue
        labels, feats, a = load_superpixel_features(store, rec, key)
        t = np.zeros((len(a), spec.n + 1))
        np.add.at(t, (labels.ravel(), np.where(mask.ravel() == 255, spec.n, mask.ravel())), 1)
        x.append(feats)
        prelim.append(spx.pool(store.prelim(r, rec.image_id, spec.n), labels, n=len(a), channel_axis=0))
        tags.append(spec.tag_vector(rec.tags))
        areas.append(a.astype(np.float64))
        truth.append(t)

    def report(name: str, pred: list[np.ndarray], seconds: float) -> None:
        conf = sum(superpixel_confusion(q, t, spec.n) for q, t in zip(pred, truth))
        iou, miou = iou_from_confusion(conf)
        ratio = conf.sum(0) / np.maximum(conf.sum(1), 1)
        shown = "  ".join(f"{c} {iou[spec.index(c)]:.3f} x{ratio[spec.index(c)]:.2f}"
                          for c in args.classes + ([spec.names[spec.background]] if spec.background is not None else [])
                          if c in spec.names)
        print(f"{name:22s} {miou:.4f}  {shown}  {seconds:.0f}s", flush=True)

    print(f"{len(x)} images, round {r}; superpixel mIoU (area-weighted), then IoU and labelled / true area")
    report("preliminary result", [hard_targets(q, t).argmax(1) for q, t in zip(prelim, tags)], 0)
    for name in sets:
        cols = np.concatenate([groups[g] for g in name.split("+")])
        for share in args.min_shares or [mil.min_share]:
            start = time.time()
            res = refine([f[:, cols] for f in x], prelim, tags, areas, iterations=mil.iterations,
                         prior_weight=mil.prior_weight, hidden=mil.hidden, min_share=share,
                         negatives=mil.negatives_in(r), epochs=mil.epochs, lr=mil.lr, seed=config.seed + r)
            pred = [hard_targets(evidence(res.model, f[:, cols], q, t, mil.prior_weight), t).argmax(1)
                    for f, q, t in zip(x, prelim, tags)]
            report(name if args.min_shares is None else f"{name} min_share {share:g}", pred, time.time() - start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CAM mIoU of a finished run's image classifier on a split with masks, for several shares of each
class map's image mean subtracted before the argmax over the tags (``classifier.cam_centring``)
and the image scales given, with each class's labelled area over its true area for a few classes
(how docs/benchmarks.md#defaults-and-why chose ``classifier.cam_centring``).

    python tools/cam_centring.py RUN_DIR [--centring 0 0.5 1] [--scales 1.5] [--split train]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from wsseg.tasks.common import training as tr  # noqa: E402
from wsseg.tasks.common.metrics import confusion_matrix  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402
from wsseg.tasks.wsss.pipeline import cam_to_prob_centered  # noqa: E402
from tools.label_areas import area_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory with a trained image classifier and masks")
    p.add_argument("--centring", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="shares of each class map's image mean to subtract (default 0 0.25 0.5 0.75 1)")
    p.add_argument("--scales", type=float, nargs="+", default=[1.5], help="CAM image scales (default 1.5)")
    p.add_argument("--split", default="train", help="split measured (default train)")
    p.add_argument("--show", nargs="+", default=["bird", "boat", "water", "chair", "body"], metavar="CLASS",
                   help="classes whose IoU and area ratio are printed (default bird boat water chair body)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    store = Store(args.run_dir)
    classes = store.classes()
    k, names = classes.n, classes.names
    model, state = store.read_model("classifier")
    objects = state["meta"]["object_classes"]
    conf = {a: np.zeros((k, k + 1), np.int64) for a in args.centring}
    records = [r for r in store.manifest(args.split) if r.has_mask]
    for i, rec in enumerate(records, 1):
        image, mask = store.image(rec.image_id), store.mask(rec.image_id)
        maps = np.zeros((k,) + image.shape[:2], np.float32)
        maps[objects] = tr.class_activation_maps(model, image, scales=tuple(args.scales), raw=True)
        tagged = classes.tag_vector(rec.tags)
        for a in args.centring:  # the pipeline's own centring (round 0's preliminary result), argmax over the tags
            prob = cam_to_prob_centered(maps, tagged, centring=a)
            conf[a] += confusion_matrix(prob.argmax(0).astype(np.uint8), mask, k)
        if i % 50 == 0 or i == len(records):
            print(f"  {i}/{len(records)} images", file=sys.stderr, flush=True)
    shown = [c for c in args.show if c in names]
    for a in args.centring:
        iou, area = area_table(conf[a])
        detail = "  ".join(f"{c} {iou[names.index(c)]:.3f}/{area[names.index(c)]:.2f}" for c in shown)
        print(f"centring {a:4.2f}: CAM mIoU {np.nanmean(iou):.4f}  (IoU/area) {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

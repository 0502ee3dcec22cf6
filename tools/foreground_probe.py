"""Class-agnostic foreground starts for one-class corpora, scored against the masks: what the
foreground path starts from today (the boundary-connectivity saliency) beside two starts from
the ImageNet-pretrained encoder, each alone and as GrabCut's start (docs/benchmarks.md#foreground-path).

* ``ddt``: co-localisation (Wei et al., "Deep descriptor transforming for image co-localization",
  IJCAI 2017): what every image of the corpus shares is the object. The run's cached superpixel
  features of the encoder (:mod:`tasks.wsss.deep_features`) are centred on their corpus mean and
  projected on their first principal component; the sign that puts the image borders lower is
  the object's side.
* ``imagenet_cam``: the ImageNet head's class activation map of the image's five most probable
  ImageNet classes, weighted by their probabilities (the head names objects, so its map is
  objectness), scaled to its maximum.
* ``scda``: the sum over channels of the encoder's last activations (Wei et al., "Selective
  convolutional descriptor aggregation", TIP 2017), 0.5 at the image's mean.
* ``saliency+scda``, ``saliency+ddt``: the mean of the saliency and each of those two.

Reads a run directory that ``wsseg bench quality`` (or ``wsseg train`` on a corpus with masks)
filled: its images, masks and feature cache. Prints the object IoU over all pixels of each start
(thresholded at 0.5, and as the start of :func:`tasks.wsss.foreground.evidence_grabcut`), box
GrabCut for reference, and writes them to ``--out`` as JSON::

    python tools/foreground_probe.py runs/objects-run --limit 50 --out runs/objects-probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wsseg.models import efficientnet_lite as el  # noqa: E402
from wsseg.tasks.config import WSSSConfig  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402
from wsseg.tasks.store.checkpoints import imagenet_weights  # noqa: E402
from wsseg.tasks.wsss import foreground as fg  # noqa: E402
from wsseg.tasks.wsss.feature_cache import feature_key, load_features  # noqa: E402


def ddt_direction(feats: list[np.ndarray], areas: list[np.ndarray], borders: list[np.ndarray]):
    """Corpus mean and first principal component (area-weighted) of the superpixel features,
    the component's sign chosen so that border superpixels project lower than the image mean."""
    x = np.concatenate(feats).astype(np.float64)
    w = np.concatenate(areas).astype(np.float64)
    mu = (x * w[:, None]).sum(0) / w.sum()
    xc = x - mu
    cov = (xc * w[:, None]).T @ xc / w.sum()
    val, vec = np.linalg.eigh(cov)
    v = vec[:, -1]
    lift = np.mean([((f - mu) @ v)[b].mean() - ((f - mu) @ v).mean() for f, b in zip(feats, borders)])
    return mu, (-v if lift > 0 else v), float(np.sqrt(max(val[-1], 1e-12)))


@torch.no_grad()
def imagenet_maps(net: el.EfficientNetLite, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H, W) ImageNet-head CAM of the five most probable classes in [0, 1], and the SCDA map
    scaled to 0.5 at its mean, clipped to [0, 1]."""
    x = el.preprocess(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float())
    head = net.act(net._bn1(net._conv_head(net.forward_features(x)[-1])))
    logits = torch.einsum("bchw,kc->bkhw", head, net._fc.weight) + net._fc.bias[None, :, None, None]
    top = torch.topk(torch.softmax(logits.mean((2, 3)), 1)[0], 5)
    sel = logits[0, top.indices]
    cam = (F.relu(sel - sel.mean((1, 2), keepdim=True)) * top.values[:, None, None]).sum(0)
    scda = head[0].sum(0)
    up = lambda m: F.interpolate(m[None, None], size=image.shape[:2], mode="bilinear",  # noqa: E731
                                 align_corners=False)[0, 0].numpy()
    cam, scda = up(cam), up(scda)
    return cam / max(float(cam.max()), 1e-9), np.clip(scda / (2 * max(float(scda.mean()), 1e-9)), 0, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory with a one-class corpus, its masks and its feature cache")
    ap.add_argument("--split", default="train", help="the split scored (default train)")
    ap.add_argument("--limit", type=int, default=0, help="score the first N masked images only (0: all)")
    ap.add_argument("--out", help="JSON file for the figures")
    a = ap.parse_args(argv)
    store = Store(a.run_dir)
    config = WSSSConfig.model_validate(store.read_config() or {})
    if config.features.deep_features == "none":
        raise SystemExit(f"{a.run_dir}: its features have no encoder columns (features.deep_features=none)")
    key, bg = feature_key(config.features), store.classes().background
    if bg is None:
        raise SystemExit(f"{a.run_dir}: the corpus has no implicit background; the probe scores one-class corpora")
    recs = [r for r in store.manifest(a.split) if store.mask(r.image_id) is not None]
    recs = recs[:a.limit] if a.limit else recs
    deep = el.EfficientNetLite(config.features.deep_features, 1000, 3, 16)
    el.load_pretrained(deep, imagenet_weights(config.features.deep_features)).eval()
    width = sum(deep.out_channels[i] for i in (2, 3, 4))
    t0 = time.perf_counter()
    feats = [load_features(store, r, key) for r in recs]
    mu, v, scale = ddt_direction([f.sp_features[:, -width:] for f in feats], [f.sp_areas for f in feats],
                                 [np.unique(np.concatenate([f.superpixels[0], f.superpixels[-1], f.superpixels[:, 0],
                                                            f.superpixels[:, -1]])) for f in feats])
    counts: dict[str, np.ndarray] = {}

    def score(name: str, pred: np.ndarray, mask: np.ndarray) -> None:
        valid, truth = mask != 255, (mask != bg) & (mask != 255)
        pred = pred & valid
        counts[name] = counts.get(name, np.zeros(2)) + [(pred & truth).sum(), (pred | truth).sum()]

    for i, (rec, f) in enumerate(zip(recs, feats)):
        image, mask, sp = store.image(rec.image_id), store.mask(rec.image_id), f.superpixels
        area = np.maximum(np.bincount(sp.ravel(), minlength=len(f.sp_areas)), 1)
        sp_mean = lambda m: (np.bincount(sp.ravel(), weights=m.ravel(), minlength=len(area)) / area)[sp]  # noqa: E731
        starts = {"saliency": fg.boundary_saliency(image, sp)[sp],
                  "ddt": (1 / (1 + np.exp(-2 * ((f.sp_features[:, -width:] - mu) @ v) / scale)))[sp]}
        cam, scda = imagenet_maps(deep, image)
        starts["imagenet_cam"], starts["scda"] = sp_mean(cam), sp_mean(scda)
        starts["saliency+scda"] = (starts["saliency"] + starts["scda"]) / 2
        starts["saliency+ddt"] = (starts["saliency"] + starts["ddt"]) / 2
        for name, prob in starts.items():
            score(f"{name} > 0.5", prob > 0.5, mask)
            score(f"GrabCut from {name}", fg.evidence_grabcut(image, prob), mask)
        score("box GrabCut", fg.box_grabcut(image), mask)
        print(f"\r  {i + 1}/{len(recs)} images  {time.perf_counter() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    result = {name: round(float(c[0] / max(c[1], 1)), 4) for name, c in counts.items()}
    print(f"object IoU on {len(recs)} images of {a.run_dir} ({a.split}):")
    for name, iou in result.items():
        print(f"  {name:32s} {iou:.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"run_dir": str(a.run_dir), "split": a.split, "images": len(recs),
                                           "object_iou": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

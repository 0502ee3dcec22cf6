"""METHOD.md A, step 4: the multi-label image classifier on the tags, whose class activation
maps are round 0's preliminary result (and whose encoder starts the segmenters, and whose class
probabilities gate the segmenter on untagged images)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from wsseg.tasks.common import training as tr
from wsseg.tasks.config import ClassifierConfig, Scope, options_with, settings_changed
from wsseg.tasks.corpus.resume import what_changed
from wsseg.tasks.runtime.progress import Progress
from wsseg.tasks.store import ClassSpec, ImageRecord, Store, build_network


def object_classes(classes: ClassSpec) -> list[int]:
    """Indices of the classes a tag can name (every class but the implicit background)."""
    return [i for i in range(classes.n) if i != classes.background]


def tag_target(record: ImageRecord, classes: ClassSpec) -> np.ndarray:
    """(C,) float32 0/1 tags of one image over :func:`object_classes`."""
    obj = object_classes(classes)
    target = np.zeros(len(obj), np.float32)
    for t in record.tags:
        target[obj.index(classes.index(t))] = 1.0
    return target


def tag_targets(records: list[ImageRecord], classes: ClassSpec) -> np.ndarray:
    """(N, C) float32 0/1 tag matrix over :func:`object_classes`."""
    return np.stack([tag_target(r, classes) for r in records]) if records else \
        np.zeros((0, len(object_classes(classes))), np.float32)


class TagLoader:
    """(image, None, tag vector) of corpus images, read one at a time (nothing per image is held
    but its record); picklable for DataLoader workers."""

    def __init__(self, store: Store, records: list[ImageRecord], classes: ClassSpec):
        self.root, self.records, self.classes = str(store.root), records, classes

    def __call__(self, i: int):
        rec = self.records[i]
        return Store(self.root).image(rec.image_id), None, tag_target(rec, self.classes)


def classifier_builder(cfg: ClassifierConfig) -> tuple[str, dict]:
    """Registry name and builder options of the image classifier ``cfg`` asks for: the
    EfficientNet-Lite classifier with ImageNet weights (``encoder`` lite0/1/2), or the small one
    trained from scratch (``encoder`` small)."""
    if cfg.encoder == "small":
        return "image_classifier", {"width": cfg.width, "stride": cfg.stride}
    return "lite_classifier", {"variant": cfg.encoder, "stride": cfg.stride}


def classifier_changes(meta: dict, cfg: ClassifierConfig, inputs: dict | None) -> list[str]:
    """What differs between a trained classifier's checkpoint metadata ``meta`` and the settings
    ``cfg`` and ``inputs`` (:func:`tasks.corpus.resume.classifier_inputs`) of now, one phrase each;
    empty when it is kept. How its maps are read (scope CAM_READING of :data:`tasks.config.OPTIONS`)
    is not how it was trained: those settings keep it."""
    wanted = cfg.model_dump(mode="json")
    reading = options_with(Scope.CAM_READING, under="classifier")
    return ((["its settings"] if settings_changed(meta.get("config", wanted), cfg, "classifier", reading)
             else []) + (what_changed(meta.get("inputs"), inputs) if inputs is not None else []))


def train_image_classifier(store: Store, records: list[ImageRecord], cfg: ClassifierConfig, *, seed: int,
                           device: str = "auto", log: Callable[[dict, int], None] | None = None,
                           inputs: dict | None = None) -> float:
    """Train the image classifier on the tags of ``records`` and save it as the run's
    ``classifier`` checkpoint; returns the seconds its training took (read back from the
    checkpoint when one trained with the same settings already exists; one trained with other
    settings is trained again). ``inputs`` (:func:`tasks.corpus.resume.classifier_inputs`: class list,
    corpus hash, seed) are recorded in the checkpoint; one trained from other inputs, or from
    unrecorded ones, is trained again, and the terminal says what changed."""
    classes = store.classes()
    obj = object_classes(classes)
    wanted = cfg.model_dump(mode="json")
    state = store.train_state("classifier")
    saved = store.usable_checkpoint("classifier")  # read once: its metadata says how it was trained
    if saved is not None:
        meta = saved.get("meta", {})
        changed = classifier_changes(meta, cfg, inputs)
        if not changed:
            return meta.get("seconds", 0.0)
        Progress("classifier", 1).message(f"{store.checkpoint_path('classifier')}: {'; '.join(changed)} "
                                          "changed since it was trained: training again")
        state.clear()
    t0 = time.perf_counter()
    tr.seed_everything(seed)  # the initial weights too: torch's own start-up seed differs per process
    builder, options = classifier_builder(cfg)
    model = build_network(builder, len(obj), in_channels=3, **options)
    ds = tr.StoreDataset(len(records), TagLoader(store, records, classes),
                         tr.Augment(crop=cfg.size, scale=tuple(cfg.scale)), seed=seed, with_edge=False)
    tcfg = tr.TrainConfig(epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=seed, device=device,
                          max_seconds=cfg.max_seconds, patience=cfg.epochs, num_workers=1)
    prog = Progress("classifier", cfg.epochs, "epochs")
    result = tr.fit(model, ds, tr.multilabel_loss, tcfg, checkpoint=state,
                    resume_key={"config": {k: v for k, v in wanted.items()
                                           if k not in options_with(Scope.CAM_READING, under="classifier")},
                                "inputs": inputs, "classes": list(classes.names)},
                    log=(lambda m, step: log({f"classifier_{k}": v for k, v in m.items()}, step)) if log else None,
                    progress=lambda s: prog.advance(1, s.split(" ", 2)[-1]))
    seconds = time.perf_counter() - t0
    store.write_model("classifier", model, builder=builder, num_classes=len(obj), in_channels=3,
                      options=options,
                      meta={"object_classes": obj, "epochs_run": result.epochs_run, "config": wanted,
                            "seconds": seconds, **({"inputs": inputs} if inputs is not None else {})})
    return seconds

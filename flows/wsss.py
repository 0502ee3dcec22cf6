"""Prefect flows of method A: ``ingest``, ``refresh_round``, ``train_wsss`` and ``evaluate``.

Shard tasks (a few dozen images each) run on Dask workers and loop a per-image function of
``tasks.pipeline`` over their images; training tasks run in the flow's own process with all its
threads (and the GPU, when there is one). Every output goes through the store, so a stopped run
resumes where it stopped: finished shards, rounds and epochs are not recomputed.

Import this module only after :func:`flows.runtime.prepare` has set the environment.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect_dask import DaskTaskRunner

import models
from models.small import load_encoder_from
from flows.config import WSSSConfig
from flows.runtime import Progress
from tasks import ingest as ing
from tasks import mil
from tasks import pipeline as pl
from tasks import training as tr
from tasks.metrics import iou_from_confusion
from flows.report import overlay_grid
from tasks.proposal_classifier import (combine_evidence, predict_proposals, proposal_targets, superpixel_scores,
                                       train_proposal_classifier)
from tasks.store import ClassSpec, ImageRecord, Store
from tasks import superpixels as spx
from tasks.tracking import Tracker

# Resumability comes from the store's shard markers and content-addressed caches, which survive
# processes and Prefect databases; Prefect's own result cache would duplicate that, so it is off.
SHARD_TASK = dict(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)


def _worker_setup() -> None:
    torch.set_num_threads(1)


def shards_of(records: list[ImageRecord], size: int) -> list[list[str]]:
    ids = [r.image_id for r in records]
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def runner(address: str) -> DaskTaskRunner:
    return DaskTaskRunner(address=address)


def run_shards(task_fn, shards: list[list[str]], stage: str, **kwargs) -> list[Any]:
    """Submit one task per shard and collect results as they finish, with terminal progress
    and a Prefect progress artifact."""
    total = sum(len(s) for s in shards)
    prog = Progress(stage, total)
    art = create_progress_artifact(0.0, description=f"{stage}: shards done")
    futures = {task_fn.submit(ids=ids, **kwargs): len(ids) for ids in shards}
    out = []
    for fut in as_completed(list(futures)):
        res = fut.result()
        out.append(res)
        prog.advance(futures[fut])
        update_progress_artifact(art, 100.0 * prog.done / max(total, 1))
    return out


# ============================================================================ ingest
ingest_shard = task(name="ingest-shard", **SHARD_TASK)(pl.ingest_shard)


@flow(name="ingest")
def ingest(source: str, run_dir: str, shard_size: int = 32, skip_invalid: bool = False,
           background: str | None = "auto") -> dict:
    """Step 0: a source dataset -> corpus store (Zarr images, Parquet manifest).

    Every problem (missing or unreadable file, unknown tag) is reported with its file; the
    manifest is written only when there is none, unless ``skip_invalid`` drops those images.
    """
    items, classes = ing.read_source(source, background=background)
    if not items:
        raise ing.IngestError([f"{source}: no images listed"])
    by_id = {it.image_id: dict(image_path=str(it.image_path), mask_path=str(it.mask_path) if it.mask_path else None,
                               tags=list(it.tags), split=it.split) for it in items}
    ids = list(by_id)
    shards = [ids[i:i + shard_size] for i in range(0, len(ids), shard_size)]
    results = run_shards(ingest_shard, shards, "ingest", run_dir=run_dir, items=by_id)
    problems = [p for r in results for p in r["problems"]]
    if problems and not skip_invalid:
        raise ing.IngestError(problems + ["(nothing was added to the corpus; fix these or pass --skip-invalid)"])
    order = {iid: i for i, iid in enumerate(ids)}
    recs = sorted((ImageRecord(**(r | {"tags": tuple(r["tags"])})) for res in results for r in res["records"]),
                  key=lambda r: order[r.image_id])
    Store(run_dir).write_corpus(recs, classes)
    splits: dict[str, int] = {}
    for r in recs:
        splits[r.split] = splits.get(r.split, 0) + 1
    summary = {"images": len(recs), "skipped": len(problems), "classes": len(classes.names),
               "implicit_background": classes.names[classes.background] if classes.background is not None else None,
               "splits": splits}
    create_markdown_artifact(key="corpus", markdown=_md_table([summary]), description="corpus summary")
    return summary


# ============================================================================ features (step 2, B)
features_shard = task(name="features-shard", **SHARD_TASK)(pl.features_shard)


def compute_all_features(run_dir: str, records: list[ImageRecord], cfg: WSSSConfig) -> str:
    fcfg = cfg.features.model_dump()
    key = pl.feature_key(fcfg)
    store = Store(run_dir)
    todo = [r for r in records if not store.has_cached(pl.FEATURE_STAGE, key, r.sha256)]
    if todo:
        run_shards(features_shard, shards_of(todo, cfg.shard_size), "features", run_dir=run_dir, fcfg=fcfg, key=key)
    else:
        Progress("features", len(records)).message(f"all {len(records)} images cached ({key})")
    return key


# ============================================================================ image classifier (step 4)
class TagLoader:
    """(image, None, tag vector) of corpus images; picklable for DataLoader workers."""

    def __init__(self, run_dir: str, ids: list[str], targets: np.ndarray):
        self.run_dir, self.ids, self.targets = run_dir, ids, targets

    def __call__(self, i: int):
        return Store(self.run_dir).image(self.ids[i]), None, self.targets[i]


class LabelLoader:
    """(image, edge map, label map) with labels from a round's pseudo-labels or the masks."""

    def __init__(self, run_dir: str, records: list[ImageRecord], feature_key: str, round_index: int | None):
        self.run_dir, self.records, self.key, self.round = run_dir, records, feature_key, round_index

    def label(self, i: int, store: Store | None = None) -> np.ndarray:
        store = store or Store(self.run_dir)
        rec = self.records[i]
        return store.mask(rec.image_id) if self.round is None else store.pseudo(self.round, rec.image_id)

    def class_counts(self, n_classes: int) -> np.ndarray:
        """(n_classes,) labelled pixels of each class over all records (ignore excluded)."""
        store = Store(self.run_dir)
        counts = np.zeros(n_classes)
        for i in range(len(self.records)):
            lab = self.label(i, store)
            counts += np.bincount(lab[lab != tr.IGNORE].ravel(), minlength=n_classes)[:n_classes]
        return counts

    def __call__(self, i: int):
        store = Store(self.run_dir)
        rec = self.records[i]
        return store.image(rec.image_id), pl.load_edges(store, rec, self.key), self.label(i, store)


def object_classes(classes: ClassSpec) -> list[int]:
    return [i for i in range(classes.n) if i != classes.background]


def train_image_classifier(run_dir: str, records: list[ImageRecord], cfg: WSSSConfig,
                           tracker: Tracker | None) -> tuple[Path, float]:
    """Multi-label classifier on the tags, written to RUN/classifier.pt; returns it and the
    seconds its training took (read back from the checkpoint when it already exists)."""
    from models.small import image_classifier

    store = Store(run_dir)
    classes = store.classes()
    obj = object_classes(classes)
    out = store.root / "classifier.pt"
    wanted = cfg.classifier.model_dump(mode="json")
    if out.exists():
        meta = models.load_checkpoint(out)[1]["meta"]
        if meta.get("config", wanted) == wanted:
            return out, meta.get("seconds", 0.0)
        Progress("classifier", 1).message(f"{out} was trained with other settings: training again")
        (store.root / "train_state" / "classifier.pt").unlink(missing_ok=True)
    t0 = time.perf_counter()
    targets = np.zeros((len(records), len(obj)), np.float32)
    for i, r in enumerate(records):
        for t in r.tags:
            targets[i, obj.index(classes.index(t))] = 1.0
    c = cfg.classifier
    tr.seed_everything(cfg.seed)  # the initial weights too: torch's own start-up seed differs per process
    model = image_classifier(len(obj), 3, width=c.width, stride=c.stride)
    ds = tr.StoreDataset(len(records), TagLoader(run_dir, [r.image_id for r in records], targets),
                         tr.Augment(crop=c.size, scale=tuple(c.scale)), seed=cfg.seed, with_edge=False)
    tcfg = tr.TrainConfig(epochs=c.epochs, batch_size=c.batch_size, lr=c.lr, seed=cfg.seed, device=cfg.device,
                          max_seconds=c.max_seconds, patience=c.epochs, num_workers=1)
    prog = Progress("classifier", c.epochs, "epochs")
    log = (lambda m, step: tracker.log_metrics({f"classifier_{k}": v for k, v in m.items()}, step)) if tracker else None
    result = tr.fit(model, ds, tr.multilabel_loss, tcfg, checkpoint=store.root / "train_state" / "classifier.pt",
                    log=log, progress=lambda s: prog.advance(1, s.split(" ", 2)[-1]))
    models.save_checkpoint(out, model, builder_ref="models.small:image_classifier", num_classes=len(obj),
                           in_channels=3, options={"width": c.width, "stride": c.stride},
                           meta={"object_classes": obj, "epochs_run": result.epochs_run, "config": wanted,
                                 "seconds": time.perf_counter() - t0})
    return out, time.perf_counter() - t0


# ============================================================================ round steps
preliminary_shard = task(name="preliminary-shard", **SHARD_TASK)(pl.preliminary_shard)


def train_round_mil(run_dir: str, r: int, records: list[ImageRecord], key: str, cfg: WSSSConfig,
                    tracker: Tracker | None) -> Path | None:
    """Superpixel MIL classifier of round r (tasks/mil.py), trained on the whole corpus; None when off."""
    m = cfg.mil
    if m.iterations == 0:
        return None
    store = Store(run_dir)
    out = store.round_dir(r) / "mil.pt"
    if out.exists():
        return out
    classes = store.classes()
    feats, prelims, tags, areas = [], [], [], []
    prog = Progress(f"r{r} superpixel MIL", m.iterations, "iterations")
    for rec in records:
        f = pl.load_features(store, rec, key)
        feats.append(f.sp_features)
        prelims.append(spx.pool(store.prelim(r, rec.image_id, classes.n), f.superpixels, n=len(f.sp_areas),
                                channel_axis=0))
        tags.append(classes.tag_vector(rec.tags))
        areas.append(f.sp_areas)

    def report(i: int, changed: float, loss: float) -> None:
        prog.advance(1, f"labels changed {changed:.3f}, loss {loss:.3f}")
        if tracker is not None:
            tracker.log_metrics({"mil_changed_share": changed, "mil_loss": loss}, step=i)

    res = mil.refine(feats, prelims, tags, areas, iterations=m.iterations, prior_weight=m.prior_weight,
                     hidden=m.hidden, min_share=m.min_share, negatives=m.negatives_in(r), epochs=m.epochs, lr=m.lr,
                     seed=cfg.seed + r, progress=report)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": res.model, "changed": res.changed, "losses": res.losses}, out)
    return out


def train_round_proposal_classifier(run_dir: str, r: int, records: list[ImageRecord], key: str,
                                    cfg: WSSSConfig, mil_path: Path | None = None) -> Path:
    """Step 3: the proposal classifier of round r, trained on the whole corpus; its targets come
    from the preliminary result, refined by the round's MIL classifier when there is one."""
    store = Store(run_dir)
    out = store.round_dir(r) / "proposal_classifier.pt"
    if out.exists():
        return out
    classes = store.classes()
    mil_model = pl.load_mil(mil_path)
    feats, targets, tags, sp_probs, feat_objs = [], [], [], [], []
    prog = Progress("proposal-classifier", len(records))
    for i, rec in enumerate(records):
        f = pl.load_features(store, rec, key)
        allowed = classes.tag_vector(rec.tags)
        sp_prob = pl.sp_evidence(f, store.prelim(r, rec.image_id, classes.n), allowed, mil_model,
                                 cfg.mil.prior_weight)
        feats.append(pl.proposal_inputs(f))
        targets.append(proposal_targets(f.membership, sp_prob, f.sp_areas, allowed,
                                        sharpen=cfg.proposals.target_sharpen))
        tags.append(allowed)
        sp_probs.append(sp_prob)
        feat_objs.append(f)
        if (i + 1) % max(1, len(records) // 4) == 0:
            prog.advance(max(1, len(records) // 4), "features gathered")
    p = cfg.proposals
    model, losses = train_proposal_classifier(feats, targets, tags, hidden=p.hidden, epochs=p.epochs, lr=p.lr,
                                              seed=cfg.seed + r, negatives=p.negatives)
    for it in range(p.mil_iterations):
        # multiple-instance refinement: targets from the mixture of the preliminary result and
        # the classifier's own multi-scale superpixel scores, then retrain
        targets = []
        for rec, x, allowed, sp_prob, f in zip(records, feats, tags, sp_probs, feat_objs):
            sp_clf = superpixel_scores(predict_proposals(model, x, allowed), f.membership)
            mixed = combine_evidence(sp_prob, sp_clf, allowed, weight=p.evidence_weight)
            targets.append(proposal_targets(f.membership, mixed, f.sp_areas, allowed, sharpen=p.target_sharpen))
        model, losses = train_proposal_classifier(feats, targets, tags, hidden=p.hidden, epochs=p.epochs, lr=p.lr,
                                                  seed=cfg.seed + r + 1000 * (it + 1), negatives=p.negatives)
    prog.message(f"trained on {sum(len(f) for f in feats)} proposals, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "losses": losses}, out)
    return out


pseudo_shard = task(name="pseudo-label-shard", **SHARD_TASK)(pl.pseudo_shard)


def train_round_segmenter(run_dir: str, r: int, records: list[ImageRecord], key: str, cfg: WSSSConfig,
                          tracker: Tracker | None, *, label_round: int | None = None,
                          out: Path | None = None, init: Path | None = None) -> tuple[Path, tr.TrainResult | None]:
    """Step 8: train the segmentation model on round r's pseudo-labels (or on the masks when
    ``label_round`` is None and ``out`` is given: the supervised reference)."""
    store = Store(run_dir)
    classes = store.classes()
    s = cfg.segmentation
    out = out or store.round_dir(r) / "model.pt"
    if out.exists():
        return out, None
    in_ch = 4 if s.use_edges else 3
    build_options = dict(s.options)
    if s.backbone_weights:
        build_options["pretrained"] = dict(s.backbone_weights)
    tr.seed_everything(cfg.seed + r)  # initial weights reproducible, as fit's own seeding is
    model = models.build_model(s.model, classes.n, in_channels=in_ch, **build_options)
    start = "random weights"
    if init is not None and init.exists() and s.finetune:
        prev, _ = models.load_checkpoint(init)
        model.load_state_dict(prev.state_dict())
        start = f"fine-tuning {init.parent.name}/{init.name}"
    elif s.encoder_init == "classifier" and (store.root / "classifier.pt").exists():
        clf, _ = models.load_checkpoint(store.root / "classifier.pt")
        if load_encoder_from(model, clf):
            start = "the image classifier's encoder"
    labels = LabelLoader(run_dir, records, key, label_round)
    if getattr(model, "needs_global_context", False):
        # global-local: crops of the network's patch size, each with its whole image's coarse view and box
        ds = tr.ContextDataset(len(records), labels, tr.Augment(crop=model.patch_size), seed=cfg.seed + r,
                               with_edge=s.use_edges)
    else:
        ds = tr.StoreDataset(len(records), labels, tr.Augment(crop=s.crop), seed=cfg.seed + r,
                             with_edge=s.use_edges)
    epochs = max(s.epochs, -(-s.min_steps // max(1, len(records) // s.batch_size)))
    tcfg = tr.TrainConfig(epochs=epochs, batch_size=s.batch_size, lr=s.lr, crop=s.crop, seed=cfg.seed + r,
                          device=cfg.device, max_seconds=s.max_seconds, patience=s.patience,
                          num_workers=s.num_workers)
    prog = Progress(f"segmenter r{r}" if label_round is not None else "supervised", epochs, "epochs")
    log = (lambda m, step: tracker.log_metrics({f"seg_{k}": v for k, v in m.items()}, step)) if tracker else None
    state_path = out.with_name(f"{out.stem}.train_state.pt")
    weights = tr.balanced_class_weights(labels.class_counts(classes.n), s.class_balance) if s.class_balance else None
    result = tr.fit(model, ds, tr.segmentation_loss(weights), tcfg, checkpoint=state_path, log=log,
                    progress=lambda msg: prog.advance(1, msg.split(" ", 2)[-1]))
    models.save_checkpoint(out, model, builder_ref=s.model, num_classes=classes.n, in_channels=in_ch,
                           options=dict(s.options),  # weights are in the checkpoint: no `pretrained`
                           meta={"classes": list(classes.names), "round": r, "epochs_run": result.epochs_run,
                                 "stopped": result.stopped, "feature_key": key, "start": start,
                                 # a checkpoint copied away from its run still knows its edge channel
                                 **({"edges": {"sigma": cfg.features.edge_sigma, "tau": cfg.features.edge_tau}}
                                    if in_ch == 4 else {})})
    prog.message(f"start: {start}; stopped after {result.epochs_run} epochs ({result.stopped}), "
                 f"{result.images_per_second:.1f} img/s, data wait {100 * result.data_wait_share:.0f}%")
    return out, result


def converged_at(config: WSSSConfig, r: int, changed_share: float) -> bool:
    """Whether the rounds stop after round ``r``: its labels changed less than ``epsilon``
    against the round before (round 0 has none to compare with)."""
    return r > 0 and changed_share < config.epsilon


def final_model_config(config: WSSSConfig, rounds: int) -> WSSSConfig:
    """``config`` for a segmenter trained from the start (``segmentation.encoder_init``) on one
    set of labels with the whole budget of ``rounds`` rounds: ``epochs`` (and ``max_seconds``)
    times ``rounds`` when the rounds fine-tune one another, as they are. The last round's model
    and the supervised reference of ``bench quality`` are trained with it, so they differ only
    in their labels."""
    seg = config.segmentation
    factor = rounds if seg.finetune else 1
    return config.model_copy(update={"segmentation": seg.model_copy(update={
        "epochs": seg.epochs * factor,
        "max_seconds": None if seg.max_seconds is None else seg.max_seconds * factor})})


# ============================================================================ evaluation
evaluate_shard = task(name="evaluate-shard", **SHARD_TASK)(pl.evaluate_shard)


def evaluate_sources(run_dir: str, records: list[ImageRecord], sources: list[list], shard_size: int,
                     stage: str = "evaluate", **kwargs) -> dict[str, dict]:
    """mIoU, per-class IoU and pixel accuracy of each label source over ``records``."""
    with_masks = [r for r in records if r.has_mask]
    if not with_masks:
        return {}
    results = run_shards(evaluate_shard, shards_of(with_masks, shard_size), stage, run_dir=run_dir,
                         sources=sources, **kwargs)
    out = {}
    names = Store(run_dir).classes().names
    for k in results[0]:
        conf = sum(np.asarray(r[k], np.int64) for r in results)
        per_class, miou = iou_from_confusion(conf)
        out[k] = {"miou": float(miou), "pixel_accuracy": float(np.trace(conf[:, :-1]) / max(conf.sum(), 1)),
                  "per_class_iou": {names[i]: (None if np.isnan(v) else float(v)) for i, v in enumerate(per_class)}}
    return out


def gate_options(run_dir: str, config: WSSSConfig) -> dict:
    """``evaluate_shard`` keywords of ``config.inference``: the run's image classifier and its
    scales when the model's output is gated, nothing otherwise (or when the run has none)."""
    path = Store(run_dir).root / "classifier.pt"
    if not config.inference.gate or not path.exists():
        return {}
    return {"classifier_path": str(path), "gate_scales": list(config.classifier.cam_scales)}


@flow(name="evaluate")
def evaluate(run_dir: str, round_index: int | None = None, split: str = "train", source: str = "pseudo",
             shard_size: int = 16) -> dict:
    """mIoU of a round's pseudo-labels (``source="pseudo"`` or ``"cam"``) or of a round's model
    on a split (``source="model"``) against the ground-truth masks."""
    store = Store(run_dir)
    rounds = sorted(int(p.name[1:]) for p in (store.root / "rounds").glob("r[0-9][0-9][0-9]"))
    if not rounds:
        raise ValueError(f"{run_dir}: no rounds yet; run `wsseg train` first")
    r = rounds[-1] if round_index is None else round_index
    records = store.manifest(split)
    if source == "model":
        key = (store.read_round(r) or {}).get("feature_key")
        cfg_path = store.root / "config.json"
        config = WSSSConfig.model_validate_json(cfg_path.read_text()) if cfg_path.exists() else WSSSConfig()
        res = evaluate_sources(run_dir, records, [["model", split]], shard_size,
                               model_path=str(store.round_dir(r) / "model.pt"), key=key,
                               **gate_options(run_dir, config))
    else:
        res = evaluate_sources(run_dir, records, [[r, source]], shard_size)
    if not res:
        raise ValueError(f"no image of split {split!r} has a ground-truth mask to evaluate against")
    value = res[f"model:{split}"] if source == "model" else next(iter(res.values()))
    if f"model_ungated:{split}" in res:  # the gate's effect, beside the gated figure
        value = {**value, "gated": True, "ungated_miou": res[f"model_ungated:{split}"]["miou"]}
    create_markdown_artifact(key="evaluation", markdown=_md_table([{"round": r, "split": split, "source": source,
                                                                   "miou": value["miou"]}]))
    return {"round": r, "split": split, "source": source, **value}


# ============================================================================ refresh round
@flow(name="refresh_round")
def refresh_round(run_dir: str, round_index: int, config: WSSSConfig, feature_key: str,
                  classifier_path: str | None = None, train_model: bool = True) -> dict:
    """One refresh round (METHOD.md A steps 1-8), reproducible from its parameters.

    ``train_model=False`` stops after the pseudo-labels (step 8 skipped): a label-only round."""
    store = Store(run_dir)
    done = store.read_round(round_index)
    if done and (not train_model or (store.round_dir(round_index) / "model.pt").exists()):
        return done  # a label-only round resumed by a full run goes on to train its model
    t0 = time.perf_counter()
    r = round_index
    records = store.manifest(config.split)
    shards = shards_of(records, config.shard_size)
    cfg = config.model_dump()
    tracker = Tracker(store.root)
    with tracker.run(f"round-{r}", nested=True, tags={"round": str(r)}) as run_id:
        tracker.log_params({"round": r, **cfg})
        # 1. preliminary result: round 0 from the image classifier's CAMs, later from model r-1
        if r == 0:
            prelim_model, kind = classifier_path, "cam"
        else:
            prelim_model, kind = str(store.round_dir(r - 1) / "model.pt"), "model"
        run_shards(preliminary_shard, shards, f"r{r} preliminary", run_dir=run_dir, round_index=r,
                   model_path=prelim_model, kind=kind, key=feature_key, cfg=cfg)
        # [ours] superpixel MIL: the preliminary result refined by a corpus-wide appearance classifier
        mil_path = train_round_mil(run_dir, r, records, feature_key, config, tracker)
        # 3. proposal classification (cross-entropy), trained on the whole corpus
        clf_path = train_round_proposal_classifier(run_dir, r, records, feature_key, config, mil_path)
        # 5.-7. IoU filtering, fusion per tagged class, 3-way clustering, seeded segmentation
        results = run_shards(pseudo_shard, shards, f"r{r} pseudo-labels", run_dir=run_dir, round_index=r,
                             clf_path=str(clf_path), key=feature_key, pcfg=cfg["proposals"], seed=config.seed,
                             mil_path=str(mil_path) if mil_path else None, mil_weight=config.mil.prior_weight)
        stats = [s for res in results for s in res["stats"]]
        pixels = sum(s["pixels"] for s in stats)
        changed = sum(s["changed"] * s["pixels"] for s in stats) / pixels
        ignored = sum(s["ignore"] * s["pixels"] for s in stats) / pixels
        # 8. correction: train the segmentation model on the pseudo-labels; the last round's
        # model (the run's final one) with the whole budget from the start, see final_model_config
        last = r == config.max_rounds - 1 or converged_at(config, r, changed)
        seg_cfg, init = config, (store.round_dir(r - 1) / "model.pt" if r > 0 else None)
        if last and config.segmentation.final_model == "full_budget":
            seg_cfg, init = final_model_config(config, r + 1), None
        model_path, result = train_round_segmenter(run_dir, r, records, feature_key, seg_cfg, tracker, label_round=r,
                                                   init=init) if train_model else (None, None)
        # measurement only: pseudo-label quality against the masks, where the corpus has them
        sources = [[r, "pseudo"]] + ([[0, "cam"]] if r == 0 else [])
        ev = evaluate_sources(run_dir, records, sources, config.shard_size, stage=f"r{r} evaluate")
        summary = {"round": r, "pseudo_label_miou": ev.get(f"{r}:pseudo", {}).get("miou"),
                   "changed_share": changed, "ignore_share": ignored,
                   "wall_seconds": time.perf_counter() - t0, "mlflow_run_id": run_id,
                   "feature_key": feature_key, "images": len(records),
                   "per_class_iou": ev.get(f"{r}:pseudo", {}).get("per_class_iou"),
                   "train_epochs": result.epochs_run if result else None,
                   "train_stopped": result.stopped if result else None}
        if r == 0 and "0:cam" in ev:
            summary["cam_miou"] = ev["0:cam"]["miou"]
            summary["cam_per_class_iou"] = ev["0:cam"]["per_class_iou"]
        tracker.log_metrics({k: summary[k] for k in ("pseudo_label_miou", "changed_share", "ignore_share",
                                                     "wall_seconds")}, step=r)
        pic = store.round_dir(r) / "overlay.png"
        overlay_grid(store, records[:6], [("pseudo-label", r, "pseudo")] + ([("CAM", 0, "cam")] if r == 0 else []),
                     pic)
        tracker.log_artifact(pic, "overlays")
        if model_path is not None:
            tracker.log_artifact(model_path, "checkpoint")
        create_markdown_artifact(key=f"round-{r}", markdown=_md_table([_row(summary)]) +
                                 f"\n\nMLflow run: `{run_id}`", description=f"refresh round {r}")
    store.write_round(r, summary)
    return summary


def _row(s: dict) -> dict:
    return {k: s.get(k) for k in ("round", "pseudo_label_miou", "changed_share", "ignore_share", "wall_seconds")}


def _md_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


# ============================================================================ the whole training
@flow(name="train_wsss")
def train_wsss(run_dir: str, config: WSSSConfig = WSSSConfig(), dask_address: str | None = None,
               final_model: bool = True) -> dict:
    """Refresh rounds until the pseudo-labels stop changing (share < epsilon) or the budget ends.

    ``final_model=False``: the last round stops after its pseudo-labels (no segmentation model is
    trained on them), for label-only runs such as the bench's ablations."""
    t0 = time.perf_counter()
    store = Store(run_dir)
    _check_config(store.root, config)
    records = store.manifest(config.split)
    if not records:
        raise ValueError(f"{run_dir}: no images in split {config.split!r}")
    tracker = Tracker(store.root)
    rows: list[dict] = []
    with tracker.run("train_wsss", tags={"flow": "train_wsss"}) as parent_id:
        tracker.log_params(config.model_dump())
        # 2. superpixels, proposals and the edge feature map, once per image and parameter set
        key = compute_all_features(run_dir, records, config)
        # 4. image classifier on the tags; its CAMs are round 0's preliminary result
        clf, cls_seconds = train_image_classifier(run_dir, records, config, tracker)
        converged = False
        for r in range(config.max_rounds):
            sub = refresh_round.with_options(task_runner=runner(dask_address)) if dask_address else refresh_round
            s = sub(run_dir, r, config, key, str(clf), final_model or r < config.max_rounds - 1)
            if r == 0:
                rows.append({"round": "cam", "pseudo_label_miou": s.get("cam_miou"), "changed_share": None,
                             "ignore_share": 0.0, "wall_seconds": cls_seconds})
            rows.append(_row(s) | {"mlflow_run_id": s["mlflow_run_id"]})
            # 9. convergence: share of pseudo-label pixels changed since the previous round
            if converged_at(config, r, s["changed_share"]):
                converged = True
                break
        final = store.round_dir(int(rows[-1]["round"])) / "model.pt"
        if final.exists():
            tracker.log_artifact(final, "final_model")
        tracker.log_metrics({"final_pseudo_label_miou": rows[-1]["pseudo_label_miou"], "rounds": len(rows) - 1})
        summary = {"run_dir": str(store.root), "rounds": rows, "converged": converged,
                   "final_model": str(final) if final.exists() else None,
                   "mlflow_parent_run_id": parent_id, "wall_seconds": time.perf_counter() - t0,
                   "feature_key": key, "images": len(records)}
        create_markdown_artifact(key="train-wsss", markdown=_md_table([{k: v for k, v in r.items()} for r in rows]) +
                                 f"\n\nMLflow parent run: `{parent_id}`", description="pseudo-label rounds")
    (store.root / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


# How many rounds to run, and how the trained model labels untagged images, change no round's
# content: a run may be taken further (or stopped earlier) on the same directory, and its
# finished rounds are reused.
NOT_IN_ROUNDS = ("max_rounds", "inference")


def _check_config(root: Path, config: WSSSConfig) -> None:
    """A run directory belongs to one configuration: resuming with another would mix them
    (the round budget and inference settings aside, which config.json then records as last asked)."""
    path = root / "config.json"
    current = config.model_dump(mode="json")
    if path.exists():
        previous = json.loads(path.read_text())
        diff = sorted(k for k in set(previous) | set(current)
                      if previous.get(k) != current.get(k) and k not in NOT_IN_ROUNDS)
        if diff:
            raise ValueError(f"{path}: this run directory was started with a different configuration "
                             f"(differs in: {', '.join(diff)}); use a new --run-dir, or delete rounds/ and "
                             "config.json to start over")
        if previous == current:
            return
    path.write_text(json.dumps(current, indent=1))

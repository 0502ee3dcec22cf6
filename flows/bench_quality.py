"""``wsseg bench quality``: pseudo-label quality side by side with CAM and CAM + dense CRF.

One command, one Prefect flow run (:func:`bench_quality`), one Dask cluster:

1. ingest the dataset folder into the run directory and run ``train_wsss`` on the config's split
   (the method reads tags only; masks are read only by the evaluation steps below);
2. baselines on the same images: ``cam`` (round 0's CAM labels) and ``cam_crf`` (round 0's
   CAM probabilities refined by a dense CRF over the tagged classes only,
   :func:`tasks.wsss.crf.cam_crf_shard`, in shard tasks on Dask);
3. the final round's segmentation model, evaluated on ``eval_split``;
4. the same network trained on the ground-truth masks of the split with the final model's
   recipe (:func:`tasks.wsss.segmenter.final_model_config`: same start, same total epochs, same
   seed), evaluated the same way (the supervised reference); with ``model_seeds=N`` both models
   again under N - 1 further seeds (every seed's figures, the mean and range of each and of the
   ratio);
5. with ``ablate``: one variant per switched-off part of the method (:mod:`tasks.bench.ablation`),
   each in its own run directory sharing the corpus, feature cache, image classifier and round
   0's CAMs of the main run; each runs ``ablate_rounds`` label-only rounds (no model after the
   last) and reports its pseudo-label mIoU beside the main run's at the same round;
6. with ``compare``: each named network (and the configured one) trained from scratch on the
   final round's pseudo-labels and, separately, on the masks, for the same wall-time budget
   (``compare_seconds``, turned into epochs from each network's measured speed so that its
   learning-rate schedule completes), all evaluated on ``eval_split``;
7. ``FILE.json``, a markdown table ``FILE.md`` and an overlay figure ``FILE.png``
   (:func:`tasks.report.figures.write_quality_report`).

The pure parts (checks, the result dict, budgets) are :mod:`tasks.bench.quality`; the CLI's parser is
``flows.cli``'s. Import this module only after :func:`flows.runtime.prepare` has run.
"""
from __future__ import annotations

import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task

from wsseg.flows.naming import FlowRunName, ShardRunName
from wsseg.flows.runtime import by_reference, on_cluster
from wsseg.flows.wsss import (SHARD_TASK, compute_all_features, evaluate_sources, gate_options, handing, ingest,
                        run_shards, shards_of, train_wsss)
from wsseg.tasks.bench import ablation
from wsseg.tasks.bench import quality
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.corpus.encoders import with_weight_digests
from wsseg.tasks.report.figures import write_quality_report
from wsseg.tasks.store import ImageRecord, Store
from wsseg.tasks.wsss.crf import CRF_DEFAULTS, cam_crf_shard
from wsseg.tasks.wsss.pipeline import box_grabcut_shard
from wsseg.tasks.wsss.segmenter import final_model_config, train_segmenter

__all__ = ["bench_quality", "score_model", "seed_spread", "run_ablations", "compare_networks",
           "measure_train_speed"]

cam_crf_task = task(name="cam-crf-shard", task_run_name=ShardRunName("cam-crf"), **SHARD_TASK)(cam_crf_shard)
box_grabcut_task = task(name="box-grabcut-shard", task_run_name=ShardRunName("box-grabcut"), **SHARD_TASK)(box_grabcut_shard)


@by_reference
@flow(name="bench_quality", flow_run_name=FlowRunName("bench-quality"))
def bench_quality(data: str, run_dir: str, config: WSSSConfig, out: str, eval_split: str | None = "val",
                  ablate: list[str] | None = None, dask_address: str | None = None, background: str | None = "auto",
                  crf: dict | None = None, compare: list[str] | None = None, compare_seconds: float = 300.0,
                  ablate_rounds: int = 1, model_seeds: int = 1) -> dict:
    """Steps 1-7 of the module docstring on the Dask cluster at ``dask_address``; writes ``out``
    (JSON) and the ``.md`` and ``.png`` beside it, and returns the result."""
    t0, stages = time.perf_counter(), {}
    config = with_weight_digests(config)  # recorded with the result; train_wsss checks the run directory's
    data, store = str(Path(data).resolve()), Store(run_dir)
    quality.check_inputs(store, data, out, model_seeds)
    crf = {**CRF_DEFAULTS, **(crf or {})}
    # 1. corpus and the method (tags only)
    with quality.timed(stages, "ingest"):
        on_cluster(ingest, dask_address)(data, str(store.root), config.shard_size, False, background)
        records = quality.split_records(store, config.split, data)
    with quality.timed(stages, "train_wsss"):
        summary = on_cluster(train_wsss, dask_address)(str(store.root), config, dask_address)
    rounds, key = quality.method_rounds(summary), summary["feature_key"]
    # the final round's labels (tasks.wsss.stopping) and the final model: the last round run's, trained on them
    final_r, model_r = quality.final_round(summary), int(rounds[-1]["round"])
    # 2. baselines on the same images: CAM (stored by round 0), CAM + CRF and, with an implicit
    # background, GrabCut from a box inset 10% from the border
    with quality.timed(stages, "baselines"):
        run_shards(cam_crf_task, shards_of(records, config.shard_size), "cam+crf", per_shard=handing(records),
                   run_dir=str(store.root), crf=crf,
                   cam=config.classifier if summary.get("foreground") else None)
        sources = [[0, "cam"], [0, "cam_crf"], [final_r, "pseudo"]]
        if store.classes().background is not None:
            run_shards(box_grabcut_task, shards_of(records, config.shard_size), "box grabcut",
                       per_shard=handing(records), run_dir=str(store.root))
            sources.append([0, "box_grabcut"])
        labels = evaluate_sources(str(store.root), records, sources, config.shard_size, stage="evaluate pseudo-labels")
    # 3. the final model on the eval split (gated by the image classifier per config.inference;
    # the ungated figures are kept beside the gated ones)
    with quality.timed(stages, "evaluate_model"):
        gate = gate_options(store, config)
        eval_split, eval_records, warnings = quality.eval_records(store, eval_split, config.split, records)
        eval_key = compute_all_features(str(store.root), eval_records, config)
        wsss = score_model(store, eval_records, eval_split, eval_key, gate, config.shard_size,
                           "evaluate WSSS model", "segmenter", model_r)
    # 4. supervised reference: the final model's recipe (network, start, total epochs, seed:
    # round model_r's), masks instead of pseudo-labels
    with quality.timed(stages, "supervised"):
        recipe = final_model_config(config, len(rounds))
        train_segmenter(store, records, key, recipe, r=model_r, label_round=None, kind="supervised")
        supervised = score_model(store, eval_records, eval_split, eval_key, gate, config.shard_size,
                                 "evaluate supervised model", "supervised")
    res = quality.quality_result(
        data=data, store=store, config=config, records=records, eval_split=eval_split,
        eval_images=len(eval_records), summary=summary, labels=labels, wsss=wsss, supervised=supervised,
        gated=bool(gate), supervised_epochs=recipe.segmentation.epochs, crf=crf,
        final_model=str(store.checkpoint_path("segmenter", model_r)),
        supervised_model=str(store.checkpoint_path("supervised")), warnings=warnings)
    # 4b. more seeds of both models: on a small eval split the ratio moves by a few hundredths
    # with the seed alone; each further pair shares the labels, recipe and classifier
    if model_seeds > 1:
        with quality.timed(stages, "model_seeds"):
            first = {"seed": config.seed, "wsss": res["wsss_model_miou"], "supervised": res["supervised_model_miou"],
                     "wsss_ungated": wsss[1].get("miou"), "supervised_ungated": supervised[1].get("miou")}
            res["model_seeds"] = seed_spread(store, records, eval_records, key, eval_key, recipe, final_r,
                                             model_r, model_seeds, eval_split, gate, first)
    # 5. ablations, label-only, each compared with the main run's same round
    if ablate is not None:
        with quality.timed(stages, "ablations"):
            res |= run_ablations(store, config, ablate, rounds, ablate_rounds, dask_address)
    # 6. networks side by side: same pseudo-labels, same masks, same wall-time budget
    if compare:
        with quality.timed(stages, "model_comparison"):
            res["model_comparison"] = compare_networks(store, records, eval_records, key, eval_key, config,
                                                       final_r, compare, compare_seconds, eval_split)
    res["stage_seconds"], res["wall_seconds"] = stages, time.perf_counter() - t0
    # 7. FILE.json, FILE.md, FILE.png
    return write_quality_report(store, res, out)


# ============================================================================ steps
def score_model(store: Store, records: list[ImageRecord], split: str, key: str, gate: dict, shard_size: int,
                stage: str, kind: str, r: int | None = None, name: str | None = None) -> tuple[dict, dict]:
    """The checkpoint ``kind`` (``r``, ``name``: see :meth:`tasks.store.Store.checkpoint_path`)
    evaluated on ``records``: its (gated, ungated) entries of :func:`flows.wsss.evaluate_sources`
    (``miou``, ``per_class_iou``, ...; the ungated one is empty without a gate, both are empty
    where no image has a mask). An evaluation of the same inputs (:func:`evaluation_key`) recorded
    in the run directory's ``evaluations.json`` is reused instead of labelling the images again."""
    ident, inputs = f"{kind}:{r}:{name}:{split}", evaluation_key(store, records, key, gate, kind, r, name)
    done = (store.read_json(EVALUATIONS) or {}).get(ident) if inputs is not None else None
    if done is not None and done.get("inputs") == inputs:
        print(f"  [{stage}] reused: the same checkpoint, images, masks and gate as its last evaluation",
              file=sys.stderr, flush=True)
        return done["gated"], done["ungated"]
    ev = evaluate_sources(str(store.root), records, [["model", split]], shard_size, stage=stage,
                          model={"kind": kind, "r": r, "name": name}, key=key, **gate)
    out = ev.get(f"model:{split}", {}), ev.get(f"model_ungated:{split}", {})
    if inputs is not None:
        store.write_json(EVALUATIONS, {**(store.read_json(EVALUATIONS) or {}),
                                       ident: {"inputs": inputs, "gated": out[0], "ungated": out[1]}})
    return out


#: the run directory's record of model evaluations (``RUN/evaluations.json``), see :func:`score_model`
EVALUATIONS = "evaluations"


def evaluation_key(store: Store, records: list[ImageRecord], key: str, gate: dict, kind: str,
                   r: int | None = None, name: str | None = None) -> dict | None:
    """What an evaluation of checkpoint ``kind`` on ``records`` depends on: the sha256 of the
    checkpoint (and of the image classifier when it gates), the gate's scales, the corpus hash of
    the images with masks, a digest of their masks and the feature key of their edge maps; None
    on object storage (not cached there) or without the checkpoint."""
    from wsseg.tasks.store import corpus_hash, sha256_file

    path = store.checkpoint_path(kind, r, name=name)
    if store.remote or not path.is_file():
        return None
    with_masks = [rec for rec in records if rec.has_mask]
    masks = hashlib.sha256()
    for rec in with_masks:
        m = store.mask(rec.image_id)
        masks.update(f"{rec.image_id} {None if m is None else m.shape}".encode()
                     + (b"" if m is None else np.ascontiguousarray(m).tobytes()))
    return {"checkpoint": sha256_file(path), "gate": gate,
            "classifier": sha256_file(store.checkpoint_path("classifier")) if gate else None,
            "images": corpus_hash(with_masks), "masks": masks.hexdigest(), "feature_key": key}


def seed_spread(store: Store, records: list[ImageRecord], eval_records: list[ImageRecord], key: str,
                eval_key: str, recipe: WSSSConfig, final_r: int, model_r: int, n: int, eval_split: str,
                gate: dict, first: dict) -> dict:
    """The WSSS model (final round's labels) and the supervised reference (masks) trained again
    with ``recipe`` under seeds ``recipe.seed + 1 .. + n - 1`` (the ``extra`` checkpoints
    ``seedNNN-wsss`` and ``seedNNN-supervised``), evaluated like the first pair (``first``:
    seed 0's figures, already measured); :func:`tasks.bench.quality.seed_summary` of all of them.
    Each pair is trained as round ``model_r``'s, as the first pair was: a segmenter's torch seed is
    ``seed + r``, so seed 1 at round ``final_r`` = ``model_r`` - 1 was seed 0's pair again (until
    2026-12-05, where the final round was not the last)."""
    rows = [first]
    for k in range(1, n):
        cfg = recipe.model_copy(update={"seed": recipe.seed + k})
        row: dict[str, Any] = {"seed": cfg.seed}
        for what, label_round in (("wsss", final_r), ("supervised", None)):
            name = f"seed{cfg.seed:03d}-{what}"
            train_segmenter(store, records, key, cfg, r=model_r, label_round=label_round, kind="extra", name=name)
            gated, ungated = score_model(store, eval_records, eval_split, eval_key, gate, recipe.shard_size,
                                         f"evaluate seed {cfg.seed} {what}", "extra", name=name)
            row[what], row[f"{what}_ungated"] = gated.get("miou"), ungated.get("miou")
        rows.append(row)
    return quality.seed_summary(rows)


def run_ablations(store: Store, config: WSSSConfig, names: list[str], rounds: list[dict], ablate_rounds: int,
                  dask_address: str | None) -> dict:
    """The ``--ablate`` variants ``names`` (all when empty), each ``ablate_rounds`` label-only
    rounds in its own run directory, compared with the main run's pseudo-label mIoU at the
    same round: ``ablation_round``, ``ablation_reference_miou`` and ``ablations`` of the result.
    A variant that fails is reported with its error; the others still run."""
    a_rounds = max(1, min(ablate_rounds, config.max_rounds))
    ref_round = min(a_rounds - 1, int(rounds[-1]["round"]))
    reference = next(r["pseudo_label_miou"] for r in rounds if int(r["round"]) == ref_round)
    out: dict[str, Any] = {"ablation_round": ref_round, "ablation_reference_miou": reference, "ablations": {}}
    for name, v in ablation.choose_variants(config, names).items():
        entry = out["ablations"][name] = {"what": v["what"], "overrides": v["overrides"]}
        skip = ablation.skip_reason(v, a_rounds)
        if skip:
            entry["skipped"] = skip
            print(f"  [ablate {name}] skipped: {skip}", file=sys.stderr, flush=True)
            continue
        tv = time.perf_counter()
        try:
            vcfg = ablation.apply_overrides(config, {**v["overrides"], "max_rounds": a_rounds})
            vstore = store.ablation(name)
            vstore.share_from(store, parts=("corpus", "cache", "classifier"))
            if ablation.shares_round0(config, vcfg) and store.read_round(0) is not None:
                vstore.share_round_from(store, 0)  # round 0's CAMs: same classifier, shards and split
            print(f"  [ablate {name}] {v['what']} -> {vstore.root}", file=sys.stderr, flush=True)
            last = quality.method_rounds(on_cluster(train_wsss, dask_address)(
                str(vstore.root), vcfg, dask_address, final_model=False))[-1]
            m = last["pseudo_label_miou"]
            entry.update({"pseudo_label_miou": m, "final_round": int(last["round"]),
                          "delta": None if m is None or reference is None else m - reference,
                          "per_class_iou": (vstore.read_round(int(last["round"])) or {}).get("per_class_iou"),
                          "run_dir": str(vstore.root)})
        except Exception as e:  # one broken variant must not lose the others' numbers
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"  [ablate {name}] failed: {entry['error']}", file=sys.stderr, flush=True)
        entry["wall_seconds"] = time.perf_counter() - tv
    return out


def measure_train_speed(store: Store, records: list[ImageRecord], key: str, config: WSSSConfig,
                        steps: int = 4) -> float:
    """Training images per second of ``config.segmentation``'s network through the real path
    (store, augmentation, DataLoader workers, the step), measured on the second of two short
    epochs of ``steps`` batches (the first one pays for start-up), in a scratch run directory
    that shares the corpus and feature cache and is removed afterwards. A first version timed
    steps on random tensors: it saw 31 img/s where the real epochs ran at 20 (the loader's CPU
    and the store reads were missing), so budgets overran by half."""
    n = min(len(records), config.segmentation.batch_size * steps)
    with tempfile.TemporaryDirectory(dir=store.root, prefix="speed-") as tmp:
        probe = Store(tmp)
        probe.share_from(store, parts=("corpus", "cache"))
        result = train_segmenter(probe, records[:n], key, quality.speed_probe_config(config), r=0,
                                 label_round=None, kind="extra", name="probe")
    return n / max(result.history[-1]["seconds"], 1e-6)


def compare_networks(store: Store, records: list[ImageRecord], eval_records: list[ImageRecord], key: str,
                     eval_key: str, config: WSSSConfig, final_r: int, specs: list[str], seconds: float,
                     eval_split: str) -> dict[str, dict]:
    """Each network of ``specs`` (plus the configured one) trained from scratch on the final
    round's pseudo-labels and on the masks of ``records`` (the ``extra`` checkpoints
    ``compare-NN-<name>-wsss`` and ``-supervised``), for the same wall-time budget, and
    evaluated on ``eval_records``. The budget becomes whole epochs from each network's measured
    training speed, so every run completes its learning-rate schedule; ``fit``'s own time
    budget (``max_seconds``) stops a run that turns out slower than measured."""
    gate = gate_options(store, config)
    out: dict[str, dict] = {}
    for i, (tag, name, options) in enumerate(quality.compared_networks(config, specs)):
        net_cfg = quality.network_config(config, name, options)
        ips = measure_train_speed(store, records, key, net_cfg)
        epochs = quality.budget_epochs(seconds, ips, len(records))
        cfg = quality.budget_config(net_cfg, epochs, seconds)
        entry: dict[str, Any] = {"model": name, "options": options, "budget_seconds": seconds,
                                 "measured_images_per_second": ips, "epochs": epochs}
        print(f"  [compare {tag}] {ips:.2f} img/s measured -> {epochs} epochs of {len(records)} images per "
              f"{seconds:.0f}s budget", file=sys.stderr, flush=True)
        for what, label_round in (("wsss", final_r), ("supervised", None)):
            ckpt, t = f"compare-{i:02d}-{name}-{what}", time.perf_counter()
            result = train_segmenter(store, records, key, cfg, r=final_r, label_round=label_round, kind="extra",
                                     name=ckpt)
            train_s = time.perf_counter() - t
            m, _ = score_model(store, eval_records, eval_split, eval_key, gate, config.shard_size,
                               f"evaluate {tag} {what}", "extra", name=ckpt)
            entry[what] = {"miou": m.get("miou"), "per_class_iou": m.get("per_class_iou"),
                           "checkpoint": str(store.checkpoint_path("extra", name=ckpt)),
                           "train_seconds": train_s if result is not None else None,
                           "epochs_run": result.epochs_run if result is not None else None,
                           "stopped": result.stopped if result is not None else None}
        entry["wsss_over_supervised"] = quality.ratio(entry["wsss"]["miou"], entry["supervised"]["miou"])
        out[tag] = entry
    return out

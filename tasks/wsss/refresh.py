"""Incremental refresh: label the images a finished round has no pseudo-label of (new, changed
or retagged since it was computed) with that round's models, without training anything.

A refreshed image gets what the round itself would have given it: its features (superpixels,
edge map, proposals), the preliminary result of the round's network (the image classifier's
CAMs for round 0, round r-1's segmenter after that, restricted to the image's tags and mixed
with what the rounds keep of round 0: its pseudo-label, computed first where the image has none,
from its preliminary result), then the round's MIL and proposal classifiers, fusion, clustering
and seeded segmentation. Its arrays go into the round's own ``prelim`` and ``pseudo`` arrays, where
``wsseg evaluate`` and ``wsseg status`` find them; the round's models, metrics and the arrays
of every other image are left as they are.
"""
from __future__ import annotations

import time

from wsseg.tasks.config import WSSSConfig, changed_fields
from wsseg.tasks.corpus.encoders import with_weight_digests
from wsseg.tasks.corpus.resume import classes_entry, round_inputs, round_view
from wsseg.tasks.runtime.progress import run_log
from wsseg.tasks.store import ImageRecord, Store, shard_records
from wsseg.tasks.wsss.feature_cache import compute_features
from wsseg.tasks.wsss.pipeline import (_worker_setup, foreground_on, prelim_model, preliminary_image, pseudo_image,
                                      round_clusters)
from wsseg.tasks.wsss.proposal_classifier import round_mil_model


def refresh_problem(store: Store, r: int, config: WSSSConfig) -> str | None:
    """Why round ``r``'s models cannot label new images of this run directory, or None: the class
    list or the configuration changed since the round was computed (``wsseg train`` retrains)."""
    recorded = store.round_inputs(r)
    classes = store.classes()
    if recorded is not None:
        before = recorded.get("classes") or {}
        if before != classes_entry(classes):
            return (f"the class list changed since round {r} was trained ({len(before.get('names', []))} -> "
                    f"{classes.n} classes): its models cannot label the new classes; run `wsseg train` to retrain")
        # the round recorded its weight files' digests; a configuration as a user passes it has none yet
        # (and the corpus it was trained on: its size says whether the trainers learnt from a sample)
        now = round_view(round_inputs(classes, recorded.get("corpus") or {}, with_weight_digests(config)), r)["config"]
        fields = changed_fields(round_view(recorded, r)["config"], now)
        if fields:
            return (f"the configuration differs from round {r}'s (in: {', '.join(fields)}); run `wsseg train` "
                    "to compute the rounds with it")
        return None
    meta_classes = store.model_meta("segmenter", r).get("classes") if store.has_checkpoint("segmenter", r) else None
    if meta_classes is not None and list(meta_classes) != list(classes.names):
        return (f"the class list changed since round {r} was trained ({len(meta_classes)} -> {classes.n} "
                "classes): its models cannot label the new classes; run `wsseg train` to retrain")
    return None


def refresh_shard(run_dir: str, ids: list[str], round_index: int, key: str, config: WSSSConfig,
                  records: list[ImageRecord] | None = None, foreground: bool | None = None) -> dict:
    """Label the images ``ids`` with round ``round_index``'s models (see the module docstring);
    images that already have a pseudo-label in the round are skipped, so a stopped refresh
    resumes. Returns ``images``, ``labelled``, the wall seconds of each stage (``seconds``:
    ``features``, ``prelim``, ``pseudo``) and ``cpu_seconds``, the process's CPU time over the
    shard (models loaded included)."""
    c0 = time.process_time()
    _worker_setup()
    store = Store(run_dir)
    r = round_index
    recs = [rec for rec in shard_records(store, ids, records) if not store.has_pseudo(r, rec.image_id)]
    seconds = {"features": 0.0, "prelim": 0.0, "pseudo": 0.0}
    if not recs:
        return {"images": len(ids), "labelled": 0, "seconds": seconds, "cpu_seconds": time.process_time() - c0}
    classes = store.classes()
    with store.packing(store.shard_name(ids)):  # the shard's arrays as one pack a group, written at the end
        t = time.perf_counter()
        for rec in recs:  # 2. superpixels, proposals, edge map (unless cached: the same image seen before)
            compute_features(store, rec, config.features, key)
        seconds["features"] = time.perf_counter() - t
        t = time.perf_counter()
        # 1. preliminary result by the round's network; a later round that mixes in round 0
        # (prior_weight) needs round 0's pseudo-label first, and so its preliminary result, and
        # every round reads the superpixel features of round 0's CAM pass (features.deep_features)
        needs_prior = r > 0 and config.prior_weight > 0
        needs_cam = r > 0 and (needs_prior or config.features.deep_features != "none")
        cam_net = prelim_model(store, 0) if needs_cam else None
        net, state = prelim_model(store, r)
        # round 0 of a corpus whose tags carry no contrast: the class-agnostic foreground evidence
        fg_on = foreground_on(store, config)[0] if foreground is None else foreground
        foreground = (r == 0 or needs_cam) and fg_on
        clusters = round_clusters(store, config) if foreground else None  # round 0's, read once
        corrected = store.corrections().keys()
        round0 = (store.read_classifier("proposal_classifier", 0)["model"], round_mil_model(store, 0)) \
            if needs_prior else None
        for rec in recs:
            if cam_net is not None and not store.has_pseudo(0, rec.image_id, name="cam"):
                preliminary_image(store, rec, 0, *cam_net, classes, key, config, foreground, corrected, clusters)
            if round0 is not None and not store.has_pseudo(0, rec.image_id):
                pseudo_image(store, rec, 0, *round0, classes, key, config.proposals, config.seed,
                             config.mil.prior_weight, config.foreground if fg_on else None, corrected)
            preliminary_image(store, rec, r, net, state, classes, key, config, foreground and r == 0, corrected,
                              clusters)
        seconds["prelim"] = time.perf_counter() - t
        t = time.perf_counter()
        # 3., 5.-7. the round's proposal and MIL classifiers, filtering, fusion, seeded segmentation
        clf = store.read_classifier("proposal_classifier", r)["model"]
        mil_model = round_mil_model(store, r)
        for rec in recs:
            pseudo_image(store, rec, r, clf, mil_model, classes, key, config.proposals, config.seed,
                         config.mil.prior_weight, config.foreground if fg_on else None, corrected)
        seconds["pseudo"] = time.perf_counter() - t
    run_log(f"refresh with round {r}'s models: {len(recs)} images from {recs[0].image_id}, "
            f"{sum(seconds.values()):.1f} s")
    return {"images": len(ids), "labelled": len(recs), "seconds": seconds, "cpu_seconds": time.process_time() - c0}

"""Prefect flows of method A: ``ingest``, ``refresh_round``, ``train_wsss``, ``evaluate`` and
``refresh`` (new images labelled with the last round's models, nothing trained).

Wiring only. Shard tasks (a few dozen images each) run on Dask workers and loop a per-image
function of :mod:`tasks.wsss.pipeline` over their images; the corpus-wide trainers
(:mod:`tasks.wsss.classifier`, :mod:`tasks.wsss.mil`, :mod:`tasks.wsss.proposal_classifier`,
:mod:`tasks.wsss.segmenter`) run in the flow's own process with all its threads (and the GPU, when
there is one). Every output goes through the store, so a stopped run resumes where it stopped:
finished shards, rounds and epochs are not recomputed.

Import this module only after :func:`flows.runtime.prepare` has set the environment.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import time
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from wsseg.flows.naming import FlowRunName, ShardRunName
from wsseg.flows.runtime import by_reference, on_cluster
from wsseg.tasks.config import WSSSConfig, config_difference, recorded_config, shard_size_for, without_removed
from wsseg.tasks.corpus import ingest as ing
from wsseg.tasks.corpus import resume
from wsseg.tasks.corpus.encoders import with_weight_digests
from wsseg.tasks.corpus.tags import contrast_warnings
from wsseg.tasks.report.figures import overlay_grid, pick_overlay_records
from wsseg.tasks.labels.corrections import corrections_entry
from wsseg.tasks.labels.review import SIGNALS, review_table
from wsseg.tasks.runtime.progress import Progress
from wsseg.tasks.runtime.tracking import Tracker
from wsseg.tasks.store import ImageRecord, Store, sha256_file
from wsseg.tasks.store.remote import is_local
from wsseg.tasks.store.stream import InOrder, Shards, ids_of
from wsseg.tasks.wsss import mil
from wsseg.tasks.wsss import pipeline as pl
from wsseg.tasks.wsss import proposal_classifier
from wsseg.tasks.wsss import refresh as rf
from wsseg.tasks.wsss import stopping
from wsseg.tasks.wsss.classifier import train_image_classifier
from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE, feature_key
from wsseg.tasks.wsss.recompute import budget_retrains, decision_context, round_fate
from wsseg.tasks.wsss.segmenter import final_model_config, round_model_config, train_segmenter
from wsseg.tasks.wsss.summary import (coverage_of, label_shares, markdown_table, reverted_of, row, source_scores,
                                warnings_markdown)

# Resumability comes from the store's shard markers and content-addressed caches, which survive
# processes and Prefect databases; Prefect's own result cache would duplicate that, so it is off.
SHARD_TASK = dict(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
#: the bound on shard tasks per stage where no configuration gives one (WSSSConfig.max_shards)
MAX_SHARDS = WSSSConfig.model_fields["max_shards"].default
#: the shard tasks :func:`run_shards` keeps in flight (:func:`wave_size`): enough to keep a few dozen
#: workers fed through Prefect's 0.1-0.2 s of dispatch a task, and queued tasks for an adaptive
#: cluster to scale on, while the flow and the Dask scheduler hold the rows of 64 shards instead
#: of a whole stage's; fewer when shards are large (:data:`WAVE_ROWS`), never fewer than twice the
#: cluster's worker threads (docs/large-corpora.md, "Memory")
WAVE = 64
#: the rows in flight that bound the wave of large shards: 32,000 rows (64 shards of 500, 7 of
#: 5000) are about 26 MB of records and handed rows, whatever the corpus's size
WAVE_ROWS = 32_000

ingest_shard = task(name="ingest-shard", task_run_name=ShardRunName("ingest"), **SHARD_TASK)(pl.ingest_shard)
features_shard = task(name="features-shard", task_run_name=ShardRunName("features"), **SHARD_TASK)(pl.features_shard)
preliminary_shard = task(name="preliminary-shard", task_run_name=ShardRunName("preliminary"), **SHARD_TASK)(pl.preliminary_shard)
foreground_prelim_shard = task(name="foreground-start-shard", task_run_name=ShardRunName("foreground-start"),
                               **SHARD_TASK)(pl.foreground_prelim_shard)
pseudo_shard = task(name="pseudo-label-shard", task_run_name=ShardRunName("pseudo-labels"), **SHARD_TASK)(pl.pseudo_shard)
evaluate_shard = task(name="evaluate-shard", task_run_name=ShardRunName("evaluate"), **SHARD_TASK)(pl.evaluate_shard)
refresh_shard = task(name="refresh-shard", task_run_name=ShardRunName("refresh"), **SHARD_TASK)(rf.refresh_shard)


def shards_of(records: list[ImageRecord], size: int, max_shards: int = MAX_SHARDS) -> list[list[str]]:
    """The ids of ``records`` in order, cut into shards of ``size`` images, or more when that
    would make more than ``max_shards`` shard tasks (:func:`tasks.config.shard_size_for`)."""
    ids = [r.image_id for r in records]
    size = shard_size_for(len(ids), size, max_shards)
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def stream_shards(rows, size: int, max_shards: int = MAX_SHARDS, keep=None) -> Shards:
    """:func:`shards_of`'s shards of ``rows`` (a list, or a split's :meth:`Store.split_rows`) that
    ``keep`` accepts, as rows, made one at a time as a stage submits them
    (:class:`tasks.store.stream.Shards`): the flow holds the rows of the shards in flight only."""
    return Shards(rows, lambda n: shard_size_for(n, size, max_shards), keep)


def handing(records: list[ImageRecord] | None = None):
    """``run_shards``'s ``per_shard`` that hands each shard task the manifest rows of its images,
    so that no task reads the manifest (:func:`tasks.store.shard_records`): a shard of rows
    (:func:`stream_shards`) is handed as it is; a shard of ids, its rows from ``records``."""
    if records is None:
        return lambda shard: {"records": list(shard)}
    index = {r.image_id: r for r in records}
    return lambda ids: {"records": [index[i] for i in ids]}


def pending_shards(store: Store, r: int, stage: str, shards):
    """The shards of round ``r``'s ``stage`` (``prelim``, ``pseudo``) without a done marker, and
    the results the others recorded: a resumed stage submits tasks only for what is left (a
    task costs about 0.2 s even when it finds its shard done). ``shards``: :class:`Shards` (the
    shards left are the same, made again as they are submitted) or a list of shards of ids."""
    streamed = isinstance(shards, Shards)
    todo, done = [], []
    indexed = zip(shards.indices(), shards.ids()) if streamed else enumerate(shards)  # streamed: the ids alone read
    for index, shard in indexed:
        res = store.shard_done(r, stage, store.shard_name(ids_of(shard)))
        if res is None:
            todo.append(index if streamed else shard)
        else:
            done.append(res)
    return (shards.only(todo) if streamed else todo), done


def wave_size(shard_size: int = 1) -> int:
    """How many shard tasks of ``shard_size`` images :func:`run_shards` keeps in flight: :data:`WAVE`,
    or as many as hold :data:`WAVE_ROWS` rows when that is fewer, and at least twice the worker
    threads of the flow's task runner (a Dask cluster's at this moment, a thread pool's size): a
    shard of 5000 images keeps its worker busy for minutes, against a fraction of a second to
    dispatch the next one."""
    from prefect.context import FlowRunContext

    runner = getattr(FlowRunContext.get(), "task_runner", None)
    threads = 0
    try:
        if type(runner).__name__ == "DaskTaskRunner":  # prefect_dask's: its client is made at first use,
            threads = sum(runner.client.nthreads().values())  # so a flow's first stage asks for it
        else:  # Prefect's ThreadPoolTaskRunner
            threads = int(getattr(runner, "_max_workers", 0) or 0)
    except Exception:  # a runner of another kind, a scheduler that does not answer: the floor
        pass
    return max(2 * threads, min(WAVE, -(-WAVE_ROWS // max(shard_size, 1))))


def run_shards(task_fn, shards, stage: str, per_shard=None, in_flight: int | None = None, collect=None,
               **kwargs) -> list[Any]:
    """Run one task per shard of ``shards`` (lists of ids, or of rows: :func:`stream_shards`) and
    collect the results as they finish, with terminal progress and a Prefect progress artifact.
    At most ``in_flight`` tasks (:func:`wave_size`) are submitted at a time, the next shard as
    each finishes, so a stage's arguments are not all held at once (by the flow, the Dask
    scheduler and Prefect) however many shards it has. ``per_shard(shard)``: keywords of that
    shard's task alone (what is per image goes only to its shard: every task's arguments are
    walked and pickled). ``collect(position, result)``: called as each shard finishes (its
    position among the shards submitted); what it returns is kept instead of the result, so that
    a flow keeps of each shard only what it needs."""
    if not isinstance(shards, Shards):
        shards = list(shards)
    total = shards.images if isinstance(shards, Shards) else sum(len(s) for s in shards)
    prog = Progress(stage, total)
    art = create_progress_artifact(0.0, description=f"{stage}: shards done")
    size = shards.size if isinstance(shards, Shards) else max((len(s) for s in shards), default=1)
    bound, queue, running = max(1, in_flight or wave_size(size)), iter(shards), {}

    def submit_next() -> bool:
        shard = next(queue, None)
        if shard is None:
            return False
        ids = ids_of(shard)
        running[task_fn.submit(ids=ids, **kwargs, **(per_shard(shard) if per_shard else {}))] = (len(ids), submitted[0])
        submitted[0] += 1
        return True

    submitted = [0]
    while len(running) < bound and submit_next():
        pass
    out = []
    while running:
        fut = next(as_completed(list(running)))
        n, position = running.pop(fut)
        out.append(fut.result() if collect is None else collect(position, fut.result()))
        prog.advance(n)
        update_progress_artifact(art, 100.0 * prog.done / max(total, 1))
        submit_next()
    return out


# ============================================================================ ingest
@by_reference
@flow(name="ingest", flow_run_name=FlowRunName("ingest"))
def ingest(source: str, run_dir: str, shard_size: int = 32, skip_invalid: bool = False,
           background: str | None = "auto", max_pixels: int = ing.MAX_PIXELS, min_side: int = ing.MIN_SIDE,
           allow_external_links: bool = False, alpha_background: str = ing.ALPHA_BACKGROUND,
           headers_checked: bool = False) -> dict:
    """Step 0: a source dataset -> corpus store (images and masks packed by shard, Parquet manifest, ingest report).

    The cheap checks (listing, tags, ids, duplicates, headers against ``max_pixels`` and
    ``min_side``, links leaving the source unless ``allow_external_links``) run before any
    worker; the workers decode and check masks. Every problem is reported with its file. Without
    ``skip_invalid`` any problem refuses the source and nothing is added to the corpus; with it,
    every valid image is ingested and ``corpus/ingest_report.json`` lists the rejected ones
    (ingested + rejected = listed). Transparent pixels are composited on ``alpha_background``.
    ``headers_checked``: the caller has just read every header with these limits (``wsseg ingest``
    does, before the cluster starts), so they are not read twice.
    """
    check = ing.check_source(source, background=background, max_pixels=max_pixels, min_side=min_side,
                             allow_external_links=allow_external_links, headers=not headers_checked)
    check.raise_for(skip_invalid)
    ing.parse_colour(alpha_background)
    classes = check.classes
    items = check.items
    size = shard_size_for(len(items), shard_size, MAX_SHARDS)
    shards = [items[i:i + size] for i in range(0, len(items), size)]
    store = Store(run_dir)
    store.drop_staged()  # a stopped ingest's staged packs and manifest are not this one's
    # the shards' records go into the new manifest in the source's order as the shards finish:
    # the flow holds those of the shards finished ahead of an unfinished one, not the corpus's
    writer = store.manifest_writer()
    in_order = InOrder(writer.add)

    def collect(position: int, res: dict) -> dict:
        in_order.put(position, res.pop("records"))
        res.pop("written", None)
        return res

    try:
        results = run_shards(ingest_shard, shards, "ingest", collect=collect,
                             per_shard=lambda s: {"items": {it.image_id: dict(
                                 image_path=str(it.image_path), mask_path=str(it.mask_path) if it.mask_path else None,
                                 tags=list(it.tags), split=it.split, line=it.line) for it in s}},
                             run_dir=run_dir, n_classes=classes.n, alpha_background=alpha_background)
        counts = writer.close()
    except BaseException:
        writer.abort()
        raise
    decoded = [r for res in results for r in res["rejected"]]
    staged = [i for res in results for i in res.get("staged", [])]
    if decoded and not skip_invalid:  # refused: what the shards staged goes, the stored corpus stays as it was
        store.drop_staged()
        raise ing.IngestError([p for r in decoded for p in r["problems"]], hint=ing.REFUSED_HINT)
    rejected = sorted(check.rejected + decoded, key=lambda r: (r["line"] is None, r["line"] or 0))
    if not counts["images"]:
        store.drop_staged()
        raise ing.IngestError([p for r in rejected for p in r["problems"]],
                              hint="(nothing was added to the corpus: every listed image was rejected)")
    settings = dict(source=str(source), max_pixels=max_pixels, min_side=min_side,
                    allow_external_links=allow_external_links, alpha_background=alpha_background,
                    skip_invalid=skip_invalid)
    listed = check.listed
    del check, items, shards  # the listing is not needed past here
    store.commit_staged(staged)
    summary = ing.corpus_summary(store, counts, classes, skipped=len(rejected), listed=listed, rejected=rejected,
                                 notes=[n for res in results for n in res.get("notes", [])],
                                 decoded=sum(res.get("decoded", 0) for res in results), settings=settings)
    create_markdown_artifact(key="corpus", markdown=markdown_table([{k: v for k, v in summary.items() if k != "warnings"}])
                             + warnings_markdown(summary["warnings"]), description="corpus summary")
    return summary


# ============================================================================ shared steps
def compute_all_features(run_dir: str, records, config: WSSSConfig, only=None) -> str:
    """Step 2 (and B's edge map): superpixels, proposals and the edge map of every image of
    ``records`` (a list, or a split's :meth:`Store.split_rows`; those ``only`` accepts, when given)
    whose cache entry is missing; returns the cache key."""
    key = feature_key(config.features)
    store = Store(run_dir)
    seen = [0]

    def missing(r: ImageRecord) -> bool:
        if only is not None and not only(r):
            return False
        seen[0] += 1
        return not store.has_cached(FEATURE_STAGE, key, r.sha256)

    todo = stream_shards(records, config.shard_size, config.max_shards, keep=missing)
    if todo.images:
        run_shards(features_shard, todo, "features", per_shard=handing(), run_dir=run_dir, cfg=config.features,
                   key=key)
    else:
        Progress("features", seen[0]).message(f"all {seen[0]} images cached ({key})")
    return key


def evaluate_sources(run_dir: str, records, sources: list[list], shard_size: int,
                     stage: str = "evaluate", **kwargs) -> dict[str, dict]:
    """mIoU, per-class IoU and pixel accuracy of each label source over ``records`` (a list, or
    rows streamed: :meth:`Store.split_rows`; keywords: those of :func:`tasks.wsss.pipeline.evaluate_shard`)."""
    with_masks = stream_shards(records, shard_size, keep=lambda r: r.has_mask)
    if not with_masks.images:
        return {}
    results = run_shards(evaluate_shard, with_masks, stage, per_shard=handing(), run_dir=run_dir, sources=sources,
                         **kwargs)
    return source_scores(results, Store(run_dir).classes().names)


def gate_options(store: Store, config: WSSSConfig) -> dict:
    """``evaluate_shard`` keywords of ``config.inference``: the scales of the run's image
    classifier when the model's output is gated, nothing otherwise (or when the run has none)."""
    if not config.inference.gate or not store.has_checkpoint("classifier"):
        return {}
    return {"gate_scales": list(config.classifier.cam_scales)}


@by_reference
@flow(name="evaluate", flow_run_name=FlowRunName("evaluate-{source}-{split}"))
def evaluate(run_dir: str, round_index: int | None = None, split: str = "train", source: str = "pseudo",
             shard_size: int = 16) -> dict:
    """mIoU of a round's pseudo-labels (``source="pseudo"`` or ``"cam"``) or of a round's model
    on a split (``source="model"``) against the ground-truth masks."""
    store = Store(run_dir)
    rounds = store.finished_rounds()  # a round being written by a running `wsseg train` is not read
    if not rounds:
        raise ValueError(f"{run_dir}: no finished round yet; run `wsseg train` first")
    final = (store.read_summary() or {}).get("final_round") if source == "pseudo" else None
    r = (final if final in rounds else rounds[-1]) if round_index is None else round_index
    records = store.split_rows(split)
    if source == "model":
        key = (store.read_round(r) or {}).get("feature_key")
        config = WSSSConfig.model_validate(without_removed(store.read_config()))
        if key == feature_key(config.features):  # a split the rounds did not run on (val) has no edge maps yet
            compute_all_features(run_dir, records, config, only=lambda x: x.has_mask)
        res = evaluate_sources(run_dir, records, [["model", split]], shard_size,
                               model={"kind": "segmenter", "r": r}, key=key, **gate_options(store, config))
    else:
        res = evaluate_sources(run_dir, records, [[r, source]], shard_size)
    if not res:
        raise ValueError(f"no image of split {split!r} has a ground-truth mask to evaluate against")
    value = res[f"model:{split}"] if source == "model" else next(iter(res.values()))
    if f"model_ungated:{split}" in res:  # the gate's effect, beside the gated figure
        value = {**value, "gated": True, "ungated_miou": res[f"model_ungated:{split}"]["miou"]}
    create_markdown_artifact(key="evaluation", markdown=markdown_table([{"round": r, "split": split, "source": source,
                                                                         "miou": value["miou"],
                                                                         "mean_class_accuracy":
                                                                             value["mean_class_accuracy"]}]))
    return {"round": r, "split": split, "source": source, **value}


# ============================================================================ refresh round
@by_reference
@flow(name="refresh_round", flow_run_name=FlowRunName("round-{round_index}"))
def refresh_round(run_dir: str, round_index: int, config: WSSSConfig, feature_key: str,
                  train_model: bool = True) -> dict:
    """One refresh round (METHOD.md A steps 1-8), reproducible from its parameters.

    ``train_model=False`` stops after the pseudo-labels (step 8 skipped): a label-only round."""
    store = Store(run_dir)
    r = round_index
    records = store.split_rows(config.split)  # read a batch at a time by each use, never held whole
    keep_round_inputs(store, r, resume.round_inputs(store.classes(), store.split_entry(config.split), config,
                                                    corrections_entry(store, records)), config)
    done = settle_budget(store, r, config, store.read_round(r))
    if done and (not train_model or store.usable_checkpoint("segmenter", r)):
        return done  # a label-only round resumed by a full run goes on to train its model
    t0 = time.perf_counter()
    shards = stream_shards(records, config.shard_size, config.max_shards)
    tracker = Tracker(store.state_dir)
    with tracker.run(f"round-{r}", nested=True, tags={"round": str(r)}) as run_id:
        tracker.log_params({"round": r, **config.model_dump()})
        # 1. preliminary result: round 0 from the image classifier's CAMs, later from model r-1
        #    (round 0 on the foreground path: the class-agnostic foreground evidence)
        fg_on = pl.foreground_on(store, config)[0]
        clustered = r == 0 and fg_on and pl.uses_clusters(config)  # the foreground from the corpus's clusters too
        todo, _ = pending_shards(store, r, "prelim", shards)
        run_shards(preliminary_shard, todo, f"r{r} preliminary", per_shard=handing(), run_dir=run_dir,
                   round_index=r, key=feature_key, config=config, foreground=fg_on and not clustered)
        learn = trained_on(store, records, config, quiet=True)  # the trainers' images (all, or train_images of them)
        if clustered:  # [ours] the corpus-wide view: two clusters of the superpixel features, then each image again
            pl.fit_round_clusters(store, learn, feature_key, config)
            todo, _ = pending_shards(store, r, "foreground", shards)
            run_shards(foreground_prelim_shard, todo, "r0 foreground start", per_shard=handing(), run_dir=run_dir,
                       key=feature_key, config=config)
        # [ours] superpixel MIL: the preliminary result refined by a corpus-wide appearance classifier
        mil.train_round(store, r, learn, feature_key, config.mil, seed=config.seed, log=tracker.log_metrics)
        # 3. proposal classification (cross-entropy), trained on the corpus (its train_images sample when set)
        proposal_classifier.train_round(store, r, learn, feature_key, config.proposals,
                                        mil_prior_weight=config.mil.prior_weight, seed=config.seed)
        # 5.-7. IoU filtering, fusion per tagged class, 3-way clustering, seeded segmentation
        #     (on the foreground path: GrabCut of the whole image from the combined foreground evidence)
        todo, results = pending_shards(store, r, "pseudo", shards)
        foreground = config.foreground if fg_on else None
        results += run_shards(pseudo_shard, todo, f"r{r} pseudo-labels", per_shard=handing(), run_dir=run_dir,
                              round_index=r, key=feature_key, cfg=config.proposals, seed=config.seed,
                              mil_weight=config.mil.prior_weight, foreground=foreground)
        changed, ignored = label_shares(results)
        # 9. whether the rounds stop here and which round's labels are final (tasks.wsss.stopping, no mask)
        decision = stopping.decide(config, r, changed, reverted_of(results), coverage_of(results),
                                   **decision_context(store, r, config, fg_on))
        # 8. correction: train the segmentation model on the pseudo-labels; the last round's
        # model (the run's final one) with the whole budget from the start, see final_model_config,
        # on the final round's labels (the round before, when this one oscillates)
        last = decision.stop
        seg_cfg, init = (final_model_config(config, r + 1), None) if last else \
            (round_model_config(config), r - 1 if r > 0 else None)
        result = train_segmenter(store, learn, feature_key, seg_cfg, r=r, label_round=decision.final_round,
                                 init_round=init, log=tracker.log_metrics) if train_model else None
        # measurement and reporting, after the method's steps
        summary = report_round(store, r, records, config, tracker, run_id, feature_key, changed, ignored, result,
                               time.perf_counter() - t0) | decision.record() | {"trained_images": len(learn)}
        tracker.log_metrics({"reverted_fraction": decision.reverted}
                            | ({"tag_coverage": decision.coverage} if decision.coverage is not None else {}), step=r)
    store.write_round(r, summary)
    return summary


def trained_on(store: Store, records, config: WSSSConfig, quiet: bool = False) -> list[ImageRecord]:
    """The images of ``records`` (a list, or streamed: :meth:`Store.split_rows`) the corpus-wide
    trainers learn from: all, or with ``config.train_images`` a seeded sample of them that keeps
    every corrected image (:func:`tasks.wsss.pipeline.training_sample`, which holds the sample
    only); said on the terminal unless ``quiet``."""
    learn = pl.training_sample(records, config.train_images, config.seed, store.corrections().keys())
    if len(learn) < len(records) and not quiet:
        Progress("trainers", len(records)).message(
            f"the trainers learn from {len(learn)} of the {len(records)} images (train_images, seed {config.seed}); "
            "every image is labelled")
    return learn


def keep_round_inputs(store: Store, r: int, inputs: dict, config: WSSSConfig) -> None:
    """Resume round ``r`` only from results computed from ``inputs`` (class list, corpus hash,
    configuration), as :func:`tasks.wsss.recompute.round_fate` decides: when the round recorded
    other ones, or none though finished (an older wsseg's), it and every later round are removed
    and computed again, and the terminal says what changed. A change that the round's
    pseudo-labels do not depend on (the segmentation model, the stopping rule:
    scope MODEL of :data:`tasks.config.OPTIONS`) removes only its model, summary and the later rounds, and one
    that acts from round 1 on (scope FROM_ROUND_1) leaves round 0 whole
    (:func:`tasks.corpus.resume.round_view`). A change of the stopping rule alone
    (scope DECISION; ``config``: the run's today) takes a finished round's
    decision again from its record: where it stands the round is kept whole, its record saying
    the new rule's reason (:func:`tasks.wsss.recompute.decision_stands`). A change of what the
    final model alone reads (scope FINAL_MODEL) keeps every finished round that
    did not stop the rounds whole; the last one's model is trained again. An unfinished round
    without a record (one sharing another run's round-0 arrays, as the ablations do) is resumed.
    The inputs are then recorded."""
    recorded = store.round_inputs(r)
    fate = round_fate(store, r, inputs, config)
    said = f"{'; '.join(fate.changed)} changed since round {r} was computed"
    if fate.kind == "final_model":
        store.write_round_inputs(r, inputs)
        Progress(f"r{r}", 1).message(f"{said}: it acts on the final model only; this round is kept")
        return
    if fate.kind == "decision":
        store.write_round(r, (store.read_round(r) or {}) | fate.decision.record())
        store.write_round_inputs(r, inputs)
        what = fate.decision.reason or "the rounds go on"
        Progress(f"r{r}", 1).message(f"{said}: its decision stands ({what}); its labels and model are kept")
        return
    if fate.kind == "model":
        gone = store.drop_round_model(r)
        again = f"its model and round(s) {', '.join(map(str, gone))} are" if gone else "its model is"
        Progress(f"r{r}", 1).message(f"{said}: its pseudo-labels do not depend on it and are kept; {again} "
                                     "computed again")
    elif fate.kind == "rounds":
        gone = store.drop_rounds(r)
        Progress(f"r{r}", 1).message(f"{said}: round(s) {', '.join(map(str, gone))} are computed again")
    if recorded != inputs or fate.changed:
        store.write_round_inputs(r, inputs)


def settle_budget(store: Store, r: int, config: WSSSConfig, done: dict | None) -> dict | None:
    """Round ``r``'s summary ``done`` under the round budget of ``config`` (``max_rounds``, which
    changes no round's labels): where the budget moved (:func:`tasks.wsss.stopping.budget_moved`) the
    round's decision is the budget's today; its model is trained again where the last round's recipe
    differs from a round's (:func:`tasks.wsss.recompute.budget_retrains`: the summary and model are
    removed and None returned), else the summary is rewritten and returned."""
    if not done or not stopping.budget_moved(done, r, config):
        return done
    where = f"round {r} is {'' if r >= config.max_rounds - 1 else 'no longer '}the last"
    if budget_retrains(store, r, config, done):
        gone = store.drop_round_model(r)
        later = f" (round(s) {', '.join(map(str, gone))} removed)" if gone else ""
        Progress(f"r{r}", 1).message(f"the round budget is {config.max_rounds} now: {where}; its pseudo-labels "
                                     f"are kept, its model is trained again{later}")
        return None
    done = done | stopping.budget_decision(r, config)  # later rounds depend on its model only: kept
    store.write_round(r, done)
    Progress(f"r{r}", 1).message(f"the round budget is {config.max_rounds} now: {where}; its labels and model are kept")
    return done


def report_round(store: Store, r: int, records, config: WSSSConfig, tracker: Tracker,
                 run_id: str, feature_key: str, changed: float, ignored: float, result, seconds: float) -> dict:
    """Round ``r``'s summary: pseudo-label quality against the masks (where the corpus has
    them), MLflow metrics and artifacts, the overlay picture and the Prefect artifact."""
    sources = [[r, "pseudo"]] + ([[0, "cam"]] if r == 0 else [])
    ev = evaluate_sources(str(store.root), records, sources, config.shard_size, stage=f"r{r} evaluate")
    summary = {"round": r, "pseudo_label_miou": ev.get(f"{r}:pseudo", {}).get("miou"),
               "pseudo_label_class_accuracy": ev.get(f"{r}:pseudo", {}).get("mean_class_accuracy"),
               "pseudo_label_chance_miou": ev.get(f"{r}:pseudo", {}).get("chance_miou"),
               "changed_share": changed, "ignore_share": ignored,
               "wall_seconds": seconds, "mlflow_run_id": run_id,
               "feature_key": feature_key, "images": len(records),
               "corrected_images": (corrections_entry(store, records) or {}).get("images", 0),
               "per_class_iou": ev.get(f"{r}:pseudo", {}).get("per_class_iou"),
               "per_class_accuracy": ev.get(f"{r}:pseudo", {}).get("per_class_accuracy"),
               "train_epochs": result.epochs_run if result else None,
               "train_stopped": result.stopped if result else None}
    if r == 0 and "0:cam" in ev:
        summary["cam_miou"] = ev["0:cam"]["miou"]
        summary["cam_per_class_iou"] = ev["0:cam"]["per_class_iou"]
        summary["cam_class_accuracy"] = ev["0:cam"]["mean_class_accuracy"]
        summary["cam_chance_miou"] = ev["0:cam"]["chance_miou"]
    tracker.log_metrics({k: summary[k] for k in ("pseudo_label_miou", "pseudo_label_class_accuracy",
                                                 "pseudo_label_chance_miou", "changed_share", "ignore_share",
                                                 "wall_seconds")}, step=r)
    pic = store.round_dir(r) / "overlay.png"
    overlay_grid(store, pick_overlay_records(records, with_mask=False),
                 [("pseudo-label", r, "pseudo")] + ([("CAM", 0, "cam")] if r == 0 else []), pic)
    tracker.log_artifact(pic, "overlays")
    if store.has_checkpoint("segmenter", r):
        tracker.log_artifact(store.checkpoint_path("segmenter", r), "checkpoint")
    queue = review_table(store, r, top=10, measure=False)["rows"]
    if queue:  # the review queue (tasks.labels.review): what a person should look at first
        create_markdown_artifact(key=f"review-{r}", description=f"round {r}: the labels most likely wrong",
                                 markdown=markdown_table([{"image_id": x["image_id"], "score": x["score"],
                                                           **{k: x[k] for k in SIGNALS}} for x in queue]) +
                                 f"\n\nEvery image: `wsseg review --run-dir {store.root} --round {r}`")
    create_markdown_artifact(key=f"round-{r}", markdown=markdown_table([row(summary)]) +
                             (f"\n\nMLflow run: [`{run_id}`]({tracker.run_url(run_id)})" if run_id
                              else "\n\nMLflow run: not recorded"), description=f"refresh round {r}")
    return summary


# ============================================================================ the whole training
@by_reference
@flow(name="train_wsss", flow_run_name=FlowRunName("train-wsss"))
def train_wsss(run_dir: str, config: WSSSConfig = WSSSConfig(), dask_address: str | None = None,
               final_model: bool = True, model_name: str | None = None) -> dict:
    """Refresh rounds until the pseudo-labels stop changing (share < epsilon), oscillate (see
    :mod:`tasks.wsss.stopping`: then the round before is final) or the budget ends; the summary names
    the final round and why, and warns when the tags carry no contrast (:mod:`tasks.wsss.foreground`).

    ``final_model=False``: the last round stops after its pseudo-labels (no segmentation model is
    trained on them), for label-only runs such as the bench's ablations. The final model is
    logged in the parent MLflow run as an MLflow model (``model``), and registered as a new
    version of the registered model ``model_name`` when that is given."""
    t0 = time.perf_counter()
    store = Store(run_dir)
    config = with_weight_digests(config)  # the ImageNet weight files' sha256: part of every resume key
    check_config(store, config)
    records = store.split_rows(config.split)  # read a batch at a time by each use, never held whole
    if not records:
        raise ValueError(f"{run_dir}: no images in split {config.split!r}")
    tracker = Tracker(store.state_dir)  # MLflow's database: local, beside a remote run
    rows: list[dict] = []
    with tracker.run("train_wsss", tags={"flow": "train_wsss"}) as parent_id:
        tracker.log_params(config.model_dump())
        # 2. superpixels, proposals and the edge feature map, once per image and parameter set
        key = compute_all_features(run_dir, records, config)
        # 4. image classifier on the tags; its CAMs are round 0's preliminary result
        learn = trained_on(store, records, config)
        cls_seconds = train_image_classifier(store, learn, config.classifier, seed=config.seed,
                                             device=config.device, log=tracker.log_metrics,
                                             inputs=resume.classifier_inputs(store.classes(), learn, config))
        foreground, tag_stats = pl.foreground_on(store, config)
        warnings = contrast_warnings(tag_stats, where=f"split {config.split!r}", foreground=foreground)
        for w in warnings:
            Progress("tags", 1).message(f"warning: {w}")
        converged, decision = False, None
        for r in range(config.max_rounds):
            s = on_cluster(refresh_round, dask_address)(run_dir, r, config, key,
                                                        final_model or r < config.max_rounds - 1)
            if r == 0:
                rows.append({"round": "cam", "pseudo_label_miou": s.get("cam_miou"),
                             "pseudo_label_class_accuracy": s.get("cam_class_accuracy"),
                             "pseudo_label_chance_miou": s.get("cam_chance_miou"), "changed_share": None,
                             "ignore_share": 0.0, "tag_coverage": None, "wall_seconds": cls_seconds})
            rows.append(row(s) | {"mlflow_run_id": s["mlflow_run_id"]})
            # 9. stopping (tasks.wsss.stopping): converged, oscillating, or the round budget
            decision = s if "stops_rounds" in s else stopping.decide(config, r, s["changed_share"], 0.0).record()
            if decision["stops_rounds"]:
                converged = bool(decision["converged"])
                break
        last = int(rows[-1]["round"])
        final_round = int(decision["final_round"]) if decision else last
        final_row = next(x for x in rows if x["round"] == final_round)
        final = store.checkpoint_path("segmenter", last) if store.has_checkpoint("segmenter", last) else None
        logged, digest = log_final_model(store, tracker, last, model_name) if final is not None else (None, None)
        tracker.log_metrics({"final_pseudo_label_miou": final_row["pseudo_label_miou"],
                             "final_pseudo_label_class_accuracy": final_row.get("pseudo_label_class_accuracy"),
                             "final_round": final_round, "rounds": len(rows) - 1})
        reason = decision["stop_reason"] if decision else None
        tracker.set_tags({"stop_reason": reason, "final_round": final_round, "foreground": foreground})
        summary = {"run_dir": str(store.root), "rounds": rows, "converged": converged,
                   "final_round": final_round, "stop_reason": reason,
                   "final_pseudo_label_miou": final_row["pseudo_label_miou"],
                   "final_pseudo_label_class_accuracy": final_row.get("pseudo_label_class_accuracy"),
                   "final_model": str(final) if final is not None else None,
                   "foreground": foreground, "warnings": warnings,
                   "mlflow_parent_run_id": parent_id, "wall_seconds": time.perf_counter() - t0,
                   "feature_key": key, "images": len(records), "final_model_sha256": digest,
                   "corrected_images": (corrections_entry(store, records) or {}).get("images", 0)}
        if logged is not None:
            summary["mlflow_model"] = logged
        url = tracker.run_url(parent_id)
        link = f"[`{parent_id}`]({url})" if url else f"`{parent_id}`"
        registered = (f"\n\nRegistered model: `{model_name}` version {logged['registered_version']}"
                      if logged and logged.get("registered_version") is not None else "")
        create_markdown_artifact(key="train-wsss", markdown=markdown_table(rows) +
                                 f"\n\nFinal: round {final_round} ({reason})" +
                                 f"\n\nMLflow parent run: {link}" + registered + warnings_markdown(warnings),
                                 description="pseudo-label rounds")
    store.write_summary(summary)
    record_config(store, config)
    return summary


def log_final_model(store: Store, tracker: Tracker, r: int, model_name: str | None) -> tuple[dict | None, str]:
    """Log round ``r``'s segmenter, the run's final model, to MLflow (and register it as a version
    of ``model_name``), unless the run directory's previous training logged this very file (its
    sha256) under the same name and MLflow still has it: a rerun that computed nothing then adds
    no model, only its run pointing at the one logged (tag ``final_model_logged``). Returns what
    :meth:`Tracker.log_model` returned (or the earlier one) and the checkpoint's sha256."""
    path = store.checkpoint_path("segmenter", r)
    digest = sha256_file(path) if is_local(path) else hashlib.sha256(path.read_bytes()).hexdigest()
    before = store.read_summary() or {}
    earlier = before.get("mlflow_model")
    if (before.get("final_model_sha256") == digest and (earlier or {}).get("registered_name") == model_name
            and tracker.has_model(earlier)):
        tracker.set_tags({"final_model_logged": earlier["model_uri"]})
        return earlier, digest
    tracker.log_artifact(path, "final_model")
    net, spec = store.read_model("segmenter", r)
    return tracker.log_model(net, "model", in_channels=spec["in_channels"], num_classes=spec["num_classes"],
                             register=model_name), digest


# ============================================================================ incremental refresh
@by_reference
@flow(name="refresh", flow_run_name=FlowRunName("refresh"))
def refresh(run_dir: str) -> dict:
    """Label the images of the corpus that the last finished round has no pseudo-label of (new
    since it was computed, or changed or retagged: the ingest dropped theirs) with that round's
    models, trained on nothing (see :mod:`tasks.wsss.refresh`); ``wsseg train`` retrains.

    Refused when the class list or the configuration changed since the round was computed. The
    labels go into the round's arrays; ``refresh.json`` records what was done, with the
    pseudo-label mIoU of the refreshed images that have masks."""
    t0 = time.perf_counter()
    store = Store(run_dir)
    rounds = store.finished_rounds()
    if not rounds:
        raise ValueError(f"{run_dir}: no finished round to label new images with; run `wsseg train` first")
    r = rounds[-1]
    config = WSSSConfig.model_validate(without_removed(store.read_config()))
    problem = rf.refresh_problem(store, r, config)
    if problem:
        raise ValueError(f"{run_dir}: {problem}")
    records = store.split_rows(config.split)
    todo = stream_shards(records, config.shard_size, keep=lambda rec: not store.has_pseudo(r, rec.image_id))
    key = feature_key(config.features)
    seconds, cpu = {"features": 0.0, "prelim": 0.0, "pseudo": 0.0}, 0.0
    if todo.images:
        for res in run_shards(refresh_shard, todo, f"refresh with r{r}", per_shard=handing(), run_dir=run_dir,
                              round_index=r, key=key, config=config, foreground=pl.foreground_on(store, config)[0]):
            seconds = {k: v + res["seconds"][k] for k, v in seconds.items()}
            cpu += res["cpu_seconds"]
    else:
        Progress("refresh", len(records)).message(f"every image of split {config.split!r} has a round-{r} "
                                                 "pseudo-label: nothing to do")
    ev = evaluate_sources(run_dir, todo.kept_rows(), [[r, "pseudo"]], config.shard_size,
                          stage="refresh evaluate") if todo.images else {}
    summary = {"round": r, "images": len(records), "labelled": todo.images, "stage_seconds": seconds,
               "core_ms_per_image": 1000 * cpu / max(todo.images, 1),
               "pseudo_label_miou": ev.get(f"{r}:pseudo", {}).get("miou"),
               "wall_seconds": time.perf_counter() - t0,
               "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    store.write_json("refresh", summary)
    create_markdown_artifact(key="refresh", markdown=markdown_table([summary]), description="incremental refresh")
    return summary


def check_config(store: Store, config: WSSSConfig) -> None:
    """Say where ``config`` differs from the run directory's configuration (config.json): a run
    started with another one is not mixed in, every result computed with the fields that differ is
    computed again (the classifier and each round record what they were computed from; see
    :mod:`tasks.corpus.resume`). The round budget, inference settings and where the work runs change
    no round. ``config`` is recorded only once the training finishes (:func:`record_config`): a
    command that fails leaves the record as it was."""
    previous = store.read_config()
    # (without a record or a corpus yet every option counts)
    implicit = previous is None or not store.has_corpus() or store.classes().background is not None
    diff = config_difference(previous, config, implicit, store.split_images(config.split) if store.has_corpus() else None)
    if diff:
        Progress("config", 1).message(f"{store.config_path}: the configuration differs from the one this run "
                                      f"directory was computed with (in: {', '.join(diff)}); the results that "
                                      "depend on it are computed again")


def record_config(store: Store, config: WSSSConfig) -> None:
    """Record ``config`` as the run directory's configuration (config.json: what a plain `wsseg
    train` resumes with), without where the work ran (scope RUNTIME of :data:`tasks.config.OPTIONS`)."""
    current = recorded_config(config)
    if store.read_config() != current:
        store.write_config(current)

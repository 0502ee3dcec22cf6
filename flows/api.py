"""wsseg's Python API: what the ``wsseg`` commands do, as functions that return plain data.

Each function does what the command of the same name does, with the same checks, locks and
one-line errors (a ``ValueError`` naming the file or option), and returns the summary that the
command's ``--json`` prints: dicts, lists, numbers and strings (JSON-able), except
:func:`segment`, which returns label arrays. The CLI (:mod:`wsseg.flows.commands`) calls these
functions and prints their results; ``import wsseg`` gives them at the top (``wsseg.train``).

The work runs as the commands run it: Prefect flows whose shard tasks go to a local Dask cluster
of ``workers`` processes (or the existing one at ``dask_address``), under a Prefect API started
for the call unless ``PREFECT_API_URL`` names one (inside a user's own Prefect flow, a call's flow
is a subflow of it). Each call points Prefect's and MLflow's state at its run directory
(``RUN/.prefect``, ``RUN/mlflow.db``) unless ``PREFECT_API_URL`` / ``MLFLOW_TRACKING_URI`` are
set. Progress lines go to standard error, as the commands'.

    import wsseg

    wsseg.ingest(wsseg.SAMPLE, run_dir="runs/api")          # images/ + labels.csv (+ masks, to measure)
    summary = wsseg.train(run_dir="runs/api", rounds=1)      # the refresh rounds
    labels = wsseg.segment([image_array], model="runs/api")  # [(H, W) uint8 class indices]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from wsseg.flows.cli_common import DEFAULT_RUN_DIR, SAMPLE, version_text

if TYPE_CHECKING:
    import numpy as np

    from wsseg.tasks.config import WSSSConfig

__all__ = ["ingest", "train", "refresh", "evaluate", "segment", "segment_files", "export", "review", "status",
           "check", "version", "SAMPLE", "DEFAULT_RUN_DIR"]

PathLike = Union[str, os.PathLike]


def version() -> str:
    """The installed wsseg's version (what ``wsseg --version`` prints)."""
    return version_text()


# ---------------------------------------------------------------------------------------------- shared
def _store(run_dir: PathLike):
    """The run directory's store, its endpoint reachable (one request for a URL)."""
    from wsseg.tasks.store import Store

    store = Store(run_dir)
    store.check_reachable()
    return store


def _existing(run_dir: PathLike):
    """The store of a run directory that exists: a ValueError naming it otherwise."""
    store = _store(run_dir)
    if not (store.exists() if store.remote else store.root.is_dir()):
        raise ValueError(f"{run_dir}: no such run directory")
    return store


def _prepare(run_dir: PathLike) -> None:
    """Point Prefect, Dask's scratch and MLflow at the run directory (:func:`flows.runtime.prepare`),
    unless this process already is (the CLI prepared it, with its own --verbose)."""
    from wsseg.flows.runtime import prepare
    from wsseg.tasks.store.remote import state_dir_for

    if os.environ.get("PREFECT_HOME") != str(state_dir_for(run_dir) / ".prefect"):
        prepare(run_dir)


def need_corpus(run_dir: PathLike) -> None:
    """A ValueError saying what to run first when the run directory holds no corpus."""
    from wsseg.tasks.store import Store

    store = Store(run_dir)
    if not store.has_corpus():
        raise ValueError(f"{store.root}: no corpus here; run `wsseg ingest SOURCE --run-dir {run_dir}` first")


def need_round(run_dir: PathLike) -> None:
    """A ValueError saying what to run first when the run directory has no finished round."""
    from wsseg.tasks.store import Store

    need_corpus(run_dir)
    if not Store(run_dir).finished_rounds():
        raise ValueError(f"{run_dir}: no finished round yet; run `wsseg train --run-dir {run_dir}` first")


def _workers(workers: int | None) -> int:
    return workers or os.cpu_count() or 2


def _recomputing_damage(store, command: str, run: Callable[[], dict]) -> dict:
    """``run()`` (a train or refresh flow); when it meets a damaged file that was computed (a pack of
    a round or of the feature cache, a checkpoint, a record: not the corpus, which only the source
    brings back), the damaged derived data of the run directory is removed as ``wsseg check
    --repair`` removes it and ``run()`` runs again, computing exactly that again (once)."""
    from wsseg.tasks.store.check import check_run
    from wsseg.tasks.store.damage import DamagedFileError

    try:
        return run()
    except DamagedFileError as e:
        rel = Path(e.path).as_posix().removeprefix(str(store.root).rstrip("/") + "/")
        if rel.startswith("corpus/") or rel == e.path:  # the source's, or not this run directory's
            raise
        print(f"wsseg {command}: {e}: reading every file (`wsseg check --repair`) and computing the damaged "
              "derived data again", file=sys.stderr, flush=True)
        res = check_run(store, repair=True)
        if res["from_source"]:
            raise
        for d in res["repaired"]:
            print(f"  {d['path']}: {d['done']}", file=sys.stderr, flush=True)
        return run()


# ---------------------------------------------------------------------------------------------- writers
def ingest(source: PathLike | None = None, run_dir: PathLike = DEFAULT_RUN_DIR, *,
           corrections: PathLike | None = None, shard_size: int = 32, skip_invalid: bool = False,
           background: str | None = "auto", max_pixels: int | None = None, min_side: int | None = None,
           allow_external_links: bool = False, alpha_background: str | None = None, workers: int | None = None,
           dask_address: str | None = None) -> dict[str, Any]:
    """``wsseg ingest``: a dataset folder (``images/`` + ``labels.csv``, or a PASCAL VOC layout) into
    the run directory's corpus store; ingesting a grown source again decodes only new and changed
    images. ``corrections``: corrected label maps (a folder of ``<image id>.png`` or Label Studio's
    JSON export), ingested after the source (or alone, into a run that holds the images).

    Returns the ingest summary (``images``, ``listed``, ``skipped``, ``problems``, ``classes``,
    ``splits``, ``implicit_background``, ``changes`` against the corpus before, ``warnings``,
    ``report``: the ingest report's path) and, with ``corrections``, their result under
    ``"corrections"`` (``stored``, ``refused``: one line per refused file). ``background``: the
    implicit background class's name, ``"auto"`` (a first class named background) or None.
    Raises ValueError (:class:`tasks.corpus.ingest.IngestError`) naming every problem of the source
    before anything is written, unless ``skip_invalid``.
    """
    if source is None and corrections is None:
        raise ValueError("give the dataset folder to ingest (source), or corrections, or both")
    if source is not None and not Path(source).is_dir():
        raise ValueError(f"{source}: no such source folder")
    if corrections is not None and not Path(corrections).exists():
        raise ValueError(f"{corrections}: no such file or folder (corrections: a folder of PNG label maps or a "
                         "Label Studio JSON export)")
    store = _store(run_dir)
    if source is None and not store.has_corpus():
        raise ValueError(f"{run_dir}: no corpus here; ingest the images (source) before their corrections")
    summary: dict[str, Any] = {}
    if source is not None:
        summary = _ingest_source(Path(source), run_dir, shard_size=shard_size, skip_invalid=skip_invalid,
                                 background=background, max_pixels=max_pixels, min_side=min_side,
                                 allow_external_links=allow_external_links, alpha_background=alpha_background,
                                 workers=workers, dask_address=dask_address)
    if corrections is not None:
        summary["corrections"] = _ingest_corrections(run_dir, Path(corrections))
    return summary


def _ingest_source(source: Path, run_dir: PathLike, *, shard_size, skip_invalid, background, max_pixels,
                   min_side, allow_external_links, alpha_background, workers, dask_address) -> dict:
    from wsseg.tasks.corpus import ingest as ing

    bg = None if background in (None, "none") else background
    # options left unset take the defaults of tasks.corpus.ingest (the flow's keyword defaults)
    checks = {k: v for k, v in dict(max_pixels=max_pixels, min_side=min_side,
                                     allow_external_links=allow_external_links or None).items() if v is not None}
    opts = checks | ({"alpha_background": alpha_background} if alpha_background is not None else {})
    # the cheap checks (listing, tags, ids, duplicates, headers, links) before any worker or server starts
    check_ = ing.check_source(source, background=bg, **checks)
    check_.raise_for(skip_invalid)
    if alpha_background is not None:
        ing.parse_colour(alpha_background)
    if check_.rejected:
        print(f"skipping {len(check_.rejected)} of {check_.listed} listed image(s) (skip_invalid; the ingest report "
              "lists every one):", *check_.skipped_lines(), sep="\n", file=sys.stderr)
    headers_checked = not check_.rejected
    del check_  # the flow lists the source again: this listing is not held beside it
    _prepare(run_dir)
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import ingest as ingest_flow

    root = _store(run_dir).root
    with _store(run_dir).lock("wsseg ingest", reentrant=True):
        # a clean source's headers were just read: the flow does not read them again (with rejected images
        # it does, so that it knows them). Absolute paths: an existing cluster's workers run elsewhere
        with dask_cluster(dask_address, _workers(workers), root) as address:
            return on_cluster(ingest_flow, address)(str(source.resolve()), str(root), shard_size, skip_invalid, bg,
                                                    headers_checked=headers_checked, **opts)


def _ingest_corrections(run_dir: PathLike, corrections: Path) -> dict:
    from wsseg.tasks.labels.corrections import ingest_corrections
    from wsseg.tasks.runtime.progress import Progress

    store = _store(run_dir)
    prog = Progress("corrections", 0)
    seen = 0

    def advance() -> None:
        nonlocal seen
        seen += 1
        if seen % 50 == 0:
            prog.message(f"{seen} read")

    with store.lock("wsseg ingest", reentrant=True):
        return ingest_corrections(store, corrections, progress=advance)


def _config_args(run_dir, config, overrides, rounds, network, device, backbone_weights):
    """The options of ``train`` as the CLI's parser would give them to
    :func:`flows.cli_common.build_config` (one place decides how they combine)."""
    import argparse

    conf_file = None
    if config is not None and not isinstance(config, Mapping) and not hasattr(config, "model_dump"):
        conf_file = Path(config)  # a JSON file of WSSSConfig fields
    return argparse.Namespace(run_dir=str(run_dir), config=conf_file, rounds=rounds, network=network, device=device,
                              backbone_weights=[f"{k}={v}" for k, v in (backbone_weights or {}).items()] or None,
                              overrides=[f"{k}={json.dumps(v)}" for k, v in (overrides or {}).items()])


def train(run_dir: PathLike = DEFAULT_RUN_DIR, *, config: "Mapping[str, Any] | WSSSConfig | PathLike | None" = None,
          overrides: Mapping[str, Any] | None = None, rounds: int | None = None, network: str | None = None,
          device: str | None = None, backbone_weights: Mapping[str, PathLike] | None = None,
          recompute: bool = False, workers: int | None = None, dask_address: str | None = None,
          register: str | None = None) -> dict[str, Any]:
    """``wsseg train``: refresh rounds on the ingested corpus until the stopping rule or the round
    budget ends them; re-running resumes (finished shards, rounds and epochs are kept) with the
    configuration recorded in the run directory.

    ``config``: a configuration over the defaults instead of the run's recorded one
    (``WSSSConfig`` fields as a nested mapping, ``{}`` for the defaults, a ``WSSSConfig``, or the
    path of a JSON file: ``--config``); ``overrides``: single dotted fields over either,
    ``{"proposals.t1": 0.4}`` (``--set``); ``rounds``: the round budget (``--rounds``); ``network``:
    the segmentation network (``--network``); ``device``: ``auto``, ``cpu`` or ``cuda``;
    ``backbone_weights``: torchvision ImageNet files of the fusion network, ``{"resnet50": path}``;
    ``register``: also register the final model in MLflow's registry under this name. Options that
    would compute finished results again raise a ValueError naming them, unless ``recompute``.

    A damaged file met on the way that was computed (a pack, a checkpoint) is computed again (see
    :func:`check`); a damaged corpus file stops it with the line naming the file.

    Returns the run's summary (what :meth:`Store.read_summary` and ``--json`` give): ``rounds`` (one row per
    round: ``miou`` and the other measures), ``final_round``, ``stop_reason``, ``converged``,
    ``final_model``, ``images``, ``wall_seconds``, ...
    """
    from wsseg.flows.cli_common import build_config, refuse_discarding

    need_corpus(run_dir)
    base = None
    if config is not None and (isinstance(config, Mapping) or hasattr(config, "model_dump")):
        base = dict(config) if isinstance(config, Mapping) else config.model_dump(mode="json")
    args = _config_args(run_dir, config, overrides, rounds, network, device, backbone_weights)
    conf = build_config(args, base)
    args.recompute = recompute
    refuse_discarding(args, conf)
    _prepare(run_dir)
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import train_wsss

    store = _store(run_dir)
    with store.lock("wsseg train", reentrant=True):
        with dask_cluster(dask_address, _workers(workers), store.root) as address:
            return _recomputing_damage(store, "train", lambda: on_cluster(train_wsss, address)(
                str(store.root), conf, address, model_name=register))


def refresh(run_dir: PathLike = DEFAULT_RUN_DIR, *, workers: int | None = None,
            dask_address: str | None = None) -> dict[str, Any]:
    """``wsseg refresh``: label the images the last finished round has no labels of (ingested since,
    changed or retagged) with that round's models, training nothing.

    Returns the refresh summary (``labelled``, ``images``, ``round``, ``pseudo_label_miou`` where
    masks exist, ``wall_seconds``, ``core_ms_per_image``, ``stage_seconds``), also in refresh.json.
    """
    need_round(run_dir)
    _prepare(run_dir)
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import refresh as refresh_flow

    store = _store(run_dir)
    with store.lock("wsseg refresh", reentrant=True):
        with dask_cluster(dask_address, _workers(workers), store.root) as address:
            return _recomputing_damage(store, "refresh", lambda: on_cluster(refresh_flow, address)(str(store.root)))


# ---------------------------------------------------------------------------------------------- readers
def evaluate(run_dir: PathLike = DEFAULT_RUN_DIR, *, round: int | None = None, split: str = "train",
             source: str = "pseudo", workers: int | None = None, dask_address: str | None = None) -> dict[str, Any]:
    """``wsseg evaluate``: mIoU against the corpus's masks of a round's pseudo-labels (``source=
    "pseudo"``), round 0's CAM labels (``"cam"``) or the round's segmenter (``"model"``) on ``split``.
    Returns ``miou``, ``pixel_accuracy``, ``mean_class_accuracy``, ``chance_miou``, ``per_class_iou``, ..."""
    need_round(run_dir)
    _prepare(run_dir)
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import evaluate as evaluate_flow

    root = _store(run_dir).root
    with dask_cluster(dask_address, _workers(workers), root) as address:
        return on_cluster(evaluate_flow, address)(str(root), round, split, source)


def segment(images: "Sequence[PathLike | np.ndarray]", model: PathLike, *, gate: bool | None = None,
            device: str = "cpu", fov: str = "auto", patch_size: int | None = None, overlap: int | None = None,
            batch: int = 4) -> "list[np.ndarray]":
    """Label images with a trained model, in memory: each of ``images`` (an (H, W, 3) uint8 RGB array,
    or an image file's path) gives an (H, W) uint8 array of class indices, in order; nothing is
    written. ``model``: a run directory (its final model), a checkpoint or a ``bench highres``
    output, as ``wsseg segment --model``. The values index the run's class list (its source's
    ``classes.txt``, in order; ``export`` writes it beside the labels). ``gate``: weight each class by the run's image
    classifier (default: the run's ``inference.gate``); ``fov``, ``patch_size``, ``overlap``,
    ``batch``: a global-local model's, as ``wsseg segment``'s options.
    """
    from wsseg.tasks.highres.segment import Labeller
    from wsseg.tasks.store import files

    label = Labeller(model, device=device, gate=gate, fov=fov, patch_size=patch_size, overlap=overlap, batch=batch)
    return [label(files.read_image(x) if isinstance(x, (str, os.PathLike)) else x) for x in images]


def segment_files(images: Sequence[PathLike], model: PathLike, out: PathLike, *, gate: bool | None = None,
                  device: str = "cpu", fov: str = "auto", patch_size: int | None = None,
                  overlap: int | None = None, batch: int = 4, threads: int | None = None) -> dict[str, Any]:
    """``wsseg segment``: label image files of any size into ``out`` (``<stem>.png``, a palette PNG
    of class indices, per image, and an overlay or, above 50 megapixels, a Zarr array), with
    Prefect and MLflow state in ``out``. Returns the report also written to ``out/segment.json``
    (per image: size, seconds, class shares, files; the process's peak memory)."""
    missing = [str(p) for p in images if not Path(p).is_file()]
    if missing:
        raise ValueError(f"{missing[0]}: no such image file" + (f" (and {len(missing) - 1} more)"
                                                               if len(missing) > 1 else ""))
    from wsseg.tasks.store import RunLock, files, read_file

    read_file(files.resolve_checkpoint(model))  # a missing, damaged or untrusted checkpoint: before any flow
    _prepare(out)
    from wsseg.flows.runtime import prefect_api

    with RunLock(Path(out), "wsseg segment", option="--out", reentrant=True):
        from wsseg.flows.highres import segment as segment_flow

        with prefect_api() as ready:
            ready()
            return segment_flow([str(p) for p in images], str(model), str(out), patch_size=patch_size,
                                overlap=overlap, batch=batch, device=device, fov=fov, gate=gate, threads=threads)


def export(run_dir: PathLike = DEFAULT_RUN_DIR, out: PathLike | None = None, *, fmt: str = "png",
           round: int | str = "final", images: bool = True, force: bool = False,
           review: int | None = None) -> dict[str, Any]:
    """``wsseg export``: a finished round's labels (the final one by default) as the files other
    tools read, streamed image by image into ``out``: ``fmt="png"`` (the PASCAL VOC layout),
    ``"coco"`` (one COCO JSON of RLE masks) or ``"labelstudio"`` (tasks with brush predictions and
    the labelling configuration). ``review=N``: only the top N of the review queue. Returns what was
    written (``out``, ``round``, ``images``, ``config_digest``, ...), also ``out/export.json``."""
    from wsseg.tasks.labels.export import export_labels

    if out is None:
        raise ValueError("export needs out, the folder to write")
    return export_labels(_existing(run_dir), out, which=round, fmt=fmt, images=images, force=force, review=review)


def review(run_dir: PathLike = DEFAULT_RUN_DIR, *, round: int | str = "final", top: int | None = 20) -> dict[str, Any]:
    """``wsseg review``: a finished round's images ranked by how likely their labels are wrong,
    worst first (``rows``: ``image_id``, ``score``, the signals, ``corrected``; ``iou`` and
    ``spearman`` where the corpus has masks); ``top`` rows (None: every image). A round computed
    without the review queue gets its signals from its stored labels once (and keeps them)."""
    from wsseg.tasks.labels.export import export_round
    from wsseg.tasks.labels.review import review_table

    store = _store(run_dir)
    if not store.has_corpus():
        raise ValueError(f"{run_dir}: no corpus here (run `wsseg ingest` and `wsseg train` first)")
    r = export_round(store, round)
    if not store.review_rows(r):
        print(f"round {r} was computed without the review queue: its signals are computed from the round's stored "
              "labels once (and kept)", file=sys.stderr)
    res = review_table(store, r, top=top or None)
    if not res["images"]:
        raise ValueError(f"{store.root}: round {r} holds no labels to review")
    return res | {"round": r}


def status(run_dir: PathLike = DEFAULT_RUN_DIR) -> dict[str, Any]:
    """``wsseg status``: where a run directory stands (corpus, finished rounds with their measures,
    shards done and pending of a round in progress, the store's size, the writer, the last error),
    from its records alone: it starts nothing and takes well under a second."""
    from wsseg.tasks.report.status import run_status

    return run_status(_existing(run_dir))


def check(run_dir: PathLike = DEFAULT_RUN_DIR, *, repair: bool = False) -> dict[str, Any]:
    """``wsseg check``: read and verify every file the run directory's records name; returns the
    damaged and missing ones (``damaged``: path, what it holds, the problem, what to do). ``repair``
    removes damaged derived data so that the next :func:`train` or :func:`refresh` recomputes
    exactly that, and names the corpus files that only ``ingest`` of the source brings back."""
    from wsseg.tasks.store.check import check_run

    store = _existing(run_dir)
    if not repair:
        return check_run(store)
    with store.lock("wsseg check --repair", reentrant=True):
        return check_run(store, repair=True)

"""``wsseg bench pipeline``: the pure parts of the pipeline benchmark (the flow is
:mod:`flows.bench_pipeline`).

* a corpus of N distinct images built from a source folder: :func:`replica_plan` (which source
  image each copy comes from), :func:`augment` (each copy flipped or not, cropped, rescaled and
  colour-jittered, seeded by the copy's index, so that every copy's content hash differs while
  its tags stay valid; the mask, when there is one, follows the geometry), :func:`replicate_shard`
  (one shard of copies written as a normal source folder that ``wsseg ingest`` reads);
* :func:`measured_shard`: a shard function of :mod:`tasks.wsss.pipeline` (or :mod:`tasks.wsss.crf`) run
  with the worker's process CPU time, wall time and peak memory recorded around it;
* :func:`stage_figures`: images/s and core-ms per image of one stage from its shards;
* :func:`plain_loop`: the same per-image functions in a plain loop in one process, images
  and results in memory (no Prefect, no Dask, no store), with the time of each step of the
  pseudo-labels (filtering, fusion, clustering, seeded segmentation) measured inside
  :func:`tasks.wsss.fusion.pseudo_label`;
* :func:`store_listing`: what listing and opening a run directory costs (objects, seconds);
* :func:`label_hashes`, :func:`format_summary`.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import cv2
import numpy as np

from wsseg.tasks.runtime.memory import rss_mb

__all__ = ["BENCH_CONFIG", "replica_plan", "copy_params", "augment", "replicate_shard", "write_source_index",
           "read_source_index", "measured_shard", "stage_figures", "plain_loop", "store_listing", "label_hashes",
           "format_summary", "SHARD_FUNCTIONS", "CPU_STAGES", "PSEUDO_STEPS"]

#: The benchmark's configuration (``WSSSConfig`` fields; ``--set`` and ``--config`` go on top): the
#: CPU stages as the defaults have them, the corpus-wide trainers on a small fixed budget (a few
#: epochs, so that their time is a per-epoch cost times N) and one round, so that N = 1000 and
#: 4000 fit a two-core machine; ``segmentation.num_workers`` 0 keeps the segmenter's data loading
#: in the flow process, whose memory is measured.
BENCH_CONFIG = {
    "classifier": {"epochs": 2, "size": 160, "stride": 16, "batch_size": 16, "cam_scales": [1.0]},
    "mil": {"iterations": 1, "epochs": 3},
    "proposals": {"epochs": 2},
    "segmentation": {"epochs": 1, "crop": 160, "batch_size": 8, "num_workers": 0},
    "max_rounds": 1,
}

#: the CPU stages of a round, in order (features are computed once per image, the others every round)
CPU_STAGES = ("features", "preliminary", "pseudo_labels")
#: the steps of the pseudo-labels whose time :func:`plain_loop` measures inside tasks.wsss.fusion.pseudo_label:
#: step -> names of tasks.wsss.fusion that make it up
PSEUDO_STEPS = {"filtering": ("_class_counts", "proposal_iou", "filter_proposals"), "fusion": ("fuse_class",),
                "clustering": ("three_way",), "seeded_segmentation": ("seed_map", "seeded_segmentation")}


# ---------------------------------------------------------------------------- the replicated corpus
def replica_plan(items: Sequence[dict], n: int, *, start: int = 0) -> list[dict]:
    """Copies ``start .. start + n - 1`` of a source's images, in turn: copy ``k`` comes from item
    ``k % len(items)``, is that image's copy number ``k // len(items)`` and is called
    ``<source id>-c<copy>``; ``start`` lets a later corpus grow by new copies (N, then N/10 more).

    Parameters
    ----------
    items : sequence of dict
        ``image_id``, ``image_path``, ``mask_path`` (or None), ``tags`` of each source image.
    n : int
        Number of copies, at least 1.

    Returns
    -------
    plan : list of dict
        ``k``, ``image_id``, ``source_id``, ``image_path``, ``mask_path``, ``tags`` per copy.

    Examples
    --------
    >>> items = [dict(image_id="a", image_path="a.jpg", mask_path=None, tags=["cow"])]
    >>> [p["image_id"] for p in replica_plan(items, 2)]
    ['a-c0000', 'a-c0001']
    """
    if not items:
        raise ValueError("the source lists no image to replicate")
    if n < 1 or start < 0:
        raise ValueError(f"replica_plan needs n >= 1 and start >= 0, got n={n}, start={start}")
    out = []
    for k in range(start, start + n):
        it = items[k % len(items)]
        out.append({"k": k, "image_id": f"{it['image_id']}-c{k // len(items):04d}", "source_id": it["image_id"],
                    "image_path": str(it["image_path"]), "tags": list(it["tags"]),
                    "mask_path": str(it["mask_path"]) if it.get("mask_path") else None})
    return out


def copy_params(k: int, seed: int = 0) -> dict:
    """The changes made to copy ``k``: a horizontal flip (half of the copies), a crop keeping 80-95 %
    of each side, a rescale by 0.7-1.0 and a colour jitter (per-channel gain 0.85-1.15 and offset
    -12..12); drawn from ``numpy.random.default_rng([seed, k])``, so a copy is the same every time."""
    rng = np.random.default_rng([seed, k])
    keep = rng.uniform(0.80, 0.95, 2)
    return {"flip": bool(rng.random() < 0.5), "keep": keep.tolist(), "offset": rng.random(2).tolist(),
            "scale": float(rng.uniform(0.7, 1.0)), "gain": rng.uniform(0.85, 1.15, 3).tolist(),
            "bias": rng.uniform(-12, 12, 3).tolist()}


def augment(image: np.ndarray, mask: np.ndarray | None, params: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """One copy of ``image`` (and its mask) changed by ``params`` (:func:`copy_params`).

    Parameters
    ----------
    image : (H, W, 3) uint8
    mask : (H, W) uint8 or None
        Class indices; cropped, flipped and rescaled (nearest neighbour) like the image, values kept.
    params : dict
        ``flip``, ``keep`` (kept share of height, width), ``offset`` (where the crop sits, 0-1),
        ``scale``, ``gain`` and ``bias`` (per RGB channel).

    Returns
    -------
    image : (h, w, 3) uint8
    mask : (h, w) uint8 or None

    Examples
    --------
    >>> img = np.full((40, 50, 3), 100, np.uint8)
    >>> p = dict(flip=True, keep=[0.9, 0.8], offset=[0, 0], scale=0.5, gain=[1, 1, 1.1], bias=[0, 0, 0])
    >>> a, m = augment(img, np.zeros((40, 50), np.uint8), p)
    >>> a.shape, m.shape, int(a[0, 0, 2])
    ((18, 20, 3), (18, 20), 110)
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
    if mask is not None and mask.shape != image.shape[:2]:
        raise ValueError(f"mask {mask.shape} does not match the image {image.shape[:2]}")
    # crop
    h, w = image.shape[:2]
    ch, cw = max(1, int(round(h * params["keep"][0]))), max(1, int(round(w * params["keep"][1])))
    top, left = int(params["offset"][0] * (h - ch)), int(params["offset"][1] * (w - cw))
    img = image[top:top + ch, left:left + cw]
    msk = None if mask is None else mask[top:top + ch, left:left + cw]
    # flip
    if params["flip"]:
        img = img[:, ::-1]
        msk = None if msk is None else msk[:, ::-1]
    # rescale
    size = (max(1, int(round(cw * params["scale"]))), max(1, int(round(ch * params["scale"]))))
    img = cv2.resize(np.ascontiguousarray(img), size, interpolation=cv2.INTER_AREA)
    if msk is not None:
        msk = cv2.resize(np.ascontiguousarray(msk), size, interpolation=cv2.INTER_NEAREST)
    # colour jitter
    out = img.astype(np.float32) * np.asarray(params["gain"], np.float32) + np.asarray(params["bias"], np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8), msk


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def replicate_shard(out_dir: str, plan: list[dict], seed: int = 0) -> dict:
    """Write one shard of copies (:func:`replica_plan` entries) into the source folder ``out_dir``:
    ``images/<id>.jpg`` (JPEG, quality 92) and, where the source image has one, ``masks/<id>.png``
    (same palette). Returns ``images`` and ``sha256`` {image id: hash of the written image file}."""
    from PIL import Image

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    shas = {}
    for p in plan:
        with Image.open(p["image_path"]) as im:
            image = np.asarray(im.convert("RGB"))
        mask = palette = None
        if p["mask_path"]:
            with Image.open(p["mask_path"]) as m:
                palette = m.getpalette() if m.mode == "P" else None
                mask = np.asarray(m if m.mode in ("P", "L") else m.convert("L"))
        image, mask = augment(image, mask, copy_params(p["k"], seed))
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=92)
        _atomic_bytes(out / "images" / f"{p['image_id']}.jpg", buf.getvalue())
        shas[p["image_id"]] = hashlib.sha256(buf.getvalue()).hexdigest()
        if mask is not None:
            (out / "masks").mkdir(exist_ok=True)
            m = Image.fromarray(mask, mode="P" if palette else "L")
            if palette:
                m.putpalette(palette)
            buf = io.BytesIO()
            m.save(buf, format="PNG")
            _atomic_bytes(out / "masks" / f"{p['image_id']}.png", buf.getvalue())
    return {"images": len(plan), "sha256": shas}


def write_source_index(out_dir: str | Path, plan: list[dict], classes: Sequence[str], split: str,
                       sha256: dict[str, str], settings: dict) -> Path:
    """``labels.csv`` (image_id,split,labels; every copy in ``split``, its source's tags),
    ``classes.txt`` and, last, ``replica.json`` (``settings``, the plan's ids and each copy's
    hash: its presence says the folder is complete)."""
    out = Path(out_dir)
    lines = ["image_id,split,labels"] + [f"{p['image_id']},{split},{';'.join(p['tags'])}" for p in plan]
    _atomic_bytes(out / "labels.csv", ("\n".join(lines) + "\n").encode())
    _atomic_bytes(out / "classes.txt", ("\n".join(classes) + "\n").encode())
    index = {**settings, "images": len(plan), "sha256": {p["image_id"]: sha256[p["image_id"]] for p in plan}}
    _atomic_bytes(out / "replica.json", json.dumps(index, indent=1).encode())
    return out / "replica.json"


def read_source_index(out_dir: str | Path, settings: dict) -> dict | None:
    """The ``replica.json`` of a complete replicated folder made with ``settings``, else None."""
    path = Path(out_dir) / "replica.json"
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if all(index.get(k) == v for k, v in settings.items()) else None


# ---------------------------------------------------------------------------- measured shards
def _shard_functions() -> dict[str, Callable[..., Any]]:
    from wsseg.tasks.wsss import crf
    from wsseg.tasks.wsss import pipeline as pl

    return {"features": pl.features_shard, "preliminary": pl.preliminary_shard, "pseudo_labels": pl.pseudo_shard,
            "cam_crf": crf.cam_crf_shard, "replicate": replicate_shard}


#: the shard functions :func:`measured_shard` runs, by name (names, not pickled functions, cross to the workers)
SHARD_FUNCTIONS = tuple(["features", "preliminary", "pseudo_labels", "cam_crf", "replicate"])


def measured_shard(function: str, **kwargs) -> dict:
    """Run shard function ``function`` (one of :data:`SHARD_FUNCTIONS`) with ``kwargs`` and measure it
    in the process that runs it (a Dask worker).

    Returns
    -------
    dict
        ``result`` (the function's own), ``images`` (its ``ids`` or ``plan``), ``cpu_seconds``
        (process CPU time, all threads), ``seconds`` (wall), ``started`` and ``finished``
        (epoch seconds), ``pid`` and ``peak_rss_mb`` (the process's peak resident set so far).
    """
    table = _shard_functions()
    if function not in table:
        raise ValueError(f"unknown shard function {function!r}; one of: {', '.join(table)}")
    c0, t0, started = time.process_time(), time.perf_counter(), time.time()
    result = table[function](**kwargs)
    return {"result": result, "images": len(kwargs.get("ids", kwargs.get("plan", ()))),
            "cpu_seconds": time.process_time() - c0, "seconds": time.perf_counter() - t0, "started": started,
            "finished": time.time(), "pid": os.getpid(), "peak_rss_mb": rss_mb("VmHWM")}


def warm_up() -> int:
    """Import what the shard functions need (torch, OpenCV, the method's modules), so that a fresh
    worker's first measured shard does not pay for it; returns the process id."""
    _shard_functions()
    return os.getpid()


def stage_figures(shards: list[dict], wall_seconds: float, images: int) -> dict:
    """Figures of one stage over ``images`` images from its :func:`measured_shard` outputs and the
    stage's wall time (submission to last result, as the flow saw it).

    Returns
    -------
    dict
        ``images``, ``images_per_s`` (images / wall), ``core_ms_per_image`` (the workers' CPU
        time inside the shard functions per image), ``wall_seconds``, ``core_seconds``, ``shards``.

    Examples
    --------
    >>> s = stage_figures([{"cpu_seconds": 1.0, "images": 10}, {"cpu_seconds": 3.0, "images": 10}], 2.0, 20)
    >>> s["images_per_s"], s["core_ms_per_image"]
    (10.0, 200.0)
    """
    core = float(sum(s["cpu_seconds"] for s in shards))
    return {"images": int(images), "images_per_s": images / wall_seconds if wall_seconds > 0 else None,
            "core_ms_per_image": 1000.0 * core / images if images else None,
            "wall_seconds": float(wall_seconds), "core_seconds": core, "shards": len(shards)}


def worker_peaks(shards: Sequence[dict]) -> dict[int, float]:
    """{pid: peak resident set in MB} of the processes that ran ``shards`` (their last reading)."""
    out: dict[int, float] = {}
    for s in shards:
        out[s["pid"]] = max(out.get(s["pid"], 0.0), s["peak_rss_mb"])
    return out


# ---------------------------------------------------------------------------- the plain loop
class _Clock:
    """CPU and wall seconds per named step, summed over calls (not re-entrant per name)."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)
        return timed


@contextlib.contextmanager
def _timed_steps(clock: _Clock, module, steps: dict[str, Sequence[str]]) -> Iterator[list[str]]:
    """The functions of ``module`` named in ``steps`` replaced, for the ``with`` block, by the same
    functions timed into ``clock`` under their step's name (so a caller such as
    ``tasks.wsss.fusion.pseudo_label`` runs unchanged while its steps are measured). Yields the names
    found (a name the module no longer has is left out of the figures)."""
    saved = {}
    try:
        for step, names in steps.items():
            for name in names:
                if callable(getattr(module, name, None)):
                    saved[name] = getattr(module, name)
                    setattr(module, name, clock.wrap(f"pseudo_labels.{step}", saved[name]))
        yield sorted(saved)
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _quantised(prob: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(K, H, W) probabilities as the preliminary result's storage keeps them (the allowed classes,
    to 1/255), so that the loop's later steps see the flow's numbers."""
    q = np.zeros_like(prob, dtype=np.float32)
    q[allowed] = np.clip(np.rint(prob[allowed] * 255.0), 0, 255).astype(np.uint8).astype(np.float32) / 255.0
    return q


def plain_loop(store, records: Sequence, config, seed: int | None = None) -> dict:
    """METHOD.md A's CPU stages of round 0 for ``records``, one image after the other in this
    process: features (edge map, superpixels, superpixel features, proposals), the preliminary
    result (the image classifier's CAMs) and the pseudo-labels (proposal scores, MIL evidence,
    then :func:`tasks.wsss.fusion.pseudo_label` with its filtering, fusion, clustering and seeded
    segmentation timed inside), with the networks of ``store``'s round 0. Images are read from
    the store before the clock starts; nothing is written.

    Returns
    -------
    dict
        ``images``, ``cpu`` and ``wall`` {step: seconds} (steps ``features.*``, ``preliminary``,
        ``pseudo_labels.*`` and the totals ``features``, ``pseudo_labels``), ``hashes`` {image id:
        sha256 of the pseudo-label}, ``timed_functions`` (the names timed inside pseudo_label).
    """
    import torch

    from wsseg.tasks.edges.weighting import feature_region_map
    from wsseg.tasks.store import arrays_to_sparse, sparse_to_arrays
    from wsseg.tasks.wsss import fusion
    from wsseg.tasks.wsss import pipeline as pl
    from wsseg.tasks.wsss import superpixels as spx
    from wsseg.tasks.wsss.feature_cache import ImageFeatures, proposal_inputs
    from wsseg.tasks.wsss.features import superpixel_features
    from wsseg.tasks.wsss.proposal_classifier import predict_proposals, round_mil_model
    from wsseg.tasks.wsss.proposals import hierarchical_proposals

    import cv2

    threads, cv_threads = torch.get_num_threads(), cv2.getNumThreads()
    torch.set_num_threads(1)  # as on a worker (tasks.wsss.pipeline._worker_setup)
    cv2.setNumThreads(1)
    fc, pc, seed = config.features, config.proposals, config.seed if seed is None else seed
    classes = store.classes()
    model, state = store.read_model("classifier")
    clf = store.read_classifier("proposal_classifier", 0)["model"]
    mil_model = round_mil_model(store, 0)
    images = {r.image_id: store.image(r.image_id) for r in records}
    clock, hashes = _Clock(), {}
    try:
        with _timed_steps(clock, fusion, PSEUDO_STEPS) as timed:
            for rec in records:
                image, allowed = images[rec.image_id], classes.tag_vector(rec.tags)
                # features (tasks.wsss.feature_cache.compute_features without the cache)
                with clock("features"):
                    with clock("features.edge_map"):
                        edges = feature_region_map(image, sigma=fc.edge_sigma, tau=fc.edge_tau)
                    with clock("features.superpixels"):
                        labels = spx.superpixels(image, method=fc.superpixel_method, region_size=fc.region_size,
                                                 ruler=fc.ruler, n_iter=fc.superpixel_iterations)
                    with clock("features.superpixel_features"):
                        feats = superpixel_features(image, labels, edge_map=edges)
                    with clock("features.proposals"):
                        membership = hierarchical_proposals(image, labels, edge_map=edges,
                                                            min_size=fc.proposal_min_size,
                                                            diversify=fc.proposal_diversify)
                    labels, feats = labels.astype(np.int32), feats.astype(np.float32)
                # preliminary result, round 0 (tasks.wsss.pipeline.preliminary_shard without the store),
                # and the superpixel features pooled from its CAM pass (features.deep_features)
                with clock("preliminary"):
                    prob, deep = pl.round0_cam(model, state, image, allowed, classes, config, lambda: labels)
                    pl.labels_from_prob(prob)
                prelim = _quantised(prob, allowed)
                if deep is not None:
                    feats = np.hstack([feats, deep])
                f = ImageFeatures(edges.astype(np.uint8), labels, feats, arrays_to_sparse(sparse_to_arrays(membership)),
                                  spx.areas(labels, n=feats.shape[0]))
                # pseudo-labels (tasks.wsss.pipeline.pseudo_shard without the store)
                with clock("pseudo_labels"):
                    with clock("pseudo_labels.proposal_scores"):
                        pprob = predict_proposals(clf, proposal_inputs(f), allowed)
                    with clock("pseudo_labels.mil_evidence"):
                        prelim = pl.pseudo_evidence(f, prelim, allowed, mil_model, config.mil.prior_weight)
                    label, _ = pl.make_pseudo_label(image, f, pprob, prelim, classes, rec.tags, pc, seed)
                hashes[rec.image_id] = _label_hash(label)
    finally:
        torch.set_num_threads(threads)
        cv2.setNumThreads(cv_threads)
    return {"images": len(records), "cpu": clock.cpu, "wall": clock.wall, "hashes": hashes, "timed_functions": timed}


# ---------------------------------------------------------------------------- outputs and the store
def _label_hash(label: np.ndarray) -> str:
    h = hashlib.sha256(str((label.shape, label.dtype.str)).encode())
    h.update(np.ascontiguousarray(label).tobytes())
    return h.hexdigest()


def label_hashes(store, r: int, ids: Sequence[str], name: str = "pseudo") -> dict[str, str | None]:
    """{image id: sha256 of round ``r``'s stored label map ``name`` (shape, dtype and bytes)}, None
    where there is none."""
    out: dict[str, str | None] = {}
    for iid in ids:
        label = store.pseudo(r, iid, name=name)
        out[iid] = None if label is None else _label_hash(label)
    return out


def corpus_digest(hashes: dict[str, str | None]) -> str:
    """One sha256 over the per-image hashes, in id order."""
    return hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()


def store_listing(store, k: int = 50, seed: int = 0, feature_key: str | None = None) -> dict:
    """The cost of listing and opening a run directory: how many objects (files) each of its
    top-level parts holds and how long listing all of them takes, and the seconds to open the
    manifest and to read ``k`` random images, feature-cache entries and pseudo-labels of round 0
    through the store.

    Returns
    -------
    dict
        ``objects`` {part: files}, ``objects_total``, ``list_seconds``, ``manifest_seconds``,
        ``status_seconds`` (what `wsseg status` does, in this process),
        ``images``, ``k``, and ``open_ms`` {image, features, pseudo_label: mean ms per read}.
    """
    t = time.perf_counter()
    objects: dict[str, int] = {}
    for dirpath, _, names in os.walk(store.root):
        rel = Path(dirpath).relative_to(store.root).parts
        part = rel[0] if rel else "."
        objects[part] = objects.get(part, 0) + len(names)
    list_seconds = time.perf_counter() - t
    t = time.perf_counter()
    records = store.manifest()
    manifest_seconds = time.perf_counter() - t
    picks = random.Random(seed).sample(records, min(k, len(records)))
    open_ms: dict[str, float | None] = {}
    readers = {"image": lambda r: store.image(r.image_id),
               "pseudo_label": lambda r: store.pseudo(0, r.image_id)}
    if feature_key is not None:
        from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE

        readers["features"] = lambda r: store.cached(FEATURE_STAGE, feature_key, r.sha256)
    for what, read in readers.items():
        t = time.perf_counter()
        for r in picks:
            read(r)
        open_ms[what] = 1000.0 * (time.perf_counter() - t) / len(picks) if picks else None
    from wsseg.tasks.report.status import run_status

    t = time.perf_counter()
    run_status(store)
    status_seconds = time.perf_counter() - t
    main = {p: n for p, n in objects.items() if p in ("corpus", "cache", "rounds")}
    return {"status_seconds": status_seconds, "objects": dict(sorted(objects.items())), "objects_store": sum(main.values()),
            "objects_total": sum(objects.values()), "list_seconds": list_seconds,
            "manifest_seconds": manifest_seconds, "images": len(records), "k": len(picks), "open_ms": open_ms}


# ---------------------------------------------------------------------------- summary
def _f(v, p=1) -> str:
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def format_summary(res: dict) -> str:
    """The table printed at the end of ``wsseg bench pipeline``."""
    lines = [f"pipeline benchmark: {res['data']} -> sizes {', '.join(str(n) for n in res['sizes'])}, "
             f"workers {res['workers']}; one round, trainers on the benchmark budget"]
    lines.append(f"\n{'stage':<36} {'images/s':>9} {'core-ms/img':>12}  measured")
    for name, s in res["stages"].items():
        lines.append(f"{name:<36} {_f(s.get('images_per_s')):>9} {_f(s.get('core_ms_per_image')):>12}  "
                     f"{s.get('measured', '')}")
    lines.append(f"\n{'size':>6} {'flow MB':>8} {'worker MB':>10} " +
                 " ".join(f"{t + ' s':>20}" for t in ("classifier", "mil", "proposal_classifier", "segmenter")))
    for n in res["peak_rss_mb"]:
        rss, tr = res["peak_rss_mb"][n], res["trainer_seconds"].get(n, {})
        lines.append(f"{n:>6} {_f(rss.get('flow'), 0):>8} {_f(rss.get('worker'), 0):>10} " +
                     " ".join(f"{_f(tr.get(t)):>20}" for t in ("classifier", "mil", "proposal_classifier", "segmenter")))
    lines.append(f"\n{'size':>6} {'objects':>9} {'list s':>8} {'manifest s':>11} {'status s':>9} {'image ms':>9} "
                 f"{'features ms':>12} {'label ms':>9}")
    for n, s in res["store_listing"].items():
        o = s["open_ms"]
        lines.append(f"{n:>6} {s['objects_total']:>9} {_f(s['list_seconds'], 2):>8} {_f(s['manifest_seconds'], 3):>11} "
                     f"{_f(s.get('status_seconds'), 2):>9} "
                     f"{_f(o.get('image'), 2):>9} {_f(o.get('features'), 2):>12} {_f(o.get('pseudo_label'), 2):>9}")
    t = res["targets"]
    lines.append("")
    for key, target in (("overhead_share", "<= 0.10"), ("parallel_efficiency", ">= 0.9"),
                        ("ours_over_dcrf", "<= 1.0"), ("ours_with_features_over_dcrf", "<= 1.2"),
                        ("rerun_share", "<= 0.05")):
        v = res.get(key)
        ok = "" if v is None else ("  ok" if t.get(key) else "  MISSED")
        lines.append(f"{key:<28} {_f(v, 3):>8}   target {target}{ok}")
    lines.append(f"{'overhead_core_share':<28} {_f(res.get('overhead_core_share'), 3):>8}   (the same in CPU time)")
    lines.append(f"{'dcrf_core_ms_per_image':<28} {_f(res.get('dcrf_core_ms_per_image')):>8}   (CAM + dense CRF)")
    lines.append(f"rerun bit-identical: {res['rerun_identical']}; plain loop identical to the flow: "
                 f"{res.get('plain_loop_identical')}; worker counts identical: {res.get('workers_identical')}")
    for n, load in (res.get("load_average") or {}).items():
        if load:
            lines.append(f"machine load (1-min average) during N={n}: {load[0]:.1f} -> {load[1]:.1f} on "
                         f"{os.cpu_count()} cores")
    return "\n".join(lines)

"""Per-image steps of a refresh round: the pure functions of tasks/ composed with the store.

Each function handles one image and is what a shard task loops over. They read and write only
through :class:`tasks.store.Store`.
"""
from __future__ import annotations

import hashlib
import heapq
import time
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator, Sequence

import numpy as np
import torch

from wsseg.tasks.common import training as tr
from wsseg.tasks.common.metrics import ConfusionAccumulator, changed_share, ignore_share, reverted_share, tag_log_shares
from wsseg.tasks.config import ClassifierConfig, FeatureConfig, ForegroundConfig, ProposalConfig, WSSSConfig
from wsseg.tasks.corpus.ingest import ALPHA_BACKGROUND, decode_image, load_mask
from wsseg.tasks.corpus.tags import tag_statistics
from wsseg.tasks.labels.corrections import corrected_prelim
from wsseg.tasks.labels.review import image_signals
from wsseg.tasks.runtime.progress import run_log
from wsseg.tasks.store import ClassSpec, ImageRecord, Store, sha256_file, shard_records
from wsseg.tasks.wsss import foreground as fg
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.deep_features import levels_of, pool_superpixels, stride_columns
from wsseg.tasks.wsss.feature_cache import (ImageFeatures, compute_features, load_edges, load_features, load_superpixels,
                                             proposal_inputs)
from wsseg.tasks.wsss.fusion import pseudo_label
from wsseg.tasks.wsss.proposal_classifier import predict_proposals, round_mil_model, sp_evidence, superpixel_scores

def restrict(prob: np.ndarray, allowed: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(K, H, W) probabilities renormalised over the ``allowed`` classes (zero elsewhere).

    Computed on the allowed channels only (the others add exact zeros to the sum); the others
    are ``0 / total``, so the result is bit for bit that of the whole stack."""
    idx = np.flatnonzero(allowed)
    sub = (np.maximum(prob[idx], 0) + eps).astype(np.float32)
    total = sub.sum(0, keepdims=True)
    out = np.empty(np.shape(prob), np.float32)
    out[:] = np.float32(0.0) / total
    out[idx] = sub / total
    return out


def gate_probs(prob: np.ndarray, class_probs: np.ndarray, object_classes: Sequence[int]) -> np.ndarray:
    """(K, H, W) segmentation probabilities of an untagged image, each object class weighted by
    the image classifier's probability that the image shows it (``class_probs``, one per entry
    of ``object_classes``) and renormalised; the implicit background, if any, keeps weight 1.

    The tags' role at inference: where a training image's tags restrict its labels, an unseen
    image's class probabilities damp the classes it most likely lacks."""
    gate = np.ones(prob.shape[0], np.float32)
    gate[np.asarray(object_classes, int)] = np.clip(class_probs, 0.0, 1.0)
    return restrict(prob * gate[:, None, None], np.ones(prob.shape[0], bool))


def trained_classes_only(prob: np.ndarray, state: dict) -> np.ndarray:
    """(K, H, W) probabilities of a segmenter restricted (renormalised) to the classes its training
    images were tagged with (checkpoint meta ``trained_classes``, plus an implicit background): a
    class it never saw a tag of is no answer on a user's image. Unchanged when the checkpoint
    does not say, or when every class was tagged."""
    trained = state.get("meta", {}).get("trained_classes")
    if trained is None or len(set(trained)) >= prob.shape[0]:
        return prob
    allowed = np.zeros(prob.shape[0], bool)
    allowed[np.asarray(trained, int)] = True
    return restrict(prob, allowed)


class ClassifierGate:
    """A run's image classifier applied to untagged images: ``gate(prob, image)`` is
    :func:`gate_probs` with the classifier's class probabilities at ``scales``.

    ``model`` and ``state`` are what :func:`tasks.store.load_model` returns for the classifier."""

    def __init__(self, model: torch.nn.Module, state: dict, scales: Sequence[float] = (1.0,)):
        self.model = model
        self.object_classes = state["meta"]["object_classes"]
        self.scales = tuple(scales)

    @classmethod
    def of_run(cls, store: Store, scales: Sequence[float]) -> "ClassifierGate":
        """The gate of a run directory's own image classifier."""
        return cls(*store.read_model("classifier"), scales)

    def __call__(self, prob: np.ndarray, image: np.ndarray) -> np.ndarray:
        return gate_probs(prob, tr.image_class_probs(self.model, image, scales=self.scales), self.object_classes)


def background_score(threshold: float, object_tags: int) -> float:
    """The implicit background's CAM score on an image with ``object_tags`` object tags:
    ``threshold ** (1 / n)``, the score the strongest of n independent uniform maps stays below
    as often as one map stays below ``threshold`` (so the chance that a background pixel stays
    background is the same at every tag count; a constant score lost to it, see
    docs/benchmarks.md#defaults-and-why).

    >>> background_score(0.36, 2), background_score(0.36, 1)
    (0.6, 0.36)
    """
    return float(threshold ** (1.0 / max(object_tags, 1)))


def cam_to_prob(cams: np.ndarray, allowed: np.ndarray, background: int | None,
                background_threshold: float) -> np.ndarray:
    """Turn (K, H, W) CAMs in [0, 1] into probabilities over the allowed classes; the implicit
    background class, when there is one, scores ``background_threshold`` raised with the image's
    object tags (:func:`background_score`)."""
    c = cams.copy()
    if background is not None:
        n_objects = int(np.count_nonzero(allowed)) - int(bool(allowed[background]))
        c[background] = background_score(background_threshold, n_objects)
    return restrict(c, allowed)


def cam_to_prob_centered(class_maps: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Probabilities over the allowed classes from raw (K, H, W) class maps (logit units): each
    class map minus its own image mean, softmax over the allowed classes.

    Centring removes each class's image-level offset (what the global pooling learned for the
    tag), so the comparison between classes at a pixel is about where each class sits, not how
    confident the image-level score is. Measured on msrc21 train (276 images, one classifier):
    0.420 mIoU against 0.383 for max-normalised ReLU CAMs and 0.406 for the uncentred maps.
    """
    c = class_maps - class_maps.reshape(len(class_maps), -1).mean(1)[:, None, None]
    c = np.where(allowed[:, None, None], c, -np.inf)
    c = np.exp(c - c.max(0, keepdims=True))
    return (c / c.sum(0, keepdims=True)).astype(np.float32)


def max_normalize(prob: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(K, H, W) probabilities with each allowed class divided by its own maximum over the image,
    renormalised over the allowed classes.

    A tag says its class is in the image, so its strongest pixels should go to it even when the
    network, trained on a corpus where the class is small, never makes it the most probable
    class anywhere. Measured on msrc21 train (round 1's preliminary result, a class-balanced
    round-0 model): 0.466 mIoU as it is, 0.496 normalised."""
    peak = prob.reshape(len(prob), -1).max(1)
    return restrict(prob / np.maximum(peak, 1e-6)[:, None, None], allowed)


def labels_from_prob(prob: np.ndarray) -> np.ndarray:
    return prob.argmax(0).astype(np.uint8)


def make_pseudo_label(image: np.ndarray, feat: ImageFeatures, proposal_prob: np.ndarray, prelim: np.ndarray,
                      classes: ClassSpec, tags: tuple[str, ...], cfg: ProposalConfig,
                      seed: int) -> tuple[np.ndarray, dict]:
    """Steps 5-7 for one image (filtering, fusion, 3-way clustering, seeded segmentation)."""
    object_tags = np.zeros(classes.n, bool)
    for t in tags:
        object_tags[classes.index(t)] = True
    return pseudo_label(
        image, feat.superpixels, feat.membership, proposal_prob, prelim, object_tags,
        background=classes.background, t1=cfg.t1, p1=cfg.p1, t2=cfg.t2, p2=cfg.p2,
        fusion=cfg.fusion, k=cfg.k, threshold=cfg.threshold, seeding=cfg.seeding, beta=cfg.beta,
        downscale=cfg.downscale, seed=seed, prior_weight=cfg.seed_prior_weight,
        grabcut_iters=cfg.grabcut_iters)


def cam_probs(model: torch.nn.Module, state: dict, image: np.ndarray, allowed: np.ndarray, classes: ClassSpec,
              cfg: ClassifierConfig, maps_levels: tuple[int, ...] | None = None):
    """Step 1, round 0: (K, H, W) probabilities over the allowed classes from the image
    classifier's class maps: centred class maps (:func:`cam_to_prob_centered`) when every pixel
    belongs to a tag (no implicit background), else max-normalised CAMs against the implicit
    background's score (:func:`cam_to_prob`). With ``maps_levels``: ``(probabilities, maps)``, the
    encoder's maps of the same pass (:func:`tasks.common.training.class_activation_maps`)."""
    obj = state["meta"]["object_classes"]
    cams = np.zeros((classes.n,) + image.shape[:2], np.float32)
    centered = classes.background is None
    got = tr.class_activation_maps(model, image, scales=tuple(cfg.cam_scales), raw=centered, maps_levels=maps_levels)
    cams[obj], maps = got if maps_levels is not None else (got, None)
    prob = cam_to_prob_centered(cams, allowed) if centered else \
        cam_to_prob(cams, allowed, classes.background, cfg.background_threshold)
    return prob if maps_levels is None else (prob, maps)


def round0_cam(model: torch.nn.Module, state: dict, image: np.ndarray, allowed: np.ndarray, classes: ClassSpec,
               config: WSSSConfig, superpixels: Callable[[], np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """Round 0's CAM probabilities of one image (:func:`cam_probs`) and, from the same pass, its
    superpixel features (:func:`tasks.wsss.deep_features.pool_superpixels` over ``superpixels()``,
    the image's superpixels), or None without ``features.deep_features``."""
    if config.features.deep_features == "none":
        return cam_probs(model, state, image, allowed, classes, config.classifier), None
    prob, maps = cam_probs(model, state, image, allowed, classes, config.classifier,
                           maps_levels=levels_of(config.features.deep_strides))
    return prob, pool_superpixels(maps, superpixels())


def label_prior(label: np.ndarray, allowed: np.ndarray, n_classes: int, hold: float = 0.5) -> np.ndarray:
    """(K, H, W) prior from a label map: each pixel's label holds ``hold`` of it and the
    ``allowed`` classes share the rest evenly; a pixel without a label (ignore, or a class not
    allowed) is even over the allowed classes.

    >>> p = label_prior(np.array([[0, 2]]), np.array([True, False, True]), 3)
    >>> p[:, 0, 0].tolist(), p[:, 0, 1].tolist()
    ([0.75, 0.0, 0.25], [0.25, 0.0, 0.75])
    """
    idx = np.flatnonzero(allowed)
    onehot = label[None] == idx[:, None, None]  # as tasks.labels.corrections.corrected_prelim builds it
    out = np.zeros((n_classes,) + label.shape, np.float32)
    out[idx] = np.where(onehot.any(0), hold * onehot + (1.0 - hold) / len(idx), 1.0 / len(idx))
    return out


def model_prelim_probs(model: torch.nn.Module, image: np.ndarray, edges: np.ndarray | None, allowed: np.ndarray,
                       config: WSSSConfig, prior: np.ndarray | None = None) -> np.ndarray:
    """Step 1, rounds >= 1: the previous round's model's probabilities over the allowed classes,
    each class max-normalised (``prelim_normalize``) and mixed with round 0's (``prior_weight``)."""
    prob = restrict(tr.predict_probs(model, image, edges), allowed)
    if config.prelim_normalize:
        prob = max_normalize(prob, allowed)
    return mix_prior(prob, prior, allowed, config.prior_weight) if config.prior_weight > 0 else prob


def mix_prior(prob: np.ndarray, prior: np.ndarray, allowed: np.ndarray, weight: float) -> np.ndarray:
    """The geometric mixture ``prob ** (1 - weight) * prior ** weight`` over the ``allowed``
    classes: with :func:`label_prior` at weight 0.5, a model that is unsure keeps round 0's label
    and one that is sure overrides it.

    >>> allowed = np.array([True, True])
    >>> prior = label_prior(np.zeros((1, 2), np.uint8), allowed, 2)  # round 0 said class 0
    >>> mix_prior(np.array([[[0.4, 0.1]], [[0.6, 0.9]]]), prior, allowed, 0.5).argmax(0).tolist()
    [[0, 1]]
    """
    return restrict((prob + 1e-4) ** (1 - weight) * (prior + 1e-4) ** weight, allowed)


# ---------------------------------------------------------------------------- one image of a round
def prelim_model(store: Store, r: int) -> tuple[torch.nn.Module, dict]:
    """The network of round ``r``'s preliminary result: the image classifier (round 0) or round
    r-1's segmenter, as :func:`tasks.store.load_model` returns it."""
    return store.read_model("classifier") if r == 0 else store.read_model("segmenter", r - 1)


def training_sample(records: Iterable[ImageRecord], limit: int | None, seed: int,
                    keep: Collection[str] = ()) -> list[ImageRecord]:
    """The images the corpus-wide trainers learn from (``WSSSConfig.train_images``): all of
    ``records``, or the ``limit`` whose keyed hash of (``seed``, id) is lowest, always with those
    in ``keep`` (the images a person corrected), in the order of ``records``. A hash rank, not a
    draw over the list: an ingest that adds or removes images changes the sample only by as many
    images, and the same corpus, limit and seed give the same sample in every process.

    ``records`` is read once as it comes (a split's rows streamed: :meth:`Store.split_rows`): the
    flow holds at most ``limit`` rows besides those in ``keep`` (a heap of the lowest ranks, ties
    in the order of ``records``), not the whole split."""
    if limit is None:
        return list(records)
    keep, salt = set(keep), str(seed).encode()
    kept: list[tuple[int, ImageRecord]] = []  # (position, row) of the images in keep
    heap: list[tuple[int, int, int, ImageRecord]] = []  # (-rank, -position, position, row): the limit lowest
    n = 0
    for pos, r in enumerate(records):
        n += 1
        if r.image_id in keep:
            kept.append((pos, r))
            continue
        rank = int.from_bytes(hashlib.blake2b(r.image_id.encode(), digest_size=8, key=salt[:64]).digest(), "big")
        item = (-rank, -pos, pos, r)
        if len(heap) < limit:
            heapq.heappush(heap, item)
        elif heap and item > heap[0]:  # a lower rank (or the same, earlier) than the worst one held
            heapq.heapreplace(heap, item)
    if n <= limit:  # every row is held: all of them
        chosen = kept + [(pos, r) for _, _, pos, r in heap]
    else:
        best = sorted(heap, reverse=True)[:max(0, limit - len(keep))]
        chosen = kept + [(pos, r) for _, _, pos, r in best]
    return [r for _, r in sorted(chosen, key=lambda x: x[0])]


def split_tags(store: Store, split: str) -> Iterator[list[str]]:
    """The tags of each image of ``split``, read a batch at a time (one column)."""
    for batch in store.manifest_batches(split, columns=["tags"]):
        yield from batch.column("tags").to_pylist()


def foreground_on(store: Store, config: WSSSConfig) -> tuple[bool, dict]:
    """Whether the run's class-agnostic foreground path is on (``config.foreground.mode``, from
    the tag statistics of the training split: :func:`tasks.wsss.foreground.foreground_active`), and
    those statistics."""
    classes = store.classes()
    stats = tag_statistics(split_tags(store, config.split), classes.names, classes.background)
    return fg.foreground_active(stats, config.foreground.mode), stats


def round0_prior(store: Store, rec: ImageRecord, classes: ClassSpec) -> np.ndarray:
    """(K, H, W) what rounds >= 1 keep of round 0 for one image: its pseudo-label as
    :func:`label_prior` (round 0's labels kept the rare classes a segmenter forgets better than
    its preliminary result did, see docs/benchmarks.md#the-rounds-keep-round-0s-labels)."""
    label = store.pseudo(0, rec.image_id)
    if label is None:
        raise FileNotFoundError(f"{store.round_dir(0)}: no round 0 pseudo-label of {rec.image_id} "
                                "(the rounds >= 1 keep it as their prior)")
    return label_prior(label, classes.tag_vector(rec.tags), classes.n)


def preliminary_image(store: Store, rec: ImageRecord, r: int, model: torch.nn.Module, state: dict, classes: ClassSpec,
                      key: str, config: WSSSConfig, foreground: bool = False, corrected: Collection[str] = (),
                      clusters: fg.CorpusClusters | None = None) -> None:
    """Step 1 for one image: its preliminary result of round ``r`` (``model``, ``state``: those
    of :func:`prelim_model`), written to the store; round 0 also writes the CAM labels. With
    ``foreground`` (:func:`foreground_on`), round 0's result is the class-agnostic foreground
    evidence (:func:`foreground_start`, from the image's saliency and the corpus's ``clusters``)
    instead of the CAMs'. An image in ``corrected`` (the ids of :meth:`Store.corrections`) has its
    correction as the result where it labels a pixel (:func:`tasks.labels.corrections.corrected_prelim`)."""
    image = store.image(rec.image_id)
    allowed = classes.tag_vector(rec.tags)
    if r == 0:
        prob, deep = round0_cam(model, state, image, allowed, classes, config,
                                lambda: load_superpixels(store, rec, key))
        store.write_pseudo(r, rec.image_id, labels_from_prob(prob), name="cam")
        if deep is not None:
            store.write_deep(rec.image_id, deep)
        if foreground and classes.background is not None:
            prob = foreground_start(image, load_superpixels(store, rec, key), deep, prob, allowed, classes.background,
                                    config, clusters)
    else:
        edges = load_edges(store, rec, key) if state["in_channels"] == 4 else None
        prior = round0_prior(store, rec, classes) if config.prior_weight > 0 else None
        prob = model_prelim_probs(model, image, edges, allowed, config, prior)
    if rec.image_id in corrected:
        prob = corrected_prelim(store.correction(rec.image_id), prob, allowed)
    idx = np.flatnonzero(allowed)
    store.write_prelim(r, rec.image_id, prob[idx], idx)


def foreground_start(image: np.ndarray, sp_labels: np.ndarray, deep: np.ndarray | None, cam_prob: np.ndarray,
                     allowed: np.ndarray, background: int, config: WSSSConfig,
                     clusters: fg.CorpusClusters | None) -> np.ndarray:
    """(K, H, W) round 0's preliminary result of one image on the foreground path: its
    foreground (:func:`tasks.wsss.foreground.start_foreground`: the image's saliency and the
    corpus ``clusters``' at ``foreground.cluster_weight``) shared among its object tags by
    ``cam_prob`` (:func:`tasks.wsss.foreground.foreground_probs`)."""
    fg_sp = fg.start_foreground(image, sp_labels, None if deep is None else cluster_features(deep, config), clusters,
                                config.foreground.cluster_weight)
    return fg.foreground_probs(fg_sp[sp_labels], cam_prob, allowed, background)


def cluster_features(deep: np.ndarray, config: WSSSConfig) -> np.ndarray:
    """The columns of round 0's superpixel features (``deep``) the corpus clusters read: those of
    the stride-16 maps (the coarsest pooled where 16 is not), the encoder's object-level view; with
    the stride-8 columns beside them the clusters split colours more than objects (msrc21's people:
    object IoU 0.546 against 0.699 from stride 16 alone, 2026-12-07)."""
    strides = tuple(config.features.deep_strides)
    return deep[:, stride_columns(config.classifier.encoder, strides, 16 if 16 in strides else max(strides))]


def uses_clusters(config: WSSSConfig) -> bool:
    """Whether the foreground path's round 0 reads corpus-wide clusters (:func:`fit_round_clusters`):
    a cluster weight above 0 and superpixel features from round 0's CAM pass to cluster."""
    return config.foreground.cluster_weight > 0 and config.features.deep_features != "none"


def fit_round_clusters(store: Store, records: Sequence[ImageRecord], key: str, config: WSSSConfig,
                       max_rows: int = 200_000) -> fg.CorpusClusters:
    """The foreground path's corpus clusters (:func:`tasks.wsss.foreground.fit_clusters`) over round 0's
    superpixel features of ``records`` (the trainers' images), each image giving at most its share
    of ``max_rows`` superpixels; stored with round 0 and read back when they are there already
    (a resumed round 0, a refresh of new images)."""
    got = round_clusters(store, config)
    if got is not None:
        return got
    if not records:
        raise ValueError("the foreground path's clusters need at least one training image")
    per_image = max(1, -(-max_rows // len(records)))
    rng = np.random.default_rng(config.seed)

    def rows() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for rec in records:
            feats = store.deep(rec.image_id)
            if feats is None:
                raise FileNotFoundError(f"{store.round_dir(0)}: no superpixel features of {rec.image_id} "
                                        "(round 0's CAM pass writes them); run `wsseg train` again")
            feats, border = cluster_features(feats, config), fg.border_superpixels(load_superpixels(store, rec, key))
            if len(feats) > per_image:
                keep = np.sort(rng.choice(len(feats), per_image, replace=False))
                feats, border = feats[keep], border[keep]
            yield feats, border

    clusters = fg.fit_clusters(rows(), seed=config.seed, max_rows=max_rows)
    store.write_foreground_clusters(clusters.to_dict())
    return clusters


def round_clusters(store: Store, config: WSSSConfig) -> fg.CorpusClusters | None:
    """Round 0's stored corpus clusters when the run uses them (:func:`uses_clusters`), else None."""
    got = store.foreground_clusters() if uses_clusters(config) else None
    return None if got is None else fg.CorpusClusters.from_dict(got)


def foreground_prelim_shard(run_dir: str, ids: list[str], key: str, config: WSSSConfig,
                            records: list[ImageRecord] | None = None) -> dict:
    """Round 0 on the foreground path, after the corpus clusters are fitted: each image's
    preliminary result made again from its saliency and the clusters (:func:`foreground_start`),
    its object tags sharing the foreground as round 0's CAM pass shared it (its stored preliminary
    result: the same shares, whichever of the two wrote it)."""
    _worker_setup()
    store = Store(run_dir)
    shard = store.shard_name(ids)
    if store.shard_done(0, "foreground", shard):
        return {"images": len(ids), "skipped": True}
    classes = store.classes()
    clusters = round_clusters(store, config)
    corrected = store.corrections().keys()
    with store.packing(shard):
        for rec in shard_records(store, ids, records):
            allowed = classes.tag_vector(rec.tags)
            prob = foreground_start(store.image(rec.image_id), load_superpixels(store, rec, key),
                                    store.deep(rec.image_id), store.prelim(0, rec.image_id, classes.n), allowed,
                                    classes.background, config, clusters)
            if rec.image_id in corrected:
                prob = corrected_prelim(store.correction(rec.image_id), prob, allowed)
            idx = np.flatnonzero(allowed)
            store.write_prelim(0, rec.image_id, prob[idx], idx)
    store.mark_shard_done(0, "foreground", shard, {"images": len(ids)})
    run_log(f"round 0 foreground start: {len(ids)} images from {ids[0]}")
    return {"images": len(ids), "skipped": False}


def pseudo_evidence(f: ImageFeatures, prelim: np.ndarray, allowed: np.ndarray, mil_model,
                    mil_weight: float = 0.0) -> np.ndarray:
    """The (K, H, W) evidence fusion starts from: the preliminary result refined by the round's
    MIL classifier (when it has one)."""
    if mil_model is not None:
        prelim = spx.paint(sp_evidence(f, prelim, allowed, mil_model, mil_weight), f.superpixels)
    return prelim


def foreground_pseudo_label(image: np.ndarray, f: ImageFeatures, prelim: np.ndarray, prob: np.ndarray,
                            allowed: np.ndarray, classes: ClassSpec, mil_model, cfg: ForegroundConfig, seed: int,
                            mil_weight: float = 0.0) -> np.ndarray:
    """Steps 5-7 on the foreground path: GrabCut of the whole image from
    the mean foreground probability of the preliminary result, the MIL evidence (when the round
    has a MIL classifier) and the proposal scores (:func:`tasks.wsss.foreground.foreground_label`)."""
    evidence = [prelim]
    if mil_model is not None:
        evidence.append(spx.paint(sp_evidence(f, prelim, allowed, mil_model, mil_weight), f.superpixels))
    evidence.append(spx.paint(superpixel_scores(prob, f.membership), f.superpixels))
    return fg.foreground_label(image, evidence, allowed, classes.background, iterations=cfg.grabcut_iters,
                               sure=cfg.grabcut_sure, border=cfg.grabcut_border, seed=seed)


def image_pseudo_label(image: np.ndarray, f: ImageFeatures, prelim: np.ndarray, clf, mil_model, allowed: np.ndarray,
                       classes: ClassSpec, tags: tuple[str, ...], cfg: ProposalConfig, seed: int,
                       mil_weight: float = 0.0, foreground: ForegroundConfig | None = None) -> np.ndarray:
    """Steps 3 and 5-7 for one image, without the store: proposal scores, then the foreground
    path's GrabCut (``foreground`` given) or the evidence, filtering, fusion, 3-way clustering
    and seeded segmentation."""
    prob = predict_proposals(clf, proposal_inputs(f), allowed)
    if foreground is not None and classes.background is not None:
        return foreground_pseudo_label(image, f, prelim, prob, allowed, classes, mil_model, foreground, seed,
                                       mil_weight)
    prelim = pseudo_evidence(f, prelim, allowed, mil_model, mil_weight)
    label, _ = make_pseudo_label(image, f, prob, prelim, classes, tags, cfg, seed)
    return label


def pseudo_image(store: Store, rec: ImageRecord, r: int, clf, mil_model, classes: ClassSpec, key: str, cfg: ProposalConfig,
                 seed: int, mil_weight: float = 0.0, foreground: ForegroundConfig | None = None,
                 corrected: Collection[str] = (), prelim: np.ndarray | None = None) -> np.ndarray:
    """Steps 5-7 for one image with round ``r``'s proposal classifier ``clf`` and MIL classifier
    (``mil_model``, None when the round has none): its (H, W) uint8 pseudo-label, also written to
    the store. ``foreground``: the run's foreground settings when its foreground path is on
    (:func:`foreground_on`), else None. An image in ``corrected`` (:meth:`Store.corrections`)
    keeps its correction: nothing is computed, no round overwrites it. ``prelim``: the image's
    preliminary result of round ``r`` when the caller has read it already."""
    if rec.image_id in corrected:
        label = store.correction(rec.image_id)
        store.write_pseudo(r, rec.image_id, label)
        return label
    label = image_pseudo_label(store.image(rec.image_id), load_features(store, rec, key),
                               store.prelim(r, rec.image_id, classes.n) if prelim is None else prelim, clf, mil_model,
                               classes.tag_vector(rec.tags), classes, rec.tags, cfg, seed, mil_weight, foreground)
    store.write_pseudo(r, rec.image_id, label)
    return label


# ---------------------------------------------------------------------------- shard loops
# The flows wrap each of these in a Prefect task that runs on a Dask worker; they live here,
# importable by name, so that workers unpickle them by reference. They take handles (a run
# directory, image ids, checkpoint kinds) and typed configuration sections, and return small
# results: every array goes to the store.

def _worker_setup() -> None:
    """One thread per worker process, for torch and for OpenCV (whose pthreads pool otherwise
    takes every core in each worker: two workers on two cores ran four threads)."""
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)


def ingest_shard(run_dir: str, ids: list[str], items: dict[str, dict], n_classes: int | None = None,
                 alpha_background: str | Sequence[int] = ALPHA_BACKGROUND) -> dict:
    """Decode, hash and store the images (and evaluation masks) of one shard.

    An image is stored only when it and its mask passed every check (decoding, mask size and
    values: class indices below ``n_classes`` or 255 = void), so nothing is written for a
    rejected one. Returns ``records``, ``problems`` (one line each), ``rejected`` (one entry
    per image: image_id, file, line, problems), ``notes`` (images composited on
    ``alpha_background``), ``written`` (ids whose image this call wrote), ``staged`` (ids whose new
    image or mask replaces a stored one) and ``decoded`` (how many images it decoded). The images
    and masks go into one pack per group (or a few, :data:`~tasks.store.Store.CORPUS_PACK_BYTES`
    each) whose index waits in the store's staging area until the flow accepts the ingest
    (:meth:`tasks.store.Store.commit_staged`): a refused ingest leaves the stored corpus as it was.

    An image (or mask) whose file has the sha256 of the stored one is not decoded again: an
    ingest again of a grown source reads and hashes the unchanged files' bytes, nothing more."""
    store = Store(run_dir)
    records, problems, rejected, notes, written, staged = [], [], [], [], [], []
    with store.packing(store.shard_name(ids)):
        for iid in ids:
            it = items[iid]
            path = Path(it["image_path"])
            image = note = mask = mask_sha = None
            try:
                sha = sha256_file(path)
                if store.has_image(iid, sha):
                    shape = store.image_shape(iid)
                else:
                    image, note = decode_image(path, alpha_background)
                    shape = image.shape
                if it["mask_path"]:
                    mask_sha = sha256_file(it["mask_path"])
                    if image is not None or not store.has_stored_mask(iid, mask_sha):
                        mask = load_mask(Path(it["mask_path"]), tuple(shape[:2]), n_classes)
            except (ValueError, OSError) as e:
                problems.append(str(e))
                rejected.append(dict(image_id=iid, file=str(path), line=it.get("line"), problems=[str(e)]))
                continue
            if (image is not None and store.has_stored_image(iid)) or (image is None and mask is not None):
                staged.append(iid)  # replaces a stored image or mask
            if image is not None:
                store.put_image(iid, image, sha, staged=True)
                written.append(iid)
            if mask is not None:
                store.put_mask(iid, mask, mask_sha, staged=True)
            store.flush_packed(store.CORPUS_PACK_BYTES)
            if note:
                notes.append(note)
            records.append(dict(image_id=iid, height=int(shape[0]), width=int(shape[1]), tags=list(it["tags"]),
                                sha256=sha, split=it["split"], source=str(path), has_mask=mask_sha is not None))
    return {"records": records, "problems": problems, "rejected": rejected, "notes": notes, "written": written,
            "staged": staged, "decoded": len(written)}


def features_shard(run_dir: str, ids: list[str], cfg: FeatureConfig, key: str,
                   records: list[ImageRecord] | None = None) -> dict:
    """Step 2 for one shard: the feature-cache entries of images ``ids`` (``records``: their
    manifest rows, as every shard function takes them: :func:`tasks.store.shard_records`)."""
    _worker_setup()
    store = Store(run_dir)
    recs = shard_records(store, ids, records)
    t0 = time.perf_counter()
    with store.packing(store.shard_name(ids)):  # one pack of the shard's feature-cache entries
        computed = sum(compute_features(store, rec, cfg, key) for rec in recs)
    seconds = time.perf_counter() - t0
    run_log(f"features: {len(ids)} images from {ids[0]}, {int(computed)} computed, {seconds:.1f} s")
    return {"images": len(ids), "computed": int(computed), "seconds": seconds}


def preliminary_shard(run_dir: str, ids: list[str], round_index: int, key: str, config: WSSSConfig,
                      records: list[ImageRecord] | None = None, foreground: bool | None = None) -> dict:
    """Step 1: preliminary result of each image (round 0: the image classifier's CAMs; later:
    round r-1's model), restricted to the image's tags. Round 0 also stores the CAM labels (the
    baseline row). ``foreground``: whether the run is on the class-agnostic foreground path, as
    its flow decided it once (:func:`foreground_on`, which reads the whole manifest); None: decided here."""
    _worker_setup()
    store = Store(run_dir)
    r = round_index
    if store.shard_done(r, "prelim", store.shard_name(ids)):
        return {"images": len(ids), "skipped": True}
    classes = store.classes()
    model, state = prelim_model(store, r)
    foreground = r == 0 and (foreground_on(store, config)[0] if foreground is None else foreground)
    corrected = store.corrections().keys()
    with store.packing(store.shard_name(ids)):  # written before the marker below
        for rec in shard_records(store, ids, records):
            preliminary_image(store, rec, r, model, state, classes, key, config, foreground, corrected)
    store.mark_shard_done(r, "prelim", store.shard_name(ids), {"images": len(ids)})
    run_log(f"round {r} preliminary result: {len(ids)} images from {ids[0]}")
    return {"images": len(ids), "skipped": False}


def start_name(foreground: ForegroundConfig | None) -> str:
    """What :func:`start_labels` compares with, in words (the stop reason names it)."""
    return "the CAM labels" if foreground is None else "round 0's preliminary result"


def start_labels(store: Store, rec: ImageRecord, classes: ClassSpec, foreground: ForegroundConfig | None,
                 prelim0: np.ndarray | None = None) -> np.ndarray | None:
    """The labels round 0 started from, which its changed share and round 1's reverted fraction
    are measured against (:mod:`tasks.wsss.stopping`): the CAM labels, or on the class-agnostic
    foreground path (``foreground`` given) the argmax of round 0's preliminary result
    (``prelim0`` when the caller has read it), which there comes from the images' saliency, not
    from the CAM. The CAM of a corpus with one tag set has learnt nothing of where the object is
    (object IoU 0.18 on the msrc21 objects corpus), so measured against it most of a round's
    changes looked like reversals: round 1 there sent 0.55 of its changed pixels "back to the CAM
    labels" and 0.21 back to round 0's start, and the oscillation rule stopped a round that had
    raised the object IoU from 0.719 to 0.745 (docs/benchmarks.md#one-class-corpus)."""
    if foreground is None:
        return store.pseudo(0, rec.image_id, name="cam")
    if prelim0 is None:
        prelim0 = store.prelim(0, rec.image_id, classes.n)
    return prelim0.argmax(0).astype(np.uint8)


def pseudo_shard(run_dir: str, ids: list[str], round_index: int, key: str, cfg: ProposalConfig, seed: int,
                 mil_weight: float = 0.0, foreground: ForegroundConfig | None = None,
                 records: list[ImageRecord] | None = None) -> dict:
    """Steps 5-7 for one shard: proposal probabilities, filtering, fusion, seeded segmentation,
    with the round's proposal classifier and (when the round has one) its MIL classifier;
    ``foreground`` as in :func:`pseudo_image`."""
    _worker_setup()
    store = Store(run_dir)
    done = store.shard_done(round_index, "pseudo", store.shard_name(ids))
    if done:
        return done
    classes = store.classes()
    clf = store.read_classifier("proposal_classifier", round_index)["model"]
    mil_model = round_mil_model(store, round_index)
    corrected = store.corrections().keys()
    # pixel counts summed over the shard: a result of the same size at any shard size (nothing per image)
    totals = {"pixels": 0, "changed_pixels": 0, "reverted_pixels": 0, "ignore_pixels": 0}
    # per class: the log label shares on the images tagged with it, summed (tasks.wsss.stopping's tag coverage)
    log_shares, tagged = np.zeros(classes.n), np.zeros(classes.n, np.int64)
    review = []  # per image: the review queue's signals (tasks.labels.review)
    with store.packing(store.shard_name(ids)):  # the shard's labels, one pack, written before its marker
        for rec in shard_records(store, ids, records):
            prelim = store.prelim(round_index, rec.image_id, classes.n)  # read once: the label and the review signals
            label = pseudo_image(store, rec, round_index, clf, mil_model, classes, key, cfg, seed, mil_weight,
                                 foreground, corrected, prelim)
            previous = store.pseudo(round_index - 1, rec.image_id) if round_index > 0 else \
                start_labels(store, rec, classes, foreground, prelim)
            before = (store.pseudo(round_index - 2, rec.image_id) if round_index > 1 else
                      start_labels(store, rec, classes, foreground) if round_index == 1 else None)
            n = int(label.size)
            totals["pixels"] += n
            totals["changed_pixels"] += round(changed_share(label, previous) * n) if previous is not None else n
            totals["reverted_pixels"] += round(reverted_share(label, previous, before) * n)
            totals["ignore_pixels"] += round(ignore_share(label) * n)
            ls, t = tag_log_shares(label, classes.tag_vector(rec.tags).nonzero()[0], classes.n)
            log_shares, tagged = log_shares + ls, tagged + t
            object_tags = [c for c in (classes.index(x) for x in rec.tags) if c != classes.background]
            review.append({"image_id": rec.image_id, "corrected": rec.image_id in corrected,
                           **image_signals(label, prelim, classes.tag_vector(rec.tags), previous, object_tags)})
    store.write_review(round_index, store.shard_name(ids), review)
    result = {"images": len(ids), **totals, "tag_log_shares": log_shares.tolist(), "tagged": tagged.tolist()}
    store.mark_shard_done(round_index, "pseudo", store.shard_name(ids), result)
    run_log(f"round {round_index} pseudo-labels: {len(ids)} images from {ids[0]}, changed share "
            f"{totals['changed_pixels'] / max(totals['pixels'], 1):.3f}")
    return result


def evaluate_shard(run_dir: str, ids: list[str], sources: list[list], model: dict | None = None,
                   key: str | None = None, gate_scales: Sequence[float] | None = None,
                   records: list[ImageRecord] | None = None) -> dict:
    """Confusion matrices of label sources against the masks (the only place masks are read).

    ``sources``: [round, name] pairs of stored label maps, or ["model", split] to predict with
    the checkpoint ``model`` first (keywords of :meth:`Store.read_model`: ``kind``, ``r``,
    ``name``). With ``gate_scales`` the model's output is gated by the run's image classifier
    (:func:`gate_probs`, the classifier at those scales) and the ungated output is measured too,
    as "model_ungated:<split>".
    """
    _worker_setup()
    store = Store(run_dir)
    n = store.classes().n
    accs = {f"{a}:{b}": ConfusionAccumulator(n) for a, b in sources}
    net = gate = None
    if model:
        net, state = store.read_model(**model)
    if model and gate_scales is not None:
        gate = ClassifierGate.of_run(store, gate_scales)
        accs.update({f"model_ungated:{b}": ConfusionAccumulator(n) for a, b in sources if a == "model"})
    for rec in shard_records(store, ids, records):
        gt = store.mask(rec.image_id)
        if gt is None:
            continue
        for a, b in sources:
            if a == "model":
                image = store.image(rec.image_id)
                edges = load_edges(store, rec, key) if state["in_channels"] == 4 else None
                prob = trained_classes_only(tr.predict_probs(net, image, edges), state)
                if gate is not None:
                    accs[f"model_ungated:{b}"].update(prob.argmax(0).astype(np.uint8), gt)
                    prob = gate(prob, image)
                pred = prob.argmax(0).astype(np.uint8)
            else:
                pred = store.pseudo(int(a), rec.image_id, name=b)
                if pred is None:
                    continue
            accs[f"{a}:{b}"].update(pred, gt)
    return {k: acc.conf.tolist() for k, acc in accs.items()}


def box_grabcut_shard(run_dir: str, ids: list[str], inset: float = 0.1, iterations: int = 3,
                      records: list[ImageRecord] | None = None) -> dict:
    """``bench quality``'s per-image baseline on an implicit-background corpus, stored as round 0's
    ``box_grabcut`` labels: GrabCut from a box inset ``inset`` from the border
    (:func:`tasks.wsss.foreground.box_grabcut`), nothing learnt. Its foreground goes to the image's
    object tag; with several, each pixel to the round-0 CAM label's object class there, or else
    the object tag the CAM gives most pixels. Untagged images are all background. Images already
    stored are skipped (round 0 holds them only while its CAMs are the same), so a second
    ``bench quality`` on a run directory does not compute them again."""
    _worker_setup()
    store = Store(run_dir)
    classes = store.classes()
    bg = classes.background
    if bg is None:
        raise ValueError(f"{run_dir}: box GrabCut needs an implicit background class; this corpus has none")
    done = 0
    with store.packing(store.shard_name(ids)):  # the shard's labels as one pack
        for rec in shard_records(store, ids, records):
            if store.has_pseudo(0, rec.image_id, name="box_grabcut"):
                continue
            image = store.image(rec.image_id)
            obj = [classes.index(t) for t in rec.tags if classes.index(t) != bg]
            label = np.full(image.shape[:2], bg, np.uint8)
            if obj:
                fgm = fg.box_grabcut(image, inset, iterations)
                cam = store.pseudo(0, rec.image_id, name="cam")
                if len(obj) == 1 or cam is None:
                    label[fgm] = obj[0]
                else:
                    counts = [int(np.count_nonzero(cam == c)) for c in obj]
                    fill = np.where(np.isin(cam, obj), cam, obj[int(np.argmax(counts))])
                    label[fgm] = fill[fgm]
            store.write_pseudo(0, rec.image_id, label, name="box_grabcut")
            done += 1
    return {"images": len(ids), "computed": done}

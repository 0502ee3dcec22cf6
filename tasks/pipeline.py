"""Per-image steps of a refresh round: the pure functions of tasks/ composed with the store.

Each function handles one image and is what a shard task loops over. They read and write only
through :class:`tasks.store.Store`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

import models
from tasks import training as tr
from tasks.ingest import load_image, load_mask
from tasks.metrics import ConfusionAccumulator, changed_share, ignore_share
from tasks.proposal_classifier import combine_evidence, predict_proposals, superpixel_scores

from tasks import mil
from tasks import superpixels as spx
from tasks.edges import feature_region_map
from tasks.features import proposal_features, superpixel_features
from tasks.fusion import pseudo_label
from tasks.proposals import hierarchical_proposals
from tasks.store import (ClassSpec, ImageRecord, Store, arrays_to_sparse, params_key, records_by_id,
                         sha256_file, sparse_to_arrays)

FEATURE_STAGE = "features"


@dataclass
class ImageFeatures:
    edges: np.ndarray          # (H, W) uint8 {0,1} feature-region map
    superpixels: np.ndarray    # (H, W) int32
    sp_features: np.ndarray    # (S, D) float32
    membership: sp.csr_matrix  # (P, S) bool
    sp_areas: np.ndarray       # (S,) int64


def feature_key(fcfg: dict) -> str:
    return params_key({"stage": FEATURE_STAGE, "version": 1, **fcfg})


def compute_features(store: Store, rec: ImageRecord, fcfg: dict, key: str) -> bool:
    """Superpixels, feature-region map, superpixel features and proposals of one image,
    cached by image content and parameters. Returns False when the cache already had them."""
    if store.has_cached(FEATURE_STAGE, key, rec.sha256):
        return False
    image = store.image(rec.image_id)
    edges = feature_region_map(image, sigma=fcfg["edge_sigma"], tau=fcfg["edge_tau"])
    labels = spx.superpixels(image, method=fcfg["superpixel_method"], region_size=fcfg["region_size"],
                             ruler=fcfg["ruler"])
    feats = superpixel_features(image, labels, edge_map=edges)
    membership = hierarchical_proposals(image, labels, edge_map=edges, min_size=fcfg["proposal_min_size"],
                                        diversify=fcfg["proposal_diversify"])
    store.put_cached(FEATURE_STAGE, key, rec.sha256, {
        "edges": edges.astype(np.uint8), "superpixels": labels.astype(np.int32),
        "spfeat": feats.astype(np.float32), **sparse_to_arrays(membership)})
    return True


def load_edges(store: Store, rec: ImageRecord, key: str) -> np.ndarray:
    """The (H, W) feature-region map alone (a network's 4th input channel), without the superpixel parts."""
    return store.cached(FEATURE_STAGE, key, rec.sha256, ("edges",))["edges"]


def load_features(store: Store, rec: ImageRecord, key: str) -> ImageFeatures:
    d = store.cached(FEATURE_STAGE, key, rec.sha256)
    labels = d["superpixels"]
    return ImageFeatures(d["edges"], labels, d["spfeat"], arrays_to_sparse(d),
                         spx.areas(labels, n=d["spfeat"].shape[0]))


def restrict(prob: np.ndarray, allowed: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(K, H, W) probabilities renormalised over the ``allowed`` classes (zero elsewhere)."""
    p = np.where(allowed[:, None, None], np.maximum(prob, 0) + eps, 0.0).astype(np.float32)
    return p / p.sum(0, keepdims=True)


def gate_probs(prob: np.ndarray, class_probs: np.ndarray, object_classes: Sequence[int]) -> np.ndarray:
    """(K, H, W) segmentation probabilities of an untagged image, each object class weighted by
    the image classifier's probability that the image shows it (``class_probs``, one per entry
    of ``object_classes``) and renormalised; the implicit background, if any, keeps weight 1.

    The tags' role at inference: where a training image's tags restrict its labels, an unseen
    image's class probabilities damp the classes it most likely lacks."""
    gate = np.ones(prob.shape[0], np.float32)
    gate[np.asarray(object_classes, int)] = np.clip(class_probs, 0.0, 1.0)
    return restrict(prob * gate[:, None, None], np.ones(prob.shape[0], bool))


class ClassifierGate:
    """A run's image classifier applied to untagged images: ``gate(prob, image)`` is
    :func:`gate_probs` with the classifier's class probabilities at ``scales``."""

    def __init__(self, path: str | Path, scales: Sequence[float] = (1.0,)):
        self.model, state = models.load_checkpoint(path)
        self.object_classes = state["meta"]["object_classes"]
        self.scales = tuple(scales)

    def __call__(self, prob: np.ndarray, image: np.ndarray) -> np.ndarray:
        return gate_probs(prob, tr.image_class_probs(self.model, image, scales=self.scales), self.object_classes)


def cam_to_prob(cams: np.ndarray, allowed: np.ndarray, background: int | None,
                background_threshold: float) -> np.ndarray:
    """Turn (K, H, W) CAMs in [0, 1] into probabilities over the allowed classes; the implicit
    background class, when there is one, scores a constant ``background_threshold``."""
    c = cams.copy()
    if background is not None:
        c[background] = background_threshold
    return restrict(c, allowed)


def cam_to_prob_centered(class_maps: np.ndarray, allowed: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Probabilities over the allowed classes from raw (K, H, W) class maps (logit units): each
    class map minus its own image mean, softmax over the allowed classes.

    Centring removes each class's image-level offset (what the global pooling learned for the
    tag), so the comparison between classes at a pixel is about where each class sits, not how
    confident the image-level score is. Measured on msrc21 train (276 images, one classifier):
    0.420 mIoU against 0.383 for max-normalised ReLU CAMs and 0.406 for the uncentred maps.
    """
    c = class_maps - class_maps.reshape(len(class_maps), -1).mean(1)[:, None, None]
    c = np.where(allowed[:, None, None], c / max(temperature, 1e-6), -np.inf)
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


def cam_mode(mode: str, background: int | None) -> str:
    """``auto``: centred class maps when every pixel belongs to a tag (no implicit background),
    max-normalised CAMs against a constant background score otherwise."""
    return ("centered" if background is None else "normalized") if mode == "auto" else mode


def labels_from_prob(prob: np.ndarray) -> np.ndarray:
    return prob.argmax(0).astype(np.uint8)


def proposal_inputs(feat: ImageFeatures) -> np.ndarray:
    return proposal_features(feat.sp_features, feat.membership, feat.sp_areas)


def load_mil(path: str | Path | None):
    """The round's superpixel MIL classifier (None when the round has none)."""
    if not path:
        return None
    return torch.load(path, weights_only=False)["model"]


def sp_evidence(feat: ImageFeatures, prelim: np.ndarray, allowed: np.ndarray, mil_model, prior_weight: float) -> np.ndarray:
    """(S, K) per-superpixel evidence of one image: the preliminary result pooled per superpixel,
    refined by the round's MIL classifier when there is one."""
    sp_prelim = spx.pool(prelim, feat.superpixels, n=len(feat.sp_areas), channel_axis=0)
    if mil_model is None:
        return sp_prelim
    return mil.evidence(mil_model, feat.sp_features, sp_prelim, allowed, prior_weight)


def make_pseudo_label(image: np.ndarray, feat: ImageFeatures, proposal_prob: np.ndarray, prelim: np.ndarray,
                      classes: ClassSpec, tags: tuple[str, ...], pcfg: dict, seed: int) -> tuple[np.ndarray, dict]:
    """Steps 5-7 for one image (filtering, fusion, 3-way clustering, seeded segmentation)."""
    object_tags = np.zeros(classes.n, bool)
    for t in tags:
        object_tags[classes.index(t)] = True
    return pseudo_label(
        image, feat.superpixels, feat.membership, proposal_prob, prelim, object_tags,
        background=classes.background, t1=pcfg["t1"], p1=pcfg["p1"], t2=pcfg["t2"], p2=pcfg["p2"],
        fusion=pcfg["fusion"], k=pcfg["k"], threshold=pcfg["threshold"], clustering=pcfg["clustering"],
        clustering_lo=pcfg["clustering_lo"], clustering_hi=pcfg["clustering_hi"],
        seeding=pcfg["seeding"], min_confidence=pcfg["min_confidence"], beta=pcfg["beta"],
        downscale=pcfg["downscale"], seed=seed, prior_weight=pcfg["seed_prior_weight"],
        grabcut_iters=pcfg.get("grabcut_iters", 3))


# ---------------------------------------------------------------------------- shard loops
# The flows wrap each of these in a Prefect task that runs on a Dask worker; they live here,
# importable by name, so that workers unpickle them by reference.

def _worker_setup() -> None:
    torch.set_num_threads(1)


def ingest_shard(run_dir: str, ids: list[str], items: dict[str, dict]) -> dict:
    """Decode, hash and store the images (and evaluation masks) of one shard."""
    store = Store(run_dir)
    records, problems = [], []
    for iid in ids:
        it = items[iid]
        path = Path(it["image_path"])
        try:
            sha = sha256_file(path)
            if store.has_image(iid, sha):
                shape = tuple(json.loads((store.corpus_dir / "images.zarr" / iid / "zarr.json").read_text())["shape"])
            else:
                image = load_image(path)
                shape = image.shape
                store.put_image(iid, image, sha)
            has_mask = False
            if it["mask_path"]:
                store.put_mask(iid, load_mask(Path(it["mask_path"]), shape[:2]))
                has_mask = True
        except (ValueError, OSError) as e:
            problems.append(str(e))
            continue
        records.append(dict(image_id=iid, height=int(shape[0]), width=int(shape[1]), tags=list(it["tags"]),
                            sha256=sha, split=it["split"], source=str(path), has_mask=has_mask))
    return {"records": records, "problems": problems}


def features_shard(run_dir: str, ids: list[str], fcfg: dict, key: str) -> dict:
    _worker_setup()
    store = Store(run_dir)
    recs = records_by_id(store.manifest(), ids)
    t0 = time.perf_counter()
    computed = sum(compute_features(store, rec, fcfg, key) for rec in recs)
    return {"images": len(ids), "computed": int(computed), "seconds": time.perf_counter() - t0}


def preliminary_shard(run_dir: str, ids: list[str], round_index: int, model_path: str, kind: str,
                      key: str, cfg: dict) -> dict:
    """Step 1: preliminary result of each image (round 0: CAMs; later: model r-1), restricted
    to the image's tags. Round 0 also stores the CAM labels (the baseline row)."""
    _worker_setup()
    store = Store(run_dir)
    if store.shard_done(round_index, "prelim", ids[0]):
        return {"images": len(ids), "skipped": True}
    classes = store.classes()
    model, state = models.load_checkpoint(model_path)
    for rec in records_by_id(store.manifest(), ids):
        image = store.image(rec.image_id)
        allowed = classes.tag_vector(rec.tags)
        if kind == "cam":
            ccfg = cfg["classifier"]
            obj = state["meta"]["object_classes"]
            cams = np.zeros((classes.n,) + image.shape[:2], np.float32)
            centered = cam_mode(ccfg["cam_mode"], classes.background) == "centered"
            cams[obj] = tr.class_activation_maps(model, image, scales=tuple(ccfg["cam_scales"]), raw=centered)
            prob = cam_to_prob_centered(cams, allowed, ccfg["cam_temperature"]) if centered else \
                cam_to_prob(cams, allowed, classes.background, ccfg["background_threshold"])
            store.write_pseudo(round_index, rec.image_id, labels_from_prob(prob), name="cam")
        else:
            edges = load_edges(store, rec, key) if state["in_channels"] == 4 else None
            prob = restrict(tr.predict_probs(model, image, edges), allowed)
            if cfg.get("prelim_normalize", False):
                prob = max_normalize(prob, allowed)
            w = cfg.get("prior_weight", 0.0)
            if w > 0:
                prior = store.prelim(0, rec.image_id, classes.n)
                prob = restrict((prob + 1e-4) ** (1 - w) * (prior + 1e-4) ** w, allowed)
        idx = np.flatnonzero(allowed)
        store.write_prelim(round_index, rec.image_id, prob[idx], idx)
    store.mark_shard_done(round_index, "prelim", ids[0], {"images": len(ids)})
    return {"images": len(ids), "skipped": False}


def pseudo_shard(run_dir: str, ids: list[str], round_index: int, clf_path: str, key: str, pcfg: dict,
                 seed: int, mil_path: str | None = None, mil_weight: float = 0.0) -> dict:
    """Steps 5-7 for one shard: proposal probabilities, filtering, fusion, seeded segmentation."""
    _worker_setup()
    store = Store(run_dir)
    done = store.shard_done(round_index, "pseudo", ids[0])
    if done:
        return done
    classes = store.classes()
    clf = torch.load(clf_path, weights_only=False)["model"]
    mil_model = load_mil(mil_path)
    stats = []
    for rec in records_by_id(store.manifest(), ids):
        image = store.image(rec.image_id)
        f = load_features(store, rec, key)
        prelim = store.prelim(round_index, rec.image_id, classes.n)
        allowed = classes.tag_vector(rec.tags)
        prob = predict_proposals(clf, proposal_inputs(f), allowed)
        sp_prelim = None
        if mil_model is not None:
            sp_prelim = sp_evidence(f, prelim, allowed, mil_model, mil_weight)
            prelim = spx.paint(sp_prelim, f.superpixels)
        if pcfg["evidence"] == "combined":
            if sp_prelim is None:
                sp_prelim = spx.pool(prelim, f.superpixels, n=len(f.sp_areas), channel_axis=0)
            mixed = combine_evidence(sp_prelim, superpixel_scores(prob, f.membership), allowed,
                                     weight=pcfg["evidence_weight"])
            prelim = spx.paint(mixed, f.superpixels)
        label, info = make_pseudo_label(image, f, prob, prelim, classes, rec.tags, pcfg, seed)
        store.write_pseudo(round_index, rec.image_id, label)
        previous = store.pseudo(round_index - 1, rec.image_id) if round_index > 0 else \
            store.pseudo(0, rec.image_id, name="cam")
        stats.append({"image_id": rec.image_id, "pixels": int(label.size),
                      "changed": float(changed_share(label, previous)) if previous is not None else 1.0,
                      "ignore": float(ignore_share(label))})
    result = {"images": len(ids), "stats": stats}
    store.mark_shard_done(round_index, "pseudo", ids[0], result)
    return result


def evaluate_shard(run_dir: str, ids: list[str], sources: list[list], model_path: str | None = None,
                   key: str | None = None, classifier_path: str | None = None,
                   gate_scales: Sequence[float] = (1.0,)) -> dict:
    """Confusion matrices of label sources against the masks (the only place masks are read).

    ``sources``: [round, name] pairs of stored label maps, or ["model", split] to predict with
    ``model_path`` first. With ``classifier_path`` the model's output is gated by the image
    classifier (:func:`gate_probs`, the classifier at ``gate_scales``) and the ungated output is
    measured too, as "model_ungated:<split>".
    """
    _worker_setup()
    store = Store(run_dir)
    n = store.classes().n
    accs = {f"{a}:{b}": ConfusionAccumulator(n) for a, b in sources}
    model = gate = None
    if model_path:
        model, state = models.load_checkpoint(model_path)
    if model_path and classifier_path:
        gate = ClassifierGate(classifier_path, gate_scales)
        accs.update({f"model_ungated:{b}": ConfusionAccumulator(n) for a, b in sources if a == "model"})
    for rec in records_by_id(store.manifest(), ids):
        gt = store.mask(rec.image_id)
        if gt is None:
            continue
        for a, b in sources:
            if a == "model":
                image = store.image(rec.image_id)
                edges = load_edges(store, rec, key) if state["in_channels"] == 4 else None
                prob = tr.predict_probs(model, image, edges)
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

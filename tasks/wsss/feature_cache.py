"""METHOD.md A step 2 (and B's edge map): the per-image features of a corpus, computed once per
image content and parameter set and cached in the store: superpixels, the feature-region (edge)
map, superpixel appearance features and the multi-scale proposals (superpixel sets)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from wsseg.tasks.config import FeatureConfig
from wsseg.tasks.edges.weighting import feature_region_map
from wsseg.tasks.store import ImageRecord, Store, arrays_to_sparse, params_key, sparse_to_arrays
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.features import FEATURE_NAMES, proposal_features, superpixel_features
from wsseg.tasks.wsss.proposals import hierarchical_proposals

FEATURE_STAGE = "features"
#: the superpixel box columns of the hand-made features (the first of the cached columns)
BOX_COLUMNS = [FEATURE_NAMES.index(c) for c in ("ymin", "ymax", "xmin", "xmax")]


@dataclass
class ImageFeatures:
    edges: np.ndarray          # (H, W) uint8 {0,1} feature-region map
    superpixels: np.ndarray    # (H, W) int32
    sp_features: np.ndarray    # (S, D) float32: tasks.wsss.features' 94 columns, then tasks.wsss.deep_features' ones
                               # (round 0's, where the run has them: Store.deep)
    membership: sp.csr_matrix  # (P, S) bool
    sp_areas: np.ndarray       # (S,) int64


def feature_key(cfg: FeatureConfig) -> str:
    """The cache key of ``cfg``: a short hash of every feature parameter but ``deep_features``, which
    the features stage does not compute (round 0 pools them from its CAM pass: :meth:`Store.deep`);
    version 2 since then (version 1 held ImageNet's Lite features)."""
    return params_key({"stage": FEATURE_STAGE, "version": 2,
                       **cfg.model_dump(exclude={"deep_features", "deep_strides"})})


def compute_features(store: Store, rec: ImageRecord, cfg: FeatureConfig, key: str) -> bool:
    """Superpixels, feature-region map, superpixel features and proposals of one image,
    cached by image content and parameters. Returns False when the cache already had them."""
    if store.has_cached(FEATURE_STAGE, key, rec.sha256):
        return False
    image = store.image(rec.image_id)
    edges = feature_region_map(image, sigma=cfg.edge_sigma, tau=cfg.edge_tau)
    labels = spx.superpixels(image, method=cfg.superpixel_method, region_size=cfg.region_size,
                             ruler=cfg.ruler, n_iter=cfg.superpixel_iterations)
    feats = superpixel_features(image, labels, edge_map=edges)
    membership = hierarchical_proposals(image, labels, edge_map=edges, min_size=cfg.proposal_min_size,
                                        diversify=cfg.proposal_diversify)
    store.put_cached(FEATURE_STAGE, key, rec.sha256, {
        "edges": edges.astype(np.uint8), "superpixels": labels.astype(np.int32),
        "spfeat": feats.astype(np.float32), **sparse_to_arrays(membership)})
    return True


def load_edges(store: Store, rec: ImageRecord, key: str) -> np.ndarray:
    """The (H, W) feature-region map alone (a network's 4th input channel), without the superpixel parts."""
    return store.cached(FEATURE_STAGE, key, rec.sha256, ("edges",))["edges"]


def _with_deep(store: Store, rec: ImageRecord, hand: np.ndarray) -> np.ndarray:
    """The hand-made superpixel features of one image, then round 0's from its CAM pass where the
    run has them (:meth:`Store.deep`; ``features.deep_features``)."""
    deep = store.deep(rec.image_id)
    return hand if deep is None else np.hstack([hand, deep])


def load_features(store: Store, rec: ImageRecord, key: str) -> ImageFeatures:
    """Everything of one image's features that a round reads: the cached entry, with round 0's
    superpixel features from its CAM pass appended where the run has them (so from round 0's
    preliminary result on)."""
    d = store.cached(FEATURE_STAGE, key, rec.sha256)
    labels = d["superpixels"]
    return ImageFeatures(d["edges"], labels, _with_deep(store, rec, d["spfeat"]), arrays_to_sparse(d),
                         spx.areas(labels, n=d["spfeat"].shape[0]))


def load_superpixels(store: Store, rec: ImageRecord, key: str) -> np.ndarray:
    """The (H, W) int32 superpixels of one image alone."""
    return store.cached(FEATURE_STAGE, key, rec.sha256, ("superpixels",))["superpixels"]


def load_superpixel_features(store: Store, rec: ImageRecord, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H, W) int32 superpixels, (S, D) superpixel features (round 0's appended as in
    :func:`load_features`) and (S,) areas of one image, without the edge map and the proposals
    (what the superpixel MIL reads)."""
    d = store.cached(FEATURE_STAGE, key, rec.sha256, ("superpixels", "spfeat"))
    return (d["superpixels"], _with_deep(store, rec, d["spfeat"]),
            spx.areas(d["superpixels"], n=d["spfeat"].shape[0]))


def proposal_inputs(feat: ImageFeatures) -> np.ndarray:
    """(P, D) proposal features of one image (the proposal classifier's input)."""
    return proposal_features(feat.sp_features, feat.membership, feat.sp_areas,
                             boxes=feat.sp_features[:, BOX_COLUMNS])

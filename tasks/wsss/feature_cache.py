"""METHOD.md A step 2 (and B's edge map): the per-image features of a corpus, computed once per
image content and parameter set and cached in the store: superpixels, the feature-region (edge)
map, superpixel appearance features and the multi-scale proposals (superpixel sets)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from wsseg.models.efficientnet_lite import weights_digest
from wsseg.tasks.config import FeatureConfig
from wsseg.tasks.edges.weighting import feature_region_map
from wsseg.tasks.store import ImageRecord, Store, arrays_to_sparse, params_key, sparse_to_arrays
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.deep_features import deep_superpixel_features
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
    membership: sp.csr_matrix  # (P, S) bool
    sp_areas: np.ndarray       # (S,) int64


def feature_key(cfg: FeatureConfig) -> str:
    """The cache key of ``cfg``: a short hash of every feature parameter (and of the weight file of
    the encoder whose features are pooled, ``deep_features``)."""
    weights = {} if cfg.deep_features == "none" else {"weights": weights_digest(cfg.deep_features)}
    return params_key({"stage": FEATURE_STAGE, "version": 1, **cfg.model_dump(), **weights})


def compute_features(store: Store, rec: ImageRecord, cfg: FeatureConfig, key: str) -> bool:
    """Superpixels, feature-region map, superpixel features and proposals of one image,
    cached by image content and parameters. Returns False when the cache already had them."""
    if store.has_cached(FEATURE_STAGE, key, rec.sha256):
        return False
    image = store.image(rec.image_id)
    edges = feature_region_map(image, sigma=cfg.edge_sigma, tau=cfg.edge_tau)
    labels = spx.superpixels(image, method=cfg.superpixel_method, region_size=cfg.region_size,
                             ruler=cfg.ruler)
    feats = superpixel_features(image, labels, edge_map=edges)
    if cfg.deep_features != "none":
        feats = np.hstack([feats, deep_superpixel_features(image, labels, cfg.deep_features, cfg.deep_strides)])
    membership = hierarchical_proposals(image, labels, edge_map=edges, min_size=cfg.proposal_min_size,
                                        diversify=cfg.proposal_diversify)
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


def load_superpixel_features(store: Store, rec: ImageRecord, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H, W) int32 superpixels, (S, D) superpixel features and (S,) areas of one image, without
    the edge map and the proposals (what the superpixel MIL reads)."""
    d = store.cached(FEATURE_STAGE, key, rec.sha256, ("superpixels", "spfeat"))
    return d["superpixels"], d["spfeat"], spx.areas(d["superpixels"], n=d["spfeat"].shape[0])


def proposal_inputs(feat: ImageFeatures) -> np.ndarray:
    """(P, D) proposal features of one image (the proposal classifier's input)."""
    return proposal_features(feat.sp_features, feat.membership, feat.sp_areas,
                             boxes=feat.sp_features[:, BOX_COLUMNS])

"""Tests of tasks.wsss.proposals: hierarchical merging on a two-colour image and a real photo."""

from pathlib import Path

import cv2
import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from wsseg.tasks.wsss.proposals import hierarchical_proposals, proposal_areas
from wsseg.tasks.wsss.superpixels import adjacency, areas, superpixels

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21" / "images"


def _halves():
    """32x64 image, red left half, blue right half; 8 superpixels of 16x16 (ids 0-3 / 4-7)."""
    image = np.zeros((32, 64, 3), np.uint8)
    image[:, :32] = (200, 30, 30)
    image[:, 32:] = (30, 30, 200)
    labels = np.kron(np.arange(8).reshape(2, 4), np.ones((16, 16), int)).astype(np.int32)
    return image, labels


def _rows(membership):
    return [tuple(membership.indices[membership.indptr[p]:membership.indptr[p + 1]].tolist())
            for p in range(membership.shape[0])]


@pytest.fixture(scope="module")
def real():
    path = sorted(SAMPLE.glob("*.jpg"))[0]
    image = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
    labels = superpixels(image, region_size=16)
    return image, labels


def test_two_halves_merge_within_colour_first():
    image, labels = _halves()
    props = hierarchical_proposals(image, labels)
    assert sp.isspmatrix_csr(props) and props.dtype == bool and props.shape[1] == 8
    rows = _rows(props)
    left, right = (0, 1, 4, 5), (2, 3, 6, 7)
    assert left in rows and right in rows
    assert tuple(range(8)) in rows
    # singletons first, in order; no region mixes colours except the whole image
    assert rows[:8] == [(i,) for i in range(8)]
    for r in rows:
        if len(r) < 8:
            assert set(r) <= set(left) or set(r) <= set(right), r
    # a full hierarchy over 8 leaves: 8 singletons + 7 merges
    assert len(rows) == 15 == len(set(rows))


def test_edge_map_steers_merging():
    # one flat grey image: colour cannot decide; an edge line between columns 31/32
    image = np.full((32, 64, 3), 128, np.uint8)
    _, labels = _halves()
    edge = np.zeros((32, 64))
    edge[:, 31:33] = 1.0
    rows = _rows(hierarchical_proposals(image, labels, edge_map=edge, edge_weight=5.0))
    assert (0, 1, 4, 5) in rows and (2, 3, 6, 7) in rows


def test_real_image_cover_unique_connected(real):
    image, labels = real
    n = int(labels.max()) + 1
    props = hierarchical_proposals(image, labels)
    rows = _rows(props)
    assert len(rows) == len(set(rows))                     # unique
    assert tuple(range(n)) in rows                         # whole image
    assert np.asarray(props.sum(0)).ravel().min() >= 1     # every superpixel covered
    assert rows[:n] == [(i,) for i in range(n)]
    assert props.shape[0] > n + n // 2                     # many multi-superpixel regions
    # every proposal is connected in the superpixel adjacency graph
    pairs = adjacency(labels)
    graph = sp.coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n)).tocsr()
    graph = graph + graph.T
    for r in rows:
        if len(r) > 1:
            idx = np.array(r)
            assert connected_components(graph[idx][:, idx], directed=False)[0] == 1
    # size filter keeps singletons and the whole image
    sp_area = areas(labels)
    big = hierarchical_proposals(image, labels, min_size=0.2)
    share = proposal_areas(big, sp_area) / labels.size
    multi = np.diff(big.indptr) > 1
    assert (share[multi] >= 0.2).all() and share.max() == 1.0
    assert big.shape[0] < props.shape[0]


def test_diversify_and_features_options(real):
    image, labels = real
    n = int(labels.max()) + 1
    base = _rows(hierarchical_proposals(image, labels))
    diverse = _rows(hierarchical_proposals(image, labels, diversify=True))
    assert len(diverse) == len(set(diverse)) and set(base) <= set(diverse)
    assert len(diverse) > len(base)
    feats = np.random.default_rng(0).random((n, 5))
    with_feats = _rows(hierarchical_proposals(image, labels, features=feats))
    assert tuple(range(n)) in with_feats and len(with_feats) == len(set(with_feats))


def test_proposal_areas_and_errors():
    m = sp.csr_matrix(np.array([[1, 0, 1], [0, 1, 0], [1, 1, 1]], bool))
    assert proposal_areas(m, np.array([4, 5, 6])).tolist() == [10, 5, 15]
    image, labels = _halves()
    with pytest.raises(ValueError, match="colour_space"):
        hierarchical_proposals(image, labels, colour_space="xyz")
    with pytest.raises(ValueError, match="weights"):
        hierarchical_proposals(image, labels, colour_weight=-1)
    with pytest.raises(ValueError, match="contiguous"):
        hierarchical_proposals(image, labels * 2)

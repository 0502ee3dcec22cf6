"""Superpixel features pooled from the ImageNet-pretrained encoder (tasks.wsss.deep_features): their
layout, the sliver rule, their place in the feature cache's key, and that on real photos they
tell the sample's classes apart better than the hand-made colour and texture features."""
import cv2
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from wsseg.tasks.config import FeatureConfig
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.deep_features import GRID, deep_feature_dim, deep_superpixel_features
from wsseg.tasks.wsss.feature_cache import feature_key
from wsseg.tasks.wsss.features import superpixel_features
from tests.conftest import SAMPLE


def _photo(iid):
    return cv2.imread(str(SAMPLE / "images" / f"{iid}.jpg"))[:, :, ::-1].copy()


def test_layout_and_a_sliver_takes_the_cell_at_its_centroid():
    img = _photo("1_11_s")
    h, w = img.shape[:2]
    sliver = np.zeros((h, w), np.int32)
    sliver[1, 1] = 1  # holds no cell centre (cells are centred at 2, 6, 10, ...)
    block = np.zeros((h, w), np.int32)
    block[:GRID, :GRID] = 1  # holds exactly the first cell's centre
    a, b = deep_superpixel_features(img, sliver), deep_superpixel_features(img, block)
    assert a.shape == (2, deep_feature_dim()) == (2, 40 + 112) and np.isfinite(a).all()
    assert np.allclose(a[1], b[1], atol=1e-6)


def test_the_default_strides_are_the_first_columns_of_all_three():
    # the encoder stops after the last stride asked for; the maps it does compute are unchanged
    img = _photo("1_11_s")
    lab = spx.superpixels(img, method="slico", region_size=16, ruler=10.0)
    every = deep_superpixel_features(img, lab, strides=(8, 16, 32))
    assert every.shape[1] == deep_feature_dim(strides=(8, 16, 32)) == 40 + 112 + 320
    assert np.allclose(deep_superpixel_features(img, lab), every[:, :40 + 112], atol=1e-5)
    assert np.allclose(deep_superpixel_features(img, lab, strides=(32,)), every[:, 40 + 112:], atol=1e-5)


def test_the_feature_key_follows_the_choice():
    assert feature_key(FeatureConfig()) != feature_key(FeatureConfig(deep_features="none"))
    assert feature_key(FeatureConfig()) != feature_key(FeatureConfig(deep_strides=(8, 16, 32)))
    assert FeatureConfig(deep_strides=[16, 8]) == FeatureConfig()  # an order is not another choice
    with pytest.raises(ValidationError, match="strides must be distinct values of 8, 16 and 32, got \\[4\\]"):
        FeatureConfig(deep_strides=[4])


def _labelled_superpixels(iid):
    img = _photo(iid)
    mask = np.array(Image.open(SAMPLE / "masks" / f"{iid}.png"))
    lab = spx.superpixels(img, method="slico", region_size=16, ruler=10.0)
    n = lab.max() + 1
    votes = np.zeros((n, 256), np.int64)
    np.add.at(votes, (lab.ravel(), mask.ravel()), 1)
    return img, lab, votes.argmax(1)


def test_on_real_photos_they_separate_the_classes_better_than_colour_and_texture():
    ids = sorted(p.stem for p in (SAMPLE / "masks").glob("*.png"))
    hand, deep, ys, owner = [], [], [], []
    for k, iid in enumerate(ids):
        img, lab, y = _labelled_superpixels(iid)
        hand.append(superpixel_features(img, lab))
        deep.append(deep_superpixel_features(img, lab))
        ys.append(y)
        owner.append(np.full(len(y), k))
    y, owner = np.concatenate(ys), np.concatenate(owner)
    keep = y != 255

    def held_out_accuracy(x):
        x = (x - x[keep].mean(0)) / (x[keep].std(0) + 1e-6)
        right = 0
        for k in range(len(ids)):  # nearest class centroid of the other images
            train, test = keep & (owner != k), keep & (owner == k)
            classes = np.unique(y[train])
            cent = np.stack([x[train & (y == c)].mean(0) for c in classes])
            pred = classes[((x[test][:, None] - cent[None]) ** 2).sum(-1).argmin(1)]
            right += (pred == y[test]).sum()
        return right / keep.sum()

    acc_hand, acc_deep = held_out_accuracy(np.concatenate(hand)), held_out_accuracy(np.concatenate(deep))
    print(f"held-out superpixel accuracy: hand-made {acc_hand:.3f}, encoder {acc_deep:.3f}")
    assert acc_deep > acc_hand + 0.05, (acc_hand, acc_deep)

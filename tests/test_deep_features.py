"""Superpixel features pooled from the image classifier's encoder (tasks.wsss.deep_features): the
pooling's layout and sliver rule on maps whose means are known, that round 0's CAM pass gives the
same maps as a pass of their own without changing its CAMs, where the run keeps them (round 0, and
an error rather than features of another width), what the configuration accepts, and that on real
photos an ImageNet classifier's maps tell the sample's classes apart better than the hand-made colour
and texture features."""
import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from wsseg.tasks.common.training import class_activation_maps
from wsseg.tasks.config import ClassifierConfig, FeatureConfig, WSSSConfig
from wsseg.tasks.store import Store
from wsseg.tasks.store.checkpoints import build_network
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.deep_features import (GRID, classifier_superpixel_features, deep_feature_dim, levels_of,
                                            pool_superpixels)
from wsseg.tasks.wsss.feature_cache import feature_key
from wsseg.tasks.wsss.features import superpixel_features
from tests.conftest import SAMPLE


def _photo(iid):
    return cv2.imread(str(SAMPLE / "images" / f"{iid}.jpg"))[:, :, ::-1].copy()


def _classifier(variant="lite0"):
    torch.manual_seed(0)
    return build_network("lite_classifier", 5, in_channels=3, variant=variant, stride=16).eval()


def test_pooling_takes_each_superpixels_mean_and_a_sliver_takes_the_cell_at_its_centroid():
    h, w = 32, 48
    labels = np.zeros((h, w), np.int32)
    labels[:, 24:] = 1  # left and right halves
    labels[1, 1] = 2    # a sliver: holds no cell centre (cells are centred at 2, 6, 10, ...)
    # a map at half the resolution (another scale: the pooling resamples to its grid) that is 1 on the
    # left half and 3 on the right, and a second channel that is the same everywhere
    m = torch.zeros(1, 2, h // 2, w // 2)
    m[0, 0, :, :12], m[0, 0, :, 12:], m[0, 1] = 1.0, 3.0, 5.0
    out = pool_superpixels([m[:, :1], m[:, 1:]], labels)
    assert out.shape == (3, 2) and out.dtype == np.float32
    # the halves' cells away from the border are exactly 1 and 3; the column of cells at the border mixes
    assert 1.0 <= out[0, 0] < 1.2 and 2.8 < out[1, 0] <= 3.0 and np.allclose(out[:, 1], 5.0)
    assert out[2, 0] == pytest.approx(1.0)  # the sliver at (1, 1): the first cell, all left


def test_the_cam_pass_gives_the_maps_of_a_pass_of_their_own_and_the_same_cams():
    model, img = _classifier(), _photo("1_11_s")
    alone = class_activation_maps(model, img, scales=(1.5,))
    cams, maps = class_activation_maps(model, img, scales=(1.5,), maps_levels=levels_of((8, 16)))
    assert np.array_equal(cams, alone)
    x = torch.from_numpy(np.ascontiguousarray(cv2.resize(img, (int(img.shape[1] * 1.5), int(img.shape[0] * 1.5)),
                                                         interpolation=cv2.INTER_LINEAR)))
    from wsseg.tasks.common.training import to_input
    with torch.no_grad():
        own = model.encoder.forward_features(model.input(torch.from_numpy(to_input(x.numpy(), None))[None]))
    assert [m.shape for m in maps] == [own[2].shape, own[3].shape]  # the image's maps, not its mirror's
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(maps, (own[2], own[3])))
    lab = spx.superpixels(img, method="slico", region_size=16, ruler=10.0)
    feats = classifier_superpixel_features(model, img, lab, scale=1.5)
    assert feats.shape == (lab.max() + 1, deep_feature_dim(model.encoder)) == (lab.max() + 1, 40 + 112)
    assert np.allclose(feats, pool_superpixels(maps, lab), atol=1e-5)


def test_round_0_keeps_them_and_a_missing_image_is_an_error_not_another_width(tmp_path):
    store = Store(tmp_path / "run")
    assert store.deep("a") is None  # a run without them (features.deep_features none)
    store.write_deep("a", np.ones((3, 4), np.float32))
    assert np.array_equal(store.deep("a"), np.ones((3, 4), np.float32))
    with pytest.raises(KeyError, match="round 0 has the superpixel features of other images but not of 'b'"):
        store.deep("b")


def test_the_configuration_accepts_them_with_a_lite_classifier_and_the_feature_key_ignores_them():
    assert feature_key(FeatureConfig()) == feature_key(FeatureConfig(deep_features="none")) \
        == feature_key(FeatureConfig(deep_strides=(8, 16, 32)))  # the features stage computes the same
    assert FeatureConfig(deep_strides=[16, 8]) == FeatureConfig()  # an order is not another choice
    with pytest.raises(ValidationError, match="strides must be distinct values of 8, 16 and 32, got \\[4\\]"):
        FeatureConfig(deep_strides=[4])
    with pytest.raises(ValidationError, match="with classifier.encoder small set features.deep_features=none"):
        WSSSConfig(classifier=ClassifierConfig(encoder="small"))
    WSSSConfig(classifier=ClassifierConfig(encoder="small"), features=FeatureConfig(deep_features="none"))


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
    model = _classifier()  # ImageNet's encoder, before any training on the tags
    hand, deep, ys, owner = [], [], [], []
    for k, iid in enumerate(ids):
        img, lab, y = _labelled_superpixels(iid)
        hand.append(superpixel_features(img, lab))
        deep.append(classifier_superpixel_features(model, img, lab, scale=1.5))
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

"""Tests of models.backbones: torchvision-compatible ResNet50 / MobileNetV2 encoders."""

import math

import pytest
import torch

from wsseg.models.backbones import load_backbone_weights, mobilenet_v2, resnet50
from wsseg.tasks.store.checkpoints import backbone_weights


def _load_file(model, path, **kw):
    """A torchvision file read by the store, loaded by the model's loader (as build_network does)."""
    return load_backbone_weights(model, backbone_weights(path), source=str(path), **kw)

# A sample of torchvision's state_dict keys and shapes (torchvision.models.resnet50 /
# mobilenet_v2, ImageNet checkpoints resnet50-0676ba61.pth / mobilenet_v2-b0353104.pth).
RESNET50_KEYS = {
    "conv1.weight": (64, 3, 7, 7),
    "bn1.weight": (64,),
    "bn1.running_mean": (64,),
    "bn1.num_batches_tracked": (),
    "layer1.0.conv1.weight": (64, 64, 1, 1),
    "layer1.0.conv2.weight": (64, 64, 3, 3),
    "layer1.0.conv3.weight": (256, 64, 1, 1),
    "layer1.0.bn3.running_var": (256,),
    "layer1.0.downsample.0.weight": (256, 64, 1, 1),
    "layer1.0.downsample.1.weight": (256,),
    "layer1.2.conv1.weight": (64, 256, 1, 1),
    "layer2.0.conv1.weight": (128, 256, 1, 1),
    "layer2.0.conv2.weight": (128, 128, 3, 3),
    "layer2.0.downsample.0.weight": (512, 256, 1, 1),
    "layer2.3.bn3.running_var": (512,),
    "layer3.0.conv1.weight": (256, 512, 1, 1),
    "layer3.0.downsample.0.weight": (1024, 512, 1, 1),
    "layer3.5.conv2.weight": (256, 256, 3, 3),
    "layer4.0.conv1.weight": (512, 1024, 1, 1),
    "layer4.0.conv2.weight": (512, 512, 3, 3),
    "layer4.0.downsample.0.weight": (2048, 1024, 1, 1),
    "layer4.2.conv3.weight": (2048, 512, 1, 1),
    "layer4.2.bn3.bias": (2048,),
    "fc.weight": (1000, 2048),
    "fc.bias": (1000,),
}
RESNET50_ABSENT = ["layer1.1.downsample.0.weight", "layer4.3.conv1.weight", "layer3.6.conv1.weight"]

MOBILENET_V2_KEYS = {
    "features.0.0.weight": (32, 3, 3, 3),
    "features.0.1.weight": (32,),
    "features.0.1.running_var": (32,),
    "features.1.conv.0.0.weight": (32, 1, 3, 3),
    "features.1.conv.0.1.bias": (32,),
    "features.1.conv.1.weight": (16, 32, 1, 1),
    "features.1.conv.2.weight": (16,),
    "features.2.conv.0.0.weight": (96, 16, 1, 1),
    "features.2.conv.1.0.weight": (96, 1, 3, 3),
    "features.2.conv.2.weight": (24, 96, 1, 1),
    "features.2.conv.3.running_mean": (24,),
    "features.3.conv.0.0.weight": (144, 24, 1, 1),
    "features.4.conv.1.0.weight": (144, 1, 3, 3),
    "features.4.conv.2.weight": (32, 144, 1, 1),
    "features.7.conv.2.weight": (64, 192, 1, 1),
    "features.11.conv.0.0.weight": (384, 64, 1, 1),
    "features.11.conv.2.weight": (96, 384, 1, 1),
    "features.14.conv.1.0.weight": (576, 1, 3, 3),
    "features.14.conv.2.weight": (160, 576, 1, 1),
    "features.17.conv.0.0.weight": (960, 160, 1, 1),
    "features.17.conv.2.weight": (320, 960, 1, 1),
    "features.18.0.weight": (1280, 320, 1, 1),
    "features.18.1.weight": (1280,),
    "classifier.1.weight": (1000, 1280),
    "classifier.1.bias": (1000,),
}
MOBILENET_V2_ABSENT = ["features.1.conv.3.weight", "features.19.0.weight", "classifier.0.weight"]

ODD = (97, 130)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: fast and steady on a shared 2-core machine (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def r50():
    torch.manual_seed(0)
    return resnet50().eval()


@pytest.fixture(scope="module")
def mnv2():
    torch.manual_seed(0)
    return mobilenet_v2().eval()


def test_parameter_counts_match_torchvision(r50, mnv2):
    assert n_params(r50) == 25_557_032
    assert n_params(mnv2) == 3_504_872


@pytest.mark.parametrize(
    "name, expected, absent, n_keys",
    [("r50", RESNET50_KEYS, RESNET50_ABSENT, 320), ("mnv2", MOBILENET_V2_KEYS, MOBILENET_V2_ABSENT, 314)],
)
def test_state_dict_keys_are_torchvision(request, name, expected, absent, n_keys):
    sd = request.getfixturevalue(name).state_dict()
    assert len(sd) == n_keys
    for key, shape in expected.items():
        assert key in sd, key
        assert tuple(sd[key].shape) == shape, key
    for key in absent:
        assert key not in sd


def test_feature_shapes_at_odd_size(r50, mnv2):
    assert r50.out_channels == (64, 256, 512, 1024, 2048)
    assert mnv2.out_channels == (16, 24, 32, 96, 1280)
    x = torch.randn(1, 3, *ODD)
    with torch.no_grad():
        for model in (r50, mnv2):
            feats = model.forward_features(x)
            assert len(feats) == 5
            for i, (f, c) in enumerate(zip(feats, model.out_channels)):
                stride = 2 ** (i + 1)
                # 97 x 130 -> 49x65, 25x33, 13x17, 7x9, 4x5
                assert tuple(f.shape) == (1, c, math.ceil(ODD[0] / stride), math.ceil(ODD[1] / stride))
    assert tuple(feats[-1].shape[-2:]) == (4, 5)


def test_classification_forward_and_headless():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 40, 33)
    for build in (resnet50, mobilenet_v2):
        model = build(num_classes=7, in_channels=4, **({"base_channels": 16} if build is resnet50 else {}))
        assert tuple(model(x).shape) == (2, 7)
        headless = build(num_classes=0, **({"base_channels": 16} if build is resnet50 else {}))
        assert not any(k.startswith(("fc.", "classifier.")) for k in headless.state_dict())


def test_width_scaling():
    thin_r = resnet50(base_channels=16)
    thin_m = mobilenet_v2(width_mult=0.25)
    assert thin_r.out_channels == (16, 64, 128, 256, 512)
    assert thin_m.out_channels == (8, 8, 8, 24, 1280)
    x = torch.randn(2, 3, 33, 47)
    for model in (thin_r, thin_m):
        feats = model.forward_features(x)
        assert [f.shape[1] for f in feats] == list(model.out_channels)
        assert tuple(feats[2].shape[-2:]) == (5, 6)


def test_round_trip_with_four_channel_stem(tmp_path, mnv2):
    path = tmp_path / "mobilenet_v2.pth"
    saved = mnv2.state_dict()
    torch.save(saved, path)
    model = mobilenet_v2(in_channels=4)
    assert _load_file(model, path) is model
    direct = mobilenet_v2(in_channels=4)  # the models level takes the state dict itself
    assert load_backbone_weights(direct, saved) is direct
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in direct.state_dict().items())
    loaded = model.state_dict()
    w = loaded["features.0.0.weight"]
    assert w.shape == (32, 4, 3, 3)
    torch.testing.assert_close(w[:, :3], saved["features.0.0.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w[:, 3], saved["features.0.0.weight"].mean(dim=1), rtol=0, atol=0)
    for key, value in saved.items():
        if key != "features.0.0.weight":
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    # Known answer: with a zero 4th channel the adapted network computes the RGB network.
    model.eval()
    x = torch.randn(1, 3, 45, 37)
    with torch.no_grad():
        expected = mnv2.forward_features(x)
        got = model.forward_features(torch.cat([x, torch.zeros(1, 1, 45, 37)], dim=1))
        edge = model.forward_features(torch.cat([x, torch.ones(1, 1, 45, 37)], dim=1))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert (edge[0] - expected[0]).abs().max() > 1e-3


def test_round_trip_resnet50_drop_head(tmp_path, r50):
    path = tmp_path / "resnet50.pth"
    saved = r50.state_dict()
    torch.save(saved, path)
    model = resnet50(in_channels=4, num_classes=0)
    with pytest.raises(ValueError, match="unexpected keys.*'fc.weight'"):
        _load_file(model, path)
    _load_file(model, path, drop_head=True)
    w = model.conv1.weight.detach()
    torch.testing.assert_close(w[:, :3], saved["conv1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w[:, 3], saved["conv1.weight"].mean(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(model.layer4[2].bn3.running_var, saved["layer4.2.bn3.running_var"], rtol=0, atol=0)
    # Another head size: mismatched head dropped, model's own head kept.
    other = resnet50(num_classes=21, base_channels=64)
    head_before = other.fc.weight.detach().clone()
    _load_file(other, path, drop_head=True)
    torch.testing.assert_close(other.fc.weight.detach(), head_before, rtol=0, atol=0)
    torch.testing.assert_close(other.conv1.weight.detach(), saved["conv1.weight"], rtol=0, atol=0)


def test_old_checkpoint_without_num_batches_tracked_and_module_prefix(tmp_path):
    torch.manual_seed(1)
    src = mobilenet_v2(width_mult=0.25)
    sd = {f"module.{k}": v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "old.pth"
    torch.save({"state_dict": sd}, path)
    dst = mobilenet_v2(width_mult=0.25)
    _load_file(dst, path)
    torch.testing.assert_close(dst.features[5].conv[2].weight, src.features[5].conv[2].weight, rtol=0, atol=0)


def test_mismatched_checkpoint_gives_clear_error(tmp_path):
    path = tmp_path / "thin.pth"
    torch.save(mobilenet_v2(width_mult=0.5).state_dict(), path)
    with pytest.raises(ValueError) as err:
        _load_file(mobilenet_v2(), path)
    msg = str(err.value)
    assert "thin.pth" in msg and "mis-shaped" in msg and "features.0.0.weight" in msg
    assert "width_mult=1.0" in msg

    wrong_arch = tmp_path / "mobilenet.pth"
    torch.save(mobilenet_v2(width_mult=0.25).state_dict(), wrong_arch)
    with pytest.raises(ValueError) as err:
        _load_file(resnet50(base_channels=16), wrong_arch)
    msg = str(err.value)
    assert "mobilenet.pth" in msg and "ResNet" in msg
    assert "missing keys ('conv1.weight'" in msg and "unexpected keys ('features.0.0.weight'" in msg

    not_sd = tmp_path / "list.pth"
    torch.save([torch.zeros(1)], not_sd)
    with pytest.raises(ValueError, match="list.pth.*expected a state_dict"):
        _load_file(mobilenet_v2(), not_sd)
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        _load_file(mobilenet_v2(), tmp_path / "nope.pth")

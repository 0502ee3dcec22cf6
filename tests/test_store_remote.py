"""The run directory on object storage: a real S3-compatible server (moto's, over HTTP on
127.0.0.1, started here), ingest and one refresh round through a real two-worker LocalCluster
with the store at ``s3://bucket/run``, compared with the same run in a local folder (the
session's ``tiny_run``); the CLI on such a URL; and the refusals (a scheme without its package, an
endpoint that does not answer)."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import KILL_IDS, TINY, command_threads, copy_sample, harness_cluster

ROOT = Path(__file__).resolve().parents[1]
WSSEG = [sys.executable, "-m", "wsseg"]
IDS = KILL_IDS
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 and a bucket on it; the store's options in the environment
    (the LocalCluster's workers started after this inherit them). Yields the endpoint URL."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "WSSEG_STORAGE_OPTIONS")}
    os.environ.update(CREDENTIALS)
    os.environ["WSSEG_STORAGE_OPTIONS"] = json.dumps({"endpoint_url": endpoint})
    try:
        import fsspec

        fs = fsspec.filesystem("s3", endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True)
        for _ in range(120):  # the server answers within seconds
            try:
                fs.mkdir("bucket")
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"moto's server exited ({proc.returncode}); see {log.name}")
                time.sleep(0.5)
        else:
            raise RuntimeError("moto's server did not answer in 60 s")
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def s3_cluster(s3, prefect_harness, tmp_path_factory):
    """A two-worker LocalCluster (started after the store's options are set: its workers reach the
    object store) reporting to the harness's Prefect API."""
    with harness_cluster(tmp_path_factory) as address:
        yield address


def test_ingest_and_a_round_on_s3_match_a_local_run(tmp_path, s3, s3_cluster, tiny_run, monkeypatch):
    import fsspec
    import torch

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    cluster = s3_cluster
    monkeypatch.setenv("WSSEG_STATE_DIR", str(tmp_path / "state"))
    src = copy_sample(tmp_path / "src", IDS)
    cfg = WSSSConfig.model_validate(TINY)
    # the same corpus and training as the local run ``tiny_run`` (and as many torch threads)
    on_cluster(ingest, cluster)(str(src), "s3://bucket/run", shard_size=4)
    before = torch.get_num_threads()
    torch.set_num_threads(command_threads(dict(os.environ, OMP_WAIT_POLICY="PASSIVE")))
    try:
        summaries = {"s3://bucket/run": on_cluster(train_wsss, cluster)("s3://bucket/run", cfg, cluster),
                     str(tiny_run): Store(tiny_run).read_summary()}
    finally:
        torch.set_num_threads(before)
    local_dir = tiny_run
    local, remote = Store(local_dir), Store("s3://bucket/run")
    assert remote.remote and str(remote.root) == "s3://bucket/run"

    # the store lies on the object store: its objects are there, nothing under a local "s3:" folder
    fs = fsspec.filesystem("s3", endpoint_url=s3, use_listings_cache=False, skip_instance_cache=True)
    keys = fs.find("bucket/run")
    for key in ("corpus/manifest.parquet", "config.json", "summary.json", "classifier.pt", "rounds/r000/round.json",
                "rounds/r000/model.pt", "rounds/r000/overlay.png", "corpus/images/packs.json",
                "corpus/masks/packs.json"):
        assert f"bucket/run/{key}" in keys, key
    # the corpus packed by shard: its indexes published, nothing left staged, no per-image arrays
    assert any(k.startswith("bucket/run/corpus/images/packs/") and k.endswith(".json") for k in keys)
    assert not any("/corpus/staging" in k or "/corpus/images.zarr" in k for k in keys)
    assert not Path("s3:").exists() and not (tmp_path / "s3:").exists()
    # MLflow's database and Prefect's home lie in the local state folder
    assert (tmp_path / "state" / "mlflow.db").is_file()
    assert Path(summaries["s3://bucket/run"]["final_model"]) != Path(summaries[str(local_dir)]["final_model"])
    assert summaries["s3://bucket/run"]["final_model"] == "s3://bucket/run/rounds/r000/model.pt"

    # the same results: corpus, pseudo-labels and CAM labels bit for bit, metrics equal
    assert [r.__dict__ | {"source": None} for r in remote.manifest()] == \
        [r.__dict__ | {"source": None} for r in local.manifest()]
    for rec in local.manifest():
        assert np.array_equal(remote.image(rec.image_id), local.image(rec.image_id))
        for name in ("pseudo", "cam"):
            a, b = local.pseudo(0, rec.image_id, name=name), remote.pseudo(0, rec.image_id, name=name)
            assert a is not None and b is not None and a.dtype == b.dtype == np.uint8
            assert np.array_equal(a, b), (rec.image_id, name)
        assert np.array_equal(local.prelim(0, rec.image_id, local.classes().n),
                              remote.prelim(0, rec.image_id, remote.classes().n))
    keep = ("pseudo_label_miou", "changed_share", "ignore_share", "per_class_iou", "cam_miou", "train_epochs",
            "images", "feature_key")
    a, b = local.read_round(0), remote.read_round(0)
    assert a["pseudo_label_miou"] is not None
    assert {k: a.get(k) for k in keep} == {k: b.get(k) for k in keep}
    net_a, _ = local.read_model("segmenter", 0)
    net_b, _ = remote.read_model("segmenter", 0)
    for (ka, va), (kb, vb) in zip(net_a.state_dict().items(), net_b.state_dict().items()):
        assert ka == kb and np.array_equal(va.numpy(), vb.numpy()), ka
    # `wsseg evaluate` and `wsseg segment --model URL` read the run from the object store
    from wsseg.flows.wsss import evaluate
    from wsseg.tasks.highres import segment as sg

    ev = {w: on_cluster(evaluate, cluster)(w, 0, "train", "pseudo") for w in (str(local_dir), "s3://bucket/run")}
    assert ev[str(local_dir)]["miou"] == ev["s3://bucket/run"]["miou"] == a["pseudo_label_miou"]
    image = str(src / "images" / f"{IDS[0]}.jpg")
    out = {w: sg.segment([image], w, tmp_path / f"seg-{i}", log=lambda m: None)[0]
           for i, w in enumerate((str(local_dir), "s3://bucket/run"))}
    assert out[str(local_dir)].read_bytes() == out["s3://bucket/run"].read_bytes()
    # a second run on the same URL resumes: nothing is computed again, the same summary comes back
    again = on_cluster(train_wsss, cluster)("s3://bucket/run", cfg, cluster)  # all finished: read back
    assert again["rounds"][1]["pseudo_label_miou"] == summaries["s3://bucket/run"]["rounds"][1]["pseudo_label_miou"]


def _wsseg(*args, env=None, timeout=600):
    return subprocess.run([*WSSEG, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})})


@pytest.mark.command("ingest", "status")
def test_cli_ingest_status_and_lock_on_s3(tmp_path, s3):
    """`wsseg ingest --run-dir s3://...` with the endpoint given by --storage-option (the workers
    get it too), then `wsseg status` of the URL: the corpus, the local state folder, no writer."""
    src = copy_sample(tmp_path / "src", IDS[:2])
    state = tmp_path / "state"
    env = {"WSSEG_STORAGE_OPTIONS": ""}  # only the command line names the endpoint
    opt = ["--storage-option", f"endpoint_url={s3}"]
    p = _wsseg("ingest", str(src), "--run-dir", "s3://bucket/cli", "--workers", "1", "--state-dir", str(state),
               *opt, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "s3://bucket/cli/corpus" in p.stdout
    assert (state / ".prefect").is_dir() and (state / ".wsseg.lock").exists()
    p = _wsseg("status", "s3://bucket/cli", "--json", "--state-dir", str(state), *opt, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads(p.stdout)
    assert st["corpus"]["images"] == 2 and st["run_dir"] == "s3://bucket/cli"
    assert st["state_dir"] == str(state.resolve()) and st["writer"] is None and st["size_mb"] >= 0
    # the lock object is gone after the command; while a writer holds it, a second one is refused
    from wsseg.tasks.store import RunLockedError, Store

    store = Store("s3://bucket/cli")
    assert not (store.root / ".wsseg.lock").exists()
    other = tmp_path / "other-state"
    with store.lock("wsseg train"):
        held = json.loads((store.root / ".wsseg.lock").read_text())
        assert held["pid"] == os.getpid() and held["command"] == "wsseg train"
        from wsseg.tasks.store.lock import RunLock

        with pytest.raises(RunLockedError, match=r"s3://bucket/cli: in use by pid \d+ .*delete s3://bucket/cli/"
                                                  r"\.wsseg\.lock"):
            RunLock(other, "wsseg ingest", remote=store.root).acquire()  # another state folder: the object refuses
    assert not (store.root / ".wsseg.lock").exists()
    # a lock object left by a process of this host that is gone is taken over
    (store.root / ".wsseg.lock").write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname(),
                                                        "started": "x", "command": "wsseg train"}))
    with store.lock("wsseg train"):
        assert json.loads((store.root / ".wsseg.lock").read_text())["pid"] == os.getpid()


def test_refusals_are_one_line_and_write_nothing(tmp_path, s3):
    # a scheme whose filesystem package is not installed (gcsfs is not a dependency)
    from wsseg.tasks.store import Store
    from wsseg.tasks.store.remote import RemoteStoreError

    with pytest.raises(RemoteStoreError, match=r"^gs://b/run: the run directory's scheme gs needs the package "
                                               r"gcsfs \(pip install gcsfs\)$"):
        Store("gs://b/run")
    with pytest.raises(RemoteStoreError, match=r"unknown storage scheme 'nosuch'"):
        Store("nosuch://b/run")
    # file:// is a local path
    assert Store(f"file://{tmp_path}/run").root == tmp_path / "run"
    state = tmp_path / "state"
    for args, expected in [
        (["train", "--run-dir", "gs://b/run"],
         "wsseg: error: gs://b/run: the run directory's scheme gs needs the package gcsfs (pip install gcsfs)"),
        (["ingest", str(tmp_path), "--run-dir", "s3://bucket/x", "--storage-option",
          f"endpoint_url=http://127.0.0.1:{_free_port()}"], "s3://bucket/x: the object store does not answer"),
        (["ingest", str(tmp_path), "--run-dir", "s3://no-such-bucket/x"],
         "s3://no-such-bucket/x: the bucket 'no-such-bucket' does not exist"),
    ]:
        p = _wsseg(*args, "--state-dir", str(state), timeout=120)
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("wsseg: error:")]
        assert p.returncode == 2, p.stderr[-2000:]
        assert len(lines) == 1 and expected in lines[0], p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    assert not state.exists() and not (ROOT / "s3:").exists() and not (ROOT / "gs:").exists()

"""Test set-up: keep Prefect, Dask and MLflow state in a temporary directory, offline."""
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="wsseg-tests-"))
os.environ.update({
    "PREFECT_HOME": str(_HOME / ".prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # a busy machine can take longer to start the server: a user's setting is kept (flows/runtime.py)
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"),
    "DASK_TEMPORARY_DIRECTORY": str(_HOME / "dask"),
    "DASK_LOGGING__DISTRIBUTED": "error",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
})
os.environ.pop("MLFLOW_TRACKING_URI", None)

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21"
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """The module of ``tools/NAME.py`` (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    return SAMPLE


def two_colour_images(n: int = 2):
    """``n`` 48x64 images of two flat colours with masks: class 0 on the left half, class 1 + k on
    the right half of image k, the top two rows void (255); a known answer for method C's tests."""
    import numpy as np
    rng = np.random.default_rng(0)
    images, masks = [], []
    for k in range(n):
        mask = np.zeros((48, 64), np.uint8)
        mask[:, 32:] = 1 + k
        mask[:2] = 255
        noise = rng.integers(0, 9, (48, 64, 3), np.uint8)
        images.append(np.where(mask[..., None] == 0, 60, 190).astype(np.uint8) + noise)
        masks.append(mask)
    return images, masks


def copy_sample(dst: Path, ids: list[str]) -> Path:
    """A dataset folder holding only ``ids`` of the bundled sample."""
    (dst / "images").mkdir(parents=True)
    (dst / "masks").mkdir()
    rows = {}
    for line in (SAMPLE / "labels.csv").read_text().splitlines()[1:]:
        iid, split, labels = line.split(",")
        rows[iid] = (split, labels)
    lines = ["image_id,split,labels"]
    for iid in ids:
        shutil.copy(SAMPLE / "images" / f"{iid}.jpg", dst / "images")
        shutil.copy(SAMPLE / "masks" / f"{iid}.png", dst / "masks")
        lines.append(f"{iid},{rows[iid][0]},{rows[iid][1]}")
    (dst / "labels.csv").write_text("\n".join(lines) + "\n")
    shutil.copy(SAMPLE / "classes.txt", dst / "classes.txt")
    return dst


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    timeout = int(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    with prefect_test_harness(server_startup_timeout=timeout):
        yield


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test: training is then bit-reproducible, so comparisons of
    trained results cannot flip between runs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def harness_cluster(tmp_path_factory, workers: int = 2):
    """A LocalCluster of ``workers`` whose workers report to the Prefect API of
    ``prefect_harness`` (its URL exported while they start: each nanny keeps the environment it
    was started with, also for a worker it restarts); yields its address."""
    from prefect.settings import PREFECT_API_URL

    from wsseg.flows.runtime import dask_cluster

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()
    with dask_cluster(None, workers, tmp_path_factory.mktemp("dask")) as address:
        if previous is None:  # this process's own commands and subprocesses start as before
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
        yield address


@pytest.fixture(scope="session")
def cluster(prefect_harness, tmp_path_factory):
    """One two-worker LocalCluster for the whole session, its workers reporting to the
    harness's Prefect API (starting one per test module cost 10-25 s each, and its workers' first
    task as much again: torch and the method's modules imported)."""
    with harness_cluster(tmp_path_factory) as address:
        yield address


#: six sample photos and a configuration small enough for tests that run `wsseg train` as a user
#: would (killed, resumed, on an existing cluster): one round, two images per shard
KILL_IDS = ["11_21_s", "12_25_s", "12_27_s", "12_33_s", "12_6_s", "12_8_s"]
TINY = {"classifier": {"epochs": 4, "size": 160, "width": 16, "stride": 16, "batch_size": 8},
        "mil": {"iterations": 1}, "proposals": {"epochs": 5},
        "segmentation": {"epochs": 2, "crop": 160, "batch_size": 4, "num_workers": 1},
        "max_rounds": 1, "shard_size": 2}


def run_outputs(run: Path) -> dict[str, bytes]:
    """The round's pseudo-labels and the trained model's weights of run directory ``run``, as bytes."""
    from wsseg.tasks.store import Store

    store = Store(run)
    out = {f"pseudo/{r.image_id}": store.pseudo(0, r.image_id).tobytes() for r in store.manifest()}
    net, _ = store.read_model("segmenter", 0)
    out |= {f"model/{k}": v.numpy().tobytes() for k, v in net.state_dict().items()}
    return out


def command_threads(env: dict | None = None) -> int:
    """How many threads torch uses in a fresh process with environment ``env`` (a `wsseg` command's)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                              capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, prefect_harness, cluster) -> Path:
    """A finished run directory: `train` with :data:`TINY` on :data:`KILL_IDS`, never interrupted,
    on a local cluster, in this process with as many torch threads as a command's own process has
    (the numbers depend on the configuration, the seed and the thread count, not on which process
    runs the flow or how the images are sharded). Read it, never write it: tests share it."""
    import torch

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.tasks.config import WSSSConfig

    base = tmp_path_factory.mktemp("tiny-reference")
    src = copy_sample(base / "src", KILL_IDS)
    on_cluster(ingest, cluster)(str(src), str(base / "run"), shard_size=8)
    before = torch.get_num_threads()
    torch.set_num_threads(command_threads(dict(os.environ, OMP_WAIT_POLICY="PASSIVE")))
    try:
        on_cluster(train_wsss, cluster)(str(base / "run"), WSSSConfig.model_validate(TINY), cluster)
    finally:
        torch.set_num_threads(before)
    return base / "run"


@pytest.fixture(scope="session")
def tiny_reference(tiny_run) -> dict[str, bytes]:
    """:func:`run_outputs` of :func:`tiny_run`: what a killed-and-resumed `train` and a `train` on
    an existing cluster must give bit for bit."""
    return run_outputs(tiny_run)

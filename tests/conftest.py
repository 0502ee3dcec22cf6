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

    from flows.runtime import dask_cluster

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()
    with dask_cluster(None, workers, tmp_path_factory.mktemp("dask")) as address:
        if previous is None:  # this process's own commands and subprocesses start as before
            os.environ.pop("PREFECT_API_URL", None)
        yield address


@pytest.fixture(scope="session")
def cluster(prefect_harness, tmp_path_factory):
    """One two-worker LocalCluster for the whole session, its workers reporting to the
    harness's Prefect API (starting one per test module cost 10-25 s each, and its workers' first
    task as much again: torch and the method's modules imported)."""
    with harness_cluster(tmp_path_factory) as address:
        yield address

"""The one door to MLflow: training code calls a small logger interface.

``Tracker`` opens (nested) runs on the tracking URI of the run directory
(``sqlite:///RUN/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` says otherwise), flattens a config
into parameters and also logs it whole as a JSON file. Every run it opens inside a Prefect flow
run carries that flow run's id and UI URL as tags (``prefect.flow_run_id``,
``prefect.flow_run_url``), and :meth:`Tracker.run_url` gives an MLflow run's UI URL for Prefect
artifacts to link to. :meth:`Tracker.log_model` logs a segmentation network as an MLflow model
(pytorch flavour, tensor signature, pinned requirements, the ``models`` package as its code),
registered under a name when one is given.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
# a tracking server that is gone costs seconds, not minutes of retries (the work goes on without it)
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")

import mlflow  # noqa: E402

from wsseg.tasks.store import Store  # noqa: E402


def _pins() -> list[str]:
    """What loading a logged model needs, pinned to the versions that wrote it: torch and numpy
    (the exported program and its tensors) and mlflow."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("torch", "numpy", "mlflow"):
        try:
            v = version(dist).split("+")[0]  # 2.13.0+cpu -> 2.13.0: the local tag is not on PyPI
        except PackageNotFoundError:
            continue
        out.append(f"{dist}=={v}")
    return out


PIP_REQUIREMENTS = _pins()
# Where the MLflow UI answers (``wsseg ui`` and the README start it on 127.0.0.1:5000): the base
# of the run URLs put in Prefect artifacts. WSSEG_MLFLOW_UI_URL overrides it; a tracking URI that
# is an http(s) server is its own UI.
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
# The user's own server, read once: mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into the
# environment, so reading it later would send a second run directory's runs to the first one's DB.
USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


def tracking_uri(run_dir: Path) -> str:
    return USER_TRACKING_URI or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def mlflow_ui_url() -> str:
    """The MLflow UI's base URL."""
    env = os.environ.get("WSSEG_MLFLOW_UI_URL")
    if env:
        return env.rstrip("/")
    if USER_TRACKING_URI and USER_TRACKING_URI.startswith(("http://", "https://")):
        return USER_TRACKING_URI.rstrip("/")
    return DEFAULT_MLFLOW_UI


def prefect_tags() -> dict[str, str]:
    """The current Prefect flow run's id and UI URL (the URL when the UI's or the API's address
    is known: PREFECT_UI_URL, or derived from PREFECT_API_URL); empty outside a flow run."""
    try:
        from prefect.context import FlowRunContext
        from prefect.runtime import flow_run
        from prefect.settings import PREFECT_UI_URL

        run_id = flow_run.get_id()
        if not run_id:
            return {}
        tags = {"prefect.flow_run_id": str(run_id)}
        ctx = FlowRunContext.get()  # the name from the context only: outside it, runtime asks the API
        if ctx is not None and ctx.flow_run is not None and ctx.flow_run.name:
            tags["prefect.flow_run_name"] = str(ctx.flow_run.name)
        ui = PREFECT_UI_URL.value()
        if ui:
            tags["prefect.flow_run_url"] = f"{str(ui).rstrip('/')}/runs/flow-run/{run_id}"
        return tags
    except Exception:  # no Prefect, or no context: the run is recorded without the tags
        return {}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
    return out


def relocate(db: Path, before: str, artifacts: Path) -> None:
    """A run directory moved or copied elsewhere: MLflow's records in its ``mlflow.db`` (an
    experiment's, each run's and logged model's artifact location) and its models' ``MLmodel`` files
    name the artifacts where they were (``before``, a ``file:`` URI of the old ``mlartifacts``);
    they are pointed at ``artifacts``, the folder now, so that new runs write their artifacts in
    the run directory and not where it was (in the original, for a copy), and the MLflow UI finds
    the old ones. Only values that start with ``before`` change."""
    import sqlite3

    if not before.startswith("file:"):
        return
    after = artifacts.as_uri()
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as con, con:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for column in [c[1] for c in con.execute(f'PRAGMA table_info("{table}")') if "CHAR" in c[2].upper()
                           or "TEXT" in c[2].upper()]:
                con.execute(f'UPDATE "{table}" SET "{column}" = ? || substr("{column}", ?) WHERE "{column}" = ? '
                            f'OR substr("{column}", 1, ?) = ?',
                            (after, len(before) + 1, before, len(before) + 1, before + "/"))
    for mlmodel in artifacts.rglob("MLmodel"):
        text = mlmodel.read_text()
        if before + "/" in text:
            mlmodel.write_text(text.replace(before + "/", after + "/"))


class Tracker:
    """Thin wrapper over an active MLflow run that never stops the work it records.

    When MLflow cannot record something (its server unreachable, its database locked or gone),
    one line on the terminal says what could not be recorded and why; the method's outputs and
    checkpoints are written by the store regardless, and this tracker records nothing more."""

    def __init__(self, run_dir: Path, experiment: str = "wsseg"):
        self.run_dir = Path(run_dir)
        self.artifact_root = (self.run_dir / "mlartifacts").resolve()
        self.uri = tracking_uri(self.run_dir)
        self.failed: str | None = None
        self.experiment_id: str | None = None
        with self._guard("the experiment"):
            mlflow.set_tracking_uri(self.uri)
            exp = mlflow.get_experiment_by_name(experiment)
            if exp is None:
                mlflow.create_experiment(experiment, artifact_location=self.artifact_root.as_uri())
            elif USER_TRACKING_URI is None and exp.artifact_location != self.artifact_root.as_uri():
                relocate(self.run_dir / "mlflow.db", exp.artifact_location, self.artifact_root)
            self.experiment_id = mlflow.set_experiment(experiment).experiment_id

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        if self.failed is not None:
            yield  # the caller's body is skipped by its own check of self.failed
            return
        try:
            yield
        except Exception as e:  # MLflow raises many kinds (HTTP, SQLAlchemy, OS); none may stop the run
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.failed = f"{what}: {type(e).__name__}: {first}"
            print(f"wsseg: warning: MLflow at {self.uri} could not record {what} ({type(e).__name__}: "
                  f"{first[:300]}); the work goes on and its outputs are written, but MLflow records nothing "
                  "more of this command", file=sys.stderr, flush=True)

    @contextmanager
    def run(self, name: str, *, nested: bool = False, tags: dict[str, str] | None = None) -> Iterator[str | None]:
        """An MLflow run for the body; yields its id (None when MLflow cannot record). Inside a
        Prefect flow run, the run is tagged with the flow run's id and URL."""
        active = None
        if self.failed is None:
            with self._guard(f"the start of run {name!r}"):
                active = mlflow.start_run(run_name=name, nested=nested, tags={**prefect_tags(), **(tags or {})})
        status = "FINISHED"
        try:
            yield active.info.run_id if active is not None else None
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if active is not None and self.failed is None:
                with self._guard(f"the end of run {name!r}"):
                    mlflow.end_run(status)
            elif active is not None:
                try:
                    mlflow.end_run(status)  # leave no active run behind in this process
                except Exception:
                    pass

    def log_params(self, config: dict[str, Any]) -> None:
        if self.failed is None:
            with self._guard("parameters"):
                flat = flatten(config)
                for i in range(0, len(flat), 90):
                    mlflow.log_params(dict(list(flat.items())[i:i + 90]))
                mlflow.log_dict(config, Store.CONFIG_FILE)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and v == v}
        if clean and self.failed is None:
            with self._guard(f"metrics {', '.join(sorted(clean))[:80]}"):
                mlflow.log_metrics(clean, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags of the active run (e.g. why the rounds stopped), as strings; None values skipped."""
        clean = {k: str(v) for k, v in tags.items() if v is not None}
        if clean and self.failed is None:
            with self._guard(f"tags {', '.join(sorted(clean))[:80]}"):
                mlflow.set_tags(clean)

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        if self.failed is None:
            with self._guard(f"artifact {path}"):
                from wsseg.tasks.store.remote import local_copy

                with local_copy(path) as local:  # a file of a run directory on object storage: copied here
                    mlflow.log_artifact(str(local), artifact_path=folder)

    def log_model(self, model, name: str = "model", *, in_channels: int, num_classes: int,
                  register: str | None = None) -> dict | None:
        """Log a segmentation network as an MLflow model of the pytorch flavour in the active run.

        Its signature: input a float32 image batch (-1, in_channels, -1, -1) as
        :func:`tasks.common.training.to_input` makes it (the normalised RGB channels, then the edge
        channel when the network takes one), output the class scores (-1, num_classes, -1, -1);
        ``mlflow.pyfunc.load_model(uri).predict(x)`` returns those scores, whose argmax over axis
        1 is the label map. Registered as a new version of ``register`` when given. Returns
        ``{"model_uri", "registered_name", "registered_version"}`` (None when MLflow cannot record).

        Saved as a ``torch.export`` program (MLflow's ``pt2`` format: graph and weights, no pickled
        classes), so loading it runs no code from the file, as for the store's checkpoints; the
        export costs a few seconds once per training. Height and width stay free, the batch too
        (the example has two images)."""
        if self.failed is not None:
            return None
        out = None
        with self._guard(f"model {name}"):
            import mlflow.pytorch
            import numpy as np
            from mlflow.models import ModelSignature
            from mlflow.types import Schema, TensorSpec

            signature = ModelSignature(
                inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, int(in_channels), -1, -1))]),
                outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, int(num_classes), -1, -1))]))
            was_training = model.training
            model.eval()  # pyfunc predicts with the network as saved
            example = np.zeros((2, int(in_channels), 64, 64), np.float32)
            try:
                info = mlflow.pytorch.log_model(model, name=name, signature=signature, serialization_format="pt2",
                                                input_example=example, pip_requirements=PIP_REQUIREMENTS,
                                                registered_model_name=register)
            finally:
                model.train(was_training)
            out = {"model_uri": info.model_uri, "registered_name": register,
                   "registered_version": getattr(info, "registered_model_version", None)}
        return out

    def has_model(self, logged: dict | None) -> bool:
        """Whether the model ``logged`` (what :meth:`log_model` returned) is still recorded here,
        with its files: a rerun that trained nothing points at it instead of logging the same
        network again (26 MB and 13-21 s each time on msrc21's default network)."""
        uri = (logged or {}).get("model_uri") or ""
        if self.failed is not None or not uri.startswith("models:/m-"):
            return False
        try:
            import mlflow

            found = mlflow.get_logged_model(uri.removeprefix("models:/"))
            location = found.artifact_location or ""
            local = Path(location.removeprefix("file://")) if location.startswith(("file://", "/")) else None
            return found.status.name == "READY" and (local is None or (local / "MLmodel").is_file())
        except Exception:  # gone, or another store's id: log the model again
            return False

    def run_url(self, run_id: str | None) -> str | None:
        """The MLflow UI's page of run ``run_id`` (None without a run), e.g.
        ``http://127.0.0.1:5000/#/experiments/1/runs/<id>``."""
        if not run_id or self.experiment_id is None:
            return None
        return f"{mlflow_ui_url()}/#/experiments/{self.experiment_id}/runs/{run_id}"

    @staticmethod
    def active_run_id() -> str | None:
        r = mlflow.active_run()
        return r.info.run_id if r else None

"""The one door to MLflow: training code calls a small logger interface.

``Tracker`` opens (nested) runs on the tracking URI of the run directory
(``sqlite:///RUN/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` says otherwise), flattens a config
into parameters and also logs it whole as a JSON file.
"""
from __future__ import annotations

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

PIP_REQUIREMENTS = ["torch>=2.4", "numpy"]
# The user's own server, read once: mlflow.set_tracking_uri() writes MLFLOW_TRACKING_URI into the
# environment, so reading it later would send a second run directory's runs to the first one's DB.
USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


def tracking_uri(run_dir: Path) -> str:
    return USER_TRACKING_URI or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v, default=str)
    return out


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
        with self._guard("the experiment"):
            mlflow.set_tracking_uri(self.uri)
            exp = mlflow.get_experiment_by_name(experiment)
            if exp is None:
                mlflow.create_experiment(experiment, artifact_location=self.artifact_root.as_uri())
            mlflow.set_experiment(experiment)

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
        """An MLflow run for the body; yields its id (None when MLflow cannot record)."""
        active = None
        if self.failed is None:
            with self._guard(f"the start of run {name!r}"):
                active = mlflow.start_run(run_name=name, nested=nested, tags=tags)
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
                mlflow.log_dict(config, "config.json")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and v == v}
        if clean and self.failed is None:
            with self._guard(f"metrics {', '.join(sorted(clean))[:80]}"):
                mlflow.log_metrics(clean, step=step)

    def log_artifact(self, path: Path, folder: str | None = None) -> None:
        if self.failed is None:
            with self._guard(f"artifact {path}"):
                mlflow.log_artifact(str(path), artifact_path=folder)

    def log_model(self, model, name: str = "model") -> None:
        if self.failed is None:
            with self._guard(f"model {name}"):
                import mlflow.pytorch
                mlflow.pytorch.log_model(model, name=name, pip_requirements=PIP_REQUIREMENTS)

    @staticmethod
    def active_run_id() -> str | None:
        r = mlflow.active_run()
        return r.info.run_id if r else None

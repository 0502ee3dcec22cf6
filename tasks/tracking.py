"""The one door to MLflow: training code calls a small logger interface.

``Tracker`` opens (nested) runs on the tracking URI of the run directory
(``sqlite:///RUN/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` says otherwise), flattens a config
into parameters and also logs it whole as a JSON file.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

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
    """Thin wrapper over an active MLflow run."""

    def __init__(self, run_dir: Path, experiment: str = "wsseg"):
        self.run_dir = Path(run_dir)
        self.artifact_root = (self.run_dir / "mlartifacts").resolve()
        mlflow.set_tracking_uri(tracking_uri(self.run_dir))
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is None:
            mlflow.create_experiment(experiment, artifact_location=self.artifact_root.as_uri())
        mlflow.set_experiment(experiment)

    @contextmanager
    def run(self, name: str, *, nested: bool = False, tags: dict[str, str] | None = None) -> Iterator[str]:
        with mlflow.start_run(run_name=name, nested=nested, tags=tags) as r:
            yield r.info.run_id

    @staticmethod
    def log_params(config: dict[str, Any]) -> None:
        flat = flatten(config)
        for i in range(0, len(flat), 90):
            mlflow.log_params(dict(list(flat.items())[i:i + 90]))
        mlflow.log_dict(config, "config.json")

    @staticmethod
    def log_metrics(metrics: dict[str, float], step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and v == v}
        if clean:
            mlflow.log_metrics(clean, step=step)

    @staticmethod
    def log_artifact(path: Path, folder: str | None = None) -> None:
        mlflow.log_artifact(str(path), artifact_path=folder)

    @staticmethod
    def log_model(model, name: str = "model") -> None:
        import mlflow.pytorch
        mlflow.pytorch.log_model(model, name=name, pip_requirements=PIP_REQUIREMENTS)

    @staticmethod
    def active_run_id() -> str | None:
        r = mlflow.active_run()
        return r.info.run_id if r else None

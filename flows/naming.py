"""Names a user reads in the Prefect dashboard: a flow run after what it does and the run
directory it works in (``demo/round-2``, ``demo/train-wsss``, ``demo/ingest``), a shard task run
after its round, stage and images (``round-2/pseudo-labels 11_21_s..12_8_s (8 images)``)."""
from __future__ import annotations

from typing import Any


def run_dir_name(run_dir: Any) -> str:
    """The last part of a run directory's path or URL (``runs/demo`` and ``s3://b/demo/`` -> ``demo``)."""
    text = str(run_dir).rstrip("/")
    return text.rsplit("/", 1)[-1] or text


class FlowRunName:
    """A flow's ``flow_run_name``: ``what`` (formatted with the run's parameters) after the name of
    its run directory, when it has one."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self) -> str:
        from prefect.runtime import flow_run

        return flow_run_label(self.what, flow_run.parameters)

    def __repr__(self) -> str:
        return f"FlowRunName({self.what!r})"


def flow_run_label(what: str, parameters: dict) -> str:
    label = what.format(**parameters)
    run_dir = parameters.get("run_dir")
    return f"{run_dir_name(run_dir)}/{label}" if run_dir else label


class ShardRunName:
    """A shard task's ``task_run_name``: its stage, the round when it has one, and its images."""

    def __init__(self, stage: str):
        self.stage = stage

    def __call__(self, parameters: dict) -> str:
        return shard_run_label(self.stage, parameters)

    def __repr__(self) -> str:
        return f"ShardRunName({self.stage!r})"


def shard_run_label(stage: str, parameters: dict) -> str:
    ids = list(parameters.get("ids") or [])
    r = parameters.get("round_index")
    span = f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else (ids[0] if ids else "no images")
    return f"{f'round-{r}/' if r is not None else ''}{stage} {span} ({len(ids)} image{'s' if len(ids) != 1 else ''})"

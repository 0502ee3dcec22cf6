"""``wsseg bench panel``: ``bench quality`` on each corpus of a panel folder, one table.

Each corpus runs :func:`flows.bench_quality.bench_quality` (its own flow run) in its own run
directory RUN_DIR/NAME, one after the other on one Dask cluster and one Prefect API; its result
JSON (with ``.md`` and ``.png``) is written to OUT_STEM/NAME.json beside the panel's JSON, with the
provenance of the ``wsseg bench quality`` command that gives the same figures. A corpus that fails
is recorded with its error and the others still run. The panel's figures, means and targets are
:mod:`tasks.bench.panel`'s. Import this module only after :func:`flows.runtime.prepare` has run.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from wsseg.flows.runtime import on_cluster
from wsseg.tasks.bench import panel as bp
from wsseg.tasks.bench.provenance import provenance, stamp
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store import Store, files

__all__ = ["check_panel", "corpus_out", "run_panel"]


def check_panel(panel: str | Path, names: Sequence[str] | None) -> list[tuple[str, Path, str, str | None]]:
    """(name, folder, kind, object class) of each corpus to run, every one checked as ``wsseg
    ingest`` checks a source (without decoding): a missing or broken corpus fails here, before any
    corpus runs (:class:`tasks.corpus.ingest.IngestError`, ValueError)."""
    from wsseg.tasks.corpus import ingest as ing

    out = []
    for name, folder in bp.corpus_folders(panel, names):
        check = ing.check_source(folder, headers=False)
        check.raise_for(False)
        spec = check.classes
        background = None if spec.background is None else spec.names[spec.background]
        out.append((name, folder, *bp.corpus_kind(list(spec.names), background)))
    return out


def corpus_out(out: Path, name: str) -> Path:
    """Where corpus ``name``'s result JSON goes: OUT_STEM/NAME.json beside the panel's ``out``."""
    return out.parent / out.stem / f"{name}.json"


def run_panel(panel: str | Path, names: Sequence[str] | None, run_dir: Path, out: Path, config: WSSSConfig,
              quality_argv: Sequence[str], *, eval_split: str | None = "val", dask_address: str | None = None,
              at_defaults: bool = False) -> dict:
    """``bench quality`` on each corpus of ``panel`` (``names``, default all) with ``config``, on the
    Dask cluster at ``dask_address``; the panel's result (:func:`tasks.bench.panel.panel_result`
    with each corpus's ``result`` file, ``run_dir`` and ``wall_seconds``), written to ``out``.
    ``quality_argv``: the options every corpus's ``wsseg bench quality`` command shares (its
    provenance: the command that gives the same figures alone)."""
    from wsseg.flows.bench_quality import bench_quality

    corpora = check_panel(panel, names)
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    for i, (name, folder, kind, obj) in enumerate(corpora, start=1):
        run, c_out = run_dir / name, corpus_out(out, name)
        tag = f"[panel {i}/{len(corpora)}] {name}"
        print(f"{tag}: {kind}{f' ({obj})' if obj else ''}, bench quality in {run} ...", file=sys.stderr, flush=True)
        argv = ["bench", "quality", "--data", str(folder), "--run-dir", str(run), "--out", str(c_out),
                *quality_argv]
        started, t = provenance(argv), time.perf_counter()
        try:
            with Store(run).lock("wsseg bench panel"):
                res = on_cluster(bench_quality, dask_address)(
                    str(folder), str(run), config, str(c_out), eval_split=eval_split, dask_address=dask_address,
                    background="auto")
            res["provenance"] = stamp(c_out, {**started, "part_of": "wsseg bench panel"}, indent=1)
            row = bp.corpus_figures(res, kind, obj)
        except Exception as e:  # one corpus's failure leaves the others to run; the panel says which
            print(f"{tag}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            row = {"kind": kind, "object_class": obj, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        row |= {"data": str(folder), "run_dir": str(run), "result": str(c_out) if "error" not in row else None,
                "wall_seconds": time.perf_counter() - t}
        rows[name] = row
        if "error" not in row:
            vs = ", ".join(f"{bp.HEADINGS[s]} {'-' if row.get(s) is None else f'{row[s]:.3f}'}" for s in bp.SOURCES[1:])
            print(f"{tag}: {row['measure']} {row['ours']:.3f} ({vs}) in {row['wall_seconds']:.0f} s",
                  file=sys.stderr, flush=True)
    res = bp.panel_result(rows, at_defaults) | {
        "panel": str(Path(panel).resolve()), "run_dir": str(run_dir), "config": config.model_dump(mode="json"),
        "eval_split": eval_split, "wall_seconds": time.perf_counter() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(out, res, indent=1)
    out.with_suffix(".md").write_text(bp.markdown(res), encoding="utf-8")
    return res

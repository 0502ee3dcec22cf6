"""The ``wsseg`` command line.

    wsseg demo                      the whole method on the bundled 64-image sample
    wsseg ingest SOURCE             a dataset folder (labels.csv or VOC layout) -> corpus store
    wsseg train                     refresh rounds until convergence (flow train_wsss)
    wsseg evaluate                  mIoU of pseudo-labels or of a model against the masks
    wsseg bench quality|train|highres
    wsseg segment IMAGE...          inference with a trained model, any image size
    wsseg ui                        start the Prefect and MLflow UIs on 127.0.0.1 for a run dir
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent / "sample" / "msrc21"


def _common(p: argparse.ArgumentParser, default_run: str) -> None:
    p.add_argument("--run-dir", default=default_run,
                   help=f"run directory holding the corpus store, rounds, Prefect and MLflow state (default: {default_run})")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                   help="Dask worker processes of the local cluster (default: one per core)")
    p.add_argument("--dask-address", default=None,
                   help="use an existing Dask scheduler (tcp://host:8786) instead of a local cluster")
    p.add_argument("--verbose", action="store_true", help="show Prefect's own log lines")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=None, help="round budget (default from the config: 3)")
    p.add_argument("--model", default=None, help="segmentation network from the registry (small, fusion, global_local)")
    p.add_argument("--backbone-weights", nargs="+", default=None, metavar="NAME=PATH",
                   help="torchvision ImageNet checkpoints for the fusion model, e.g. resnet50=r50.pth "
                        "mobilenet_v2=mnv2.pth (loaded with torch.load(weights_only=True))")
    p.add_argument("--device", default=None, help="auto (CUDA when present, else CPU), cpu or cuda")
    p.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, dotted, e.g. --set proposals.t1=0.4 (repeatable)")


def build_config(args, base: dict | None = None):
    from flows.config import WSSSConfig

    data = dict(base or {})
    if getattr(args, "config", None):
        data = _merge(data, json.loads(Path(args.config).read_text()))
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
    if getattr(args, "model", None):
        data.setdefault("segmentation", {})["model"] = args.model
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
    return WSSSConfig.model_validate(data)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Demo budget: the bundled sample, 2 CPU cores, within 5 minutes.
DEMO_CONFIG = {
    "classifier": {"epochs": 20, "size": 160, "width": 16, "stride": 16, "batch_size": 16, "cam_scales": [1.0]},
    "mil": {"iterations": 1},
    "proposals": {"epochs": 10},
    "segmentation": {"epochs": 3, "options": {"width": 16}, "crop": 160, "batch_size": 8},
    "shard_size": 32,
}


def print_rounds(rows: list[dict], stream=sys.stdout) -> None:
    print(f"{'round':>6} {'mIoU':>7} {'changed':>8} {'ignore':>7} {'wall s':>7}", file=stream)
    for r in rows:
        f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        print(f"{str(r['round']):>6} {f(r['pseudo_label_miou']):>7} {f(r['changed_share']):>8} "
              f"{f(r['ignore_share']):>7} {f(r['wall_seconds'], 1):>7}", file=stream)


def print_where(run_dir: Path, stream=sys.stdout) -> None:
    print(f"\nPrefect runs:  {run_dir / '.prefect'} (PREFECT_HOME); UI: `wsseg ui --run-dir {run_dir}` "
          f"or PREFECT_HOME={run_dir / '.prefect'} prefect server start --host 127.0.0.1", file=stream)
    print(f"MLflow runs:   sqlite:///{run_dir / 'mlflow.db'}; UI: mlflow ui --host 127.0.0.1 "
          f"--backend-store-uri sqlite:///{run_dir / 'mlflow.db'}", file=stream)


# ---------------------------------------------------------------------------- commands
def cmd_ingest(args) -> int:
    from flows.wsss import ingest, runner
    from flows.runtime import dask_cluster

    bg = None if args.background == "none" else args.background
    with dask_cluster(args.dask_address, args.workers, Path(args.run_dir)) as address:
        s = ingest.with_options(task_runner=runner(address))(str(args.source), args.run_dir, args.shard_size,
                                                             args.skip_invalid, bg)
    print(f"ingested {s['images']} images ({s['skipped']} skipped), {s['classes']} classes, "
          f"splits {s['splits']}, implicit background: {s['implicit_background']}")
    print(Path(args.run_dir).resolve() / "corpus")
    return 0


def cmd_train(args, base: dict | None = None) -> int:
    from flows.runtime import dask_cluster
    from flows.wsss import runner, train_wsss

    config = build_config(args, base)
    run = Path(args.run_dir).resolve()
    with dask_cluster(args.dask_address, args.workers, run) as address:
        s = train_wsss.with_options(task_runner=runner(address))(str(run), config, address)
    print()
    print_rounds(s["rounds"])
    print(f"\nconverged: {s['converged']}; {len(s['rounds']) - 1} round(s) on {s['images']} images in "
          f"{s['wall_seconds']:.0f}s; final model {s['final_model']}")
    print_where(run)
    print(run / "summary.json")
    return 0


def cmd_demo(args) -> int:
    from flows.runtime import dask_cluster
    from flows.wsss import ingest, runner, train_wsss

    t0 = time.perf_counter()
    run = Path(args.run_dir).resolve()
    config = build_config(args, DEMO_CONFIG)
    print(f"wsseg demo: {SAMPLE} -> {run}", flush=True)
    with dask_cluster(args.dask_address, args.workers, run) as address:
        ingest.with_options(task_runner=runner(address))(str(SAMPLE), str(run), 16, False, "auto")
        s = train_wsss.with_options(task_runner=runner(address))(str(run), config, address)
    print("\npseudo-label quality on the sample (tags only for training; masks only for this table):")
    print_rounds(s["rounds"])
    print(f"\nconverged: {s['converged']}; total wall time {time.perf_counter() - t0:.0f}s; "
          f"overlays: {run / 'rounds' / 'r000' / 'overlay.png'} ...")
    print_where(run)
    print(run / "summary.json")
    return 0


def cmd_evaluate(args) -> int:
    from flows.runtime import dask_cluster
    from flows.wsss import evaluate, runner

    with dask_cluster(args.dask_address, args.workers, Path(args.run_dir)) as address:
        res = evaluate.with_options(task_runner=runner(address))(str(Path(args.run_dir).resolve()), args.round,
                                                                 args.split, args.source)
    gate = (f" (gated by the image classifier; ungated {res['ungated_miou']:.4f})"
            if res.get("gated") else "")
    print(f"round {res['round']} {args.source} on {args.split}: mIoU {res['miou']:.4f}, "
          f"pixel accuracy {res['pixel_accuracy']:.4f}{gate}")
    for name, v in res["per_class_iou"].items():
        print(f"  {name:>12} {'-' if v is None else f'{v:.3f}'}")
    return 0


def cmd_ui(args) -> int:
    import subprocess

    run = Path(args.run_dir).resolve()
    env = dict(os.environ, PREFECT_HOME=str(run / ".prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    procs = [
        subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                          "--port", str(args.prefect_port)], env=env),
        subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                          str(args.mlflow_port), "--workers", "1", "--backend-store-uri",
                          f"sqlite:///{run / 'mlflow.db'}"], env=env),
    ]
    print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}   MLflow UI: http://127.0.0.1:{args.mlflow_port}"
          "   (Ctrl-C stops both)")
    try:
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wsseg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="ingest the bundled sample and run refresh rounds on it",
                       description="Ingest the bundled 64-image MSRC-21 sample, run refresh rounds until convergence "
                                   "or 3 rounds, print per-round pseudo-label mIoU (masks used only to measure) "
                                   "and write summary.json.")
    _common(p, "runs/demo")
    _config_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ingest", help="a dataset folder -> corpus store",
                       description="Ingest a folder with images/ + labels.csv (image_id,labels[,split]; tags "
                                   "separated by ';'), optional classes.txt, masks/ and <split>.txt, or a PASCAL VOC "
                                   "layout, into the run directory's corpus store.")
    p.add_argument("source", type=Path)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--skip-invalid", action="store_true", help="drop unreadable images instead of failing")
    p.add_argument("--background", default="auto",
                   help="implicit background class name, 'none', or 'auto' (first class named background)")
    _common(p, "runs/default")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("train", help="refresh rounds until convergence (flow train_wsss)",
                       description="Run refresh rounds on the ingested corpus until the changed-pixel share falls "
                                   "under epsilon or the round budget ends. Re-running resumes a stopped run.")
    _common(p, "runs/default")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="mIoU against the ground-truth masks")
    _common(p, "runs/default")
    p.add_argument("--round", type=int, default=None, help="round to evaluate (default: the last)")
    p.add_argument("--split", default="train")
    p.add_argument("--source", choices=["pseudo", "cam", "model"], default="pseudo",
                   help="pseudo: the round's labels; cam: round 0's CAM labels; model: the round's segmenter on "
                        "the split, gated by the image classifier when the run's inference.gate is on (the "
                        "default; the ungated figure is printed beside it)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("ui", help="start the Prefect and MLflow UIs on 127.0.0.1")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.set_defaults(func=cmd_ui)

    bench = sub.add_parser("bench", help="benchmarks that print and write figures").add_subparsers(
        dest="bench", required=True)
    _register_optional(sub, bench)
    return ap


def _register_optional(sub, bench) -> None:
    """Subcommands living in their own modules (benchmarks, high-resolution segmentation)."""
    import importlib

    for module, fn, target in (("flows.bench_quality", "add_bench_quality_parser", bench),
                               ("flows.bench_train", "add_bench_train_parser", bench),
                               ("flows.highres", "add_bench_highres_parser", bench),
                               ("flows.highres", "add_segment_parser", sub)):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        getattr(mod, fn)(target)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if hasattr(args, "run_dir"):
        from flows.runtime import prepare

        prepare(args.run_dir, verbose=getattr(args, "verbose", False))
    try:
        return args.func(args)
    except Exception as e:  # clear one-line errors for input problems, tracebacks for bugs
        from tasks.ingest import IngestError

        if isinstance(e, (IngestError, FileNotFoundError, ValueError)) and not getattr(args, "verbose", False):
            print(f"wsseg: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

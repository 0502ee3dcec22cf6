"""What the commands of :mod:`flows.cli` share: the run-directory, storage, cluster and
configuration options, the configuration they build, and the lines they print at the end."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent / "sample" / "msrc21"
#: the run directory of every command that is not given --run-dir
DEFAULT_RUN_DIR = "runs/default"


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wsseg")
    except PackageNotFoundError:
        return "unknown (not installed)"


def common_args(p: argparse.ArgumentParser, default_run: str = DEFAULT_RUN_DIR) -> None:
    p.add_argument("--run-dir", default=default_run,
                   help=f"run directory holding the corpus store, rounds, Prefect and MLflow state (default: {default_run}); "
                        "or an fsspec URL such as s3://bucket/run (the store on object storage, the Prefect and MLflow "
                        "state in a local state folder, see --state-dir)")
    storage_args(p)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                   help="Dask worker processes of the local cluster (default: one per core)")
    p.add_argument("--dask-address", default=None,
                   help="use an existing Dask scheduler (tcp://host:8786) instead of a local cluster")
    p.add_argument("--verbose", action="store_true",
                   help="show the libraries' own log lines (Prefect, MLflow, Dask) and input errors' tracebacks")


def reader_args(p: argparse.ArgumentParser, round_help: str) -> None:
    """The options of a command that only reads a finished round (``export``, ``review``):
    --run-dir (dest ``run``, as ``status``'s: such a command creates no run directory, see
    :func:`flows.runtime.prepare`), the storage options, --round and --json."""
    p.add_argument("--run-dir", dest="run", default=DEFAULT_RUN_DIR,
                   help=f"the run directory, or an fsspec URL (default: {DEFAULT_RUN_DIR})")
    storage_args(p, state=False)
    p.add_argument("--round", default="final", help=round_help)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")


def print_result(args, res: dict, text: str, out=None) -> int:
    """A command's result: one JSON object with --json, else ``text`` (and the file ``out``)."""
    import json

    if getattr(args, "json", False):
        print(json.dumps(res, default=str))
        return 0
    print()
    print(text)
    if out is not None:
        print(out)
    return 0


def storage_args(p: argparse.ArgumentParser, state: bool = True) -> None:
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
    from wsseg.tasks.store.remote import OPTIONS_ENV, STATE_DIR_ENV, parse_storage_options

    if getattr(args, "storage_options", None):
        opts = json.loads(os.environ.get(OPTIONS_ENV) or "{}") | parse_storage_options(args.storage_options)
        os.environ[OPTIONS_ENV] = json.dumps(opts)
    if getattr(args, "state_dir", None):
        os.environ[STATE_DIR_ENV] = str(Path(args.state_dir).expanduser().resolve())


def run_root(run_dir):
    """The run directory as the store sees it: a resolved local path, or for an fsspec URL its UPath
    (the scheme's package checked: a one-line error naming it when missing)."""
    from wsseg.tasks.store import Store

    return Store(run_dir).root


def config_args(p: argparse.ArgumentParser, resume: bool = False) -> None:
    """The configuration's options. ``resume`` (``train``): they apply to the run directory's
    recorded configuration (:meth:`Store.read_config`), not to the defaults, and --defaults, --recompute are added."""
    p.add_argument("--rounds", type=int, default=None, help="round budget (default from the config: 3)")
    p.add_argument("--network", "--model", dest="network", default=None, metavar="NAME",
                   help="segmentation network from the registry: lite (ImageNet-pretrained EfficientNet-Lite0), "
                        "small (from scratch), fusion or global_local (default: the config's, lite); --model is an alias")
    p.add_argument("--backbone-weights", nargs="+", default=None, metavar="NAME=PATH",
                   help="torchvision ImageNet checkpoints for the fusion model, e.g. resnet50=r50.pth "
                        "mobilenet_v2=mnv2.pth (loaded with torch.load(weights_only=True))")
    p.add_argument("--device", default=None,
                   help="auto (CUDA when present, else CPU), cpu or cuda (cuda:N); where the work runs is not "
                        "part of the configuration: a run directory resumes on another device")
    if not resume:
        p.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one field, dotted, e.g. --set proposals.t1=0.4 (repeatable)")
        return
    start = p.add_mutually_exclusive_group()
    start.add_argument("--config", type=Path, default=None,
                       help="JSON file with WSSSConfig fields: the configuration is the file's fields over the "
                            "defaults, not the run directory's (without it, and without --defaults, the run "
                            "resumes with the configuration recorded in RUN/config.json)")
    start.add_argument("--defaults", dest="config", action="store_const", const={},
                       help="start from wsseg's defaults instead of the run directory's recorded configuration "
                            "(--set and the other options apply over them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, dotted, e.g. --set proposals.t1=0.4 (repeatable), over the run "
                        "directory's recorded configuration (over the defaults with --defaults or --config)")
    p.add_argument("--recompute", action="store_true",
                   help="compute again the finished results (the image classifier, rounds, models) that the "
                        "options change; without it such options are refused with one line naming what they "
                        "would recompute, and nothing is changed")


def run_configuration(run_dir) -> dict:
    """The configuration a run directory's results were computed with (:meth:`Store.read_config`,
    without where the work ran), as JSON. A run whose first `train` was stopped before its end has no
    recorded configuration yet (it is written when a train finishes): then the configuration its
    newest finished round recorded (:meth:`Store.round_inputs`: every field but the round budget, from
    its decision when the budget ended the rounds, and the inference settings); empty (the defaults) for a run directory with neither."""
    from wsseg.tasks.config import recorded_config, without_removed
    from wsseg.tasks.store import Store

    if run_dir is None:
        return {}
    store = Store(run_dir)
    recorded = recorded_config(store.read_config())
    if recorded is None:
        for r in reversed(store.finished_rounds()):
            recorded = recorded_config(((store.round_inputs(r) or {}).get("config")))
            if recorded:
                done = store.read_round(r) or {}
                if done.get("stops_rounds") and str(done.get("stop_reason") or "").startswith("round budget"):
                    recorded["max_rounds"] = r + 1  # the budget ended the rounds there: it was r + 1
                break
    # an older record's removed options are not today's fields; the results compare with what it held
    return without_removed(recorded)


def check_device(device: str | None) -> None:
    """A device that is not there (cuda without CUDA, an unknown name): one line, before anything starts."""
    if device is None:
        return
    from wsseg.tasks.common.training import device_problem

    problem = device_problem(device)
    if problem:
        raise ValueError(problem)


def refuse_discarding(args, config) -> None:
    """``wsseg train`` without --recompute: a configuration that would compute finished results
    again (:func:`tasks.wsss.recompute.options_discard`) is refused with one line naming them and
    the options that change them; nothing is changed."""
    if getattr(args, "recompute", False):
        return
    from wsseg.models.efficientnet_lite import PretrainedWeightsError
    from wsseg.tasks.corpus.encoders import with_weight_digests
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss.recompute import describe, options_discard

    store = Store(args.run_dir)
    try:
        gone = options_discard(store, with_weight_digests(config))
    except PretrainedWeightsError as e:
        raise ValueError(str(e)) from None
    if gone:
        raise ValueError(f"{args.run_dir}: the options would compute finished results again: "
                         f"{describe(gone, store.finished_rounds())}; nothing was changed: add --recompute to do "
                         "it, or leave the options out to resume with the run's configuration")


def parse_sets(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as the mapping of :func:`flows.api.train`'s ``overrides`` (a value
    is JSON when it parses as JSON, else the string)."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_config(args, base: dict | None = None):
    """The configuration of the options ``args`` (--config, --defaults, --set, --rounds, ...) over
    ``base``; without ``base``, over the run directory's recorded configuration (``args.run_dir``:
    :func:`run_configuration`, a resumed run keeps its own) or, with --config or --defaults, over the
    defaults. A device that is not there is refused (:func:`check_device`)."""
    import copy

    from wsseg.tasks.config import WSSSConfig

    conf = getattr(args, "config", None)
    if base is None:
        base = {} if conf is not None else run_configuration(getattr(args, "run_dir", None))
    data = copy.deepcopy(base)
    if isinstance(conf, dict):  # --defaults
        data = merge_dicts(data, conf)
    elif conf:
        try:
            data = merge_dicts(data, json.loads(Path(conf).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{conf}: not valid JSON ({e})") from None
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
        config = WSSSConfig.model_validate(data)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ValueError(f"bad configuration (--set / --config): {where}") from None
    check_device(config.device)
    return config


def merge_dicts(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Demo budget: the bundled sample, 2 CPU cores, within 5 minutes.
DEMO_CONFIG = {
    "classifier": {"epochs": 12, "size": 160, "stride": 16, "batch_size": 16, "cam_scales": [1.0]},
    "mil": {"iterations": 1},
    "proposals": {"epochs": 10},
    "segmentation": {"epochs": 3, "crop": 160, "batch_size": 8},
    "shard_size": 32,
}


#: what the columns of :func:`print_rounds` are, printed under it
ROUNDS_LEGEND = (
    "cam: round 0's CAMs as labels; mIoU, cls acc (mean class accuracy): against the masks, where the corpus has\n"
    "them; chance: the mIoU of the same class shares placed at random; changed: share of pixels relabelled since\n"
    "the row above; ignore: share left undecided; tag share: a tagged class's share of its images' pixels\n"
    "(geometric mean: the summary's exp(tag_coverage); a fall means a tagged class shrank)")


def print_rounds(rows: list[dict], stream=sys.stdout) -> None:
    """The rounds table (the CAM baseline, then a row per round) and its legend."""
    from wsseg.tasks.common.metrics import tag_share

    print(f"{'round':>6} {'mIoU':>7} {'cls acc':>7} {'chance':>7} {'changed':>8} {'ignore':>7} {'tag share':>10} "
          f"{'wall s':>7}", file=stream)
    for r in rows:
        f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        print(f"{str(r['round']):>6} {f(r['pseudo_label_miou']):>7} {f(r.get('pseudo_label_class_accuracy')):>7} "
              f"{f(r.get('pseudo_label_chance_miou')):>7} {f(r['changed_share']):>8} {f(r['ignore_share']):>7} "
              f"{f(tag_share(r.get('tag_coverage'))):>10} {f(r['wall_seconds'], 1):>7}", file=stream)
    print(ROUNDS_LEGEND, file=stream)


def print_final(s: dict, stream=sys.stdout) -> None:
    """The final round and why the rounds stopped, and the warnings of a ``train_wsss`` summary."""
    if s.get("final_round") is not None:
        print(f"\nfinal: round {s['final_round']} ({s.get('stop_reason')})", file=stream)
    if s.get("corrected_images"):
        print(f"corrected by a person (wsseg ingest --corrections): {s['corrected_images']} of {s.get('images')} "
              "images, their labels kept as corrected", file=stream)
    for w in s.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)


def print_where(run_dir: Path, stream=sys.stdout) -> None:
    from wsseg.tasks.store.remote import state_dir_for

    state = state_dir_for(run_dir)  # the run directory itself when it is local
    print(f"\nDashboards:    wsseg ui --run-dir {run_dir}   (Prefect flow runs with their logs and artifacts on "
          f"http://127.0.0.1:4200, MLflow runs, metrics, overlays and models on http://127.0.0.1:5000)", file=stream)
    print(f"Run state:     {state / '.prefect'} (PREFECT_HOME), sqlite:///{state / 'mlflow.db'} (MLflow)",
          file=stream)


# ---------------------------------------------------------------------------- commands


def register_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--register", metavar="NAME", default=None,
                   help="register the final model (logged in the MLflow parent run as an MLflow pytorch model) "
                        "as a new version of the MLflow registered model NAME; load it with "
                        "mlflow.pyfunc.load_model('models:/NAME/<version>')")

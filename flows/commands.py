"""The commands of method A and the run directory: ``wsseg demo``, ``ingest``, ``train``,
``refresh``, ``evaluate``, ``export``, ``review``, ``status``, ``ui`` and ``segment`` (their parsers are in
:func:`flows.cli.parser`, ``segment``'s here)."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

from wsseg.flows.cli_common import (SAMPLE, storage_args, run_root, build_config, DEMO_CONFIG, print_rounds,
                                    print_final, print_where, parse_sets)


def cmd_ingest(args) -> int:
    from wsseg.flows import api

    s = api.ingest(args.source, args.run_dir, corrections=args.corrections, shard_size=args.shard_size,
                   skip_invalid=args.skip_invalid, background=args.background, max_pixels=args.max_pixels,
                   min_side=args.min_side, allow_external_links=args.allow_external_links,
                   alpha_background=args.alpha_background, workers=args.workers, dask_address=args.dask_address)
    if args.source is not None:
        print_ingest(args, s)
    return print_corrections(args, s["corrections"]) if args.corrections is not None else 0


def print_corrections(args, res: dict) -> int:
    """``wsseg ingest --corrections PATH``'s result (tasks.labels.corrections); each refused file is
    one line on stderr and the status is 1 when any was refused."""
    from wsseg.tasks.labels.corrections import summary_line

    for line in res["refused"]:
        print(f"wsseg: error: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
    else:
        print(summary_line(res))
        if res["stored"]:
            print(f"the rounds are computed again with them (the features and the image classifier are kept): "
                  f"wsseg train --run-dir {args.run_dir}")
    return 1 if res["refused"] else 0


def print_ingest(args, s: dict) -> None:
    from wsseg.tasks.corpus import ingest as ing

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
    if ch.get("corrections_dropped"):
        print(f"{len(ch['corrections_dropped'])} correction(s) dropped: their images changed, were removed, or lost "
              f"the corrected classes ({', '.join(ch['corrections_dropped'][:5])}"
              f"{', ...' if len(ch['corrections_dropped']) > 5 else ''})")
    print(f"report: {s['report']}")
    print(run_root(args.run_dir) / "corpus")


def cmd_refresh(args) -> int:
    from wsseg.flows import api

    run = run_root(args.run_dir)
    s = api.refresh(args.run_dir, workers=args.workers, dask_address=args.dask_address)
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    miou = "-" if s["pseudo_label_miou"] is None else f"{s['pseudo_label_miou']:.4f}"
    print(f"labelled {s['labelled']} of {s['images']} images with round {s['round']}'s models in "
          f"{s['wall_seconds']:.1f} s ({s['core_ms_per_image']:.0f} core-ms per image: features "
          f"{s['stage_seconds']['features']:.1f} s, preliminary {s['stage_seconds']['prelim']:.1f} s, pseudo-labels "
          f"{s['stage_seconds']['pseudo']:.1f} s); their pseudo-label mIoU {miou}")
    from wsseg.tasks.store import Store

    print(Store(run).root / "refresh.json")
    return 0


def cmd_train(args) -> int:
    from wsseg.flows import api

    run = run_root(args.run_dir)
    s = api.train(args.run_dir, config=args.config, overrides=parse_sets(args.overrides), rounds=args.rounds,
                  network=args.network, device=args.device,
                  backbone_weights=dict(w.partition("=")[::2] for w in args.backbone_weights or []),
                  recompute=args.recompute, workers=args.workers, dask_address=args.dask_address,
                  register=args.register)
    if args.json:
        print(json.dumps(s, default=str))
        return 0
    print()
    print_rounds(s["rounds"])
    print_final(s)
    print(f"\nconverged: {s['converged']}; {len(s['rounds']) - 1} round(s) on {s['images']} images in "
          f"{s['wall_seconds']:.0f}s; final model {s['final_model']}")
    print_where(run)
    from wsseg.tasks.store import Store

    print(Store(run).summary_path)
    return 0


def cmd_demo(args) -> int:
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.tasks.bench.provenance import finished, provenance
    from wsseg.tasks.store import Store

    t0 = time.perf_counter()
    run = run_root(args.run_dir)
    config = build_config(args, DEMO_CONFIG)
    print(f"wsseg demo: {SAMPLE} -> {run}", flush=True)
    started = provenance(getattr(args, "argv", None))
    with dask_cluster(args.dask_address, args.workers, run) as address:
        on_cluster(ingest, address)(str(SAMPLE), str(run), 16, False, "auto")
        s = on_cluster(train_wsss, address)(str(run), config, address, model_name=args.register)
    # the demo's figures are benchmark figures too (`wsseg bench report` reads the run's summary): where
    # they come from goes with them; a later `wsseg train` on the run directory writes its own summary
    store = Store(run)
    store.write_summary({**store.read_summary(), "provenance": finished(started)})
    print("\npseudo-label quality on the sample (tags only for training; masks only for this table):")
    print_rounds(s["rounds"])
    print_final(s)
    print(f"\nconverged: {s['converged']}; total wall time {time.perf_counter() - t0:.0f}s; "
          f"overlays: {run / 'rounds' / 'r000' / 'overlay.png'} ...")
    print_where(run)
    print(store.summary_path)
    return 0


def cmd_evaluate(args) -> int:
    from wsseg.flows import api

    res = api.evaluate(args.run_dir, round=args.round, split=args.split, source=args.source, workers=args.workers,
                       dask_address=args.dask_address)
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
    print("acc.: the share of the class's pixels in the masks labelled as it; chance: its IoU with the same class "
          "shares placed at random")
    return 0


def cmd_status(args) -> int:
    from wsseg.flows import api
    from wsseg.tasks.report.status import format_status

    st = api.status(args.run)
    print(json.dumps(st, default=str) if args.json else format_status(st))
    return 0


def cmd_export(args) -> int:
    from wsseg.flows import api

    res = api.export(args.run, args.out, fmt=args.fmt, round=args.round, images=args.images, force=args.force,
                     review=args.review)
    if args.json:
        print(json.dumps(res))
        return 0
    where = Path(res["out"]) / (res["layout"] if args.fmt == "png" else res["file"])
    which = f"the review queue's top {res['images']}" if args.review is not None else str(res["images"])
    print(f"exported round {res['round']}'s labels of {which} images ({args.fmt}"
          f"{', with the images' if res['with_images'] else ''}; configuration {res['config_digest']}) to {where}")
    if args.fmt == "png":
        print("  splits: " + ", ".join(f"{k} {v}" for k, v in res["splits"].items()) +
              f"; torchvision: VOCSegmentation({res['out']!r}, image_set='trainval'); mmsegmentation: "
              f"data_root={str(where)!r}")
    elif args.fmt == "coco":
        print(f"  {res['annotations']} annotations (one per class present in an image), {res['categories']} "
              f"categories; pycocotools: COCO({str(where)!r})")
    else:
        print(f"  {res['annotations']} brush predictions (one per class present in an image); {res['open_with']}")
        print("  then `wsseg ingest --run-dir RUN --corrections <the project's JSON export>` takes the corrections in")
    if res["images_without_labels"]:
        print(f"  {res['images_without_labels']} image(s) of the corpus have no labels in round {res['round']} "
              f"(split(s) {', '.join(res['missing_splits'])}: the rounds label the tagged split; "
              f"`wsseg refresh` labels new images)")
    return 0


#: what the columns of the review table are, printed under it
REVIEW_LEGEND = (
    "score: the mean of the scored signals' ranks among the round's images, 0 to 1 (1: the worst by every one); "
    "disagreement: share of labelled pixels the round's preliminary network labels otherwise; uncertainty: 1 - its "
    "mean top probability over the image's tags; changed: share of pixels relabelled since the round before; "
    "ignore: share left undecided; missing_tags: share of the image's tags with under 1% of its pixels")


def cmd_review(args) -> int:
    from wsseg.flows import api
    from wsseg.tasks.labels.review import SIGNALS

    res = api.review(args.run, round=args.round, top=args.top)
    r = res["round"]
    if args.json:
        print(json.dumps(res))
        return 0
    measured = any(x.get("iou") is not None for x in res["rows"])
    cols = ["rank", "image_id", "score", *SIGNALS] + (["iou"] if measured else [])
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    table = [[str(i + 1), x["image_id"] + (" (corrected)" if x.get("corrected") else ""),
              *(fmt(x.get(c)) for c in cols[2:])] for i, x in enumerate(res["rows"])]
    widths = [max(len(c), *(len(t[k]) for t in table)) if table else len(c) for k, c in enumerate(cols)]
    print(f"review queue of round {r}: {res['images']} images ({res['corrected']} corrected), the labels most "
          f"likely wrong first (score: the mean rank of {', '.join(SIGNALS[:3])}, missing_tags)")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    print(textwrap.fill(REVIEW_LEGEND + ("; iou: the labels' mIoU against the image's mask (measuring only)"
                                         if measured else ""), 112))
    if res["spearman"] is not None:
        print(f"against the masks (measuring only, {res['measured']} uncorrected images with a mask): Spearman "
              f"correlation of score and per-image IoU {res['spearman']:+.3f} (negative: the worst labels first)")
    print(f"export these for a person's look: wsseg export --run-dir {args.run} --round {r} --review "
          f"{len(res['rows'])} --format labelstudio --out DIR")
    return 0


def cmd_ui(args) -> int:
    from wsseg.flows.ui import serve

    return serve(args.run_dir, args.prefect_port, args.mlflow_port, timeout=args.timeout)


# ---------------------------------------------------------------------------- method C and bench train (parsers)
def cmd_segment(args) -> int:
    from wsseg.flows import api
    from wsseg.flows.runtime import prepare

    # Prefect and MLflow state of `wsseg segment` live in the --out folder (locked: flows.cli)
    prepare(args.out, verbose=args.verbose)
    t0 = time.perf_counter()
    try:
        report = api.segment_files(args.inputs, args.model, args.out, patch_size=args.patch_size, overlap=args.overlap,
                                   batch=args.batch, device=args.device, fov=args.fov, gate=args.gate,
                                   threads=args.threads)
    except ValueError as e:
        print(f"wsseg segment: error: {e}", file=sys.stderr)
        return 2
    n = len(report["images"])
    print(f"{n} label map{'s' if n != 1 else ''} in {time.perf_counter() - t0:.1f} s: {Path(args.out).resolve()}")
    return 0


def add_segment_parser(sub) -> argparse.ArgumentParser:
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
    storage_args(p, state=False)
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
    p.add_argument("--verbose", action="store_true", help="show the libraries' own log lines (Prefect, MLflow)")
    p.set_defaults(func=cmd_segment)
    return p


def cmd_check(args) -> int:
    """``wsseg check``: one line per damaged or missing file (what it holds, the problem, what to
    do or what --repair did), then a summary line; 1 when something is left for the user to do."""
    from wsseg.flows import api

    res = api.check(args.run, repair=args.repair)
    if args.json:
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    done = {d["path"]: d["done"] for d in res["repaired"]}
    for d in res["damaged"]:
        what = f"--repair: {done[d['path']]}" if d["path"] in done else d["action"]
        print(f"{Path(res['run_dir']) / d['path']}: {d['problem']} ({d['holds']}); {what}")
    size = f"{res['bytes'] / 2 ** 20:.1f} MB"
    if not res["damaged"]:
        print(f"all is well: {res['files']} files ({size}) of {res['run_dir']} read and verified")
        return 0
    found = f"{len(res['damaged'])} damaged or missing of {res['files']} files ({size}) read"
    left = len(res["damaged"]) - len(res["repaired"])
    if res["ok"]:
        print(f"{found}; repaired: `wsseg train --run-dir {args.run}` computes them again")
    elif args.repair or left == len(res["from_source"]):
        print(f"{found}; {left} to bring back from the source (`wsseg ingest SOURCE --run-dir {args.run}`, "
              f"corrections: `--corrections PATH`)")
    else:
        print(f"{found}; `wsseg check --run-dir {args.run} --repair` removes what can be computed again")
    return 0 if res["ok"] else 1

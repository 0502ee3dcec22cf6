"""The commands of method A and the run directory: ``wsseg demo``, ``ingest``, ``train``,
``refresh``, ``evaluate``, ``export``, ``review``, ``status``, ``ui`` and ``segment`` (their parsers are in
:func:`flows.cli.parser`, ``segment``'s here)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from wsseg.flows.cli_common import (SAMPLE, storage_args, run_root, build_config, DEMO_CONFIG, print_rounds,
                              print_final, print_where)


def cmd_ingest(args) -> int:
    if args.source is not None:
        cmd_ingest_source(args)
    return cmd_corrections(args) if args.corrections is not None else 0


def cmd_corrections(args) -> int:
    """``wsseg ingest --corrections PATH``: store the corrections (tasks.labels.corrections); each
    refused file is one line on stderr and the status is 1 when any was refused."""
    from wsseg.tasks.labels.corrections import ingest_corrections, summary_line
    from wsseg.tasks.runtime.progress import Progress
    from wsseg.tasks.store import Store

    store = Store(run_root(args.run_dir))
    prog = Progress("corrections", 0)
    seen = 0

    def advance() -> None:
        nonlocal seen
        seen += 1
        if seen % 50 == 0:
            prog.message(f"{seen} read")

    res = ingest_corrections(store, args.corrections, progress=advance)
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


def cmd_ingest_source(args) -> None:
    from wsseg.tasks.corpus import ingest as ing

    bg = None if args.background == "none" else args.background
    # options left unset take the defaults of tasks.corpus.ingest (the flow's keyword defaults)
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

    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import ingest

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
    if ch.get("corrections_dropped"):
        print(f"{len(ch['corrections_dropped'])} correction(s) dropped: their images changed, were removed, or lost "
              f"the corrected classes ({', '.join(ch['corrections_dropped'][:5])}"
              f"{', ...' if len(ch['corrections_dropped']) > 5 else ''})")
    print(f"report: {s['report']}")
    print(run_root(args.run_dir) / "corpus")


def cmd_refresh(args) -> int:
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import refresh

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
    from wsseg.tasks.store import Store

    print(Store(run).root / "refresh.json")
    return 0


def cmd_train(args, base: dict | None = None) -> int:
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import train_wsss

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
    from wsseg.tasks.store import Store

    print(Store(run).summary_path)
    return 0


def cmd_demo(args) -> int:
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import ingest, train_wsss

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
    from wsseg.tasks.store import Store

    print(Store(run).summary_path)
    return 0


def cmd_evaluate(args) -> int:
    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import evaluate

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
    from wsseg.tasks.report.status import format_status, run_status
    from wsseg.tasks.store import Store

    store = Store(args.run)  # a URL's scheme checked here
    store.check_reachable()
    if not (store.exists() if store.remote else store.root.is_dir()):
        raise ValueError(f"{args.run}: no such run directory")
    st = run_status(store)
    print(json.dumps(st, default=str) if args.json else format_status(st))
    return 0


def cmd_export(args) -> int:
    from wsseg.tasks.labels.export import export_labels
    from wsseg.tasks.store import Store

    store = Store(args.run)
    store.check_reachable()
    if not (store.exists() if store.remote else store.root.is_dir()):
        raise ValueError(f"{args.run}: no such run directory")
    res = export_labels(store, args.out, which=args.round, fmt=args.fmt, images=args.images, force=args.force,
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


def cmd_review(args) -> int:
    from wsseg.tasks.labels.export import export_round
    from wsseg.tasks.labels.review import SIGNALS, review_table
    from wsseg.tasks.store import Store

    store = Store(args.run)
    store.check_reachable()
    if not store.has_corpus():
        raise ValueError(f"{args.run}: no corpus here (run `wsseg ingest` and `wsseg train` first)")
    r = export_round(store, args.round)
    if not store.review_rows(r):
        print(f"round {r} was computed without the review queue: its signals are computed from the round's stored "
              "labels once (and kept)", file=sys.stderr)
    res = review_table(store, r, top=args.top or None)
    if not res["images"]:
        raise ValueError(f"{store.root}: round {r} holds no labels to review")
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
    from wsseg.flows.runtime import prefect_api, prepare

    prepare(args.out)  # Prefect and MLflow state of `wsseg segment` live in the --out folder (locked: flows.cli)
    from wsseg.flows.highres import segment

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
    p.set_defaults(func=cmd_segment)
    return p

"""``wsseg bench report``: today's figures as one markdown page, from the benchmarks' JSONs.

A figure copied into prose by hand goes stale and loses where it came from; here each table is
made from the result files themselves, with the command, date and machine of each (their
``provenance``, :mod:`tasks.bench.provenance`) under it, so that refreshing a figure is running
the benchmark and this command again. One section per question, only for the kinds of result
given:

* labels on a corpus (``bench quality``), on a panel of corpora (``bench panel``), and the
  trainers' sample (quality results of the same data and configuration but for ``train_images``);
* ultra-high resolution (``bench highres``); pipeline cost (``bench pipeline``); scale
  (``bench scale``); training throughput (``bench train``); a person's corrections
  (``bench corrections``); the demo's rounds (its run summary, :meth:`Store.summary_path`).

Each kind is recognised by its keys (:func:`kind_of`); the page is the same bytes for the same
files and command (results sorted, floats at fixed decimals: 3 for an mIoU).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from wsseg.tasks.bench.provenance import PROVENANCE, busy

__all__ = ["Result", "kind_of", "read_result", "collect", "render", "KINDS"]

#: the benchmarks' result kinds, in the page's order: kind -> (the command, its section's heading)
KINDS = {
    "quality": ("wsseg bench quality", "Labels on a corpus"),
    "panel": ("wsseg bench panel", "Labels on the panel"),
    "highres": ("wsseg bench highres", "Ultra-high resolution"),
    "pipeline": ("wsseg bench pipeline", "Pipeline cost"),
    "scale": ("wsseg bench scale", "Scale"),
    "train": ("wsseg bench train", "Training throughput"),
    "corrections": ("wsseg bench corrections", "A person's corrections"),
    "demo": ("wsseg demo", "The demo"),
}
#: the keys each kind's JSON always has (the result dicts of tasks.bench.quality.quality_result,
#: tasks.bench.panel.panel_result (with flows.bench_panel.run_panel's ``panel``),
#: flows.highres.bench_highres, flows.bench_pipeline.result, flows.bench_scale.bench_scale,
#: tasks.bench.train.run_bench, flows.bench_corrections and flows.wsss.train_wsss's summary)
SIGNATURES = {
    "quality": {"baselines", "rounds", "pseudo_label_miou", "wsss_model_miou", "supervised_model_miou", "config"},
    "panel": {"panel", "corpora", "one_class_mean", "targets"},
    "pipeline": {"stages", "sizes", "dcrf_core_ms_per_image", "ours_over_dcrf", "targets"},
    "scale": {"per_size", "sizes", "ratios", "targets"},
    "highres": {"train_ids", "eval_ids", "patch_size", "scale", "steps", "wall_seconds"},
    "train": {"model", "images_per_second", "compute_images_per_second", "data_wait_share", "peak_rss_mb"},
    "corrections": {"variants", "baseline", "review_spearman"},
    "demo": {"rounds", "final_round", "feature_key", "converged"},
}
#: how deep ``collect`` looks below a folder: results lie at FOLDER/x.json or FOLDER/bench/x.json;
#: a run directory's own records (shards, rounds) lie deeper and are not read
DEPTH = 2


@dataclass(frozen=True)
class Result:
    """One benchmark result: the file as shown on the page, its kind and its contents."""
    shown: str
    kind: str
    data: dict

    @property
    def provenance(self) -> dict | None:
        return self.data.get(PROVENANCE)


# ============================================================================ reading
def kind_of(data) -> str | None:
    """The kind of benchmark result ``data`` is (a key of :data:`KINDS`), ``"partial"`` for one
    its benchmark left unfinished, or None."""
    if not isinstance(data, dict):
        return None
    if (data.get("partial") and "per_size" in data) or "variants_done" in data:
        return "partial"
    for kind, keys in SIGNATURES.items():
        if keys <= set(data) and (kind != "highres" or any(k.endswith("_train_seconds") for k in data)) and (
                kind != "demo" or (isinstance(data["rounds"], list)
                                   and any(isinstance(r, dict) and r.get("round") == "cam" for r in data["rounds"]))):
            return kind
    return None


def read_result(path: str | os.PathLike, shown: str | None = None) -> Result:
    """The benchmark result in ``path``; ValueError with one line naming the file and what to do
    when it cannot be read, is no JSON, or is no benchmark's result."""
    shown = shown or str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{shown}: cannot be read ({e.strerror or e}); pass a benchmark's result JSON "
                         "or a folder holding them") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{shown}: damaged JSON ({e}); run its benchmark again or leave the file out") from None
    kind = kind_of(data)
    if kind == "partial":
        raise ValueError(f"{shown}: a benchmark's partial result (it stopped before the end); run it again to "
                         "the end, or leave the file out")
    if kind is None:
        raise ValueError(f"{shown}: not a wsseg benchmark result (none of the keys of "
                         f"{', '.join(c for c, _ in KINDS.values())}'s JSON); pass the JSON a benchmark wrote "
                         "(its --out) or leave the file out")
    return Result(shown, kind, data)


def _folder_jsons(folder: Path) -> list[Path]:
    """The JSON files in ``folder`` and up to :data:`DEPTH` folders below it, hidden ones left out,
    in sorted order."""
    found = []
    for root, dirs, names in os.walk(folder):
        depth = len(Path(root).relative_to(folder).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < DEPTH else []
        found += [Path(root) / n for n in names if n.endswith(".json") and not n.startswith(".")]
    return sorted(found)


def collect(paths: Sequence[str | os.PathLike]) -> tuple[list[Result], list[str]]:
    """The results of ``paths`` (files, or folders searched for them) and the files of the folders
    that were left out (no benchmark's result). A file named on its own must be a result; in a
    folder, a run summary counts only when ``wsseg demo`` wrote it (a bench's run directory
    holds its own). A result found twice (the same file, or MLflow's copy of it) is taken once."""
    results, skipped, seen = [], [], set()
    for given in paths:
        p = Path(given)
        if not p.exists():
            raise ValueError(f"{given}: no such file or folder; pass benchmark result JSONs or folders holding them")
        if p.is_dir():
            for f in _folder_jsons(p):
                shown = os.path.join(str(given), str(f.relative_to(p)))
                try:
                    r = read_result(f, shown)
                except ValueError as e:
                    if "damaged JSON" in str(e) or "cannot be read" in str(e):
                        raise
                    skipped.append(shown)
                    continue
                if r.kind == "demo" and not str((r.provenance or {}).get("command") or "").startswith("wsseg demo"):
                    skipped.append(shown)
                    continue
                results.append(r)
        else:
            results.append(read_result(p, str(given)))
    out = []
    for r in results:
        key = json.dumps(r.data, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out, skipped


# ============================================================================ formatting
def _f(v, p: int = 3) -> str:
    """A figure at ``p`` decimals ("-" when missing)."""
    if v is None or isinstance(v, bool):
        return "-" if v is None else ("yes" if v else "no")
    if isinstance(v, (int, float)):
        return f"{v:.{p}f}"
    return _cell(v)


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def _verdict(met) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def provenance_lines(r: Result) -> list[str]:
    """Where ``r``'s figures come from: its file, command, date, machine, load and wsseg."""
    p = r.provenance
    if not p:
        return [f"- `{r.shown}`: command, date and machine not recorded (a result written before wsseg recorded "
                "them: run its benchmark again to have them)"]
    cmd = f"`{p['command']}`" if p.get("command") else "command not recorded (not run from the command line)"
    m = p.get("machine") or {}
    load = p.get("load_average") or {}
    src = p.get("source") or {}
    version = f"wsseg {p.get('wsseg', '?')}" + (
        f" (commit {src['commit']}{' with local changes' if src.get('local_changes') else ''})"
        if src.get("commit") else "")
    note = ": other work was running beside it, so its times are slower than on an idle machine" if busy(p) else ""
    return [f"- `{r.shown}`: {cmd}",
            f"  - {p.get('date', 'date not recorded')} on {m.get('words', 'a machine not recorded')}; "
            f"1-minute load {_f(load.get('start'), 2)} at the start, {_f(load.get('end'), 2)} at the end{note}; "
            f"{version}"]


def _argv_value(r: Result, *options: str) -> str | None:
    """The value of one of ``options`` in the command ``r`` was made by (from its provenance)."""
    argv = (r.provenance or {}).get("argv") or []
    for i, a in enumerate(argv):
        for o in options:
            if a == o and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(o + "="):
                return a.split("=", 1)[1]
    return None


def _name(r: Result, data_key: str | None = None) -> str:
    """The corpus a result measured: the folder name of its data (``data_key`` of the JSON, else
    the command's ``--data``), else the file's name."""
    data = r.data.get(data_key) if data_key else None
    data = data or _argv_value(r, "--data", "--data-dir")
    return Path(str(data).rstrip("/")).name if data else Path(r.shown).stem


# ============================================================================ the sections
def _quality_name(r: Result) -> str:
    return Path(str(r.data.get("data_dir") or r.data.get("dataset") or r.shown).rstrip("/")).name


def _trained(d: dict) -> tuple[int, int]:
    """(images the trainers learnt from, images of the split) of a quality result: its config's
    ``train_images`` bound, none (every image) when it does not cut the split."""
    images = int(d.get("images") or 0)
    limit = (d.get("config") or {}).get("train_images")
    return (images if limit is None or limit >= images else int(limit)), images


def _rounds_cell(rounds: Sequence[dict]) -> str:
    return ", ".join(_f(x.get("pseudo_label_miou")) for x in rounds) or "-"


def _ratio_cell(d: dict) -> str:
    cell = _f(d.get("wsss_over_supervised"))
    seeds = (d.get("model_seeds") or {})
    if seeds.get("ratio"):
        s = seeds["ratio"]
        cell += f" ({len(seeds.get('seeds') or [])} seeds: mean {_f(s['mean'])}, {_f(s['min'])}-{_f(s['max'])})"
    return cell


def _final_cell(d: dict) -> str:
    return f"{_f(d.get('pseudo_label_miou'))} (round {d.get('final_round', '?')})"


def quality_section(results: list[Result]) -> list[str]:
    """Per corpus: the pseudo-labels' mIoU (CAM, CAM + dense CRF, box GrabCut, each round, the
    final round) and the final model against the same network trained on the masks."""
    rows = []
    for r in sorted(results, key=lambda r: (_quality_name(r), -_trained(r.data)[0], r.shown)):
        d = r.data
        b, u = d.get("baselines") or {}, d.get("ungated") or {}
        trained, images = _trained(d)
        rows.append([_cell(_quality_name(r)), f"{d.get('split')}: {images}",
                     "all" if trained == images else f"{trained}",
                     _f((b.get("cam") or {}).get("miou")), _f((b.get("cam_crf") or {}).get("miou")),
                     _f((b.get("box_grabcut") or {}).get("miou")), _rounds_cell(d.get("rounds") or []),
                     _final_cell(d), f"{d.get('eval_split')}: {d.get('eval_images')}",
                     _f(d.get("wsss_model_miou")), _f(d.get("supervised_model_miou")), _ratio_cell(d),
                     " / ".join(_f(u.get(k)) for k in ("wsss_model_miou", "supervised_model_miou",
                                                        "wsss_over_supervised")) if u else "-"])
    lines = _table(["corpus", "images (split)", "trainers' images", "CAM", "CAM + dense CRF", "box GrabCut",
                    "rounds 0, 1, ...", "final labels", "eval images (split)", "model", "supervised",
                    "model / supervised", "ungated: model / supervised / ratio"], rows)
    lines += ["", "Pseudo-label mIoU on the training split against its masks (read only to measure); model: the "
                  "final round's network on the eval split, gated by the image classifier where the run gates "
                  "(`model_gate`), supervised: the same network, recipe and seed trained on the masks.", ""]
    return lines + [x for r in sorted(results, key=lambda r: r.shown) for x in provenance_lines(r)]


def panel_section(results: list[Result]) -> list[str]:
    """Per panel result: its table (a row per corpus, the one-class means) and its targets, judged
    (:func:`tasks.bench.panel.markdown`)."""
    from wsseg.tasks.bench.panel import markdown

    lines: list[str] = []
    for r in sorted(results, key=lambda r: (_name(r, "panel"), r.shown)):
        lines += [f"### {_cell(_name(r, 'panel'))}", "", *markdown(r.data).rstrip("\n").split("\n"), ""]
        lines += provenance_lines(r) + [""]
    return lines[:-1]


def _share_groups(results: list[Result]) -> list[list[Result]]:
    """Quality results of the same data, eval split and configuration but for ``train_images``,
    in groups of at least two trainers' samples."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        d = r.data
        config = {k: v for k, v in (d.get("config") or {}).items() if k != "train_images"}
        key = json.dumps([d.get("data_dir"), d.get("split"), d.get("eval_split"), config], sort_keys=True,
                         default=str)
        groups.setdefault(key, []).append(r)
    return [g for _, g in sorted(groups.items()) if len({_trained(r.data)[0] for r in g}) > 1]


def share_section(results: list[Result]) -> list[str]:
    """The trainers' sample: labels' and model's mIoU against the share of images the trainers saw."""
    rows, used = [], []
    for group in _share_groups(results):
        for r in sorted(group, key=lambda r: (-_trained(r.data)[0], r.shown)):
            d = r.data
            trained, images = _trained(d)
            used.append(r)
            rows.append([_cell(_quality_name(r)), f"{trained} of {images}", _f(trained / images if images else None, 2),
                         _f(((d.get("baselines") or {}).get("cam") or {}).get("miou")), _final_cell(d),
                         _f(d.get("wsss_model_miou")), _f(d.get("supervised_model_miou")), _ratio_cell(d)])
    if not rows:
        return []
    lines = _table(["corpus", "trainers learn from", "share", "CAM", "final labels", "model", "supervised",
                    "model / supervised"], rows)
    lines += ["", "The same data and configuration but for `train_images` (`--set train_images=N`): the "
                  "trainers learn from a seeded sample of the split, the shard stages still label every image.", ""]
    return lines + [x for r in sorted(used, key=lambda r: r.shown) for x in provenance_lines(r)]


def _variants(d: dict) -> list[str]:
    """The networks a highres result scores, in its order."""
    return d.get("variants") or [k[:-len("_train_seconds")] for k in d if k.endswith("_train_seconds")]


def highres_section(results: list[Result]) -> list[str]:
    """Per result: each network's figures (vessel IoU and F1 on a two-class corpus, mIoU and pixel
    accuracy otherwise, per fold when cross-validated), its training and evaluation seconds, and
    the memory and speed of ``wsseg segment``."""
    lines: list[str] = []
    for r in sorted(results, key=lambda r: (_name(r), r.shown)):
        d = r.data
        vessel = any(f"{n}_iou" in d for n in _variants(d))
        key = "iou" if vessel else "miou"
        header = ["network"] + (["vessel IoU", "F1"] if vessel else ["mIoU", "pixel accuracy"])
        folds = any(f"{n}_fold_{key}" in d for n in _variants(d))
        header += (["per fold"] if folds else []) + ["train s", "eval s", "final loss"]
        rows = []
        for n in _variants(d):
            row = [_cell(n)] + ([_f(d.get(f"{n}_iou")), _f(d.get(f"{n}_f1"))] if vessel else
                                [_f(d.get(f"{n}_miou")), _f(d.get(f"{n}_pixel_accuracy"))])
            if folds:
                row.append(", ".join(_f(v) for v in d.get(f"{n}_fold_{key}") or []) or "-")
            rows.append(row + [_f(d.get(f"{n}_train_seconds"), 1), _f(d.get(f"{n}_eval_seconds"), 1),
                               _f(d.get(f"{n}_final_loss"))])
        cv = d.get("cross_validation") or {}
        lines += [f"### {_cell(_name(r))}", ""] + _table(header, rows) + [""]
        lines.append(f"{len(d['train_ids'])} training / {len(d['eval_ids'])} evaluation images"
                     + (f" in each of {cv['folds']} folds ({cv.get('eval_images')} evaluation images in all)"
                        if cv else "")
                     + f", scale {d.get('scale')}, patch {d.get('patch_size')}, {d.get('steps')} steps of "
                       f"{d.get('batch')}, backbone {d.get('backbone', '-')}, {_f(d.get('wall_seconds'), 1)} s in all.")
        if "peak_mem_mb_1x" in d:
            lines.append(f"`wsseg segment`: peak memory {_f(d.get('peak_mem_mb_1x'), 0)} MB at the image's size, "
                         f"{_f(d.get('peak_mem_mb_2x'), 0)} MB at twice its side (ratio "
                         f"{_f(d.get('peak_mem_ratio_2x'), 2)}), {_f(d.get('mpix_per_s'), 3)} Mpx/s.")
        lines += [""] + provenance_lines(r) + [""]
    return lines[:-1]


#: pipeline figures judged against a target: key, words
PIPELINE_TARGETS = (("ours_over_dcrf", "<= 1.0"), ("overhead_share", "<= 0.10"),
                    ("parallel_efficiency", ">= 0.9"), ("rerun_share", "<= 0.05"))


def pipeline_section(results: list[Result]) -> list[str]:
    """Per result: each stage's images/s and worker core-ms per image, against CAM + dense CRF's,
    and the figures it judges against its targets."""
    lines: list[str] = []
    for r in sorted(results, key=lambda r: (_name(r, "data"), r.shown)):
        d = r.data
        dcrf = d.get("dcrf_core_ms_per_image")
        rows = [[_cell(name), _f(s.get("images_per_s"), 1), _f(s.get("core_ms_per_image"), 1),
                 _f(s["core_ms_per_image"] / dcrf if dcrf and s.get("core_ms_per_image") is not None else None, 2),
                 _cell(s.get("measured", ""))] for name, s in d["stages"].items()]
        rows.append(["CAM + dense CRF", "-", _f(dcrf, 1), _f(1.0 if dcrf else None, 2), "the sample, most workers"])
        sizes = ", ".join(str(n) for n in d.get("sizes") or [])
        lines += [f"### {_cell(_name(r, 'data'))}, N = {sizes}", ""]
        lines += _table(["stage", "images/s", "core-ms/img", "/ CAM + dense CRF", "measured"], rows) + [""]
        targets = d.get("targets") or {}
        for key, words in PIPELINE_TARGETS:
            lines.append(f"- {key}: {_f(d.get(key), 2)} (target {words}: {_verdict(targets.get(key))})")
        lines.append(f"- ours_with_features_over_dcrf: {_f(d.get('ours_with_features_over_dcrf'), 2)}; "
                     f"rerun bit-identical: {_f(d.get('rerun_identical'))}")
        lines += [""] + provenance_lines(r) + [""]
    return lines[:-1]


#: the steps of ``wsseg bench scale`` (tasks.bench.scale.STEPS), in the order it runs them
SCALE_STEPS = ("ingest", "train", "export", "review", "status", "rerun")


def scale_section(results: list[Result]) -> list[str]:
    """Per result: at each size, each step's wall time, core-ms per image and peak memory; the
    ratios of the largest size to the smallest and every target, judged."""
    lines: list[str] = []
    for r in sorted(results, key=lambda r: (_name(r, "data"), r.shown)):
        d = r.data
        rows = []
        for n in sorted(d["per_size"], key=int):
            steps = d["per_size"][n].get("steps") or {}
            for name in [s for s in SCALE_STEPS if s in steps] + sorted(set(steps) - set(SCALE_STEPS)):
                st, peak = steps[name], steps[name].get("peak_rss_mb") or {}
                rows.append([n, _cell(name), str(st.get("rc")), _f(st.get("wall_seconds"), 1),
                             _f(st.get("core_ms_per_image"), 1), _f(peak.get("flow"), 0), _f(peak.get("worker"), 0),
                             _f(peak.get("scheduler"), 0)])
        sizes = ", ".join(str(n) for n in d.get("sizes") or [])
        lines += [f"### {_cell(_name(r, 'data'))}, N = {sizes}", ""]
        lines += _table(["N", "step", "exit", "wall s", "core-ms/img", "flow MB", "worker MB", "scheduler MB"],
                        rows) + [""]
        if d.get("compared"):
            a, b = d["compared"]
            lines.append(f"Ratios N={b} / N={a}, same command:")
            for x in d.get("ratios") or []:
                target = f" (target {x['target']}: {_verdict(x.get('met'))})" if x.get("target") else ""
                lines.append(f"- {x['name']}: {_f(x.get('small'), 2)} -> {_f(x.get('large'), 2)}, "
                             f"ratio {_f(x.get('ratio'), 2)}{target}")
            lines.append("")
        judged = {x["name"] for x in d.get("ratios") or [] if x.get("target")}  # judged in the ratios above
        lines.append("Targets at every size:")
        for name, t in (d.get("targets") or {}).items():
            if name not in judged:
                lines.append(f"- {name}: {_verdict(t.get('met'))} ({t.get('target')})")
        lines += [""] + provenance_lines(r) + [""]
    return lines[:-1]


def train_section(results: list[Result]) -> list[str]:
    """Per result: a network's training images/s through the real loader, the share spent waiting
    for data, and the peak memory."""
    rows = []
    for r in sorted(results, key=lambda r: (r.data.get("model", ""), r.shown)):
        d = r.data
        rows.append([_cell(f"{d['model']} {json.dumps(d.get('options') or {}, sort_keys=True)}"),
                     _cell(d.get("device")), str(d.get("torch_threads")), str(d.get("loader_workers")),
                     f"{d.get('batch')} x {d.get('size')}px", _f(d.get("images_per_second"), 2),
                     _f(d.get("compute_images_per_second"), 2), _f(d.get("data_wait_share"), 3),
                     _f((d.get("peak_rss_mb") or {}).get("main"), 0)])
    lines = _table(["network", "device", "threads", "loader workers", "batch", "images/s", "compute images/s",
                    "data wait share", "peak MB (main)"], rows)
    return lines + [""] + [x for r in sorted(results, key=lambda r: r.shown) for x in provenance_lines(r)]


def corrections_section(results: list[Result]) -> list[str]:
    """Per result: what correcting a share of the images bought, per pick (its JSON's ``rows``)."""
    from wsseg.tasks.bench.corrections import summary_rows

    rows = []
    for r in sorted(results, key=lambda r: r.shown):
        for x in r.data.get("rows") or summary_rows(r.data):
            rows.append([f"`{r.shown}`", _cell(x["variant"]), str(x["corrected"]), _f(x.get("others_miou")),
                         _f(x.get("others_miou_before")), _f(x.get("others_gain")), _f(x.get("corpus_miou")),
                         _f(x.get("model_miou"))])
    lines = _table(["result", "pick", "corrected", "others' labels", "before", "gain", "corpus labels", "model"],
                   rows)
    return lines + [""] + [x for r in sorted(results, key=lambda r: r.shown) for x in provenance_lines(r)]


def demo_section(results: list[Result]) -> list[str]:
    """Per run: the CAM's and each round's pseudo-label mIoU, and the final round."""
    rows = []
    for r in sorted(results, key=lambda r: r.shown):
        d = r.data
        cam = next((x for x in d["rounds"] if x.get("round") == "cam"), {})
        rounds = [x for x in d["rounds"] if x.get("round") != "cam"]
        rows.append([_cell(Path(r.shown).parent.name or r.shown), str(d.get("images", "-")),
                     _f(cam.get("pseudo_label_miou")), _rounds_cell(rounds),
                     f"{_f(d.get('final_pseudo_label_miou'))} (round {d.get('final_round')})",
                     _cell(d.get("stop_reason") or "-")])
    lines = _table(["run", "images", "CAM", "rounds 0, 1, ...", "final labels", "why the rounds stopped"], rows)
    return lines + [""] + [x for r in sorted(results, key=lambda r: r.shown) for x in provenance_lines(r)]


#: kind -> (heading, what the section answers, the function that writes it)
SECTIONS: dict[str, tuple[str, Callable[[list[Result]], list[str]]]] = {
    "quality": ("How good are the labels on a corpus?", quality_section),
    "panel": ("How good are the labels on the panel of corpora?", panel_section),
    "share": ("What does the trainers' sample cost?", share_section),
    "highres": ("Ultra-high resolution: global-local against patches and a downsampled image", highres_section),
    "pipeline": ("What does a round cost, per image and stage?", pipeline_section),
    "scale": ("Does the user's whole path scale with the corpus?", scale_section),
    "train": ("How fast do the networks train?", train_section),
    "corrections": ("What do a person's corrections buy?", corrections_section),
    "demo": ("The demo: pseudo-labels by round", demo_section),
}


def render(results: list[Result], command: str) -> str:
    """The page: a line saying it is generated by ``command``, then a section per question for
    the kinds of ``results`` (in :data:`SECTIONS`' order)."""
    by_kind: dict[str, list[Result]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)
    lines = [f"*Generated by `{command}` from the benchmarks' result JSONs: do not edit it by hand; run the "
             "benchmarks, then this command again.*", "", "# Today's figures", "",
             "Each table is followed by the command that produced its figures, with its date and machine. What "
             "the figures mean and the decisions they support: [benchmarks.md](benchmarks.md#what-the-figures-mean); "
             "their earlier values: [journal.md](journal.md). To refresh a figure, run the command under its table "
             "again with its `--out` among the JSONs this page reads, then the command above."]
    for key, (heading, section) in SECTIONS.items():
        body = section(by_kind.get("quality" if key == "share" else key, []))
        if by_kind.get("quality" if key == "share" else key) and body:
            lines += ["", f"## {heading}", "", *body]
    return "\n".join(lines) + "\n"

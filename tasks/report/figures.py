"""Pictures and tables built from a run directory.

* :func:`overlay_grid`: a round's labels over their images (``wsseg train``'s overlays);
* ``wsseg bench quality``'s report: :func:`pick_overlay_records` and :func:`overlay_figure`
  (``FILE.png``), :func:`markdown_report` (``FILE.md``), and :func:`write_quality_report`, which
  writes both beside the result's ``FILE.json``.
"""
from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Iterable

import numpy as np

from wsseg.tasks.common.metrics import confusion_matrix, iou_from_confusion, tag_share
from wsseg.tasks.report.overlay import grid, legend, overlay, write_png
from wsseg.tasks.store import ImageRecord, Store


def overlay_grid(store: Store, records: list[ImageRecord], sources: list[tuple[str, int, str]], out: Path) -> Path:
    """One row per image: the image, each label source over it, and the ground truth if any.

    ``sources``: (title, round, stored label name) triples. A colour key of the classes shown
    is drawn below.
    """
    rows, present = [], set()
    for rec in records:
        image = store.image(rec.image_id)
        row = [(f"{rec.image_id}: {', '.join(rec.tags)}", image)]
        for title, r, name in sources:
            label = store.pseudo(r, rec.image_id, name=name)
            if label is not None:
                row.append((title, overlay(image, label)))
        gt = store.mask(rec.image_id)
        if gt is not None:
            row.append(("ground truth", overlay(image, gt)))
        rows.append(row)
        present |= _present(store, rec, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_png(out, _with_key(grid(rows), store.classes().names, present))
    return out


def _present(store: Store, rec: ImageRecord, sources: list[tuple[str, int, str]]) -> set[int]:
    """The classes that occur in ``rec``'s stored labels of ``sources`` and its mask."""
    labels = [store.pseudo(r, rec.image_id, name=name) for _, r, name in sources] + [store.mask(rec.image_id)]
    return set().union(*(np.unique(lab).tolist() for lab in labels if lab is not None))


def _with_key(picture: np.ndarray, names, present: set[int]) -> np.ndarray:
    """``picture`` with the colour key of the ``present`` classes below it."""
    return np.concatenate([picture, legend(names, sorted(present), picture.shape[1])], 0)


# ---------------------------------------------------------------------------- bench quality
def pick_overlay_records(records: Iterable[ImageRecord], n: int = 6, *, with_mask: bool = True) -> list[ImageRecord]:
    """The ``n`` images with the most tags (the hard ones: a single-tag image is solved by any
    method), ties broken by id, so the choice does not depend on the records' order; with
    ``with_mask`` only images that have a mask to compare with (when there are any)."""
    def key(r: ImageRecord) -> tuple:
        return -len(r.tags), r.image_id

    # heapq.nsmallest is sorted(...)[:n] holding n rows: records may be a split's rows streamed
    picks = heapq.nsmallest(n, (r for r in records if r.has_mask), key=key) if with_mask else []
    return picks or heapq.nsmallest(n, records, key=key)


def _image_miou(pred: np.ndarray | None, gt: np.ndarray, n: int) -> float | None:
    if pred is None:
        return None
    return iou_from_confusion(confusion_matrix(pred, gt, n))[1]


def overlay_figure(store: Store, records: list[ImageRecord], sources: list[tuple[str, int, str]], out: Path) -> Path:
    """Rows of image | ground truth | each source, titled with the image's own mIoU, and a colour
    key of the classes shown."""
    n = store.classes().n
    rows, present = [], set()
    for rec in records:
        image = store.image(rec.image_id)
        gt = store.mask(rec.image_id)
        row = [(f"{rec.image_id}: {', '.join(rec.tags)}", image)]
        if gt is not None:
            row.append(("ground truth", overlay(image, gt)))
        for title, r, name in sources:
            label = store.pseudo(r, rec.image_id, name=name)
            if label is None:
                continue
            m = _image_miou(label, gt, n) if gt is not None else None
            row.append((title + ("" if m is None else f" {m:.2f}"), overlay(image, label)))
        rows.append(row)
        present |= _present(store, rec, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_png(out, _with_key(grid(rows), store.classes().names, present))
    return out


#: row titles of the baselines of ``bench quality`` (tasks.bench.quality.BASELINES)
BASELINE_TITLES = {"cam": "CAM (round 0)", "cam_crf": "CAM + dense CRF",
                   "box_grabcut": "box GrabCut (10% inset, 3 iterations, per image)"}
SHORT_TITLES = {"cam": "CAM", "cam_crf": "CAM+CRF", "box_grabcut": "box GrabCut"}


def _f(v, p: int = 4) -> str:
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown_report(res: dict) -> str:
    """The markdown table of a bench result (the dict written to FILE.json)."""
    b = res["baselines"]
    lines = [f"# Pseudo-label quality: {res['dataset']} ({res['split']}, {res['images']} images)", "",
             f"Pseudo-labels measured on `{res['split']}` (tags only for training, masks only here); "
             f"models measured on `{res['eval_split']}` ({res['eval_images']} images).", "",
             "| labels on " + res["split"] + " | mIoU | mean class acc. | pixel acc. | changed | ignore | "
             "mIoU at chance | tag share |",
             "|---|---|---|---|---|---|---|---|"]
    for name in b:
        lines.append(f"| {BASELINE_TITLES.get(name, name)} | {_f(b[name]['miou'])} | {_f(b[name].get('class_accuracy'))} | "
                     f"{_f(b[name]['pixel_accuracy'])} | | 0.0000 | {_f(b[name].get('chance_miou'))} | |")
    for r in res["rounds"]:
        final = r["round"] == res["final_round"]
        chance = r.get("pseudo_label_chance_miou")
        if chance is None and final:  # a round summary from before the figure existed: the result's
            chance = res.get("pseudo_label_chance_miou")
        lines.append(f"| ours, round {r['round']}{' (final)' if final else ''} | {_f(r['pseudo_label_miou'])} | "
                     f"{_f(r.get('pseudo_label_class_accuracy'))} | | {_f(r['changed_share'])} | {_f(r['ignore_share'])} | "
                     f"{_f(chance)} | {_f(tag_share(r.get('tag_coverage')))} |")
    lines += ["", "mIoU at chance: what labels with the same class shares would score placed at random "
                  "(tasks.common.metrics.chance_iou_from_confusion); a source near it knows how much of each class "
                  "there is, not where. Tag share: a tagged class's (and the implicit background's) share of "
                  "its images' pixels, a geometric mean (no mask): exp of the JSON's tag_coverage, the mean over "
                  "the tagged classes of the mean log label share on the images tagged with them; a fall means a "
                  "tagged class shrank (recorded; no rule stops the rounds on it since `stopping` 'auto' went, "
                  "tasks.wsss.stopping)."]
    if res.get("stop_reason"):
        lines += ["", f"Stopped: {res['stop_reason']}."]
    if res.get("foreground"):
        lines += ["", "Class-agnostic foreground path: on (round 0's preliminary result from the images' "
                      "boundary-connectivity saliency)."]
    u = res.get("ungated")
    head = f"| models on {res['eval_split']} | mIoU{' (gated by the image classifier) | ungated' if u else ''} |"
    def row(name: str, key: str, p: int = 4) -> str:
        return f"| {name} | {_f(res[key], p)} |" + (f" {_f(u[key], p)} |" if u else "")
    lines += ["", head, "|---|---|" + ("---|" if u else ""),
              row("WSSS model (final round, pseudo-labels)", "wsss_model_miou"),
              row(f"supervised (masks of {res['split']}, {res['supervised_epochs']} epochs)", "supervised_model_miou"),
              row("WSSS / supervised", "wsss_over_supervised", 3)]
    if res.get("wsss_model_class_accuracy") is not None:
        pad = " |" if u else ""
        lines += [f"| WSSS model, mean class accuracy | {_f(res['wsss_model_class_accuracy'])} |{pad}",
                  f"| supervised, mean class accuracy | {_f(res.get('supervised_model_class_accuracy'))} |{pad}"]
    ms = res.get("model_seeds")
    if ms:
        def spread(k: str, p: int = 4) -> str:
            v = ms.get(k)
            return f"{_f(v['mean'], p)} ({_f(v['min'], p)}-{_f(v['max'], p)})" if v else "n/a"
        tail = lambda k, p=4: f" {spread(k + '_ungated', p)} |" if u else ""
        lines += [f"| WSSS model, mean (min-max) over {len(ms['seeds'])} seeds | {spread('wsss')} |{tail('wsss')}",
                  f"| supervised, mean (min-max) over {len(ms['seeds'])} seeds | {spread('supervised')} |"
                  f"{tail('supervised')}",
                  f"| WSSS / supervised, mean (min-max) | {spread('ratio', 3)} |{tail('ratio', 3)}"]
    pc = res["per_class_iou"]
    names = list(pc["ours"])
    cols = [k for k in pc if k != "ours"] + ["ours"]
    acc = res.get("per_class_accuracy") or {}
    chance = (res.get("per_class_chance_iou") or {}).get("ours") or {}
    lines += ["", "## Per-class IoU (pseudo-labels)", "",
              "| class | " + " | ".join(SHORT_TITLES.get(k, k) for k in cols) + " | ours, pixel acc. | ours at chance |",
              "|---|" + "---|" * (len(cols) + 2)]
    lines += [f"| {c} | " + " | ".join(_f(pc[k].get(c), 3) for k in cols) + f" | {_f(acc.get(c), 3)} | "
              f"{_f(chance.get(c), 3)} |" for c in names if any(pc[k].get(c) is not None for k in cols)]
    if res.get("ablations"):
        ref_r = res.get("ablation_round", res["final_round"])
        ref = res.get("ablation_reference_miou", res["pseudo_label_miou"])
        lines += ["", f"## Ablations (pseudo-label mIoU of round {ref_r} on {res['split']})", "",
                  "| variant | what | mIoU | vs main |", "|---|---|---|---|",
                  f"| main | as configured | {_f(ref)} | |"]
        for name, a in res["ablations"].items():
            m = a.get("pseudo_label_miou")
            note = a.get("skipped") or a.get("error")
            delta = "" if m is None or ref is None else f"{m - ref:+.4f}"
            lines.append(f"| {name} | {a['what']}{' — ' + note if note else ''} | {_f(m)} | {delta} |")
    if res.get("model_comparison"):
        lines += ["", f"## Networks at the same budget (from scratch, evaluated on {res['eval_split']})", "",
                  "| network | options | img/s | epochs | on pseudo-labels | on masks | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for tag, c in res["model_comparison"].items():
            lines.append(f"| {c['model']} | `{json.dumps(c['options'])}` | {c['measured_images_per_second']:.2f} | "
                         f"{c['epochs']} ({c['budget_seconds']:.0f}s) | {_f(c['wsss']['miou'])} | "
                         f"{_f(c['supervised']['miou'])} | {_f(c['wsss_over_supervised'], 3)} |")
    if res.get("warnings"):
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in res["warnings"]]
    lines += ["", f"Wall time {res['wall_seconds']:.0f}s ("
              + ", ".join(f"{k} {v:.0f}s" for k, v in res["stage_seconds"].items()) + ")."]
    return "\n".join(lines) + "\n"


def write_quality_report(store: Store, res: dict, out: str | Path) -> dict:
    """Write a bench result as ``out`` (JSON), with the overlay figure (``.png``: CAM, CAM + CRF
    and the final round's labels of :func:`pick_overlay_records`'s images of the bench's split)
    and the markdown table (``.md``) beside it; returns ``res`` with their names added."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    picks = pick_overlay_records(store.manifest(res["split"]))
    box = [("box GrabCut", 0, "box_grabcut")] if "box_grabcut" in res["baselines"] else []
    overlay_figure(store, picks, [("CAM", 0, "cam"), ("CAM+CRF", 0, "cam_crf")] + box +
                   [(f"ours r{res['final_round']}", res["final_round"], "pseudo")], out.with_suffix(".png"))
    res["figure"], res["table"] = str(out.with_suffix(".png")), str(out.with_suffix(".md"))
    res["figure_images"] = [r.image_id for r in picks]
    out.write_text(json.dumps(res, indent=1, default=float))
    out.with_suffix(".md").write_text(markdown_report(res))
    return res

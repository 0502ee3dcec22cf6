"""The plain parts of ``wsseg bench panel`` (its runner is :mod:`flows.bench_panel`): which corpora
of a panel folder to run, each corpus's figures from its ``bench quality`` result, the means over
the one-class corpora, the targets judged, and the table.

A panel folder holds one corpus folder per corpus (``tools/make_panel.py`` writes them). Each
corpus is one of three kinds, read from its classes:

* ``one-class``: an implicit background and one object class; its figure is that class's IoU
  (``object IoU``) for ours and each baseline;
* ``many-class``: an implicit background and several object classes; its figure is the mIoU;
* ``no background``: every class named (msrc21 itself); the mIoU, and no box GrabCut.

The targets (:data:`TARGETS`) were set at the default configuration; a result of another one
says so (``at_defaults``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["SOURCES", "TARGETS", "corpus_folders", "corpus_kind", "corpus_figures", "panel_result", "markdown"]

#: the label sources side by side, in the table's order: ours (the final round's pseudo-labels),
#: round 0's CAM, CAM + dense CRF and box GrabCut (keys of ``bench quality``'s ``per_class_iou``)
SOURCES = ("ours", "cam", "cam_crf", "box_grabcut")
HEADINGS = {"ours": "ours", "cam": "CAM", "cam_crf": "CAM + dense CRF", "box_grabcut": "box GrabCut"}
#: the targets of the panel, set at the default configuration
TARGETS = {
    "one_class_margin": 0.10,    # mean object IoU over the one-class corpora >= their mean box GrabCut + this
    "many_class_miou": 0.75,     # a many-class corpus's mIoU at least this
    "many_class_margin": 0.10,   # and at least the best of CAM, CAM + dense CRF, box GrabCut + this
    "msrc21_train": 0.805,       # msrc21's train pseudo-label mIoU not lower than this (2026-12 figure)
}
#: the name under which msrc21 itself is judged when a panel holds it (a link to ../shared/data/msrc21)
MSRC21 = "msrc21"


def corpus_folders(panel: str | Path, names: Sequence[str] | None = None) -> list[tuple[str, Path]]:
    """(name, folder) of the corpora to run: ``names`` in their order, or every folder of ``panel``
    holding a labels.csv, in the order of the panel's ``panel.json`` (``tools/make_panel.py``'s),
    then by name. A name without its corpus folder, or a panel without any, is a ValueError."""
    panel = Path(panel)
    if not panel.is_dir():
        raise ValueError(f"{panel}: no such panel folder (build it with `python tools/make_panel.py "
                         f"../shared/data {panel}`)")
    if names:
        missing = [n for n in names if not (panel / n / "labels.csv").is_file()]
        if missing:
            have = [p.name for p in sorted(panel.iterdir()) if (p / "labels.csv").is_file()]
            raise ValueError(f"{panel}: no corpus {', '.join(missing)} (a folder with labels.csv); the panel "
                             f"holds: {', '.join(have) or 'none'}")
        if len(set(names)) != len(names):
            raise ValueError(f"--corpora names a corpus twice: {', '.join(names)}")
        return [(n, panel / n) for n in names]
    found = {p.name: p for p in panel.iterdir() if not p.name.startswith(".") and (p / "labels.csv").is_file()}
    if not found:
        raise ValueError(f"{panel}: no corpus folder (one with labels.csv) in it; build the panel with "
                         f"`python tools/make_panel.py ../shared/data {panel}`")
    order: list[str] = []
    record = panel / "panel.json"
    if record.is_file():
        try:
            order = [n for n in json.loads(record.read_text()) if n in found]
        except (json.JSONDecodeError, TypeError):
            order = []
    order += sorted(set(found) - set(order))
    return [(n, found[n]) for n in order]


def corpus_kind(names: Sequence[str], background: str | None) -> tuple[str, str | None]:
    """(kind, the object class of a one-class corpus) of a corpus with classes ``names`` and
    implicit background ``background`` (None: every class named)."""
    if background is None:
        return "no background", None
    objects = [n for n in names if n != background]
    return ("one-class", objects[0]) if len(objects) == 1 else ("many-class", None)


def corpus_figures(res: dict, kind: str, object_class: str | None) -> dict[str, Any]:
    """One corpus's row from its ``bench quality`` result ``res``: the measure (``object IoU`` or
    ``mIoU``) of each of :data:`SOURCES` (None where not measured), the images and the final round."""
    per_class = res.get("per_class_iou") or {}
    if kind == "one-class":
        values = {s: (per_class.get(s) or {}).get(object_class) for s in SOURCES}
    else:
        values = {"ours": res.get("pseudo_label_miou")} | {
            s: ((res.get("baselines") or {}).get(s) or {}).get("miou") for s in SOURCES[1:]}
    return {"kind": kind, "object_class": object_class, "measure": "object IoU" if kind == "one-class" else "mIoU",
            **values, "images": res.get("images"), "split": res.get("split"), "eval_images": res.get("eval_images"),
            "eval_split": res.get("eval_split"), "final_round": res.get("final_round"),
            "pseudo_label_miou": res.get("pseudo_label_miou"), "wsss_model_miou": res.get("wsss_model_miou"),
            "supervised_model_miou": res.get("supervised_model_miou")}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def panel_result(corpora: dict[str, dict], at_defaults: bool) -> dict[str, Any]:
    """The panel's figures from its corpora's rows (:func:`corpus_figures`; a corpus that failed
    holds ``error``): the means over the one-class corpora (``one_class_mean``) and the targets,
    each with ``met`` (None: not measured, e.g. a corpus of its kind failed or is not in the panel)."""
    one = {n: c for n, c in corpora.items() if c.get("kind") == "one-class"}
    failed = [n for n, c in corpora.items() if "error" in c]
    means = {s: _mean([c[s] for c in one.values() if c.get(s) is not None]) for s in SOURCES}
    targets = []
    complete = bool(one) and all(c.get(s) is not None for c in one.values() for s in ("ours", "box_grabcut"))
    if one:
        need = means["box_grabcut"] + TARGETS["one_class_margin"] if means["box_grabcut"] is not None else None
        targets.append({"name": "one-class mean", "what": f"mean object IoU over the one-class corpora at least "
                        f"{TARGETS['one_class_margin']:.2f} above their mean box GrabCut",
                        "value": means["ours"], "threshold": need,
                        "met": (means["ours"] >= need) if complete else None})
        below = [n for n, c in one.items() if c.get("ours") is not None and c.get("box_grabcut") is not None
                 and c["ours"] < c["box_grabcut"]]
        targets.append({"name": "no one-class corpus below its box GrabCut",
                        "what": "every one-class corpus's object IoU at least its own box GrabCut's",
                        "below": below, "met": (not below) if complete else None})
    for n, c in corpora.items():
        if c.get("kind") != "many-class":
            continue
        best = max((c[s] for s in SOURCES[1:] if c.get(s) is not None), default=None)
        ours = c.get("ours")
        targets.append({"name": f"{n} mIoU", "what": f"{n}: mIoU at least {TARGETS['many_class_miou']:.2f}",
                        "value": ours, "threshold": TARGETS["many_class_miou"],
                        "met": None if ours is None else ours >= TARGETS["many_class_miou"]})
        need = None if best is None else best + TARGETS["many_class_margin"]
        targets.append({"name": f"{n} over the baselines",
                        "what": f"{n}: mIoU at least {TARGETS['many_class_margin']:.2f} above the best of CAM, "
                                "CAM + dense CRF and box GrabCut",
                        "value": ours, "threshold": need,
                        "met": None if ours is None or need is None else ours >= need})
    m = corpora.get(MSRC21) or {}
    targets.append({"name": "msrc21 train", "what": f"msrc21's train pseudo-label mIoU not lower than "
                                                  f"{TARGETS['msrc21_train']:.3f}",
                    "value": m.get("ours"), "threshold": TARGETS["msrc21_train"],
                    "met": None if m.get("ours") is None else m["ours"] >= TARGETS["msrc21_train"],
                    **({} if MSRC21 in corpora else {"note": "not in the panel: link ../shared/data/msrc21 into it "
                                                              "as msrc21, or run `wsseg bench quality` on it"})})
    return {"corpora": corpora, "failed": failed,
            "one_class_mean": {"corpora": [n for n, c in one.items() if "error" not in c], **means},
            "targets": targets, "target_values": TARGETS, "at_defaults": at_defaults}


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _verdict(t: dict) -> str:
    return "not measured" if t.get("met") is None else ("met" if t["met"] else "NOT MET")


def markdown(res: dict) -> str:
    """The panel's table (a row per corpus, then the one-class means) and its targets, judged."""
    head = ["corpus", "kind", "images (split)", "measure", *(HEADINGS[s] for s in SOURCES), "ours - box GrabCut"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, c in res["corpora"].items():
        if "error" in c:
            lines.append(f"| {name} | {c.get('kind') or '-'} | - | failed: {str(c['error'])[:80].replace('|', '/')} |"
                         + " |" * (len(head) - 4))
            continue
        gap = None if c.get("ours") is None or c.get("box_grabcut") is None else c["ours"] - c["box_grabcut"]
        images = f"{c.get('split')}: {c.get('images')}" + (f", {c.get('eval_split')}: {c.get('eval_images')}"
                                                           if c.get("eval_split") != c.get("split") else "")
        lines.append(f"| {name} | {c['kind']}{' (' + c['object_class'] + ')' if c.get('object_class') else ''} "
                     f"| {images} | {c['measure']} | " + " | ".join(_f(c.get(s)) for s in SOURCES)
                     + f" | {'-' if gap is None else f'{gap:+.3f}'} |")
    mean = res["one_class_mean"]
    if mean["corpora"]:
        gap = None if mean["ours"] is None or mean["box_grabcut"] is None else mean["ours"] - mean["box_grabcut"]
        lines.append(f"| one-class mean ({len(mean['corpora'])}) | | | object IoU | "
                     + " | ".join(_f(mean.get(s)) for s in SOURCES) + f" | {'-' if gap is None else f'{gap:+.3f}'} |")
    lines += ["", "Pseudo-labels of each corpus's training split against its masks (read only to measure): ours "
                  "(the final round's), round 0's CAM, CAM + dense CRF and GrabCut from a box inset 10% from the "
                  "border; object IoU: the one class's IoU on a one-class corpus; mIoU (background included) "
                  "otherwise. The dense CRF refines the image classifier's CAM, also on the foreground path, "
                  "where round 0's own start (saliency and corpus clusters) replaces the CAM.", "", "Targets" + ("" if res.get("at_defaults") else
                                                " (set at the default configuration; this run used another)") + ":"]
    for t in res["targets"]:
        detail = ""
        if t.get("threshold") is not None or t.get("value") is not None:
            detail = f" ({_f(t.get('value'))} against {_f(t.get('threshold'))})"
        if t.get("below"):
            detail = f" (below: {', '.join(t['below'])})"
        if t.get("note"):
            detail += f"; {t['note']}"
        lines.append(f"- {t['what']}: {_verdict(t)}{detail}")
    return "\n".join(lines) + "\n"

"""What each result of a run directory is computed from, so that a stored one is reused only
while it still fits.

The image classifier, a round's preliminary results, corpus classifiers, pseudo-labels and
model depend on the class list, the corpus content and the configuration. Each records them
when it is computed (the classifier in its checkpoint's metadata, a round in
``rounds/rNNN/inputs.json``); a later run compares them with its own and recomputes, saying
what changed, when they differ. The corpus content is one hash of the manifest rows a result
uses (image id, sha256 of the file, tags, split, in the manifest's order).

Example
-------
>>> from tasks.store import ClassSpec, ImageRecord
>>> recs = [ImageRecord("a", 4, 4, ("cow",), "0" * 64, "train", "a.jpg", False)]
>>> old = {"classes": classes_entry(ClassSpec(("cow", "grass"))), "corpus": corpus_entry(recs), "config": {}}
>>> new = dict(old, classes=classes_entry(ClassSpec(("cow", "grass", "sky"))))
>>> what_changed(old, new)
['the class list (2 -> 3 classes; added sky)']
"""
from __future__ import annotations

from typing import Sequence

from wsseg.tasks.config import (NOT_IN_ROUNDS, Scope, WSSSConfig, changed_fields, in_effect, options_with, sampled,
                                with_added_options)
from wsseg.tasks.store import ClassSpec, ImageRecord, corpus_hash


def corpus_entry(records: Sequence[ImageRecord]) -> dict:
    """``{"hash": corpus_hash, "images": count}`` (the count only to say what changed)."""
    return {"hash": corpus_hash(records), "images": len(records)}


def classes_entry(classes: ClassSpec) -> dict:
    return {"names": list(classes.names), "background": classes.background}


def classifier_inputs(classes: ClassSpec, records: Sequence[ImageRecord], config: WSSSConfig) -> dict:
    """What the image classifier depends on besides its own settings (which its checkpoint
    records already): the class list, the corpus it is trained on, the seed and the digests of
    the ImageNet weight files its encoder starts from."""
    return {"classes": classes_entry(classes), "corpus": corpus_entry(records),
            "config": {"seed": config.seed, "pretrained": {k: v for k, v in config.pretrained.items()
                                                           if k == config.classifier.encoder}}}


def round_inputs(classes: ClassSpec, records: Sequence[ImageRecord] | dict, config: WSSSConfig,
                 corrections: dict | None = None) -> dict:
    """What a round depends on: the class list, the corpus of its split (its records, or their
    :func:`corpus_entry` as the manifest's footer records it), every configuration field but
    :data:`tasks.config.NOT_IN_ROUNDS` (round budget, inference settings) and, when the run has
    any, a person's corrections (``{"images": n, "digest": ...}``)."""
    cfg = {k: v for k, v in config.model_dump(mode="json").items() if k not in NOT_IN_ROUNDS}
    corpus = records if isinstance(records, dict) else corpus_entry(records)
    cfg["train_images"] = sampled(cfg.get("train_images"), corpus.get("images"))
    out = {"classes": classes_entry(classes), "corpus": corpus, "config": cfg}
    return out | ({"corrections": corrections} if corrections else {})


def round_view(inputs: dict | None, r: int, part: str = "model") -> dict | None:
    """The part of round ``r``'s inputs (:func:`round_inputs`) that its ``part`` depends on, by the
    scopes of :data:`tasks.config.OPTIONS`: ``"model"``, the round as a whole (its labels, model and
    stopping decision), ``"labels"``, its pseudo-labels alone (without the options of scope MODEL and
    DECISION), ``"computed"``, its labels and model without the rule of its decision (DECISION),
    which its record lets be taken again, or ``"round_model"``, the round as a round that is not the
    last (without FINAL_MODEL, which its own segmenter does not read). Round 0 depends on no option
    of scope FROM_ROUND_1. A record written before options were removed first gets the value it
    was computed with of those it lacks (:func:`tasks.config.with_added_options`).

    >>> inputs = {"config": {"seed": 0, "segmentation": {"epochs": 3}, "prior_weight": 0.5, "epsilon": 0.02}}
    >>> round_view(inputs, 0)["config"], round_view(inputs, 1, "labels")["config"]
    ({'seed': 0, 'segmentation': {'epochs': 3}, 'epsilon': 0.02}, {'seed': 0, 'prior_weight': 0.5})
    >>> round_view(inputs, 1, "computed")["config"]
    {'seed': 0, 'segmentation': {'epochs': 3}, 'prior_weight': 0.5}
    >>> weighted = {"config": {"segmentation": {"epochs": 3, "class_balance": 0.5}}}
    >>> round_view(weighted, 1, "round_model")["config"]["segmentation"]
    {'epochs': 3, 'rounds_class_balance': 0.5, 'rounds_boundary_ignore': 0}

    ``classifier.background_rule`` (removed; an older record holds it) counted only on a corpus with
    an implicit background:

    >>> rule = {"config": {"classifier": {"epochs": 8, "background_rule": "constant", "cam_mode": "auto"}}}
    >>> round_view(rule | {"classes": {"background": None}}, 0)["config"]
    {'classifier': {'epochs': 8, 'cam_mode': 'auto', 'cam_centring': 1.0}}
    >>> round_view(rule | {"classes": {"background": "background"}}, 0)["config"]["classifier"]["background_rule"]
    'constant'
    """
    if inputs is None:
        return None
    if part not in ("model", "labels", "computed", "round_model"):
        raise ValueError(f"part must be 'model', 'labels', 'computed' or 'round_model', got {part!r}")
    left_out = ((options_with(Scope.FROM_ROUND_1, under="") if r == 0 else ())
                + (options_with(Scope.MODEL, Scope.DECISION, under="") if part == "labels" else ())
                + (options_with(Scope.DECISION, under="") if part == "computed" else ()))
    config = {k: v for k, v in with_added_options(inputs.get("config") or {}, removed=True).items()
              if k not in left_out}
    if part == "round_model":  # an older record's added options first: rounds_class_balance reads class_balance
        config = with_added_options(config)
        for path in options_with(Scope.FINAL_MODEL):
            head, _, leaf = path.partition(".")
            if isinstance(config.get(head), dict):
                config[head] = {k: v for k, v in config[head].items() if k != leaf}
    return {**inputs, "config": in_effect(config, (inputs.get("classes") or {}).get("background") is not None)}


def what_changed(previous: dict | None, current: dict) -> list[str]:
    """What differs between the inputs a result was computed from (``previous``) and those of
    now (``current``), one phrase each; empty when it may be reused. A result that recorded no
    inputs (written by an older wsseg) cannot be trusted and is named as such."""
    if previous is None:
        return ["its inputs (not recorded: written by an older wsseg)"]
    out = []
    a, b = previous.get("classes"), current.get("classes")
    if a != b:
        a, b = a or {"names": [], "background": None}, b or {"names": [], "background": None}
        added = [c for c in b["names"] if c not in a["names"]]
        removed = [c for c in a["names"] if c not in b["names"]]
        detail = "; ".join(p for p in (f"added {', '.join(added)}" if added else "",
                                      f"removed {', '.join(removed)}" if removed else "") if p)
        if not detail:
            detail = "other order or implicit background"
        out.append(f"the class list ({len(a['names'])} -> {len(b['names'])} classes; {detail})")
    a, b = previous.get("corpus") or {}, current.get("corpus") or {}
    if a.get("hash") != b.get("hash"):
        out.append(f"the corpus content ({a.get('images')} -> {b.get('images')} images, manifest hash "
                   f"{a.get('hash')} -> {b.get('hash')})")
    a, b = previous.get("corrections") or {}, current.get("corrections") or {}
    if a.get("digest") != b.get("digest"):
        out.append(f"the corrections ({a.get('images', 0)} -> {b.get('images', 0)} corrected images)")
    a, b = previous.get("config") or {}, current.get("config") or {}
    # fields an older wsseg recorded that no round depends on (the shard size) are no change, nor
    # options it did not have while they keep their defaults
    fields = changed_fields(a, b)
    if fields:
        out.append(f"the configuration (differs in: {', '.join(fields)})")
    return out

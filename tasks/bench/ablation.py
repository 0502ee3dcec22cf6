"""Ablations of ``wsseg bench quality --ablate``: one configuration per switched-off part of the
method, and the dotted-key overrides (``--set proposals.t1=0.4``) that express them.

* :func:`ablation_variants`: the variants a configuration allows, each
  ``{"what": text, "overrides": {dotted key: value}}`` (plus ``"from_round"`` when the part acts
  from a later round on, ``"skip"`` when the configuration cannot express it);
* :func:`choose_variants`, :func:`skip_reason`: which of them a bench runs, and why one is not;
* :func:`apply_overrides`, :func:`check_overrides`: dotted keys onto a :class:`~tasks.config.WSSSConfig`;
* :func:`shares_round0`: whether a variant may reuse its main run's round-0 CAMs.
"""
from __future__ import annotations

import typing
from typing import Any

from wsseg.tasks.config import WSSSConfig

__all__ = ["ablation_variants", "apply_overrides", "check_overrides", "choose_variants", "skip_reason",
           "shares_round0", "field_exists", "IOU_FILTER"]

IOU_FILTER = {"proposals.t1": 0.3, "proposals.p1": 0.5}  # the filter's settings when the variant turns it on
CLASS_BALANCE = 0.5  # the rounds' segmenters' class weights when the variant turns them on (until 2026-12-05)


def field_exists(model_cls, dotted: str) -> bool:
    """Whether a dotted key names a field of a pydantic model (keys inside a dict field count)."""
    node = model_cls
    for part in dotted.split("."):
        if node is dict or typing.get_origin(node) is dict:
            return True
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            return False
        node = fields[part].annotation
    return True


def check_overrides(overrides: list[str]) -> None:
    """Refuse ``--set`` keys that are no WSSSConfig field (pydantic would silently drop them)."""
    bad = [item.split("=", 1)[0] for item in overrides if not field_exists(WSSSConfig, item.split("=", 1)[0])]
    if bad:
        raise ValueError(f"--set {', '.join(bad)}: no such config field; see tasks/config.py:WSSSConfig "
                         f"(e.g. segmentation.options.width, proposals.t1)")


def apply_overrides(config: WSSSConfig, overrides: dict[str, Any]) -> WSSSConfig:
    """A validated copy of ``config`` with dotted-key overrides applied."""
    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return WSSSConfig.model_validate(data)


def ablation_variants(config: WSSSConfig) -> dict[str, dict]:
    """The ``--ablate`` variants of a configuration, each switching one part of the method off
    (or swapping it), as ``{name: {"overrides": {dotted key: value}, "what": text}}``; a variant
    the configuration cannot express carries ``"skip"`` (the reason) instead of running."""
    p, f = config.proposals, config.features
    out: dict[str, dict] = {}
    if p.t1 > 0 or p.p1 > 0:
        out["no_iou_filter"] = {"what": "IoU filtering off (t1=0, p1=0: every proposal is positive)",
                                "overrides": {"proposals.t1": 0.0, "proposals.p1": 0.0}}
    else:  # the default since it measured better: the variant is the method's filter switched on
        out["iou_filter"] = {"what": f"IoU filtering on (t1={IOU_FILTER['proposals.t1']}, "
                                     f"p1={IOU_FILTER['proposals.p1']}) instead of off",
                             "overrides": dict(IOU_FILTER)}
    out |= {
        "fusion_" + ("threshold" if p.fusion == "topk" else "topk"): {
            "what": f"fusion {'threshold' if p.fusion == 'topk' else 'top-k'} instead of {p.fusion}",
            "overrides": {"proposals.fusion": "threshold" if p.fusion == "topk" else "topk"}},
    }
    if config.mil.iterations > 0:
        out["no_mil"] = {"what": "superpixel MIL refinement off (the preliminary result goes to step 3 as it is)",
                         "overrides": {"mil.iterations": 0}}
    if config.mil.iterations > 0 and config.mil.prior_weight > 0:
        out["no_mil_prior"] = {"what": "MIL mixtures without the preliminary result (the superpixel classifier "
                                       "alone reassigns)", "overrides": {"mil.prior_weight": 0.0}}
    if p.seed_prior_weight > 0:
        out["no_seed_prior"] = {"what": "seeded segmentation without the evidence prior (colour and seeds alone)",
                                "overrides": {"proposals.seed_prior_weight": 0.0}}
    if config.prior_weight > 0 and config.max_rounds > 1:
        out["no_round_prior"] = {"what": "rounds >= 1 use model r-1 alone as the preliminary result (no round-0 prior)",
                                 "overrides": {"prior_weight": 0.0}, "from_round": 1}
    if config.prelim_normalize and config.max_rounds > 1:
        out["no_prelim_normalize"] = {"what": "rounds >= 1 take model r-1's probabilities as they are (no per-class "
                                              "max normalisation)",
                                      "overrides": {"prelim_normalize": False}, "from_round": 1}
    if config.segmentation.rounds_class_balance > 0:
        out["no_class_balance"] = {"what": "the rounds' segmenters trained with unweighted cross-entropy",
                                   "overrides": {"segmentation.rounds_class_balance": 0.0}, "from_round": 1}
    else:  # off by default since it measured better: the variant turns it on
        out["class_balance"] = {"what": f"the rounds' segmenters' cross-entropy weighted by class rarity (share ** "
                                        f"-{CLASS_BALANCE})",
                                "overrides": {"segmentation.rounds_class_balance": CLASS_BALANCE}, "from_round": 1}
    for s in ("grabcut", "random_walker", "none"):
        if s != p.seeding:
            out[f"seeding_{s}"] = {"what": f"seeded segmentation {s} instead of {p.seeding}",
                                   "overrides": {"proposals.seeding": s}}
    if config.segmentation.use_edges:
        out["no_edges"] = {"what": "edge-feature channel off (3-channel segmenter)",
                           "overrides": {"segmentation.use_edges": False}, "from_round": 1}
    for m in ("slico", "felzenszwalb"):
        if m != f.superpixel_method:
            out[f"superpixel_{m}"] = {"what": f"superpixels {m} instead of {f.superpixel_method}",
                                      "overrides": {"features.superpixel_method": m}}
    for v in out.values():
        missing = [k for k in v["overrides"] if not field_exists(WSSSConfig, k)]
        if missing:
            v["skip"] = f"WSSSConfig has no field {', '.join(missing)}"
    return out


def choose_variants(config: WSSSConfig, names: list[str]) -> dict[str, dict]:
    """The variants of :func:`ablation_variants` named in ``names`` (every one when it is empty).

    Raises
    ------
    ValueError
        When a name is not a variant of this configuration.
    """
    variants = ablation_variants(config)
    unknown = [a for a in names if a not in variants]
    if unknown:
        raise ValueError(f"unknown ablation(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
    return {k: v for k, v in variants.items() if not names or k in names}


def skip_reason(variant: dict, rounds: int) -> str | None:
    """Why a variant cannot be measured in ``rounds`` label-only rounds (None: it can)."""
    return variant.get("skip") or (f"acts from round {variant['from_round']} on; pass --ablate-rounds "
                                   f"{variant['from_round'] + 1} or more to measure it"
                                   if variant.get("from_round", 0) >= rounds else None)


def shares_round0(main: WSSSConfig, variant: WSSSConfig) -> bool:
    """Whether a variant's round 0 starts from the same CAMs as its main run's: same image
    classifier settings, same shards, same split."""
    return (variant.classifier == main.classifier and variant.shard_size == main.shard_size
            and variant.split == main.split)

"""What a training under a configuration keeps and computes again of a run directory's finished
results: the image classifier, and each finished round whole (its labels and model) or its model
alone.

:func:`round_fate` decides for one round from what it was computed from (``inputs.json``,
:mod:`tasks.corpus.resume`) and its record; the flow acts on it (:func:`flows.wsss.keep_round_inputs`).
:func:`options_discard` asks the same of every finished result before anything starts, so that
``wsseg train`` can refuse options that would discard finished work unless told to compute it
again (``--recompute``); what a new corpus, class list or correction changes is recomputed
anyway and is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from wsseg.tasks.config import Scope, WSSSConfig, changed_options, options_with, recorded_config
from wsseg.tasks.corpus import resume
from wsseg.tasks.labels.corrections import corrections_entry
from wsseg.tasks.store import ImageRecord, Store
from wsseg.tasks.wsss import pipeline as pl
from wsseg.tasks.wsss import stopping
from wsseg.tasks.wsss.classifier import classifier_changes

#: what :func:`round_fate` decides for a round: ``kept`` whole; ``final_model``: kept, what changed
#: acts on the final model only and this round's is not it; ``decision``: kept, its stopping decision
#: taken again under another rule stands; ``model``: its labels kept, its model and every later
#: round computed again; ``rounds``: it and every later round computed again
FATES = ("kept", "final_model", "decision", "model", "rounds")


@dataclass(frozen=True)
class Fate:
    kind: str
    changed: tuple[str, ...] = ()  # what changed since the round was computed, in words
    decision: stopping.Decision | None = None  # kind "decision": the decision taken again


def decision_context(store: Store, r: int, config: WSSSConfig, foreground_on: bool) -> dict:
    """What round ``r``'s stopping decision reads beside its own figures (:func:`tasks.wsss.stopping.decide`'s
    keywords): round r-1's tag coverage, whether the corpus has an implicit background, and what round 0
    started from (the foreground path's start when ``foreground_on``)."""
    return {"previous_coverage": (store.read_round(r - 1) or {}).get("tag_coverage") if r > 0 else None,
            "implicit_background": store.classes().background is not None,
            "start": pl.start_name(config.foreground if foreground_on else None)}


def decision_stands(store: Store, r: int, config: WSSSConfig) -> stopping.Decision | None:
    """Round ``r``'s stopping decision taken again under ``config``'s rule from its record
    (:func:`tasks.wsss.stopping.decide_again`) where the round is finished and the decision stands
    (whether the rounds stop there, and which round is final); None where its model must be
    trained for another decision (or its record cannot tell)."""
    done = store.read_round(r)
    if not done or "stops_rounds" not in done:
        return None
    decision = stopping.decide_again(config, r, done,
                                     **decision_context(store, r, config, pl.foreground_on(store, config)[0]))
    if decision is None or (decision.stop, decision.final_round) != (done["stops_rounds"], done["final_round"]):
        return None
    return decision


def round_fate(store: Store, r: int, inputs: dict, config: WSSSConfig) -> Fate:
    """What becomes of round ``r`` under ``inputs`` (:func:`tasks.corpus.resume.round_inputs`) and
    ``config``: see :data:`FATES`. A round recorded as computed from other inputs, or finished without
    a record (an older wsseg's), is computed again from itself on, except what the change does not
    reach (:func:`tasks.corpus.resume.round_view`); an unfinished round without a record (one sharing
    another run's round-0 arrays, as the ablations do) is resumed."""
    recorded = store.round_inputs(r)
    if recorded is None and store.read_round(r) is None:
        return Fate("kept")
    changed = tuple(resume.what_changed(resume.round_view(recorded, r), resume.round_view(inputs, r)))
    if not changed:
        return Fate("kept")
    if recorded is None:
        return Fate("rounds", changed)

    def same(part: str) -> bool:
        return not resume.what_changed(resume.round_view(recorded, r, part), resume.round_view(inputs, r, part))

    done = store.read_round(r)
    if done and done.get("stops_rounds") is False and store.has_checkpoint("segmenter", r) and same("round_model"):
        return Fate("final_model", changed)  # not the last round: its segmenter reads none of what changed
    if same("computed"):
        decision = decision_stands(store, r, config)
        if decision is not None:
            return Fate("decision", changed, decision)
    return Fate("model" if same("labels") else "rounds", changed)


def budget_retrains(store: Store, r: int, config: WSSSConfig, done: dict | None) -> bool:
    """Whether the round budget of ``config`` trains finished round ``r``'s model again: the budget
    moved its decision (:func:`tasks.wsss.stopping.budget_moved`) and the last round's recipe differs
    from a round's (the full-budget final model, from round 1 on)."""
    return bool(done) and stopping.budget_moved(done, r, config) and r > 0 and store.has_checkpoint("segmenter", r)


# ---------------------------------------------------------------------------- before a command starts
@dataclass(frozen=True)
class Discard:
    """A finished result a configuration would compute again: ``what`` (``"classifier"``, or round
    ``round``'s ``"rounds"``: it and every later finished round, or ``"model"``: its model and every
    later finished round) and ``options``: (dotted option, value it was computed with, value now)."""

    what: str
    round: int | None
    options: tuple[tuple[str, object, object], ...]


def _data_changed(recorded: dict | None, inputs: dict) -> bool:
    """Whether what a result was computed from differs from ``inputs`` in more than its configuration
    (the class list, corpus, corrections): it is computed again whatever the options say."""
    if recorded is None:
        return True
    return bool(resume.what_changed(recorded, {**inputs, "config": recorded.get("config")}))


def _read_only(store: Store, kind: str) -> dict | None:
    """Checkpoint ``kind``'s content, or None where it is missing or damaged (left where it is: the
    command that asks may be refused, and a damaged one is recomputed whatever the options say)."""
    from wsseg.tasks.store.checkpoints import CheckpointError, read_file

    path = store.checkpoint_path(kind)
    try:
        return read_file(path) if path.is_file() else None
    except CheckpointError:
        return None


def options_discard(store: Store, config: WSSSConfig, records: Sequence[ImageRecord] | None = None) -> list[Discard]:
    """The finished results of ``store`` that a training under ``config`` (its weight digests filled
    in: :func:`tasks.corpus.encoders.with_weight_digests`) would compute again because of the
    configuration alone, as the flow would decide it; ``records``: the split's manifest rows (read
    a batch at a time where they are used when not given, as the flow does). Empty for a
    configuration the results were computed with."""
    if records is None:  # the footer's hash and count; the rows read where they are used
        corpus, records = store.split_entry(config.split), store.split_rows(config.split)
    else:
        records = corpus = list(records)
    classes = store.classes()
    out: list[Discard] = []
    saved = _read_only(store, "classifier")
    if saved is not None:
        meta = saved.get("meta") or {}
        learn = pl.training_sample(records, config.train_images, config.seed, store.corrections().keys())
        inputs = resume.classifier_inputs(classes, learn, config)
        if classifier_changes(meta, config.classifier, inputs) and not _data_changed(meta.get("inputs"), inputs):
            now = config.classifier.model_dump(mode="json")
            options = [o for o in changed_options({"classifier": meta.get("config", now)}, {"classifier": now})
                       if o[0].split(".")[-1] not in options_with(Scope.CAM_READING, under="classifier")]
            options += changed_options((meta.get("inputs") or {}).get("config") or {}, inputs["config"])
            out.append(Discard("classifier", None, tuple(options)))
    inputs = resume.round_inputs(classes, corpus, config, corrections_entry(store, records))
    finished = set(store.finished_rounds())
    for r in range(config.max_rounds):
        if r not in finished:
            break
        recorded = store.round_inputs(r)
        if _data_changed(resume.round_view(recorded, r), resume.round_view(inputs, r)):
            break  # it and every later round are computed again anyway
        fate = round_fate(store, r, inputs, config)
        done = store.read_round(r)
        if fate.kind in ("model", "rounds"):
            options = changed_options(resume.round_view(recorded, r)["config"], resume.round_view(inputs, r)["config"])
            out.append(Discard(fate.kind, r, tuple(options)))
            break
        if fate.kind == "decision":
            done = (done or {}) | fate.decision.record()
        if budget_retrains(store, r, config, done):
            before = (recorded_config(store.read_config()) or {}).get("max_rounds")
            out.append(Discard("model", r, (("max_rounds", before, config.max_rounds),)))
            break
        if done and stopping.budget_moved(done, r, config):
            done = done | stopping.budget_decision(r, config)
        if (done or {}).get("stops_rounds"):
            break
    return out


def describe(discards: list[Discard], finished: Sequence[int]) -> str:
    """The finished results of ``discards`` and the options that change them, as one phrase:
    ``the image classifier and rounds 0, 1, 2 (classifier.epochs 12 -> 8)``.

    >>> describe([Discard("model", 1, (("segmentation.epochs", 3, 4),))], [0, 1, 2])
    "round 1's model and round(s) 2 (segmentation.epochs 3 -> 4)"
    """
    parts, options = [], []
    for d in discards:
        if d.what == "classifier":
            parts.append("the image classifier")
        else:
            later = [r for r in finished if r > d.round]
            if d.what == "model":
                parts.append(f"round {d.round}'s model")
                rounds = later
            else:
                rounds = [d.round] + later
            if rounds:
                parts.append(f"round(s) {', '.join(map(str, rounds))}")
        options += [o for o in d.options if o[0] not in [p[0] for p in options]]
    shown = [f"{name} {_value(a)} -> {_value(b)}" for name, a, b in options[:4]]
    if len(options) > 4:
        shown.append(f"and {len(options) - 4} more")
    what = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)
    return what + (f" ({', '.join(shown)})" if shown else "")


def _value(v: object) -> str:
    text = str(v) if not isinstance(v, str) else repr(v) if " " in v or not v else v
    return text if len(text) <= 24 else text[:21] + "..."

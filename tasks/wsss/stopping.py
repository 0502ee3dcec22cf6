"""When the refresh rounds stop, and which round is final, from the pseudo-labels alone (no mask).

Three reasons end the rounds after round r (METHOD.md A step 9):

* **oscillation** (``stopping`` "oscillation", from round 1): at least half of the
  pixels round r changed went back to the label they had two rounds before (round 1: the labels
  round 0 started from, which its changed share is measured against too: the CAM labels, or on the
  class-agnostic foreground path the argmax of round 0's preliminary result). The round then mostly undoes
  its predecessor instead of moving on; round r-1, the last that moved forward, is final: its
  labels, and the final model trained on them;
* (a fourth, **tag coverage fell**, ``stopping`` "auto", was removed: without the MIL's least share
  the coverage falls in rounds that gain; docs/benchmarks.md#defaults-and-why names the commit
  that last had it; the tag coverage is still recorded);
* **converged**: the changed share fell below ``epsilon``; round r is final;
* **round budget**: ``max_rounds`` reached; round r is final.

Measured (pseudo-label mIoU of rounds 0 / 1 / 2 against the masks; tag coverage; reverted
fraction of rounds 1 / 2), 2026-12-02: the bundled demo 0.491 / 0.536 / 0.502, coverage -1.913 /
-1.565 / -1.642, reverted 0.25 / 0.41: round 2's coverage falls, round 1 is final (the best);
msrc21 train 0.606 / 0.656 / 0.672, coverage -1.497 / -1.315 / -1.294, reverted 0.32 / 0.34:
round 2, the budget, is final (the best); the one-class msrc21 "objects" corpus (docs/benchmarks.md#one-class-corpus) 0.768 /
0.726, coverage -0.853 / -0.898 (the object's share grew, the background's fell more), reverted
0.69: the oscillation rule stops round 1, round 0 is final (the best); coco128 train 0.060 / 0.082
/ 0.095, coverage -4.396 / -2.843 / -2.970 (round 2 gives the background back some of what round
1 gave the objects: background share of the labels 0.780 / 0.673 / 0.700, truth 0.675,
background IoU 0.571 / 0.529 / 0.556), reverted 0.17 / 0.39: round 2, the budget, is final (the
best; the coverage rule would have kept round 1, 0.013 lower). The reverted fraction alone does
not separate the demo's bad round 2 from msrc21's good one (and read 0.55 for the demo's on
another machine, where the oscillation rule was first measured); the coverage does, but its fall
on the demo is about one standard error of its image-to-image spread, so a round that changes
little either way may be judged by noise. Half is the point past which a round's changes are mostly reversions; no
threshold on the coverage is used beyond "lower than the round before".

On the foreground path round 1 was measured against the CAM labels until 2026-12-04; with the
pretrained defaults the objects corpus's round 1 (object IoU 0.745, round 0 0.719) then read 0.55
and stopped. Against round 0's preliminary result, its real start, it reads 0.21; round 2 (0.756)
converges and is final (docs/benchmarks.md#one-class-corpus).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from wsseg.tasks.config import WSSSConfig

__all__ = ["OSCILLATION", "Decision", "decide", "decide_again"]

#: a round whose reverted fraction of its changes reaches this oscillates
OSCILLATION = 0.5


@dataclass(frozen=True)
class Decision:
    """What round ``round`` decided: ``stop`` (no further round), ``final_round`` (whose labels
    and model are the run's final ones when it stops; the round itself otherwise), ``reason``
    (one sentence, None while the rounds go on), ``reverted`` (the reverted fraction of its
    changes), ``coverage`` (its labels' tag coverage, None where not recorded) and ``converged``."""

    round: int
    stop: bool
    final_round: int
    reason: str | None
    reverted: float
    converged: bool
    coverage: float | None = None

    def record(self) -> dict:
        """The round summary's fields."""
        d = asdict(self)
        return {"reverted_fraction": d["reverted"], "tag_coverage": d["coverage"], "stops_rounds": d["stop"],
                "final_round": d["final_round"], "stop_reason": d["reason"], "converged": d["converged"]}


BUDGET = "round budget"


def budget_moved(summary: dict, r: int, config: WSSSConfig) -> bool:
    """Whether round ``r``'s recorded decision (``summary``) was the round budget's and
    ``config.max_rounds`` makes it another: the round was the last and no longer is (a run taken
    further) or is the last now though it was not (a run stopped earlier). Its decision is then
    :func:`budget_decision`'s (a decision of another rule: converged, oscillation, coverage, holds
    whatever the budget), and its model is trained again where the last round's recipe differs
    (the final model: :func:`tasks.wsss.segmenter.final_model_config`).

    >>> from tasks.config import WSSSConfig
    >>> last = {"stops_rounds": True, "stop_reason": "round budget: 1 round(s) run; round 0 is final"}
    >>> budget_moved(last, 0, WSSSConfig(max_rounds=1)), budget_moved(last, 0, WSSSConfig(max_rounds=3))
    (False, True)
    >>> budget_moved({"stops_rounds": False, "stop_reason": None}, 1, WSSSConfig(max_rounds=2))
    True
    """
    if "stops_rounds" not in summary:  # an older wsseg's summary: its decision is taken again anyway
        return False
    by_budget = bool(summary.get("stops_rounds")) and str(summary.get("stop_reason") or "").startswith(BUDGET)
    goes_on = not summary.get("stops_rounds")
    last_now = r >= config.max_rounds - 1
    return (by_budget and not last_now) or (goes_on and last_now)


def budget_decision(r: int, config: WSSSConfig) -> dict:
    """The decision fields of a round summary for round ``r`` where no other rule stops the
    rounds (as in a round whose :func:`budget_moved`): the budget's stop when it is the last round
    of ``config.max_rounds``, else the rounds go on."""
    last = r >= config.max_rounds - 1
    return {"stops_rounds": last, "final_round": r, "converged": False,
            "stop_reason": _budget_reason(config, r) if last else None}


def _budget_reason(config: WSSSConfig, r: int) -> str:
    return f"{BUDGET}: {config.max_rounds} round(s) run; round {r} is final"


def decide(config: WSSSConfig, r: int, changed: float, reverted_share: float, coverage: float | None = None,
           previous_coverage: float | None = None, implicit_background: bool = False,
           start: str = "the CAM labels") -> Decision:
    """The decision after round ``r`` whose labels changed ``changed`` of the pixels, of which
    ``reverted_share`` (a share of all pixels) went back to their label of two rounds before;
    ``coverage`` and ``previous_coverage``: the tag coverage of round r's and round r-1's labels
    (the coverage rule is skipped where either is None, and on a corpus with an
    ``implicit_background``, whose objects trade pixels with the background: there a smaller
    object is a correction as often as a loss); ``start``: what round 0 started from, which round
    1 is compared with (:func:`tasks.wsss.pipeline.start_labels`)."""
    frac = reverted_share / changed if changed > 0 else 0.0
    keep = dict(reverted=frac, coverage=coverage)
    if config.stopping == "oscillation" and r >= 1 and changed > 0 and frac >= OSCILLATION:
        before = start if r == 1 else f"round {r - 2}"
        return Decision(r, True, r - 1, (
            f"oscillation: round {r} sent {frac:.2f} of the pixels it changed back to their label of {before} "
            f"(>= {OSCILLATION}); round {r - 1} is final"), converged=False, **keep)
    if r > 0 and changed < config.epsilon:
        return Decision(r, True, r, f"converged: round {r} changed {changed:.4f} of the pixels "
                                    f"(< epsilon {config.epsilon}); round {r} is final", converged=True, **keep)
    if r >= config.max_rounds - 1:
        return Decision(r, True, r, _budget_reason(config, r), converged=False, **keep)
    return Decision(r, False, r, None, converged=False, **keep)


def decide_again(config: WSSSConfig, r: int, done: dict, previous_coverage: float | None = None,
                 implicit_background: bool = False, start: str = "the CAM labels") -> Decision | None:
    """Round ``r``'s decision taken again under ``config``'s rule from its record ``done`` (its
    changed share, reverted fraction and tag coverage), with :func:`decide`'s other arguments as
    when the round ran; None where the record lacks them (an older wsseg's).

    >>> done = {"changed_share": 0.05, "reverted_fraction": 0.6, "tag_coverage": -1.2}
    >>> decide_again(WSSSConfig(stopping="budget", max_rounds=3), 1, done, None).stop
    False
    >>> decide_again(WSSSConfig(stopping="oscillation", max_rounds=3), 1, done, None).final_round
    0
    """
    if "changed_share" not in done or "reverted_fraction" not in done:
        return None
    changed = float(done["changed_share"])
    return decide(config, r, changed, float(done["reverted_fraction"] or 0.0) * changed, done.get("tag_coverage"),
                  previous_coverage, implicit_background=implicit_background, start=start)

"""When the refresh rounds stop, and which round is final, from the pseudo-labels alone (no mask).

Three reasons end the rounds after round r (METHOD.md A step 9):

* **oscillation** (``stopping="oscillation"``, from round 1): at least half of the pixels round r
  changed went back to the label they had two rounds before (round 1: the CAM labels, which
  round 0's changed share is measured against too). The round then
  mostly undoes its predecessor instead of moving on; round r-1, the last that moved forward, is
  final: its labels, and the final model trained on them;
* **converged**: the changed share fell below ``epsilon``; round r is final;
* **round budget**: ``max_rounds`` reached; round r is final.

Measured (reverted fraction of rounds 1 / 2, pseudo-label mIoU of rounds 0 / 1 / 2): the bundled
demo 0.23 / 0.55, 0.505 / 0.557 / 0.532, so round 1 is final; msrc21 train 0.34 / 0.39,
0.615 / 0.665 / 0.676, round 2 (the budget) is final; a 69-image one-class corpus from msrc21
(foreground path) 0.504 at round 1, 0.713 / 0.643, round 0 is final, the best each time but
with little margin on the last. Half is the point past which a round's changes are mostly
reversions; it was not tuned beyond these runs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tasks.config import WSSSConfig

__all__ = ["OSCILLATION", "Decision", "decide"]

#: a round whose reverted fraction of its changes reaches this oscillates
OSCILLATION = 0.5


@dataclass(frozen=True)
class Decision:
    """What round ``round`` decided: ``stop`` (no further round), ``final_round`` (whose labels
    and model are the run's final ones when it stops; the round itself otherwise), ``reason``
    (one sentence, None while the rounds go on), ``reverted`` (the reverted fraction of its
    changes) and ``converged``."""

    round: int
    stop: bool
    final_round: int
    reason: str | None
    reverted: float
    converged: bool

    def record(self) -> dict:
        """The round summary's fields."""
        d = asdict(self)
        return {"reverted_fraction": d["reverted"], "stops_rounds": d["stop"], "final_round": d["final_round"],
                "stop_reason": d["reason"], "converged": d["converged"]}


def decide(config: WSSSConfig, r: int, changed: float, reverted_share: float) -> Decision:
    """The decision after round ``r`` whose labels changed ``changed`` of the pixels, of which
    ``reverted_share`` (a share of all pixels) went back to their label of two rounds before."""
    frac = reverted_share / changed if changed > 0 else 0.0
    if config.stopping == "oscillation" and r >= 1 and changed > 0 and frac >= OSCILLATION:
        before = "the CAM labels" if r == 1 else f"round {r - 2}"
        return Decision(r, True, r - 1, (
            f"oscillation: round {r} sent {frac:.2f} of the pixels it changed back to their label of {before} "
            f"(>= {OSCILLATION}); round {r - 1} is final"), frac, False)
    if r > 0 and changed < config.epsilon:
        return Decision(r, True, r, f"converged: round {r} changed {changed:.4f} of the pixels "
                                    f"(< epsilon {config.epsilon}); round {r} is final", frac, True)
    if r >= config.max_rounds - 1:
        return Decision(r, True, r, f"round budget: {config.max_rounds} round(s) run; round {r} is final",
                        frac, False)
    return Decision(r, False, r, None, frac, False)

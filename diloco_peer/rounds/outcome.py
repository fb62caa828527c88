"""A round's outcome, decided in one place: from its exchange (the gate's decision and the all-reduce's result)
to what the conclusion does with it.

``decide`` is pure: it reads the exchange and checks the average (finite, not far longer than what we sent, not
refused by the fault injection), and changes nothing. The round's end (``OuterRounds.conclude``) carries the
verdict out; an average that arrives while the next round trains (``arrival.py``) reaches the replica early only
if the verdict is ``clean``, so both always agree on what a round's average is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..averaging.averager import RoundResult
from ..averaging.robust_aggregation import refuse_update
from ..config.faults import NO_FAULTS, Faults
from ..swarm.progress import ReadyDecision


@dataclass
class Exchange:
    """A round's gate and all-reduce, as the conclusion sees them."""

    decision: ReadyDecision
    result: RoundResult
    dropped: bool = False
    """Stopped at the gate, or (blocking) the gate found us off the swarm's state and synced to it instead."""
    off_swarm: str = ""
    """Overlapped: why the gate found our outer weights off the swarm's ("" if they were not)."""


@dataclass(frozen=True)
class Verdict:
    """What the round's end does with an exchange."""

    outcome: str
    """One of ``observe.metrics.ROUND_OUTCOMES``: ``averaged``; ``partial`` (averaged, but a reducer failed
    mid-round: part of our vector kept its own values); ``failed`` (ready peers, but no average we may apply);
    ``solo`` (nobody to average with)."""
    steps_with_average: bool
    """Our outer step takes the group's average; else, failing the state below, our own pseudo-gradient."""
    seeks_swarm_state: bool
    """Before stepping: if the other peers end this round with a state other than ours, take theirs instead of
    stepping (no average to step with; or the gate found our outer weights off the swarm's)."""
    rechecks: bool
    """After stepping, our weights may differ from the swarm's: part of our vector was not averaged (our weights
    differ from our group's), or our group held fewer peers than the gate saw ready (the round's peers split into
    groups, each with an average of its own). Compare them with the state the others end the round with, ours
    included, and take that one if it is not ours: a split heals within its round."""
    error: str
    """Why the group's average is not applied ("" where it is)."""
    warnings: tuple[str, ...] = ()
    """What the peer's log says about the round."""

    @property
    def withdraws(self) -> bool:
        """We no longer average this epoch: our record says so at once (peers whose round failed too need not wait
        for us), and the round's buffers and error-feedback residual go back to what they were."""
        return not self.steps_with_average

    @property
    def clean(self) -> bool:
        """The round's end applies the group's average as it is: an early arrival may take it at once."""
        return self.outcome == "averaged" and not self.seeks_swarm_state


def decide(exchange: Exchange, epoch: int, max_update_ratio: float, faults: Faults = NO_FAULTS) -> Verdict:
    """The verdict on the exchange of the round that ends at outer epoch ``epoch`` (applied, it makes ``epoch +
    1``). ``max_update_ratio``: ``averaging.max_update_ratio`` (``refuse_update``); ``faults``: a test may refuse
    a round's average as a peer whose checks fail would (``refuse_round``). Not for a dropped exchange (there is
    nothing to conclude)."""
    decision, result = exchange.decision, exchange.result
    round_number = epoch + 1
    error = result.error
    averaged = result.ok
    if averaged:
        refusal = refuse_update(result.averaged, result.sent_norm, max_update_ratio) \
            or faults.refuses_average(round_number)
        if refusal:
            averaged, error = False, f"refused the group's average: {refusal}"
    if averaged:
        outcome = "partial" if result.values_not_averaged else "averaged"
    else:
        outcome = "failed" if decision.ready > 1 or result.ok else "solo"
    warnings = []
    if outcome == "failed":
        warnings.append(f"round {round_number}: averaging failed ({error}); taking the state the others end this "
                        f"round with (or, if they have none, a solo outer step)")
    if len(set(result.group_epochs)) > 1:
        warnings.append(f"round {round_number}: the group mixed epochs {sorted(result.group_epochs)}")
    if exchange.off_swarm:
        warnings.append(f"round {round_number}: {exchange.off_swarm}: taking the swarm's state after this round")
    if result.values_not_averaged:
        warnings.append(f"round {round_number}: {result.values_not_averaged} values were not averaged (a peer failed "
                        f"mid-round); checking our weights against the swarm's")
    split = averaged and result.group_size < decision.members
    if split:
        warnings.append(f"round {round_number}: averaged in a group of {result.group_size} where the gate saw "
                        f"{decision.members} ready; checking our weights against the swarm's")
    return Verdict(outcome=outcome, steps_with_average=averaged,
                   seeks_swarm_state=not averaged or bool(exchange.off_swarm),
                   rechecks=bool(result.values_not_averaged) or split, error="" if averaged else error,
                   warnings=tuple(warnings))

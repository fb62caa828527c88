"""Rounds bounded by time: every peer trains as many inner steps as fit the round, so that fast and slow peers reach
the round gate together and nobody waits for anybody.

Volunteers' devices differ tenfold and more. With a fixed H every round waits for the slowest peer (the others idle),
or leaves it behind (its compute is thrown away). ``outer.round_length = "time"`` instead fixes the round's *time*:

- ``outer.inner_steps`` (H) keeps the meaning a DiLoCo user knows: the round's length in the faster peers' steps
  (as DyLU, Liu et al. 2024). The round's *period* is the time the swarm's fastest peer takes for a round of H steps,
  its round's other work included: ``min over peers of H * step_seconds + work_seconds``, from the progress records
  (each peer publishes its own, as moving averages: ``step_seconds`` per inner step, ``work_seconds`` per round outside
  training and waiting: the outer step, the eval, the records).
- A peer's training *budget* is the period less its own other work: a fast peer trains H steps; one five times
  slower about H / 5, and both are ready at the same time. The budget's time ends the round (``RoundClock``), not
  the steps planned from the pace (``planned_steps``). The inner LR schedule strides H over the steps planned
  (``Trainer.stride``), so every peer's schedule stays where the swarm's round is.
- A claim is bounded: a period under ``1 / MAX_SPREAD`` of the peers' median counts as that, so one peer that
  claims to be a thousand times faster cannot shrink everyone's rounds to one step.

Every peer counts its budget from its own start, and on a loaded machine (or behind a slow link) the peers of a
round begin it seconds apart: their all-reduces end apart. A peer that began its round after the round's first peer
did cuts its training by as much (``Pace.late``), so that the round's peers still reach the gate together: the late
one trains less, where otherwise everyone else would wait for it (and with many peers on a loaded machine the first
to arrive left before the last came: BENCHMARKS.md, "Many peers").

A newcomer (nothing measured yet) trains for the swarm's period too, cut by the time its steps take (``Pace.budget``);
only the swarm's first round, which nobody has measured, trains H steps. ``outer.round_length = "steps"`` trains H
every round, as the DiLoCo paper does. How contributions of unequal steps are weighted:
``training.outer_optimizer.contribution_scale``.
"""

from __future__ import annotations

import statistics
import time

from ..swarm.progress_record import ProgressRecord
from ..training.trainer import Trainer

SMOOTHING = 0.5
"""Weight of the newest round in the moving averages (a loaded machine's pace drifts within a few rounds)."""
MAX_SPREAD = 20.0
"""A period counts as at least the peers' median over this (a liar's claim of a tiny step time is bounded)."""
LATE_SLACK = 0.5
"""How late, in periods, a peer may come to the round and still be waited for (``Pace.too_slow``)."""
OVERRUN = 0.05
"""The most of its budget a round may overrun to fit one more inner step (half a step at most): a slow peer's half step
was a large part of the fast peers' round, which they spent at the gate waiting for it (``overrun``)."""

MAX_CUT = 0.5
"""The most of its budget a late start cuts (``Pace.late``): a record that says its peer began long before us (a liar,
a clock that is off) cannot shrink our round to nothing."""


class Pace:
    """This peer's pace, and how long it trains in a round of the swarm's.

    :param inner_steps: H, the round's length in the fastest peer's inner steps
    :param timed: rounds bounded by time (``outer.round_length == "time"``); else H steps every round
    """

    def __init__(self, inner_steps: int, timed: bool):
        self.inner_steps = inner_steps
        self.timed = timed
        self.step_seconds: float | None = None
        """This peer's seconds per inner step, lately."""
        self.work_seconds: float | None = None
        """This peer's seconds per round outside training and waiting, lately."""

    def trained(self, steps: int, seconds: float) -> None:
        """A round's inner steps are done: ``steps`` of them took ``seconds`` (published with our "ready": the
        others' next rounds are budgeted with it)."""
        if steps > 0 and seconds > 0:
            self.step_seconds = _smooth(self.step_seconds, seconds / steps)

    def ended(self, round_seconds: float, train_seconds: float, waited_seconds: float) -> None:
        """A round ended after ``round_seconds``, of which it trained ``train_seconds`` and waited ``waited_seconds``
        (the gate and the all-reduce, or an overlapped round's wait for its exchange): the rest was its work."""
        self.work_seconds = _smooth(self.work_seconds, max(0.0, round_seconds - train_seconds - waited_seconds))

    def fields(self) -> dict:
        """What our progress record says of our pace (nothing before we have measured it)."""
        fields = {"step_seconds": self.step_seconds, "work_seconds": self.work_seconds}
        return {key: value for key, value in fields.items() if value is not None}

    def period(self, records: list[ProgressRecord], own: str = "") -> float | None:
        """The round's period: the fastest peer's round of H steps, in seconds (None: nobody measured yet). Our own
        record (peer id ``own``) counts as we measure ourselves now; a peer that has not said its work yet (its first
        round) is taken to have as much as we do, at its speed (``at_pace``: a slow volunteer that took the fast
        peers' work for as long as its own planned too long a round, and they waited for it)."""
        work = self.own_work(records, own)
        rounds = [self.inner_steps * r.step_seconds
                  + (r.work_seconds if r.work_seconds is not None else at_pace(work, self.step_seconds, r.step_seconds))
                  for r in records if r.step_seconds is not None and r.peer_id != own]
        if self.step_seconds is not None:
            rounds.append(self.inner_steps * self.step_seconds + work)
        if not rounds:
            return None
        return max(min(rounds), statistics.median_low(rounds) / MAX_SPREAD)

    def own_work(self, records: list[ProgressRecord], own: str = "") -> float:
        """Our work per round outside training and waiting: as measured, or (not measured yet) the peers' median,
        each at our speed (``at_pace``)."""
        if self.work_seconds is not None:
            return self.work_seconds
        said = [at_pace(r.work_seconds, r.step_seconds, self.step_seconds)
                for r in records if r.work_seconds is not None and r.peer_id != own]
        return statistics.median_low(said) if said else 0.0

    def budget(self, records: list[ProgressRecord], own: str = "") -> float | None:
        """Seconds this peer (peer id ``own``) trains in the round ``records`` describe (None: H steps, not a
        time). A newcomer that has not measured itself yet trains for the swarm's period too: its first round,
        with nothing to plan from, is cut by the time its steps take as they go (``OuterRounds.train``), instead of
        H steps that held a slow joiner's swarm at the gate for a whole slow round."""
        period = self.period(records, own) if self.timed else None
        if period is None:
            return None
        return max(period - self.own_work(records, own), 0.0)

    def too_slow(self, record: ProgressRecord, records: list[ProgressRecord], own: str = "") -> bool:
        """Whether the peer of ``record`` cannot be ready in time for a round of the period ``records`` give: one inner
        step of it and its round's other work take longer than the whole round and ``LATE_SLACK`` of another (it
        trains one step at least, and arrives late every time: a peer with a sliver of a core can need longer for
        one step, its eval and its outer step than the swarm's round lasts). The round gate does not wait for it;
        rounds of fixed H wait for everyone. A peer only a little late is waited for: its round's work counts, and
        on a loaded machine the paces are noisy enough that equal peers came out over the bare period (12 peers on
        two busy cores: one was left out of a round and ready half a second later). ``own``: our peer id
        (``period``)."""
        period = self.period(records, own) if self.timed else None
        if period is None or record.step_seconds is None:
            return False
        return record.step_seconds + (record.work_seconds or 0.0) > period * (1 + LATE_SLACK)

    def proxies(self, records: list[ProgressRecord], own: str, epoch: int, slower_than: float) -> list[str]:
        """The peers (base58, fastest first) to hand our pseudo-gradient of ``epoch`` in to instead of joining its
        all-reduce (``averaging/hand_in.py``): those at our epoch that average as members, if our inner steps take
        over ``slower_than`` times the median of theirs (``averaging.hand_in_slower_than``; 0: never) and two of them
        at least are there to average it; else none. ``records``: the ones we trust, as our last gate read them,
        when the peers were a round behind (``epoch - 1``): they go on to ours as we do."""
        if not self.timed or not slower_than or self.step_seconds is None:
            return []
        others = [r for r in records if r.peer_id != own and epoch - 1 <= r.epoch <= epoch and r.joined
                  and not r.hands_to and r.step_seconds is not None]
        if len(others) < 2 or self.step_seconds <= slower_than * statistics.median_low(r.step_seconds for r in others):
            return []
        # the members: the others that this rule, applied from their side, keeps in the all-reduce. Peers decide at
        # once, each seeing the others as members: two that both handed in to one proxy left it nobody to average
        # with (a fast peer over the threshold of a test, beside the slow one)
        paces = {r.peer_id: r.step_seconds for r in others} | {own: self.step_seconds}
        members = [r for r in others if r.step_seconds <= slower_than * statistics.median_low(
            seconds for peer, seconds in paces.items() if peer != r.peer_id)]
        if len(members) < 2:
            return []
        return [r.peer_id for r in sorted(members, key=lambda r: (r.step_seconds, r.peer_id))]

    def late(self, records: list[ProgressRecord], own: str, training_round: int, started: float,
             budget: float) -> float:
        """Seconds to cut from our ``budget`` for round ``training_round``, which we began at ``started`` (wall clock):
        how much later than the first of the round's other peers (their ``round_started``) we began, ``MAX_CUT`` of the
        budget at most. ``records``: the ones we trust. A start after ours is not a reason for us to wait: that
        peer cuts its own round."""
        starts = [r.round_started for r in records if r.peer_id != own and r.training_round == training_round
                  and r.round_started is not None and r.round_started <= started]
        if not self.timed or not starts:
            return 0.0
        return min(started - min(starts), MAX_CUT * budget)

    def planned_steps(self, budget: float | None) -> int:
        """The inner steps a round of ``budget`` seconds should hold here: H at most, one at least (H where we have
        not measured our steps yet: the time cuts the round)."""
        if budget is None or self.step_seconds is None:
            return self.inner_steps
        return max(1, min(self.inner_steps, int((budget + overrun(budget, self.step_seconds)) / self.step_seconds)))


class RoundClock:
    """When a round bounded by time is over: once its next inner step would end past the budget by more than
    ``overrun`` allows, one step at least. It counts the time in inner steps, not the hops between chunks of them
    (those are the round's other work, which the budget has left out already). ``trainer``'s LR position says when
    the first step is done.

    The time ends every peer's round, the fastest's too: on a busy machine a round's steps go slower or faster than
    the pace measured lately, and a peer that trained the steps planned from it (H for the fastest) came to the gate
    early or late, where the others waited for it or it for them (BENCHMARKS.md, "Unequal volunteers").

    :param budget: our seconds of training in the round (None: H steps, not a time)
    """

    def __init__(self, budget: float | None, step_seconds: float | None, trainer: Trainer):
        self.budget = budget
        self.step_seconds = step_seconds
        """Our seconds per inner step, lately (None: not measured yet; the steps of this round tell)."""
        self.trainer = trainer
        self.first = trainer.position
        self.trained = 0.0
        self.steps = 0
        self.chunk_started: float | None = None

    def cut(self, seconds: float) -> float:
        """We began the round ``seconds`` after its first peer (``Pace.late``): it ends that much earlier for us. A
        cut under half a step changes nothing (the overrun covers it). The seconds cut (0: none)."""
        if self.budget is None or seconds < 0.5 * (self.step_seconds or 0.0) or seconds <= 0:
            return 0.0
        self.budget -= seconds  # (the compute thread reads it between two steps: one float, written once)
        return seconds

    def chunk_starts(self) -> None:
        self.chunk_started = time.monotonic()

    def chunk_ended(self, seconds: float, steps: int) -> None:
        self.trained += seconds
        self.steps += steps
        self.chunk_started = None

    def overdue(self) -> bool:
        if self.budget is None or self.trainer.position <= self.first:
            return False
        running = time.monotonic() - self.chunk_started if self.chunk_started is not None else 0.0
        step = self.step_seconds or (self.trained / self.steps if self.steps else running)
        return self.trained + running + step - overrun(self.budget, step) > self.budget


def at_pace(seconds: float, step_seconds: float | None, other_step_seconds: float | None) -> float:
    """``seconds`` of a round's other work, done by a peer of ``step_seconds`` per inner step, as a peer of
    ``other_step_seconds`` takes it (as it is where either is not known): the eval and the outer step are compute as
    the inner steps are, and a device many times slower at those is about as slow at these."""
    if not step_seconds or not other_step_seconds:
        return seconds
    return seconds * other_step_seconds / step_seconds


def overrun(budget: float, step_seconds: float) -> float:
    """Seconds a round of ``budget`` may run over to fit one more step of ``step_seconds``: half a step (a round of
    steps is as long as the budget, on average), but no more than ``OVERRUN`` of the budget (a slow peer comes to the
    gate early by most of a step rather than late by half of one: its lost time is its own)."""
    return min(0.5 * step_seconds, OVERRUN * budget)


def _smooth(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value

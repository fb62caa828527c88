"""Outer rounds: inner steps, then gate -> average -> check -> apply, round after round.

One outer round, as DiLoCo (Douillard et al. 2023) and OpenDiLoCo run it:

1. **train**: inner AdamW steps on this peer's shard (on the compute thread; the event loop stays free): by
   default as many as fit the round's period, H at most (``outer.round_length = "time"``: ``pace.py``), else H;
2. **gate**: publish "ready" for our epoch and wait (bounded) until the peers of this epoch are ready;
3. **average**: matchmake a group and all-reduce the pseudo-gradients (outer weights - replica weights),
   weighted by the tokens behind them;
4. **check**: refuse an average that is not finite or far larger than our own pseudo-gradient;
5. **apply**: the outer Nesterov step with the average (no group: with our own, a *solo* step); evaluate.

Steps 2-3 are the *exchange* (``exchange.py``), steps 4-5 the *conclusion* (``OuterRounds.conclude``), whose
verdict comes from one function (``outcome.decide``). When the exchange runs against the inner steps is the
schedule's (``schedule.py``): at once (blocking), or while the next round trains (overlapped). A peer whose weights
are not the swarm's heals by state sync (``healing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from ..averaging.averager import RoundAverager, RoundResult
from ..config import AveragingConfig, OuterConfig
from ..observe.events import EventLog
from ..observe.inner_progress import InnerProgress
from ..state.state_sync import StateSync
from ..swarm.dht_role import DhtRole
from ..swarm.progress import SwarmProgress
from ..swarm.progress_record import ProgressRecord
from ..training.outer_optimizer import OuterOptimizer, contribution_scale, scaled
from ..training.trainer import ComputeThread, Trainer
from .arrival import EarlyAverage
from .exchange import RoundExchange
from .healing import Healing
from .outcome import Exchange, Verdict, decide
from .pace import Pace, RoundClock
from .record import InnerResult, RoundRecord
from .schedule import schedule_for

logger = logging.getLogger("diloco_peer")

PROGRESS_EVENTS_PER_ROUND = 5


class OuterRounds:
    """Runs this peer's outer rounds; the daemon hands it the running components and keeps the lifecycle.

    :param outer_cfg: the ``[outer]`` section: H, the schedule (``overlap``, ``apply_on_arrival``), the outer lr,
        ``round_length`` (rounds bounded by time or by H steps) and ``contribution`` (how a round of fewer steps
        than H counts in the average)
    :param averaging: the ``[averaging]`` section: the gate, the checks of the average, the waits of healing
    :param max_rounds: ``run.max_rounds``: leave once the outer epoch reaches it (0: never)
    :param name: this peer's name, in logs and records
    :param trainer: the replica and its inner optimizer
    :param outer: the outer weights, momentum and epoch
    :param averager: one all-reduce per round (runs in its own process)
    :param progress: our progress record and the round gate
    :param sync: state sync (downloads the swarm's state; serves ours under its lock)
    :param events: the event log
    :param compute: the thread all torch work runs on
    :param should_stop: true once the daemon was asked to leave
    :param dht_role: whether our DHT node serves the others (none: it stays as it joined; ``swarm/dht_role.py``)
    :param tty: show a live status bar per round (else a progress line now and then: ``InnerProgress``)
    """

    def __init__(self, outer_cfg: OuterConfig, averaging: AveragingConfig, max_rounds: int, name: str, *,
                 trainer: Trainer, outer: OuterOptimizer, averager: RoundAverager, progress: SwarmProgress,
                 sync: StateSync, events: EventLog, compute: ComputeThread, should_stop: Callable[[], bool],
                 dht_role: DhtRole | None = None, tty: bool = False):
        self.averaging = averaging
        self.max_rounds = max_rounds
        self.inner_steps = outer_cfg.inner_steps
        self.outer_lr = outer_cfg.lr
        self.contribution = outer_cfg.contribution
        self.pace = Pace(outer_cfg.inner_steps, timed=outer_cfg.round_length == "time")
        """This peer's pace, and how long it trains in a round bounded by time."""
        self.healed = False
        """The round concluded last healed (took the others' state, or rechecked ours against theirs)."""
        self.name = name
        self.trainer = trainer
        self.outer = outer
        self.averager = averager
        self.progress = progress
        self.sync = sync
        self.events = events
        self.compute = compute
        self.should_stop = should_stop
        self.shown = InnerProgress(events, name, tty)
        """How the inner steps show (a status bar, progress lines and events)."""
        self.schedule = schedule_for(outer_cfg, EarlyAverage(outer, self._update_ratio, averager.faults))
        self.healing = Healing(averaging, self.schedule.lag, self.inner_steps, name, trainer=trainer, outer=outer,
                               averager=averager, progress=progress, sync=sync, events=events, should_stop=should_stop)
        self.exchange = RoundExchange(averaging, self.schedule.lag, self._at_gate, name, too_slow=self._too_slow,
                                      proxies=self._proxies, dht_role=dht_role, outer=outer, averager=averager,
                                      progress=progress, sync=sync, healing=self.healing, events=events,
                                      compute=compute, should_stop=should_stop)

    async def run(self, on_round: Callable[[RoundRecord], None]) -> None:
        """Rounds until stopped or ``run.max_rounds``; ``on_round(record)`` after each (one interrupted: dropped)."""
        try:
            while not self.should_stop() and not self.reached_max_rounds():
                started = time.perf_counter()
                record = await self.schedule.round(self)
                if record is not None:
                    record.round_seconds = time.perf_counter() - started
                    self._observe(record)
                    on_round(record)
        finally:
            self.exchange.cancel()

    def reached_max_rounds(self) -> bool:
        if self.max_rounds and self.outer.epoch >= self.max_rounds:
            logger.info(f"{self.name}: reached run.max_rounds={self.max_rounds}, leaving the swarm")
            return True
        return False

    async def catch_up(self, records: list) -> bool:
        """At start: if the swarm is ahead of us or our weights differ from its, download its state (``Healing``)."""
        return await self.healing.catch_up(records)

    async def train(self, epoch: int, start: list[torch.Tensor] | None = None) -> InnerResult:
        """The inner steps of round ``epoch + 1``: H, or (rounds bounded by time) as many as fit this peer's budget
        (``pace.py``), in chunks so that progress shows between them. The LR schedule goes from ``epoch * H`` to
        ``(epoch + 1) * H`` either way. Overlapped (``start``: the replica at the round's start), the average in
        flight is applied as soon as it arrives."""
        trainer, H = self.trainer, self.inner_steps
        end = (epoch + 1) * H
        budget = self.pace.budget(self.exchange.records, own=self.progress.record.peer_id)
        planned = self.pace.planned_steps(budget)
        trainer.stride = H / planned
        # a round bounded by time ends when its time is up (``RoundClock``), H steps at most, whatever the steps
        # planned from our pace lately; one that has not measured its steps yet (a newcomer) goes a step at a time
        measured = self.pace.step_seconds is not None
        clock = RoundClock(budget, self.pace.step_seconds, trainer)
        late = asyncio.create_task(self._started(epoch, clock)) if budget is not None else None
        chunk = max(1, planned // PROGRESS_EVENTS_PER_ROUND) if measured or budget is None else 1
        arrival = self.schedule.arrival
        arrived = arrival.due if arrival is not None else lambda: False
        steps, tokens, seconds, weighted_loss = 0, 0, 0.0, 0.0
        self.shown.start(epoch, planned, done=0)
        while steps < H and not self.should_stop() and not clock.overdue():
            if arrived():
                await self.compute.run(arrival.apply, start, trainer.step - epoch * H)
            if steps >= planned:  # past the plan: these steps train at the LR of the round's end, never further
                trainer.stride = 0.0
            todo = min(chunk, (planned if steps < planned else H) - steps)
            clock.chunk_starts()
            stats = await self.compute.run(trainer.train_steps, todo,
                                           lambda: self.should_stop() or arrived() or clock.overdue())
            clock.chunk_ended(stats.seconds, stats.steps)
            if not stats.steps:
                continue
            steps, tokens, seconds = steps + stats.steps, tokens + stats.tokens, seconds + stats.seconds
            weighted_loss += stats.loss * stats.steps
            self.progress.record = self.progress.record.copy(update={"inner_step": trainer.step})  # heartbeat
            self.shown.chunk(epoch, trainer.step, steps, stats)
        self.shown.end()
        if not self.should_stop():
            trainer.step = end  # (a few steps short of the budget, or the stride's rounding: the round's end)
        cut = late.result() if late is not None and late.done() else 0.0
        if late is not None:
            late.cancel()
        return InnerResult(steps=steps, tokens=tokens, compute_seconds=seconds,
                           train_loss=weighted_loss / max(steps, 1), late_seconds=cut, budget_seconds=budget)

    async def _started(self, training_round: int, clock: RoundClock) -> float:
        """Our round's start goes into our record, then we read when the round's other peers began theirs: as much
        as we began later than the first of them is cut from our training (``Pace.late``). It runs while the first
        steps train; the seconds cut.

        A blocking round begins where the last one's all-reduce ended: the outer step and the eval that follow are
        our round's work, which our budget has left out already (a slow peer's are long, and counted twice they cut
        it short). Otherwise (overlapped, the first round, after healing) it begins now."""
        exchange = self.exchange
        blocking_end = not self.schedule.lag and not self.healed and exchange.ended_at is not None
        started = exchange.ended_at if blocking_end else time.time()
        try:
            await self.progress.publish(training_round=training_round, round_started=started)
            records = await self.progress.swarm_records()
        except Exception as e:  # a flaky DHT costs the cut, never the round
            logger.debug(f"{self.name}: could not read the round's starts: {e}")
            return 0.0
        return clock.cut(self.pace.late(records, self.progress.record.peer_id, training_round, started, clock.budget))

    def _observe(self, record: RoundRecord) -> None:
        """A round's work outside training and waiting goes into our record (published with the next store): rounds
        that healed (a state sync, or the wait to compare our state with the others') or failed measure those, not
        us."""
        if record.outcome not in ("averaged", "solo") or self.healed:
            return
        self.pace.ended(record.round_seconds, record.compute_seconds, self.exchange.waited)
        self.progress.record = self.progress.record.copy(update=self.pace.fields())

    async def launch(self, pseudo_gradient: Callable[[], list[torch.Tensor]], inner: InnerResult) -> None:
        """Start the exchange of the round just trained (the schedule concludes it, now or a round later): the
        pseudo-gradient ``pseudo_gradient()`` computes (on the compute thread, idle between rounds), scaled as
        ``outer.contribution`` says for the steps behind it."""
        scale = contribution_scale(self.contribution, inner.steps, self.inner_steps)
        sent = await self.compute.run(scaled, pseudo_gradient, scale)
        self.pace.trained(inner.steps, inner.compute_seconds)  # our "ready" says it: the others budget with it
        self.progress.record = self.progress.record.copy(update=self.pace.fields())
        task = self.exchange.launch(sent, inner.tokens, self.trainer.step, scale, inner.steps)
        if self.schedule.arrival is not None:
            self.schedule.arrival.watch(task)

    async def conclude(self, inner: InnerResult, unsent: list[torch.Tensor] | None) -> RoundRecord | None:
        """Collect the pending exchange, decide its outcome, carry it out, heal where needed; the round's record
        (None: the round was dropped). ``unsent``: overlapped, the progress not averaged yet (it goes on top of
        whatever outer weights we end with)."""
        exchange = await self.exchange.collect()
        if exchange.dropped:
            return None
        epoch = self.outer.epoch
        self.report_offenses(exchange.result)
        verdict = decide(exchange, epoch, self._update_ratio(), self.averager.faults)
        for warning in verdict.warnings:
            logger.warning(warning)
        synced = await self._apply(verdict, exchange.result, unsent, epoch)
        self.healed = synced or verdict.rechecks
        if verdict.rechecks and not synced:
            # our weights may differ from the other peers' of the round: our step goes into our record now, if it is
            # not there yet (each peer waits for the others' before it compares), then the state most of them hold
            if (self.progress.record.epoch, self.progress.record.state_hash) != (self.outer.epoch,
                                                                               self.sync.state_hash):
                await self.publish_step()
            if await self.healing.recheck_after_round(epoch):
                await self.schedule.after_sync(self, unsent)
        # a peer that handed in and stepped with its group's average (or took the swarm's state) holds the outer
        # weights those peers hold, bit for bit, and they evaluate them on the same windows: the eval would cost a slow
        # peer a good part of its round (its share of a core is what it trains with), for a loss the swarm already has
        theirs = self.exchange.handed_to and (verdict.steps_with_average or synced)
        eval_loss = None if theirs else await self.schedule.evaluate(self)
        return self._record(epoch, exchange, verdict, inner, eval_loss)

    async def _apply(self, verdict: Verdict, result: RoundResult, unsent: list[torch.Tensor] | None,
                     epoch: int) -> bool:
        """The outer step with the group's average. Without one (or off the swarm's weights), first the state the
        other peers end this round with, and only if they have none a solo step with our own pseudo-gradient.
        Whether we took the others' state."""
        if verdict.withdraws:  # peers whose round failed too need not wait for us
            self.averager.round_failed()  # (it also hands back the average's memory: a download may follow)
            await self.progress.publish(ready=False)
        if verdict.seeks_swarm_state and await self.healing.after_failed_round(epoch):
            await self.schedule.after_sync(self, unsent)
            return True
        update = result.averaged if verdict.steps_with_average else await self.exchange.own_pseudo_gradient()
        await self.compute.run(self._outer_step, update)
        await self.schedule.after_step(self, unsent)
        return False

    def _outer_step(self, update: list[torch.Tensor]) -> None:
        with self.sync.lock:  # a peer downloading our state sees the state before or after, never between
            self.outer.step(update)
            self.sync.after_outer_step()

    async def publish_step(self) -> None:
        """Our new outer epoch and state, in our record, not ready. The pseudo-gradient we send next is averaged
        under this epoch (blocking: the round we train next; overlapped: the progress made while this round's
        average was in flight), so the peers' gates of that epoch wait for us (``round``)."""
        await self.progress.publish(epoch=self.outer.epoch, round=self.outer.epoch, ready=False,
                                    state_hash=self.sync.state_hash)

    def _update_ratio(self) -> float:
        """How many times longer than ours the group's average may be (``averaging.max_update_ratio``), for the
        pseudo-gradient we sent: as many times more where it holds fewer than H steps and counts as it is
        (``outer.contribution = "tokens"``), since a pseudo-gradient grows with the steps behind it."""
        steps, scale = self.exchange.steps, self.exchange.scale
        fewer = self.inner_steps / steps / scale if steps else 1.0
        return self.averaging.max_update_ratio * max(1.0, fewer)

    def _too_slow(self, record: ProgressRecord, records: list[ProgressRecord]) -> bool:
        return self.pace.too_slow(record, records, own=self.progress.record.peer_id)

    def _proxies(self, records: list[ProgressRecord], epoch: int) -> list[str]:
        # topk hands nothing in: the proxy's encoding would drop most of it, and no error feedback would keep that
        slower_than = 0.0 if self.averaging.compression == "topk" else self.averaging.hand_in_slower_than
        return self.pace.proxies(self.progress.trusted(records), self.progress.record.peer_id, epoch, slower_than)

    async def _at_gate(self, records: list) -> tuple[bool, str]:
        return await self.schedule.at_gate(self, records)

    def report_offenses(self, result: RoundResult) -> None:
        """Log the contributions our averager refused (metrics count them, by kind, from the event log)."""
        for offense in result.offenses:
            self.events.write("offense", peer=self.name, **offense)
            if offense["banned"]:  # its records stop counting at once: no vote, no target, no wait for it
                self.progress.ban(offense["offender"], self.averaging.ban_seconds)
                logger.warning(f"banned peer {offense['offender']} for {self.averaging.ban_seconds:g}s: repeated "
                               f"offenses, the last: {offense['kind']}: {offense['detail']}")

    def _record(self, epoch: int, exchange: Exchange, verdict: Verdict, inner: InnerResult,
                eval_loss: float | None) -> RoundRecord:
        """The record of the round concluded from outer epoch ``epoch``."""
        decision, result = exchange.decision, exchange.result
        arrival = self.schedule.arrival
        return RoundRecord(
            peer=self.name, round=self.outer.epoch, epoch=epoch,
            outcome=verdict.outcome, group_size=result.group_size, group_epochs=result.group_epochs,
            ready_peers=decision.ready, alive_peers=decision.alive, expected_peers=decision.expected,
            wait_seconds=decision.waited,
            allreduce_seconds=result.seconds, transfer_seconds=result.transfer_seconds, bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received, bytes_relayed=result.bytes_relayed,
            values_not_averaged=result.values_not_averaged, error=verdict.error or result.error, tokens=inner.tokens,
            compute_seconds=inner.compute_seconds, train_loss=inner.train_loss, eval_loss=eval_loss,
            inner_lr=self.trainer.current_lr(), outer_lr=self.outer_lr, inner_step=self.trainer.step,
            param_sha256=self.sync.state_hash, inner_steps=inner.steps,
            arrived_step=arrival.step if arrival is not None else None,
            late_seconds=round(inner.late_seconds, 3) or None, density=result.density,
            budget_seconds=round(inner.budget_seconds, 3) if inner.budget_seconds is not None else None)


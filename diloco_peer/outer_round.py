"""Outer rounds: H inner steps, then gate -> average -> check -> apply, round after round.

One outer round, as DiLoCo (Douillard et al. 2023) and OpenDiLoCo run it:

1. **train**: H inner AdamW steps on this peer's shard (on the compute thread; the event loop stays free);
2. **gate**: publish "ready" for our epoch and wait (bounded) until the peers of this epoch are ready;
3. **average**: matchmake a group and all-reduce the pseudo-gradients (outer weights - replica weights),
   weighted by the tokens behind them;
4. **check**: refuse an average that is not finite or far larger than our own pseudo-gradient;
5. **apply**: the outer Nesterov step with the average (no group: with our own, a *solo* step); evaluate.

Steps 2-3 are the *exchange*. ``outer.overlap = "blocking"`` awaits it at once. The overlapped modes launch it in the
background and go straight on training the next round; the exchange of round t is concluded (steps 4-5) at the end of
round t+1. Meanwhile the replica trains from the outer weights plus what ``training.outer_optimizer.overlap_offset``
puts on top: ``"eager"`` the outer step this peer predicts from its own fresh pseudo-gradient (Kale et al. 2025's eager
updates), ``"delayed"`` (DiLoCoX's one-step delay) its own progress as it is. The average replaces that stand-in as
soon as it arrives: between two inner steps of round t+1 the replica moves onto where the average will put the outer
weights, with the progress made since on top (``arrival.py``, ``outer.apply_on_arrival``; the ``round`` event's
``arrived_step`` says at which inner step, absent: at the round's end). The outer step itself still happens at the end
of round t+1. The outer weights of peers that averaged together stay bit-identical in every mode; ``diloco-peer
simulate --overlap eager`` computes the same updates (``run_diloco(arrival=...)``).

Epochs (overlapped): after applying round t's average the outer weights are at epoch t; the record says
``epoch t, ready, round t+1`` while round t+1 trains (``SwarmProgress.wait_until_ready(delayed=True)``).

Healing: a peer that is behind (newcomer, restart from an old checkpoint, straggler) or whose weights left the swarm's
(a failed round, a reducer that died mid-all-reduce) downloads the swarm's state from peers that hold it
(``state/state_sync.py``) and goes on from there; overlapped, with its own unsent progress on top (a *rebase*). Every
gate compares the swarm's (epoch, hash) with ours: blocking syncs at once, overlapped takes the swarm's state at the
end of that round. A failed round takes the state the *other* peers end it with (with two peers our own un-stepped
record would otherwise make us our own target) and steps alone only if they have none. A newcomer synced at epoch e
trains round e+1 and rebases at its end onto epoch e+1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from .arrival import EarlyAverage
from .averaging.averager import RoundAverager, RoundResult
from .averaging.robust_aggregation import refuse_update
from .config import PeerConfig
from .observe.events import EventLog
from .observe.inner_progress import InnerProgress
from .round_record import Exchange, InnerResult, RoundRecord
from .state.state_sync import StateSync
from .state.target import after_failed_sync, swarm_target
from .swarm.progress import ALL_READY, ReadyDecision, SwarmProgress
from .training.outer_optimizer import OuterOptimizer, evaluate_outer, overlap_offset, progress_since, replica_copy
from .training.trainer import ComputeThread, Trainer

logger = logging.getLogger("diloco_peer")

PROGRESS_EVENTS_PER_ROUND = 5


class OuterRounds:
    """Runs this peer's outer rounds; the daemon hands it the running components and keeps the lifecycle.

    :param cfg: the config tree (``outer``, ``averaging`` and ``run.max_rounds`` are read)
    :param name: this peer's name, in logs and records
    :param trainer: the replica and its inner optimizer
    :param outer: the outer weights, momentum and epoch
    :param averager: one all-reduce per round (runs in its own process)
    :param progress: our progress record and the round gate
    :param sync: state sync (downloads the swarm's state; serves ours under its lock)
    :param events: the event log
    :param compute: the thread all torch work runs on
    :param should_stop: true once the daemon was asked to leave
    :param tty: show a live status bar per round (else a progress line now and then: ``InnerProgress``)
    """

    def __init__(self, cfg: PeerConfig, name: str, *, trainer: Trainer, outer: OuterOptimizer,
                 averager: RoundAverager, progress: SwarmProgress, sync: StateSync, events: EventLog,
                 compute: ComputeThread, should_stop: Callable[[], bool], tty: bool = False):
        self.cfg, self.name = cfg, name
        self.trainer, self.outer, self.averager, self.progress = trainer, outer, averager, progress
        self.sync, self.events, self._compute, self.should_stop = sync, events, compute, should_stop
        self.shown = InnerProgress(events, name, tty)
        """How the inner steps show (a status bar, progress lines and events)."""
        self.overlapped = cfg.outer.overlap != "blocking"
        self.pending: asyncio.Task | None = None
        """Overlapped modes: the exchange of the last round's progress, running while this round trains."""
        self.sent: list[torch.Tensor] = []
        """The pseudo-gradient ``pending`` averages (a solo step applies it if the all-reduce fails)."""
        self.early = EarlyAverage(cfg, outer, averager.faults)
        """Overlapped: applies ``pending``'s average to the replica as soon as it arrives."""
        self.last_sync_epoch = -1
        """The outer epoch our last state sync brought us to."""
        self.downloads = 0
        """State downloads begun (``catch_up``)."""

    async def run(self, on_round: Callable[[RoundRecord], None]) -> None:
        """Rounds until stopped or ``run.max_rounds``; ``on_round(record)`` after each (one interrupted: dropped)."""
        try:
            while not self.should_stop() and not self.reached_max_rounds():
                started = time.perf_counter()
                record = await self._round()
                if record is not None:
                    record.round_seconds = time.perf_counter() - started
                    on_round(record)
        finally:
            if self.pending is not None:
                self.pending.cancel()

    async def _round(self) -> RoundRecord | None:
        """One round. None if stopped, replaced by a state sync, or (overlapped) with no exchange to conclude yet."""
        H = self.cfg.outer.inner_steps
        start = await self._compute.run(replica_copy, self.trainer.model) if self.overlapped else None
        inner = await self._inner_steps(self.trainer.step // H if self.overlapped else self.outer.epoch, start)
        if self.should_stop():
            return None
        if not self.overlapped:  # blocking: the exchange is awaited at once, nothing is left unsent
            self._launch(await self._compute.run(self.outer.pseudo_gradient), inner.tokens)
            return await self._conclude(inner, unsent=None)
        unsent = await self._compute.run(progress_since, self.trainer.model, start)
        record = await self._conclude(inner, unsent)
        self._launch([-d for d in unsent], inner.tokens)  # start - end, like ``outer - replica``
        return record

    def reached_max_rounds(self) -> bool:
        if self.cfg.run.max_rounds and self.outer.epoch >= self.cfg.run.max_rounds:
            logger.info(f"{self.name}: reached run.max_rounds={self.cfg.run.max_rounds}, leaving the swarm")
            return True
        return False

    async def _inner_steps(self, epoch: int, start: list[torch.Tensor] | None) -> InnerResult:
        """The H inner steps of ``epoch``, in chunks so that progress shows between them. Overlapped (``start``:
        the replica at the round's start), the last round's average is applied as soon as it arrives."""
        trainer, H = self.trainer, self.cfg.outer.inner_steps
        chunk = max(1, H // PROGRESS_EVENTS_PER_ROUND)
        tokens, compute, weighted_loss = 0, 0.0, 0.0
        self.shown.start(epoch, H, done=trainer.step - epoch * H)
        arrived = self.early.due if start is not None else lambda: False
        while trainer.step - epoch * H < H and not self.should_stop():
            if arrived():
                await self._compute.run(self.early.apply, start, trainer.step - epoch * H)
            todo = min(chunk, H - (trainer.step - epoch * H))
            stats = await self._compute.run(trainer.train_steps, todo, lambda: self.should_stop() or arrived())
            if not stats.steps:
                continue
            tokens, compute = tokens + stats.tokens, compute + stats.seconds
            weighted_loss += stats.loss * stats.steps
            self.progress.record = self.progress.record.copy(update={"inner_step": trainer.step})  # heartbeat
            self.shown.chunk(epoch, trainer.step, trainer.step - epoch * H, stats)
        self.shown.end()
        return InnerResult(tokens=tokens, compute_seconds=compute, train_loss=weighted_loss / H)

    # --- the exchange: gate and all-reduce

    def _launch(self, pseudo_gradient: list[torch.Tensor], tokens: int) -> None:
        self.sent = pseudo_gradient
        self.pending = asyncio.create_task(self._exchange(pseudo_gradient, tokens, self.outer.epoch))
        self.early.watch(self.pending)

    async def _exchange(self, pseudo_gradient: list[torch.Tensor], tokens: int, epoch: int) -> Exchange:
        """Publish "ready" for ``epoch``, wait at the gate, then average with the ready peers (if any)."""
        cfg = self.cfg.averaging
        await self.progress.publish(epoch=epoch, round=epoch + self.overlapped, inner_step=self.trainer.step,
                                    ready=True, state_hash=self.sync.state_hash,
                                    tokens=self.progress.record.tokens + tokens)
        decision = await self.progress.wait_until_ready(
            min_peers=cfg.min_peers if epoch == 0 else 1, min_peers_timeout=cfg.first_round_timeout,
            ready_timeout=cfg.ready_timeout, should_stop=self.should_stop, delayed=self.overlapped)
        if self.should_stop():
            return Exchange(decision, RoundResult(ok=False, error=decision.reason), dropped=True)
        # blocking: behind or off the swarm's weights, our pseudo-gradient is relative to a state nobody holds
        downloads = self.downloads
        if not self.overlapped and await self.catch_up(decision.records):
            return Exchange(decision, RoundResult(ok=False), dropped=True)
        if self.downloads != downloads and self.averager.in_place:  # a failed download took the round's buffer
            pseudo_gradient = self.sent = await self.own_pseudo_gradient()
        # overlapped: our progress is a fair contribution (it is relative to where we started), but the outer
        # weights it would be applied to are not the swarm's: the conclusion rebases instead of stepping
        off_swarm = self.sync.needs_sync(swarm_target(decision.records)) if self.overlapped else ""
        if decision.ready < 2:
            return Exchange(decision, RoundResult(ok=False, error=decision.reason), off_swarm=off_swarm)
        self.events.write("averaging", peer=self.name, epoch=epoch, ready_peers=decision.ready)
        return Exchange(decision, await self.averager.average(pseudo_gradient, weight=tokens, epoch=epoch,
                                                              expected=decision.expected if cfg.start_when_complete
                                                              else None, nudge=self._waiting(decision, epoch)),
                        off_swarm=off_swarm)

    def _waiting(self, decision: ReadyDecision, epoch: int) -> list[str]:
        """Peers to tell that the round's last one is ready: all ready at our gate's first read (we came last)."""
        if decision.reads != 1 or decision.reason != ALL_READY:
            return []
        return [r.peer_id for r in decision.records
                if r.ready and r.epoch == epoch and r.peer_id != self.progress.record.peer_id]

    async def _collect(self) -> tuple[Exchange, float]:
        """The pending exchange's outcome and how long we waited for it; a failure there is a lost round."""
        waited = time.perf_counter()
        try:
            exchange = await self.pending
        except Exception as e:  # e.g. the DHT failed to store our record: never fatal
            exchange = Exchange(ReadyDecision(1, 1, 0.0, "error"), RoundResult(False, error=f"{type(e).__name__}: {e}"))
        self.pending = None
        return exchange, time.perf_counter() - waited

    # --- the conclusion: check, apply, heal

    async def _conclude(self, inner: InnerResult, unsent: list[torch.Tensor] | None) -> RoundRecord | None:
        """Check the pending exchange's average and apply it (or take a solo step, or rebase); the record.

        ``unsent``: overlapped modes' progress not averaged yet (``_continue`` puts it on top of the outer weights)."""
        if self.pending is None:  # overlapped: the first round after starting or syncing
            await self._first_round(unsent)
            return None
        exchange, overlap_wait = await self._collect()
        if exchange.dropped:
            return None
        decision, result = exchange.decision, exchange.result
        epoch, max_ratio = self.outer.epoch, self.cfg.averaging.max_update_ratio
        self.report_offenses(result)
        outcome = "averaged" if result.ok else ("failed" if decision.ready > 1 else "solo")
        if result.ok and (why := refuse_update(result.averaged, result.sent_norm, max_ratio)
                          or self.averager.faults.refuses_average(epoch + 1)):
            result.ok, result.error, outcome = False, f"refused the group's average: {why}", "failed"
        if outcome == "averaged" and result.values_not_averaged:
            outcome = "partial"  # a reducer failed mid-round: part of our vector kept its own values (healed below)
        if outcome == "failed":
            logger.warning(f"round {epoch + 1}: averaging failed ({result.error}); taking the state the others "
                           f"end this round with (or, if they have none, a solo outer step)")
        if len(set(result.group_epochs)) > 1:
            logger.warning(f"round {epoch + 1}: the group mixed epochs {sorted(result.group_epochs)}")
        await self._apply(exchange, unsent, epoch)
        if result.values_not_averaged:
            # our weights now differ from those of the others in the group: re-sync at once, before training, with
            # the state the others end this round with (a peer that died mid-round stops counting when its record
            # expires, after 3 heartbeats)
            logger.warning(f"round {epoch + 1}: {result.values_not_averaged} values were not averaged "
                           f"(a peer failed mid-round); checking our weights against the swarm's")
            if self.overlapped:  # our step now, not with the next "ready": each member waits here for the others'
                await self.progress.publish(epoch=self.outer.epoch, round=self.outer.epoch + 1, ready=False,
                                            state_hash=self.sync.state_hash)  # (else each kept its own state)
            await self._rebase(unsent, await self._round_end(epoch, extra=3 * self.cfg.averaging.heartbeat),
                               ours_now=True)
        if unsent is None:
            eval_loss = await self._compute.run(self.trainer.evaluate)
        else:  # overlapped: the outer weights' loss (the replica holds them plus the unsent progress)
            eval_loss = await self._compute.run(evaluate_outer, self.outer, self.trainer.evaluate)
        return RoundRecord(
            peer=self.name, round=self.outer.epoch, epoch=epoch, outcome=outcome, group_size=result.group_size,
            group_epochs=result.group_epochs, ready_peers=decision.ready, alive_peers=decision.alive,
            wait_seconds=decision.waited, allreduce_seconds=result.seconds, transfer_seconds=result.transfer_seconds,
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, bytes_relayed=result.bytes_relayed,
            values_not_averaged=result.values_not_averaged, error=result.error, tokens=inner.tokens,
            compute_seconds=inner.compute_seconds, train_loss=inner.train_loss, eval_loss=eval_loss,
            inner_lr=self.trainer.current_lr(), outer_lr=self.cfg.outer.lr, inner_step=self.trainer.step,
            param_sha256=self.sync.state_hash, overlap_wait_seconds=overlap_wait if self.overlapped else None,
            arrived_step=self.early.step)

    async def _first_round(self, unsent: list[torch.Tensor]) -> None:
        if self.last_sync_epoch == self.outer.epoch:  # synced into a running swarm, in the middle of a round: take
            await self._rebase(unsent, await self._round_end(self.outer.epoch))  # its result, our progress on top
        else:
            await self._compute.run(self._continue, unsent)  # a fresh start: nothing to apply yet

    async def _apply(self, exchange: Exchange, unsent: list[torch.Tensor] | None, epoch: int) -> None:
        """The outer step with the group's average. Without one, first the state the other peers end this round
        with (their records, not ours, decide: ``_rebase``), and only if they have none a solo step with our own
        pseudo-gradient. An overlapped peer whose outer weights the gate found off the swarm's takes the others'
        state instead of stepping."""
        result = exchange.result
        if not result.ok or exchange.off_swarm:
            if exchange.off_swarm:
                logger.warning(f"round {epoch + 1}: {exchange.off_swarm}: taking the swarm's state after this round")
            if not result.ok:  # we no longer average this epoch: peers whose round failed too need not wait for us
                self.averager.round_failed()  # (it also hands back the average's memory: a download may follow)
                await self.progress.publish(ready=False)
            # a peer that died mid-round stops counting when its record expires, after 3 heartbeats
            records = await self._round_end(epoch, extra=3 * self.cfg.averaging.heartbeat, ready_only=True)
            if await self._rebase(unsent, records, others_only=True):
                return
        await self._compute.run(self._outer_step, result.averaged if result.ok else await self.own_pseudo_gradient(),
                                unsent)
        if not self.overlapped:  # overlapped modes publish their new epoch with the next "ready"
            await self.progress.publish(epoch=self.outer.epoch, round=self.outer.epoch, ready=False,
                                        state_hash=self.sync.state_hash)

    async def own_pseudo_gradient(self) -> list[torch.Tensor]:
        """Our pseudo-gradient of the round being concluded, for a solo step (or an all-reduce after a failed
        download): as sent, or, where the averager writes the average over what we sent (``in_place``: blocking
        rounds on a GPU, whose replica is untouched until the outer step), computed again from the replica."""
        return await self._compute.run(self.outer.pseudo_gradient) if self.averager.in_place else self.sent

    def _outer_step(self, update: list[torch.Tensor], unsent: list[torch.Tensor] | None) -> None:
        with self.sync.lock:  # a peer downloading our state sees the state before or after, never between
            self.outer.step(update)
            self.sync.after_outer_step()
        if unsent is not None:
            self._continue(unsent)

    def _continue(self, unsent: list[torch.Tensor]) -> None:
        """Overlapped: replica = outer weights + ``overlap_offset`` (``delayed``: the progress not averaged
        yet; ``eager``: the outer step predicted from it)."""
        on_top = overlap_offset(self.outer, self.cfg.outer.overlap, unsent)
        with torch.no_grad():
            for p, o, d in zip(self.trainer.model.parameters(), self.outer.params, on_top):
                p.copy_((o + d).to(p.device, p.dtype))

    def report_offenses(self, result: RoundResult) -> None:
        """Log the contributions our averager refused (metrics count them, by kind, from the event log)."""
        for offense in result.offenses:
            self.events.write("offense", peer=self.name, **offense)
            if offense["banned"]:  # its records stop counting at once: no vote, no target, no wait for it
                self.progress.ban(offense["offender"], self.cfg.averaging.ban_seconds)
                logger.warning(f"banned peer {offense['offender']} for {self.cfg.averaging.ban_seconds:g}s: repeated "
                               f"offenses, the last: {offense['kind']}: {offense['detail']}")

    # --- healing: state sync

    async def _round_end(self, epoch: int, extra: float = 0.0, ready_only: bool = False) -> list:
        """The swarm's records once some peer has ended round ``epoch`` (``ready_timeout + extra`` at most;
        ``ready_only``: not waiting for peers at ``epoch`` that no longer average it, see ``wait_for_round_end``)."""
        return await self.progress.wait_for_round_end(epoch, self.cfg.averaging.ready_timeout + extra,
                                                      self.should_stop, ready_only=ready_only)

    async def _rebase(self, unsent: list[torch.Tensor] | None, records: list, others_only: bool = False,
                      ours_now: bool = False) -> bool:
        """If the swarm holds other outer weights than ours, download them (and keep our unsent progress).
        ``others_only``: after a failed round, judge by the other peers' records alone (with two peers the quorum
        epoch is the lower one, and our own un-stepped record would make us our own target). ``ours_now``: after
        a partial round, with our state as it is now: every member holds a state of its own, and all must pick
        the same one (judged by the others alone, two members could each wait for the other's, seen in CI)."""
        if others_only or ours_now:
            records = [r for r in records if r.peer_id != self.progress.record.peer_id]
        if ours_now:
            records.append(self.progress.record.copy(update={"epoch": self.outer.epoch,
                                                             "state_hash": self.sync.state_hash}))
        if not await self.catch_up(records, sending=unsent is not None):
            return False
        if unsent is not None:
            await self._compute.run(self._continue, unsent)
        return True

    async def catch_up(self, records: list, sending: bool = False) -> bool:
        """If the swarm is ahead of us or our weights differ from its, download its state. True if we did.
        ``sending``: overlapped, we send progress at the synced epoch next (a rebase), so our record says we
        are in that epoch's round and its gate waits for us; else the round after it, which we train next.

        Until we hold the swarm's state (synced, or nothing to sync) our epoch does not vote on the swarm's
        (``progress.quorum_epoch``): a newcomer or a peer restarted from an old checkpoint knows nothing of it.
        """
        target = swarm_target(records)
        why = self.sync.needs_sync(target)
        if not why:
            if not self.progress.record.joined:
                await self.progress.publish(joined=True)
            return False
        logger.info(f"state sync: {why}; downloading epoch {target.epoch} from one of {len(target.holders)} peers")
        self.downloads += 1
        if self.averager.in_place:  # the round's one buffer holds nothing the replica cannot give again: its 4
            self.averager.release()  # bytes per parameter go back before the download's staging buffer fills up
        await self._heading_for(target.epoch)
        result = await self.sync.sync(target, self.should_stop)
        for _ in range(3):  # the swarm stepped on meanwhile: sync again (a few rounds: their updates, round_log.py)
            if not (result.moved_on or result.ok) or self.should_stop() or not self.sync.needs_sync(
                    target := swarm_target(await self.progress.swarm_records())):
                break
            await self._heading_for(target.epoch)
            retry = await self.sync.sync(target, self.should_stop, reuse=result, count=False)
            if result.ok and not retry.ok:
                break  # we hold the state the first one brought: the next gate tries again
            result = retry.after(result)
        self.events.write("sync", peer=self.name, reason=why, donor=result.donor, epoch=result.epoch,
                          seconds=result.seconds, bytes=result.bytes, attempts=result.attempts, ok=result.ok,
                          error=result.error, donor_errors=result.donor_errors, rounds=result.rounds,
                          stages=result.stages)
        if not result.ok:
            logger.warning(f"state sync failed ({result.error}); will try again at the next round")
            await self._heading_for(self.outer.epoch)
            if not self.should_stop():
                await after_failed_sync(self.progress, target, result, self.sync.needs_sync,
                                        2 * self.cfg.averaging.ready_timeout)
            return False
        # the inner LR-schedule position: the round after the synced epoch (overlapped: the round after that,
        # which the swarm trains while it averages the synced epoch's)
        self.trainer.step = (self.outer.epoch + self.overlapped) * self.cfg.outer.inner_steps
        next_round = self.outer.epoch + (self.overlapped and not sending)
        self.last_sync_epoch = self.outer.epoch
        self.averager.reset_feedback()  # the residual belonged to the weights we just replaced
        await self.progress.publish(epoch=self.outer.epoch, round=next_round,
                                    inner_step=self.trainer.step, ready=False, state_hash=self.sync.state_hash,
                                    joined=True)
        logger.info(f"state sync: now at epoch {self.outer.epoch} ({result.summary()})")
        return True

    async def _heading_for(self, epoch: int) -> None:
        """Blocking, joined: our record says we sync towards the round of ``epoch`` (``round``), so that its gate
        waits for us, ``ready_timeout`` at most (``wait_until_ready``): a joiner one round behind at every gate
        (a catch-up outlasting the others' round at short H) averaged no round at all."""
        if not self.overlapped and self.progress.record.joined and self.progress.record.round != epoch:
            await self.progress.publish(round=epoch, ready=False)

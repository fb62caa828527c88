"""Healing: a peer whose outer weights are not the swarm's takes the swarm's state, and goes on from there.

A peer is off the swarm's state when it is behind (a newcomer, a restart from an old checkpoint, a straggler) or
when its weights left the swarm's (a failed round, a refused average, a reducer that died mid-all-reduce). It then
downloads the state the swarm agrees on (``state.target.swarm_target``: the epoch by quorum, the hash most of its
peers hold) from peers that hold it (``state/state_sync.py``).

Where the peers' records are read decides what "the swarm's state" means:

- at the round gate (``Healing.catch_up``), the state the swarm holds now;
- after a failed round, the state the *other* peers end that round with (``Healing.round_end`` waits for them;
  with two peers our own un-stepped record would otherwise make us our own target); a solo step follows only if
  they have none;
- after a partial round, or one whose group held only some of the round's peers (they split into groups), the state
  the round's peers end it with, ours included: each may hold one of its own, and all must pick the same (judged
  by the others alone, two members could each wait for the other's, seen in CI).

A sync that fails tells which claims did not hold (``after_failed_sync``): they stop counting towards the target.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..averaging.averager import RoundAverager
from ..config import AveragingConfig
from ..observe.events import EventLog
from ..state.state_sync import StateSync
from ..state.target import Target, swarm_target
from ..swarm.progress import SwarmProgress
from ..swarm.progress_record import ProgressRecord
from ..training.outer_optimizer import OuterOptimizer
from ..training.trainer import Trainer

logger = logging.getLogger("diloco_peer")

LIFE_HEARTBEATS = 4
"""Heartbeats a record of a peer that died still counts: it expires after 3, and a gate counts it one more
(``SwarmProgress.swarm_records``)."""
RETRIES_WHEN_THE_SWARM_MOVED_ON = 3
"""Syncs again in a row when the swarm stepped while we downloaded (each takes the rounds' updates, not the whole
state, where the donors logged them: ``averaging/round_log.py``)."""


class Healing:
    """Takes the swarm's state when ours is not it.

    :param cfg: the ``[averaging]`` section (``ready_timeout`` and ``heartbeat`` bound the waits for the others)
    :param lag: the schedule's lag (``schedule.py``): 0 in blocking rounds, 1 in overlapped ones, where a peer at
      outer epoch e trains round e + 1
    :param inner_steps: H, for the inner LR-schedule position a synced state implies
    :param name: this peer's name, in the event log
    """

    def __init__(self, cfg: AveragingConfig, lag: int, inner_steps: int, name: str, *, trainer: Trainer,
                 outer: OuterOptimizer, averager: RoundAverager, progress: SwarmProgress, sync: StateSync,
                 events: EventLog, should_stop: Callable[[], bool]):
        self.cfg = cfg
        self.lag = lag
        self.inner_steps = inner_steps
        self.name = name
        self.trainer = trainer
        self.outer = outer
        self.averager = averager
        self.progress = progress
        self.sync = sync
        self.events = events
        self.should_stop = should_stop
        self.last_sync_epoch = -1
        """The outer epoch our last state sync brought us to."""
        self.downloads = 0
        """State downloads begun (``catch_up``)."""

    async def round_end(self, epoch: int, extra: float = 0.0, ready_only: bool = False,
                        everyone: bool = False) -> list[ProgressRecord]:
        """The swarm's records once the others have ended round ``epoch`` (``ready_timeout + extra`` at most;
        ``ready_only``, ``everyone``: see ``wait_for_round_end``)."""
        return await self.progress.wait_for_round_end(epoch, self.cfg.ready_timeout + extra, self.should_stop,
                                                      ready_only=ready_only, everyone=everyone)

    async def after_failed_round(self, epoch: int) -> bool:
        """Our round ``epoch`` ended without an average to step with (or off the swarm's weights): take the state the
        other peers end it with, if it is not ours. True if we did. A peer that died mid-round stops counting when
        its record stops counting, after 4 heartbeats (``LIFE_HEARTBEATS``)."""
        records = await self.round_end(epoch, extra=LIFE_HEARTBEATS * self.cfg.heartbeat, ready_only=True)
        own = self.progress.record.peer_id
        return await self.catch_up([r for r in records if r.peer_id != own], sending=True)

    async def recheck_after_round(self, epoch: int) -> bool:
        """Round ``epoch`` may have left our weights off the swarm's (part of our vector was not averaged, or our
        group held only some of the round's peers): once the others have stepped, take the state most of them hold,
        ours as it is now included, if it is not ours. True if we did."""
        # every peer that averaged this round (ready at its epoch until it steps), one that died mid-round until
        # its record stops counting (``LIFE_HEARTBEATS``)
        records = await self.round_end(epoch, extra=LIFE_HEARTBEATS * self.cfg.heartbeat, ready_only=True,
                                       everyone=True)
        own = self.progress.record.peer_id
        records = [r for r in records if r.peer_id != own]
        records.append(self.progress.record.copy(update={"epoch": self.outer.epoch,
                                                         "state_hash": self.sync.state_hash}))
        return await self.catch_up(records, sending=True)

    async def catch_up(self, records: list[ProgressRecord], sending: bool = False) -> bool:
        """If the swarm is ahead of us or our weights differ from its, download its state. True if we did.
        ``sending``: the next pseudo-gradient we send is the synced epoch's (a round's end: blocking, the round we
        train next; overlapped, the progress we made meanwhile, put on top of the synced weights: a rebase), so our
        record says we are in that epoch's round and its gate waits for us. Else (at start) overlapped peers first
        train the round after it, which the swarm trains while it averages the synced epoch's.

        Until we hold the swarm's state (synced, or nothing to sync) our epoch does not vote on the swarm's
        (``quorum.quorum_epoch``): a newcomer or a peer restarted from an old checkpoint knows nothing of it.
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
        result = await self._download(target)
        self.events.write("sync", peer=self.name, reason=why, donor=result.donor, epoch=result.epoch,
                          seconds=result.seconds, bytes=result.bytes, attempts=result.attempts, ok=result.ok,
                          error=result.error, donor_errors=result.donor_errors, rounds=result.rounds,
                          stages=result.stages)
        if not result.ok:
            logger.warning(f"state sync failed ({result.error}); will try again at the next round")
            await self.heading_for(self.outer.epoch)
            if not self.should_stop():
                await self.after_failed_sync(target, result)
            return False
        # the inner LR-schedule position: the round after the synced epoch (overlapped: the round after that,
        # which the swarm trains while it averages the synced epoch's)
        self.trainer.step = (self.outer.epoch + self.lag) * self.inner_steps
        next_round = self.outer.epoch + (self.lag if not sending else 0)
        self.last_sync_epoch = self.outer.epoch
        # the error-feedback residual stays: it holds our training that no average took in yet, as valid a step from
        # the synced weights as from ours (a sparse codec's holds most of it)
        await self.progress.publish(epoch=self.outer.epoch, round=next_round, inner_step=self.trainer.step,
                                    ready=False, state_hash=self.sync.state_hash, joined=True)
        logger.info(f"state sync: now at epoch {self.outer.epoch} ({result.summary()})")
        return True

    async def _download(self, target: Target):
        """Sync to ``target``, and again (a few times) where the swarm stepped on meanwhile; the ``SyncResult``."""
        await self.heading_for(target.epoch)
        result = await self.sync.sync(target, self.should_stop)
        for _ in range(RETRIES_WHEN_THE_SWARM_MOVED_ON):
            if not (result.moved_on or result.ok) or self.should_stop() or not self.sync.needs_sync(
                    target := swarm_target(await self.progress.swarm_records())):
                break
            await self.heading_for(target.epoch)
            retry = await self.sync.sync(target, self.should_stop, reuse=result, count=False)
            if result.ok and not retry.ok:
                break  # we hold the state the first one brought: the next gate tries again
            result = retry.after(result)
        return result

    async def heading_for(self, epoch: int) -> None:
        """Blocking, joined: our record says we sync towards the round of ``epoch`` (``round``), so that its gate
        waits for us, ``ready_timeout`` at most (``wait_until_ready``): a joiner one round behind at every gate
        (a catch-up outlasting the others' round at short H) averaged no round at all. (Overlapped gates wait for
        the round a record trains, which a sync sets.)"""
        if self.lag == 0 and self.progress.record.joined and self.progress.record.round != epoch:
            await self.progress.publish(round=epoch, ready=False)

    async def after_failed_sync(self, target: Target, result) -> None:
        """After a failed sync to ``target`` (``result``: a ``state_sync.SyncResult``): stop counting the claims that
        did not hold, and join the swarm the other records describe if we hold its state. A lie (a peer that claims
        a state it cannot serve) then neither keeps us from joining nor stays the target; every peer finds that out
        for itself, with one failed sync."""
        progress = self.progress
        for donor in set(result.rejected):  # served another epoch or state than it publishes: for good
            progress.distrust(donor, target.epoch, target.state_hash)
        others = [p for p in target.holders if p != progress.record.peer_id]
        if not progress.record.joined and len(others) == 1 and not result.rejected and not result.moved_on:
            # a claim nobody else confirms and its one holder did not serve, while we look for the swarm to join:
            # maybe the network, maybe a lie (once joined, we simply try again at the next round)
            progress.distrust(others[0], target.epoch, target.state_hash, 2 * self.cfg.ready_timeout)
        if not progress.record.joined and not self.sync.needs_sync(swarm_target(await progress.swarm_records())):
            logger.warning(f"state sync: the state of epoch {target.epoch} that {len(others)} peer(s) claim could "
                           f"not be had; joining the swarm the other peers describe")
            await progress.publish(joined=True)

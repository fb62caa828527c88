"""Schedules: when a round's exchange runs against the inner steps, and what the replica trains from meanwhile.

``Blocking`` is DiLoCo's round (and OpenDiLoCo's): H inner steps from the outer weights, then the exchange,
awaited at once; the replica restarts from the new outer weights.

``Overlapped`` launches round t's exchange and goes straight on training round t+1; the exchange is concluded at
the end of round t+1. Meanwhile the replica trains from the outer weights plus a stand-in for the average in
flight (``training.outer_optimizer.overlap_offset``): the ``eager`` correction, the outer step this peer predicts
from its own fresh pseudo-gradient (Kale et al. 2025's eager updates); the ``delayed`` one, its own progress as it
is (DiLoCoX's one-step delay). With ``outer.apply_on_arrival`` the average replaces the stand-in as soon as it
arrives (``arrival.py``). The outer weights of peers that averaged together stay bit-identical either way;
``diloco-peer simulate --overlap eager`` computes the same updates.

A schedule's ``lag`` is the one number the rest of the round needs from it: a peer at outer epoch e trains round
e + ``lag`` (0 blocking, 1 overlapped). Records carry it (``round``), the gate waits for the peers of our round by
it, and a synced or resumed state puts the inner LR schedule at ``(epoch + lag) * H``.

A schedule drives one round (``round``) with the ``OuterRounds`` that runs it, ``r``: its components and its
shared steps (``r.train``, ``r.launch``, ``r.conclude``).
"""

from __future__ import annotations

import torch

from ..config import OuterConfig
from ..state.target import swarm_target
from ..swarm.progress_record import ProgressRecord
from ..training.outer_optimizer import evaluate_outer, overlap_offset, progress_since, replica_copy
from .arrival import EarlyAverage
from .record import RoundRecord


class Blocking:
    """Train, exchange, conclude: nothing overlaps the exchange."""

    lag = 0
    arrival = None
    """No average arrives while a blocking round trains."""

    async def round(self, r) -> RoundRecord | None:
        inner = await r.train(r.outer.epoch)
        if r.should_stop():
            return None
        await r.launch(r.outer.pseudo_gradient, inner)
        return await r.conclude(inner, unsent=None)

    async def at_gate(self, r, records: list[ProgressRecord]) -> tuple[bool, str]:
        """Behind or off the swarm's weights, our pseudo-gradient is relative to a state nobody holds: we sync to the
        swarm's state instead of averaging (the round is dropped)."""
        return await r.healing.catch_up(records), ""

    async def after_step(self, r, unsent: None) -> None:
        """The new epoch goes into our record at once: the next round's gates read it."""
        await r.publish_step()

    async def after_sync(self, r, unsent: None) -> None:
        """The replica holds the synced outer weights: nothing to add."""

    async def evaluate(self, r) -> float:
        return await r.compute.run(r.trainer.evaluate)


class Overlapped:
    """Round t's exchange runs while round t+1 trains; concluded at the end of round t+1.

    :param cfg: the ``[outer]`` section: ``overlap`` (``eager`` or ``delayed``: the correction the replica trains
      with while the average is in flight) and ``apply_on_arrival``
    :param arrival: applies the average in flight as soon as it arrives (``arrival.py``); None: at the round's end
    """

    lag = 1

    def __init__(self, cfg: OuterConfig, arrival: EarlyAverage | None):
        self.correction = cfg.overlap
        self.arrival = arrival

    async def round(self, r) -> RoundRecord | None:
        start = await r.compute.run(replica_copy, r.trainer.model)
        inner = await r.train(r.trainer.step // r.inner_steps, start)
        if r.should_stop():
            return None
        unsent = await r.compute.run(progress_since, r.trainer.model, start)
        if r.exchange.pending is None:  # the first round after starting or syncing: nothing to conclude yet
            await self._first_round(r, unsent)
            record = None
        else:
            record = await r.conclude(inner, unsent)
            if record is not None:
                record.overlap_wait_seconds = r.exchange.waited
        await r.launch(lambda: [-d for d in unsent], inner)  # start - end, like ``outer - replica``
        return record

    async def _first_round(self, r, unsent: list[torch.Tensor]) -> None:
        if r.healing.last_sync_epoch == r.outer.epoch:  # synced into a running swarm, in the middle of a round: take
            records = await r.healing.round_end(r.outer.epoch)  # its result, our progress on top
            if await r.healing.catch_up(records, sending=True):
                await self.after_sync(r, unsent)
        else:
            await self.after_step(r, unsent)  # a fresh start: nothing to apply yet

    async def at_gate(self, r, records: list[ProgressRecord]) -> tuple[bool, str]:
        """Our progress is a fair contribution (it is relative to where we started), but the outer weights it would
        be applied to may not be the swarm's: then the round's end takes the swarm's state instead of stepping."""
        return False, r.sync.needs_sync(swarm_target(records))

    async def after_step(self, r, unsent: list[torch.Tensor]) -> None:
        """The replica goes on from the new outer weights plus the stand-in for what is not averaged yet."""
        await r.compute.run(self._continue, r.outer, r.trainer.model, unsent)

    async def after_sync(self, r, unsent: list[torch.Tensor]) -> None:
        """A rebase: our unsent progress goes on top of the synced outer weights, as after a step."""
        await self.after_step(r, unsent)

    async def evaluate(self, r) -> float:
        """The outer weights' loss (the replica holds them plus the unsent progress)."""
        return await r.compute.run(evaluate_outer, r.outer, r.trainer.evaluate)

    def _continue(self, outer, model: torch.nn.Module, unsent: list[torch.Tensor]) -> None:
        on_top = overlap_offset(outer, self.correction, unsent)
        with torch.no_grad():
            for p, o, d in zip(model.parameters(), outer.params, on_top):
                p.copy_((o + d).to(p.device, p.dtype))


def schedule_for(cfg: OuterConfig, arrival: EarlyAverage) -> Blocking | Overlapped:
    """The schedule ``outer.overlap`` names; ``arrival`` is used where ``outer.apply_on_arrival`` asks for it."""
    if cfg.overlap == "blocking":
        return Blocking()
    return Overlapped(cfg, arrival if cfg.apply_on_arrival else None)

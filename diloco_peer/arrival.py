"""Overlapped rounds: the last round's average reaches the replica as soon as it arrives, not a round later.

Round t's exchange runs while round t+1 trains from the outer weights plus a stand-in for its average
(``training.outer_optimizer.overlap_offset``). ``outer_round.OuterRounds`` asks ``EarlyAverage.due`` between
inner steps; once the exchange is done, ``apply`` checks its outcome as the round's end will, and if it is clean
moves the replica onto where the average puts it (``correct_on_arrival``), keeping the progress made since. The
outer step, epoch, state hash, records and checkpoints stay at the round's end, unchanged: a stand-in that lives
for d inner steps instead of H is the only difference. Any other outcome (failed, refused, partial, off the
swarm's weights) is left to the round's end, which handles it as it always did.
"""

from __future__ import annotations

import asyncio

import torch

from .averaging.robust_aggregation import refuse_update
from .config import PeerConfig
from .config.faults import Faults
from .round_record import Exchange
from .training.outer_optimizer import OuterOptimizer, correct_on_arrival


class EarlyAverage:
    """Applies the pending exchange's average to the replica mid-round (``outer.apply_on_arrival``).

    :param cfg: the config tree (``outer.apply_on_arrival``, ``averaging.max_update_ratio``)
    :param outer: the outer optimizer (its weights and momentum are read, never changed here)
    :param faults: the fault injection (``refuse_round`` refuses an average here as at the round's end)
    """

    def __init__(self, cfg: PeerConfig, outer: OuterOptimizer, faults: Faults):
        self.enabled = cfg.outer.apply_on_arrival and cfg.outer.overlap != "blocking"
        self.max_ratio = cfg.averaging.max_update_ratio
        self.outer, self.faults = outer, faults
        self.task: asyncio.Task | None = None
        self.looked = False
        self.step: int | None = None
        """The inner step of the round at which ``task``'s average reached the replica (None: not mid-round)."""

    def watch(self, task: asyncio.Task) -> None:
        """``task`` (the exchange just launched) is the one to look for from now on."""
        self.task, self.looked, self.step = task, False, None

    def due(self) -> bool:
        """True once the watched exchange is done and not looked at yet (safe to ask from the compute thread)."""
        return self.enabled and not self.looked and self.task is not None and self.task.done()

    def apply(self, start: list[torch.Tensor], inner_step: int) -> bool:
        """On the compute thread: if the done exchange's outcome is clean, move the replica onto where its average
        puts it (``start``, the round's start, becomes that point) and remember ``inner_step``. True if it did."""
        self.looked = True
        if self.task.cancelled() or self.task.exception() is not None or not self.clean(self.task.result()):
            return False
        correct_on_arrival(self.outer, self.task.result().result.averaged, start)
        self.step = inner_step
        return True

    def clean(self, exchange: Exchange) -> bool:
        """Whether the round's end would apply this average as it is (``OuterRounds._conclude``'s checks)."""
        result = exchange.result
        return (result.ok and not exchange.dropped and not exchange.off_swarm and not result.values_not_averaged
                and not refuse_update(result.averaged, result.sent_norm, self.max_ratio)
                and not self.faults.refuses_average(self.outer.epoch + 1))

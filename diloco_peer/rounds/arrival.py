"""Overlapped rounds: the last round's average reaches the replica as soon as it arrives, not a round later.

Round t's exchange runs while round t+1 trains from the outer weights plus a stand-in for its average
(``training.outer_optimizer.overlap_offset``). The training loop (``OuterRounds.train``) asks ``EarlyAverage.due``
between inner steps; once the exchange is done, ``apply`` asks ``outcome.decide`` what the round's end will make of
it, and if the verdict is clean moves the replica onto where the average puts it (``correct_on_arrival``), keeping
the progress made since. The outer step, epoch, state hash, records and checkpoints stay at the round's end,
unchanged: a stand-in that lives for d inner steps instead of H is the only difference. Any other verdict (failed,
refused, partial, off the swarm's weights) is left to the round's end, which handles it as it always did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from ..config.faults import Faults
from ..training.outer_optimizer import OuterOptimizer, correct_on_arrival
from .outcome import decide


class EarlyAverage:
    """Applies the pending exchange's average to the replica mid-round (``outer.apply_on_arrival``).

    :param outer: the outer optimizer (its weights and momentum are read, never changed here)
    :param max_update_ratio: the bound of the average's norm, as the round's end checks it (a function of the
      pending pseudo-gradient: ``OuterRounds._update_ratio``)
    :param faults: the fault injection (``refuse_round`` refuses an average here as at the round's end)
    """

    def __init__(self, outer: OuterOptimizer, max_update_ratio: Callable[[], float], faults: Faults):
        self.outer = outer
        self.max_update_ratio = max_update_ratio
        self.faults = faults
        self.task: asyncio.Task | None = None
        self.looked = False
        self.step: int | None = None
        """The inner step of the round at which ``task``'s average reached the replica (None: not mid-round)."""

    def watch(self, task: asyncio.Task) -> None:
        """``task`` (the exchange just launched) is the one to look for from now on."""
        self.task, self.looked, self.step = task, False, None

    def due(self) -> bool:
        """True once the watched exchange is done and not looked at yet (safe to ask from the compute thread)."""
        return not self.looked and self.task is not None and self.task.done()

    def apply(self, start: list[torch.Tensor], inner_step: int) -> bool:
        """On the compute thread: if the round's end will apply the done exchange's average as it is, move the
        replica onto where it puts it (``start``, the round's start, becomes that point) and remember
        ``inner_step``. True if it did."""
        self.looked = True
        if self.task.cancelled() or self.task.exception() is not None:
            return False
        exchange = self.task.result()
        if exchange.dropped or not decide(exchange, self.outer.epoch, self.max_update_ratio(), self.faults).clean:
            return False
        correct_on_arrival(self.outer, exchange.result.averaged, start)
        self.step = inner_step
        return True

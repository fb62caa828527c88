"""What one state sync did: whether it took a state and from whom, its bytes, its donors' failures, and where its
time went (``SyncResult``, returned by ``StateSync.sync``, logged by the daemon and kept in the event log)."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field


@dataclass
class SyncResult:
    ok: bool
    donor: str = ""
    epoch: int = -1
    seconds: float = 0.0
    bytes: int = 0
    attempts: int = 0
    error: str = ""
    donor_errors: list[str] = field(default_factory=list)
    """Why each donor that was tried failed, in order (a later donor may still have succeeded)."""
    rejected: list[str] = field(default_factory=list)
    """Donors (peer ids) whose state failed the checks: what they publish does not hold."""
    rounds: int = 0
    """Rounds caught up with the updates a donor logged, instead of downloading the state (``round_log``)."""
    moved_on: bool = False
    """A donor sent a later epoch than the target: the swarm stepped on while we looked (ask for a new target)."""
    later: tuple | None = field(default=None, repr=False)
    """That later state, if sound: (donor, metadata, tensors). ``sync(reuse=this result)`` makes it ours if it is
    what the swarm's new target names, instead of downloading it again."""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each stage: ``rounds`` (fetching and replaying logged updates, ``round_log.replay``),
    ``download``, ``check`` (shapes, finite values, hashes) and ``load`` (into the outer weights and the replica).
    At GB scale they say where a sync's time goes (BENCHMARKS.md, "Where a state sync's time goes")."""

    def summary(self) -> str:
        """What came from where, and how long each stage took (a state taken as kept ran none)."""
        stages = "".join(f", {stage} {seconds:.2f}s" for stage, seconds in self.stages.items())
        return f"{self.bytes / 1e6:.2f} MB from {self.donor[-8:]} in {self.seconds:.2f}s{stages}"

    def after(self, earlier: "SyncResult") -> "SyncResult":
        """This retry with an ``earlier`` attempt's cost and donor errors added: one record of the whole sync."""
        for stage, seconds in earlier.stages.items():
            self.stages[stage] = round(self.stages.get(stage, 0.0) + seconds, 3)
        self.seconds += earlier.seconds
        self.bytes += earlier.bytes
        self.attempts += earlier.attempts
        self.rounds += earlier.rounds
        self.donor_errors[:0] = earlier.donor_errors
        self.rejected[:0] = earlier.rejected
        return self


async def timed(result: SyncResult, stage: str, work: Awaitable):
    """``await work``, its seconds added to ``result.stages[stage]`` (also when it fails)."""
    started = time.perf_counter()
    try:
        return await work
    finally:
        result.stages[stage] = round(result.stages.get(stage, 0.0) + time.perf_counter() - started, 3)

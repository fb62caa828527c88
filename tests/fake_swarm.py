"""An in-process swarm for the round's unit tests: real ``OuterRounds`` (its schedules, gate logic, verdicts and
healing), fakes only where a real peer talks to other processes.

- ``Board``: the DHT's progress records, a dict. ``BoardProgress`` is the real ``SwarmProgress`` (its round gate,
  ``wait_for_round_end``, bans and trust) publishing to and reading from it, polling in milliseconds.
- ``Hub``: matchmaking and the all-reduce. The peers that average an epoch form one group once as many as the gate
  expected have come (or a short wait ran out); each gets the token-weighted mean, exactly. A script makes a
  member's all-reduce fail (``"fail"``) or leaves part of its vector un-averaged (``"partial"``).
- ``HubSync``: a state sync copies a holder's outer state (weights, momentum, epoch) as a download would.
- ``PullTrainer``: a replica (one linear layer) whose inner steps pull its weights towards a target of its own, so
  that peers' pseudo-gradients differ and every number is known in advance.

torchft tests its DiLoCo the same way, in-process with a mocked manager; the real-swarm tests stay for end to end.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_peer.averaging.averager import RoundResult
from diloco_peer.config import AveragingConfig, OuterConfig
from diloco_peer.config.faults import NO_FAULTS, Faults
from diloco_peer.observe.events import EventLog
from diloco_peer.rounds.outer_rounds import OuterRounds
from diloco_peer.state.state_sync import StateSync, SyncResult
from diloco_peer.swarm.progress import SwarmProgress
from diloco_peer.swarm.progress_record import ProgressRecord
from diloco_peer.training.model import param_sha256
from diloco_peer.training.outer_optimizer import OuterOptimizer
from diloco_peer.training.trainer import InnerStats, Trainer

TOKENS_PER_STEP = 100


class Board:
    """The progress records every peer sees (the DHT's ``{run_id}_progress`` key)."""

    def __init__(self):
        self.records: dict[str, ProgressRecord] = {}


class BoardProgress(SwarmProgress):
    """``SwarmProgress`` with the board for a DHT: the real gate, fast polls."""

    POLL_SECONDS = 0.005
    FAST_POLL_SECONDS = 0.001

    def __init__(self, board: Board, peer_id: str):  # (no DHT: none of SwarmProgress.__init__ applies)
        self.board, self.faults, self.heartbeat = board, NO_FAULTS, 1.0
        self.record = ProgressRecord(peer_id=peer_id, epoch=0, inner_step=0, tokens=0, ready=False, joined=False,
                                     time=time.time())
        self._banned, self._distrusted, self._suspects = {}, {}, {}
        self.present, self.stats_provider, self.nudged = 1, None, None

    async def _store(self, value) -> None:
        self.board.records[self.record.peer_id] = self.record

    async def swarm_records(self) -> list[ProgressRecord]:
        others = [r for p, r in self.board.records.items() if p != self.record.peer_id]
        self.present = 1 + len(others)
        return self.trusted(others) + [self.record]


@dataclass
class Hub:
    """One group per epoch: the token-weighted mean of what its members send."""

    script: dict[tuple[int, str], str] = field(default_factory=dict)
    """(epoch, peer name) -> "fail" (its all-reduce fails), "partial" (half its vector keeps its own values),
    "group:NAME" (it averages in a group of that name, apart from the others: a split) or "late:SECONDS" (its
    all-reduce ends that much after the others', as on a loaded machine)."""
    means: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """The group's mean of each epoch, as computed."""
    wait: float = 0.5
    """Seconds a group waits for the members the gate expected."""
    _sent: dict[tuple[int, str], dict[str, tuple[list[torch.Tensor], float]]] = field(default_factory=dict)

    async def average(self, name: str, tensors: list[torch.Tensor], weight: float, epoch: int,
                      expected: int | None) -> RoundResult:
        tag = self.script.get((epoch, name), "")
        group = self._sent.setdefault((epoch, tag if tag.startswith("group:") else ""), {})
        group[name] = ([t.clone() for t in tensors], weight)
        deadline = time.monotonic() + self.wait
        while len(group) < (expected or 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.002)  # the members that came meanwhile are in too
        if len(group) < 2 or self.script.get((epoch, name)) == "fail":
            return RoundResult(ok=False, error="no other peer joined the group" if len(group) < 2 else "scripted")
        total = sum(w for _, w in group.values())
        mean = [sum(ts[i] * (w / total) for ts, w in group.values()) for i in range(len(tensors))]
        if not tag.startswith("group:"):
            self.means.setdefault(epoch, mean)
        averaged, lost = [m.clone() for m in mean], 0
        if self.script.get((epoch, name)) == "partial":  # a reducer died: its span keeps our own values
            averaged[0] = tensors[0].clone()
            lost = tensors[0].numel()
        if tag.startswith("late:"):
            await asyncio.sleep(float(tag.removeprefix("late:")))
        return RoundResult(ok=True, averaged=averaged, group_size=len(group), group_epochs=[epoch] * len(group),
                           sent_norm=float(torch.cat([t.flatten() for t in tensors]).norm()), values_not_averaged=lost)


class HubAverager:
    """A peer's averager: what ``OuterRounds`` calls of ``RoundAverager``."""

    in_place = False

    def __init__(self, hub: Hub, name: str, faults: Faults = NO_FAULTS):
        self.hub, self.name, self.faults = hub, name, faults
        self.failed_rounds = 0

    async def average(self, pseudo_gradient, weight, epoch, expected=None, nudge=(),
                      step_seconds=None) -> RoundResult:
        return await self.hub.average(self.name, pseudo_gradient, weight, epoch, expected)

    def round_failed(self) -> None:
        self.failed_rounds += 1

    def release(self) -> None:
        pass

    def reset_feedback(self) -> None:
        pass


class HubSync:
    """A peer's state sync: a download is a copy of a holder's outer state."""

    needs_sync = StateSync.needs_sync  # the real rule: behind, or other weights at our epoch

    def __init__(self, outer: OuterOptimizer, peers: dict[str, Peer]):
        self.outer, self.peers = outer, peers
        self.lock = threading.Lock()
        self.syncs = 0
        self.after_outer_step()

    def after_outer_step(self) -> None:
        self.state_hash = f"{self.outer.epoch}:{param_sha256([*self.outer.params, *self.outer.momentum_views])}"

    async def sync(self, target, should_stop=lambda: False, reuse=None, count=True) -> SyncResult:
        donor = next((p for p in self.peers.values() if p.progress.record.peer_id in target.holders
                      and p.sync is not self), None)
        if donor is None:
            return SyncResult(ok=False, error="no holder serves it")
        if donor.sync.state_hash != target.state_hash:  # it stepped since it published: ask for a new target
            return SyncResult(ok=False, error="the donor moved on", moved_on=donor.outer.epoch > target.epoch)
        source = donor.outer
        self.outer.load_state([p.detach().clone() for p in source.params], source.momentum_buffers(), source.epoch)
        self.after_outer_step()
        self.syncs += 1
        return SyncResult(ok=True, donor=donor.progress.record.peer_id, epoch=source.epoch, attempts=1)


class PullTrainer:
    """Inner steps that move the replica a tenth of the way to ``target`` each (SGD on a quadratic, in effect), each
    taking ``step_seconds`` (asleep: the peers' compute threads run side by side), or ``step_seconds(step)`` where it
    is a function of the LR-schedule step (a device whose speed changes). ``highest``: the furthest LR position any
    step trained at."""

    def __init__(self, target: float, step_seconds: float | Callable[[int], float] = 0.0, shape=(4, 3)):
        self.model = torch.nn.Linear(shape[1], shape[0])
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(0.0)
        self.target, self.step_seconds, self.device = target, step_seconds, torch.device("cpu")
        self.position, self.stride, self.highest = 0.0, 1.0, 0.0

    step = Trainer.step  # the LR-schedule position, as the real trainer keeps it

    def train_steps(self, num_steps: int, should_stop=lambda: False) -> InnerStats:
        started, done = time.perf_counter(), 0
        for _ in range(num_steps):
            if should_stop():
                break
            time.sleep(self.step_seconds(self.step) if callable(self.step_seconds) else self.step_seconds)
            self.highest = max(self.highest, self.position)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.sub_(0.1 * (p - self.target))
            self.position += self.stride
            done += 1
        seconds = max(time.perf_counter() - started, 1e-6 * done)
        return InnerStats(done, done * TOKENS_PER_STEP, self.evaluate(), seconds, self.current_lr())

    @torch.no_grad()
    def evaluate(self) -> float:
        return float(sum(((p - 1.0) ** 2).sum() for p in self.model.parameters()))

    def current_lr(self) -> float:
        return 0.1


class ThreadCompute:
    """The compute thread: every call runs in a thread, so that the event loop (the exchange in flight, the other
    peers) goes on meanwhile."""

    async def run(self, fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)


@dataclass
class Peer:
    name: str
    rounds: OuterRounds
    joins_at: int = 0
    """Starts once another peer's outer epoch reached this."""
    records: list = field(default_factory=list)

    @property
    def outer(self) -> OuterOptimizer:
        return self.rounds.outer

    @property
    def progress(self) -> BoardProgress:
        return self.rounds.progress

    @property
    def sync(self) -> HubSync:
        return self.rounds.sync


class FakeSwarm:
    """Peers that share a board and a hub; ``run(rounds)`` runs them all concurrently for that many outer rounds."""

    def __init__(self, tmp: Path, outer: OuterConfig, averaging: AveragingConfig | None = None):
        self.tmp, self.outer_cfg = tmp, outer
        # (no norm check here: a peer whose replica reached its own target sends ~0, and the mean is 10x that; the
        # verdict's own tests check the norm)
        self.averaging = averaging or AveragingConfig(ready_timeout=2.0, heartbeat=0.05, max_update_ratio=0.0)
        self.board, self.hub = Board(), Hub()
        self.peers: dict[str, Peer] = {}

    def add(self, name: str, target: float, faults: Faults = NO_FAULTS, joins_at: int = 0,
            step_seconds: float | Callable[[int], float] = 0.0) -> Peer:
        trainer = PullTrainer(target, step_seconds)
        outer = OuterOptimizer(trainer.model, self.outer_cfg)
        rounds = OuterRounds(self.outer_cfg, self.averaging, 0, name, trainer=trainer, outer=outer,
                             averager=HubAverager(self.hub, name, faults), progress=BoardProgress(self.board, name),
                             sync=HubSync(outer, self.peers), events=EventLog(self.tmp / f"{name}.jsonl"),
                             compute=ThreadCompute(), should_stop=lambda: False)
        peer = self.peers[name] = Peer(name, rounds, joins_at)
        return peer

    def run(self, rounds: int, timeout: float = 20.0) -> None:
        """Every peer runs until its outer epoch reaches ``rounds`` (records in ``peer.records``), as the daemon
        runs it: publish, catch up with the swarm, rounds."""
        async def one(peer: Peer) -> None:
            while peer.joins_at and max(p.outer.epoch for p in self.peers.values()) < peer.joins_at:
                await asyncio.sleep(0.001)
            peer.rounds.max_rounds = rounds
            await peer.progress.publish(epoch=peer.outer.epoch, round=peer.outer.epoch,
                                        state_hash=peer.sync.state_hash)
            await peer.rounds.catch_up(await peer.progress.swarm_records())
            await peer.rounds.run(peer.records.append)

        async def main() -> None:
            for peer in self.peers.values():  # the founders' records are there before anyone's first gate
                if not peer.joins_at:
                    await peer.progress.publish(epoch=0, round=0, state_hash=peer.sync.state_hash)
            await asyncio.wait_for(asyncio.gather(*(one(p) for p in self.peers.values())), timeout)

        asyncio.run(main())

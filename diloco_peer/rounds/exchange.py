"""A round's exchange: publish "ready", wait at the round gate, then all-reduce the pseudo-gradient with the peers
that are ready, weighted by the tokens behind it.

The schedule launches the exchange as an asyncio task (``RoundExchange.launch``) and the round's end collects it:
at once in blocking rounds, a round later in overlapped ones, which train the next round meanwhile. What the gate's
records mean for us (sync at once, or note that our outer weights are off the swarm's) is the schedule's call
(``Blocking.at_gate`` or ``Overlapped.at_gate``, ``schedule.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from ..averaging.averager import RoundAverager, RoundResult
from ..config import AveragingConfig
from ..observe.events import EventLog
from ..state.state_sync import StateSync
from ..swarm.dht_role import DhtRole
from ..swarm.progress import ALL_READY, ReadyDecision, SwarmProgress
from ..swarm.progress_record import ProgressRecord
from ..training.outer_optimizer import OuterOptimizer, scaled
from ..training.trainer import ComputeThread
from .healing import Healing
from .outcome import Exchange

logger = logging.getLogger("diloco_peer")

GateVerdict = Callable[[list[ProgressRecord]], Awaitable[tuple[bool, str]]]
"""What a schedule makes of the gate's records (``Blocking.at_gate`` or ``Overlapped.at_gate``): (the round is
dropped, why our outer weights are off the swarm's or "")."""


class RoundExchange:
    """The exchange of one round at a time: launched, then collected by the round's end.

    :param cfg: the ``[averaging]`` section (the gate's ``min_peers`` and timeouts, ``start_when_complete``)
    :param lag: the schedule's lag: a record at outer epoch e sends round e + ``lag``'s pseudo-gradient
    :param at_gate: the schedule's reading of the gate's records (``GateVerdict``)
    :param too_slow: names a peer the gate need not wait for: it cannot be ready in time (``Pace.too_slow``)
    :param proxies: ``(records, epoch)`` -> the peers to hand our pseudo-gradient in to instead of joining the
      all-reduce, fastest first (``Pace.proxies``; none: we are not too slow for it)
    :param dht_role: told each round whether we handed in: our DHT node stops serving while we do (``DhtRole``)
    :param name: this peer's name, in the event log
    """

    def __init__(self, cfg: AveragingConfig, lag: int, at_gate: GateVerdict, name: str, *, too_slow=None,
                 proxies=None, dht_role: DhtRole | None = None, outer: OuterOptimizer,
                 averager: RoundAverager, progress: SwarmProgress, sync: StateSync, healing: Healing,
                 events: EventLog, compute: ComputeThread, should_stop: Callable[[], bool]):
        self.cfg = cfg
        self.lag = lag
        self.at_gate = at_gate
        self.too_slow = too_slow
        self.proxies = proxies
        self.dht_role = dht_role
        self.name = name
        self.outer = outer
        self.averager = averager
        self.progress = progress
        self.sync = sync
        self.healing = healing
        self.events = events
        self.compute = compute
        self.should_stop = should_stop
        self.pending: asyncio.Task | None = None
        """The exchange launched last, until the round's end collects it."""
        self.sent: list[torch.Tensor] = []
        """The pseudo-gradient ``pending`` averages (a solo step applies it if the all-reduce fails)."""
        self.scale = 1.0
        """What ``sent`` was multiplied by (``outer.contribution``)."""
        self.steps = 0
        """The inner steps behind ``sent`` (0: not said)."""
        self.waited = 0.0
        """Seconds the last ``collect`` waited for its exchange to end, less the time it handed in (``_hand_in``)."""
        self.handing_seconds = 0.0
        """Seconds the exchange launched last spent handing our pseudo-gradient in (``_hand_in``): our work."""
        self.handed_to = ""
        """The proxy the exchange launched last handed our pseudo-gradient in to ("": none; we were a member)."""
        self.ended_at: float | None = None
        """When (wall clock) the exchange collected last ended: in blocking rounds, where the round's next one begins
        as the others count it (``Pace.late``)."""
        self.records: list[ProgressRecord] = []
        """The swarm's records as the last gate saw them (the pace of rounds bounded by time is read from them)."""

    def launch(self, pseudo_gradient: list[torch.Tensor], tokens: int, inner_step: int, scale: float = 1.0,
               steps: int = 0) -> asyncio.Task:
        """Start exchanging ``pseudo_gradient`` (``tokens`` and ``steps`` inner steps behind it, already multiplied
        by ``scale``: ``outer.contribution``) for our outer epoch; the task."""
        self.sent = pseudo_gradient
        self.handing_seconds = 0.0
        self.handed_to = ""
        self.scale = scale
        self.steps = steps
        self.pending = asyncio.create_task(self._exchange(pseudo_gradient, tokens, self.outer.epoch, inner_step))
        return self.pending

    async def collect(self) -> Exchange:
        """The pending exchange's outcome (``waited``: how long we waited for it); a failure there is a lost round."""
        started = time.perf_counter()
        try:
            exchange = await self.pending
        except Exception as e:  # e.g. the DHT failed to store our record: never fatal
            exchange = Exchange(ReadyDecision(1, 1, 0.0, "error"), RoundResult(False, error=f"{type(e).__name__}: {e}"))
        self.pending = None
        self.ended_at = time.time()
        self.waited = max(0.0, time.perf_counter() - started - self.handing_seconds)
        return exchange

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()

    async def own_pseudo_gradient(self) -> list[torch.Tensor]:
        """Our pseudo-gradient of the round being concluded, for a solo step (or an all-reduce after a failed
        download): as sent, or, where the averager writes the average over what we sent (``in_place``: blocking
        rounds on a GPU, whose replica is untouched until the outer step), computed again from the replica and scaled
        as what was sent."""
        if not self.averager.in_place:
            return self.sent
        return await self.compute.run(scaled, self.outer.pseudo_gradient, self.scale)

    async def _exchange(self, pseudo_gradient: list[torch.Tensor], tokens: int, epoch: int,
                        inner_step: int) -> Exchange:
        cfg = self.cfg
        proxy = self.handed_to = await self._hand_in(pseudo_gradient, tokens, epoch)
        await self.progress.publish(epoch=epoch, round=epoch + self.lag, inner_step=inner_step, ready=True,
                                    state_hash=self.sync.state_hash, tokens=self.progress.record.tokens + tokens,
                                    hands_to=proxy)
        # (after our "ready": the others' gates need not wait for the switch)
        if self.dht_role is not None and await self.dht_role.round(handed_in=bool(proxy)):
            self.events.write("dht_role", peer=self.name, epoch=epoch, serving=self.dht_role.serving)
        decision = await self.progress.wait_until_ready(
            min_peers=cfg.min_peers if epoch == 0 else 1, min_peers_timeout=cfg.first_round_timeout,
            ready_timeout=cfg.ready_timeout, should_stop=self.should_stop, lag=self.lag, too_slow=self.too_slow)
        if self.should_stop():
            return Exchange(decision, RoundResult(ok=False, error=decision.reason), dropped=True)
        self.records = decision.records
        downloads = self.healing.downloads
        dropped, off_swarm = await self.at_gate(decision.records)
        if (dropped or decision.members < 2) and not proxy and self._handed_to_us(decision, epoch):
            await self.averager.no_all_reduce(epoch)
        if dropped:
            return Exchange(decision, RoundResult(ok=False), dropped=True)
        if self.healing.downloads != downloads and self.averager.in_place:  # a failed download took the buffer
            pseudo_gradient = self.sent = await self.own_pseudo_gradient()
        if proxy:  # its all-reduce has our pseudo-gradient in it: we get the average from it
            result = await self.averager.handed_back(proxy, epoch)
            # our work: sending what we handed in and receiving the average (not the wait for the proxy's round)
            self.handing_seconds = max(self.handing_seconds, result.transfer_seconds)
            return Exchange(decision, result, off_swarm=off_swarm)
        if decision.members < 2:
            return Exchange(decision, RoundResult(ok=False, error=decision.reason), off_swarm=off_swarm)
        self.events.write("averaging", peer=self.name, epoch=epoch, ready_peers=decision.ready)
        # once complete, the group starts at once; a gate that left stragglers behind expects the ready peers only
        # (else matchmaking waited its whole window for a peer that was alive and not coming)
        expected = (decision.expected if decision.reason == ALL_READY else decision.members) \
            if cfg.start_when_complete else None
        result = await self.averager.average(pseudo_gradient, weight=tokens, epoch=epoch, expected=expected,
                                             nudge=self._waiting(decision, epoch),
                                             step_seconds=self.progress.record.step_seconds)
        return Exchange(decision, result, off_swarm=off_swarm)

    async def _hand_in(self, pseudo_gradient: list[torch.Tensor], tokens: int, epoch: int) -> str:
        """Hand our pseudo-gradient in to a proxy if we are too slow for the all-reduce (``averaging/hand_in.py``;
        blocking rounds only): the proxy that took it, or "" (we join the all-reduce: not too slow, or no proxy took
        it). Its time counts as our round's work, not as waiting (``handing_seconds``): the pace budgets our
        training so that we are ready, handed in, when the others are."""
        started = time.perf_counter()
        candidates = self.proxies(self.records, epoch) if self.proxies is not None and not self.lag else []
        for proxy in candidates[:2]:
            why = await self.averager.hand_in(pseudo_gradient, tokens, epoch, proxy)
            if not why:
                self.events.write("handed_in", peer=self.name, epoch=epoch, proxy=proxy,
                                  seconds=round(time.perf_counter() - started, 3))
                self.handing_seconds = time.perf_counter() - started
                return proxy
            logger.info(f"{self.name}: {proxy[-8:]} did not take our hand-in for round {epoch}: {why}")
        self.handing_seconds = time.perf_counter() - started
        return ""

    def _handed_to_us(self, decision: ReadyDecision, epoch: int) -> bool:
        own = self.progress.record.peer_id
        return any(r.hands_to == own and r.epoch == epoch for r in decision.records)

    def _waiting(self, decision: ReadyDecision, epoch: int) -> list[str]:
        """Peers to tell that the round's last one is ready: all ready at our gate's first read (we came last)."""
        if decision.reads != 1 or decision.reason != ALL_READY:
            return []
        return [r.peer_id for r in decision.records
                if r.ready and r.epoch == epoch and r.peer_id != self.progress.record.peer_id]

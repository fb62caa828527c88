"""One outer round's all-reduce, as the daemon sees it: find a group through the DHT, average the pseudo-gradient.

``RoundAverager`` runs ``PseudoGradientAverager`` (``pseudo_gradient_averager.py``: hivemind's averager in its
own process, with exact results, checked numbers, admission and bans) and turns one round into a
``RoundResult``: the average, the group, the bytes moved and the offenses seen.

A round that cannot find a group or whose all-reduce fails returns ``ok=False`` with the reason; the
caller then takes a solo outer step. Nothing here raises into the training loop.

Memory: two buffers of the model's size in shared memory, made before the averager process forks: ``inputs``
(the pseudo-gradient we send: ``OuterOptimizer.pseudo_gradient`` writes it there, so no copy of it is made) and
the averager's own tensors, where the all-reduce writes the average (the result hands them out as they are).
Both give their memory back between rounds (``release``): 8 bytes per parameter during a round, none while
the replica trains; 4 where ``inputs`` is lent (the replica's memory, blocking rounds on a CPU) or where the
average is written over what we sent (``in_place``: blocking rounds on a GPU).

A round that fails, or whose average we refuse, falls back on a solo step with our own pseudo-gradient (if the
others have no state to take), and that must still be ours. So the average is written over what we sent only
where the caller can compute the pseudo-gradient again: a GPU replica is untouched until the outer step
(``OuterRounds.own_pseudo_gradient``). A lent CPU replica holds the pseudo-gradient itself: written over, a
refused average, a forked client's NaNs included, went into that solo step (seen in ``test_bad_peers.py``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from dataclasses import dataclass, field

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from ..config import AveragingConfig
from ..config.faults import NO_FAULTS, Faults
from ..lifecycle import hivemind_calls
from ..swarm.admission import Admission
from ..training.outer_optimizer import flat_tensors, release_pages
from .compression import Codec, ErrorFeedback, WireCompression, configured_codec, get_codec
from .handing_in import HandingIn
from .hivemind_internals import keeping_our_sigint
from .link_fit import LinkFit
from .pseudo_gradient_averager import PseudoGradientAverager
from .robust_aggregation import BanList, Limits, vector_norm
from .traffic import FAILED_VALUES, RECEIVED, RELAYED, SENT, TRANSFER_US

logger = logging.getLogger(__name__)


def wire_compression(codec: Codec) -> CompressionBase:
    """The hivemind compression that sends pseudo-gradients as ``codec`` encodes them (``configured_codec``)."""
    return {"none": NoCompression, "fp16": Float16Compression}.get(codec.name, lambda: WireCompression(codec))()


PEERS_PER_WINDOW = 4
"""Groups of up to this many gather within ``averaging.matchmaking_time``; a larger one gets as many such windows as
it has groups of this many (``RoundAverager.matchmaking_window``)."""


class _ExpectedFailuresInOneLine(logging.Filter):
    """hivemind logs a full traceback when a round finds no group; the daemon reports that itself, in one
    line, with what it does about it. Tracebacks stay visible at debug level (``diloco-peer -v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.exc_info and isinstance(record.exc_info[1], AllreduceException)
        return not expected or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


@dataclass
class RoundResult:
    """What one round's all-reduce did: the average (if any), the group, the bytes moved, the offenses seen."""

    ok: bool
    """True if the pseudo-gradient was averaged with at least one other peer."""
    averaged: list[torch.Tensor] | None = None
    """The average: the averager's own buffers, valid until they are released (``RoundAverager.release``, after
    the outer step that consumes them) or the next round."""
    group_size: int = 1
    group_epochs: list[int] = field(default_factory=list)
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    sent_norm: float = 0.0
    """The norm of the pseudo-gradient we sent (``refuse_update`` compares the average with it)."""
    values_not_averaged: int = 0
    """Values whose reducer failed mid-round: they hold our local value (replicas differ there)."""
    bytes_relayed: int = 0
    """Of those, bytes exchanged with members over relayed connections."""
    transfer_seconds: float = 0.0
    """The all-reduce proper, after matchmaking: where the bytes moved (``seconds`` includes matchmaking)."""
    error: str = ""
    density: float | None = None
    """``topk``: the density we asked our group to send at (``link_fit.py``)."""
    offenses: list[dict] = field(default_factory=list)
    """Contributions of other peers our averager refused since the last round (see ``offenses()``)."""


class RoundAverager(HandingIn):
    """Averages one pseudo-gradient per outer round with whichever peers are in the round.

    :param dht: a running DHT (the averager gets its own process and shares the DHT's p2p daemon)
    :param shapes: the parameter shapes, in model order
    :param run_id: averaging happens under the DHT prefix ``{run_id}_outer``
    :param cfg: the ``[averaging]`` section: timeouts, codec, declared bandwidth, checks and bans
    :param admission: who may average with us (default: everyone)
    :param relayed: we are reachable only through a relay (the group lets direct members reduce instead)
    :param faults: fault injection, for the tests only (``config/faults.py``): passed on to the averager process
    :param inputs: the buffer our pseudo-gradient is sent from (``flat_tensors(shapes, shared=True)``), if not our
      own: the daemon's blocking rounds on a CPU lend the replica's memory (it is reloaded after every round
      anyway), and a lent buffer is never released here
    :param in_place: write the average over the pseudo-gradient we sent (one buffer for both, 4 bytes per parameter
      less during a round), for a caller that can compute its pseudo-gradient again after a failed or refused
      round (``PeerConfig.averages_in_place``; not with ``inputs``). An all-reduce that fails once it has begun is
      then not retried (the round fails), and ``release_average`` releases what we sent too
    """

    def __init__(self, dht: DHT, shapes: list[torch.Size], run_id: str, cfg: AveragingConfig,
                 admission: Admission = Admission(), relayed: bool = False, *, faults: Faults = NO_FAULTS,
                 inputs: list[torch.Tensor] | None = None, in_place: bool = False):
        if in_place and inputs is not None:
            raise ValueError("in_place=True writes the average over our own input buffer: a lent one (inputs) "
                             "holds the replica, which a solo step after a failed round would still need")
        self.cfg = cfg
        self.admission = admission
        self.relayed = relayed
        self.faults = faults
        self.peer_id = dht.peer_id.to_base58()
        self.codec = configured_codec(cfg)
        self.feedback = ErrorFeedback(self.codec, cfg.feedback_decay) if cfg.error_feedback else None
        self.link_fit = LinkFit(cfg.topk_density, cfg.exchange_share) if cfg.compression == "topk" else None
        self._banned: dict[str, float] = {}  # peer id -> when its ban ends (time.monotonic), see banned()
        self._in_flight = False  # an all-reduce may be using the buffers: they must not be released
        self._control = None  # the last round's step in the averager process (hivemind's StepControl)
        self._sent_norm = 0.0
        self._handed = (0.0, None)  # when our last hand-in began, and our traffic counters then (``handed_back``)
        self._owns_inputs = inputs is None
        # before the fork: the averager process reads them
        self._inputs = flat_tensors(shapes, shared=True) if inputs is None else inputs
        self.in_place = in_place
        # where the all-reduce writes the average (in place: the very list we send from, see PseudoGradientAverager)
        self._outputs = self._inputs if in_place else flat_tensors(shapes, shared=True)
        # installed before the averager process forks, so that it applies there
        averager_logger = logging.getLogger("hivemind.averaging.averager")
        if not any(isinstance(f, _ExpectedFailuresInOneLine) for f in averager_logger.filters):
            averager_logger.addFilter(_ExpectedFailuresInOneLine())
        with keeping_our_sigint():  # hivemind would leave Ctrl+C ignored in this process
            self.averager = PseudoGradientAverager(
                self._outputs,
                dht,
                prefix=f"{run_id}_outer",
                start=True,
                min_group_size=2,
                min_matchmaking_time=cfg.matchmaking_time,
                request_timeout=cfg.request_timeout,
                allreduce_timeout=cfg.allreduce_timeout,
                sender_timeout=cfg.allreduce_timeout / 2,
                reducer_timeout=cfg.allreduce_timeout * 0.75,
                next_chunk_timeout=cfg.allreduce_timeout / 4,
                compression=wire_compression(self.codec),
                part_size_bytes=cfg.part_size_bytes,
                bandwidth=cfg.bandwidth or None,
                shutdown_timeout=5,
                limits=Limits.of(cfg),
                admission=admission,
                bans=BanList(cfg.ban_after, cfg.ban_seconds),
                progress_key=f"{run_id}_progress",
                faults=faults,
                inputs=self._inputs,
            )
        if cfg.start_when_complete:  # the leader's loop watch starts now, not at the first round (expect_group)
            self.averager.expect_group(None)

    @property
    def nudged(self):
        """Set (a ``member_news.Nudge``) when a peer says the round's last one is ready (``member_news.py``)."""
        return self.averager.news.nudged

    @property
    def inputs(self) -> list[torch.Tensor] | None:
        """Where the pseudo-gradient of a round should be written (``OuterOptimizer.pseudo_gradient_buffers``):
        ``average`` then sends it without copying it. None with error feedback, whose corrected pseudo-gradient
        differs from the one the round keeps (a solo step applies the uncorrected one)."""
        return None if self.feedback is not None else self._inputs

    def release(self) -> None:
        """The round's buffers are consumed (the outer step, or a state sync, is done with them): their memory goes
        back to the system until the next round writes them. Not while an all-reduce may still use them."""
        self._release(inputs=True)

    def release_average(self) -> None:
        """A round that failed (or whose average we refused): its average is never read, while our pseudo-gradient
        stays for a solo step should no state be had from the others. The average's memory goes back now, before
        the state download that usually follows needs as much again (4 bytes per parameter). ``in_place``: that is
        the one buffer, our pseudo-gradient included (the caller computes it again for a solo step)."""
        self._release(inputs=False)

    def _release(self, inputs: bool) -> None:
        lock = self.averager.lock_averaged_tensors
        if self._in_flight or not lock.acquire(block=False):  # (busy: an abandoned round's all-reduce, still on)
            return
        try:
            if inputs and self._owns_inputs:
                release_pages(self._inputs)
            release_pages(self._outputs)
        finally:
            lock.release()

    async def average(self, pseudo_gradient: list[torch.Tensor], weight: float, epoch: int,
                      expected: int | None = None, nudge: list[str] = (),
                      step_seconds: float | None = None) -> RoundResult:
        """All-reduce ``pseudo_gradient`` (weighted by ``weight``, the tokens behind it) with a group.

        :param epoch: our outer epoch: only peers averaging the same epoch share a group
        :param expected: how many peers (us included) may come, by the live records the round gate saw (trusted or
          not: ``ReadyDecision.expected``): once that many are in the group,
          its all-reduce starts at once; ``averaging.matchmaking_time`` only bounds the wait for peers that do not
          show up (a straggler still training, a peer that died). None (or fewer than 2): the group gathers for
          the whole window. (The count of *ready* peers would turn a peer away that got ready just after another
          peer's gate opened: a full group refuses it, and it lost rounds that way in a 4-peer NAT test.)
        :param nudge: peers (base58 ids) waiting at their round gates, told that the round's last peer is ready
          (``member_news.py``; their gates watch ``nudged``)
        :param step_seconds: our seconds per inner step, lately (``rounds/pace.py``), gathered: a slower member
          reduces a smaller span (``vector_split.paced_bandwidths``); None: not measured
        """
        started, begun = time.perf_counter(), time.monotonic()
        before = self.averager.traffic.clone()
        density = self.link_fit.density if self.link_fit is not None else None
        if density is not None:  # (the density fitted to our link: the group's may be lower)
            self.feedback.codec = get_codec("topk", density, self.cfg.topk_bits)
        if self.feedback is not None:  # send codec(x + residual); keep what the codec drops for next round
            pseudo_gradient, _ = self.feedback.roundtrip(pseudo_gradient)
        self._in_flight = True
        try:
            result = await self._average(pseudo_gradient, weight, epoch, expected, nudge, step_seconds, started,
                                         before, density)
        finally:
            self._in_flight = False
        if result.ok and self.feedback is not None:  # what the replies dropped of ours goes back (a sparse codec)
            self.feedback.settle(result.averaged)
        if result.ok and self.link_fit is not None and (change := self.link_fit.observe(
                begun, density, result.transfer_seconds)):
            logger.info(f"link fit: {change}")
        result.density = density
        return result

    async def _average(self, pseudo_gradient: list[torch.Tensor], weight: float, epoch: int, expected: int | None,
                       nudge: list[str], step_seconds: float | None, started: float, before: torch.Tensor,
                       density: float | None) -> RoundResult:
        self._copy_in(pseudo_gradient)
        weight = self.faults.poisoned_weight(weight)
        # one matchmaking key per outer epoch: a late peer still averaging epoch e never lands in the group of epoch
        # e+1, where its pseudo-gradient (relative to older weights) would poison everyone's step; and the size at
        # which a group we lead starts (hivemind's leader otherwise gathers followers until the end of the window
        # even when all are in). One call into the averager process: it is on the way of the round's last peers
        size = expected if expected and expected >= 2 else None
        await hivemind_calls.call(self.averager.expect_group, size, format(epoch, "b"), nudge,
                                  timeout=self.cfg.request_timeout * 10)
        window = self.matchmaking_window(size)
        control = self.averager.step(
            weight=float(weight),
            # bans: the peers we ban, so that a leader leaves them out before the group forms (group_bans.py)
            # expected: a leader that counted fewer waits for as many as we count (grow_target_with_followers)
            # density: topk's, fitted to our link: the group sends at its members' lowest (link_fit.py)
            gather={"epoch": epoch, "tokens": int(weight), "proof": self.admission.proof(self.peer_id),
                    "relayed": self.relayed, "bans": self.banned(), "step_seconds": step_seconds,
                    "expected": size, "density": density},
            scheduled_time=get_dht_time() + window,
            # deadline for *finding* a group: one window, and two more for a retry (the all-reduce has its own)
            timeout=window * 3,
            wait=False,
        )
        self._control = control
        try:
            # bounded: a step answers within its matchmaking deadline plus the all-reduce's own timeouts (with
            # a retry); longer, it waits on an averager process that is gone, and is abandoned
            gathered = await hivemind_calls.call(control.result, timeout=window * 3 + 2 * self.cfg.allreduce_timeout
                                                 + 30)
        except asyncio.CancelledError:
            control.cancel()
            raise
        except TimeoutError:
            control.cancel()
            return self._result(False, started, before, error="our averager process did not answer in time")
        except Exception as e:  # no group, timeout, a peer died mid-round: never fatal here
            return self._result(False, started, before, error=f"{type(e).__name__}: {e}".strip(": "))
        if not gathered or len(gathered) < 2:
            return self._result(False, started, before, error="no other peer joined the group")
        with self.averager.get_tensors() as tensors:
            averaged = list(tensors)
        epochs = [int(meta["epoch"]) for meta in gathered.values()]
        return self._result(True, started, before, averaged=averaged, group_size=len(gathered), group_epochs=epochs)

    def _result(self, ok: bool, started: float, before: torch.Tensor, **kwargs) -> RoundResult:
        delta = (self.averager.traffic - before).tolist()
        return RoundResult(
            ok=ok, seconds=time.perf_counter() - started, bytes_sent=delta[SENT], bytes_received=delta[RECEIVED],
            bytes_relayed=delta[RELAYED], sent_norm=self._sent_norm,
            values_not_averaged=delta[FAILED_VALUES], transfer_seconds=delta[TRANSFER_US] / 1e6,
            offenses=self.offenses(), **kwargs,
        )

    def _copy_in(self, pseudo_gradient: list[torch.Tensor]) -> None:
        """``pseudo_gradient`` into the buffers the averager process sends from, unless it was written there."""
        if any(a is not b for a, b in zip(pseudo_gradient, self._inputs)):  # not written in place: copied
            with self.averager.get_tensors():  # (a late all-reduce of an abandoned round must not read it half-way)
                for target, source in zip(self._inputs, pseudo_gradient):
                    target.copy_(source)
        self._sent_norm = vector_norm(pseudo_gradient)

    def matchmaking_window(self, expected: int | None) -> float:
        """Seconds a group we lead gathers the ``expected`` peers the round gate saw (``averaging.matchmaking_time``;
        longer for a larger group). The peers of a round learn that all are ready a poll and a DHT read apart, and in
        a large swarm on a loaded machine their gates open seconds apart: a leader that assembled after one fixed
        window left the last peers to a group of their own, whose replicas then differed (BENCHMARKS.md, "Many
        peers"). A complete group starts at once (``start_when_complete``): the window only bounds the wait for a
        peer that does not come."""
        return self.cfg.matchmaking_time * max(1.0, (expected or 0) / PEERS_PER_WINDOW)

    def offenses(self) -> list[dict]:
        """Contributions our averager refused since the last call: {offender, kind, detail, banned}."""
        found = []
        while True:
            try:
                peer, kind, detail, banned = self.averager.offenses.get_nowait()
            except queue.Empty:
                return found
            found.append({"offender": peer, "kind": kind, "detail": detail, "banned": banned})
            if banned:
                self._banned[peer] = time.monotonic() + self.cfg.ban_seconds

    def banned(self) -> list[str]:
        """The peers our averager bans now, as the offenses it reported say (its process enforces them)."""
        now = time.monotonic()
        self._banned = {peer: until for peer, until in self._banned.items() if until > now}
        return sorted(self._banned)

    def round_failed(self) -> None:
        """Our pseudo-gradient of the last ``average`` was not applied by anyone: the error-feedback residual
        goes back to what it was before that round (``ErrorFeedback.undo``), so that nothing it held is lost, and
        the round's average, never to be read, gives its memory back (``release_average``)."""
        if self.feedback is not None:
            self.feedback.undo()
        self.release_average()

    async def finish_allreduce(self, timeout: float) -> float:
        """Leaving: give an all-reduce that is exchanging tensors right now ``timeout`` seconds to end, so that
        its group does not lose our part of the vector (a partial round, and a state sync for each member). A
        cancelled step goes on in the averager process once its all-reduce has begun; stopping that process
        is what would break it. Our own average is not used. The seconds waited."""
        started = time.monotonic()
        while self.exchanging and time.monotonic() - started < timeout:
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    @property
    def exchanging(self) -> bool:
        """Our averager process is in the middle of an all-reduce (matchmaking done, tensors on the wire)."""
        return self._control is not None and self._control.stage == AveragingStage.RUNNING_ALLREDUCE

    def shutdown(self) -> None:
        self.averager.shutdown()
        self.averager.news.nudged.close()

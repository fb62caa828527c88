"""One outer round's all-reduce: find a group through the DHT and average the pseudo-gradients.

This wraps hivemind's ``DecentralizedAverager`` (matchmaking + butterfly all-reduce), by subclassing
rather than forking: its groups run ``allreduce.ExactAllReduceRunner`` (exact results, our codecs, byte
counts, checked numbers), and it guards who takes part: a group member or a state download must pass
admission (``admission.py``: swarm secret, allowlist) and must not be banned (``robust_aggregation.BanList``:
peers whose contributions were refused repeatedly). Offenses cross to the daemon through a queue.

A round that cannot find a group or whose all-reduce fails returns ``ok=False`` with the reason; the
caller then takes a solo outer step. Nothing here raises into the training loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass, field
from typing import AsyncIterator  # not collections.abc: hivemind reads the handler type by its typing name

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, Float16Compression, NoCompression
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

from ..swarm.admission import Admission
from .allreduce import FAILED_VALUES, RECEIVED, RELAYED, SENT, TRANSFER_US, ExactAllReduceRunner
from .compression import ErrorFeedback, WireCompression, deserialize, get_codec
from ..config import AveragingConfig
from .robust_aggregation import BanList, Limits, capped_bandwidths

logger = logging.getLogger(__name__)

FAULT_ENV = "DILOCO_PEER_FAULT"
"""Fault injection, for the tests only: ``crash_in_allreduce:N`` makes the peer die (SIGKILL, its main
process too) in the middle of its N-th all-reduce, as a reducer that has received a first part and
answered nobody yet: the worst moment for the others. A broken or malicious peer: ``poison:nan`` /
``poison:X`` / ``poison:signflip`` send NaNs / the pseudo-gradient times X / its negation,
``poison:shape`` sends parts one value short, ``poison:weight`` claims a weight of 1e12 tokens."""


def wire_compression(name: str) -> CompressionBase:
    """The hivemind compression that sends pseudo-gradients as ``averaging.compression`` says."""
    return {"none": NoCompression, "fp16": Float16Compression}.get(name, lambda: WireCompression(name))()


class _ExpectedFailuresInOneLine(logging.Filter):
    """hivemind logs a full traceback when a round finds no group; the daemon reports that itself, in one
    line, with what it does about it. Tracebacks stay visible at debug level (``diloco-peer -v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.exc_info and isinstance(record.exc_info[1], AllreduceException)
        return not expected or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class PseudoGradientAverager(DecentralizedAverager):
    """hivemind's averager with exact (non-delta) results and byte counters; runs in its own process.

    It also serves and fetches the peer's state (see ``state_sync.py``): ``state_provider`` is called in
    this (host) process whenever another peer downloads our state, and ``download_state_from`` fetches
    the state of one chosen donor, where hivemind's ``load_state_from_peers`` always picks the donor itself.

    :param limits: the bounds every incoming part and average is checked against
    :param admission: who may join our groups and download our state
    :param bans: the ban list (enforced in the averager process)
    :param progress_key: the DHT key of the swarm's progress records; in a swarm closed by a secret, only
      peers with a record there may download our state (only secret holders can write to that DHT)
    """

    def __init__(self, averaged_tensors, dht: DHT, *, limits: Limits = Limits(), admission: Admission = Admission(),
                 bans: BanList | None = None, progress_key: str = "", **kwargs):
        self.traffic = torch.zeros(5, dtype=torch.int64).share_memory_()
        self.state_provider = None
        self.limits, self.admission, self.progress_key = limits, admission, progress_key
        self.bans = bans if bans is not None else BanList(ban_after=2, ban_seconds=600.0)
        self.offenses = mp.Queue()
        """(peer id, kind, detail, banned now) for every refused contribution, read by the host process."""
        fault = os.environ.get(FAULT_ENV, "")
        self._crash_in_allreduce = int(fault.split(":")[1]) if fault.startswith("crash_in_allreduce:") else 0
        self._allreduces = 0
        super().__init__(averaged_tensors, dht, **kwargs)

    def _report(self, peer_id: PeerID, kind: str, detail: str) -> None:
        # in the averager process: count the offense, ban a repeat offender, tell the host
        peer = peer_id.to_base58()
        banned_now = self.bans.record(peer)
        logger.warning(f"refused a contribution of peer {peer}: {kind}: {detail}"
                       + (f"; banned for {self.bans.ban_seconds:g}s" if banned_now else ""))
        self.offenses.put((peer, kind, detail, banned_now))

    def _refusal(self, peer_id: PeerID, gathered: bytes | None) -> tuple[str, str]:
        """(kind, why) if ``peer_id``, showing the data it gathers with a group, may not be in our group."""
        peer = peer_id.to_base58()
        if self.bans.is_banned(peer):
            return "banned", f"peer {peer} is banned for repeated offenses"
        proof = None
        if self.admission.secret is not None:
            try:
                proof = self.serializer.loads(self.serializer.loads(gathered)[2]).get("proof", b"")
            except Exception:
                proof = b""
        why = self.admission.refuses(peer, proof)
        return ("unadmitted", why) if why else ("", "")

    async def _step(self, **kwargs):
        self._skip_refused_leaders()
        return await super()._step(**kwargs)

    def _skip_refused_leaders(self) -> None:
        # hivemind's matchmaking asks every leader it finds in the DHT; a banned or unadmitted one would take
        # us into its group and we would then refuse to average (the round lost). Ask the next leader instead.
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_skips_refused_leaders", False):
            return
        request_join_group = matchmaking._request_join_group

        async def _request_join_group(leader: PeerID):
            peer = leader.to_base58()
            if self.bans.is_banned(peer) or self.admission.refuses(peer, None):
                return None  # as if it had turned us down
            return await request_join_group(leader)

        matchmaking._request_join_group = _request_join_group
        matchmaking._skips_refused_leaders = True

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        kind, why = self._refusal(context.remote_id, request.gather)
        if why:
            if kind != "banned":  # a banned peer knocking again is not a new offense
                self._report(context.remote_id, kind, why)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        peer = context.remote_id.to_base58()
        why = "banned" if self.bans.is_banned(peer) else self.admission.refuses(peer, None)
        if not why and self.admission.secret is not None and self.progress_key:
            found = await self.dht.get(self.progress_key, latest=True, return_future=True)
            entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
            holders = {entry.value.get("peer_id") for entry in entries if isinstance(entry.value, dict)}
            why = "" if peer in holders else f"peer {peer} has no progress record in the swarm's DHT"
        if why:
            logger.warning(f"refused to serve our state to {peer}: {why}")
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def get_current_state(self):
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    def report_offense(self, peer: str, kind: str, detail: str) -> None:
        """From the host process: count an offense found there (e.g. a corrupt state download) towards a ban."""
        self._outer_pipe.send(("_report_from_host", [peer, kind, detail], {}))

    async def _report_from_host(self, peer: str, kind: str, detail: str) -> None:
        self._report(PeerID.from_base58(peer), kind, detail)

    def download_state_from(self, donor: str, timeout: float) -> tuple[dict, list[torch.Tensor], int]:
        """Download ``donor``'s state: (metadata, tensors, bytes received). Raises on failure or silence."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(donor=donor, timeout=timeout, future=future)))
        return future.result()

    async def _download_state_from(self, donor: str, timeout: float, future: MPFuture) -> None:
        # runs in the averager process; ``timeout`` bounds the wait for each chunk, not the whole download
        try:
            if self.bans.is_banned(donor) or self.admission.refuses(donor, None):
                raise RuntimeError(f"donor {donor} is banned or not admitted")
            stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
            metadata, tensors, parts, received = None, [], [], 0

            def _complete(parts) -> torch.Tensor:
                if len(parts) != max(parts[0].chunks, 1):  # a stream that broke off: say so, not "invalid shape"
                    raise RuntimeError(f"the state download broke off: tensor {len(tensors)} came in "
                                       f"{len(parts)} of {parts[0].chunks} chunks")
                return deserialize(combine_from_streaming(parts))

            async for message in aiter_with_timeout(stream, timeout=timeout):
                received += message.ByteSize()
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                    tensors.append(_complete(parts))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(_complete(parts))
            if metadata is None:
                raise RuntimeError("the donor declined to share its state")
            future.set_result((metadata, tensors, received))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}".strip(": ")))

    def _fair_fractions(self, group_info) -> tuple[int, ...]:
        # hivemind's split of the vector, but from capped declared bandwidths (robust_aggregation.capped_bandwidths)
        # and members behind a relay reduce nothing when a direct member can: relayed bytes are slow and scarce
        bandwidths, modes, relayed = [], [], []
        for gathered in group_info.gathered:
            bandwidth, mode, user = self.serializer.loads(gathered)
            bandwidths.append(bandwidth)
            modes.append(AveragingMode(mode))
            try:
                relayed.append(self.serializer.loads(user).get("relayed") is True)
            except Exception:  # not our gather format: _refusal deals with such a member
                relayed.append(False)
        reducing = [m != AveragingMode.CLIENT for m in modes]
        if any(r and not x for r, x in zip(reducing, relayed)):
            reducing = [r and not x for r, x in zip(reducing, relayed)]
        capped = capped_bandwidths([b if r else 0.0 for b, r in zip(bandwidths, reducing)])
        return load_balance_peers(self.total_size, capped, self.allreduce_kwargs["min_vector_size"])

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        started = time.perf_counter()
        group_id = group_info.group_id if group_id is None else group_id
        self._allreduces += 1
        kwargs["peer_fractions"] = await asyncio.get_running_loop().run_in_executor(
            None, self._fair_fractions, group_info)
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            kind, why = self._refusal(peer_id, gathered) if peer_id != self.peer_id else ("", "")
            if why:  # a leader let in a peer we refuse (or is one): we average with nobody in this group
                if kind != "banned":
                    self._report(peer_id, kind, why)
                error = AllreduceException(f"refused to average with this group: {why}")
                self._running_groups[group_id].set_exception(error)  # members waiting for us get an error now
                raise error
        relayed = frozenset(info.peer_id for info in await self._p2p.list_peers()
                            if any("p2p-circuit" in str(addr) for addr in info.addrs))
        runner = ExactAllReduceRunner(
            traffic=self.traffic,
            relayed=relayed,
            limits=self.limits,
            on_offense=lambda peer_id, problem: self._report(peer_id, problem.kind, problem.detail),
            crash=self._allreduces == self._crash_in_allreduce,
            truncate=os.environ.get(FAULT_ENV, "") == "poison:shape",
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        # hivemind retries a failed all-reduce with the same tensors: those we had already overwritten with
        # averages would then go in as if they were our pseudo-gradient. Put our own values back first.
        ours = [t.clone() for t in tensors]
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
        except BaseException:
            for tensor, own in zip(tensors, ours):
                tensor.copy_(own)
            raise
        # by now every sender has started streaming to us (our last part needed all of theirs)
        await runner.wait_for_replies(timeout=runner.reducer_timeout or 5.0)
        self.traffic[FAILED_VALUES] += runner.tensor_part_container.failed_size
        self.traffic[TRANSFER_US] += int((time.perf_counter() - started) * 1e6)
        self.last_updated = get_dht_time()
        self._state_updated.set()


@dataclass
class RoundResult:
    ok: bool
    """True if the pseudo-gradient was averaged with at least one other peer."""
    averaged: list[torch.Tensor] | None = None
    group_size: int = 1
    group_epochs: list[int] = field(default_factory=list)
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    values_not_averaged: int = 0
    """Values whose reducer failed mid-round: they hold our local value (replicas differ there)."""
    bytes_relayed: int = 0
    """Of those, bytes exchanged with members over relayed connections."""
    transfer_seconds: float = 0.0
    """The all-reduce proper, after matchmaking: where the bytes moved (``seconds`` includes matchmaking)."""
    error: str = ""
    offenses: list[dict] = field(default_factory=list)
    """Contributions of other peers our averager refused since the last round (see ``offenses()``)."""


class RoundAverager:
    """Averages one pseudo-gradient per outer round with whichever peers are in the round.

    :param dht: a running DHT (the averager gets its own process and shares the DHT's p2p daemon)
    :param shapes: the parameter shapes, in model order
    :param run_id: averaging happens under the DHT prefix ``{run_id}_outer``
    :param cfg: the ``[averaging]`` section: timeouts, codec, declared bandwidth, checks and bans
    :param admission: who may average with us (default: everyone)
    :param relayed: we are reachable only through a relay (the group lets direct members reduce instead)
    """

    def __init__(self, dht: DHT, shapes: list[torch.Size], run_id: str, cfg: AveragingConfig,
                 admission: Admission = Admission(), relayed: bool = False):
        self.cfg, self.admission, self.relayed = cfg, admission, relayed
        self.peer_id = dht.peer_id.to_base58()
        self.feedback = ErrorFeedback(get_codec(cfg.compression)) if cfg.error_feedback else None
        fault = os.environ.get(FAULT_ENV, "")
        self._poison = fault.split(":", 1)[1] if fault.startswith("poison:") else ""
        tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        # installed before the averager process forks, so that it applies there
        averager_logger = logging.getLogger("hivemind.averaging.averager")
        if not any(isinstance(f, _ExpectedFailuresInOneLine) for f in averager_logger.filters):
            averager_logger.addFilter(_ExpectedFailuresInOneLine())
        self.averager = PseudoGradientAverager(
            tensors,
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
            compression=wire_compression(cfg.compression),
            bandwidth=cfg.bandwidth or None,
            shutdown_timeout=5,
            declare_state_period=max(cfg.heartbeat * 3, 5.0),
            limits=Limits(max_update_ratio=cfg.max_update_ratio, max_weight_ratio=cfg.max_weight_ratio,
                          robust=cfg.aggregation == "robust", min_cosine=cfg.min_cosine),
            admission=admission,
            bans=BanList(cfg.ban_after, cfg.ban_seconds),
            progress_key=f"{run_id}_progress",
        )

    async def average(self, pseudo_gradient: list[torch.Tensor], weight: float, epoch: int) -> RoundResult:
        """All-reduce ``pseudo_gradient`` (weighted by ``weight``, the tokens behind it) with a group."""
        started = time.perf_counter()
        before = self.averager.traffic.clone()
        if self.feedback is not None:  # send codec(x + residual); keep what the codec drops for next round
            pseudo_gradient, _ = self.feedback.roundtrip(pseudo_gradient)
        with self.averager.get_tensors() as tensors:
            for target, source in zip(tensors, pseudo_gradient):
                target.copy_(source)
                if self._poison == "nan":
                    target.fill_(float("nan"))
                elif self._poison == "signflip":
                    target.neg_()
                elif self._poison not in ("", "shape", "weight"):
                    target.mul_(float(self._poison))
        if self._poison == "weight":
            weight = 1e12  # claims to have trained on a trillion tokens: its part would swamp the mean
        # one matchmaking key per outer epoch: a late peer still averaging epoch e never lands in the group
        # of epoch e+1, where its pseudo-gradient (relative to older weights) would poison everyone's step
        await asyncio.to_thread(self.averager.set_group_bits, format(epoch, "b"))
        control = self.averager.step(
            weight=float(weight),
            gather={"epoch": epoch, "tokens": int(weight), "proof": self.admission.proof(self.peer_id),
                    "relayed": self.relayed},
            # deadline for *finding* a group: after the round gate, peers arrive within a second, so one
            # matchmaking period suffices; three leave room for a retry (the all-reduce has its own timeout)
            timeout=self.cfg.matchmaking_time * 3,
            wait=False,
        )
        try:
            gathered = await asyncio.to_thread(control.result)
        except asyncio.CancelledError:
            control.cancel()
            raise
        except Exception as e:  # no group, timeout, a peer died mid-round: never fatal here
            return self._result(False, started, before, error=f"{type(e).__name__}: {e}".strip(": "))
        if not gathered or len(gathered) < 2:
            return self._result(False, started, before, error="no other peer joined the group")
        with self.averager.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        epochs = [int(meta["epoch"]) for meta in gathered.values()]
        return self._result(True, started, before, averaged=averaged, group_size=len(gathered), group_epochs=epochs)

    def _result(self, ok: bool, started: float, before: torch.Tensor, **kwargs) -> RoundResult:
        delta = (self.averager.traffic - before).tolist()
        return RoundResult(
            ok=ok, seconds=time.perf_counter() - started, bytes_sent=delta[SENT], bytes_received=delta[RECEIVED],
            bytes_relayed=delta[RELAYED],
            values_not_averaged=delta[FAILED_VALUES], transfer_seconds=delta[TRANSFER_US] / 1e6,
            offenses=self.offenses(), **kwargs,
        )

    def offenses(self) -> list[dict]:
        """Contributions our averager refused since the last call: {offender, kind, detail, banned}."""
        found = []
        while True:
            try:
                peer, kind, detail, banned = self.averager.offenses.get_nowait()
            except queue.Empty:
                return found
            found.append({"offender": peer, "kind": kind, "detail": detail, "banned": banned})

    def reset_feedback(self) -> None:
        """Forget the error-feedback residual (after a state sync replaced the weights it belonged to)."""
        if self.feedback is not None:
            self.feedback.residuals = None

    def shutdown(self) -> None:
        self.averager.shutdown()

"""One outer round's all-reduce: find a group through the DHT and average the pseudo-gradients.

This wraps hivemind's ``DecentralizedAverager`` (matchmaking + butterfly all-reduce) with two changes,
both made by subclassing rather than forking:

1. **Exact results.** Stock hivemind reducers send back ``average - your_part`` and every member adds
   that delta to its own part. In floating point ``mine + (avg - mine) != avg`` in the last bits, and
   the error differs per member, so replicas drift apart bit by bit. Here reducers send the average
   itself (and a reducer keeps exactly what it sends, compression round-trip included), so every
   member of a group ends the round with the very same bytes: DiLoCo replicas stay bit-identical.
2. **Our codecs on the wire.** bf16, per-block int8 and int4 (``compression.py``) travel under codes
   hivemind does not know, so the runner decodes every message with ``compression.deserialize``.
3. **Traffic accounting.** The payload bytes of every all-reduce message sent and received are counted
   in a small shared-memory tensor that the daemon reads after each round.

A round that cannot find a group or whose all-reduce fails returns ``ok=False`` with the reason; the
caller then takes a solo outer step. Nothing here raises into the training loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished, azip
from hivemind.utils.streaming import combine_from_streaming

from .compression import ErrorFeedback, WireCompression, deserialize, get_codec
from .config import AveragingConfig

_SENT, _RECEIVED, _FAILED_VALUES, _TRANSFER_US = 0, 1, 2, 3
FAULT_ENV = "DILOCO_PEER_FAULT"
"""Fault injection, for the tests only: ``crash_in_allreduce:N`` makes the peer die (SIGKILL, its main
process too) in the middle of its N-th all-reduce, as a reducer that has received a first part and
answered nobody yet: the worst moment for the others. ``poison:nan`` / ``poison:X`` make it send NaNs /
its pseudo-gradient times X: a broken or malicious peer."""


def wire_compression(name: str) -> CompressionBase:
    """The hivemind compression that sends pseudo-gradients as ``averaging.compression`` says."""
    return {"none": NoCompression, "fp16": Float16Compression}.get(name, lambda: WireCompression(name))()


class _ExpectedFailuresInOneLine(logging.Filter):
    """hivemind logs a full traceback when a round finds no group; the daemon reports that itself, in one
    line, with what it does about it. Tracebacks stay visible at debug level (``diloco-peer -v``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.exc_info and isinstance(record.exc_info[1], AllreduceException)
        return not expected or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class _CountingStub:
    """Wraps a peer's averaging stub so that the all-reduce messages we exchange with it are counted."""

    def __init__(self, stub, runner: _ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(self._runner._count(inputs, _SENT))
        return self._runner._count(stream, _RECEIVED)


class _ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose reducers return averages instead of deltas (see the module docstring)."""

    def __init__(self, *, traffic: torch.Tensor, crash: bool = False, **kwargs):
        super().__init__(**kwargs)
        self._crash = crash
        # outputs are averages now: a failed reducer's part must fall back to our own values, not to zeros
        self.tensor_part_container.return_deltas = False
        self._traffic = traffic
        self._replying = 0  # reply streams to other members still open (their last bytes not yet counted)
        self._replies_done = asyncio.Event()
        self._replies_done.set()
        self._compression = self.tensor_part_container.compression
        self._lossless = isinstance(self._compression, NoCompression)

    def _encode(self, tensor: torch.Tensor):
        return self._compression.compress(tensor, CompressionInfo.from_tensor(tensor))

    async def _count(self, messages, slot: int):
        async for message in messages:
            self._traffic[slot] += message.ByteSize()
            yield message

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def rpc_aggregate_part(self, stream, context):
        self._replying += 1
        self._replies_done.clear()
        try:
            async for message in super().rpc_aggregate_part(self._count(stream, _RECEIVED), context):
                self._traffic[_SENT] += message.ByteSize()
                yield message
        finally:
            self._replying -= 1
            if self._replying == 0:
                self._replies_done.set()

    async def wait_for_replies(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until we have answered every member whose parts we reduce.

        Our own averages can be complete while our replies to others are still being encoded: waiting
        keeps a round's byte counts whole (sent == received across the group) and our reducer's work
        inside the round it belongs to.
        """
        try:
            await asyncio.wait_for(self._replies_done.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _communicate_with_peer(self, peer_id):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            # our own shard: we are its reducer; keep exactly the bytes the other members receive
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                          weight=self.weight)
                if not self._lossless:
                    averaged = deserialize(self._encode(averaged))
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
            return
        # as in hivemind, but decoding with our codecs too
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def _decode(message):
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                return deserialize(message.tensor_part)

            part_index = 0
            async for averaged in amap_in_executor(_decode, aiter_with_timeout(stream, self.reducer_timeout),
                                                   max_prefetch=self.tensor_part_container.prefetch):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]
            if part_index != expected:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected}")
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # as in hivemind, but the reply is the averaged part itself rather than (average - sender's part)
        loop = asyncio.get_event_loop()
        part_index = 0
        try:
            async for part, weight in amap_in_executor(
                lambda msg: (deserialize(msg.tensor_part), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if self._crash:
                    os.kill(os.getppid(), signal.SIGKILL)  # the daemon; its reaper takes the DHT and p2pd along
                    os.kill(os.getpid(), signal.SIGKILL)
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                    part_index += 1
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, self._encode, averaged)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class PseudoGradientAverager(DecentralizedAverager):
    """hivemind's averager with exact (non-delta) results and byte counters; runs in its own process.

    It also serves and fetches the peer's state (see ``state_sync.py``): ``state_provider`` is called in
    this (host) process whenever another peer downloads our state, and ``download_state_from`` fetches
    the state of one chosen donor, where hivemind's ``load_state_from_peers`` always picks the donor itself.
    """

    def __init__(self, averaged_tensors, dht: DHT, **kwargs):
        self.traffic = torch.zeros(4, dtype=torch.int64).share_memory_()
        self.state_provider = None
        fault = os.environ.get(FAULT_ENV, "")
        self._crash_in_allreduce = int(fault.split(":")[1]) if fault.startswith("crash_in_allreduce:") else 0
        self._allreduces = 0
        super().__init__(averaged_tensors, dht, **kwargs)

    def get_current_state(self):
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        return self.state_provider()

    def download_state_from(self, donor: str, timeout: float) -> tuple[dict, list[torch.Tensor], int]:
        """Download ``donor``'s state: (metadata, tensors, bytes received). Raises on failure or silence."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(donor=donor, timeout=timeout, future=future)))
        return future.result()

    async def _download_state_from(self, donor: str, timeout: float, future: MPFuture) -> None:
        # runs in the averager process; ``timeout`` bounds the wait for each chunk, not the whole download
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
            metadata, tensors, parts, received = None, [], [], 0
            async for message in aiter_with_timeout(stream, timeout=timeout):
                received += message.ByteSize()
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                    tensors.append(deserialize(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize(combine_from_streaming(parts)))
            if metadata is None:
                raise RuntimeError("the donor declined to share its state")
            future.set_result((metadata, tensors, received))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}".strip(": ")))

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        started = time.perf_counter()
        group_id = group_info.group_id if group_id is None else group_id
        self._allreduces += 1
        runner = _ExactAllReduceRunner(
            traffic=self.traffic,
            crash=self._allreduces == self._crash_in_allreduce,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        # by now every sender has started streaming to us (our last part needed all of theirs)
        await runner.wait_for_replies(timeout=runner.reducer_timeout or 5.0)
        self.traffic[_FAILED_VALUES] += runner.tensor_part_container.failed_size
        self.traffic[_TRANSFER_US] += int((time.perf_counter() - started) * 1e6)
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
    transfer_seconds: float = 0.0
    """The all-reduce proper, after matchmaking: where the bytes moved (``seconds`` includes matchmaking)."""
    error: str = ""


class RoundAverager:
    """Averages one pseudo-gradient per outer round with whichever peers are in the round.

    :param dht: a running DHT (the averager gets its own process and shares the DHT's p2p daemon)
    :param shapes: the parameter shapes, in model order
    :param run_id: averaging happens under the DHT prefix ``{run_id}_outer``
    :param cfg: the ``[averaging]`` section: timeouts, codec, declared bandwidth
    """

    def __init__(self, dht: DHT, shapes: list[torch.Size], run_id: str, cfg: AveragingConfig):
        self.cfg = cfg
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
                elif self._poison:
                    target.mul_(float(self._poison))
        # one matchmaking key per outer epoch: a late peer still averaging epoch e never lands in the group
        # of epoch e+1, where its pseudo-gradient (relative to older weights) would poison everyone's step
        await asyncio.to_thread(self.averager.set_group_bits, format(epoch, "b"))
        control = self.averager.step(
            weight=float(weight),
            gather={"epoch": epoch, "tokens": int(weight)},
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
            ok=ok, seconds=time.perf_counter() - started, bytes_sent=delta[_SENT], bytes_received=delta[_RECEIVED],
            values_not_averaged=delta[_FAILED_VALUES], transfer_seconds=delta[_TRANSFER_US] / 1e6, **kwargs,
        )

    def reset_feedback(self) -> None:
        """Forget the error-feedback residual (after a state sync replaced the weights it belonged to)."""
        if self.feedback is not None:
            self.feedback.residuals = None

    def shutdown(self) -> None:
        self.averager.shutdown()


def refuse_update(update: list[torch.Tensor], own: list[torch.Tensor], max_ratio: float) -> str:
    """Why an averaged pseudo-gradient must not be applied ("" if it may): a peer that sent NaNs or a
    huge vector (broken hardware, a buggy fork, an attacker) must not poison our weights."""
    bad = sum(int((~torch.isfinite(t)).sum()) for t in update)
    if bad:
        return f"{bad} non-finite values"
    norm, own_norm = _norm(update), _norm(own)
    if max_ratio and norm > max_ratio * max(own_norm, 1e-12):
        return f"norm {norm:.3g} is {norm / max(own_norm, 1e-12):.0f}x ours (averaging.max_update_ratio={max_ratio:g})"
    return ""


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))

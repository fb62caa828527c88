"""The butterfly all-reduce of one group, as hivemind runs it, with our changes made by subclassing.

1. **Exact results.** Stock hivemind reducers send back ``average - your_part`` and every member adds
   that delta to its own part. In floating point ``mine + (avg - mine) != avg`` in the last bits, and
   the error differs per member, so replicas drift apart bit by bit. Here reducers send the average
   itself (and a reducer keeps exactly what it sends, compression round-trip included), so every
   member of a group ends the round with the very same bytes: DiLoCo replicas stay bit-identical.
2. **Our codecs on the wire.** bf16, per-block int8 and int4 (``compression.py``) travel under codes
   hivemind does not know, so the runner decodes every message with ``compression.deserialize``.
3. **Traffic accounting** (``traffic.py``). The payload bytes of every all-reduce message sent and received
   are counted in a small shared-memory tensor (slots ``SENT``, ``RECEIVED``, ...) that the daemon reads after
   each round.
4. **Checked numbers** (``robust_aggregation.py``): every part a reducer receives and every average a
   member gets back is checked (shape, finite, weight, norm; direction in robust mode) before use; an
   offender is dropped from the round and reported through ``on_offense``.
5. **Silent members are asked, then dropped** (``member_silence.py``): one that says nothing and answers nothing
   leaves the round within seconds instead of hivemind's timeouts (half and three quarters of the all-reduce's).
6. **Streams end from the member's side.** A member hangs up once it has every average of a reducer, and the
   reducer waits for that: a reducer that hung up first could lose its last averages on the way
   (``p2pd_internals.until_the_caller_hangs_up``; seen as partial rounds: BENCHMARKS.md, "Reliability: streams
   that end early").
7. **A refusal ends a delayed stream** (``delayed_results.py``): a member that reduces nothing is answered only
   once its stream has ended; a reducer that refuses it ends that stream, and the member reads the end at once.

Two of hivemind's private methods are copied here and changed (``_communicate_with_peer``,
``_accumulate_parts_streaming``): ``hivemind_internals.INVENTORY`` records the sha256 of the originals, so
that a hivemind upgrade that changes them fails a test until the copies are looked at.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from ..config.faults import NO_FAULTS, Faults
from ..swarm.p2pd_internals import HANG_UP_WAIT, until_the_caller_hangs_up
from . import hivemind_internals as internals
from .compression import deserialize
from .delayed_results import replies_after_sending
from .member_silence import Patience, SilenceWatch
from .robust_aggregation import BadContribution, CheckedPartReducer, Limits, check_average
from .traffic import RECEIVED, RELAYED, SENT, CountingStub

logger = logging.getLogger(__name__)

GONE_WITHIN = 3.0
"""Seconds a reducer we lost may keep its connection and still count as gone (``_drop_if_gone``)."""


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose reducers return averages instead of deltas (see the module docstring).

    :param traffic: the shared byte counters (slots ``SENT``, ``RECEIVED``, ...)
    :param limits: the bounds of the checks
    :param on_offense: called with (peer id, ``BadContribution``) for every refused part or average
    :param faults: fault injection, for the tests only (``config/faults.py``)
    :param allreduce: the number of this all-reduce in our averager (from 1), for ``faults``
    :param relayed: members we reach over a relay: their bytes also count as ``RELAYED``
    :param outputs: where the averages go, laid out like ``tensors`` in one buffer (``flat_tensors``): each averaged
      part is written there the moment it is known, instead of waiting, decoded, until the parts before it are in
      (the parts a reducer averaged early would otherwise pile up: up to half the model with two peers)
    """

    def __init__(self, *, traffic: torch.Tensor, limits: Limits, on_offense, faults: Faults = NO_FAULTS,
                 allreduce: int = 0, relayed: frozenset[PeerID] = frozenset(), outputs: list[torch.Tensor] = (),
                 **kwargs):
        super().__init__(**kwargs)
        self._outputs = _flat_twin(kwargs["tensors"], outputs)
        self._parts: dict[int, list[torch.Tensor]] = {}  # peer index -> our input parts it reduces (their places)
        self._relayed = relayed
        self._faults = faults
        self._allreduce = allreduce
        self._limits = limits
        self._on_offense = on_offense
        own = self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None
        # hivemind's own reducer is replaced unused: marked finished, or its finalize (when garbage-collected)
        # warns "Reducer: received 0.0% of input tensors" in every round we reduce in
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = CheckedPartReducer(
            self.tensor_part_reducer.part_shapes, len(self.sender_peer_ids), own=own, limits=limits,
            on_refused=lambda sender, problem: self._refuse_sender(self.sender_peer_ids[sender], problem))
        # outputs are averages now: a failed reducer's part must fall back to our own values, not to zeros
        self.tensor_part_container.return_deltas = False
        self._traffic = traffic
        self._replying: Counter[PeerID] = Counter()  # reply streams to each member still open (bytes not all counted)
        self._awaiting: set[PeerID] = set()  # reducers whose averages we wait for
        self._delivered: set[PeerID] = set()  # senders whose every part reached us
        self._silence = SilenceWatch(self._ask_still_there, self._waited_on, self._drop_silent,
                                     Patience(len(self.ordered_peer_ids)))
        self._disputed: list[tuple[PeerID, BadContribution]] = []  # reducers whose averages we refused by direction
        self._agreed: set[PeerID] = set()  # reducers (not us) whose every average passed our checks
        self._replies_done = asyncio.Event()
        self._replies_done.set()
        self._compression = self.tensor_part_container.compression
        self._lossless = isinstance(self._compression, NoCompression)

    def _register(self, peer_index: int, part_index: int, averaged: torch.Tensor) -> None:
        """An averaged part is known: into its place in ``outputs`` at once (the container keeps a view of it)."""
        if self._outputs is not None:
            if peer_index not in self._parts:
                self._parts[peer_index] = internals.own_input_parts(self, peer_index)
            part = self._parts[peer_index][part_index]
            place = self._outputs[part.storage_offset():part.storage_offset() + part.numel()]
            averaged = place.copy_(averaged.reshape(-1)).view(averaged.shape)
        self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)

    def _refuse_sender(self, peer_id: PeerID, problem: BadContribution) -> None:
        # reported once per round and sender; the sender is dropped from every part it has not sent yet
        if peer_id not in self.banned_senders:
            self._on_offense(peer_id, problem)
        asyncio.create_task(internals.ban_sender(self, peer_id))

    def _encode(self, tensor: torch.Tensor):
        return self._compression.compress(tensor, CompressionInfo.from_tensor(tensor))

    async def _count(self, messages, slot: int, peer: PeerID):
        try:
            async for message in messages:
                if slot == RECEIVED:
                    self._silence.heard(peer)
                self._traffic[slot] += message.ByteSize()
                if peer in self._relayed:
                    self._traffic[RELAYED] += message.ByteSize()
                yield message
        finally:  # closing the count closes the stream it counts: how a member hangs up on its reducer
            await messages.aclose()

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            if self._faults.truncates_parts:  # fault injection (poison:shape): a buggy fork drops a value per part
                message.tensor_part.CopyFrom(self._encode(deserialize(message.tensor_part)[:-1]))
            yield message

    def _get_peer_stub(self, peer):
        return CountingStub(super()._get_peer_stub(peer), self._count, peer)

    async def run(self):
        self._silence.start()  # until ``wait_for_replies`` ends: a silent member may hold our replies after the run
        try:
            async for averaged in super().run():
                yield averaged
        except BaseException:  # failed, or given up on: no ``wait_for_replies`` follows
            self._silence.stop()
            raise

    def _waited_on(self) -> set[PeerID]:
        """The members we wait on now: senders of parts we reduce, reducers of our parts, and members we reply to
        (they hang up once they have our averages)."""
        senders = set()
        if self.parts_for_local_averaging:
            senders = set(self.sender_peer_ids) - self.banned_senders - self._delivered - {self.peer_id}
        return senders | self._awaiting | {peer for peer, open_ in self._replying.items() if open_}

    async def _ask_still_there(self, peer: PeerID) -> None:
        await super()._get_peer_stub(peer).rpc_still_there(averaging_pb2.DownloadRequest())

    async def _drop_silent(self, peer: PeerID) -> None:
        """``peer`` is silent: dropped as a sender (the parts it has not sent are averaged without it) and no longer
        waited for as a reducer (``_communicate_with_peer``) or to hang up (``wait_for_replies``)."""
        if peer in self.sender_peer_ids and peer not in self.banned_senders:
            await internals.ban_sender(self, peer)
        self._settle_replies()

    def _settle_replies(self) -> None:
        if all(self._silence.is_silent(peer) for peer, open_ in self._replying.items() if open_):
            self._replies_done.set()

    async def rpc_aggregate_part(self, stream, context):
        self._replying[context.remote_id] += 1
        self._replies_done.clear()
        replied = 0
        try:
            async for message in super().rpc_aggregate_part(self._count(stream, RECEIVED, context.remote_id), context):
                self._traffic[SENT] += message.ByteSize()
                if context.remote_id in self._relayed:
                    self._traffic[RELAYED] += message.ByteSize()
                replied += message.code == averaging_pb2.AVERAGED_PART
                yield message
            if replied and replied == self.tensor_part_reducer.num_parts:  # the member hangs up once it has them all
                await until_the_caller_hangs_up(self.reducer_timeout or HANG_UP_WAIT)
        finally:
            self._replying[context.remote_id] -= 1
            self._settle_replies()

    def settle_disputes(self) -> None:
        """Report the reducers whose averages we refused by direction, once the all-reduce is over. Such a refusal
        is judged against our own part alone, so it counts towards a ban only where the average points clearly
        against our part (below ``ban_cosine``, as a sender's part must: ``robust_aggregation._direction``) and
        another reducer's averages passed the same check: then the group agrees with us and that reducer is the
        odd one out (one that flips the averages it returns is banned by the members it reduces for). An honest
        reducer that left our part out of its span's average, as pointing against the group's median there, sends
        back an average that points slightly away from it (BENCHMARKS.md, "Many peers"). If no other reducer's
        averages passed, we may be the one off (an honest peer in CI refused every reducer's averages for three
        rounds, banned them all and trained alone). Either way the average is refused, and the round's un-averaged
        values make us check our state against the swarm's."""
        for peer_id, problem in self._disputed:
            if problem.counts and not self._agreed:
                problem = BadContribution(problem.kind, f"{problem.detail}; not counted towards a ban: no other "
                                                        f"reducer's averages agreed with our part", counts=False)
            self._on_offense(peer_id, problem)
        self._disputed.clear()

    async def wait_for_replies(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until we have answered every member whose parts we reduce (but silent ones).

        Our own averages can be complete while our replies to others are still being encoded: waiting
        keeps a round's byte counts whole (sent == received across the group) and our reducer's work
        inside the round it belongs to.
        """
        try:
            await asyncio.wait_for(self._replies_done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._silence.stop()

    async def _communicate_with_peer(self, peer_id):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            # our own shard: we are its reducer; keep exactly the bytes the other members receive. Our own part
            # gets the codec's rounding like every part that crossed the wire: a lossy average then does not
            # depend on who reduced which part (and ``diloco-peer simulate`` computes it exactly)
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                if not self._lossless:
                    part = deserialize(self._encode(part))
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                          weight=self.weight)
                if not self._lossless:
                    averaged = deserialize(self._encode(averaged))
                self._register(peer_index, part_index, averaged)
            return
        # as in hivemind, but decoding with our codecs too, and given up on if the reducer goes silent
        try:
            await self._faults.hold_sending(self._allreduce)  # fault injection: crash/freeze_in_allreduce
            self._awaiting.add(peer_id)
            received = await self._silence.unless_silent(peer_id, self._exchange(peer_id, peer_index))
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as e:
            self.tensor_part_container.register_failed_reducer(peer_index)
            if isinstance(e, Exception):  # (hivemind says so at debug level: a partial round named neither)
                logger.warning(f"all-reduce: our exchange with reducer {peer_id} failed: {type(e).__name__}: {e}")
                await self._drop_if_gone(peer_id)
            raise
        finally:
            self._awaiting.discard(peer_id)

    async def _exchange(self, peer_id: PeerID, peer_index: int) -> int:
        """Our parts to reducer ``peer_id`` and its averages back; returns how many averages came."""
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
        if self.should_delay_results(self.peer_id):  # we reduce nothing: answered once our parts are out, or refused
            stream = await replies_after_sending(stream, done_sending)
        return await self._receive_averages(peer_id, peer_index, stream)

    async def _drop_if_gone(self, peer_id: PeerID) -> None:
        """Our exchange with reducer ``peer_id`` failed. If it has not begun to send us its own parts either, and
        our p2pd's connection to it goes away within ``GONE_WITHIN`` seconds, it is gone (a crash mid-round: its
        averager died at once, and the reaper takes its p2pd within half a second): drop it as a sender now.
        hivemind would wait ``sender_timeout`` for parts that never come, the whole group with it (measured:
        BENCHMARKS.md, "Reliability: a member that dies (or freezes) before it sends"). A reducer that stays
        connected (a stream reset while both ends live on) or that begins to send keeps its place. (If we reduce
        nothing, nobody sends to us.)"""
        if not self.parts_for_local_averaging:
            return
        deadline = time.monotonic() + GONE_WITHIN
        while peer_id in self.sender_peer_ids and peer_id not in self.active_senders | self.banned_senders:
            try:
                peers = await asyncio.wait_for(internals.p2p_of(self).list_peers(), GONE_WITHIN)
            except Exception:  # a p2pd that does not answer tells us nothing: hivemind's timeout decides
                return
            if peer_id not in {info.peer_id for info in peers}:
                await self._ban_sender(peer_id)
                return
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.1)

    async def _ban_sender(self, peer_id: PeerID) -> None:
        await super()._ban_sender(peer_id)
        # hivemind's wait for senders that never started (``_handle_missing_senders``, which the round awaits) ends
        # when every sender has started; one dropped before it did has nothing left to wait for
        if self.active_senders | self.banned_senders >= set(self.sender_peer_ids):
            self.all_senders_started.set()

    async def _receive_averages(self, peer_id: PeerID, peer_index: int, stream) -> int:
        """The averages reducer ``peer_id`` sends us, each checked and registered as it comes; returns their number.
        We hang up once they are all in: the reducer waits for that (``p2pd_internals.until_the_caller_hangs_up``)."""
        own_parts = internals.own_input_parts(self, peer_index)
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]

        def _decode(message):
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            try:
                return deserialize(message.tensor_part)
            except Exception as e:
                return BadContribution("malformed", f"undecodable averaged part: {type(e).__name__}: {e}")

        part_index = 0
        replies = amap_in_executor(_decode, aiter_with_timeout(stream, self.reducer_timeout),
                                   max_prefetch=self.tensor_part_container.prefetch)
        try:
            async for averaged in replies:
                try:
                    if isinstance(averaged, BadContribution):
                        raise averaged
                    if part_index >= len(own_parts):
                        raise BadContribution("shape", f"more than the {len(own_parts)} averaged parts expected")
                    check_average(averaged, own_parts[part_index], self._limits)
                except BadContribution as problem:
                    if problem.kind == "direction":
                        self._disputed.append((peer_id, problem))  # judged once all reducers are done
                    else:
                        self._on_offense(peer_id, problem)
                    raise AllreduceException(f"refused the average of reducer {peer_id}: {problem}") from None
                self._register(peer_index, part_index, averaged)
                part_index += 1
                if part_index == expected:
                    self._agreed.add(peer_id)
                    break
        finally:
            await replies.aclose()
            await stream.aclose()
        return part_index

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # as in hivemind, but the reply is the averaged part itself rather than (average - sender's part)
        loop = asyncio.get_event_loop()
        part_index = 0

        def _decode(message):
            try:
                return deserialize(message.tensor_part), message.weight
            except Exception as e:
                return BadContribution("malformed", f"undecodable part: {type(e).__name__}: {e}"), 0.0

        decoded = amap_in_executor(_decode, stream, max_prefetch=self.tensor_part_container.prefetch)
        try:
            async for part, weight in decoded:
                self._faults.crash_now_if_due(self._allreduce)  # fault injection: crash_in_allreduce
                try:
                    if isinstance(part, BadContribution):
                        raise part
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight)
                    part_index += 1
                except BadContribution as problem:
                    self._refuse_sender(self.sender_peer_ids[sender_index], problem)
                    break
                except BannedException:
                    break
                serialized = await loop.run_in_executor(None, self._encode, self._faults.poisoned_reply(averaged))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await internals.ban_sender(self, self.sender_peer_ids[sender_index])
                # hivemind answers a member that reduces nothing only once its stream has ended; we read no more
                # of it, so end it here: else that answer, our round's last reply, waited for reducer_timeout
                # (delayed_results.py)
                await decoded.aclose()
                await stream.aclose()
            else:
                self._delivered.add(self.sender_peer_ids[sender_index])


def _flat_twin(inputs, outputs) -> torch.Tensor | None:
    """``outputs`` as one flat tensor whose offsets are those of ``inputs`` (both ``flat_tensors`` of the same
    shapes), or None if they are not laid out so (e.g. a copy of the inputs: then parts are kept as they come)."""
    if not outputs or len(outputs) != len(inputs):
        return None
    storages = {t.untyped_storage().data_ptr() for t in inputs}, {t.untyped_storage().data_ptr() for t in outputs}
    if len(storages[0]) != 1 or len(storages[1]) != 1:
        return None
    if any(i.shape != o.shape or i.storage_offset() != o.storage_offset() or not i.is_contiguous()
           for i, o in zip(inputs, outputs)):
        return None
    total = outputs[0].untyped_storage().nbytes() // outputs[0].element_size()
    return outputs[0].new_empty(0).set_(outputs[0].untyped_storage(), 0, (total,), (1,))

"""Handing in: a volunteer too slow for the swarm's all-reduce gives its pseudo-gradient to a fast peer (its proxy),
which averages it in with its own, and takes the round's average back from it.

Why: a member's all-reduce runs at its own pace. Every member sends its parts and receives the averages at the pace
of its CPU and link, and a reducer answers a part only once every member's copy of it is in, so the whole group's
all-reduce ends when the slowest member's parts are through: a peer at a sliver of a core held every round of the fast
peers (BENCHMARKS.md, "Unequal volunteers"). Reducing less (``vector_split.paced_bandwidths``) does
not remove what it sends. Handed in ahead of the round, its sending is off everyone's critical path:

1. the slow peer S (``rounds/pace.py``, ``Pace.proxies``) sends its pseudo-gradient and its tokens to a proxy P as
   soon as its inner steps are done (``hand_in``, P's ``rpc_hand_in``), and says it is ready only then, naming P
   (``ProgressRecord.hands_to``). P's gate waits for S's "ready" as for any peer's, so P's all-reduce starts with
   the hand-in in P's hands; no gate counts S in the group it expects;
2. P checks it against its own pseudo-gradient (finite, a sane weight, a norm within ``averaging.max_update_ratio``
   of P's own, a direction not against P's: ``averaging.ban_cosine``; a refused one is an offense) and sends the
   weighted mean of the two, under the sum of their weights (``HandIns.fold``): the group's average is what it
   would have been with S a member (robust aggregation clips a part's weight to the group's median, so S's tokens
   may count for less there);
3. S asks P for the round's average (``fetch``, P's ``rpc_hand_back``). P answers once its all-reduce of the round
   ended: with the average it got, if the round was clean (the one every member got, bit for bit, so S's outer step
   leaves its replica where the others' are), else with nothing, and S heals as a peer whose round failed
   (``rounds/healing.py``).

A proxy keeps at most ``MAX_PER_ROUND`` hand-ins a round (each a copy of the model's fp32 vector), for its current
round or the next only; one from a peer it refuses (banned, not admitted), for a round it has begun already, or for
another round is refused, and S then joins the all-reduce as any member (``rounds/exchange.py``). A proxy that
leaves gives the peers that handed in to it time to take their answers (``HandIns.owes``) before its averager stops.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator  # not collections.abc: hivemind reads the handler type by its typing name

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming

from ..swarm.p2pd_internals import until_the_caller_hangs_up
from . import hivemind_internals as internals
from . import traffic
from .compression import deserialize
from .state_transfer import tensor_messages
from .robust_aggregation import BadContribution, Limits, check_arrival, vector_norm, weighted_mean

logger = logging.getLogger(__name__)

MAX_PER_ROUND = 2
"""Hand-ins a proxy takes in one round: each is held as a copy of the model's fp32 vector until its round ends."""
KEEP_RESULTS = 2
"""Rounds whose averages a proxy keeps for the peers that handed in (the last ones; S fetches it at once)."""


@dataclass
class HandedIn:
    peer: str
    """The base58 id of the peer that handed it in."""
    tensors: list[torch.Tensor]
    weight: float
    """Its tokens (the weight a member's pseudo-gradient has in the all-reduce)."""


class HandIns:
    """The proxy's side, in its averager process: the hand-ins of each round and the average each round ended with.

    :param limits: the bounds a hand-in is checked against (``max_update_ratio``, ``max_weight_ratio``,
      ``ban_cosine``)
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.epoch = -1
        """The round our averager runs now (``round_begins``)."""
        self.began = False
        """Its all-reduce began: a hand-in for it comes too late."""
        self.waiting: dict[int, list[HandedIn]] = {}
        self.results: dict[int, tuple[list[torch.Tensor] | None, int, set[str]]] = {}
        """epoch -> (the average, or None: not clean; the group's size; the peers that handed in, who get it)."""
        self.owed: dict[int, set[str]] = {}
        """epoch -> the peers that handed it in and have not taken its answer yet (a leaving proxy waits for them)."""
        self._ended: dict[int, asyncio.Event] = {}

    def round_begins(self, epoch: int) -> None:
        """Our averager is told the round of ``epoch`` comes next: hand-ins for earlier rounds are dropped."""
        if epoch != self.epoch:
            self.epoch, self.began = epoch, False
        for old in [e for e in self.waiting if e < epoch]:  # rounds we skipped (a state sync): no average for them
            self._settle(old, None, 0)

    def refusal(self, peer: str, epoch: int, weight: float) -> str:
        """Why a hand-in of ``peer`` for the round of ``epoch`` is not taken ("" if it is)."""
        if epoch < self.epoch or (epoch == self.epoch and self.began):
            return f"late: our all-reduce of round {self.epoch} has begun"
        if epoch > self.epoch + 1:  # (each round held would be memory a stranger could fill)
            return f"round {epoch} is not ours: we run round {self.epoch}, or the next"
        if not (math.isfinite(weight) and weight > 0):
            return f"weight {weight!r} (must be finite and positive)"
        handed = self.waiting.get(epoch, [])
        if any(h.peer == peer for h in handed):
            return f"handed in round {epoch} already"
        if len(handed) >= MAX_PER_ROUND:
            return f"full: {MAX_PER_ROUND} hand-ins for round {epoch} already"
        return ""

    def take(self, handed: HandedIn, epoch: int) -> None:
        self.waiting.setdefault(epoch, []).append(handed)

    def fold(self, own: list[torch.Tensor], weight: float, report) -> tuple[list[torch.Tensor], float, int]:
        """What we send in the all-reduce of this round: ``own`` (weighing ``weight``) averaged with the hand-ins
        that pass the checks, and the sum of their weights; (own, weight, 0) with none. ``report(peer, problem)``
        counts a refused hand-in as an offense. Called again for a retry of the all-reduce: the same result."""
        self.began = True
        kept = []
        own_norm = vector_norm(own)
        for handed in self.waiting.get(self.epoch, []):
            problem = check(handed, own, own_norm, weight, self.limits)
            if problem is None:
                kept.append(handed)
            else:
                report(handed.peer, problem)
        if not kept:
            return own, weight, 0
        mixed = [weighted_mean({0: (tensor, weight)} | {s: (h.tensors[i], h.weight) for s, h in enumerate(kept, 1)},
                               like=tensor) for i, tensor in enumerate(own)]
        return mixed, weight + sum(h.weight for h in kept), len(kept)

    def ended(self, averaged: list[torch.Tensor] | None, group_size: int) -> None:
        """Our all-reduce of this round ended: ``averaged`` (None: not clean) is what the peers that handed in get."""
        self._settle(self.epoch, averaged, group_size)

    def no_all_reduce(self, epoch: int) -> None:
        """We run no all-reduce for the round of ``epoch`` (our gate found no other member, or we dropped the round):
        the peers that handed it in hear so now, not when their wait ends, and later hand-ins for it are refused. (A
        proxy whose only members handed in waited for their round's end while they waited for its average.)"""
        if epoch >= self.epoch:
            self.epoch, self.began = epoch, True
        self._settle(epoch, None, 0)

    def step_ended(self) -> None:
        """Our step of this round is over, whether or not an all-reduce ran: nobody waits for an average any
        longer than this."""
        self._settle(self.epoch, None, 0)

    async def result(self, epoch: int, peer: str, timeout: float) -> tuple[list[torch.Tensor] | None, int]:
        """The average of the round of ``epoch`` for ``peer``, which handed it in: (the average, the group's size)
        once that round ended, ``timeout`` at most; (None, 0) if it ended unclean, not in time, or ``peer`` handed
        nothing in to it."""
        if epoch not in self.results:
            try:
                await asyncio.wait_for(self._event(epoch).wait(), timeout)
            except asyncio.TimeoutError:
                return None, 0
        averaged, group_size, peers = self.results.get(epoch, (None, 0, set()))
        return (averaged, group_size) if peer in peers else (None, 0)

    def _settle(self, epoch: int, averaged: list[torch.Tensor] | None, group_size: int) -> None:
        """The round of ``epoch`` is over for the peers that handed in to it: they get ``averaged`` (None: nothing)."""
        handed = self.waiting.pop(epoch, None)
        if handed is not None:
            self.results[epoch] = (averaged, group_size, {h.peer for h in handed})
            self.owed[epoch] = {h.peer for h in handed}
            for old in sorted(self.results)[:-KEEP_RESULTS]:
                del self.results[old]
                self.owed.pop(old, None)
        self._event(epoch).set()

    def answered(self, epoch: int, peer: str) -> None:
        """``peer`` took the answer for the round of ``epoch`` (or hung up, or is gone): we owe it nothing more."""
        self.owed.get(epoch, set()).discard(peer)

    def owes(self) -> int:
        """How many answers the peers that handed in have not taken yet."""
        return sum(len(peers) for peers in self.owed.values())

    def _event(self, epoch: int) -> asyncio.Event:
        for old in [e for e in self._ended if e < epoch - KEEP_RESULTS]:
            del self._ended[old]
        return self._ended.setdefault(epoch, asyncio.Event())


def check(handed: HandedIn, own: list[torch.Tensor], own_norm: float, weight: float,
          limits: Limits) -> BadContribution | None:
    """What is wrong with a hand-in, measured against our own pseudo-gradient ``own`` (None: nothing). A hand-in
    is a light contribution (a slow peer's few steps): its direction is refused only where it points clearly against
    ours (``ban_cosine``), as a reducer judges a light part (``robust_aggregation.aggregate``)."""
    if len(handed.tensors) != len(own):
        return BadContribution("shape", f"a hand-in of {len(handed.tensors)} tensors, not our {len(own)}")
    try:  # what a reducer checks of a part as it arrives: shape, dtype, finite values, a sane weight
        for tensor, ours in zip(handed.tensors, own):
            check_arrival(tensor, ours.shape, handed.weight, limits)
    except BadContribution as problem:
        return problem
    if limits.max_weight_ratio and handed.weight > limits.max_weight_ratio * max(weight, 1e-12):
        return BadContribution("weight", f"a hand-in of weight {handed.weight:g}, {handed.weight / weight:.0f}x ours "
                                         f"(averaging.max_weight_ratio={limits.max_weight_ratio:g})")
    norm = vector_norm(handed.tensors)
    if limits.max_update_ratio and norm > limits.max_update_ratio * max(own_norm, 1e-12):
        return BadContribution("norm", f"a hand-in of norm {norm:.3g}, {norm / max(own_norm, 1e-12):.0f}x ours "
                                       f"(averaging.max_update_ratio={limits.max_update_ratio:g})")
    dot = sum(float(torch.dot(h.flatten().double(), o.flatten().double())) for h, o in zip(handed.tensors, own))
    cosine = dot / max(norm * own_norm, 1e-30)
    if cosine < limits.ban_cosine:
        return BadContribution("direction", f"a hand-in whose cosine with ours is {cosine:.2f} "
                                            f"(averaging.ban_cosine={limits.ban_cosine:g})")
    return None


async def receive(averager, stream, shapes: list[torch.Size], timeout: float) -> tuple[dict, list[torch.Tensor]]:
    """The metadata and tensors of a stream of ``state_transfer.tensor_messages`` (``timeout``: the wait for each
    message). Raises if it is malformed or breaks off: tensors not of ``shapes`` (fp32) or fewer, more bytes than
    such tensors take (a stranger's stream is held in memory), no metadata, no end mark."""
    metadata, tensors, parts = None, [], []
    ended = False
    budget = 4 * sum(s.numel() for s in shapes) + 2**20  # (fp32 values, and room for the messages' framing)
    async for message in aiter_with_timeout(stream, timeout=timeout):
        budget -= message.ByteSize()
        if budget < 0:
            raise ValueError(f"more bytes than the {len(shapes)} tensors of our pseudo-gradient take")
        if not message.metadata and not message.HasField("tensor_part"):
            ended = True
            break
        if message.metadata:
            metadata = averager.serializer.loads(message.metadata)
        if not message.HasField("tensor_part"):
            continue
        if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
            tensors.append(deserialize(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
        if len(tensors) > len(shapes):
            raise ValueError(f"more than the {len(shapes)} tensors of our pseudo-gradient")
    if parts:
        tensors.append(deserialize(combine_from_streaming(parts)))
    if not ended or not isinstance(metadata, dict):
        raise ValueError("the stream broke off" if not ended else "no metadata")
    if len(tensors) != len(shapes) and tensors:
        raise ValueError(f"{len(tensors)} tensors, not the {len(shapes)} of our pseudo-gradient")
    if any(t.shape != s or t.dtype != torch.float32 for t, s in zip(tensors, shapes)):
        raise ValueError("tensors not shaped like our pseudo-gradient (fp32)")
    return metadata, tensors


async def serve_hand_in(averager, requests, peer: str):
    """In the proxy's averager process (``rpc_hand_in``): take a hand-in from ``peer`` and answer whether it was
    taken (metadata ``{"taken": bool, "why": str}``)."""
    shapes = [t.shape for t in averager.inputs]
    why = ""
    try:
        metadata, tensors = await receive(averager, requests, shapes, averager.request_timeout * 10)
        epoch, weight = int(metadata["epoch"]), float(metadata["tokens"])
        _, why = averager.members.refusal_of(peer, metadata)
        why = why or averager.hand_ins.refusal(peer, epoch, weight) or ("" if tensors else "no tensors")
        if not why:
            averager.hand_ins.take(HandedIn(peer, tensors, weight), epoch)
            logger.info(f"took the hand-in of {peer[-8:]} for round {epoch} ({weight:g} tokens)")
    except Exception as e:
        why = f"a malformed hand-in: {type(e).__name__}: {e}"
    if why:
        logger.info(f"refused the hand-in of {peer[-8:]}: {why}")
    yield averaging_pb2.DownloadData(metadata=averager.serializer.dumps({"taken": not why, "why": why}))
    await until_the_caller_hangs_up()


async def hand_in(averager, proxy: str, epoch: int, tokens: float, proof: bytes, timeout: float) -> str:
    """In the slow peer's averager process: send what we would send in an all-reduce (``averager._sent()``) to a
    proxy for the round of ``epoch``; why it was not taken ("" if it was)."""
    metadata = {"epoch": epoch, "tokens": tokens, "proof": proof}
    started = time.perf_counter()
    outgoing = tensor_messages(averager, averager._sent(), metadata)

    async def sent():
        for message in outgoing:
            averager.traffic[traffic.SENT] += message.ByteSize()
            yield message

    replies = await asyncio.wait_for(averager._stub_for(PeerID.from_base58(proxy)).rpc_hand_in(sent()), timeout)
    try:
        reply = await asyncio.wait_for(anext(replies), timeout)
    finally:
        await replies.aclose()
    answer = averager.serializer.loads(reply.metadata) if reply.metadata else {}
    why = answer.get("why", "no answer") if isinstance(answer, dict) else "a malformed answer"
    seconds = time.perf_counter() - started
    averager.traffic[traffic.TRANSFER_US] += int(seconds * 1e6)  # (our round's work: ``RoundExchange._hand_in``)
    logger.debug(f"hand-in for round {epoch}: {seconds:.2f}s, {why or 'taken'}")
    return str(why) if not (isinstance(answer, dict) and answer.get("taken") is True) else ""


async def serve_result(averager, raw: bytes, peer: str):
    """In the proxy's averager process (``rpc_hand_back``): the average of the round the request names, for a peer
    that handed in; once the round ended, metadata ``{"group_size": n}`` and the tensors (none: no clean average)."""
    try:
        asked = averager.serializer.loads(raw)
        epoch, wait = int(asked["epoch"]), min(float(asked["wait"]), 600.0)
    except Exception:
        return
    averaged, group_size = await averager.hand_ins.result(epoch, peer, wait)
    try:
        for message in tensor_messages(averager, averaged or [], {"group_size": group_size if averaged else 0}):
            yield message
        await until_the_caller_hangs_up()
    finally:  # the caller hung up, with everything or gone: a leaving proxy need not wait for it any longer
        averager.hand_ins.answered(epoch, peer)


async def fetch(averager, proxy: str, epoch: int, wait: float) -> int:
    """In the slow peer's averager process: the average of the round of ``epoch`` from the proxy we handed in to,
    written to ``averaged_tensors``, once its round ended (``wait`` at most); the size of the group it was averaged
    in (0: no clean average came, and they are untouched)."""
    request = averaging_pb2.DownloadData(metadata=averager.serializer.dumps({"epoch": epoch, "wait": wait}))
    stream = await asyncio.wait_for(averager._stub_for(PeerID.from_base58(proxy)).rpc_hand_back(request),
                                    averager.request_timeout * 10)

    first = []  # when the first message came: the proxy's round had ended

    async def counted():
        async for message in stream:
            if not first:
                first.append(time.perf_counter())
            averager.traffic[traffic.RECEIVED] += message.ByteSize()
            yield message
    try:
        metadata, tensors = await receive(averager, counted(), [t.shape for t in averager.inputs],
                                          wait + averager.request_timeout * 10)
    finally:  # we hang up first, the proxy waits for it (p2pd_internals.until_the_caller_hangs_up)
        await stream.aclose()
        if first:
            averager.traffic[traffic.TRANSFER_US] += int((time.perf_counter() - first[0]) * 1e6)
    group_size = metadata.get("group_size")
    if not tensors or type(group_size) is not int or group_size < 2:
        return 0
    async with enter_asynchronously(averager.get_tensors()) as averaged:
        for target, tensor in zip(averaged, tensors):
            target.copy_(tensor)
    return group_size


class HandInService:
    """``PseudoGradientAverager``'s part in handing in: the proxy's calls (``rpc_hand_in``, ``rpc_hand_back``) and
    the slow peer's (``hand_in_to``, ``fetch_average``, from the host process). Its averager keeps the proxy's
    ``hand_ins`` (``HandIns``) and folds them into its all-reduce."""

    async def rpc_hand_in(self, requests: AsyncIterator[averaging_pb2.DownloadData],
                          context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in serve_hand_in(self, requests, context.remote_id.to_base58()):
            yield message

    async def rpc_hand_back(self, request: averaging_pb2.DownloadData,
                            context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in serve_result(self, request.metadata, context.remote_id.to_base58()):
            yield message

    def hand_in_to(self, proxy: str, epoch: int, tokens: float, proof: bytes, timeout: float) -> str:
        """From the host process: hand what ``inputs`` holds in to ``proxy`` for the round of ``epoch``; why it was
        not taken ("" if it was). Blocks (call it through ``lifecycle.hivemind_calls``)."""
        return self.with_peer(hand_in, proxy, epoch, tokens, proof, timeout)

    def no_all_reduce(self, epoch: int) -> None:
        """From the host process: we run no all-reduce for the round of ``epoch`` (``HandIns.no_all_reduce``).
        Blocks (call it through ``lifecycle.hivemind_calls``)."""
        future = MPFuture()
        internals.send_to_averager_process(self, "_no_all_reduce", epoch, future=future)
        future.result()

    async def _no_all_reduce(self, epoch: int, future: MPFuture) -> None:
        self.hand_ins.no_all_reduce(epoch)
        future.set_result(None)

    def hand_backs_owed(self) -> int:
        """From the host process: answers the peers that handed in to us have not taken yet (``HandIns.owes``).
        Blocks (call it through ``lifecycle.hivemind_calls``)."""
        future = MPFuture()
        internals.send_to_averager_process(self, "_hand_backs_owed", future=future)
        return future.result()

    async def _hand_backs_owed(self, future: MPFuture) -> None:
        future.set_result(self.hand_ins.owes())

    def fetch_average(self, proxy: str, epoch: int, wait: float) -> int:
        """From the host process: the average of the round of ``epoch`` from ``proxy``, written to
        ``averaged_tensors`` (``fetch``); the size of its group, 0 if no clean average came. Blocks."""
        return self.with_peer(fetch, proxy, epoch, wait)

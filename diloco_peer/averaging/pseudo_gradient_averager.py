"""The hivemind averager we run: ``DecentralizedAverager`` extended by subclassing rather than forking.

It lives in its own process (hivemind forks it) and adds to hivemind's matchmaking and butterfly all-reduce:

- **exact results**: its groups run ``allreduce.ExactAllReduceRunner`` (averages instead of deltas, our
  codecs, byte counts, checked numbers), over a split of the vector that no member can bend by declaring a
  huge bandwidth, paced by its members' speeds (``vector_split.py``);
- **who takes part** (``membership.py``): a group member or a state download must pass admission
  (``swarm/admission.py``: swarm secret, allowlist) and must not be banned (``robust_aggregation.BanList``: peers
  whose contributions were refused repeatedly); matchmaking skips leaders we refuse. Offenses cross to the host
  process through a queue;
- **complete groups start at once**: told how many peers the round expects (``expect_group``), a group we lead
  begins its all-reduce as soon as they are all in, not at the end of the matchmaking window (after a grace if
  a follower may be gone: ``assembly_grace.py``);
- **state serving**: it serves this peer's state and downloads the state of one chosen donor (``state_sync.py``);
- **member news** (``member_news.py``): "still there?" answered, "the round's last peer is ready" sent and heard.

hivemind's private API is reached through ``hivemind_internals.py``; the private methods overridden here are
listed in its inventory.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from typing import AsyncIterator  # not collections.abc: hivemind reads the handler type by its typing name

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from ..config.faults import NO_FAULTS, Faults
from ..swarm.admission import Admission
from ..swarm.p2pd_internals import until_the_caller_hangs_up
from ..training.outer_optimizer import flat_tensors
from . import hivemind_internals as internals
from . import assembly_grace, hand_in, leader_search, round_log, state_transfer, traffic, vector_split
from .allreduce import ExactAllReduceRunner
from .member_news import MemberNews
from .membership import Membership
from .robust_aggregation import BanList, Limits

logger = logging.getLogger(__name__)


class PseudoGradientAverager(hand_in.HandInService, DecentralizedAverager):
    """hivemind's averager with exact (non-delta) results, byte counters, admission and bans.

    It also serves and fetches the peer's state (see ``state_sync.py``): ``state_provider`` is called in
    this (host) process whenever another peer downloads our state, and ``download_state_from`` fetches
    the state of one chosen donor, where hivemind's ``load_state_from_peers`` always picks the donor itself.

    :param limits: the bounds every incoming part and average is checked against
    :param admission: who may join our groups and download our state
    :param bans: the ban list (enforced in the averager process)
    :param progress_key: the DHT key of the swarm's progress records; in a swarm closed by a secret, only
      peers with a record there may download our state (only secret holders can write to that DHT)
    :param faults: fault injection, for the tests only (``config/faults.py``); crosses into the averager process
    :param inputs: the buffers (in shared memory, shaped like ``averaged_tensors``) that hold what we send in an
      all-reduce; the averages are written to ``averaged_tensors``. Default: new ones. ``averaged_tensors`` itself
      (the same list): the average is written over what we sent, part by part as each is known (a part's average
      arrives only after its reducer had our part of it), and an all-reduce that fails once it has begun is not
      tried again, since what it would send is no longer ours (``RoundAverager(in_place=True)``)
    """

    def __init__(self, averaged_tensors, dht: DHT, *, limits: Limits = Limits(), admission: Admission = Admission(),
                 bans: BanList | None = None, progress_key: str = "", faults: Faults = NO_FAULTS,
                 inputs: list[torch.Tensor] | None = None, **kwargs):
        self.in_place = inputs is averaged_tensors
        """The average is written over what we sent: no retry once an all-reduce began (``_run_allreduce_inplace_``)."""
        self.inputs = inputs if inputs is not None else flat_tensors([t.shape for t in averaged_tensors], shared=True)
        self.serving = state_transfer.serving_table()
        """The downloads of our state being served (``state_transfer.py``), shared with the host."""
        self.served = state_transfer.ServedStates(self)
        """The host's side of those downloads: ``state_provider`` opens one, an outer step freezes them."""
        self.frozen_serves: dict[int, tuple] = {}
        """In the averager process: slot -> (generation, start, copies) for downloads whose state changed."""
        self.round_log: dict[int, tuple[str, list]] = {}
        """In the averager process: epoch -> (state hash before, update) of the rounds logged for a peer that is
        behind (``averaging/round_log.py``); the host sends them."""
        self.replayed_at = torch.zeros(1, dtype=torch.float64).share_memory_()
        """``time.time()`` of the last download of logged rounds we served, shared with the host."""
        self.traffic = traffic.counters()
        """What our all-reduces cost (``traffic.py``), shared with the host."""
        self.news = MemberNews()
        """"The round's last peer is ready", heard and told (``member_news.py``)."""
        self.hand_ins = hand_in.HandIns(limits)
        """As a proxy, in the averager process: what slow peers handed in to us, and their rounds' averages."""
        self.state_provider = None
        self.limits = limits
        self.faults = faults
        self.bans = bans if bans is not None else BanList(ban_after=2, ban_seconds=600.0)
        self.members = Membership(admission, self.bans, progress_key, self.serializer)
        """Who may be in our groups, lead the groups we join and download our state (``membership.py``)."""
        self.offenses = mp.Queue()
        """(peer id, kind, detail, banned now) for every refused contribution, read by the host process."""
        self.allreduces = 0
        """All-reduces this averager has started (in its process), the current one included."""
        self._step_control = None
        """The step being run (hivemind's ``StepControl``, in the averager process), for ``forbid_retries``."""
        self._join_arrivals: dict[int, float] = {}
        """When each join request we are handling (by id of its context) reached us, in its process."""
        super().__init__(averaged_tensors, dht, **kwargs)

    # --- who takes part

    def _report(self, peer_id: PeerID, kind: str, detail: str, counts: bool = True) -> None:
        # in the averager process: count the offense (``counts``: see ``BadContribution``), ban a repeat offender,
        # tell the host
        peer = peer_id.to_base58()
        banned_now = self.bans.record(peer) if counts else False
        logger.warning(f"refused a contribution of peer {peer}: {kind}: {detail}"
                       + (f"; banned for {self.bans.ban_seconds:g}s" if banned_now else ""))
        self.offenses.put((peer, kind, detail, banned_now))

    def _report_hand_in(self, peer: str, problem) -> None:
        self._report(PeerID.from_base58(peer), problem.kind, problem.detail, problem.counts)

    def _refuses_leader(self, leader: PeerID) -> bool:
        return self.members.refuses(leader.to_base58())

    async def _step(self, **kwargs):
        # hivemind's matchmaking asks every leader it finds in the DHT; a banned or unadmitted one would take
        # us into its group and we would then refuse to average (the round lost). Ask the next leader instead.
        internals.patch_join_requests(self, self._refuses_leader)
        internals.reject_stale_join_requests(self, lambda context: self._join_arrivals.get(id(context)))
        internals.grow_target_with_followers(self, lambda request: self.members.expected(request.gather))
        internals.leave_out_before_assembly(self, lambda requests: self.members.left_out(requests, self.peer_id))
        leader_search.pace(self)  # a leader no longer reads the DHT back to back while it gathers its group
        self._step_control = kwargs.get("step")  # (see _refuse_group)
        try:
            return await super()._step(**kwargs)
        finally:
            self.hand_ins.step_ended()

    def expect_group(self, size: int | None, group_bits: str | None = None, nudge: list[str] = ()) -> None:
        """From the host process, before a step: a group we lead starts its all-reduce once ``size`` members (us
        included) are in, not at the step's scheduled time; ``None`` gathers until then (hivemind's way).
        ``group_bits``: also the matchmaking key's bits (hivemind's ``set_group_bits``), in the same message: one
        trip through the pipe per round instead of two. ``nudge``: peers (base58) to tell, in the background, that
        the round's last peer is ready (``MemberNews.tell``).

        The scheduled time stays the upper bound: a group still short of ``size`` then starts with whoever came
        (``min_group_size`` at least). A group that reached ``size`` turns later peers away (hivemind's
        ``GROUP_IS_FULL``); they look for another group within their step's timeout. Blocks until the averager
        process took it (call it through ``lifecycle.hivemind_calls``, as every wait on that process).
        """
        if size is not None and size < 2:
            raise ValueError(f"a group needs at least 2 members, got expected size {size}")
        future = MPFuture()
        internals.send_to_averager_process(self, "_expect_group", size, group_bits, list(nudge), future=future)
        future.result()

    async def _expect_group(self, size: int | None, group_bits: str | None, nudge: list[str],
                            future: MPFuture) -> None:
        try:
            self.news.tell(nudge, self._stub_for)
            if group_bits is not None:
                await internals.set_group_bits_here(self, group_bits)
                self.hand_ins.round_begins(int(group_bits, 2))
            internals.set_target_group_size(self, size)
            assembly_grace.round_begins(self, size)
            future.set_result(None)
        except BaseException as e:
            if not future.done():
                future.set_exception(e)

    def _stub_for(self, peer: PeerID):
        """In the averager process: our stub for ``peer``'s averager (the same class, the same prefix)."""
        return type(self).get_stub(internals.p2p_of(self), peer, namespace=self.prefix)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        kind, why = self.members.refusal(context.remote_id, request.gather)
        if why:
            if kind != "banned":  # a banned peer knocking again is not a new offense
                self._report(context.remote_id, kind, why)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return  # (no wait for the hang-up: a refused peer is refused whether or not this word reaches it)
        self._join_arrivals[id(context)] = time.monotonic()  # see internals.reject_stale_join_requests
        try:
            async for message in super().rpc_join_group(request, context):
                yield message
        finally:
            self._join_arrivals.pop(id(context), None)
        # the follower hangs up once it has our last word (hivemind's request_join_group closes the stream): our
        # hanging up first could lose that word (BEGIN_ALLREDUCE), and the follower would miss a group it is in
        await until_the_caller_hangs_up()

    def report_offense(self, peer: str, kind: str, detail: str) -> None:
        """From the host process: count an offense found there (e.g. a corrupt state download) towards a ban."""
        internals.send_to_averager_process(self, "_report_from_host", peer, kind, detail)

    async def _report_from_host(self, peer: str, kind: str, detail: str) -> None:
        self._report(PeerID.from_base58(peer), kind, detail)

    # --- member news (``member_news.py``)

    async def rpc_still_there(self, request: averaging_pb2.DownloadRequest,
                              context: P2PContext) -> averaging_pb2.DownloadRequest:
        """Answers at once: a member of our all-reduce asks before it drops us as silent (``member_silence.py``)."""
        return averaging_pb2.DownloadRequest()

    async def rpc_round_ready(self, request: averaging_pb2.DownloadRequest,
                              context: P2PContext) -> averaging_pb2.DownloadRequest:
        """Another peer found every peer of its round ready: our gate should read the records now."""
        self.news.heard()
        return averaging_pb2.DownloadRequest()

    # --- state serving

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in self._serve_state(context, start=0):
            yield message

    async def rpc_download_state_from(self, request: averaging_pb2.DownloadData,
                                      context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Our state from tensor ``start`` on (in the request's metadata): the rest of a download that another donor
        broke off (``state_transfer.download``)."""
        try:
            start = self.serializer.loads(request.metadata).get("start")
        except Exception:
            start = None
        if type(start) is not int or not 0 <= start < 2 * len(self.inputs):
            logger.warning(f"refused a state download from {context.remote_id.to_base58()}: a bad start")
            return
        async for message in self._serve_state(context, start):
            yield message

    async def rpc_download_rounds(self, request: averaging_pb2.DownloadData,
                                  context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The rounds we logged after the state the request names (``averaging/round_log.py``): the updates that take a
        peer one or a few rounds behind to our state, instead of the whole state."""
        if await self.members.refuses_download(context.remote_id.to_base58(), self.dht) or not self.allow_state_sharing:
            return
        async for message in round_log.serve(self, request.metadata):
            yield message

    async def _declare_for_download_periodically(self) -> None:
        """Declares nothing. hivemind stores every averager under ``<prefix>.all_averagers`` for its own
        ``load_state_from_peers``, which we never call: donors are found by their progress records
        (``state/state_sync.py``). So each store was a DHT write per peer and ``declare_state_period`` that nobody
        read, and one that outlasted its timeout (a DHT process starved in a loaded swarm) was logged as a task
        exception never retrieved: hivemind starts each store as a task it never awaits."""

    async def _keep_round(self, epoch: int, state_hash: str, update: list | None, keep: int) -> None:
        round_log.keep(self, epoch, state_hash, update, keep)

    async def _serve_state(self, context: P2PContext, start: int) -> AsyncIterator[averaging_pb2.DownloadData]:
        if await self.members.refuses_download(context.remote_id.to_base58(), self.dht):
            return
        await self.faults.delay_serving()  # fault injection: a slow donor
        if not self.allow_state_sharing:
            return  # (as hivemind's own handler: the downloader tries its next donor)
        # the host's state provider (state_sync.py) hands the live tensors and the (slot, generation) of this
        # download (hivemind pads a provider's answer without one with None: tensors that never change)
        metadata, tensors, slot = await internals.state_from_host(self)
        async for message in state_transfer.serve(self, metadata, tensors, slot, start):
            yield message

    async def _freeze_serve(self, slot: int, generation: int, start: int, copies: list[torch.Tensor]) -> None:
        state_transfer.keep_frozen(self, slot, generation, start, copies)

    def get_current_state(self):
        if self.state_provider is None:
            raise RuntimeError("this peer has no state to share yet")
        self.served.opened = None  # (hivemind asks for one state at a time, from one thread of ours)
        metadata, tensors = self.state_provider()
        return metadata, tensors, self.served.opened

    def download_state_from(self, donor: str, timeout: float, **resume) -> tuple[dict, list[torch.Tensor], int]:
        """Download ``donor``'s state: (metadata, tensors, bytes received). Raises on failure or silence.
        ``timeout`` bounds the wait for each chunk, not the whole download. ``resume``: ``into``, ``resume`` and
        ``expected`` of ``state_transfer.download``."""
        return self.with_peer(state_transfer.download, donor, timeout, **resume)

    def with_peer(self, call, peer: str, *args, **kwargs):
        """From the host process: ``await call(averager, peer, *args, **kwargs)`` run in the averager process, for a
        ``peer`` (base58) we do not refuse (banned, not admitted); its result. Raises a one-line ``RuntimeError`` on
        failure. Blocks (call it through ``lifecycle.hivemind_calls``)."""
        future = MPFuture()
        internals.send_to_averager_process(self, "_call_with_peer", call, peer, args, kwargs, future=future)
        return future.result()

    async def _call_with_peer(self, call, peer: str, args: tuple, kwargs: dict, future: MPFuture) -> None:
        try:
            if self.members.refuses(peer):
                raise RuntimeError(f"peer {peer} is banned or not admitted")
            future.set_result(await call(self, peer, *args, **kwargs))
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"{type(e).__name__}: {e}".strip(": ")))

    # --- the all-reduce

    def _fair_fractions(self, group_info) -> tuple[int, ...]:
        # hivemind's split of the vector, but not by what members declare alone: vector_split.py
        return vector_split.split(self.total_size, self.members.declared(group_info),
                                  self.allreduce_kwargs["min_vector_size"])

    def _member_limits(self, group_info) -> Limits:
        """Our checks of this group's averages: ``Limits.for_member``, by the tokens each member gathered."""
        tokens = self.members.tokens(group_info)
        return self.limits.for_member(tokens, tokens[group_info.peer_ids.index(self.peer_id)])

    async def _refuse_group(self, group_info, group_id: bytes) -> None:
        # a leader let in a peer we refuse (or is one; leaders leave out banned peers, see group_bans.py, but one
        # may not): we average with nobody in this group, and say so at once, so that nobody waits for us
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            kind, why = self.members.refusal(peer_id, gathered) if peer_id != self.peer_id else ("", "")
            if why:
                if kind != "banned":
                    self._report(peer_id, kind, why)
                error = AllreduceException(f"refused to average with this group: {why}")
                running = internals.running_group(self, group_id)
                running.set_exception(error)  # members that send us their parts get an error now
                running.exception()  # retrieved: nobody may ask, and asyncio would log it as lost
                others = [p for p in group_info.peer_ids if p != self.peer_id]
                await asyncio.gather(*(self._withdraw_from(p, group_id) for p in others))
                # and no retry: its matchmaking would clear hivemind's "groups registered" event, and a member whose
                # part reaches us only now would wait on it for a group that is gone (a reducer timeout), where
                # without it the part is answered BAD_GROUP_ID at once
                internals.forbid_retries(self._step_control)
                raise error

    async def _withdraw_from(self, peer_id: PeerID, group_id: bytes) -> None:
        """Tell ``peer_id`` we send no parts in group ``group_id``: hivemind's reducer drops a sender whose stream
        opens with anything but a part (here CANCELLED), instead of waiting a sender timeout for it."""
        try:
            replies = await self._stub_for(peer_id).rpc_aggregate_part(
                as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED, group_id=group_id)))
            await asyncio.wait_for(anext(replies), timeout=5.0)
        except Exception as e:  # gone, or done already: nothing is waiting for us there
            logger.debug(f"withdrawing from group at {peer_id}: {e!r}")

    def _sent(self) -> list[torch.Tensor]:
        """What we send in an all-reduce: ``inputs``, or (fault injection) a poisoned copy of them."""
        if self.faults.poison_kind in ("nan", "signflip", "scale"):
            poisoned = [t.clone() for t in self.inputs]
            self.faults.poison(poisoned)  # a broken or malicious peer's pseudo-gradient; our own stays as it is
            return poisoned
        return list(self.inputs)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        # hivemind's, changed: our runner, exact averages written (not deltas added), our checks and counters
        started = time.perf_counter()
        group_id = group_info.group_id if group_id is None else group_id
        self.allreduces += 1
        kwargs["peer_fractions"] = await asyncio.get_running_loop().run_in_executor(
            None, self._fair_fractions, group_info)
        await self._refuse_group(group_info, group_id)
        kwargs["compression"] = self.members.compression(group_info, kwargs["compression"])  # (topk: its density)
        # with what slow peers handed in to us averaged in, under their weights too (hand_in.py)
        sent, kwargs["weight"], folded = self.hand_ins.fold(self._sent(), kwargs["weight"], self._report_hand_in)
        p2p = internals.p2p_of(self)
        relayed = frozenset(info.peer_id for info in await p2p.list_peers()
                            if any("p2p-circuit" in str(addr) for addr in info.addrs))
        runner = ExactAllReduceRunner(
            traffic=self.traffic,
            relayed=relayed,
            limits=self._member_limits(group_info),
            on_offense=lambda peer_id, problem: self._report(peer_id, problem.kind, problem.detail, problem.counts),
            faults=self.faults,
            allreduce=self.allreduces,
            p2p=p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=sent,
            outputs=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        internals.running_group(self, group_id).set_result(runner)
        if self.in_place:  # from here on, averages may be written over what we send: a retry would send them
            internals.forbid_retries(self._step_control)
        # the runner reads our pseudo-gradient from ``inputs`` and the averages go to ``tensors``: a retry after a
        # failure (hivemind retries with the same tensors) reads our own values again, and no copy is needed
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
        finally:
            runner.settle_disputes()
        # by now every sender has started streaming to us (our last part needed all of theirs, or it went silent)
        await runner.wait_for_replies(timeout=runner.reducer_timeout or 5.0)
        self.traffic[traffic.FAILED_VALUES] += runner.tensor_part_container.failed_size
        if folded:  # what the peers that handed in get: the average, if every value of it is one
            clean = runner.tensor_part_container.failed_size == 0
            self.hand_ins.ended([t.clone() for t in tensors] if clean else None, len(group_info.peer_ids))
        self.traffic[traffic.TRANSFER_US] += int((time.perf_counter() - started) * 1e6)
        self.last_updated = get_dht_time()
        internals.mark_state_updated(self)

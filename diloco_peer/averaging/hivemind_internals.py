"""hivemind's private averaging API, in one place: what our averager and all-reduce rely on beyond the public one.

hivemind is extended by subclassing: ``PseudoGradientAverager`` (a ``DecentralizedAverager``),
``ExactAllReduceRunner`` (an ``AllReduceRunner``) and ``CheckedPartReducer`` (a ``TensorPartReducer``) override
or copy some of their private methods, and those overrides stay in the subclasses. Every other use of a private
name of hivemind's averaging goes through the small functions below, and ``INVENTORY`` lists them all: each
method we override, copy (with the sha256 of hivemind's own source of it when we copied it), call or patch, and
each attribute we read. The p2pd side has its own list (``swarm/p2pd_internals.py``).

Pinned to hivemind ``HIVEMIND_VERSION``: ``tests/test_hivemind_internals.py`` checks every entry against the
installed hivemind (signatures, attributes on real objects, the sources of what we copied) and fails, naming the
attribute and the version, where they differ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2

from ..swarm.p2pd_internals import HIVEMIND_VERSION, PrivateUse

__all__ = ["HIVEMIND_VERSION", "INVENTORY", "ban_sender", "forbid_retries", "keeping_our_sigint", "mark_state_updated",
           "matchmaking_of", "own_input_parts", "leave_out_before_assembly", "p2p_of", "patch_join_requests",
           "grow_target_with_followers", "reject_stale_join_requests", "running_group", "send_to_averager_process",
           "set_group_bits_here", "set_target_group_size", "state_from_host"]

AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
MATCHMAKING = "hivemind.averaging.matchmaking.Matchmaking"
KEY_MANAGER = "hivemind.averaging.key_manager.GroupKeyManager"
RUNNER = "hivemind.averaging.allreduce.AllReduceRunner"
CONTAINER = "hivemind.averaging.partition.TensorPartContainer"
REDUCER = "hivemind.averaging.partition.TensorPartReducer"
CONTROL = "hivemind.averaging.control.StepControl"
LEADERS = "hivemind.averaging.matchmaking.PotentialLeaders"

_OURS = "pseudo_gradient_averager.PseudoGradientAverager"

logger = logging.getLogger(__name__)


def _reads(owner: str, where: str, *names: str) -> tuple[PrivateUse, ...]:
    return tuple(PrivateUse(owner, name, "read", where) for name in names)


INVENTORY = (
    # the averager (in its own process): matchmaking, the all-reduce hook, the host <-> averager pipe
    PrivateUse(AVERAGER, "_step", "override", f"{_OURS}: skips leaders we refuse before matchmaking"),
    PrivateUse(AVERAGER, "_declare_for_download_periodically", "override",
               f"{_OURS}: no all_averagers records (donors are found by their progress records)"),
    PrivateUse(AVERAGER, "_run_allreduce_inplace_", "copy", f"{_OURS}: exact results, our runner, our checks",
               ("tensors", "group_info", "group_id"),
               "914d57cffc7d69e1ce16b384f3fc0783fbbf08b7fa839634da9571f9c4143925"),
    PrivateUse(AVERAGER, "_aggregate_with_group", "relies",
               f"{_OURS}._fair_fractions: replaces the peer_fractions it passes to _run_allreduce_inplace_",
               ("group_info", "min_vector_size"),
               "c297d8a435ce2b1c0ca36b8e6bc318a23b1c696ef1624dabc654cee803650868"),
    PrivateUse(AVERAGER, "_step", "relies",
               "forbid_retries (after _refuse_group): a failed attempt is retried only while allow_retries",
               ("step",), "dfbb4416e9ebba51a120d9bc76a5eb30d844fe34fca4e52fc452f7761cfe67bf"),
    *_reads(CONTROL, "forbid_retries (written: False, in the averager process's copy)", "_allow_retries"),
    PrivateUse(AVERAGER, "rpc_aggregate_part", "relies",
               f"{_OURS}._refuse_group: a part for a group that is gone is answered BAD_GROUP_ID at once unless a new "
               "matchmaking attempt cleared _pending_groups_registered (hence no retry after a refusal)",
               ("stream", "context"), "06ad9597d5884df8ff5bfd5e8b26db44865737e589807e4a87edcc766da5f017"),
    PrivateUse(AVERAGER, "_run_internal", "relies",
               "send_to_averager_process: a (method, args, kwargs) on the pipe runs as a task in the averager process",
               (), "8f85686e1ccd3eb0c11e362ce4aa1a877e378f98d47393a6fbd45e598626b5d3"),
    PrivateUse(AVERAGER, "_set_group_bits", "call",
               "set_group_bits_here: what the public set_group_bits runs in the averager process",
               ("group_bits", "future")),
    PrivateUse(AVERAGER, "_get_current_state_from_host_process", "call",
               "state_from_host: our rpc_download_state asks the host for the state to serve", ()),
    PrivateUse("hivemind.averaging.averager", "_background_thread_fetch_current_state", "relies",
               f"{_OURS}.get_current_state: its third element (our download's slot, not tensor infos) comes "
               "through as it is, and CPU tensors (in shared memory) are passed, not copied; it calls "
               "tensor.cpu().detach().requires_grad_(...) on each, which state_files.SpilledTensor answers",
               ("serializer", "pipe", "get_current_state_ref"),
               "0bef353cf74912ec85a435b0859c08544ee6d557a9072619118d0d8a1b57f572"),
    *_reads(AVERAGER, "the accessors below", "_p2p", "_outer_pipe", "_running_groups", "_matchmaking",
            "_state_updated"),
    *_reads(AVERAGER, _OURS, "serializer", "prefix", "total_size", "allreduce_kwargs"),
    PrivateUse(AVERAGER, "run_in_background", "relies",
               "keeping_our_sigint: it sets SIGINT to SIG_IGN in the calling process, before it forks",
               ("await_ready", "timeout"), "028dd8b1e9b723d83bf30d357049eea84d9c26b94d318282bd34835dadf39fb7"),
    PrivateUse(MATCHMAKING, "_request_join_group", "patch", "patch_join_requests (per averager instance); and "
               "PseudoGradientAverager.rpc_join_group relies on it closing its stream once it has the leader's word",
               ("leader",), "df823040a94d1c1ddb28c15536b631502954dd03024ac943820a21075e335b43"),
    PrivateUse(MATCHMAKING, "_check_reasons_to_reject", "patch",
               "reject_stale_join_requests (per averager instance): turns away a request that waited too long",
               ("request", "context")),
    *_reads(MATCHMAKING, "reject_stale_join_requests, assembly_grace.round_begins", "request_timeout"),
    PrivateUse(MATCHMAKING, "_check_reasons_to_reject", "patch",
               "grow_target_with_followers (per averager instance): an accepted follower that expects a larger group "
               "raises target_group_size (it runs under the join lock, before the size is compared)",
               ("request", "context")),
    PrivateUse(MATCHMAKING, "leader_assemble_group", "patch",
               "leave_out_before_assembly (per averager instance): drops followers before the group forms", ()),
    *_reads(MATCHMAKING, "leave_out_before_assembly", "current_followers"),
    # a group that is complete starts at once (set_target_group_size)
    *_reads(MATCHMAKING, "set_target_group_size (written, per round)", "target_group_size"),
    PrivateUse(MATCHMAKING, "rpc_join_group", "relies",
               "set_target_group_size: a leader assembles its group when target_group_size members are in",
               ("request", "context"), "0d6120e412849439dbc8dd78ef7d87543ef956e251fa1590888af06dfc12864a"),
    PrivateUse(MATCHMAKING, "leader_assemble_group", "relies",
               "assembly_grace.round_begins: wrapped on the instance, to wait ASSEMBLY_GRACE before forming the group",
               (), "516cc5ff7fb369f2bec50e89ba31d5a2628001f45f159da650b6de759d786fd4"),
    *_reads(MATCHMAKING, "assembly_grace.round_begins (the wrapped assembly: cancelled meanwhile?)",
            "assembled_group"),
    PrivateUse(MATCHMAKING, "_check_reasons_to_reject", "relies",
               "set_target_group_size: a full group turns further peers away (GROUP_IS_FULL)",
               ("request", "context"), "c694e8194862154f80c71315a9a91813d01c907668a4fba8d1f29c88fe7618d3"),
    PrivateUse(LEADERS, "_update_queue_periodically", "relies",
               "leader_search.pace: the leader queue is read through the key manager's get_averagers, and only there",
               ("key_manager",), "13036c7d743da89efd85ef93befc61463e1e45d87bdb6d07e97b46fa7e4ba580"),
    PrivateUse(KEY_MANAGER, "get_averagers", "patch", "leader_search.pace (per averager instance): paced reads",
               ("group_key", "only_active")),
    PrivateUse(KEY_MANAGER, "update_key_on_group_assembled", "relies",
               "set_target_group_size: the group bits follow the key manager's own target_group_size, left alone",
               ("group_info",), "aa20396d475cbcdadadc14b3ed26f0788438a0320821549ac83e80a5c82afbbd"),
    # the all-reduce of one group
    PrivateUse(RUNNER, "_generate_input_for_peer", "override", "allreduce.ExactAllReduceRunner: poison:shape",
               ("peer_index",)),
    PrivateUse(RUNNER, "_get_peer_stub", "override", "allreduce.ExactAllReduceRunner: byte counts", ("peer",)),
    PrivateUse(RUNNER, "_communicate_with_peer", "copy", "allreduce.ExactAllReduceRunner: averages, not deltas",
               ("peer_id",), "d910885e9727ed48e117de0b94731d74ac1abd11340c903622367d35e1b6f374"),
    PrivateUse(RUNNER, "_accumulate_parts_streaming", "copy", "allreduce.ExactAllReduceRunner: averages, checks",
               ("stream", "sender_index"), "6c5a3c72660603033d98a698d8debccf860244979008d06f3bff943fcc2a47fc"),
    PrivateUse(RUNNER, "rpc_aggregate_part", "relies",
               "allreduce.ExactAllReduceRunner: calls our _accumulate_parts_streaming(stream, sender_index)",
               ("stream", "context"), "c66765f4ad58eeaf01a350466686af1cf5f96406ea0aa88e1fa4dcda2c13ad6a"),
    PrivateUse(RUNNER, "_ban_sender", "call", "ban_sender", ("peer_id",)),
    PrivateUse(RUNNER, "_ban_sender", "override",
               "allreduce.ExactAllReduceRunner: sets all_senders_started once every sender started or was dropped",
               ("peer_id",)),
    PrivateUse(RUNNER, "_handle_missing_senders", "relies",
               "allreduce.ExactAllReduceRunner._ban_sender: the run waits sender_timeout for all_senders_started, "
               "then drops the senders that never started", (),
               "cc0d3fc90b383f5870ac0251d53cf5c5667295aa60b585d07d41517b272f3051"),
    *_reads(RUNNER, "allreduce.ExactAllReduceRunner", "tensor_part_container", "tensor_part_reducer",
            "sender_peer_ids", "banned_senders", "peer_id", "ordered_peer_ids", "parts_for_local_averaging",
            "weight", "reducer_timeout", "should_delay_results", "active_senders", "all_senders_started"),
    *_reads(RUNNER, "p2p_of", "_p2p"),
    *_reads(CONTAINER, "own_input_parts", "_input_parts_by_peer"),
    *_reads(CONTAINER, "allreduce.ExactAllReduceRunner", "return_deltas", "compression", "prefetch",
            "num_parts_by_peer", "failed_size", "register_processed_part", "register_failed_reducer"),
    # the reducer of one part
    PrivateUse(REDUCER, "accumulate_part", "override", "robust_aggregation.CheckedPartReducer: checks on arrival",
               ("sender_index", "part_index", "tensor_part", "weight")),
    PrivateUse(REDUCER, "check_current_part_finished", "copy", "robust_aggregation.CheckedPartReducer: aggregate",
               (), "ec9b059c42f3ca271d3e89ff63177006d66e0fc4a6bb99427eb08ab25d3d3640"),
    *_reads(REDUCER, "robust_aggregation.CheckedPartReducer, allreduce.ExactAllReduceRunner", "part_shapes",
            "num_parts", "finished", "accumulator", "current_part_index", "current_part_accumulated_from",
            "num_current_senders", "sender_failed_after", "current_part_future", "reset_accumulators"),
)
"""Every name of hivemind's averaging we rely on beyond its public API (see ``PrivateUse``)."""


# --- the averager: call these in its own process unless said otherwise

def p2p_of(owner: DecentralizedAverager | AllReduceRunner) -> P2P:
    """The averager process's P2P (``_p2p``), which its handlers and all-reduces (``owner``: either) use."""
    return owner._p2p


def running_group(averager: DecentralizedAverager, group_id: bytes) -> asyncio.Future:
    """The future through which hivemind hands the all-reduce runner of group ``group_id`` to the members'
    requests (``_running_groups``): its result is our runner, its exception fails them at once."""
    return averager._running_groups[group_id]


def mark_state_updated(averager: DecentralizedAverager) -> None:
    """Tell hivemind the averaged tensors changed, as its own ``_run_allreduce_inplace_`` does when it ends."""
    averager._state_updated.set()


async def state_from_host(averager: DecentralizedAverager) -> tuple:
    """In the averager process: what the host's ``get_current_state`` returns now (metadata serialized, tensors
    as they are on the CPU, and its third element), through hivemind's own pipe for it."""
    return await averager._get_current_state_from_host_process()


def forbid_retries(step) -> None:
    """No further attempt for this step (a ``StepControl``, in the averager process): hivemind retries a failed
    matchmaking or all-reduce with the same tensors until the deadline, unless ``allow_retries`` is off."""
    step._allow_retries = False


async def set_group_bits_here(averager: DecentralizedAverager, group_bits: str) -> None:
    """In the averager process: set the matchmaking key's group bits as ``set_group_bits`` does from the host (it
    sends this coroutine through the pipe), for a call from the host that sets more in one message."""
    if not all(bit in "01" for bit in group_bits):
        raise ValueError(f"group bits must be a string of 0s and 1s, got {group_bits!r}")
    done = concurrent.futures.Future()
    await averager._set_group_bits(group_bits, future=done)
    done.result()


def send_to_averager_process(averager: DecentralizedAverager, method: str, *args, **kwargs) -> None:
    """From the host process: run ``averager.<method>(*args, **kwargs)`` (a coroutine method) as a task in the
    averager process, through the pipe hivemind's own ``step`` uses (``_outer_pipe``)."""
    averager._outer_pipe.send((method, list(args), kwargs))


@contextlib.contextmanager
def keeping_our_sigint():
    """Start a hivemind averager inside this, and our SIGINT handling (Ctrl+C: leave cleanly) survives it.

    ``DecentralizedAverager.run_in_background`` sets SIGINT to ``SIG_IGN`` in the *calling* process, so that the
    averager process it forks ignores Ctrl+C; it never puts the handler back. Without this, a peer ignored
    Ctrl+C (and any SIGINT) from its first averager on (found by the lifecycle tests).
    """
    ours = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if ours is not None:  # None: a handler not installed from Python, which we cannot put back
            signal.signal(signal.SIGINT, ours)


def set_target_group_size(averager: DecentralizedAverager, size: int | None) -> None:
    """Make the groups this averager leads start their all-reduce as soon as they have ``size`` members (us
    included), instead of gathering followers until the step's scheduled time; ``None``: gather until then.

    hivemind's ``Matchmaking`` (``_matchmaking``) takes ``target_group_size`` once, when the averager process
    creates it; ``rpc_join_group`` reads it at every follower it accepts (assembles the group when it is reached)
    and ``_check_reasons_to_reject`` turns further peers away with ``GROUP_IS_FULL``. Only the matchmaking's copy
    is set: the ``GroupKeyManager`` keeps its own (None), from which it derives the group bits after a group.
    A group formed the moment it is complete may hold a follower that is already gone: ``assembly_grace.py``.
    """
    averager._matchmaking.target_group_size = size


def matchmaking_of(averager: DecentralizedAverager) -> Matchmaking:
    """The averager process's ``Matchmaking`` (``_matchmaking``, made when that process starts), whose public
    ``leader_assemble_group``, ``assembled_group`` and ``request_timeout`` ``assembly_grace.py`` uses."""
    return averager._matchmaking


def patch_join_requests(averager: DecentralizedAverager, refuses: Callable[[PeerID], bool]) -> None:
    """Make matchmaking skip the leaders ``refuses`` names, as if they had turned us down.

    hivemind's matchmaking (``_matchmaking``, created in the averager process) asks every leader it finds in
    the DHT to take us in (``Matchmaking._request_join_group``); this replaces that method on this averager's
    instance only. Idempotent: call it before each step (matchmaking exists once the process runs).
    """
    matchmaking = averager._matchmaking
    if getattr(matchmaking, "diloco_skips_refused", False):
        return
    request_join_group = matchmaking._request_join_group

    async def _request_join_group(leader: PeerID):
        return None if refuses(leader) else await request_join_group(leader)

    matchmaking._request_join_group = _request_join_group
    matchmaking.diloco_skips_refused = True


def reject_stale_join_requests(averager: DecentralizedAverager, arrived: Callable[[object], float | None]) -> None:
    """Make a leader turn away a join request that waited so long for the leader that its sender gave up.

    A follower waits ``request_timeout`` for the leader's ACCEPTED, then closes its stream and asks another
    leader. hivemind's leader answers a request only once it holds its join lock, which it also holds while it
    asks a leader of its own (up to ``request_timeout``): the answer can come after the follower gave up. Worse,
    if the leader's matchmaking window has ended meanwhile, it forms its group at once, before it sees the closed
    stream: a group with a member that is not there (its step fails; the others' round is partial). Seen in CI
    under load, the last round of an overlapped churn test.

    So a request that has waited over half the ``request_timeout`` when the leader gets to it is turned away
    (BAD_EXPIRATION_TIME: it expired while it waited for us); the follower, if it is still waiting, asks the
    next leader. ``arrived(context)`` is the ``time.monotonic()`` at which the request of ``context`` reached us
    (``None``: unknown, not checked). Idempotent: call it before each step, like ``patch_join_requests``.
    """
    matchmaking = averager._matchmaking
    if getattr(matchmaking, "diloco_rejects_stale", False):
        return
    check = matchmaking._check_reasons_to_reject
    max_wait = matchmaking.request_timeout / 2

    def _check_reasons_to_reject(request, context):
        since = arrived(context)
        if since is not None and time.monotonic() - since > max_wait:
            logger.debug(f"turned away {context.remote_id}: its join request waited {time.monotonic() - since:.2f}s "
                         f"for us, over {max_wait:.2f}s (it has likely given up)")
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
        return check(request, context)

    matchmaking._check_reasons_to_reject = _check_reasons_to_reject
    matchmaking.diloco_rejects_stale = True


def grow_target_with_followers(averager: DecentralizedAverager, expects: Callable[[object], int | None]) -> None:
    """Make a group this averager leads wait for as many members as any follower it accepts expects.

    Each member's round gate counted the peers it expects (``expect_group``), and on a loaded machine the counts
    differ: a progress record that one gate read late, or judged too slow to wait for, is in another's count. A
    leader whose count was one short formed its group, complete by its count, and turned the last peer away
    (``GROUP_IS_FULL``): that peer's round failed, or it formed a group with another late one (12 peers on two
    busy cores, in CI). So a follower we accept that expects more (``expects(request)``, from the data it gathers
    with) raises ``target_group_size``; never lowers it. hivemind checks a request and compares the group's size
    with the target under its join lock, in that order: the follower that raises the target is counted against the
    raised one. The step's scheduled time still bounds the wait for a peer that does not come. Idempotent: call it
    before each step, like ``patch_join_requests``.
    """
    matchmaking = averager._matchmaking
    if getattr(matchmaking, "diloco_grows_target", False):
        return
    check = matchmaking._check_reasons_to_reject

    def _check_reasons_to_reject(request, context):
        refusal = check(request, context)
        target = matchmaking.target_group_size
        if refusal is None and target is not None:
            wanted = expects(request)
            if wanted is not None and wanted > target:
                logger.debug(f"{context.remote_id} expects {wanted} members, we {target}: the group waits for more")
                matchmaking.target_group_size = wanted
        return refusal

    matchmaking._check_reasons_to_reject = _check_reasons_to_reject
    matchmaking.diloco_grows_target = True


def leave_out_before_assembly(averager: DecentralizedAverager, leave_out: Callable[[dict], list[PeerID]]) -> None:
    """Make a group this averager leads form without the followers ``leave_out`` names.

    ``leave_out(requests)`` gets the followers in (``{peer id: JoinRequest}``, hivemind's ``current_followers``,
    whose ``gather`` holds each one's gather data) right before the leader forms the group, and returns those
    to drop. A dropped follower is told GROUP_DISBANDED by hivemind's ``rpc_join_group`` (it is not in the
    group) and looks for another. Idempotent: call it before each step.
    """
    matchmaking = averager._matchmaking
    if getattr(matchmaking, "diloco_leaves_out", False):
        return
    assemble = matchmaking.leader_assemble_group

    async def leader_assemble_group():
        for peer in leave_out(dict(matchmaking.current_followers)):
            matchmaking.current_followers.pop(peer, None)
        return await assemble()

    matchmaking.leader_assemble_group = leader_assemble_group
    matchmaking.diloco_leaves_out = True


# --- one group's all-reduce

def own_input_parts(runner: AllReduceRunner, peer_index: int) -> list[torch.Tensor]:
    """The parts of our own tensors that member ``peer_index`` reduces, as we send them (before compression)."""
    return [part for part, _ in runner.tensor_part_container._input_parts_by_peer[peer_index]]


async def ban_sender(runner: AllReduceRunner, peer_id: PeerID) -> None:
    """Drop ``peer_id`` from the rest of this all-reduce as a sender (hivemind's own fate for a failed sender:
    the others average without it)."""
    await runner._ban_sender(peer_id)

"""hivemind's private API around its libp2p daemon (p2pd), in one place: the one module of ``swarm`` that
touches it.

hivemind's ``P2P`` exposes neither the p2pd client (to dial a given address, to hang up) nor every p2pd flag;
NAT traversal needs both (``reachability.py``, ``relay.py``, ``join.py``). They are reached here only, through
small documented functions, and ``INVENTORY`` lists every private name of hivemind this module relies on. The
averaging side has its own list (``averaging/hivemind_internals.py``), of the same ``PrivateUse`` entries.

Pinned to hivemind ``HIVEMIND_VERSION``: ``tests/test_hivemind_internals.py`` checks every entry against the
installed hivemind and fails, naming the attribute and the version, where they differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from hivemind.p2p import P2P

HIVEMIND_VERSION = "1.1.12"
"""The hivemind version whose internals the inventories describe (pyproject.toml pins it)."""


@dataclass(frozen=True)
class PrivateUse:
    """One name of hivemind's that is not its public API, and how we depend on it.

    ``use`` is one of: ``override`` (a subclass of ours replaces the method and calls hivemind's through
    ``super()``), ``copy`` (a subclass replaces it with a changed copy of hivemind's code: ``source_sha256`` is
    that of hivemind's source when we copied it, so that an upgrade that changes the original forces a look at
    the copy), ``relies`` (we depend on what its body does: ``source_sha256`` as for a copy), ``call`` (we call
    it), ``patch`` (we replace it at run time) or ``read`` (an attribute we read or set).
    """

    owner: str
    """The hivemind class, by its dotted path."""
    name: str
    use: str
    where: str
    """Our module (or class) that relies on it."""
    params: tuple[str, ...] = ()
    """For a method: the parameters we pass or accept, in hivemind's order."""
    source_sha256: str = ""


P2P_CLASS = "hivemind.p2p.p2p_daemon.P2P"
P2PD_CLIENT_CLASS = "hivemind.p2p.p2p_daemon_bindings.p2pclient.Client"

INVENTORY = (
    PrivateUse(P2P_CLASS, "_client", "read", "p2pd_client: reachability.py, join.py"),
    PrivateUse(P2PD_CLIENT_CLASS, "connect", "call", "reachability.py, join.py: dial a peer at given addresses",
               ("peer_id", "maddrs")),
    PrivateUse(P2PD_CLIENT_CLASS, "disconnect", "call", "reachability.py: the prober hangs up after a dial-back",
               ("peer_id",)),
    PrivateUse(P2P_CLASS, "_make_process_args", "patch", "p2pd_flags: relay.py, join.py (process-wide)"),
    PrivateUse(P2P_CLASS, "_add_protobuf_stream_handler", "relies",
               "until_the_caller_hangs_up: a caller that closes the stream cancels the handler",
               ("name", "handler", "input_protobuf_type", "max_prefetch", "balanced"),
               "f72a7faa60ec83fde67c3698415e4738961a131e736fb26301c4b7aa9514057c"),
    PrivateUse(P2P_CLASS, "_iterate_protobuf_stream_handler", "relies",
               "until_the_caller_hangs_up: closing the caller's iterator closes the stream",
               ("peer_id", "name", "requests", "output_protobuf_type"),
               "132d50ef5ecd4e13ad2886337e87cc47983abf9dae05afe9f6f9deee74401bf7"),
)
"""Every private name of hivemind's P2P this package relies on (see ``PrivateUse``)."""

HANG_UP_WAIT = 60.0
"""Seconds a stream handler that has sent everything waits for its caller to hang up (``until_the_caller_hangs_up``)."""


async def until_the_caller_hangs_up(timeout: float = HANG_UP_WAIT) -> None:
    """In a stream handler, after its last message: wait until the caller closes the stream (hivemind's
    ``P2P._add_protobuf_stream_handler`` then cancels the handler, and this wait with it), at most ``timeout``.

    Why a handler must not hang up first: p2pd pipes each stream between the handler's unix socket and the libp2p
    stream (go-libp2p-daemon's ``doStreamPipe``). When the handler closes its socket, p2pd closes the libp2p
    stream, reading side first (yamux ``Stream.Close``), which wakes p2pd's other copy loop with "stream reset";
    if that loop resets the stream before the close has sent its FIN, the caller's yamux drops everything it
    had received but not yet handed over: the last messages of the stream, up to a receive window (256 KiB and
    up). hivemind's caller then ends its iteration as if the stream were complete. So our protocols end from the
    caller's side: the caller knows when it has everything (a count, an end mark) and hangs up; the handler
    waits here, and a caller that dies resets the stream, which cancels the wait as well.
    """
    await asyncio.sleep(timeout)


def p2pd_client(p2p: P2P):
    """The p2pd control client of ``p2p`` (``P2P._client``): ``connect(peer_id, maddrs)`` dials a peer at the
    addresses we choose (hivemind's P2P only dials through its peer store), ``disconnect(peer_id)`` hangs up."""
    return p2p._client


_extra_flags: dict[str, str] = {}


def _with_extra_flags(original):
    @functools.wraps(original)
    def make_process_args(*args, **kwargs):
        return original(*args, **{**kwargs, **_extra_flags})

    make_process_args.diloco_wrapped = True
    return make_process_args


@contextlib.contextmanager
def p2pd_flags(**flags: str) -> Iterator[None]:
    """p2pd flags that hivemind's ``P2P.create`` does not expose, for the daemons started inside the block.

    hivemind builds the p2pd command line in ``P2P._make_process_args``, wrapped here once, process-wide, to add
    the flags of the block; a DHT started in the block forks its process (and p2pd) while they are set, so it
    keeps them. Outside a block the wrapper adds nothing.
    """
    if not getattr(P2P._make_process_args, "diloco_wrapped", False):
        P2P._make_process_args = staticmethod(_with_extra_flags(P2P._make_process_args))
    _extra_flags.update(flags)
    try:
        yield
    finally:
        _extra_flags.clear()

"""Circuit relays as hivemind 1.1.12's libp2p daemon (p2pd) runs them, and what a relay grants.

p2pd runs *two* relays on one hop protocol (its main.go and daemon.go): one with the configured limits (4 GiB
and 30 min per relayed connection), started once the node is (forced) public, and go-libp2p's default one
(128 KiB and 2 min), which it always starts. The one registered last serves, for good; with the default one,
relayed all-reduces and state downloads break off within their first MB. Relay nodes therefore start p2pd with
``RELAY_ENV``, and both sides check what a relay grants by asking it for a slot as auto-relay does
(``circuit_limit``): bootstraps restart until theirs is right, NAT'd peers do not count on one that is not.
The p2pd flags hivemind's ``P2P.create`` does not expose go through ``p2pd_internals.p2pd_flags``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

logger = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
GOOD_CIRCUIT_BYTES = 1 << 30
"""A relay that resets a relayed connection sooner (go-libp2p's default: after 128 KiB) cannot carry averaging."""
RELAY_ENV = {"GOMAXPROCS": "1"}
"""Environment of a relay's p2pd. Of its two relays (``ProbeService.relay_limit``) the one registered last serves;
with one Go thread that was the configured one in every start measured, with the default threads rarely
(measured: BENCHMARKS.md, "Notes from the NAT work"). One thread carried the NAT tests' relayed rounds; a busy
relay's throughput with it, and that of a peer that opts in (``swarm.relay_service``, whose own averaging traffic
goes through the same daemon), are not measured."""

@contextlib.contextmanager
def p2pd_env(env: dict[str, str]) -> Iterator[None]:
    """Environment variables for the daemons started inside the block (a DHT's process forks with them)."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        value = value | (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes) -> dict[int, list]:
    """A protobuf message's fields (number -> values; varints as ints, the rest as bytes): enough for the
    three small circuit relay v2 messages we read, without compiling their .proto."""
    fields = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        if key & 7 == 0:
            value, i = _varint(buf, i)
        elif key & 7 == 2:
            size, i = _varint(buf, i)
            value = buf[i:i + size]
            i += size
        else:
            raise ValueError(f"unexpected protobuf wire type {key & 7}")
        fields.setdefault(key >> 3, []).append(value)
    return fields


async def circuit_limit(p2p: P2P, relay: PeerID, timeout: float = 5.0) -> tuple[int | None, int | None]:
    """Ask ``relay`` (connected) for a slot, as auto-relay does (circuit relay v2 RESERVE), and read the limit it
    grants each relayed connection: (bytes per direction, seconds), None where it sets none. Raises
    ConnectionError if it refuses."""

    async def ask() -> tuple[int | None, int | None]:
        _, reader, writer = await p2p.call_binary_stream_handler(relay, HOP_PROTOCOL)
        try:
            writer.write(b"\x02\x08\x00")  # a 2-byte HopMessage {type: RESERVE}, length-prefixed
            await writer.drain()
            prefix = await reader.readexactly(1)
            while prefix[-1] & 0x80:
                prefix += await reader.readexactly(1)
            reply = _fields(await reader.readexactly(_varint(prefix, 0)[0]))
        finally:
            writer.close()
        if reply.get(5) != [100]:  # HopMessage.status: 100 is OK
            raise ConnectionError(f"the relay refused a slot (status {reply.get(5, ['none'])[0]})")
        limit = _fields(reply[4][0]) if 4 in reply else {}
        return limit.get(2, [None])[0], limit.get(1, [None])[0]

    return await asyncio.wait_for(ask(), timeout)


def limit_text(data: int | None, seconds: int | None) -> str:
    size = "no data limit" if data is None else (f"{data / 2**30:g} GiB" if data >= 2**30 else f"{data >> 10} KiB")
    return f"{size} and {'no time limit' if seconds is None else f'{seconds / 60:g} min'} per relayed connection"


async def usable_relays(p2p: P2P, relays: list[str]) -> list[str]:
    """Those of ``relays`` (holding a slot for us) whose relayed connections can carry averaging; a warning line
    for each that cannot: a relay node of an older version may serve go-libp2p's default relay (128 KiB)."""
    usable = []
    for relay in relays:
        try:
            data, seconds = await circuit_limit(p2p, PeerID.from_base58(Multiaddr(relay).value_for_protocol("p2p")))
        except Exception as e:  # it just dialed us through its circuit: an unanswered question does not condemn it
            logger.debug(f"relay {relay} did not tell its limit: {e!r}")
            data = seconds = None
        if data is None or data >= GOOD_CIRCUIT_BYTES:
            usable.append(relay)
        else:
            logger.warning(f"relay {relay.split('/')[-1][-8:]} grants {limit_text(data, seconds)}, too little for "
                           f"averaging (go-libp2p's default relay: its node runs an older diloco-peer); not using it")
    return usable

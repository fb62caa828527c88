"""Reachability: can other peers dial this one directly, only through a relay, or not at all?

Most volunteers sit behind a home router that drops inbound connections. hivemind's libp2p daemon (p2pd,
go-libp2p 0.32) has the parts for that: circuit relay v2, auto-relay with static relays, client mode. This
module decides which of them a peer needs, at start-up and then every ``swarm.reachability_check`` seconds:

* ``direct``: a bootstrap dialed us back at our listen (or announced) address. Nothing to do.
* ``relayed``: the dial-back failed, but a relay (a bootstrap node, or a public peer with
  ``swarm.relay_service``) holds a slot for us and dialed us through it: others reach us at
  ``<relay>/p2p-circuit/p2p/<us>``. Traffic through a relay is slower and counted (``bytes_relayed``).
* ``outbound-only``: neither. The peer runs in client mode: it averages with reachable peers but never
  leads a group nor reduces a part.

Why our own dial-back and not libp2p's AutoNAT: AutoNAT servers refuse to dial non-public addresses (in a
LAN or an emulated internet it never decides) and need several servers and many seconds (measured:
BENCHMARKS.md, "Notes from the NAT work"); the relay service runs only on nodes whose reachability is *public*,
so bootstraps force it. The dial-back comes from a separate p2pd with its own identity (the *prober*): a dial
from the node we are already connected to would reuse that connection and always succeed. The probe service dials
only the IP the request came from, or a circuit through itself, so it cannot be used to make a bootstrap dial third
parties.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from .p2pd_internals import p2pd_client
from .relay import GOOD_CIRCUIT_BYTES, circuit_limit, limit_text, usable_relays

logger = logging.getLogger(__name__)

DIRECT, RELAYED, OUTBOUND = "direct", "relayed", "outbound-only"
MODES = (DIRECT, RELAYED, OUTBOUND)
PROBE_PROTOCOL = "/diloco-peer/probe/1.0.0"
DIAL_TIMEOUT = 3.0
"""Seconds the prober waits for one dial: a home router that drops SYNs never answers at all."""
MAX_CANDIDATES = 3
RELAY_WAIT = 10.0
"""Seconds a NAT'd peer waits for its first relay reservation (far less when the relay is up: BENCHMARKS.md,
"Notes from the NAT work")."""
RELAY_SETTLE = 3.0
"""Seconds a NAT'd peer that holds one relay gives its other relays to hold it too, before it says how it is
reached (``check_relays``)."""


@contextlib.contextmanager
def held_ports(host_maddrs: list[str]):
    """``host_maddrs`` with TCP port 0 replaced by a free port, each held for the block: the dial-back must probe
    the port the DHT will listen on, so it is chosen once, before both, and kept from other processes meanwhile.

    A port picked by a bind to port 0 and let go at once was free for every other bind until our p2pd took it: two
    peers of a 32-peer demo started together got the same one, and since p2pd listens with ``SO_REUSEPORT`` both
    of their p2pds bound it. The kernel then handed each dial to that port to either daemon, and the two peers lost
    each other in every round (partial rounds, a failed one). Here the picking socket stays bound, with
    ``SO_REUSEPORT``: our p2pds (same user, ``SO_REUSEPORT``) can bind the port too, a bind to port 0 is never given
    a port in use, and a plain bind to it is refused. A bound socket that does not listen takes no connection."""
    resolved, holds = [], []
    try:
        for text in host_maddrs:
            addr = Multiaddr(text)
            protocols = [p.name for p in addr.protocols()]
            if "tcp" in protocols and addr.value_for_protocol("tcp") == "0":
                hold = socket.socket(socket.AF_INET6 if "ip6" in protocols else socket.AF_INET)
                holds.append(hold)
                hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                hold.bind(("", 0))
                text = text.replace("/tcp/0", f"/tcp/{hold.getsockname()[1]}", 1)
            resolved.append(text)
        yield resolved
    finally:
        for hold in holds:
            hold.close()


def _host(addr: Multiaddr) -> str:
    for proto in ("ip4", "ip6"):
        with contextlib.suppress(Exception):
            return addr.value_for_protocol(proto)
    return ""


def _split(address: str) -> tuple[PeerID, Multiaddr]:
    addr = Multiaddr(address)
    peer = addr.value_for_protocol("p2p")
    return PeerID.from_base58(peer), addr.decapsulate(Multiaddr(f"/p2p/{peer}"))


class UnreachableServer(ConnectionError):
    """The probe service's node could not be connected to (down, or a wrong address)."""


def _one_line(error: BaseException) -> str:
    text = str(error).strip().replace("\n", " ")
    return (text or type(error).__name__)[:300]


class ProbeService:
    """Answers dial-back probes (``PROBE_PROTOCOL``); runs on bootstrap nodes and opted-in relays.

    A request is one JSON line: ``{"port": 40001, "addrs": [...]}`` asks "can you dial me at these
    addresses?" (only those at the IP the request came from, plus that IP with ``port``);
    ``{"circuit": true}`` asks "can you dial me through your relay?". The answer is one JSON line
    ``{"observed": <address the request came from>, "results": [{"addr", "ok", "error", "seconds"}]}``.
    """

    def __init__(self, p2p: P2P, prober: P2P, own_addrs: list[str]):
        self.p2p = p2p
        self.prober = prober
        self.own_addrs = own_addrs
        self._locks: dict[PeerID, asyncio.Lock] = {}  # one dial per peer at a time: each drops its connection

    @classmethod
    async def start(cls, dht) -> ProbeService:
        p2p = await dht.replicate_p2p()
        prober = await P2P.create(no_listen=True, auto_nat=False, nat_port_map=False)
        own = [str(a).split("/p2p/")[0] for a in await p2p.get_visible_maddrs()]
        service = cls(p2p, prober, own)
        await p2p.add_binary_stream_handler(PROBE_PROTOCOL, service._handle)
        return service

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.p2p.remove_binary_stream_handler(PROBE_PROTOCOL)
        await self.prober.shutdown()

    async def relay_limit(self, wait: float = 2.0) -> tuple[bool, str]:
        """Does our relay let a circuit carry a round's traffic? (ok, its limit in words.)

        p2pd runs two relays, of which the configured one should serve (relay.py): this asks ours for a slot as
        auto-relay does. The default one answers first for a moment if the configured one is still starting,
        so a small limit is asked again for up to ``wait`` seconds.
        """
        own = sorted(self.own_addrs, key=lambda a: "/127.0.0.1/" not in a)
        if not own:
            return False, "the node has no address to reach its relay at"
        await p2pd_client(self.prober).connect(self.p2p.peer_id, [Multiaddr(own[0])])
        deadline = time.monotonic() + wait
        while True:
            data, seconds = await circuit_limit(self.prober, self.p2p.peer_id)
            if data is None or data >= GOOD_CIRCUIT_BYTES or time.monotonic() > deadline:
                return data is None or data >= GOOD_CIRCUIT_BYTES, limit_text(data, seconds)
            await asyncio.sleep(0.2)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), DIAL_TIMEOUT))
            if not isinstance(request, dict):
                raise ValueError("a probe request is a JSON object")
            reply = await self._probe(info.peer_id, Multiaddr(str(info.addr)), request)
        except Exception as e:  # a bad request gets an answer, never a crash of the service
            logger.debug(f"probe request of {info.peer_id} failed: {e!r}")
            reply = {"error": f"bad probe request: {_one_line(e)}", "results": []}
        with contextlib.suppress(Exception):
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
            writer.close()

    def _candidates(self, observed: Multiaddr, request: dict) -> list[str]:
        if request.get("circuit"):
            # through ourselves: our own address (loopback first: the prober runs on this machine)
            ours = sorted(self.own_addrs, key=lambda a: "/127.0.0.1/" not in a)
            return [f"{ours[0]}/p2p/{self.p2p.peer_id}/p2p-circuit"] if ours else []
        host = _host(observed)
        if not host or "p2p-circuit" in str(observed):
            return []
        kind = "ip6" if ":" in host else "ip4"
        candidates = []
        for text in list(request.get("addrs", []))[:16]:
            with contextlib.suppress(Exception):
                if "p2p-circuit" in str(text):
                    continue
                addr = Multiaddr(str(text).split("/p2p/")[0])  # the peer id is the caller's, checked on dial
                if _host(addr) == host and str(addr) not in candidates:
                    candidates.append(str(addr))
        port = request.get("port")
        if isinstance(port, int) and 0 < port < 65536 and f"/{kind}/{host}/tcp/{port}" not in candidates:
            candidates.append(f"/{kind}/{host}/tcp/{port}")
        return candidates[:MAX_CANDIDATES]

    async def _probe(self, peer_id: PeerID, observed: Multiaddr, request: dict) -> dict:
        results = []
        for addr in self._candidates(observed, request):
            started = time.monotonic()
            async with self._locks.setdefault(peer_id, asyncio.Lock()):
                try:
                    dial = p2pd_client(self.prober).connect(peer_id, [Multiaddr(addr)])
                    await asyncio.wait_for(dial, DIAL_TIMEOUT)
                    # connected to that very peer (the handshake checks its key), not just to some hop on the way
                    ok = any(p.peer_id == peer_id for p in await self.prober.list_peers())
                    error = "" if ok else "the dial reached some other peer"
                except Exception as e:  # refused, unreachable, timed out, wrong peer id: all mean "no"
                    ok = False
                    error = _one_line(e) if str(e).strip() else "timed out"
                finally:
                    with contextlib.suppress(Exception):
                        await p2pd_client(self.prober).disconnect(peer_id)
            results.append({"addr": addr, "ok": ok, "error": error, "seconds": round(time.monotonic() - started, 3)})
        if peer_id in self._locks and not self._locks[peer_id].locked():
            del self._locks[peer_id]
        return {"observed": str(observed), "results": results}


async def ask_probe(p2p: P2P, server: str, request: dict, timeout: float = 15.0) -> dict:
    """Send one probe request to the probe service at ``server`` (a multiaddr with /p2p/); its reply."""
    peer_id, addr = _split(server)

    async def ask() -> dict:
        try:  # at once if already connected (a DHT's own daemon)
            await p2pd_client(p2p).connect(peer_id, [addr])
        except Exception as e:
            raise UnreachableServer(f"cannot connect: {_one_line(e)}") from None
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROBE_PROTOCOL)
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
        if not line:
            raise ConnectionError("the node closed the stream without an answer")
        return json.loads(line)

    return await asyncio.wait_for(ask(), timeout)


@dataclass
class Reach:
    """What a peer found out about itself: ``mode`` (one of ``MODES``), why, and what the user can do."""

    mode: str
    detail: str
    advice: str = ""
    relays: list[str] = field(default_factory=list)
    """Relays that dialed us through their circuit (relayed mode)."""

    def line(self) -> str:
        return f"reachability: {self.mode}: {self.detail}" + (f". {self.advice}" if self.advice else "")


async def _ask_twice(p2p: P2P, server: str, request: dict, problems: list[str]) -> dict | None:
    for _ in range(2):  # a bootstrap we can connect to gets a second chance to answer
        try:
            return await ask_probe(p2p, server, request)
        except Exception as e:  # down, or a bootstrap without the probe service (older version)
            problems.append(f"{server.split('/')[-1][-8:]}: {_one_line(e) if str(e).strip() else 'timed out'}")
            if isinstance(e, UnreachableServer):
                return None
    return None


async def probe_direct(host_maddrs: list[str], announce_maddrs: list[str], bootstraps: list[str]
                       ) -> tuple[bool | None, str]:
    """Can a stranger dial us at the port we will listen on? Asks the bootstraps in turn, from a short-lived
    p2pd listening on ``host_maddrs``. (True/False, what was seen), or (None, why) if no bootstrap could say."""
    p2p = await P2P.create(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs or None,
                           auto_nat=False, nat_port_map=False)
    try:
        addrs = [str(a) for a in await p2p.get_visible_maddrs()]
        port = next((int(Multiaddr(a).value_for_protocol("tcp")) for a in host_maddrs if "/tcp/" in a), 0)
        problems = []
        for server in bootstraps:
            reply = await _ask_twice(p2p, server, {"port": port, "addrs": addrs}, problems)
            if reply is None:
                continue
            results = reply.get("results", [])
            good = [r for r in results if r.get("ok")]
            if good:
                return True, f"{server.split('/')[-1][-8:]} dialed us back at {good[0]['addr']}"
            tried = "; ".join(f"{r['addr']}: {r['error'][:120]}" for r in results) or reply.get("error", "")
            return False, f"dial-back from {server.split('/')[-1][-8:]} failed ({tried or 'nothing to dial'})"
        return None, "no bootstrap answered the dial-back probe (" + "; ".join(problems) + ")"
    finally:
        await p2p.shutdown()


async def check_relays(p2p: P2P, relays: list[str], wait: float = 0.0, settle: float = 0.0) -> list[str]:
    """The relays that can dial us through their circuit now; retries for up to ``wait`` seconds until one
    can (a reservation is made in the background once the daemon starts), then for up to ``settle`` seconds more
    until all can: p2pd reserves with each relay on its own, and on a loaded machine the second reservation came
    seconds after the first (the start-up line then said one relay of two, which the watch corrected later)."""
    deadline = time.monotonic() + wait
    settled = None
    while True:
        replies = await asyncio.gather(*(ask_probe(p2p, r, {"circuit": True}, timeout=2 * DIAL_TIMEOUT + 2)
                                         for r in relays), return_exceptions=True)
        held = [r for r, reply in zip(relays, replies)
                if isinstance(reply, dict) and any(x.get("ok") for x in reply.get("results", []))]
        now = time.monotonic()
        if held and settled is None:
            settled = now + settle
        if len(held) == len(relays) or (held and now >= settled) or (not held and now >= deadline):
            return held
        await asyncio.sleep(0.5)


class ReachabilityWatch:
    """What a running peer keeps doing about reachability.

    A relayed peer asks its relays every ``interval`` seconds to dial it through their circuits; each change
    (a relay lost, one back, none left) is logged in one line and handed to ``on_change`` (the daemon writes a
    ``reachability`` event: metrics, status). p2pd re-reserves with a relay that comes back by itself. A
    directly reachable peer with ``relay_service`` answers dial-back probes like a bootstrap node.
    """

    def __init__(self, reach: Reach, relays: list[str], interval: float, on_change):
        self.reach = reach
        self.relays = relays
        self.interval = interval
        self.on_change = on_change
        self._task: asyncio.Task | None = None
        self._service: ProbeService | None = None

    async def start(self, dht, serve: bool) -> None:
        if serve and self.reach.mode == DIRECT:
            self._service = await ProbeService.start(dht)
            try:
                ok, limit = await self._service.relay_limit()
            except Exception as e:
                ok = False
                limit = f"no answer from it: {_one_line(e) or type(e).__name__}"
            if not ok:
                logger.warning(f"relay: our p2pd serves go-libp2p's default relay ({limit}): NAT'd peers cannot "
                               f"average through it (see ProbeService.relay_limit); restart this peer")
        if self.reach.mode == RELAYED:
            self._task = asyncio.create_task(self._watch(await dht.replicate_p2p()))

    async def _watch(self, p2p: P2P) -> None:
        held = set(self.reach.relays)
        too_small = set()
        while True:
            await asyncio.sleep(self.interval)
            now = set(await check_relays(p2p, self.relays)) - too_small
            if fresh := now - held:  # a relay new to us (or back): is it one we can average through?
                too_small |= fresh - set(await usable_relays(p2p, sorted(fresh)))
                now -= too_small
            if now == held:
                continue
            names = lambda relays: ", ".join(sorted(r.split("/")[-1][-8:] for r in relays))  # noqa: E731
            changes = "; ".join(text for text in (f"lost relay {names(held - now)}" if held - now else "",
                                                  f"relay {names(now - held)} carries us" if now - held else "")
                                if text)
            if now:
                self.reach = Reach(RELAYED, f"{changes}; reachable through {len(now)} relay(s): {names(now)}",
                                   self.reach.advice, sorted(now))
                logger.warning(self.reach.line())
            else:
                self.reach = Reach(OUTBOUND, f"{changes}; no relay carries us now: peers behind NAT cannot reach us "
                                   f"until a relay of {names(self.relays)} is back (we reserve again by ourselves)",
                                   "Averaging goes on with the peers we can dial")
                logger.error(self.reach.line())
            held = now
            self.on_change(self.reach)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._service is not None:
            await self._service.close()

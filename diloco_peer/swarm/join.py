"""Joining the swarm: the DHT node (hivemind + its libp2p daemon), the addresses it is reachable at.

Bootstrap nodes and peers both run a hivemind DHT; the DHT lives in its own process with its own event
loop and p2pd child process. A peer dials one or more bootstrap multiaddrs; one reachable bootstrap is
enough. ``identity_path`` gives a stable peer id across restarts (the key file is created if missing), and
is claimed for this process before the DHT starts (``addresses.hold_identity``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from functools import partial

from hivemind.dht import DHT
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from ..config import SwarmConfig
from ..lifecycle import hivemind_calls
from . import reachability, relay
from .addresses import BootstrapUnreachable, SwarmError, hold_identity, identity_in_use, parse_multiaddr
from .admission import load_admission
from .p2pd_internals import p2pd_client, p2pd_flags
from .reachability import DIRECT, OUTBOUND, RELAYED, Reach

logger = logging.getLogger(__name__)


def start_dht(cfg: SwarmConfig, initial_peers: list[str], *, client_mode: bool = False,
              relay_service: bool = False, relays: list[str] = ()) -> DHT:
    """Start this node's DHT; with ``initial_peers``, fail with a clear message if none is reachable.

    :param relay_service: serve as a circuit relay for NAT'd peers (bootstrap nodes; public peers that opt in):
      go-libp2p starts its relay service once it believes it is publicly reachable, so that is forced, and
      p2pd runs with ``relay.RELAY_ENV`` so that this relay, not go-libp2p's default one, serves. (Off
      has no switch: hivemind 1.1.12's p2pd always runs the default relay, 128 KiB per relayed connection. A
      node relays for the NAT'd peers that list it: ``swarm.relays``, or the bootstraps.)
    :param relays: reserve a slot with these relays and announce circuit addresses through them (a NAT'd
      peer); the relays are static (no discovery: it would wait minutes for more candidates)
    """
    for addr in [*initial_peers, *relays]:
        parse_multiaddr(addr, need_peer_id=True, what="bootstrap/relay address")
    for addr in [*cfg.host_maddrs, *cfg.announce_maddrs]:
        parse_multiaddr(addr, need_peer_id=False, what="listen/announce address")
    admission = load_admission(cfg.secret_file, cfg.allowlist)
    # one process per identity on this machine (its key file's lock); a key we just made is in use nowhere else,
    # so hivemind's check for it on the network (another machine with a copy of the key) is skipped
    created = hold_identity(cfg.identity_path) if cfg.identity_path else False
    announce = [f"{r}/p2p-circuit" for r in relays] or list(cfg.announce_maddrs)
    nat = dict(use_auto_relay=True, trusted_relays=list(relays), force_reachability="private") if relays else {}
    try:
        with (p2pd_flags(**({"relayDiscovery": "0"} if relays else {})),
              relay.p2pd_env(relay.RELAY_ENV if relay_service else {})):
            return DHT(
                start=True,
                initial_peers=list(initial_peers),
                host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=announce or None,
                identity_path=cfg.identity_path or None,
                check_if_identity_free=not created,
                client_mode=client_mode,
                startup_timeout=cfg.startup_timeout,
                authorizer=admission.authorizer(),  # a closed swarm: every DHT message signed with its secret
                **({"force_reachability": "public"} if relay_service else nat),
                # the DHT process is stopped by our shutdown, not by a parent-death heuristic
                await_ready=True,
                # every read of ours asks for the latest version (``latest=True``), past any cache: refreshing a
                # value read shortly before it expires (hivemind's default, 5 s before) was one more walk of the DHT
                # for each key read, served by every node near it, and read by nobody
                cache_refresh_before_expiry=0,
            )
    except Exception as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers and "bootstrap" in message:
            raise BootstrapUnreachable(
                f"could not reach any bootstrap peer of {', '.join(initial_peers)}: check the address "
                f"(copy it from the bootstrap's output), that the node is running and that its port is open"
                + ("; this peer uses a swarm secret: check it is the swarm's (swarm.secret_file)" if cfg.secret_file
                   else "; if the swarm is closed, set swarm.secret_file to its secret")
            ) from None
        if "already taken" in message:  # hivemind's check: another machine runs a copy of our key
            raise identity_in_use(cfg.identity_path) from None
        raise SwarmError(f"could not start the DHT node: {message}") from None


async def _ping_peers(_dht: DHT, node, peers: list[str]) -> int:
    answered = 0
    for text in peers:
        addr = Multiaddr(text)
        peer_id = PeerID.from_base58(addr.value_for_protocol("p2p"))
        try:
            await p2pd_client(node.p2p).connect(peer_id, [addr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))])
            answered += await node.protocol.call_ping(peer_id) is not None
        except Exception as e:  # down: the others may answer
            logger.debug(f"initial peer {text} did not answer: {e!r}")
    if answered:  # as hivemind's own bootstrap does: fill the routing table around our id
        await node.find_nearest_nodes([node.node_id])
    return answered


def join_dht_peers(dht: DHT, peers: list[str]) -> None:
    """Join other DHT nodes after the start (what ``initial_peers`` does at the start): a relay must start
    without bootstrap peers, see ``bootstrap_node.start_relay``."""
    if peers and not dht.run_coroutine(partial(_ping_peers, peers=list(peers))):
        raise BootstrapUnreachable(f"none of the initial peers {', '.join(peers)} answered: check the addresses "
                                   f"and that those nodes are running")


async def start_reachable_dht(cfg: SwarmConfig, initial_peers: list[str]) -> tuple[DHT, Reach]:
    """Start the DHT the way others can reach us (see reachability.py): directly, through relays, or not at all
    (client mode). ``swarm.reachability`` = auto finds out with a dial-back from a bootstrap first. A listen port 0
    is one free port for the dial-back and the DHT, held until the DHT listens on it (``held_ports``)."""
    with reachability.held_ports(cfg.host_maddrs) as host_maddrs:
        return await _start_on_held_ports(cfg.model_copy(update={"host_maddrs": host_maddrs}), initial_peers)


async def _start_on_held_ports(cfg: SwarmConfig, initial_peers: list[str]) -> tuple[DHT, Reach]:
    mode = cfg.reachability
    detail = f"set by swarm.reachability={cfg.reachability}"
    if mode == "auto" and initial_peers:
        try:
            direct, detail = await reachability.probe_direct(cfg.host_maddrs, cfg.announce_maddrs, initial_peers)
        except Exception as e:  # e.g. the port is taken: start_dht says so in its own words
            direct = None
            detail = f"could not run the dial-back probe ({str(e).strip()[:200]})"
        mode = RELAYED if direct is False else DIRECT
    elif mode == "auto":
        mode = DIRECT
        detail = "the first node of a swarm (no bootstrap to dial us back)"
    port = next((a.split("/tcp/")[1].split("/")[0] for a in cfg.host_maddrs if "/tcp/" in a), "<port>")
    forward = (f"forward TCP port {port} on your router to this machine and set "
               f"swarm.announce_maddrs=[\"/ip4/<your public IP>/tcp/{port}\"] (or --announce)")
    if mode == DIRECT:
        dht = await hivemind_calls.call(start_dht, cfg, initial_peers, relay_service=cfg.relay_service)
        return dht, Reach(DIRECT, detail)
    relays = list(cfg.relays) or list(initial_peers)
    if mode == RELAYED and relays:
        dht = await hivemind_calls.call(start_dht, cfg, initial_peers, relays=relays)
        try:
            p2p = await dht.replicate_p2p()
            carried = await reachability.check_relays(p2p, relays, wait=reachability.RELAY_WAIT,
                                                      settle=reachability.RELAY_SETTLE)
            held = await relay.usable_relays(p2p, carried)
        except BaseException:
            await hivemind_calls.call(dht.shutdown)
            raise
        if held:
            return dht, Reach(RELAYED, f"{detail}; reachable through {len(held)} relay(s): "
                              + ", ".join(r.split("/")[-1][-8:] for r in held),
                              f"Relayed traffic is slower: for direct connections {forward}", held)
        await hivemind_calls.call(dht.shutdown)
        detail += (f"; no relay of {len(relays)} dialed us through its circuit within {reachability.RELAY_WAIT:g}s"
                   if not carried else f"; the {len(carried)} relay(s) that dialed us grant too little (warned above)")
    dht = await hivemind_calls.call(start_dht, cfg, initial_peers, client_mode=True)
    return dht, Reach(OUTBOUND, detail, f"This peer averages only with reachable peers and never leads a group: "
                      f"{forward}, or check swarm.relays")


async def join_swarm(cfg: SwarmConfig, initial_peers: list[str], should_stop=lambda: False
                     ) -> tuple[DHT, Reach] | None:
    """Start the DHT (``start_reachable_dht``); while no bootstrap is reachable, retry with backoff (2 s doubling
    to 60 s) for up to ``cfg.join_timeout`` seconds. Returns None if ``should_stop()`` turns true while waiting."""
    if cfg.identity_path:  # before the reachability probe and any wait: a second process stops at once
        await asyncio.to_thread(hold_identity, cfg.identity_path)
    started = time.monotonic()
    delay = 2.0
    while True:
        try:
            return await start_reachable_dht(cfg, initial_peers)
        except BootstrapUnreachable as e:
            left = cfg.join_timeout - (time.monotonic() - started)
            if left <= 0:
                raise BootstrapUnreachable(f"{e} (gave up after swarm.join_timeout={cfg.join_timeout:g}s)") from None
            wait = min(delay, left)
            logger.warning(f"{e}; retrying in {wait:.0f}s (up to swarm.join_timeout={cfg.join_timeout:g}s)")
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if should_stop():
                    return None
                await asyncio.sleep(0.2)
            delay = min(delay * 2, 60.0)


def visible_addresses(dht: DHT) -> list[str]:
    return [str(a) for a in dht.get_visible_maddrs()]


def join_address(dht: DHT) -> str:
    """The address to hand to others: a non-loopback one if there is any, IPv4 and TCP preferred."""

    def rank(addr: str) -> tuple:
        parts = addr.split("/")
        host = parts[2] if len(parts) > 2 else ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        return (loopback, parts[1] != "ip4", "/tcp/" not in addr)

    addresses = visible_addresses(dht)
    if not addresses:
        raise SwarmError("the DHT node reports no listen address: check --listen")
    return min(addresses, key=rank)

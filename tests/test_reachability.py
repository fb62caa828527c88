"""Reachability on loopback: the probe service's rules, the relay's limit check, and bad input (see test_nat.py
for real peers behind emulated NAT routers)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers import run_cli
from multiaddr import Multiaddr

from diloco_peer.bootstrap_node import start_relay
from diloco_peer.config import SwarmConfig
from diloco_peer.swarm.reachability import ProbeService, held_ports, probe_direct
from diloco_peer.swarm.relay import usable_relays


def _service(own: list[str]) -> ProbeService:
    class _P2P:
        peer_id = "12D3KooWRelay"

    return ProbeService(_P2P(), prober=None, own_addrs=own)


def test_the_probe_service_dials_only_the_callers_own_address_or_its_own_circuit():
    service = _service(["/ip4/10.0.0.1/tcp/31337", "/ip4/127.0.0.1/tcp/31337"])
    observed = Multiaddr("/ip4/203.0.113.7/tcp/55555")
    request = {"port": 40001, "addrs": ["/ip4/203.0.113.7/tcp/40001/p2p/12D3KooWPeer", "/ip4/198.51.100.1/tcp/80",
                                        "/ip4/10.0.0.1/tcp/22", "/ip4/203.0.113.7/tcp/9/p2p/X/p2p-circuit"]}
    # a third party's address (198.51.100.1), our own LAN (10.0.0.1) and circuits are never dialed
    assert service._candidates(observed, request) == ["/ip4/203.0.113.7/tcp/40001"]
    assert service._candidates(observed, {"port": 40002}) == ["/ip4/203.0.113.7/tcp/40002"]
    assert service._candidates(observed, {"port": "22; rm -rf /", "addrs": "nonsense"}) == []
    assert service._candidates(observed, {"addrs": [f"/ip4/203.0.113.7/tcp/{p}" for p in range(1, 99)]}) == [
        "/ip4/203.0.113.7/tcp/1", "/ip4/203.0.113.7/tcp/2", "/ip4/203.0.113.7/tcp/3"]  # at most three dials
    # through our relay: our own address, loopback first (the prober runs on this machine)
    assert service._candidates(observed, {"circuit": True}) == [
        "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWRelay/p2p-circuit"]
    relayed = Multiaddr("/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N/p2p-circuit")
    assert service._candidates(relayed, {"port": 1}) == []  # a caller behind a relay: nothing to dial directly


def test_held_ports_pick_one_port_for_the_probe_and_the_dht_and_keep_it_from_everyone_else_meanwhile():
    """A 32-peer demo: two peers picked the same free port (each let it go before its p2pd took it), both p2pds bound
    it (``SO_REUSEPORT``) and each dial to it reached either; the two lost each other every round."""
    with held_ports(["/ip4/0.0.0.0/tcp/0", "/ip4/127.0.0.1/tcp/40001"]) as resolved:
        assert resolved[0].startswith("/ip4/0.0.0.0/tcp/") and not resolved[0].endswith("/tcp/0")
        assert resolved[1] == "/ip4/127.0.0.1/tcp/40001"
        port = int(resolved[0].rsplit("/", 1)[1])
        with socket.socket() as other, pytest.raises(OSError):  # another process's bind: refused
            other.bind(("", port))
        with socket.socket() as p2pd:  # our p2pd's bind, with SO_REUSEPORT as go-libp2p's: allowed, and it listens
            p2pd.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            p2pd.bind(("", port))
            p2pd.listen()
    with socket.socket() as later:  # let go after the block
        later.bind(("", port))


async def _probe_on_a_held_port(bootstraps: list[str]):
    """A dial-back probe as a joining peer runs it: on a port held for it (its p2pd binds it all the same)."""
    with held_ports(["/ip4/127.0.0.1/tcp/0"]) as host_maddrs:
        return await probe_direct(host_maddrs, [], bootstraps)


@pytest.mark.slow
@pytest.mark.light
def test_a_bootstrap_relay_grants_big_circuits_and_dials_a_listening_peer_back():
    async def main():
        dht, probes = await start_relay(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), [])
        try:
            # p2pd's configured relay serves, not go-libp2p's default one (see ProbeService.relay_limit)
            assert await probes.relay_limit() == (True, "4 GiB and 30 min per relayed connection")
            boot = f"{probes.own_addrs[0]}/p2p/{dht.peer_id}"
            assert await usable_relays(probes.prober, [boot]) == [boot]
            direct, detail = await _probe_on_a_held_port([boot])
            assert direct is True and "dialed us back at /ip4/127.0.0.1/tcp/" in detail, detail
            nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
            direct, detail = await _probe_on_a_held_port([nobody])
            assert direct is None and detail.startswith("no bootstrap answered the dial-back probe"), detail
        finally:
            await probes.close()
            dht.shutdown()

    asyncio.run(main())


def test_bad_network_settings_are_one_line_errors():
    boot = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    for args, expected in [
        (["--announce", "203.0.113.7:40001"], "bad swarm.announce_maddrs address '203.0.113.7:40001'"),
        (["--listen", "/ip4/0.0.0.0"], "bad swarm.host_maddrs address '/ip4/0.0.0.0': no /tcp/ or /udp/ port"),
        (["--set", 'swarm.relays=["/ip4/10.0.0.1/tcp/31337"]'], "missing /p2p/<peer-id>"),
        (["--reachability", "sometimes"], "invalid choice: 'sometimes'"),
    ]:
        result = run_cli("join", boot, *args)
        assert result.returncode == 2, (args, result)
        lines = result.stderr.strip().splitlines()
        assert expected in lines[-1] and "Traceback" not in result.stderr, (args, result.stderr)

"""What a relay grants: go-libp2p's default relay (128 KiB per relayed connection) is told from the configured
one, and a NAT'd peer does not count on it (relay.py). A bootstrap's relay is checked in test_reachability.py."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from multiaddr import Multiaddr

from diloco_peer.swarm.p2pd_internals import p2pd_client, p2pd_flags
from diloco_peer.swarm.relay import circuit_limit, limit_text, usable_relays


def test_limits_in_words():
    assert limit_text(4 << 30, 1800) == "4 GiB and 30 min per relayed connection"
    assert limit_text(128 << 10, 120) == "128 KiB and 2 min per relayed connection"
    assert limit_text(None, None) == "no data limit and no time limit per relayed connection"


@pytest.mark.slow
@pytest.mark.light
def test_the_limit_check_tells_go_libp2ps_default_relay_from_the_configured_one():
    async def main():
        with p2pd_flags(relayService="0"):  # then only the default relay runs (p2pd's daemon.go starts it)
            relay = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], force_reachability="public")
        client = await P2P.create(no_listen=True)
        try:
            addrs = [Multiaddr(str(a).split("/p2p/")[0]) for a in await relay.get_visible_maddrs()]
            await p2pd_client(client).connect(relay.peer_id, addrs)
            assert await circuit_limit(client, relay.peer_id) == (128 << 10, 120)
            # a NAT'd peer does not count on such a relay (a node of an older version)
            assert await usable_relays(client, [f"{addrs[0]}/p2p/{relay.peer_id}"]) == []
        finally:
            await client.shutdown()
            await relay.shutdown()

    asyncio.run(main())

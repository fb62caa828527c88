"""A peer that hands in stops serving DHT requests (``swarm/dht_role.py``): the others drop it from their routing
tables, it still stores and reads, and it serves again after a few rounds as a member."""

import asyncio
from functools import partial

import pytest
from conftest import wait_until
from hivemind.dht import DHT, DHTID
from hivemind.utils import get_dht_time

from diloco_peer.swarm.dht_role import SERVE_AGAIN_AFTER, DhtRole

pytestmark = [pytest.mark.slow, pytest.mark.light]  # three DHT nodes; nothing timed


async def _knows(_dht, node, node_id: DHTID) -> bool:
    return node_id in node.protocol.routing_table


async def _node_id(_dht, node) -> DHTID:
    return node.node_id


async def _client(_dht, node) -> bool:
    return node.protocol.client_mode


@pytest.fixture
def three_dhts():
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addrs = [str(a) for a in root.get_visible_maddrs()]
    others = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addrs) for _ in range(2)]
    yield root, *others
    for dht in [*others, root]:
        dht.shutdown()


def test_a_node_that_stops_serving_leaves_the_others_tables_and_still_stores_and_reads(three_dhts):
    root, other, slow = three_dhts
    slow_id = slow.run_coroutine(_node_id)
    knows_slow = partial(_knows, node_id=slow_id)

    def in_tables() -> bool:
        return root.run_coroutine(knows_slow) and other.run_coroutine(knows_slow)

    wait_until(in_tables, "the node in both tables")
    role = DhtRole(slow, serving=True)

    assert asyncio.run(role.round(handed_in=True))  # switched
    assert not role.serving and slow.run_coroutine(_client)
    assert not asyncio.run(role.round(handed_in=True))  # (already a client)
    # it stores and reads at once, while the others still name it among the nodes nearest a key
    assert slow.store("s", "from the client", get_dht_time() + 60)
    assert other.get("s", latest=True).value == "from the client"
    # the others' next requests to it are refused: each drops it, and their records live on each other
    for i in range(3):
        assert other.store(f"k{i}", i, get_dht_time() + 60)
        assert root.store(f"r{i}", i, get_dht_time() + 60)
    assert not root.run_coroutine(knows_slow) and not other.run_coroutine(knows_slow)
    assert slow.get("k2", latest=True).value == 2
    assert slow.store("s2", "again", get_dht_time() + 60)
    assert root.get("s2", latest=True).value == "again"
    assert not root.run_coroutine(knows_slow) and not other.run_coroutine(knows_slow)  # its requests name it not

    # rounds as a member: after SERVE_AGAIN_AFTER of them it serves, and its next request has the others take it back
    for _ in range(SERVE_AGAIN_AFTER - 1):
        assert not asyncio.run(role.round(handed_in=False))
    assert not role.serving
    assert asyncio.run(role.round(handed_in=False))
    assert role.serving and not slow.run_coroutine(_client) and slow.run_coroutine(_node_id) == slow_id
    assert slow.store("back", 1, get_dht_time() + 60)
    wait_until(in_tables, "the node in the tables again")
    assert root.get("back", latest=True).value == 1


def test_a_peer_that_joined_as_a_client_never_serves(three_dhts):
    _, _, slow = three_dhts
    role = DhtRole(slow, serving=False)
    for handed_in in [True] + [False] * SERVE_AGAIN_AFTER:
        assert not asyncio.run(role.round(handed_in=handed_in))
    assert not role.serving and not slow.run_coroutine(_client)  # (this one was started serving: left alone)

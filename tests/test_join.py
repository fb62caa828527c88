"""Starting this node's DHT (``swarm/join.py``): what it asks of hivemind's node beyond the defaults."""

import pytest
from hivemind.utils import get_dht_time

from diloco_peer.config import SwarmConfig
from diloco_peer.swarm.join import start_dht

pytestmark = [pytest.mark.slow, pytest.mark.light]  # two DHT nodes; nothing timed


async def _refreshes_queued(_dht, node) -> int:
    return len(node.cache_refresh_queue)


def test_a_value_read_is_not_refreshed_before_it_expires():
    """Every read of ours asks for the latest version, past any cache. hivemind's node, by default, reads a value it
    found again shortly before it expires (one more walk of the DHT per key read, which the nodes near the key serve):
    ours queues no such refresh."""
    config = SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=10)
    boot = start_dht(config, [])
    started = [boot]
    try:
        member = start_dht(config, [str(a) for a in boot.get_visible_maddrs()])
        started.append(member)
        assert member.store("progress", "ready", expiration_time=get_dht_time() + 6)
        for dht in started:  # (the storer's own copy and the other node's, each read as a swarm gate reads)
            assert dht.get("progress", latest=True).value == "ready"
        assert [dht.run_coroutine(_refreshes_queued) for dht in started] == [0, 0]
    finally:
        for dht in started:
            dht.shutdown()

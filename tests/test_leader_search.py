"""The leader search, paced (``averaging/leader_search.py``): hivemind's own ``PotentialLeaders`` searching for a
better leader than us, with a key manager that finds none, in this process (no DHT): paced, it reads the leaders
once per ``POLL_SECONDS``; left alone, it reads them back to back."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco_peer.averaging import leader_search

SEARCH_SECONDS = 0.5


class NoLeaders:
    """A ``GroupKeyManager`` under whose key nobody else has declared: every read finds no leader."""

    current_key = "run.0b"

    def __init__(self):
        self.reads: list[float] = []

    async def get_averagers(self, group_key, only_active):
        self.reads.append(time.monotonic())
        return []


async def _search(keys) -> None:
    # a peer that leads: nobody is better, so it waits for a leader until its search ends
    leaders = PotentialLeaders(PeerID(b"\x00" * 34), min_matchmaking_time=SEARCH_SECONDS, target_group_size=None)
    step = SimpleNamespace(deadline=get_dht_time() + SEARCH_SECONDS)
    async with leaders.begin_search(step, keys, declare=False):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(leaders.pop_next_leader(), SEARCH_SECONDS + 0.2)


def test_a_peer_that_finds_no_better_leader_reads_the_dht_once_per_poll_interval_not_back_to_back():
    unpaced, paced = NoLeaders(), NoLeaders()
    leader_search.pace_reads(paced)
    leader_search.pace_reads(paced)  # idempotent: still one pace
    asyncio.run(_search(unpaced))
    asyncio.run(_search(paced))
    assert len(unpaced.reads) > 10 * SEARCH_SECONDS / leader_search.POLL_SECONDS, len(unpaced.reads)
    assert len(paced.reads) <= SEARCH_SECONDS / leader_search.POLL_SECONDS + 2, len(paced.reads)
    gaps = [b - a for a, b in zip(paced.reads, paced.reads[1:])]
    assert gaps and min(gaps) >= leader_search.POLL_SECONDS - 0.01, gaps

"""The leader search, paced: matchmaking reads the DHT for better leaders at most every ``POLL_SECONDS``.

While it looks for a group, hivemind's matchmaking keeps a queue of the leaders declared under the round's key,
read from the DHT (``PotentialLeaders._update_queue_periodically``), and takes its next leader from it
(``pop_next_leader``). A peer that finds no leader better than itself (the one that leads the group, and any peer
until a better one has declared) asks for a new read, waits for it, finds the same queue, and asks again: it reads
the DHT back to back for the whole matchmaking window. Each read crosses from the averager process to the DHT
process and out over p2pd, so such a peer kept about a core busy while it gathered its group: its own training
(an overlapped round trains meanwhile) and every other process of the machine got the rest.

So the reads of this averager's key manager (``GroupKeyManager.get_averagers``, which only that loop calls) are
spaced by ``POLL_SECONDS`` at least: the first read of a search goes out at once, and a peer learns of a better
leader that declared meanwhile within ``POLL_SECONDS``. Joining needs no read: a follower asks its leader directly,
and the leader takes it in as the request comes (measured: BENCHMARKS.md, "The leader search, paced").
"""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager

from . import hivemind_internals as internals

POLL_SECONDS = 0.1
"""The least time between two reads of the DHT for leaders, per averager."""


def pace(averager: DecentralizedAverager) -> None:
    """Space this averager's reads of the DHT for leaders by ``POLL_SECONDS``. In the averager process; idempotent
    (call it before each step, like the other per-instance patches of its matchmaking)."""
    pace_reads(internals.matchmaking_of(averager).group_key_manager)


def pace_reads(keys: GroupKeyManager) -> None:
    """Space the reads of ``keys.get_averagers`` by ``POLL_SECONDS`` (on this instance only; idempotent)."""
    if getattr(keys, "diloco_paced", False):
        return
    get_averagers = keys.get_averagers
    last_read = float("-inf")  # time.monotonic()

    async def paced_get_averagers(group_key, only_active):
        nonlocal last_read
        await asyncio.sleep(max(0.0, last_read + POLL_SECONDS - time.monotonic()))
        last_read = time.monotonic()
        return await get_averagers(group_key, only_active)

    keys.get_averagers = paced_get_averagers
    keys.diloco_paced = True

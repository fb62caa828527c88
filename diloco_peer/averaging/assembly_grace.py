"""The leader's assembly grace: a complete group forms at once, unless a follower in it may already be gone.

Told how many peers the round expects (``PseudoGradientAverager.expect_group``), a group we lead forms the moment
its last member is in (``hivemind_internals.set_target_group_size``). Such a group can hold a follower that is
already gone: one whose join request timed out on its side (a busy leader answered late) closes its stream and
looks for another group, and hivemind forgets it only once its handler sees the closed stream. The group would
then wait a whole sender timeout for that follower's parts (seen under load, in CI).

So, once a size was set, the leader waits ``ASSEMBLY_GRACE`` seconds before it forms the group (it holds the join
lock: nobody else joins meanwhile), and a follower that left in the meantime is not in the group; unless this
process's event loop has been on time (``LoopLag.calm``). A request that waited over half its timeout for us is
turned away already (``hivemind_internals.reject_stale_join_requests``), and a leader that answers the rest at
once leaves its followers half their timeout for the way there and back: no follower of a calm leader has given
up. Waited always, the grace made a loopback round's all-reduce markedly slower (``bench/round_latency.py``;
measured: BENCHMARKS.md, "Hiding the network", "Blocking rounds need not idle on the matchmaking window").

Only the loop's lateness since the round began counts: every join request of a round comes after its step began
(a follower finds us through our declaration in the DHT, under this round's key, made once our step begins), so a
loop late before then, while this peer trained, kept none of them waiting.
"""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging import DecentralizedAverager

from . import hivemind_internals as internals

ASSEMBLY_GRACE = 0.15
"""Seconds a leader whose loop was late waits between "the group is complete" and forming it."""


class LoopLag:
    """How late the running event loop has woken a task that sleeps ``period`` seconds, over the last ``window``
    seconds: a loop that is on time answers a message as soon as it arrives. ``watched``: how long the watch must
    have run before it can call the loop calm (default: a whole window)."""

    def __init__(self, period: float = 0.05, window: float = 5.0, limit: float = 0.05, watched: float | None = None):
        self.period = period
        self.window = window
        self.limit = limit
        self.watched = window if watched is None else min(watched, window)
        self.since: float | None = None
        """``time.monotonic()`` when the watch began."""
        self.tick = 0.0
        """``time.monotonic()`` of the last wake-up."""
        self.late: list[float] = []
        """``time.monotonic()`` of the wake-ups over ``limit`` late, in the window."""

    def start(self) -> None:
        """Starts watching the running loop (the task ends with the loop)."""
        asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        self.since = self.tick = time.monotonic()
        while True:
            await asyncio.sleep(self.period)
            now = time.monotonic()
            if now - self.tick - self.period > self.limit:
                self.late.append(now)
            self.late = [t for t in self.late if now - t <= self.window]
            self.tick = now

    def calm(self, since: float | None = None) -> bool:
        """Watched for ``watched`` seconds, and never ``limit`` seconds late in the last window (a slow tick still
        under way counts: a loop blocked right now has not woken the watcher). ``since`` (a ``time.monotonic()``
        the watch had already begun by): only late wake-ups from then on count, and it need not have run
        ``watched``."""
        now = time.monotonic()
        if self.since is None or now - self.tick > self.period + self.limit:
            return False
        start = now - self.window
        if since is not None and self.since <= since:
            start = max(start, since)
        elif now - self.since < self.watched:
            return False
        return not any(t > start for t in self.late)


def round_begins(averager: DecentralizedAverager, size: int | None) -> None:
    """In the averager process, before each step, after ``set_target_group_size(averager, size)``: from now on
    only the loop's lateness counts, and once a size is set, the groups this averager leads wait the grace
    before they form unless the loop has been calm since then.

    The first call (with a size or not: the daemon makes one when its averager starts) starts the loop watch.
    A join request lives at most ``request_timeout``: once the watch has run that long, every request still
    waiting came while it watched, so the watch may call the loop calm then (a whole window made a round that
    began soon after the start wait the grace)."""
    matchmaking = internals.matchmaking_of(averager)
    lag = getattr(matchmaking, "_loop_lag", None)
    if lag is None:
        lag = matchmaking._loop_lag = LoopLag(watched=matchmaking.request_timeout)
        lag.start()
    matchmaking._round_began = time.monotonic()
    if size is None or getattr(matchmaking, "_assembles_after_grace", False):
        return
    assemble = matchmaking.leader_assemble_group

    async def assemble_after_grace():
        if lag.calm(since=matchmaking._round_began):
            return await assemble()
        await asyncio.sleep(ASSEMBLY_GRACE)
        if matchmaking.assembled_group.done():  # cancelled meanwhile (the step was): nothing to form
            return matchmaking.assembled_group.result()
        return await assemble()

    matchmaking.leader_assemble_group = assemble_after_grace
    matchmaking._assembles_after_grace = True

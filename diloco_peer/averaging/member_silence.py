"""A member that goes silent in the middle of an all-reduce: still connected, saying nothing.

A member that crashes resets its connections, and the others drop it at once (``allreduce.py``,
``_drop_if_gone``). One whose laptop went to sleep, whose link died without a reset, or whose averager hangs
keeps its connections up and sends nothing through them. hivemind's only answer is a timeout per message:
``sender_timeout`` for a sender's next part (half of ``averaging.allreduce_timeout``) and ``reducer_timeout`` for
a reducer's next average (three quarters of it); the whole group waited out the reducer timeout for such a member
(``bench/dead_member.py --fault freeze``; measured: BENCHMARKS.md, "Reliability: a member that dies (or freezes)
before it sends").

Silence alone proves nothing: a reducer says nothing until every sender's part is in, and a member on a slow uplink
may take seconds between two messages to us. So a member we wait on that has said nothing for ``SILENT_AFTER``
seconds (more in a large group: ``Patience``) is asked, on a stream of its own, whether it is still there
(``rpc_still_there``, which its averager answers at once: ``member_news.py``). A member that answers, or whose parts
come in meanwhile, is waited for as before, hivemind's timeouts still bounding the wait; one that answers nothing
within ``PROBE_TIMEOUT`` (more in a large group) is silent: dropped from the round at once, as a member that crashed
would be. Only a question that goes unanswered counts: an error is an answer (a peer of an older version, without
this call, gets the old timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

SILENT_AFTER = 1.5
"""Seconds without a message from a member we wait on before we ask whether it is still there."""
PROBE_TIMEOUT = 5.0
"""Seconds a member has to answer: generous, as the answer may queue behind its own parts on a slow uplink."""
WATCH_EVERY = 0.25
"""Seconds between two looks at the members we wait on."""
SILENT_PER_MEMBER = 0.1
"""Seconds of ``SILENT_AFTER`` per member of the group, past 15 members."""
PROBE_PER_MEMBER = 0.5
"""Seconds of ``PROBE_TIMEOUT`` per member of the group, past 10 members."""

logger = logging.getLogger(__name__)


class Patience:
    """How long a member may be quiet, and take to answer, in a group of ``members``: ``SILENT_AFTER`` and
    ``PROBE_TIMEOUT``, or more in a large group. A reducer says nothing until every member's part is in, and a member
    answers our question behind its work for every other member: both grow with the group. With many peers on one
    loaded machine live members were dropped as silent, and every member that had sent them a part ended its round
    partial (BENCHMARKS.md, "Many peers"). On machines of their own the answers come at once, and a frozen member of
    a large group is dropped that much later, still well within hivemind's timeouts."""

    def __init__(self, members: int = 0):
        self.silent_after = max(SILENT_AFTER, SILENT_PER_MEMBER * members)
        self.probe_timeout = max(PROBE_TIMEOUT, PROBE_PER_MEMBER * members)


class MemberSilent(Exception):
    """Raised instead of waiting on for a member found silent."""


class SilenceWatch:
    """Finds the members of one all-reduce that have gone silent.

    :param ask: ``ask(peer)`` asks the member whether it is still there and returns once it has answered (an
      error counts as an answer); it may take forever: the watch gives it ``patience.probe_timeout`` seconds
    :param waited_on: returns the members we wait on now (for parts, averages, or a hang-up)
    :param on_silent: called once with each member found silent, before anyone waiting on it is woken
    :param patience: how long a member may be quiet and take to answer (by the group's size)
    """

    def __init__(self, ask: Callable[[object], Awaitable[None]], waited_on: Callable[[], set],
                 on_silent: Callable[[object], Awaitable[None]], patience: Patience | None = None):
        self.patience = patience or Patience()
        self._ask = ask
        self._waited_on = waited_on
        self._on_silent = on_silent
        self._started = time.monotonic()
        self._heard: dict[object, float] = {}
        self._silent: dict[object, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self.found: list[object] = []
        """The members found silent, in the order found."""

    def heard(self, peer) -> None:
        """A message from ``peer`` came in: it is not silent."""
        self._heard[peer] = time.monotonic()

    def is_silent(self, peer) -> bool:
        return peer in self.found

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _event(self, peer) -> asyncio.Event:
        return self._silent.setdefault(peer, asyncio.Event())

    async def unless_silent(self, peer, awaitable: Awaitable):
        """``await awaitable``, unless ``peer`` is found silent first: then it is cancelled and ``MemberSilent``
        raised."""
        work = asyncio.ensure_future(awaitable)
        silence = asyncio.ensure_future(self._event(peer).wait())
        try:
            await asyncio.wait({work, silence}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            raise MemberSilent(f"{peer} went silent: no message for {self.patience.silent_after:g}s, no answer "
                               f"within {self.patience.probe_timeout:g}s")
        finally:
            silence.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)

    async def _watch(self) -> None:
        asking: dict[object, asyncio.Task] = {}
        while True:
            now = time.monotonic()
            for peer in self._waited_on():
                quiet = now - self._heard.get(peer, self._started)
                if peer not in asking and peer not in self.found and quiet >= self.patience.silent_after:
                    asking[peer] = asyncio.create_task(self._still_there(peer))
            for peer, task in list(asking.items()):
                if task.done():
                    del asking[peer]
                    if not task.result():
                        await self._found_silent(peer, time.monotonic() - self._heard.get(peer, self._started))
            await asyncio.sleep(WATCH_EVERY)

    async def _still_there(self, peer) -> bool:
        """Ask ``peer``; True if it answered, or said anything else, within our patience's probe timeout."""
        asked = time.monotonic()
        try:
            await asyncio.wait_for(self._ask(peer), self.patience.probe_timeout)
        except asyncio.TimeoutError:
            return self._heard.get(peer, self._started) > asked  # its parts came in meanwhile: not silent
        except Exception:  # any answer, an error too, comes from a live member (e.g. an older version)
            pass
        self.heard(peer)
        return True

    async def _found_silent(self, peer, quiet: float) -> None:
        self.found.append(peer)
        logger.warning(f"all-reduce: member {peer} said nothing for {quiet:.1f}s and did not answer within "
                       f"{self.patience.probe_timeout:g}s (asleep, or its link died without a reset): dropped from "
                       f"this round")
        try:
            await self._on_silent(peer)
        finally:
            self._event(peer).set()

"""The two small questions members put to each other's averagers outside an all-reduce's streams.

- **Still there?** (``rpc_still_there``): a member of our all-reduce that has heard nothing from us for a while
  asks before it drops us as silent (``member_silence.py``). Answered at once.
- **The round's last peer is ready** (``rpc_round_ready``): the round gate (``SwarmProgress.wait_until_ready``)
  polls the swarm's records in the DHT, so a peer waiting there learned that the last one got ready up to a poll
  (and a DHT read) after that one did, and that one's matchmaking waited for it. The last peer now tells the
  peers it found waiting (``MemberNews.tell``, from our averager process beside the round's ``expect_group``),
  and their gates read the records at once. The news is only a reason to read: a gate decides on the records
  alone, so a false one costs the receiver a DHT read (one per ``SwarmProgress.NUDGE_GAP`` at most), nothing
  else. What it gains on loopback: BENCHMARKS.md, "Hiding the network", "Blocking rounds need not idle on the
  matchmaking window" (the last peer's news at the gate).

hivemind serves the ``rpc_*`` methods of the averager's own class, so both handlers are methods of
``PseudoGradientAverager``, each a line that answers or hands the news to its ``MemberNews``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
from collections.abc import Callable

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

NUDGE_TIMEOUT = 2.0
"""Seconds a nudge may take before it is given up (the receiver's gate then finds out at its next poll)."""

logger = logging.getLogger(__name__)


class Nudge:
    """A flag the averager process raises and the host's round gate waits on, in its event loop, without polling.

    A ``multiprocessing.Event`` has nothing an event loop can watch: the gate looked at one every few milliseconds
    (dozens of waiting peers on one machine spent a share of its cores looking: BENCHMARKS.md, "Many peers"), or
    would need a thread started for each wait. This is a non-blocking pipe, made before the averager process forks:
    ``set`` writes a byte, the gate's loop watches the read end (``wait_in_loop``).
    """

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a pipe full of unread nudges: set already (or closed)
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (``timeout`` seconds at most); whether it is (never, once closed)."""
        return self._read >= 0 and bool(select.select([self._read], [], [], timeout)[0])

    def clear(self) -> None:
        with contextlib.suppress(OSError):  # (BlockingIOError: nothing more to read)
            while os.read(self._read, 4096):
                pass

    async def wait_in_loop(self, timeout: float) -> bool:
        """``wait``, in the running event loop: it sleeps until the byte comes or the time is up."""
        if self.is_set():
            return True
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        loop.add_reader(self._read, lambda: woken.done() or woken.set_result(True))
        try:
            await asyncio.wait_for(woken, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(self._read)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read = self._write = -1


class MemberNews:
    """The news "the round's last peer is ready", heard and told, for one averager.

    Made in the host process before the averager process forks: ``nudged`` is shared by both.
    """

    def __init__(self):
        self.nudged = Nudge()
        """Set when another peer says the round's last peer is ready; the host's round gate watches it
        (``SwarmProgress.nudged``) and clears it."""

    def heard(self) -> None:
        """In the averager process: another peer found every peer of its round ready (``rpc_round_ready``)."""
        self.nudged.set()

    def tell(self, peers: list[str], stub: Callable[[PeerID], object]) -> None:
        """In the averager process: tell ``peers`` (base58 ids) that the round's last peer is ready, in the
        background (a peer that does not answer in ``NUDGE_TIMEOUT`` finds out at its next poll). ``stub(peer)``:
        the averager's stub for ``peer``, through which its ``rpc_round_ready`` is called."""
        for peer in peers:
            asyncio.create_task(self._tell(peer, stub))

    @staticmethod
    async def _tell(peer: str, stub: Callable[[PeerID], object]) -> None:
        try:
            request = stub(PeerID.from_base58(peer)).rpc_round_ready(averaging_pb2.DownloadRequest())
            await asyncio.wait_for(request, NUDGE_TIMEOUT)
        except Exception as e:  # gone, slow, or an older version without this call: its gate polls anyway
            logger.debug(f"nudge to {peer} failed: {type(e).__name__}: {e}")

"""The two small questions members put to each other's averagers outside an all-reduce's streams.

- **Still there?** (``rpc_still_there``): a member of our all-reduce that has heard nothing from us for a while
  asks before it drops us as silent (``member_silence.py``). Answered at once.
- **The round's last peer is ready** (``rpc_round_ready``): the round gate (``SwarmProgress.wait_until_ready``)
  reads the swarm's records from the DHT every 0.05 s, so a peer waiting there learned that the last one got
  ready up to a poll (and a DHT read) after that one did, and that one's matchmaking waited for it: the skew
  between the peers' gates was 0-0.07 s of a loopback round's ~0.2 s all-reduce. The last peer now tells the
  peers it found waiting (``nudge``, sent from our averager process beside the round's ``expect_group``), and
  their gates read the records at once. The news is only a reason to read: a gate decides on the records alone,
  so a false one costs the receiver a DHT read (one per ``SwarmProgress.NUDGE_GAP`` at most), nothing else.
"""

from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from . import hivemind_internals as internals

NUDGE_TIMEOUT = 2.0
"""Seconds a nudge may take before it is given up (the receiver's gate then finds out at its next poll)."""

logger = logging.getLogger(__name__)


class MemberNews:
    """Mixed into ``PseudoGradientAverager``: the handlers of both questions, and the nudges we send.

    ``nudged`` (a ``multiprocessing.Event``, made before the averager process forks) is set when another peer
    says the round's last peer is ready; the host's round gate watches it (``SwarmProgress.nudged``)."""

    async def rpc_still_there(self, request: averaging_pb2.DownloadRequest,
                              context: P2PContext) -> averaging_pb2.DownloadRequest:
        """Answers at once (``member_silence.py``)."""
        return averaging_pb2.DownloadRequest()

    async def rpc_round_ready(self, request: averaging_pb2.DownloadRequest,
                              context: P2PContext) -> averaging_pb2.DownloadRequest:
        """Another peer found every peer of its round ready: our gate should read the records now."""
        self.nudged.set()
        return averaging_pb2.DownloadRequest()

    def nudge(self, peers: list[str]) -> None:
        """In the averager process: tell ``peers`` (base58 ids) that the round's last peer is ready, in the
        background (a peer that does not answer in ``NUDGE_TIMEOUT`` finds out at its next poll)."""
        for peer in peers:
            asyncio.create_task(self._nudge(peer))

    async def _nudge(self, peer: str) -> None:
        try:
            stub = type(self).get_stub(internals.p2p_of(self), PeerID.from_base58(peer), namespace=self.prefix)
            await asyncio.wait_for(stub.rpc_round_ready(averaging_pb2.DownloadRequest()), NUDGE_TIMEOUT)
        except Exception as e:  # gone, slow, or an older version without this call: its gate polls anyway
            logger.debug(f"nudge to {peer} failed: {type(e).__name__}: {e}")

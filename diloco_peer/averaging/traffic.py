"""What our all-reduces cost: counters in a small shared-memory tensor that the averager process writes and the
host reads (``RoundAverager`` takes their difference over a round: the round record's bytes and seconds).

The all-reduce (``allreduce.py``) counts the payload bytes of every message it sends and receives, through
``CountingStub`` for the streams we open and its own handler for those opened to us; the averager adds the
values not averaged and the time each all-reduce took (``pseudo_gradient_averager.py``).
"""

from __future__ import annotations

import torch
from hivemind.p2p import PeerID

SENT = 0
"""Slot: payload bytes of the all-reduce messages we sent."""
RECEIVED = 1
"""Slot: payload bytes of the all-reduce messages we received."""
FAILED_VALUES = 2
"""Slot: values of our vector that no reducer averaged (its reducer failed: we kept our own there)."""
TRANSFER_US = 3
"""Slot: microseconds our all-reduces took, from the group's start to the last reply."""
RELAYED = 4
"""Slot: of the bytes sent and received, those exchanged with members over relayed connections."""


def counters() -> torch.Tensor:
    """New counters, all zero, in shared memory (made before the averager process forks, shared with it)."""
    return torch.zeros(5, dtype=torch.int64).share_memory_()


class CountingStub:
    """Wraps a peer's averaging stub so that the all-reduce messages we exchange with it are counted.

    :param count: ``count(messages, slot, peer)`` passes ``messages`` on, adding each one's bytes to ``slot``
    """

    def __init__(self, stub, count, peer: PeerID):
        self._stub = stub
        self._count = count
        self._peer = peer

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(self._count(inputs, SENT, self._peer))
        return self._count(stream, RECEIVED, self._peer)

"""The swarm's epoch, by quorum: what most of the peers that have joined have reached, never the highest claim.

A newcomer knows nothing of the swarm's progress, so only joined peers vote (``voters``); a liar alone never moves
the epoch, a majority that advanced does (``quorum_epoch``). The round gate (``progress.py``), the state a peer syncs
to (``state/target.py``) and the swarm monitor read the epoch this way.
"""

from __future__ import annotations

from .progress_record import ProgressRecord

QUORUM = 0.5
"""The swarm's epoch is reached by more than this fraction of the voting peers (0.5: a strict majority;
0 would be the maximum any peer claims)."""


def voters(records: list[ProgressRecord]) -> list[ProgressRecord]:
    """The records whose epoch counts as evidence of the swarm's progress: those of joined peers (all of
    them while nobody has joined yet, as when a swarm starts)."""
    return [r for r in records if r.joined] or list(records)


def quorum_epoch(records: list[ProgressRecord], quorum: float = QUORUM) -> int | None:
    """The swarm's epoch: the highest epoch that more than ``quorum`` of the voting peers have reached.

    With the default strict majority, a swarm of 2 needs both (the lower epoch: a peer ahead of the other
    alone is not followed), 3 need 2, 5 need 3. A liar alone never moves it; a majority that advanced
    does. While a round ends the epochs differ by one and the swarm's epoch is the older one until most
    peers have stepped: a peer ahead is never pulled back (state sync refuses older states), a straggler
    catches up once the majority has moved on. None without records.
    """
    epochs = sorted((r.epoch for r in voters(records)), reverse=True)
    if not epochs:
        return None
    return epochs[min(int(len(epochs) * quorum) + 1, len(epochs)) - 1]

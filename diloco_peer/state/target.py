"""The sync target: the state the swarm agrees on, and the hash that names a state.

Each peer publishes its outer ``epoch`` and ``state_hash``: one sha256 over everything a donor serves, outer weights,
Nesterov momentum, epoch and inner LR position (``model.state_digest`` of each tensor's ``param_sha256``). The
momentum is in it because honest peers' buffers are bit-identical too and a sync replaces ours with the donor's: a
donor could otherwise poison us through it (momentum x100 was accepted before: the newcomer's loss went from ~2.4 to
87); epoch and LR position for the same reason. One digest per tensor: a donor lists them, and a download broken off
resumes from another donor after the tensors that matched. The *target* (``swarm_target``) is the
swarm's epoch by quorum (``quorum.quorum_epoch``: the highest epoch a strict majority of the joined peers have
reached, never what one peer claims) and, at that epoch, the hash most of its voting peers hold (ties: the
smallest hash, so every peer picks the same one). ``state_sync.py`` downloads it; ``rounds/healing.py`` and the
bootstrap's monitor compare records with it. A sync that failed tells which claims did not hold
(``rounds.healing.Healing.after_failed_sync``): they stop counting towards the target.

Known limit of the hash rule: peers that averaged together hold the same hash, so a liar cannot outvote them. Right
after a failed all-reduce, though, every peer may hold a state of its own; the tie then goes to the smallest hash so
that honest peers reconverge, and a liar that publishes a state at that epoch with a hash it ground to be small wins
it. Keeping our own state on a tie instead would leave honest replicas apart for good after every failed round.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from ..swarm.quorum import QUORUM, quorum_epoch, voters
from ..swarm.progress_record import ProgressRecord


@dataclass(frozen=True)
class Target:
    epoch: int
    state_hash: str
    holders: list[str]
    """Peer ids that publish exactly this state."""


def swarm_target(records: list[ProgressRecord], quorum: float = QUORUM) -> Target | None:
    """The state the swarm agrees on: its epoch by quorum (``quorum.quorum_epoch``), and the hash most of
    the voting peers at that epoch hold; None if no record carries a state."""
    records = [r for r in records if r.state_hash]
    epoch = quorum_epoch(records, quorum)
    if epoch is None:
        return None
    at_epoch = [r for r in voters(records) if r.epoch == epoch]
    counts = collections.Counter(r.state_hash for r in at_epoch)
    state_hash = min(counts, key=lambda h: (-counts[h], h))
    return Target(epoch, state_hash, [r.peer_id for r in at_epoch if r.state_hash == state_hash])

"""How a group splits the vector among its reducers: who reduces which span of the butterfly all-reduce.

hivemind's butterfly all-reduce gives each member a span of the flat vector to reduce: every other member sends
it that span, it averages what arrives and sends the average back. A member's round ends only when every span it
sent has come back, so the slowest reducer sets everyone's pace, and a reducer also answers for what its span
holds (robust_aggregation.py checks what it sends back, but a large span in one hand is a large target).

hivemind splits in proportion to the bandwidth each member declares. Here, before that split:

- declared bandwidths are capped at the group's median (``capped_bandwidths``), so nobody grabs the vector;
- members behind a relay, and clients, reduce nothing when a direct member can: relayed bytes are slow and scarce;
- each member's share is scaled by its pace against the group's median member (``paced_bandwidths``).

Every member computes this from the same gathered numbers, so the group agrees on the split without a message.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.averaging.load_balancing import load_balance_peers

MAX_BANDWIDTH_RATIO = 1.0
"""A peer's declared bandwidth counts at most this many times the group's median when the vector is split:
declaring less lowers a slow peer's share; declaring more never raises it above the median peer's
(hivemind's split is a linear program that hands a peer 4x faster than the rest the whole vector)."""

MIN_PACED_GROUP = 3
"""Members whose pace must be known before it shapes the split: in a pair the median member is either one, and a
member that claimed fast steps would make the other reduce almost nothing (and itself almost everything)."""


@dataclass(frozen=True)
class Member:
    """What a group member gathered that bears on the split.

    :param bandwidth: its declared bandwidth (None: undeclared; 0: reduces nothing)
    :param client: it joined in client mode (sends and receives, reduces nothing)
    :param relayed: it is reachable only through a relay
    :param step_seconds: its seconds per inner step, lately (None: not measured, or not said)
    """

    bandwidth: float | None
    client: bool = False
    relayed: bool = False
    step_seconds: float | None = None


def split(total_size: int, members: Sequence[Member], min_vector_size: int) -> tuple[int, ...]:
    """The number of values each member reduces, in the group's order (hivemind's ``load_balance_peers``, over the
    bandwidths capped, then paced: capping the paced ones at their median undid the pace where half were slow)."""
    reducing = [not m.client for m in members]
    if any(r and not m.relayed for r, m in zip(reducing, members)):
        reducing = [r and not m.relayed for r, m in zip(reducing, members)]
    capped = capped_bandwidths([m.bandwidth if r else 0.0 for m, r in zip(members, reducing)])
    paced = paced_bandwidths(capped, [m.step_seconds for m in members])
    return load_balance_peers(total_size, paced, min_vector_size)


def capped_bandwidths(bandwidths: list[float | None]) -> list[float | None]:
    """Declared bandwidths with outliers capped, so that nobody reduces (and so controls) a huge span.

    hivemind splits the vector among the group in proportion to the bandwidth each member *declares*; a
    reducer answers for its span alone, so a peer declaring 1e12 MB/s would reduce nearly all of it.
    """
    declared = sorted(b for b in bandwidths if b is not None and b > 0)
    if not declared:
        return list(bandwidths)
    cap = MAX_BANDWIDTH_RATIO * declared[(len(declared) - 1) // 2]
    return [min(b, cap) if b is not None and b > 0 else b for b in bandwidths]


def paced_bandwidths(bandwidths: list[float | None], step_seconds: list[float | None]) -> list[float | None]:
    """The bandwidths the vector is split by (``capped_bandwidths`` first), each member's scaled down by how much
    slower than the group's median member it trains (its ``step_seconds``, gathered): a reducer answers its span at
    its own pace, so a slow one reducing an equal span holds every member's all-reduce. (A member much slower than
    the median reducing nothing at all gained nothing measurable: BENCHMARKS.md, "Unequal volunteers".) Faster than
    the median counts as the median (a member claiming speed gains no share); fewer than ``MIN_PACED_GROUP`` paces
    gathered, or all alike: unchanged. Undeclared bandwidths count as the declared ones' mean (hivemind's rule), or
    1."""
    known = [s for s in step_seconds if s is not None and s > 0]
    if len(known) < MIN_PACED_GROUP or len(set(known)) == 1:
        return list(bandwidths)
    median = statistics.median_low(known)
    declared = [b for b in bandwidths if b is not None and b > 0]
    default = sum(declared) / len(declared) if declared else 1.0
    paced = []
    for bandwidth, step in zip(bandwidths, step_seconds):
        if bandwidth == 0:  # reduces nothing (client mode, relayed)
            paced.append(bandwidth)
            continue
        speed = min(1.0, median / step) if step is not None and step > 0 else 1.0
        paced.append((bandwidth if bandwidth is not None else default) * speed)
    return paced

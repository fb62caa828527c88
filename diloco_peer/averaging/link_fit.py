"""Sparse pseudo-gradients that fit the link: each peer lowers the density it sends until its exchange fits a share of
the round, and a group sends at the lowest density any of its members asked for (DiLoCoX, arXiv 2506.21263, adapts
its compression to the link the same way).

Only ``averaging.compression = "topk"`` with ``averaging.exchange_share`` above 0. The peer measures what it can
measure itself, every round it averages:

- the round's length: the time from one all-reduce's start to the next one's (training, the gate and the exchange);
- the exchange's: the all-reduce proper, from the group's start to the last reply (``RoundResult.transfer_seconds``).

Bytes on the wire are about proportional to the density, so the next density is the last one times the exchange's
budget (``exchange_share`` of the round) over what it took: never above ``topk_density``, never below a
sixteenth of it, and at most twice the last one (a round whose exchange was fast says little about a denser one).
Each peer gathers its pick with its group; every member computes the group's density from the same gathered picks
(``agreed``), so senders and reducers encode alike. A member whose pick is higher than the group's sends what its
error feedback computed at its own pick; the places the group's encoding drops come back into its residual with
the rest of what the average dropped (``ErrorFeedback.settle``).
"""

from __future__ import annotations

from collections.abc import Iterable

LEAST = 1 / 16
"""The lowest density a peer picks, as a share of ``topk_density``: below it a round sends too little to matter."""
GROWTH = 2.0
"""The most a pick grows from one round to the next."""


class LinkFit:
    """The density this peer asks for, fitted round by round to its link.

    :param most: ``averaging.topk_density``: the density on a link fast enough
    :param share: ``averaging.exchange_share``: the share of a round the exchange may take (0: the density stays
      ``most``)
    """

    def __init__(self, most: float, share: float):
        self.most = most
        self.share = share
        self.density = most
        self._last_start: float | None = None

    def observe(self, started: float, density: float, transfer_seconds: float) -> str:
        """An all-reduce that began at ``started`` (``time.monotonic``) at ``density`` took ``transfer_seconds``:
        the next pick. Returns what changed, in words, or ""."""
        period = None if self._last_start is None else started - self._last_start
        self._last_start = started
        if not self.share or period is None or period <= 0 or transfer_seconds <= 0:
            return ""
        budget = self.share * period
        fitted = density * budget / transfer_seconds
        pick = min(self.most, max(self.most * LEAST, min(fitted, density * GROWTH)))
        before, self.density = self.density, pick
        if abs(pick - before) < 0.05 * before:
            return ""
        return (f"topk density {before:.3%} -> {pick:.3%}: the last exchange took {transfer_seconds:.1f}s of a "
                f"{budget:.1f}s budget ({self.share:.0%} of a {period:.1f}s round)")


def agreed(picks: Iterable[object], most: float) -> float:
    """The density a group sends at: the lowest of its members' picks that is a density at all (a member that says
    none, or nonsense, counts as ``most``), never below ``most * LEAST``."""
    valid = [float(p) for p in picks if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1]
    return max(most * LEAST, min([most, *valid]))

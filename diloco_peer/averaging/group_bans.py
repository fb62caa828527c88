"""Bans a group agrees on: a peer that a member bans is left out of the group before it forms.

Each peer bans on its own evidence (``robust_aggregation.BanList``: its averager refused that peer's
contributions repeatedly), so honest peers ban an attacker in different rounds: the reducers of its parts
see its offenses first. Refusing a group only once it has formed cost everyone a round: the member that
refused stepped alone, and the others waited out a sender timeout for its parts (measured in the attack that found
it: BENCHMARKS.md, "Robust aggregation: what it costs and what it stops", "Bans the group agrees on").

So every member's join request carries the peers it bans (``bans`` in its gather data, see
``averaging/averager.py``), and the group's leader, before it forms the group, leaves out members until no
member it keeps bans another (``left_out``). A follower left out hears GROUP_DISBANDED from hivemind's
matchmaking and looks for another group; the others average as if it had never come.

Who goes, when members ban each other: the member the most others ban, first; a member left out no longer
counts as a voter. Ties go to the member that bans the most others, then to the largest peer id (every
leader decides alike). An attacker that bans everybody thus goes before the honest peer that bans it, and
one that several honest peers ban goes at once. What it cannot prevent: a member that bans an honest peer
nobody else bans gets that peer left out of the group (that peer loses the round, not the swarm), and a
leader that ignores the rule forms any group it likes; a member then still refuses to average with a peer
it bans (``PseudoGradientAverager._refuse_group``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def left_out(bans: dict[Hashable, Iterable[Hashable]], leader: Hashable) -> list[Hashable]:
    """The members to leave out of a group so that no member kept bans another, in the order they go.

    :param bans: every member of the group (the leader included) -> the peers it bans
    :param leader: the member forming the group: never left out (a follower that bans it goes instead; it
      would refuse the group anyway)
    """
    bans = {member: set(banned) for member, banned in bans.items()}
    kept = set(bans)
    out = [member for member in sorted(kept - {leader}, key=str) if leader in bans[member]]
    kept -= set(out)
    while True:
        votes = {m: sum(m in bans[other] for other in kept if other != m) for m in kept if m != leader}
        if not votes or max(votes.values()) == 0:
            return out
        worst = max(votes, key=lambda m: (votes[m], len(bans[m] & kept), str(m)))
        kept.remove(worst)
        out.append(worst)

"""How a group splits the vector among its reducers (``averaging/vector_split.py``): nobody grabs a huge span by
what it declares, a slow member reduces less, members behind a relay and clients reduce nothing."""

from hivemind.averaging.load_balancing import load_balance_peers

from diloco_peer.averaging.vector_split import (
    Member,
    capped_bandwidths,
    paced_bandwidths,
    split,
)


def test_a_peer_declaring_a_huge_bandwidth_does_not_get_to_reduce_the_whole_vector():
    assert capped_bandwidths([None, None, None]) == [None, None, None]  # nobody declared: equal shares
    assert capped_bandwidths([10.0, 12.0, 1e12]) == [10.0, 12.0, 12.0]  # at most the median
    assert capped_bandwidths([10.0, 0.0, 1e12, None]) == [10.0, 0.0, 10.0, None]  # client-mode zeros stay
    fractions = load_balance_peers(10_000, capped_bandwidths([10.0, 10.0, 1e12]), 0)
    assert max(fractions) < 0.34 * 10_000, fractions  # an equal share
    assert max(load_balance_peers(10_000, [10.0, 10.0, 1e12], 0)) == 10_000  # uncapped: the liar reduces all
    assert max(load_balance_peers(10_000, [10.0, 10.0, 40.0], 0)) == 10_000  # even at only 4x




def test_a_slower_member_reduces_a_smaller_span():
    """A member held to a sixth of a core reducing a quarter of the vector held every round's all-reduce: the split
    is scaled by each member's speed against the group's median member (gathered step_seconds)."""
    assert paced_bandwidths([None, None, None, None], [0.1, 0.1, 0.1, 0.4]) == [1.0, 1.0, 1.0, 0.25]
    assert paced_bandwidths([None, None, 0.0], [0.1, 0.1, 0.4]) == [1.0, 1.0, 0.0]  # a client reduces nothing still
    assert paced_bandwidths([10.0, 20.0, None], [0.1, 0.2, 0.1]) == [10.0, 10.0, 15.0]
    assert paced_bandwidths([None, None], [0.1, 0.1]) == [None, None]  # all alike: unchanged
    assert paced_bandwidths([None, None, None], [0.1, None, 0.1]) == [None, None, None]
    # a member claiming to be very fast counts as the median: no bigger share
    assert paced_bandwidths([None, None, None], [1e-9, 0.1, 0.1]) == [1.0, 1.0, 1.0]
    # a pair: either member is the median, and one that claimed fast steps would reduce nearly all: unchanged
    assert paced_bandwidths([None, None], [1e-9, 0.1]) == [None, None]
    # as the averager splits (declared bandwidths capped, then paced): half of the group slow still reduces less
    # (capped after pacing, the cap, the lower median, was the slow members' and made every share equal again)
    assert paced_bandwidths(capped_bandwidths([10.0, 10.0, 10.0, 10.0]), [0.1, 0.1, 0.5, 0.5]) == [10.0, 10.0, 2.0, 2.0]
    assert paced_bandwidths(capped_bandwidths([1e12, 10.0, 10.0]), [0.1, 0.1, 0.5]) == [10.0, 10.0, 2.0]


def test_the_split_of_a_group_with_a_slow_member_relayed_members_and_a_client():
    # four direct members at one pace: equal spans
    assert split(1000, [Member(None, step_seconds=0.1) for _ in range(4)], 0) == (250, 250, 250, 250)
    # at 0.8 and 0.25 of the median's pace: shorter spans (hivemind's split minimizes the slowest member's time, so
    # shorter than 0.8 of the others'), and a member that slow may get none
    fast = [Member(None, step_seconds=0.1) for _ in range(3)]
    fractions = split(1000, [*fast, Member(None, step_seconds=0.125)], 0)
    assert 0 < fractions[3] < 0.8 * fractions[0] and sum(fractions) == 1000
    fractions = split(1000, [*fast, Member(None, step_seconds=0.4)], 0)
    assert fractions[3] < 0.25 * fractions[0] and sum(fractions) == 1000
    # members behind a relay reduce nothing while a direct one can; a client never
    mixed = [Member(None), Member(None, relayed=True), Member(0.0, client=True), Member(None)]
    assert split(1000, mixed, 0) == (500, 0, 0, 500)
    assert split(1000, [Member(None, relayed=True), Member(None, relayed=True)], 0) == (500, 500)  # nobody direct
    # the fast members are all clients: the slow one reduces all
    clients = [Member(0.0, client=True, step_seconds=0.1), Member(0.0, client=True, step_seconds=0.1),
               Member(None, step_seconds=0.4)]
    assert split(1000, clients, 0) == (0, 0, 1000)

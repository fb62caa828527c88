"""Who a group's leader leaves out before the group forms, when its members ban each other (group_bans.py)."""

import itertools

import pytest

from diloco_peer.averaging.group_bans import left_out


def test_nobody_banned_nobody_left_out():
    assert left_out({"L": set(), "a": set(), "b": set()}, leader="L") == []


def test_a_peer_one_member_bans_is_left_out_and_the_others_average():
    """Honest peers ban an attacker in different rounds: the first one that does must not cost a round."""
    assert left_out({"L": set(), "h1": {"x"}, "h2": set(), "x": set()}, leader="L") == ["x"]
    assert left_out({"L": {"x"}, "h1": set(), "x": set()}, leader="L") == ["x"]  # the leader's own ban too


def test_an_attacker_that_bans_everybody_goes_before_the_honest_peer_that_bans_it():
    bans = {"L": set(), "h1": {"x"}, "h2": set(), "x": {"L", "h1", "h2"}}
    assert left_out(bans, leader="L") == ["x"]  # it bans the leader: out first, its bans no longer count
    bans = {"L": set(), "h1": {"x"}, "h2": set(), "x": {"h1", "h2"}}
    assert left_out(bans, leader="L") == ["x"]  # a tie on votes (1 each): it bans more


def test_a_peer_several_members_ban_goes_first_and_its_bans_stop_counting():
    bans = {"L": {"x"}, "h1": {"x"}, "h2": {"x"}, "x": {"h1"}}
    assert left_out(bans, leader="L") == ["x"]


def test_what_it_cannot_prevent_a_lone_ban_of_an_honest_peer_leaves_it_out():
    assert left_out({"L": set(), "h1": set(), "x": {"h1"}}, leader="L") == ["h1"]


@pytest.mark.parametrize("seed", range(20))
def test_no_member_kept_bans_another_and_every_leader_decides_alike(seed):
    import random

    rng = random.Random(seed)
    members = [f"p{i}" for i in range(6)]
    bans = {m: {o for o in members if o != m and rng.random() < 0.25} for m in members}
    out = left_out(bans, leader="p0")
    kept = set(members) - set(out)
    assert "p0" in kept and not any(bans[a] & kept for a in kept)
    # the same inputs in another order (another process, another dict order): the same decision
    for order in itertools.islice(itertools.permutations(members), 5):
        assert left_out({m: bans[m] for m in order}, leader="p0") == out

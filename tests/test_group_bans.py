"""Who a group's leader leaves out before the group forms, when its members ban each other (group_bans.py)."""

import asyncio
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


def test_a_member_that_refuses_its_group_withdraws_and_nobody_waits_for_it(dhts, monkeypatch, capfd):
    """The path the leave-out rule cannot cover: a leader lets in a peer that a member refuses (here an allowlist
    only that member holds; a ban the leader does not know of, or a leader that ignores the rule, end the same
    way). The member withdraws at once: it tells every member it sends nothing, their reducers drop it instead of
    waiting a sender timeout, and its refusal leaves no unretrieved future behind. Leaders are pinned (each
    averager accepts only ``a`` as its leader, patched before the averager processes fork) so that the group
    forms as {a, b, c} every time."""
    import torch

    from diloco_peer.averaging.averager import RoundAverager
    from diloco_peer.averaging.pseudo_gradient_averager import PseudoGradientAverager
    from diloco_peer.config import AveragingConfig
    from diloco_peer.swarm.admission import Admission

    nodes = dhts(3)
    a, b, c = (dht.peer_id.to_base58() for dht in nodes)
    monkeypatch.setattr(PseudoGradientAverager, "_refuses_leader", lambda self, leader: leader.to_base58() != a)
    cfg = AveragingConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=20.0, aggregation="mean")
    shapes = [torch.Size([64, 64])] * 12
    averagers = [RoundAverager(nodes[0], shapes, "refusal-run", cfg),
                 RoundAverager(nodes[1], shapes, "refusal-run", cfg),
                 RoundAverager(nodes[2], shapes, "refusal-run", cfg, admission=Admission(allowlist=frozenset({a, c})))]
    inputs = [[torch.full(s, value) for s in shapes] for value in (1.0, 1.5, 2.0)]

    async def one_round():
        return await asyncio.wait_for(asyncio.gather(*(x.average(v, weight=100, epoch=0)
                                                       for x, v in zip(averagers, inputs))), 60)

    try:
        results = asyncio.run(one_round())
    finally:
        for x in averagers:
            x.shutdown()
    on_a, on_b, on_c = results
    assert not on_c.ok and "refused to average with this group" in on_c.error and b in on_c.error, on_c
    assert [(o["offender"], o["kind"]) for o in on_c.offenses] == [(b, "unadmitted")], on_c.offenses
    total = sum(s.numel() for s in shapes)
    for result in (on_a, on_b):  # c's span kept each one's own values, the rest is a's and b's mean (1.25)
        assert result.ok and result.group_size == 3 and 0 < result.values_not_averaged < total, result
        averaged = torch.cat([t.flatten() for t in result.averaged])
        assert int((averaged == 1.25).sum()) == total - result.values_not_averaged, result
    # c's withdrawal reached the reducers at once: far below the sender timeout (allreduce_timeout / 2 = 10 s)
    assert max(on_a.seconds, on_b.seconds) < cfg.allreduce_timeout / 4, (on_a.seconds, on_b.seconds)
    assert "never retrieved" not in capfd.readouterr().err

"""Handing in (``averaging/hand_in.py``): a peer too slow for the all-reduce gives its pseudo-gradient to a fast peer,
which averages it in with its own, and takes the round's average back. The arithmetic and the checks in-process; the
round on real averagers (DHT + averager processes on loopback, no mocks)."""

import asyncio
import types

import pytest
import torch
from hivemind.compression import NoCompression
from hivemind.utils import MSGPackSerializer

from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.averaging.hand_in import KEEP_RESULTS, MAX_PER_ROUND, HandedIn, HandIns, receive
from diloco_peer.averaging.robust_aggregation import Limits
from diloco_peer.averaging.state_transfer import tensor_messages
from diloco_peer.config import AveragingConfig
from diloco_peer.config.faults import Faults
from diloco_peer.rounds.pace import Pace
from diloco_peer.swarm.progress_record import ProgressRecord

SHAPES = [torch.Size([257, 31]), torch.Size([1000]), torch.Size([3, 5, 7])]
CFG = AveragingConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=20.0, aggregation="mean")


def _pseudo_gradient(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    # what DiLoCo peers send: a shared direction (same start, similar data) plus their own noise
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    return [scale * (torch.randn(s, generator=shared) + 0.5 * torch.randn(s, generator=own)) for s in SHAPES]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def test_a_fold_is_the_token_weighted_mean_of_ours_and_the_hand_ins_that_pass_the_checks():
    hand_ins = HandIns(Limits(max_update_ratio=10.0, ban_cosine=-0.5))
    own, slow, flipped = _pseudo_gradient(1), _pseudo_gradient(2), [-t for t in _pseudo_gradient(3)]
    hand_ins.round_begins(5)
    assert hand_ins.refusal("slow", 5, 100.0) == ""
    hand_ins.take(HandedIn("slow", slow, 100.0), 5)
    hand_ins.take(HandedIn("flipper", flipped, 100.0), 5)
    assert "full" in hand_ins.refusal("third", 5, 100.0) and MAX_PER_ROUND == 2
    assert "already" in hand_ins.refusal("slow", 5, 100.0)
    assert "weight" in hand_ins.refusal("fourth", 6, float("nan"))
    assert "not ours" in hand_ins.refusal("fourth", 7, 100.0)  # rounds ahead: not held
    refused = []
    sent, weight, folded = hand_ins.fold(own, 1000.0, lambda peer, problem: refused.append((peer, problem.kind)))
    assert (weight, folded) == (1100.0, 1) and refused == [("flipper", "direction")]
    expected = (_flat(own).double() * 1000 + _flat(slow).double() * 100) / 1100
    assert torch.allclose(_flat(sent).double(), expected, atol=1e-6)
    assert _flat(sent).dtype == torch.float32
    # a retry of the all-reduce sends the same; a hand-in now comes too late for this round
    again, _, _ = hand_ins.fold(own, 1000.0, lambda *_: None)
    assert torch.equal(_flat(again), _flat(sent))
    assert "late" in hand_ins.refusal("other", 5, 100.0)
    assert hand_ins.refusal("other", 6, 100.0) == ""  # the next round's is taken


def test_a_hand_in_for_a_round_its_proxy_skipped_is_answered_at_once_with_nothing():
    hand_ins = HandIns(Limits())
    hand_ins.round_begins(3)
    hand_ins.take(HandedIn("slow", _pseudo_gradient(2), 100.0), 4)
    hand_ins.round_begins(6)  # the proxy synced past round 4: it never averages it

    async def ask():
        return await asyncio.wait_for(hand_ins.result(4, "slow", timeout=60), 1)

    assert asyncio.run(ask()) == (None, 0)


def test_a_round_its_proxy_runs_no_all_reduce_for_is_answered_at_once_and_takes_no_more_hand_ins():
    hand_ins = HandIns(Limits())
    hand_ins.round_begins(3)
    hand_ins.take(HandedIn("slow", _pseudo_gradient(2), 100.0), 3)
    hand_ins.no_all_reduce(3)  # the proxy's gate found no other member

    async def ask():
        return await asyncio.wait_for(hand_ins.result(3, "slow", timeout=60), 1)

    assert asyncio.run(ask()) == (None, 0)
    assert "late" in hand_ins.refusal("other", 3, 100.0)
    assert hand_ins.refusal("other", 4, 100.0) == ""  # the next round's are taken


def test_a_proxy_owes_each_peer_that_handed_in_its_answer_until_taken_and_no_older_than_it_keeps():
    hand_ins = HandIns(Limits())
    assert hand_ins.owes() == 0
    hand_ins.round_begins(3)
    for peer in ("slow", "slower"):
        hand_ins.take(HandedIn(peer, _pseudo_gradient(2), 100.0), 3)
    hand_ins.ended(_pseudo_gradient(1), group_size=2)
    assert hand_ins.owes() == 2  # a leaving proxy waits for these (``finish_hand_backs``)
    hand_ins.answered(3, "slow")
    hand_ins.answered(3, "stranger")  # (nothing owed to it)
    assert hand_ins.owes() == 1
    for epoch in range(4, 4 + KEEP_RESULTS):  # rounds go by: an answer no longer kept is no longer owed
        hand_ins.round_begins(epoch)
        hand_ins.take(HandedIn("other", _pseudo_gradient(2), 100.0), epoch)
        hand_ins.ended(None, group_size=0)
    assert hand_ins.owes() == KEEP_RESULTS


def test_a_stream_carries_our_tensors_and_one_of_more_bytes_than_they_take_is_refused():
    averager = types.SimpleNamespace(serializer=MSGPackSerializer, state_compression=NoCompression())

    async def read(tensors, shapes):
        async def stream():
            for message in tensor_messages(averager, tensors, {"epoch": 3}):
                yield message
        return await receive(averager, stream(), shapes, timeout=5)

    sent = _pseudo_gradient(1)
    metadata, got = asyncio.run(read(sent, SHAPES))
    assert metadata == {"epoch": 3} and all(torch.equal(a, b) for a, b in zip(got, sent))
    with pytest.raises(ValueError, match="more bytes"):  # (a stranger's stream is held in memory as it comes)
        asyncio.run(read([torch.zeros(400_000)], [torch.Size([10])]))
    with pytest.raises(ValueError, match="not shaped like"):
        asyncio.run(read([torch.zeros(10, dtype=torch.float64)], [torch.Size([10])]))


@pytest.mark.parametrize("bad, kind", [("nan", "non_finite"), ("huge", "norm"), ("weight", "weight"),
                                       ("shape", "shape")])
def test_a_bad_hand_in_is_refused_as_an_offense_and_ours_is_sent_alone(bad, kind):
    hand_ins = HandIns(Limits(max_update_ratio=10.0, max_weight_ratio=10.0, ban_cosine=-0.5))
    own = _pseudo_gradient(1)
    tensors = _pseudo_gradient(2, scale=100.0 if bad == "huge" else 1.0)
    if bad == "nan":
        tensors[1][7] = float("nan")
    if bad == "shape":
        tensors = tensors[:2]
    hand_ins.round_begins(0)
    hand_ins.take(HandedIn("bad", tensors, 1e6 if bad == "weight" else 100.0), 0)
    refused = []
    sent, weight, folded = hand_ins.fold(own, 1000.0, lambda peer, problem: refused.append((peer, problem.kind)))
    assert refused == [("bad", kind)] and (weight, folded) == (1000.0, 0) and sent is own


def test_a_peer_hands_in_only_when_much_slower_than_the_others_and_two_of_them_average_it():
    pace = Pace(inner_steps=20, timed=True)
    pace.step_seconds = 0.6

    def record(peer, step_seconds, epoch=3, hands_to=""):
        return ProgressRecord(peer_id=peer, epoch=epoch, inner_step=0, tokens=0, ready=False, time=0.0,
                              step_seconds=step_seconds, hands_to=hands_to)

    fast = [record("b", 0.1), record("a", 0.1), record("c", 0.12)]
    assert pace.proxies(fast + [record("me", 0.6)], "me", 3, 4.0) == ["a", "b", "c"]  # fastest first, then by id
    assert pace.proxies(fast, "me", 3, 0.0) == []  # averaging.hand_in_slower_than=0: never
    assert pace.proxies(fast, "me", 3, 8.0) == []  # 6x slower only
    assert pace.proxies(fast[:1], "me", 3, 4.0) == []  # one fast peer alone would average it with nobody
    assert pace.proxies([record("a", 0.1), record("b", 0.1, epoch=2)], "me", 3, 4.0) == ["a", "b"]  # (last gate's)
    assert pace.proxies([record("a", 0.1), record("b", 0.1, epoch=1)], "me", 3, 4.0) == []  # rounds behind
    assert pace.proxies([record("a", 0.1), record("b", 0.1, hands_to="x")], "me", 3, 4.0) == []  # slow too
    assert Pace(inner_steps=20, timed=False).proxies(fast, "me", 3, 4.0) == []  # fixed H: everyone averages
    # a peer that would hand in itself is no member: a proxy must keep one member besides itself
    assert pace.proxies([record("a", 0.1), record("b", 0.5), record("c", 0.12)], "me", 3, 4.0) == ["a", "c"]
    two_slow = Pace(inner_steps=20, timed=True)
    two_slow.step_seconds = 0.13  # 1.3x "a": over a threshold of 1.2, as "b" is
    assert two_slow.proxies([record("a", 0.1), record("b", 0.6)], "me", 3, 1.2) == []  # "a" alone would be left


@pytest.mark.slow
@pytest.mark.light  # three averagers in this process
@pytest.mark.parametrize("aggregation", ["mean", "robust"])
def test_a_hand_in_is_in_the_groups_average_and_its_peer_gets_the_same_bytes(dhts, aggregation):
    """Two members average, the third hands in to the first: everyone ends with the same bytes, the token-weighted
    mean of all three (robust aggregation clips the proxy's weight to the group's median)."""
    cfg = CFG.model_copy(update={"aggregation": aggregation})
    nodes = dhts(3)
    averagers = [RoundAverager(dht, SHAPES, "hand-in", cfg) for dht in nodes]
    proxy, member, slow = averagers
    inputs = [_pseudo_gradient(seed) for seed in (1, 2, 3)]

    async def one_round():
        why = await slow.hand_in(inputs[2], 100, epoch=0, proxy=proxy.peer_id)
        assert why == "", why
        late = await slow.hand_in(inputs[2], 100, epoch=0, proxy=proxy.peer_id)
        assert "already" in late, late
        rounds = [a.average(x, weight=1000, epoch=0, expected=2) for a, x in zip((proxy, member), inputs)]
        ended = await asyncio.wait_for(asyncio.gather(*rounds), 60)
        # the proxy, leaving now, owes the slow peer its average: it waits for it to be taken, and no longer
        assert await proxy.finish_hand_backs(0.3) >= 0.3
        leaving = asyncio.create_task(proxy.finish_hand_backs(60))
        back = await asyncio.wait_for(slow.handed_back(proxy.peer_id, 0), 60)
        assert await asyncio.wait_for(leaving, 10) < 30
        return [*ended, back]

    try:
        results = asyncio.run(one_round())
        after = asyncio.run(slow.hand_in(inputs[2], 100, epoch=0, proxy=proxy.peer_id))
    finally:
        for a in averagers:
            a.shutdown()
    summary = [(r.ok, r.group_size, r.error, r.bytes_sent, r.bytes_received) for r in results]
    assert all(r.ok and r.group_size == 2 for r in results), summary
    got = [_flat(r.averaged) for r in results]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]), summary  # the same bytes, all three
    if aggregation == "mean":
        mean = (_flat(inputs[0]).double() * 1000 + _flat(inputs[1]).double() * 1000
                + _flat(inputs[2]).double() * 100) / 2100
        assert torch.allclose(got[0].double(), mean, atol=1e-5), summary
    size = sum(s.numel() for s in SHAPES) * 4
    assert results[2].bytes_sent >= size and results[2].bytes_received >= size, summary
    assert "late" in after, after  # its all-reduce of round 0 has begun


@pytest.mark.slow
@pytest.mark.light
def test_a_hand_in_whose_proxy_averages_with_nobody_fails_and_says_so(dhts):
    """The proxy's round found no group: the peer that handed in hears "no clean average" (and heals, as after a
    failed round) once the proxy's step ended, not after a timeout of its own."""
    cfg = CFG.model_copy(update={"matchmaking_time": 1.0})
    nodes = dhts(2)
    proxy, slow = (RoundAverager(dht, SHAPES, "hand-in-alone", cfg) for dht in nodes)
    inputs = [_pseudo_gradient(seed) for seed in (1, 2)]

    async def one_round():
        assert await slow.hand_in(inputs[1], 100, epoch=0, proxy=proxy.peer_id) == ""
        return await asyncio.gather(proxy.average(inputs[0], weight=1000, epoch=0, expected=2),
                                    slow.handed_back(proxy.peer_id, 0))

    try:
        own, handed = asyncio.run(one_round())
    finally:
        proxy.shutdown()
        slow.shutdown()
    assert not own.ok and not handed.ok and "no clean average" in handed.error, (own, handed)
    assert handed.seconds < own.seconds + 5, (own.seconds, handed.seconds)


@pytest.mark.slow
@pytest.mark.light
def test_a_proxy_that_runs_no_all_reduce_tells_the_peer_that_handed_in_at_once(dhts):
    """The proxy's gate found no other member (the peers that handed in to it were all the others): it runs no
    all-reduce, and says so, where the peer that handed in waited out its fetch (126 s in a swarm of three) while the
    proxy waited for that peer's round to end."""
    nodes = dhts(2)
    proxy, slow = (RoundAverager(dht, SHAPES, "hand-in-none", CFG) for dht in nodes)

    async def one_round():
        assert await slow.hand_in(_pseudo_gradient(2), 100, epoch=0, proxy=proxy.peer_id) == ""
        fetched = asyncio.create_task(slow.handed_back(proxy.peer_id, 0))
        await proxy.no_all_reduce(0)
        return await asyncio.wait_for(fetched, 30)

    try:
        handed = asyncio.run(one_round())
    finally:
        proxy.shutdown()
        slow.shutdown()
    assert not handed.ok and "no clean average" in handed.error, handed


@pytest.mark.slow
@pytest.mark.light
def test_a_sign_flipping_hand_in_is_left_out_counted_and_its_proxy_averages_its_own(dhts):
    cfg = CFG.model_copy(update={"aggregation": "robust"})
    nodes = dhts(3)
    proxy, member = (RoundAverager(dht, SHAPES, "hand-in-bad", cfg) for dht in nodes[:2])
    slow = RoundAverager(nodes[2], SHAPES, "hand-in-bad", cfg, faults=Faults.parse("poison:signflip"))
    inputs = [_pseudo_gradient(seed) for seed in (1, 2, 3)]

    async def one_round():
        assert await slow.hand_in(inputs[2], 100, epoch=0, proxy=proxy.peer_id) == ""
        rounds = [a.average(x, weight=1000, epoch=0, expected=2) for a, x in zip((proxy, member), inputs)]
        return await asyncio.wait_for(asyncio.gather(*rounds), 60)

    try:
        results = asyncio.run(one_round())
    finally:
        for a in (proxy, member, slow):
            a.shutdown()
    assert all(r.ok for r in results), results
    assert [(o["offender"], o["kind"]) for o in results[0].offenses] == [(slow.peer_id, "direction")]
    honest = [(a + b) / 2 for a, b in zip(inputs[0], inputs[1])]
    cosine = torch.nn.functional.cosine_similarity(_flat(results[0].averaged), _flat(honest), dim=0)
    assert cosine > 0.99, float(cosine)

"""The outer round's logic, in-process and in milliseconds: blocking and overlapped schedules, failed, refused and
partial rounds, healing by state sync, and the verdict that decides a round's outcome.

The peers are real ``OuterRounds`` with a real outer optimizer and the real round gate, on a fake DHT, all-reduce,
state sync and trainer (``fake_swarm.py``). Each test checks what the round's contract says: peers that averaged
hold bit-identical outer weights, and those weights are exactly the outer steps of the group's means, one per round.
The real-swarm tests run the same logic end to end: ``test_simulate.py`` (a refused round healed, blocking and
eager, against the simulator's weights), ``test_churn.py``, ``test_unequal.py``.
"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from fake_swarm import Board, BoardProgress, FakeSwarm, PullTrainer, ThreadCompute

from diloco_peer.averaging.averager import RoundResult
from diloco_peer.config import AveragingConfig, OuterConfig
from diloco_peer.config.faults import Faults
from diloco_peer.rounds.exchange import RoundExchange
from diloco_peer.rounds.outcome import Exchange, decide
from diloco_peer.rounds.pace import MAX_CUT, MAX_SPREAD, Pace
from diloco_peer.rounds.schedule import Blocking, Overlapped
from diloco_peer.swarm.progress import ALL_READY, ReadyDecision
from diloco_peer.swarm.progress_record import ProgressRecord
from diloco_peer.training.outer_optimizer import OuterOptimizer, contribution_scale

SCHEDULES = {"blocking": OuterConfig(inner_steps=5, round_length="steps"),
             "eager": OuterConfig(inner_steps=10, overlap="eager", round_length="steps"),
             "delayed": OuterConfig(inner_steps=10, overlap="delayed", round_length="steps")}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def replayed(means: dict[int, list[torch.Tensor]], rounds: int, cfg: OuterConfig) -> list[torch.Tensor]:
    """The outer weights after one outer step with each round's group mean, from the peers' starting weights."""
    outer = OuterOptimizer(PullTrainer(0.0).model, cfg)
    for epoch in range(rounds):
        outer.step(means[epoch])
    return outer.params


def outcomes(peer) -> list[str]:
    return [r.outcome for r in peer.records]


@pytest.mark.parametrize("mode", SCHEDULES)
def test_every_round_applies_exactly_the_groups_mean_and_replicas_stay_identical(tmp_path, mode):
    cfg = SCHEDULES[mode]
    swarm = FakeSwarm(tmp_path, cfg)
    a, b = swarm.add("a", target=1.0), swarm.add("b", target=3.0)
    swarm.run(4)
    assert outcomes(a) == outcomes(b) == ["averaged"] * 4
    assert [r.round for r in a.records] == [1, 2, 3, 4]
    assert same(a.outer.params, b.outer.params) and same(a.outer.momentum_views, b.outer.momentum_views)
    assert same(a.outer.params, replayed(swarm.hub.means, 4, cfg))
    # round 1's pseudo-gradients: H pulls from 0 towards 1 and 3, equal tokens: their mean, -2 (1 - 0.9^H)
    expected = -2 * (1 - 0.9 ** cfg.inner_steps)
    assert all(torch.allclose(m, torch.full_like(m, expected)) for m in swarm.hub.means[0])
    assert a.records[-1].param_sha256 == b.records[-1].param_sha256
    assert all(r.inner_steps == cfg.inner_steps and r.tokens == cfg.inner_steps * 100 for r in a.records)


def test_overlapped_corrections_differ_only_in_what_the_replica_trains_from(tmp_path):
    """eager and delayed average the same way; the replica starts each round from different points, so their
    outer weights part from round 2 on (round 1's pseudo-gradients are the same)."""
    results = {}
    for mode in ("eager", "delayed"):
        swarm = FakeSwarm(tmp_path / mode, SCHEDULES[mode])
        swarm.add("a", target=1.0), swarm.add("b", target=3.0)
        swarm.run(3)
        results[mode] = swarm.hub.means
    assert same(results["eager"][0], results["delayed"][0])
    assert not same(results["eager"][1], results["delayed"][1])


@pytest.mark.parametrize("on_arrival", [True, False], ids=["applied-on-arrival", "at-the-round's-end"])
def test_an_early_average_moves_the_replica_not_the_outer_weights(tmp_path, on_arrival):
    cfg = OuterConfig(inner_steps=20, overlap="eager", apply_on_arrival=on_arrival, round_length="steps")
    swarm = FakeSwarm(tmp_path, cfg)
    a, b = swarm.add("a", target=1.0, step_seconds=0.001), swarm.add("b", target=3.0, step_seconds=0.001)
    swarm.run(4)
    arrived = [r.arrived_step for r in a.records + b.records]
    assert any(step is not None and step < cfg.inner_steps for step in arrived) if on_arrival else \
        all(step is None for step in arrived), arrived
    assert same(a.outer.params, b.outer.params)
    assert same(a.outer.params, replayed(swarm.hub.means, 4, cfg))


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_one_sided_failure_takes_the_others_state_within_its_round(tmp_path, mode):
    swarm = FakeSwarm(tmp_path, SCHEDULES[mode])
    a, b = swarm.add("a", target=1.0), swarm.add("b", target=3.0)
    swarm.hub.script[(1, "a")] = "fail"  # a's all-reduce of round 2 fails; b's succeeds
    swarm.run(4)
    assert outcomes(a) == ["averaged", "failed", "averaged", "averaged"]
    assert outcomes(b) == ["averaged"] * 4
    assert a.sync.syncs == 1 and a.rounds.averager.failed_rounds == 1
    for ra, rb in zip(a.records, b.records):
        assert ra.param_sha256 == rb.param_sha256, (ra.round, ra.outcome)


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_refused_average_is_never_applied_and_the_peer_takes_the_others_state(tmp_path, mode):
    swarm = FakeSwarm(tmp_path, SCHEDULES[mode])
    a = swarm.add("a", target=1.0, faults=Faults(refuse_rounds=(2,)))
    b = swarm.add("b", target=3.0)
    swarm.run(3)
    assert outcomes(a) == ["averaged", "failed", "averaged"] and outcomes(b) == ["averaged"] * 3
    assert a.records[1].error.startswith("refused the group's average")
    assert a.records[1].arrived_step is None  # (eager: the refused average never reached the replica either)
    assert a.sync.syncs == 1
    assert same(a.outer.params, b.outer.params)


def test_a_two_sided_failure_steps_alone_then_heals_at_the_next_gate(tmp_path):
    swarm = FakeSwarm(tmp_path, SCHEDULES["blocking"])
    a, b = swarm.add("a", target=1.0), swarm.add("b", target=3.0)
    swarm.hub.script.update({(1, "a"): "fail", (1, "b"): "fail"})
    swarm.run(4)
    assert outcomes(a)[:2] == outcomes(b)[:2] == ["averaged", "failed"]
    # the first to step alone publishes its state; the other, still waiting for the round's end, takes it; or both
    # step alone, and the next gate has the one with the larger hash take the other's
    assert a.sync.syncs + b.sync.syncs == 1
    assert outcomes(a)[-2:] == outcomes(b)[-2:] == ["averaged"] * 2
    assert same(a.outer.params, b.outer.params)


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_partial_round_heals_within_itself(tmp_path, mode):
    swarm = FakeSwarm(tmp_path, SCHEDULES[mode])
    a, b = swarm.add("a", target=1.0), swarm.add("b", target=3.0)
    swarm.hub.script.update({(1, "a"): "partial", (1, "b"): "partial"})  # a reducer died: each kept a span
    swarm.run(3)
    assert outcomes(a) == outcomes(b) == ["averaged", "partial", "averaged"]
    assert a.sync.syncs + b.sync.syncs == 1
    for ra, rb in zip(a.records, b.records):
        assert ra.param_sha256 == rb.param_sha256, ra.round


def test_a_peer_alone_steps_with_its_own_pseudo_gradient(tmp_path):
    cfg = SCHEDULES["blocking"]
    swarm = FakeSwarm(tmp_path, cfg, AveragingConfig(min_peers=1, max_update_ratio=0.0))
    a = swarm.add("a", target=1.0)
    swarm.run(2)
    assert outcomes(a) == ["solo", "solo"]
    alone = PullTrainer(1.0)  # DiLoCo with one replica: H inner steps, an outer step with its own pseudo-gradient
    reference = OuterOptimizer(alone.model, cfg)
    for _ in range(2):
        alone.train_steps(cfg.inner_steps)
        reference.step(reference.pseudo_gradient())
    assert same(a.outer.params, reference.params)


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_newcomer_syncs_to_the_swarm_then_averages(tmp_path, mode):
    swarm = FakeSwarm(tmp_path, SCHEDULES[mode])
    a, b = swarm.add("a", target=1.0), swarm.add("b", target=3.0)
    c = swarm.add("c", target=2.0, joins_at=2)
    swarm.run(6)
    assert c.sync.syncs >= 1  # (eager: a donor may have stepped on since it published, and the first try fails)
    assert outcomes(c)[-2:] == ["averaged"] * 2 and c.records[-1].group_size == 3, c.records
    assert same(a.outer.params, c.outer.params) and same(b.outer.params, c.outer.params)


def _exchange(ok=True, ready=2, averaged=(1.0,), lost=0, off_swarm="", error="", group=None,
              handing_in=0) -> Exchange:
    tensors = [torch.tensor(list(averaged))] if ok else None
    result = RoundResult(ok=ok, averaged=tensors, sent_norm=1.0, values_not_averaged=lost, error=error,
                         group_size=ready if group is None else group)
    decision = ReadyDecision(ready, ready, 0.0, ALL_READY, handing_in=handing_in)
    return Exchange(decision, result, off_swarm=off_swarm)


@pytest.mark.parametrize("exchange, outcome, with_average, seeks, rechecks, clean", [
    (_exchange(), "averaged", True, False, False, True),
    (_exchange(lost=5), "partial", True, False, True, False),
    (_exchange(averaged=(math.nan,)), "failed", False, True, False, False),
    (_exchange(averaged=(50.0,)), "failed", False, True, False, False),  # 50x our own norm
    (_exchange(ok=False, error="timeout"), "failed", False, True, False, False),
    (_exchange(ok=False, ready=1, error="alone"), "solo", False, True, False, False),
    (_exchange(off_swarm="our weights differ"), "averaged", True, True, False, False),
    (_exchange(ready=4, group=2), "averaged", True, False, True, True),
    # a peer that handed in to a member is not a member: no split (averaging/hand_in.py)
    (_exchange(ready=4, group=3, handing_in=1), "averaged", True, False, False, True),
    (_exchange(ready=4, group=2, handing_in=1), "averaged", True, False, True, True),
], ids=["averaged", "partial", "non-finite", "too-long", "failed", "solo", "off-swarm", "split", "handed-in",
        "split-handed-in"])
def test_the_verdict(exchange, outcome, with_average, seeks, rechecks, clean):
    verdict = decide(exchange, epoch=3, max_update_ratio=10.0)
    assert (verdict.outcome, verdict.steps_with_average, verdict.seeks_swarm_state, verdict.rechecks,
            verdict.clean) == (outcome, with_average, seeks, rechecks, clean)
    assert verdict.withdraws == (not with_average)
    assert bool(verdict.error) == (not with_average)


def test_the_verdict_of_a_round_the_fault_injection_refuses():
    verdict = decide(_exchange(), epoch=1, max_update_ratio=10.0, faults=Faults(refuse_rounds=(2,)))
    assert verdict.outcome == "failed" and "refuse_round" in verdict.error
    assert decide(_exchange(), epoch=2, max_update_ratio=10.0, faults=Faults(refuse_rounds=(2,))).clean


def test_the_schedules_carry_the_lag():
    assert Blocking.lag == 0 and Overlapped.lag == 1


def test_rounds_bounded_by_time_give_a_slow_peer_fewer_steps_and_nobody_waits(tmp_path):
    """b takes five times as long per inner step as a: after the first round (H steps each, nothing measured yet;
    each peer's "ready" then says its pace) b trains about H / 5 steps a round, a trains H, and a no longer waits
    for b at the gate."""
    cfg = OuterConfig(inner_steps=20, round_length="time")
    swarm = FakeSwarm(tmp_path, cfg)
    # steps of 20 ms and 100 ms: a loaded machine stretches a short sleep by more than its length (a fresh clone's
    # unit lane stretched a's 4 ms steps so much that b fitted 11 steps of 20 ms, and a's last round fitted 10 steps)
    a = swarm.add("a", target=1.0, step_seconds=0.02)
    b = swarm.add("b", target=3.0, step_seconds=0.1)
    swarm.run(5)
    assert outcomes(a) == outcomes(b) == ["averaged"] * 5
    assert a.records[0].inner_steps == b.records[0].inner_steps == 20
    later = [(ra.inner_steps, rb.inner_steps, ra.wait_seconds) for ra, rb in zip(a.records[1:], b.records[1:])]
    # b fits about a fifth of a's steps. A loaded machine stretches a's sleeps more than b's, which lengthens the
    # period b trains for (9 steps of 20 ms seen in CI): at most half of a's. And it can stall one of b's steps past
    # the round's budget (one step, and a wait, that round): one round of four may fall short, the others not
    b_steps = sorted(sb for _, sb, _ in later)
    assert all(sa >= 16 and 1 <= sb <= sa // 2 for sa, sb, _ in later) and b_steps[1] >= 2, later
    first_wait = a.records[0].wait_seconds  # b's 20 steps: ~1.6 s more than a's
    waits = sorted(wait for _, _, wait in later)
    assert first_wait > 0.2 and waits[-2] < first_wait / 2, (first_wait, later)
    for peer in (a, b):  # the LR schedule is at the round's end whatever the steps
        assert [r.inner_step for r in peer.records] == [20 * r.round for r in peer.records]
    assert same(a.outer.params, b.outer.params)


def test_a_peer_that_begins_its_round_late_trains_less_and_nobody_waits_for_it(tmp_path):
    """b's all-reduces end 0.1 s after a's (a loaded machine: 32 peers' rounds began up to 15 s apart), in rounds of
    ~0.3 s. From the second round (the first measured), b cuts its training by as much as it began after a, and both
    come to the gate together: a trains its H steps and does not wait for b."""
    cfg = OuterConfig(inner_steps=10, round_length="time")
    swarm = FakeSwarm(tmp_path, cfg)
    a = swarm.add("a", target=1.0, step_seconds=0.03)
    b = swarm.add("b", target=3.0, step_seconds=0.03)
    swarm.hub.script.update({(epoch, "b"): "late:0.1" for epoch in range(4)})
    swarm.run(5)
    assert outcomes(a) == outcomes(b) == ["averaged"] * 5
    late = b.records[1:5]  # the rounds trained after a late all-reduce
    assert all(r.late_seconds is not None and 0.07 < r.late_seconds < 0.2 for r in late), late
    # a is never late and trains its round: H steps, or one fewer where a loaded machine stretched its steps past
    # the budget its earlier rounds measured (a fresh clone's unit lane: 9); b, late, trains fewer than a each round
    trained = [(r.inner_steps, r.late_seconds) for r in a.records]
    assert all(steps >= 9 and cut is None for steps, cut in trained), trained
    assert all(r.inner_steps < ours.inner_steps for r, ours in zip(late, a.records[1:5])), (trained, late)
    waits = sorted(r.wait_seconds for r in a.records[1:5])
    assert waits[1] < 0.05, waits  # (b's 0.1 s: a waited for it, before)
    assert a.records[-1].late_seconds is None and same(a.outer.params, b.outer.params)


def test_a_round_bounded_by_time_ends_when_its_time_is_up_whatever_the_steps_planned(tmp_path):
    """From round 3 a's steps take 40 ms instead of 20, and b's 20 ms instead of 60 (a busy machine's load moved from
    one to the other; no shorter: a loaded lane stretched a's 10 ms sleeps until it fitted 8 of its 10 in round 2).
    Both plan round 3 from their paces so far (a: H steps, b: about a third of them), and both train until the
    round's time is up: a stops short of H instead of making b wait at the gate, b trains past its plan instead of
    stopping there and waiting for a. The steps past a plan train at the LR of the round's end, never further along
    the schedule."""
    H = 10
    cfg = OuterConfig(inner_steps=H, round_length="time")
    swarm = FakeSwarm(tmp_path, cfg)
    a = swarm.add("a", target=1.0, step_seconds=lambda step: 0.02 if step < 2 * H else 0.04)
    b = swarm.add("b", target=3.0, step_seconds=lambda step: 0.06 if step < 2 * H else 0.02)
    swarm.run(3)
    assert outcomes(a) == outcomes(b) == ["averaged"] * 3
    steps = [(ra.inner_steps, rb.inner_steps) for ra, rb in zip(a.records, b.records)]
    # a trains its H steps in round 2, or one fewer where a loaded machine stretched them past the pace it measured
    assert steps[0] == (H, H) and steps[1][0] >= H - 1, steps
    # (a's time holds about half its H steps now; b's plan was about steps[1][1], 3 while a trains 10)
    assert steps[2][0] <= H - 3 and steps[2][1] >= 2 * steps[1][1], steps
    for peer in (a, b):  # (the round's event says its budget: none in the first round, nothing measured yet)
        assert [r.inner_step for r in peer.records] == [H * r.round for r in peer.records]
        assert peer.records[0].budget_seconds is None and all(r.budget_seconds > 0 for r in peer.records[1:])
    assert b.rounds.trainer.highest < 3 * H + 1e-9 and same(a.outer.params, b.outer.params)


def test_a_late_start_is_cut_from_the_budget_by_the_rounds_first_start_and_bounded():
    pace = Pace(inner_steps=10, timed=True)
    first, second = _record("first", training_round=3, round_started=100.0), _record("second", training_round=3,
                                                                                      round_started=101.0)
    assert pace.late([first, second], own="me", training_round=3, started=102.5, budget=10.0) == 2.5
    assert pace.late([second], own="me", training_round=3, started=100.5, budget=10.0) == 0.0  # we began first
    other_round = _record("other", training_round=2, round_started=50.0)  # (no start said: nothing)
    assert pace.late([other_round, _record("quiet")], own="me", training_round=3, started=102.5, budget=10.0) == 0.0
    liar = _record("liar", training_round=3, round_started=0.0)
    assert pace.late([liar, first], own="me", training_round=3, started=102.5, budget=10.0) == MAX_CUT * 10.0
    assert Pace(inner_steps=10, timed=False).late([first], own="me", training_round=3, started=102.5, budget=1) == 0


def test_the_pace_of_a_round_bounded_by_time():
    pace = Pace(inner_steps=10, timed=True)
    assert pace.budget([]) is None and pace.planned_steps(None) == 10  # nothing measured: H steps
    # a newcomer in a running swarm trains for its period (less the peers' median work), cut by time as it goes
    others = [_record("fast", step_seconds=0.1, work_seconds=0.5), _record("slow", step_seconds=0.3, work_seconds=0.7)]
    assert pace.budget(others, own="me") == pytest.approx(1.0) and pace.planned_steps(1.0) == 10
    # our steps measured, our work not yet: the peers' work at our speed (3x fast's, 1x slow's: the median 0.7)
    measured = Pace(inner_steps=10, timed=True)
    measured.trained(steps=2, seconds=0.6)
    assert measured.own_work(others, own="me") == pytest.approx(0.7)
    assert measured.budget(others, own="me") == pytest.approx(10 * 0.1 + 0.5 - 0.7)
    measured.trained(steps=1, seconds=2.1)  # a step of 1.2 s now: 12x and 4x their work, 2.8 s
    assert measured.own_work(others, own="me") == pytest.approx(2.8) and measured.budget(others, own="me") == 0.0
    pace.trained(steps=10, seconds=5.0)  # 0.5 s a step
    assert pace.fields() == {"step_seconds": 0.5}
    pace.ended(round_seconds=7.0, train_seconds=5.0, waited_seconds=1.0)  # 1 s of work
    assert (pace.step_seconds, pace.work_seconds) == (0.5, 1.0)
    me = _record("me", step_seconds=9.0)  # what we published before: we count as we measure ourselves now
    fast = _record("fast", step_seconds=0.1, work_seconds=0.5)  # its round: 10 * 0.1 + 0.5 = 1.5 s
    assert pace.period([me, fast], own="me") == 1.5
    assert pace.budget([me, fast], own="me") == 0.5 and pace.planned_steps(0.5) == 1  # 1.5 s less our 1 s of work
    assert pace.budget([me], own="me") == 5.0 and pace.planned_steps(5.0) == 10  # alone, we are the pace
    new = _record("new", step_seconds=0.1)  # its work not said yet: ours at its speed, a fifth of our 1 s
    assert pace.period([me, new], own="me") == pytest.approx(1.2)
    liar = _record("liar", step_seconds=1e-9, work_seconds=0.0)  # bounded: the median round over MAX_SPREAD
    assert pace.period([me, fast, liar], own="me") == pytest.approx(1.5 / MAX_SPREAD)
    assert Pace(inner_steps=10, timed=False).budget([me, fast], own="me") is None
    # a round overruns its budget by half a step at most, and by a twentieth of it at most (OVERRUN): a slow peer's
    # long steps make it early, not late
    # (0.5 s a step: 2 take 1 s, 10 take 5 s; half a step would have let 0.76 s hold 2, 4.76 s hold 10)
    assert pace.planned_steps(0.94) == 1 and pace.planned_steps(0.96) == 2
    assert pace.planned_steps(4.75) == 9 and pace.planned_steps(4.77) == 10
    pace.trained(steps=10, seconds=3.0)  # the averages move halfway
    pace.ended(round_seconds=4.0, train_seconds=3.0, waited_seconds=0.0)
    assert pace.step_seconds == pytest.approx(0.4) and pace.work_seconds == pytest.approx(1.0)


def _record(peer: str, **fields) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, **{"epoch": 1, "inner_step": 0, "tokens": 0, "ready": False, "time": 0.0,
                                           **fields})


@pytest.mark.parametrize("contribution", ["tokens", "per_step"])
def test_contributions_of_unequal_steps_are_weighted_by_tokens_and_scaled_as_configured(tmp_path, contribution):
    """Round 2 of a round bounded by time: b trained fewer steps than a. The group's mean is each pseudo-gradient
    times ``contribution_scale`` (per_step: H over its steps), weighted by its tokens: checked against the pull's
    closed form, (outer - target) (1 - 0.9^steps) for a replica that took ``steps`` pulls from the outer weights."""
    cfg = OuterConfig(inner_steps=20, round_length="time", contribution=contribution)
    swarm = FakeSwarm(tmp_path, cfg)
    a = swarm.add("a", target=1.0, step_seconds=0.004)
    b = swarm.add("b", target=3.0, step_seconds=0.02)
    swarm.run(2)
    (ra, rb), H = (a.records[1], b.records[1]), cfg.inner_steps
    assert H >= ra.inner_steps > rb.inner_steps
    assert (ra.tokens, rb.tokens) == (100 * ra.inner_steps, 100 * rb.inner_steps)
    outer = replayed(swarm.hub.means, 1, cfg)  # the outer weights round 2 started from
    expected = []
    for x in outer:
        parts = [(r.tokens, contribution_scale(contribution, r.inner_steps, H) * (x - t) * (1 - 0.9 ** r.inner_steps))
                 for r, t in ((ra, 1.0), (rb, 3.0))]
        expected.append(sum(w * p for w, p in parts) / sum(w for w, _ in parts))
    assert all(torch.allclose(m, e, atol=1e-6) for m, e in zip(swarm.hub.means[1], expected))


def test_a_pseudo_gradient_computed_again_is_scaled_as_the_one_sent():
    """Averaging in place (blocking rounds on a GPU) writes the average over what was sent, so a solo step after a
    failed round computes the pseudo-gradient again from the replica: it must count as the one sent did (per_step,
    5 steps of H=20: times 4)."""
    trainer = PullTrainer(target=1.0)
    outer = OuterOptimizer(trainer.model, OuterConfig(inner_steps=20, contribution="per_step"))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.fill_(0.5)  # the replica moved; outer - replica = -0.5
    exchange = RoundExchange(AveragingConfig(), 0, None, "a", outer=outer, averager=SimpleNamespace(in_place=True),
                             progress=None, sync=None, healing=None, events=None, compute=ThreadCompute(),
                             should_stop=lambda: False)
    scale = contribution_scale("per_step", 5, 20)
    exchange.sent, exchange.scale = [torch.zeros(3, 4), torch.zeros(4)], scale  # (overwritten by the average)
    again = asyncio.run(exchange.own_pseudo_gradient())
    assert scale == 4.0 and all(torch.equal(t, torch.full_like(t, -0.5 * scale)) for t in again)
    exchange.averager.in_place = False  # otherwise: what was sent, as it was
    assert asyncio.run(exchange.own_pseudo_gradient()) is exchange.sent


@pytest.mark.parametrize("others", [["slow"], ["slow", "fast"]])
def test_a_proxy_whose_gate_finds_no_other_member_tells_the_peers_that_handed_in(others):
    """Our gate saw ``others`` ready, and "slow" had handed in to us: with nobody else to average with we run no
    all-reduce, and the averager answers the hand-ins at once (``HandIns.no_all_reduce``); with a member more we
    average, and the hand-in is folded into our part."""
    records = [_record("us", ready=True), _record("slow", ready=True, hands_to="us"),
               *[_record(name, ready=True) for name in others if name != "slow"]]
    decision = ReadyDecision(len(records), len(records), 0.0, ALL_READY, records=records, handing_in=1)
    told = []

    async def average(*args, **kwargs):
        return RoundResult(ok=True, group_size=2)

    async def no_all_reduce(epoch):
        told.append(epoch)

    async def wait_until_ready(**kwargs):
        return decision

    async def publish(**kwargs):
        pass

    async def at_gate(records):
        return False, ""

    averager = SimpleNamespace(in_place=False, average=average, no_all_reduce=no_all_reduce)
    progress = SimpleNamespace(record=_record("us"), publish=publish, wait_until_ready=wait_until_ready)
    exchange = RoundExchange(AveragingConfig(), 0, at_gate, "us", averager=averager, progress=progress,
                             outer=None, sync=SimpleNamespace(state_hash=""), healing=SimpleNamespace(downloads=0),
                             events=SimpleNamespace(write=lambda *a, **k: None), compute=ThreadCompute(),
                             should_stop=lambda: False)
    result = asyncio.run(exchange._exchange([torch.zeros(2)], tokens=10, epoch=1, inner_step=20)).result
    assert (told, result.ok) == (([1], False) if len(others) == 1 else ([], True))


@pytest.mark.parametrize("contribution", ["tokens", "per_step"])
def test_the_bound_on_the_averages_norm_grows_for_a_pseudo_gradient_of_fewer_steps(tmp_path, contribution):
    """A pseudo-gradient grows with the steps behind it: a peer of a few steps checks the group's average against
    ``max_update_ratio`` times H / its steps (unless ``per_step`` scaled what it sent by as much already); a slow
    volunteer of one step refused its group's honest averages as too long, round after round."""
    cfg = OuterConfig(inner_steps=20, round_length="time", contribution=contribution)
    swarm = FakeSwarm(tmp_path, cfg, AveragingConfig(ready_timeout=2.0, heartbeat=0.05, max_update_ratio=10.0))
    a = swarm.add("a", target=1.0, step_seconds=0.004)
    b = swarm.add("b", target=3.0, step_seconds=0.02)
    swarm.run(2)
    steps = b.records[1].inner_steps
    assert steps < 20 and all(r.outcome == "averaged" for r in (*a.records, *b.records))
    # (a trains its 20 steps, or one fewer where a loaded machine stretched them past the pace it measured)
    for peer, trained in ((a, a.records[1].inner_steps), (b, steps)):
        expected = 10.0 * 20 / trained if contribution == "tokens" else 10.0
        assert peer.rounds._update_ratio() == pytest.approx(expected), (peer.name, trained)


def test_the_contribution_scale():
    assert contribution_scale("tokens", 4, 20) == 1.0
    assert contribution_scale("per_step", 4, 20) == 5.0 and contribution_scale("per_step", 20, 20) == 1.0
    with pytest.raises(ValueError, match="unknown contribution"):
        contribution_scale("equal", 4, 20)


def test_a_peer_whose_one_step_outlasts_the_round_by_half_a_round_is_not_waited_for():
    pace = Pace(inner_steps=10, timed=True)
    fast = _record("fast", step_seconds=0.1, work_seconds=0.5)  # its round: 1.5 s
    crawler = _record("crawler", step_seconds=2.5, work_seconds=0.5)  # one step: longer than the whole round
    busy = _record("busy", step_seconds=1.3, work_seconds=1.0)  # one step and its round's work: 2.3 s, over 1.5 x 1.5
    late = _record("late", step_seconds=1.0, work_seconds=1.0)  # 2.0 s: half a second late, waited for
    slow = _record("slow", step_seconds=0.9, work_seconds=0.5)  # one step and its work fit: a round of one step
    swarm = [fast, crawler, busy, late, slow]
    assert pace.too_slow(crawler, swarm) and pace.too_slow(busy, swarm)
    assert not pace.too_slow(late, swarm) and not pace.too_slow(slow, swarm)
    assert not Pace(inner_steps=10, timed=False).too_slow(crawler, [fast, crawler])  # fixed H waits for everyone


def test_the_gate_does_not_wait_for_a_peer_that_cannot_be_ready_in_time():
    board = Board()
    me, crawler = BoardProgress(board, "me"), BoardProgress(board, "crawler")
    pace = Pace(inner_steps=10, timed=True)

    async def gate():
        await crawler.publish(epoch=0, round=0, ready=False, joined=True, step_seconds=2.0, work_seconds=0.5)
        await me.publish(epoch=0, round=0, ready=True, joined=True, step_seconds=0.1, work_seconds=0.5)
        return await me.wait_until_ready(min_peers=1, min_peers_timeout=30, ready_timeout=30, too_slow=pace.too_slow)

    decision = asyncio.run(asyncio.wait_for(gate(), timeout=5))
    assert decision.reason == ALL_READY and decision.ready == 1


@pytest.mark.parametrize("mode", ["blocking", "eager"])
def test_a_round_split_into_groups_heals_within_itself(tmp_path, mode):
    """Round 2's five peers average in a group of three and one of two (matchmaking split them, as 16 peers on a
    loaded machine did): each group holds an average of its own. Each peer sees its group held fewer than the gate's
    ready peers and compares its state with the others' once they have stepped: the pair takes the three's, in that
    round."""
    swarm = FakeSwarm(tmp_path, SCHEDULES[mode])
    peers = [swarm.add(name, target=t) for name, t in zip("abcde", (1.0, 2.0, 3.0, 4.0, 5.0))]
    swarm.hub.script.update({(1, "d"): "group:apart", (1, "e"): "group:apart"})
    swarm.run(3)
    assert all(outcomes(p) == ["averaged"] * 3 for p in peers), [outcomes(p) for p in peers]
    assert [p.records[1].group_size for p in peers] == [3, 3, 3, 2, 2]
    assert [p.sync.syncs for p in peers] == [0, 0, 0, 1, 1]  # the pair took the three's state
    for r in range(3):
        assert len({p.records[r].param_sha256 for p in peers}) == 1, r

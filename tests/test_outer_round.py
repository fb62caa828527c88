"""Outer rounds heal: after a failed round the replicas' outer weights are identical again within one round.

Real peers (``diloco-peer join`` subprocesses on loopback) in eager overlapped mode, where a failure is
hardest to see: a round's average is applied a round after it was computed, while the next round trains.
The failures are injected (``config/faults.py``) with ``refuse_round``: a peer refuses the group's average after
the all-reduce succeeded, as one whose check of the average fails would; and with ``crash_in_allreduce``: a peer
dies as a reducer mid-all-reduce, and the others keep their own values for its part of the vector.
"""

from __future__ import annotations

import signal

import pytest


def _rounds(swarm, name: str) -> dict[int, dict]:
    return {e["round"]: e for e in swarm.events(name) if e["event"] == "round"}


@pytest.mark.slow
def test_overlapped_rounds_heal_after_a_reducer_dies_and_after_one_and_two_sided_failures(local_swarm):
    """Three peers, then two. Round 2: only peer a refuses (b and c applied the average): a takes the others'
    state at the end of that round. Round 3: c dies as a reducer in the middle of the all-reduce: a and b each
    keep their own values for c's part; a partial round for both (or, if the whole all-reduce broke, a failed
    one), and both end it on one state: each publishes its step at once and both pick the same of the two.
    Round 5: both refuse; one steps alone and the other takes its state, or both step alone, their weights part,
    and at the next gate one of them sees that its weights are not the swarm's and takes the other's state
    after that round. Every other round ends identical, and the last two are averaged."""
    local_swarm.start_bootstrap()
    rounds = 7
    common = ["outer.overlap=eager", f"run.max_rounds={rounds}", "averaging.ready_timeout=10.0",
              "averaging.matchmaking_time=3.0", "checkpoint.dir=''", "averaging.min_peers=3"]
    faults = {"a": "refuse_round:2,5", "b": "refuse_round:5", "c": "crash_in_allreduce:3"}
    peers = {name: local_swarm.start_peer(name, *common, f"data.shard={i}", env={"DILOCO_PEER_FAULT": fault})
             for i, (name, fault) in enumerate(faults.items())}
    assert peers["c"].wait(timeout=300) == -signal.SIGKILL
    for name in ("a", "b"):
        assert peers[name].wait(timeout=300) == 0, (local_swarm.workdir / f"{name}.log").read_text()[-3000:]
    a, b = _rounds(local_swarm, "a"), _rounds(local_swarm, "b")
    assert sorted(a) == sorted(b) == list(range(1, rounds + 1)), (sorted(a), sorted(b))
    assert a[2]["outcome"] == "failed" and b[2]["outcome"] == "averaged", (a[2], b[2])
    assert {a[3]["outcome"], b[3]["outcome"]} <= {"partial", "failed"}, (a[3], b[3])
    assert a[5]["outcome"] == b[5]["outcome"] == "failed", (a[5], b[5])
    # the one-sided failure heals within its own round: a took the others' state instead of stepping alone
    syncs = [e for e in local_swarm.events("a") if e["event"] == "sync"]
    assert any(e["ok"] and e["epoch"] == 2 for e in syncs), syncs
    # the dead reducer: a partial round ends on one state for both (a failed one heals by the next round);
    # the two-sided refusal: whichever stepped alone first became the state the other took, at the end of this
    # round or (both stepped alone before seeing each other) of the next one
    both_partial = a[3]["outcome"] == b[3]["outcome"] == "partial"
    for r in range(1, rounds + 1):
        if r != 5 and (r != 3 or both_partial):
            assert a[r]["param_sha256"] == b[r]["param_sha256"], (r, a[r], b[r])
    # (round 4 may fail too: hivemind sometimes waits out its sender timeout, 30 s, for the dead reducer, and the
    # survivors then meet at round 4's gate at different moments; seen in 2 of 6 runs here)
    assert all(a[r]["outcome"] == b[r]["outcome"] == "averaged" for r in (1, 6, 7)), (a, b)
    assert a[1]["group_size"] == 3 and a[6]["group_size"] == 2, (a[1], a[6])

"""Outer rounds heal: after a failed round the replicas' outer weights are identical again within one round.

Real peers (``diloco-peer join`` subprocesses on loopback) in eager overlapped mode, where a failure is
hardest to see: a round's average is applied a round after it was computed, while the next round trains.
The failures are injected with ``refuse_round`` (``config/faults.py``): a peer refuses the group's average
after the all-reduce succeeded, as one whose check of the average fails would.
"""

from __future__ import annotations

import pytest


def _rounds(swarm, name: str) -> dict[int, dict]:
    return {e["round"]: e for e in swarm.events(name) if e["event"] == "round"}


@pytest.mark.slow
def test_overlapped_rounds_heal_after_a_one_sided_and_a_two_sided_failure(local_swarm):
    """Round 2: only peer a refuses (b applied the average): a takes b's state at the end of that round.
    Round 5: both refuse; one steps alone and the other takes its state, or both step alone, their weights part,
    and at the next gate one of them sees that its weights are not the swarm's and takes the other's state
    after that round. Every other round is averaged and identical."""
    local_swarm.start_bootstrap()
    rounds = 7
    common = ["outer.overlap=eager", f"run.max_rounds={rounds}", "averaging.ready_timeout=10.0",
              "averaging.matchmaking_time=3.0", "checkpoint.dir=''"]
    peers = {"a": local_swarm.start_peer("a", *common, "data.shard=0", env={"DILOCO_PEER_FAULT": "refuse_round:2,5"}),
             "b": local_swarm.start_peer("b", *common, "data.shard=1", env={"DILOCO_PEER_FAULT": "refuse_round:5"})}
    for name, proc in peers.items():
        assert proc.wait(timeout=300) == 0, (local_swarm.workdir / f"{name}.log").read_text()[-3000:]
    a, b = _rounds(local_swarm, "a"), _rounds(local_swarm, "b")
    assert sorted(a) == sorted(b) == list(range(1, rounds + 1)), (sorted(a), sorted(b))
    assert a[2]["outcome"] == "failed" and b[2]["outcome"] == "averaged", (a[2], b[2])
    assert a[5]["outcome"] == b[5]["outcome"] == "failed", (a[5], b[5])
    # the one-sided failure heals within its own round: a took b's state instead of stepping alone
    syncs = [e for e in local_swarm.events("a") if e["event"] == "sync"]
    assert any(e["ok"] and e["epoch"] == 2 for e in syncs), syncs
    # the two-sided one: both refused; whichever stepped alone first became the state the other took, at the
    # end of this round or (both stepped alone before seeing each other) of the next one
    for r in range(1, rounds + 1):
        if r != 5:
            assert a[r]["param_sha256"] == b[r]["param_sha256"], (r, a[r], b[r])
    assert all(a[r]["outcome"] == b[r]["outcome"] == "averaged" for r in (1, 3, 4, 6, 7)), (a, b)

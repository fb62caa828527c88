"""A bad peer (broken hardware, a buggy fork, an attacker) must never poison the honest peers' weights."""

import json

import pytest
import torch
from conftest import FAST

from diloco_peer.averaging_round import FAULT_ENV
from diloco_peer.checkpoint import load_file
from diloco_peer.config import load_config
from diloco_peer.robust_aggregation import refuse_update


def test_an_average_with_nans_or_a_huge_norm_is_refused():
    own = [torch.ones(10), torch.ones(3, 3)]
    assert refuse_update([t * 2 for t in own], own, 10.0) == ""
    assert "2 non-finite values" in refuse_update([torch.tensor([1.0, float("nan"), float("inf")]), own[1]], own, 10)
    assert "norm" in refuse_update([t * 11 for t in own], own, 10.0)
    assert refuse_update([t * 11 for t in own], own, 0.0) == ""  # 0 disables the norm check
    assert "non-finite" in refuse_update([t * float("nan") for t in own], own, 0.0)  # never disabled


@pytest.mark.slow
def test_a_peer_sending_a_huge_pseudo_gradient_does_not_poison_the_others(local_swarm):
    local_swarm.start_bootstrap()
    sets = ["averaging.min_peers=3", "run.max_rounds=4", "checkpoint.dir=checkpoints"]
    honest = [local_swarm.start_peer(f"p{i}", *sets) for i in range(2)]
    bad = local_swarm.start_peer("bad", *sets, env={FAULT_ENV: "poison:1000"})
    for proc in [*honest, bad]:
        assert proc.wait(timeout=300) == 0

    for name in ("p0", "p1"):
        events = local_swarm.events(name)
        rounds = [e for e in events if e["event"] == "round"]
        with_bad = [r for r in rounds if r["group_size"] == 3]
        assert with_bad, rounds  # the bad peer was in the honest peers' groups...
        for r in with_bad:  # ...and its average was refused every time, never applied
            assert r["outcome"] == "failed" and "refused the group's average: norm" in r["error"], r
        start = next(e for e in events if e["event"] == "start")
        assert all(r["eval_loss"] < start["eval_loss"] for r in rounds), rounds  # training went on
        state = load_file(sorted((local_swarm.workdir / "checkpoints" / name).glob("*.pt"))[-1],
                          load_config(None, [*FAST]).fingerprint())
        assert all(bool(torch.isfinite(p).all()) and p.abs().max() < 100 for p in state.outer_params)
    # the loss went down as in a healthy run of these settings (~2.8 after 4 rounds); one applied 1000x
    # update would have sent it far up
    last = {n: [e for e in local_swarm.events(n) if e["event"] == "round"][-1] for n in ("p0", "p1")}
    assert max(e["eval_loss"] for e in last.values()) < 3.5, json.dumps(last)[:2000]

"""Whole swarms of real processes on loopback: DiLoCo rounds, bit-identical replicas, the start-up gate."""

import asyncio
import json
import time

import pytest
import torch
from conftest import FAST, orphaned_p2pd_pids
from hivemind.dht import DHT

from diloco_peer.config import load_config
from diloco_peer.daemon import PeerDaemon
from diloco_peer.swarm.progress import SwarmProgress
from diloco_peer.training.data import Corpus
from diloco_peer.training.model import build_model
from diloco_peer.training.trainer import Trainer

pytestmark = pytest.mark.slow


def _finished_inner_steps(swarm, name: str, proc, steps: int) -> None:
    deadline = time.monotonic() + 120
    while not any(e["event"] == "progress" and e["inner_step"] == steps for e in swarm.events(name)):
        assert time.monotonic() < deadline and proc.poll() is None, f"{name} never finished its inner steps"
        time.sleep(0.2)


def test_first_round_waits_for_min_peers_and_a_peer_waiting_alone_leaves_on_sigterm(local_swarm):
    """A fast early peer must not take a solo step while the second peer is still starting (OpenDiLoCo does). And a
    peer waiting at that gate for partners that never come (another run: min_peers=3, alone) leaves promptly on
    SIGTERM: exit 0, nothing left behind."""
    before = orphaned_p2pd_pids()
    local_swarm.start_bootstrap()
    sets = ["averaging.min_peers=2", "run.max_rounds=2", "outer.inner_steps=5", "data.num_shards=2"]
    early = local_swarm.start_peer("early", *sets, "data.shard=0")
    waiting = local_swarm.start_peer("waiting", "run.run_id=alone", "averaging.min_peers=3", "outer.inner_steps=3",
                                     "data.shard=0")
    _finished_inner_steps(local_swarm, "early", early, 5)
    _finished_inner_steps(local_swarm, "waiting", waiting, 3)
    time.sleep(1)
    sent = time.monotonic()
    waiting.terminate()
    assert waiting.wait(timeout=30) == 0
    assert time.monotonic() - sent < 15
    stop = [e for e in local_swarm.events("waiting") if e["event"] == "stop"]
    assert stop and stop[0]["reason"] == "signal" and stop[0]["epoch"] == 0
    leftovers = orphaned_p2pd_pids() - before  # (the in-process tests beside this one start daemons of their own)
    assert not leftovers, f"p2pd processes left behind by the peer: {leftovers}"

    time.sleep(max(0.0, 4 - (time.monotonic() - sent)))  # the early peer now waits at the gate, alone (4 s or more)
    assert not any(e["event"] == "round" for e in local_swarm.events("early"))
    late = local_swarm.start_peer("late", *sets, "data.shard=1")
    assert early.wait(timeout=180) == 0 and late.wait(timeout=60) == 0

    rounds = {name: [e for e in local_swarm.events(name) if e["event"] == "round"] for name in ("early", "late")}
    assert [r["round"] for r in rounds["early"]] == [1, 2] == [r["round"] for r in rounds["late"]]
    for name, records in rounds.items():
        assert all(r["outcome"] == "averaged" and r["group_size"] == 2 for r in records), (name, records)
    assert rounds["early"][0]["wait_seconds"] > 4
    for a, b in zip(rounds["early"], rounds["late"]):
        assert a["param_sha256"] == b["param_sha256"]


def test_single_peer_with_unit_outer_lr_equals_plain_adamw(tmp_path):
    """H=1, outer lr 1, no momentum: the outer step copies the replica, so DiLoCo reduces to AdamW."""
    steps = 6
    cfg = load_config(None, [
        *FAST, "outer.inner_steps=1", "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false",
        "averaging.min_peers=1", f"run.max_rounds={steps}", "data.shard=0", f"run.log_dir={json.dumps(str(tmp_path))}",
        "swarm.host_maddrs=[\"/ip4/127.0.0.1/tcp/0\"]", f"checkpoint.dir={json.dumps(str(tmp_path / 'ckpt'))}",
    ])
    daemon = PeerDaemon(cfg, initial_peers=[], name="solo")
    assert asyncio.run(daemon.run()) == 0
    assert daemon.outer.epoch == steps and daemon.trainer.step == steps

    reference = Trainer(build_model(cfg.model, cfg.run.seed), Corpus(cfg.data, 0, cfg.model.vocab_size), cfg.inner)
    reference.train_steps(steps)
    for got, want in zip(daemon.trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    rounds = [json.loads(line) for line in (tmp_path / "solo.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in rounds if r["event"] == "round"] == ["solo"] * steps


def test_failed_round_falls_back_to_a_solo_step(local_swarm):
    """A partner that says it is ready but never shows up at matchmaking: the round fails, the peer takes
    a solo step, says why, and trains on."""
    local_swarm.start_bootstrap()
    ghost_dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[local_swarm.address])
    try:
        ghost = SwarmProgress(ghost_dht, "diloco-tiny", "ghost", heartbeat=60)  # its record outlives the test
        asyncio.run(ghost.publish(epoch=0, ready=True))
        # after the failed round the peer waits for the others to end it (ready_timeout + 3 heartbeats): the
        # ghost never does, so a short ready_timeout keeps that bounded wait short (it is ready: no gate wait)
        peer = local_swarm.start_peer("real", "averaging.min_peers=2", "run.max_rounds=2", "outer.inner_steps=3",
                                      "averaging.ready_timeout=2.0", "data.shard=0")
        assert peer.wait(timeout=180) == 0, (local_swarm.workdir / "real.log").read_text()
    finally:
        ghost_dht.shutdown()
    rounds = [e for e in local_swarm.events("real") if e["event"] == "round"]
    assert [r["outcome"] for r in rounds] == ["failed", "solo"]
    assert rounds[0]["ready_peers"] == 2 and rounds[0]["error"]
    assert rounds[1]["ready_peers"] == 1  # the ghost is still at epoch 0: not a partner for epoch 1
    assert "averaging failed" in (local_swarm.workdir / "real.log").read_text()

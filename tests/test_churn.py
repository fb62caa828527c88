"""Churn with real processes: peers are killed, leave and join at chosen moments; the swarm heals.

The moments are chosen from the peers' own event logs (a ``progress`` event is mid inner steps, an
``averaging`` event is the start of matchmaking + all-reduce, a ``round`` event is followed at once by
the background checkpoint write), so the schedule is the same on every run, however slow the machine.
"""

import json
import os
import signal
import time

import psutil
import pytest
from conftest import FAST, orphaned_p2pd_pids

from diloco_peer.config import load_config
from diloco_peer.config.faults import FAULT_ENV
from diloco_peer.state.checkpoint import load_file

pytestmark = pytest.mark.slow

# every churn moment below is read from the event logs, so the round length (H) only sets how long the test takes
CHURN = ["outer.inner_steps=15", "averaging.allreduce_timeout=8.0", "averaging.ready_timeout=8.0",
         "averaging.sync_timeout=5.0", "checkpoint.dir=checkpoints", "run.shutdown_grace=20.0"]


def _wait_for(swarm, name, predicate, what, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in swarm.events(name):
            if predicate(event):
                return event
        time.sleep(0.1)
    raise AssertionError(f"{name}: no {what} within {timeout}s; last events: {swarm.events(name)[-3:]}")


def _children(pid):
    return psutil.Process(pid).children(recursive=True)


def _rounds(swarm, name):
    return [e for e in swarm.events(name) if e["event"] == "round"]


def test_chaos_kills_leaves_and_joins_the_survivors_end_identical(local_swarm):
    before = orphaned_p2pd_pids()
    local_swarm.start_bootstrap()
    # p3 will die as a reducer in the middle of its third all-reduce, the worst moment for the others
    faults = {"p3": {FAULT_ENV: "crash_in_allreduce:3"}}
    procs = {f"p{i}": local_swarm.start_peer(f"p{i}", *CHURN, "averaging.min_peers=5", env=faults.get(f"p{i}"))
             for i in range(5)}
    doomed_children = [*_children(procs["p3"].pid)]

    def crash(name):  # SIGKILL of the main process only, as the OOM killer would do it
        doomed_children.extend(_children(procs[name].pid))
        procs[name].send_signal(signal.SIGKILL)

    # a newcomer starts after round 1 (it needs a while to start on this busy machine)
    _wait_for(local_swarm, "p0", lambda e: e["event"] == "round" and e["round"] == 1, "round 1")
    procs["p5"] = local_swarm.start_peer("p5", *CHURN)
    # p4 crashes in the middle of the inner steps of round 2
    _wait_for(local_swarm, "p4", lambda e: e["event"] == "progress" and e["epoch"] == 1, "round-2 inner steps")
    crash("p4")
    # p3 crashes mid-all-reduce (its third): the others in its group see the round fail or a shard not averaged;
    # they re-sync at once, so that the replicas are identical again. Every survivor gets past that round, by
    # averaging or by a state sync (a peer that was late for a round takes the swarm's state instead)
    assert procs["p3"].wait(timeout=240) == -signal.SIGKILL
    died_in = [e for e in local_swarm.events("p3") if e["event"] == "averaging"][-1]["epoch"] + 1
    survivors = ("p0", "p1", "p2", "p5")
    for name in survivors:
        _wait_for(local_swarm, name, lambda e: (e["event"] == "round" and e["round"] >= died_in)
                  or (e["event"] == "sync" and e["ok"] and e["epoch"] >= died_in), f"past round {died_in}")

    def damaged():  # the round event comes after the re-sync it triggered: give it a moment
        return [e for n in survivors for e in _rounds(local_swarm, n)
                if e["round"] == died_in and e["outcome"] in ("partial", "failed")]

    deadline = time.monotonic() + 60
    while not damaged():
        assert time.monotonic() < deadline, [e for n in survivors for e in _rounds(local_swarm, n)
                                             if e["round"] == died_in]
        time.sleep(0.2)
    # p3 died having sent nobody a part of its own: its group drops it as a sender once its connection goes, not
    # after hivemind's sender_timeout (half the all-reduce timeout: 4 s here, 30 s by default; 30.1-30.5 s in a
    # 3-peer run before, 0.5-0.9 s after). Its group's members only: the newcomer, ready once that group had formed
    # (it joined as the round's gates opened), found no group and failed after its matchmaking's 3 windows (7.6 s)
    assert all(e["allreduce_seconds"] < 4.0 for e in damaged() if e["group_size"] > 1), damaged()
    # once the newcomer has contributed: p2 leaves gracefully, then p1 is killed right after a round,
    # while its background checkpoint write runs, and restarts with the same name
    # (its first round with others: averaged, or partial if a reducer failed in it, seen in a run here)
    first = _wait_for(local_swarm, "p5", lambda e: e["event"] == "round" and "first_contribution_seconds" in e,
                      "a first contribution")
    procs["p2"].send_signal(signal.SIGTERM)
    term_sent = time.monotonic()
    n = _wait_for(local_swarm, "p1", lambda e: e["event"] == "round" and e["round"] > first["round"],
                  "a round")["round"]
    crash("p1")
    assert procs["p2"].wait(timeout=30) == 0, "a graceful leave must exit 0"
    assert time.monotonic() - term_sent < 30
    procs["p1"].wait()
    procs["p1"] = local_swarm.start_peer("p1", *CHURN)
    # the restarted peer is back in when it averages in a round with all three survivors
    last = _wait_for(local_swarm, "p1", lambda e: e["event"] == "round" and e["round"] > n and e["group_size"] == 3,
                     "an averaged round with the survivors")["round"]
    _wait_for(local_swarm, "p0", lambda e: e["event"] == "round" and e["round"] == last, f"round {last}")
    _wait_for(local_swarm, "p5", lambda e: e["event"] == "round" and e["round"] == last, f"round {last}")
    for name in ("p0", "p1", "p5"):
        procs[name].send_signal(signal.SIGTERM)
    for name in ("p0", "p1", "p5"):
        code = procs[name].wait(timeout=40)
        assert code == 0, f"{name} exited {code}: {(local_swarm.workdir / f'{name}.log').read_text()[-3000:]}"

    # a round is "partial" exactly when an all-reduce that went through left values un-averaged
    for e in (e for n in ("p0", "p1", "p2", "p5") for e in _rounds(local_swarm, n)):
        assert (e["outcome"] == "partial") == (e["values_not_averaged"] > 0 and e["outcome"] != "failed"), e
    # survivors are bit-identical after that round: the newcomer and the restarted peer included
    at_last = {name: next(e for e in _rounds(local_swarm, name) if e["round"] == last) for name in ("p0", "p1", "p5")}
    assert len({e["param_sha256"] for e in at_last.values()}) == 1, at_last
    assert all(e["outcome"] == "averaged" and e["group_size"] == 3 for e in at_last.values()), at_last
    # healed at once after p3's death: whenever all four survivors averaged in one group, they agreed
    for rnd in range(died_in + 1, last):
        full = [e for n in survivors for e in _rounds(local_swarm, n) if e["round"] == rnd and e["group_size"] == 4]
        assert len({e["param_sha256"] for e in full}) <= 1, full
    # p0 lived through everything: rounds in order, mostly averaged (a round it was late for was replaced by
    # a state sync, never stepped alone), every state sync succeeded
    p0_rounds = [e for e in _rounds(local_swarm, "p0") if e["round"] <= last]
    assert [e["round"] for e in p0_rounds] == sorted({e["round"] for e in p0_rounds}), p0_rounds
    assert sum(e["outcome"] == "averaged" for e in p0_rounds) >= last // 2, p0_rounds
    syncs = [e for e in local_swarm.events("p0") if e["event"] == "sync"]
    assert all(e["ok"] for e in syncs), syncs
    # loss went down through the churn
    start = next(e for e in local_swarm.events("p0") if e["event"] == "start")
    evaluated = [e for e in p0_rounds if "eval_loss" in e]  # (a round handed in was evaluated by its group)
    assert evaluated[-1]["round"] >= last - 1 and evaluated[-1]["eval_loss"] < start["eval_loss"] - 1.0
    # the newcomer caught up by state sync
    syncs = [e for e in local_swarm.events("p5") if e["event"] == "sync" and e["ok"]]
    assert syncs and syncs[0]["bytes"] > 0, "p5 never synced"
    assert 0 < first["first_contribution_seconds"] < 120
    # the restarted peer resumed from its newest complete checkpoint (the one being written when it was killed
    # may or may not have made it)
    p1_events = local_swarm.events("p1")
    p1_starts = [i for i, e in enumerate(p1_events) if e["event"] == "start"]
    saved = [e["epoch"] for e in p1_events[:p1_starts[1]] if e["event"] == "checkpoint"]
    restart = p1_events[p1_starts[1]]
    assert len(p1_starts) == 2 and restart["resumed_from"], restart
    assert restart["epoch"] >= max(saved), (saved, restart)
    # then it caught up by state sync, unless it was back before the swarm finished its next round: then its
    # checkpoint held the swarm's weights and it averaged at once (forked from a warm process, it restarts in
    # about half a second: seen in a suite run here)
    p1_synced = any(e["event"] == "sync" and e["ok"] and e["bytes"] > 0 for e in p1_events[p1_starts[1]:])
    swarm_at = {e["param_sha256"] for n in ("p0", "p5") for e in _rounds(local_swarm, n)
                if e["round"] == restart["epoch"]}
    assert p1_synced or restart["param_sha256"] in swarm_at, (restart, swarm_at)
    # every graceful leaver wrote its checkpoint and said goodbye
    for name in ("p0", "p1", "p2", "p5"):
        events = local_swarm.events(name)
        stop = [e for e in events if e["event"] == "stop"]
        assert len(stop) == 1 and stop[0]["reason"] == "signal", events[-3:]
        assert any(e["event"] == "checkpoint" and e["epoch"] == stop[0]["epoch"] for e in events)
    # every checkpoint on disk loads
    fingerprint = load_config(None, []).fingerprint()
    checkpoint_files = list((local_swarm.workdir / "checkpoints").rglob("*.pt"))
    assert len(checkpoint_files) >= 10
    for path in checkpoint_files:
        assert load_file(path, fingerprint).epoch == int(path.stem.split("-")[1])
    assert not list((local_swarm.workdir / "checkpoints").rglob("*.tmp"))
    # no orphans: the killed peers' DHT, averager and p2pd processes died with them
    time.sleep(1.5)
    assert not [c for c in doomed_children if c.is_running() and c.status() != "zombie"]
    assert orphaned_p2pd_pids() <= before  # a p2pd that outlived its peer is re-parented to init


def test_bootstrap_down_mid_run_and_a_dead_bootstrap_address_do_not_matter(local_swarm):
    address = local_swarm.start_bootstrap()
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # nobody listens there
    procs = []
    for i in range(2):
        cmd = ["join", dead, address, "--name", f"p{i}"]
        for item in [*FAST, f"run.log_dir={json.dumps(str(local_swarm.workdir))}", "run.max_rounds=4",
                     "averaging.min_peers=2"]:
            cmd += ["--set", item]
        procs.append(local_swarm.spawn(cmd, f"p{i}.log"))
    _wait_for(local_swarm, "p0", lambda e: e["event"] == "round" and e["round"] == 1, "round 1")
    os.killpg(local_swarm.procs[0].pid, signal.SIGKILL)  # the bootstrap node and its p2pd vanish
    for proc in procs:
        assert proc.wait(timeout=200) == 0
    rounds = [e for e in local_swarm.events("p0") if e["event"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert all(r["outcome"] == "averaged" and r["group_size"] == 2 for r in rounds), rounds
    last = {[e for e in local_swarm.events(n) if e["event"] == "round"][-1]["param_sha256"] for n in ("p0", "p1")}
    assert len(last) == 1



def test_churn_schedule_parsing_errors_are_one_line():
    from diloco_peer.config import ConfigError
    from diloco_peer.tools.churn import parse_churn

    actions = parse_churn("join:1@round3, kill:2@round2", peers=3, rounds=5)
    assert [(a.action, a.count, a.round) for a in actions] == [("kill", 2, 2), ("join", 1, 3)]
    for bad, says in [("explode:1@round2", "ACTION:COUNT@roundR"), ("kill:1@round9", "1..5"),
                      ("kill:3@round2", "leaves no peer"), ("kill:0@round1", "COUNT must be >= 1")]:
        with pytest.raises(ConfigError, match=says):
            parse_churn(bad, peers=3, rounds=5)


def test_a_leaves_survivors_are_the_peers_that_were_in_its_swarm_not_a_newcomer_syncing_into_its_round():
    from diloco_peer.tools.churn import effects, parse_churn

    def rounds(outcomes, first=1):
        return [{"event": "round", "round": first + i, "outcome": o, "group_size": 2, "param_sha256": "h"}
                for i, o in enumerate(outcomes)]

    events = {"a": rounds(["averaged"] * 4), "b": [*rounds(["averaged"] * 2), {"event": "stop"}],
              "c": rounds(["solo", "averaged"], first=3)}  # c's first round is the leave's: it was syncing
    term, = parse_churn("term:1@round3", peers=2, rounds=4)
    term.peers = ["b"]
    record, = effects([term], events, {"a": 0, "b": 0, "c": 0})
    assert record["left_cleanly"] and record["survivors_round"]["outcomes"] == ["averaged"]
    events["c"] = rounds(["averaged", "failed", "averaged"], first=2)  # c was in before: its failed round counts
    record, = effects([term], events, {"a": 0, "b": 0, "c": 0})
    assert record["survivors_round"]["outcomes"] == ["averaged", "failed"]


def test_demo_churn_schedule_shows_overlapped_rounds_healing(tmp_path):
    """``demo --churn`` in overlapped (eager) mode: a peer SIGKILLed while its round is in flight, a newcomer that
    syncs into the middle of an overlapped round and rebases onto the next epoch, then a graceful leave; the
    survivors identical after each, the newcomer contributing. (Blocking rounds under the same churn, and more:
    test_chaos_kills_leaves_and_joins_the_survivors_end_identical.)"""
    import subprocess

    from conftest import diloco_cmd

    out = tmp_path / "demo"
    # 10 rounds: a newcomer needs 5-20 s to start and sync (a fast host to a loaded one); with 7 (4 after its start)
    # a loaded machine let the swarm finish before the newcomer had joined (seen in CI). The leave (peer-1, the
    # highest-numbered founder left) comes once the newcomer has had rounds to contribute in: 5 rounds after the
    # join, and rounds of 150 inner steps, so that they last as long as its start does on any host (of 30 steps,
    # on a fast host, its first round was the leave's, seen in CI)
    cmd = diloco_cmd("demo", "--peers", "3", "--rounds", "10", "--out", str(out),
                     "--churn", "kill:1@round2,join:1@round3,term:1@round8")
    # matchmaking with more slack than FAST gives: on a loaded machine (CI) a 1 s request timeout let the newcomer
    # give up on a group its leader then formed with it (the last round failed for it, partial for the others)
    for item in [*FAST, "outer.overlap=eager", "outer.inner_steps=150", "averaging.allreduce_timeout=8.0",
                 "averaging.request_timeout=2.0", "averaging.matchmaking_time=4.0",
                 "averaging.ready_timeout=8.0", "averaging.first_round_timeout=60.0"]:
        cmd += ["--set", item]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    kill, join, term = summary["churn"]
    assert kill["peers"] == ["peer-2"] and kill["exit_codes"] == {"peer-2": -9}
    # the kill lands in round 2's exchange: a survivor's round is partial if the dead peer reduced a part of it
    survived = kill["survivors_round"]
    assert survived["identical"] and set(survived["outcomes"]) <= {"averaged", "partial"}, kill
    newcomer = join["joiners"]["peer-3"]
    assert join["peers"] == ["peer-3"] and newcomer["synced_epoch"] >= 2 and newcomer["sync_bytes"] > 0
    assert newcomer["identical_at_end"], newcomer
    rounds = [json.loads(line) for line in (out / "peer-3.jsonl").read_text().splitlines()]
    rounds = [e for e in rounds if e["event"] == "round"]
    assert any(r["outcome"] == "averaged" for r in rounds), rounds  # it contributed, not only followed
    # the leave lands in round 8's exchange, like the kill: a survivor's round is partial if peer-1 left in the
    # middle of the all-reduce; both then end it on one state (each publishes its step and both pick one)
    assert term["peers"] == ["peer-1"] and term["left_cleanly"], term
    survived = term["survivors_round"]
    assert len(survived["outcomes"]) == 2, term  # peer-0, and the newcomer: it had been in for rounds by then
    assert survived["identical"] and set(survived["outcomes"]) <= {"averaged", "partial"}, term
    assert summary["rounds_completed"] == 10 and summary["replicas_identical"] is True
    assert "churn kill:1@round2: peer-2" in result.stdout


FAST_ROUNDS = 10
"""The straggler test's fast peers' rounds. Its one round is 24 of theirs in compute, theirs mostly the gate and
matchmaking: at 6, on a slow host (their 6 rounds in 26 s), the straggler's first round outlasted them all and it
never synced; 10 leave it time for its first round on a host where a fast round's compute takes over a second."""


def test_a_straggler_does_not_hold_the_swarm_and_catches_up_by_state_sync(local_swarm):
    local_swarm.start_bootstrap()
    common = ["averaging.ready_timeout=2.0", "averaging.min_peers=3"]
    fast = [local_swarm.start_peer(f"p{i}", *common, f"run.max_rounds={FAST_ROUNDS}") for i in range(2)]
    # each inner step costs 24x (of FAST's half batch): it falls behind by more than the fast peers wait (2 s gate + 3 s
    # matchmaking)
    slow = local_swarm.start_peer("slow", *common, "inner.grad_accum=24")  # runs until told
    for proc in fast:
        assert proc.wait(timeout=300) == 0
    slow.send_signal(signal.SIGTERM)
    assert slow.wait(timeout=60) == 0, (local_swarm.workdir / "slow.log").read_text()[-3000:]

    fast_rounds = _rounds(local_swarm, "p0")
    assert [r["round"] for r in fast_rounds] == list(range(1, FAST_ROUNDS + 1))
    # the fast peers never waited for the straggler longer than the wait budget, and went on without it
    assert all(r["outcome"] == "averaged" and r["wait_seconds"] < 2.0 + 3 for r in fast_rounds), fast_rounds
    assert any(r["group_size"] == 2 for r in fast_rounds), fast_rounds
    # a group is one epoch: a late pseudo-gradient (relative to older weights) is never mixed into a newer round
    for name in ("p0", "p1", "slow"):
        assert all(len(set(r["group_epochs"])) <= 1 for r in _rounds(local_swarm, name)), _rounds(local_swarm, name)
    # the straggler never went its own way: it dropped its stale rounds and took the swarm's state, as long as
    # there was a swarm (a download that starts as the fast peers leave after their last round finds no donor)
    left = min(e["time"] for name in ("p0", "p1") for e in local_swarm.events(name) if e["event"] == "stop")
    slow_events = [e for e in local_swarm.events("slow") if e["event"] in ("round", "sync") and e["time"] < left]
    syncs = [e for e in slow_events if e["event"] == "sync"]
    assert syncs and all(e["ok"] for e in syncs), syncs
    assert any("the swarm is at epoch" in e["reason"] for e in syncs), syncs
    by_round = {r["round"]: r["param_sha256"] for r in fast_rounds}
    for before, r in zip([None, *slow_events], slow_events):
        if r["event"] != "round" or r["round"] > FAST_ROUNDS:
            continue
        if r["outcome"] == "averaged":
            assert r["param_sha256"] == by_round[r["round"]], r
        elif r["alive_peers"] > 1:  # it missed the group: its lone step was replaced by the swarm's state at once
            assert before is not None and before["event"] == "sync" and before["ok"], (before, r)
            assert r["param_sha256"] == by_round.get(r["round"], r["param_sha256"]), r

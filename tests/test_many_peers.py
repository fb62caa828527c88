"""A dozen volunteers on one 2-core machine: every round after the first is averaged in one group by all of them, or
all but one that came too late for it, and every replica holds the same weights after every round (matchmaking's
window grows with the group, and a peer that missed its round's group, or a round that split into groups, heals
within the round: docs/rounds.md, "Many peers"). What a round costs at 4 to 32 peers is ``bench/swarm_size.py``'s."""

from __future__ import annotations

PEERS = 12
ROUNDS = 3


def test_a_dozen_peers_average_every_round_in_one_group_with_identical_replicas(local_swarm):
    local_swarm.start_bootstrap()
    # the first round waits for all of them (they take a while to start, twelve on two cores); short rounds, one
    # eval batch: the rounds are what is tested, not the training; tiny-cpu's heartbeat (the tests' 1 s ones are
    # too short for twelve peers on two cores: their records expired before their next heartbeat's store)
    sets = [f"run.max_rounds={ROUNDS}", f"averaging.min_peers={PEERS}", "outer.inner_steps=5",
            "outer.round_length=time", "checkpoint.dir=''", "averaging.heartbeat=2.0", "data.eval_batches=1"]
    names = [f"p{i:02d}" for i in range(PEERS)]
    procs = {name: local_swarm.start_peer(name, *sets) for name in names}
    for name, proc in procs.items():
        assert proc.wait(timeout=420) == 0, local_swarm.log(name).read_text()[-3000:]
    rounds = {name: {e["round"]: e for e in local_swarm.events(name, "round")} for name in names}
    for name, by_round in rounds.items():
        assert sorted(by_round) == list(range(1, ROUNDS + 1)), (name, sorted(by_round))
    for r in range(1, ROUNDS + 1):
        events = [rounds[name][r] for name in names]
        assert len({e["param_sha256"] for e in events}) == 1, (r, sorted(e["param_sha256"][:8] for e in events))
        if r > 1:  # (a suite run on a loaded host: p00 came to matchmaking after the other 11 formed round 2's group)
            averaged = [e for e in events if e["outcome"] == "averaged"]
            assert len(averaged) >= PEERS - 1 and {e["group_size"] for e in averaged} == {len(averaged)}, \
                (r, [(e["peer"], e["outcome"], e["group_size"]) for e in events])

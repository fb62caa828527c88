"""A dozen volunteers on one 2-core machine: every replica holds the same weights after every round, and from the
second round on half of them at least average in one group every round (matchmaking's window grows with the group, a
group is complete by the largest count among its members, and a peer that missed its round's group, or a round that
split into groups, heals within the round: docs/rounds.md, "Many peers").

One group of all twelve every round is not asserted: on a loaded host it is what the round aims at, not what it
always gets. Beside one or two busy loops, 2 runs of 6 had a split round (7 + 5; 10 + 2 and 9 + 3 in one run): a
late peer's record had lapsed from most gates, and it reached matchmaking after the others' window had ended
(BENCHMARKS.md, "Many peers"). A peer late for the last round can find the swarm gone and end alone: it is
allowed once (a running swarm heals it at its next round).
What a round costs at 4 to 32 peers is ``bench/swarm_size.py``'s."""

from __future__ import annotations

import collections

PEERS = 12
ROUNDS = 3


def test_a_dozen_peers_hold_identical_replicas_every_round_and_half_at_least_average_in_one_group(local_swarm):
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
    # a peer that handed its pseudo-gradient in to a member says the group's size, but is not one of its members
    handed_in = collections.defaultdict(set)  # round -> the peers that handed in for it
    for name in names:
        for e in local_swarm.events(name, "handed_in"):
            handed_in[e["epoch"] + 1].add(name)
    for name, by_round in rounds.items():
        assert sorted(by_round) == list(range(1, ROUNDS + 1)), (name, sorted(by_round))
    for r in range(1, ROUNDS + 1):
        events = [rounds[name][r] for name in names]
        # a peer late for the run's last round finds the others gone (they stopped at max_rounds) and steps alone:
        # a running swarm would heal it at its next round, this one has none (seen once in a fresh clone's suite)
        ended_alone = [e["peer"] for e in events if r == ROUNDS and e["outcome"] == "solo" and e["alive_peers"] < 3]
        assert len(ended_alone) <= 1, ended_alone
        hashes = {e["param_sha256"] for e in events if e["peer"] not in ended_alone}
        assert len(hashes) == 1, (r, sorted(e["param_sha256"][:8] for e in events))
        groups = collections.Counter(e["group_size"] for e in events
                                     if e["outcome"] == "averaged" and e["peer"] not in handed_in[r])
        if r > 1:  # the state the round's peers heal to is the largest group's: half of them average in it at least
            # (a fresh clone's suite split one round 7 + 4 + 1)
            largest = max((size for size, members in groups.items() if members == size), default=0)
            assert largest >= PEERS // 2, (r, [(e["peer"], e["outcome"], e["group_size"], e["expected_peers"])
                                               for e in events])

"""Volunteers behind home routers: real peers in an emulated internet (``netbed.EmulatedInternet``).

Every test builds network namespaces: a public network with the bootstrap node(s), and each volunteer in
its own home behind its own NAT router (iptables MASQUERADE, no inbound connections unless a port is
forwarded). The peers are real ``diloco-peer`` processes; nothing about the network is mocked. These tests
need root; they skip (and fail in CI, where they must run) when namespaces cannot be made.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import diloco_cmd, require_namespaces, wait_until

from diloco_peer.tools import netbed

# the first contact through a relay (dial, two handshakes) can take longer than the FAST 1 s request timeout on
# two busy cores; a member that gives up while the leader counts it stalls the round (docs/nat.md, troubleshooting)
RELAYED = ["averaging.request_timeout=2.0", "averaging.matchmaking_time=3.0"]
NAT = ["run.max_rounds=3", "averaging.min_peers=2", *RELAYED]
DEAD_RELAY = "/ip4/10.78.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # nobody listens there


@pytest.fixture
def internet(request):
    """``internet(homes, mbit=0)``: the emulated internet, removed after the test (also on failure)."""
    require_namespaces()
    made = []

    def make(homes: int, mbit: float = 0) -> netbed.EmulatedInternet:
        net = netbed.EmulatedInternet(homes, mbit=mbit, tag=f"dt{os.getpid() % 10000}{len(made)}")
        made.append(net)
        return net.__enter__()

    try:
        yield make
    finally:
        for net in made:
            net.close()


def rounds(swarm, name: str) -> list[dict]:
    return [e for e in swarm.events(name) if e["event"] == "round"]


def reach(swarm, name: str) -> list[dict]:
    return [e for e in swarm.events(name) if e["event"] == "reachability"]


def story(swarm, names) -> str:
    """Each peer's rounds on one line, then its warnings: what a failed assertion needs to be understood later
    (in CI the logs go with the machine)."""
    lines = []
    for name in names:
        done = [f"{r['round']} {r['outcome']} x{r['group_size']} {r['round_seconds']:.1f}s {r['error']}".strip()
                for r in rounds(swarm, name)]
        lines.append(f"{name}: " + "; ".join(done))
        log = (swarm.workdir / f"{name}.log").read_text().splitlines()
        lines += [f"  {line[:300]}" for line in log
                  if any(word in line for word in (" WARN", " ERROR", "[WARN]", "[ERROR]", "hivemind.averaging"))][-25:]
    return "\n".join(lines)


def boot(swarm, net, port: int = 31337, *extra: str, log_name: str = "bootstrap.log") -> str:
    return swarm.start_bootstrap(*extra, listen=f"/ip4/{net.public_address}/tcp/{port}", netns=net.public,
                                 log_name=log_name)


def test_three_nat_peers_average_every_round_and_a_late_one_syncs_and_contributes(internet, local_swarm):
    net = internet(4, mbit=20)  # home connections of 20 Mbit/s up and down (tbf): ~2 MB per round each way
    boot(local_swarm, net)
    names = ["home1", "home2", "home3"]
    sets = ["averaging.min_peers=3", "run.max_rounds=0", *RELAYED]  # train until told to stop
    for i, name in enumerate(names):
        local_swarm.start_peer(name, *sets, netns=net.home(i + 1))
    wait_until(lambda: all(len(rounds(local_swarm, n)) >= 2 for n in names), "two rounds of all three", timeout=150)
    late_started = time.time()
    local_swarm.start_peer("late", *sets, netns=net.home(4))
    joined = wait_until(lambda: [r for r in rounds(local_swarm, "late") if r["outcome"] == "averaged"],
                        "a round of the newcomer averaged with the others", timeout=150)[0]
    wait_until(lambda: all(any(r["round"] == joined["round"] for r in rounds(local_swarm, n)) for n in names),
               f"round {joined['round']} on the older peers", timeout=60)
    local_swarm.reap()
    for name in [*names, "late"]:
        found = reach(local_swarm, name)[0]  # (a peer leaving after the relay stopped says it lost it: a second one)
        assert found["mode"] == "relayed" and found["relays"] == 1, found
        assert "dial-back" in found["detail"] and "failed" in found["detail"], found  # the router refused
    # the three: every round averaged all three, through the relay. While the newcomer starts (a CPU-heavy process
    # start on these two cores) and downloads the state over a home uplink, a round of the three may come out
    # partial (a reducer late: seen once in CI), healed by a state sync; and its first try may cut a round short
    # (it and an older peer can miss each other in matchmaking: seen once in CI); and one of the three may miss a
    # round's gate (CI, 2026-11-27: in round 4 two averaged as a pair, the third stepped alone, then took their
    # state by a state sync before the next round; the likely cause, a gate read that missed the others' records,
    # is fixed since: test_progress.py). From its first averaged round on all four average, and every round the
    # three averaged whole left them identical
    first_try = rounds(local_swarm, "late")[0]["round"]
    for name in names:
        three = [r for r in rounds(local_swarm, name) if r["round"] < first_try]
        seen = [(r["round"], r["outcome"], r["group_size"], r["bytes_relayed"]) for r in three]
        before = [r for r in three if r["time"] < late_started]
        assert len(before) >= 2 and all(r["outcome"] == "averaged" and r["bytes_relayed"] > 0 and r["group_size"] == 3
                                        for r in before), (name, seen)
        for r in three:
            if r["outcome"] in ("averaged", "partial") and r["group_size"] == 3:
                continue
            same = {n: [x for x in rounds(local_swarm, n) if x["round"] == r["round"]] for n in names}
            alone = [n for n, rs in same.items() if rs and rs[0]["outcome"] == "solo"]
            assert len(alone) == 1 and all(rs and rs[0]["outcome"] == "averaged" and rs[0]["group_size"] == 2
                                           for n, rs in same.items() if n not in alone), (name, seen)
            assert any(e["event"] == "sync" and e["ok"] and e["epoch"] == r["round"]
                       for e in local_swarm.events(alone[0])), (alone, r["round"])  # it took the pair's state
        (four,) = [r for r in rounds(local_swarm, name) if r["round"] == joined["round"]]
        assert four["outcome"] == "averaged" and four["bytes_relayed"] > 0 and four["group_size"] == 4, four
    for i in range(1, joined["round"] + 1):  # the replicas stay identical, round after round
        done = [r for n in names for r in rounds(local_swarm, n) if r["round"] == i]
        if all(r["outcome"] == "averaged" for r in done):
            assert len({r["param_sha256"] for r in done}) == 1, i
    assert joined["param_sha256"] == rounds(local_swarm, "home1")[joined["round"] - 1]["param_sha256"]
    syncs = [e for e in local_swarm.events("late") if e["event"] == "sync"]
    assert syncs and syncs[0]["ok"] and syncs[0]["epoch"] >= 2, syncs  # downloaded through the relay


def test_forwarded_port_is_direct_and_mixes_with_relayed_and_outbound_only_peers(internet, local_swarm):
    net = internet(3)
    net.forward(1, 40001)
    boot(local_swarm, net)
    # the mean, not the robust default: the forwarded peer reduces the whole vector, judging each part's direction
    # against the median of three; an honest part at cosine -0.04 was refused once in five CI-like runs (2026-11-28),
    # its sender's round went partial and healed by a sync. This test is about reachability, not aggregation
    # (the relay test below pins the mean for the same reason)
    sets = [*NAT, "averaging.min_peers=3", "averaging.aggregation=mean"]
    forwarded = local_swarm.start_peer(
        "forwarded", *sets, netns=net.home(1),
        args=["--listen", "/ip4/0.0.0.0/tcp/40001", "--announce", f"/ip4/{net.router_address(1)}/tcp/40001"])
    # hivemind's matchmaking logs at debug level: the relayed peer's lines say why it missed a group (story())
    relayed = local_swarm.start_peer("relayed", *sets, netns=net.home(2), env={"HIVEMIND_LOGLEVEL": "DEBUG"})
    # told to use a relay that is down: it can neither be dialed nor relayed
    outbound = local_swarm.start_peer("outbound", *sets, f"swarm.relays=[{DEAD_RELAY!r}]".replace("'", '"'),
                                      netns=net.home(3))
    for proc in (forwarded, relayed, outbound):
        assert proc.wait(timeout=240) == 0
    modes = {n: reach(local_swarm, n)[0] for n in ("forwarded", "relayed", "outbound")}
    assert modes["forwarded"]["mode"] == "direct", modes
    assert f"/ip4/{net.router_address(1)}/tcp/40001" in modes["forwarded"]["detail"]
    assert modes["relayed"]["mode"] == "relayed", modes
    assert modes["outbound"]["mode"] == "outbound-only", modes
    for name in ("forwarded", "relayed", "outbound"):
        done = rounds(local_swarm, name)
        assert [r["round"] for r in done] == [1, 2, 3]
        assert all(r["outcome"] == "averaged" and r["group_size"] == 3 for r in done), \
            story(local_swarm, ("forwarded", "relayed", "outbound"))
    for fwd, rel, out in zip(*(rounds(local_swarm, n) for n in ("forwarded", "relayed", "outbound"))):
        # the direct peer reduces the whole vector (it receives both others' parts), the relayed one nothing,
        # so the relay carries only the relayed peer's own part and its average; the outbound-only peer dials
        # the direct one itself and needs no relay at all
        assert fwd["bytes_received"] >= 1.9 * rel["bytes_received"], (fwd, rel)
        assert fwd["bytes_relayed"] <= rel["bytes_sent"] + rel["bytes_received"], (fwd, rel)
        assert out["bytes_relayed"] == 0, out
    log = (local_swarm.workdir / "outbound.log").read_text()
    assert "reachability: outbound-only" in log and "forward TCP port" in log


def test_relay_dies_peers_go_on_through_the_other_and_say_so_when_none_is_left(internet, local_swarm):
    net = internet(3)
    first = boot(local_swarm, net)
    second = boot(local_swarm, net, 31338, "--initial-peer", first, log_name="bootstrap2.log")
    # the mean, not the robust default: in a CI run the honest home1's pseudo-gradients had cosine -0.01 to -0.20
    # with the group's median in rounds 7-9, after the relay loss had split round 4 and home1 had synced. They were
    # refused and (before averaging.ban_cosine) banned, and home1 trained alone. Why home1 pointed away for three
    # rounds is not established (8 runs of this test under robust, some beside a CPU hog: honest cosines 0.09 and
    # up); a refused round of home1 would still fail this test, which is about relays, not aggregation
    sets = ["averaging.min_peers=2", "run.max_rounds=0", "swarm.reachability_check=5", "averaging.aggregation=mean",
            *RELAYED]
    names = ["home1", "home2", "home3"]
    for i, name in enumerate(names):
        local_swarm.start_peer(name, *sets, netns=net.home(i + 1), bootstraps=[first, second])
    wait_until(lambda: all(len(rounds(local_swarm, n)) >= 3 for n in names), "three rounds", timeout=150)
    # both relays carry every home peer (p2pd reserves with each on its own: on a loaded machine the second came
    # after the start-up report once, and the watch reported it a check later; CI 2026-11-27)
    wait_until(lambda: all(reach(local_swarm, n)[-1]["relays"] == 2 for n in names), "two relays each", timeout=30)
    before = {n: len(reach(local_swarm, n)) for n in names}
    os.killpg(local_swarm.procs[0].pid, signal.SIGKILL)  # the first relay (and bootstrap) vanishes
    wait_until(lambda: all(len(reach(local_swarm, n)) > before[n] for n in names), "a relay-lost report", timeout=60)
    for name in names:
        change = reach(local_swarm, name)[before[name]]
        assert change["mode"] == "relayed" and change["relays"] == 1 and "lost relay" in change["detail"], change
    after = len(rounds(local_swarm, "home1"))
    wait_until(lambda: [r for r in rounds(local_swarm, "home1")[after:] if r["outcome"] == "averaged"],
               "a round averaged through the remaining relay", timeout=120)
    os.killpg(local_swarm.procs[1].pid, signal.SIGKILL)  # and the second one
    wait_until(lambda: all(reach(local_swarm, n)[-1]["mode"] == "outbound-only" for n in names),
               "a no-relay-left report", timeout=60)
    log = (local_swarm.workdir / "home1.log").read_text()
    assert "no relay carries us now" in log


def test_demo_nat_refuses_metrics_ports_with_one_line():
    result = subprocess.run(diloco_cmd("demo", "--nat", "--metrics-port-base", "9300"), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "diloco-peer: error: --nat and --metrics-port-base do not go together: each peer's metrics port would be "
        "inside its own network namespace; drop one of them"]

"""Every process ends when asked, and nothing outlives it: the lifecycle matrix (issue 15)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, wait_for_line, wait_until

from diloco_peer.config.faults import FAULT_ENV

pytestmark = pytest.mark.slow

# --- the lifecycle matrix: {bootstrap, peer} x {SIGINT, SIGTERM, SIGKILL} x the phase the signal meets
#
# Each case records the process tree by pid (with start times) before the signal, then checks the exit code,
# the time to exit and that no process of the tree is left. The cases of one phase run side by side, in one
# test, so that the whole matrix costs a few swarm start-ups. SIGINT and SIGTERM: a clean leave, exit 0 (a
# second signal: 130 at once); SIGKILL: the process dies at once and its reaper takes its children along.

GRACE = 20.0  # run.shutdown_grace in these cases: every clean leave must end well within it
KILLED = -signal.SIGKILL


def tree(proc: subprocess.Popen) -> dict[int, float]:
    """pid -> start time of ``proc`` and all its descendants now (p2pd, DHT, averager, reaper)."""
    try:
        root = psutil.Process(proc.pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for member in members:
        try:
            found[member.pid] = member.create_time()
        except psutil.NoSuchProcess:
            continue
    return found


def alive(processes: dict[int, float]) -> list[str]:
    """The processes of ``processes`` that still run (same pid *and* start time: never a recycled pid)."""
    left = []
    for pid, started in processes.items():
        try:
            member = psutil.Process(pid)
            if member.create_time() == started and member.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {member.name()} {' '.join(member.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


class Case:
    """One process of the matrix, the signal it gets and what must follow."""

    def __init__(self, name: str, proc: subprocess.Popen, sig: signal.Signals, bound: float):
        self.name, self.proc, self.sig, self.bound = name, proc, sig, bound
        self.processes: dict[int, float] = {}
        self.sent = 0.0

    def signal(self) -> None:
        self.processes = tree(self.proc)
        assert len(self.processes) > 1, f"{self.name}: no children to check (exited already?)"
        self.sent = time.monotonic()
        self.proc.send_signal(self.sig)

    def check(self, expected_code: int) -> float:
        """Waits for the exit and for every process of the tree to be gone; the seconds it took."""
        code = self.proc.wait(timeout=self.bound + 30)
        took = time.monotonic() - self.sent
        assert code == expected_code, f"{self.name}: {self.sig.name} gave exit code {code}, not {expected_code}"
        assert took < self.bound, f"{self.name}: {self.sig.name} took {took:.1f}s to exit (bound {self.bound:g}s)"
        deadline = time.monotonic() + 15
        while alive(self.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(self.processes), f"{self.name}: left behind after {self.sig.name}: {alive(self.processes)}"
        return took


def _checkpoint_loads(workdir: Path, name: str, epoch: int) -> None:
    from diloco_peer.config import load_config
    from diloco_peer.state.checkpoint import load_file

    path = workdir / "checkpoints" / name / f"epoch-{epoch:06d}.pt"
    assert path.is_file(), f"{name}: no checkpoint of epoch {epoch}: {sorted(path.parent.glob('*'))}"
    load_file(path, load_config(None, [*FAST, f"run.run_id=life-{name}"]).fingerprint())


def test_stop_while_joining_a_bootstrap_nobody_answers_and_bootstrap_nodes(local_swarm):
    """Joining (every bootstrap unreachable, retrying) and bootstrap nodes: each signal, side by side."""
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmPeMbo7XxwUThbbyhqGcsnaU5xpsvSDszHuGqvDCd8P4E"  # discard port: refused
    cases = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        peer = local_swarm.start_peer(f"joining-{sig.name}", "swarm.join_timeout=120", f"run.shutdown_grace={GRACE}",
                                      bootstraps=[nobody])
        boot = local_swarm.spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0"], f"boot-{sig.name}.log")
        cases += [Case(f"joining peer ({sig.name})", peer, sig, bound=10), Case(f"bootstrap ({sig.name})", boot, sig, 10)]
    for case in cases[1::2]:
        wait_for_line(local_swarm.workdir / f"boot-{case.sig.name}.log", "diloco-peer join ", case.proc)
    for case in cases[0::2]:
        wait_for_line(local_swarm.workdir / f"joining-{case.sig.name}.log", "", case.proc)
    time.sleep(3)  # the peers are in their join retries now
    for case in cases:
        case.signal()
    for case in cases:
        case.check(KILLED if case.sig == signal.SIGKILL else 0)


def test_stop_while_training_leaves_a_checkpoint_and_nothing_behind(local_swarm):
    """Peers in their inner steps (each alone in a run of its own), one per signal. (A second signal: see the
    unresponsive-DHT case below, where leaving lasts long enough to send one.)"""
    local_swarm.start_bootstrap()
    sigs = {f"train-{sig.name}": sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)}
    procs = {name: local_swarm.start_peer(
        name, f"run.run_id=life-{name}", "averaging.min_peers=1", "outer.inner_steps=400", "data.shard=0",
        f"run.shutdown_grace={GRACE}", f"checkpoint.dir={json.dumps(str(local_swarm.workdir / 'checkpoints'))}",
        "checkpoint.every_rounds=1") for name in sigs}
    for name in sigs:  # inner steps of round 1 under way
        wait_until(lambda: any(e["event"] == "progress" for e in local_swarm.events(name)), f"{name} training", 120)
    cases = {name: Case(name, proc, sigs[name], bound=GRACE) for name, proc in procs.items()}
    for case in cases.values():
        case.signal()
    for name, case in cases.items():
        case.check(KILLED if case.sig == signal.SIGKILL else 0)
    for name in ("train-SIGINT", "train-SIGTERM"):  # a clean leave saves the round boundary it stands on
        stop = [e for e in local_swarm.events(name) if e["event"] == "stop"]
        assert stop and stop[0]["reason"] == "signal", stop
        _checkpoint_loads(local_swarm.workdir, name, 0)


def test_stop_in_an_all_reduce_and_in_a_state_sync(local_swarm):
    """Three pairs of peers (a run each): one peer of each pair is signalled while its round's exchange is in
    flight (after its ``averaging`` event: matchmaking or all-reduce); then a newcomer joins each run and is
    signalled in the middle of its state download (the remaining partner serves slowly: fault ``slow_serve``).
    The partners train on throughout."""
    local_swarm.start_bootstrap()
    common = [f"run.shutdown_grace={GRACE}", "outer.inner_steps=20", "averaging.matchmaking_time=3.0"]
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    victims, partners = {}, {}
    for sig in sigs:
        run = f"run.run_id=life-{sig.name}"
        victims[sig] = local_swarm.start_peer(f"ar-{sig.name}", run, *common)
        partners[sig] = local_swarm.start_peer(f"partner-{sig.name}", run, *common, env={FAULT_ENV: "slow_serve:6"})
    cases = []
    for sig in sigs:
        name = f"ar-{sig.name}"
        wait_until(lambda: any(e["event"] == "averaging" for e in local_swarm.events(name)), f"{name} averaging", 150)
        cases.append(Case(f"{name} in an all-reduce", victims[sig], sig, bound=GRACE))
        cases[-1].signal()
    for case in cases:
        case.check(KILLED if case.sig == signal.SIGKILL else 0)

    newcomers = {sig: local_swarm.start_peer(f"sync-{sig.name}", f"run.run_id=life-{sig.name}", *common)
                 for sig in sigs}
    cases = []
    for sig, proc in newcomers.items():
        log = local_swarm.workdir / f"sync-{sig.name}.log"
        wait_until(lambda: log.exists() and "state sync: " in log.read_text(), f"sync-{sig.name} downloading", 120)
        cases.append(Case(f"sync-{sig.name} in a state sync", proc, sig, bound=GRACE))
        cases[-1].signal()
    for case in cases:
        took = case.check(KILLED if case.sig == signal.SIGKILL else 0)
        assert took < 6 or case.sig == signal.SIGKILL, f"{case.name}: the download in flight held the leave {took:.1f}s"
    for sig, partner in partners.items():
        assert partner.poll() is None, f"partner-{sig.name} died: {partner.returncode}"


def dht_process(proc: subprocess.Popen) -> psutil.Process:
    """The peer's DHT process: its first child forked from it (hivemind starts the DHT first, the averager later)."""
    peer = psutil.Process(proc.pid)
    forked = [c for c in peer.children() if c.cmdline() == peer.cmdline()]
    return min(forked, key=lambda c: c.create_time())


def test_leaving_with_an_unresponsive_dht_ends_within_its_bound(local_swarm):
    """The DHT process stops answering (SIGSTOP) under a training peer; then the peer is asked to leave. Its
    withdraw and the DHT's shutdown cannot finish: the leave abandons them (exit 0, within run.shutdown_grace),
    a second signal meanwhile ends it at once, and SIGKILL leaves nothing behind, the stopped DHT included.
    (Before: the withdraw's thread kept the default executor, and so the process, alive for good.)"""
    local_swarm.start_bootstrap()
    grace = 30.0
    plans = {"hung-SIGTERM": [signal.SIGTERM], "hung-twice": [signal.SIGTERM, signal.SIGINT],
             "hung-SIGKILL": [signal.SIGKILL]}
    procs = {name: local_swarm.start_peer(name, f"run.run_id=life-{name}", "averaging.min_peers=1",
                                          "outer.inner_steps=400", f"run.shutdown_grace={grace}") for name in plans}
    for name in plans:
        wait_until(lambda: any(e["event"] == "progress" for e in local_swarm.events(name)), f"{name} training", 120)
    cases = {}
    for name, proc in procs.items():
        cases[name] = Case(name, proc, plans[name][0], bound=grace)
        cases[name].processes = tree(proc)
        dht_process(proc).suspend()
        cases[name].signal()
    time.sleep(2)  # well into the withdraw, which waits on the stopped DHT
    cases["hung-twice"].proc.send_signal(signal.SIGINT)
    for name, case in cases.items():
        took = case.check({"hung-SIGKILL": KILLED, "hung-twice": 130}.get(name, 0))
        if name == "hung-SIGTERM":
            log = (local_swarm.workdir / f"{name}.log").read_text()
            assert "could not withdraw our progress record" in log, log[-2000:]

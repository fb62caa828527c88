"""Every process ends when asked, and nothing outlives it: real processes, their trees compared by pid.

Each case starts real processes, records the tree they make (p2pd daemons and reapers included), stops the
top one the way an operator, a supervisor or the OOM killer does (the signal goes to that pid only, not to
its process group), and checks the exit code, the time it took, and that no process of the tree is left.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, diloco_cmd, namespaces_missing, require_namespaces, wait_for_line, wait_until

from diloco_peer.cli import EXIT_INTERRUPTED
from diloco_peer.config.faults import FAULT_ENV
from diloco_peer.lifecycle.reaper import INITIAL_PID_NAMESPACE, remove_namespace, remove_orphaned_segments
from diloco_peer.observe.events import read_events
from diloco_peer.tools import netbed
from diloco_peer.tools.demo import STOP_MARGIN

GRACE = 10.0  # the demo peers' run.shutdown_grace: the demo's stop bound is GRACE + STOP_MARGIN
GONE_AFTER_SIGKILL = 15.0  # seconds in which a SIGKILLed demo's processes (and namespaces) must be gone
RELAYED = ["averaging.request_timeout=2.0", "averaging.matchmaking_time=3.0"]  # as in test_nat.py


def alive(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of ``tree`` that still run (psutil compares start times: a recycled pid is not ours)."""
    running = []
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            continue
    return running


def command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "(gone)"


def describe(tree: list[psutil.Process]) -> str:
    return "; ".join(f"{p.pid} {command(p)[:100]}" for p in tree)


def segments(pids) -> list[str]:
    """The shared memory in /dev/shm that processes ``pids`` made (torch names it ``torch_PID_...``): torch's
    shared-memory manager removes it when they end, unless it was killed along with them (RAM gone until a
    reboot: 14 GB had piled up on the development machine)."""
    pids = {getattr(p, "pid", p) for p in pids}  # (pids, or psutil processes)
    return [f.name for f in Path("/dev/shm").glob("torch_*") if int(f.name.split("_")[1]) in pids]


def namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(prefix)]


class Demo:
    """``diloco-peer demo --peers 2 --rounds 50``: it is mid-training long enough for any stop to hit it there."""

    def __init__(self, workdir: Path, *extra: str):
        self.out, self.log = workdir / "demo", workdir / "demo.log"
        cmd = diloco_cmd("demo", "--peers", "2", "--rounds", "50", "--out", str(self.out), *extra)
        for item in [*FAST, f"run.shutdown_grace={GRACE}"]:
            cmd += ["--set", item]
        with self.log.open("w") as log:  # its own session: what we send reaches the demo's pid and nothing else
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.tree: list[psutil.Process] = []

    def record_tree_mid_training(self, timeout: float = 240) -> list[psutil.Process]:
        """Once both peers finished a round: the demo and every process under it."""
        def trained() -> bool:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            return all(any(e["event"] == "round" for e in read_events(self.out / f"peer-{i}.jsonl")) for i in (0, 1))

        wait_until(trained, "round finished by both peers", timeout=timeout)
        top = psutil.Process(self.proc.pid)
        self.tree = [top, *top.children(recursive=True)]
        commands = [command(p) for p in self.tree]
        # the tree the checks below are about: a bootstrap's and two peers' p2pd, and four reapers (the demo's,
        # the bootstrap's, each peer's)
        assert sum("p2pd" in c.partition(" ")[0] for c in commands) >= 3, commands
        assert sum("diloco_peer.lifecycle.reaper" in c for c in commands) == 4, commands
        return self.tree

    def cleanup(self) -> None:
        """Whatever the test's outcome, nothing of ours stays behind."""
        for p in alive(self.tree):
            try:
                p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _demo_tag(demo: Demo) -> str:
    """The names of a ``--nat`` demo's namespaces begin with this (netbed.EmulatedInternet's names for its internet)."""
    return f"dnat{demo.proc.pid % 100000}-"


@pytest.mark.slow
def test_a_sigterm_stops_a_demos_whole_swarm_then_exits_130_and_a_sigkill_takes_it_along(tmp_path):
    """Two demos side by side, mid-training (both peers have averaged a round): one is SIGKILLed, and every process of
    its tree (and, with ``--nat``, every namespace) and its shared memory are gone within seconds; then the other gets
    SIGTERM, stops its whole swarm and exits 130 within its bound, nothing of it left when it has exited. (Side by
    side: one swarm start-up's wait for both; the kill is checked to its end before the SIGTERM is sent.)

    The demos run with ``--nat`` where network namespaces can be made (always in CI), else on loopback: a ``--nat``
    demo's peers are a loopback demo's, each started in a namespace of its own, and what is checked of the loopback
    demo (its processes and shared memory gone) is checked of the ``--nat`` one too."""
    nat = not namespaces_missing()
    if not nat and os.environ.get("CI"):
        require_namespaces()  # (fails: the --nat demo must run in CI)
    extra = ["--nat", *[a for item in RELAYED for a in ("--set", item)]] if nat else []
    (tmp_path / "kill").mkdir()
    (tmp_path / "term").mkdir()
    killed, termed = Demo(tmp_path / "kill", *extra), Demo(tmp_path / "term", *extra)
    tags = [_demo_tag(demo) for demo in (killed, termed)]
    try:
        killed_tree = killed.record_tree_mid_training()
        termed_tree = termed.record_tree_mid_training()
        if nat:
            assert len(namespaces(tags[0])) == 5, namespaces(tags[0])  # public, and a router and a home per peer
        killed.proc.kill()
        killed.proc.wait()
        wait_until(lambda: not alive(killed_tree) and not (nat and namespaces(tags[0])) and not segments(killed_tree),
                   "end of the SIGKILLed demo's processes, namespaces and shared memory", timeout=GONE_AFTER_SIGKILL)

        os.kill(termed.proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        code = termed.proc.wait(timeout=GRACE + STOP_MARGIN + 10)
        took = time.monotonic() - sent
        assert code == EXIT_INTERRUPTED, termed.log.read_text()[-3000:]
        assert took < GRACE + STOP_MARGIN + 5, took
        assert not alive(termed_tree), describe(alive(termed_tree))  # gone before the demo exited, not only soon after
        assert not namespaces(tags[1]), namespaces(tags[1])
        assert not segments(termed_tree), segments(termed_tree)
        assert "demo: interrupted (SIGTERM), stopping the swarm" in termed.log.read_text()
        if nat:  # and before the stop: each peer behind its own router, reached through the relay, averaging
            assert "each peer behind its own NAT router" in termed.log.read_text()
            events = [list(read_events(termed.out / f"peer-{i}.jsonl")) for i in (0, 1)]
            assert all([e["mode"] for e in log if e["event"] == "reachability"][:1] == ["relayed"] for log in events)
            first = [next(e for e in log if e["event"] == "round") for log in events]
            assert [(r["round"], r["outcome"], r["group_size"]) for r in first] == [(1, "averaged", 2)] * 2, first
            assert first[0]["param_sha256"] == first[1]["param_sha256"]
    finally:
        for demo in (killed, termed):
            demo.cleanup()
        for tag in tags:
            for name in namespaces(tag):
                remove_namespace(name)


def test_the_reaper_kills_what_it_watches_and_deletes_namespaces_when_its_parent_dies(tmp_path):
    """The parent's end of the pipe closes when it dies: that alone must not make the reaper leave its job. A
    child the parent forks is watched at once, without being named, and if it leads a process group of its own
    (as hivemind's DHT process does), what it started in that group (p2pd) goes with it. torch's shared-memory
    manager (started after the reaper and before a fork, as in a peer) is spared: it removes the parent's
    segments from /dev/shm (killed along, it left 2.4 GB there for each SIGKILLed llama-150m peer, RAM gone
    until a reboot)."""
    ns = "" if netbed.available() else f"dlp-reap-{os.getpid() % 100000}"  # namespaces only where they can be made
    parent_code = (
        "import multiprocessing, os, subprocess, sys, time\n"
        "from diloco_peer.lifecycle.reaper import Reaper\n"
        "def like_the_dht(pipe):\n"
        "    os.setpgid(0, 0)\n"
        "    pipe.send(subprocess.Popen(['sleep', '600']).pid)\n"
        "    time.sleep(600)\n"
        "import torch\n"
        "torch.multiprocessing.set_sharing_strategy('file_system')  # (hivemind's)\n"
        "reaper = Reaper()\n"
        "shared = torch.ones(1000).share_memory_()  # a segment in /dev/shm and torch's manager of it\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        "reaper.watch([child.pid])\n"
        "ours, theirs = multiprocessing.Pipe()\n"
        "forked = multiprocessing.get_context('fork').Process(target=like_the_dht, args=(theirs,))\n"
        "forked.start()\n"
        f"if {ns!r}:\n"
        f"    subprocess.run(['ip', 'netns', 'add', {ns!r}], check=True)\n"
        f"    reaper.watch_namespaces([{ns!r}])\n"
        "print(reaper.proc.pid, child.pid, forked.pid, ours.recv(), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    pids = list(map(int, parent.stdout.readline().split()))
    tree = [psutil.Process(pid) for pid in pids]  # the reaper, a watched child, a forked one and its own child
    try:
        assert not ns or namespaces(ns) == [ns]
        segments = f"torch_{parent.pid}_*"
        assert list(Path("/dev/shm").glob(segments)), "the parent made no shared memory: the test tests nothing"
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(tree) and not (ns and namespaces(ns)), "the reaper's work", timeout=5)
        wait_until(lambda: not list(Path("/dev/shm").glob(segments)), "the parent's shared memory removed", timeout=5)
    finally:
        for p in alive(tree):
            p.kill()
        if ns:
            remove_namespace(ns)


def test_shared_memory_that_dead_processes_left_is_removed_and_nothing_else(tmp_path):
    """At start a peer removes the segments processes that died with torch's shared-memory manager left (every
    SIGKILLed peer's before the reaper spared the manager: 14 GB on the development machine): named for a process
    that no longer runs, untouched for a while, and neither mapped nor open anywhere. A segment still mapped or
    open, one whose process runs, a fresh one (maybe on its way between processes), and any other file stay."""
    if os.stat("/proc/self/ns/pid").st_ino != INITIAL_PID_NAMESPACE:
        why = "not in the host's pid namespace: the sweep does nothing there (by design)"
        if os.environ.get("CI"):
            pytest.fail(f"this test must run in CI: {why}")
        pytest.skip(why)
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead, alive_pid = finished.pid, os.getpid()
    names = {"orphan": f"torch_{dead}_1_0", "mapped": f"torch_{dead}_2_0", "open": f"torch_{dead}_3_0",
             "running": f"torch_{alive_pid}_4_0", "other": f"other_{dead}_5_0"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x" * 8192)
    with open(tmp_path / names["mapped"], "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    held = open(tmp_path / names["open"], "rb")
    try:
        assert remove_orphaned_segments(str(tmp_path)) == (0, 0)  # all fresh (min_age: 60 s)
        count, freed = remove_orphaned_segments(str(tmp_path), min_age=0)
    finally:
        mapped.close()
        held.close()
    assert count == 1 and freed >= 8192, (count, freed)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "orphan")
    assert remove_orphaned_segments(str(tmp_path / "absent")) == (0, 0)  # no /dev/shm (macOS)


# --- the lifecycle matrix: {bootstrap, peer} x {SIGINT, SIGTERM, SIGKILL} x the phase the signal meets
#
# Each case records the process tree by pid (with start times) before the signal, then checks the exit code,
# the time to exit and that no process of the tree is left. The cases of one phase run side by side, in one
# test, so that the whole matrix costs a few swarm start-ups. SIGINT and SIGTERM: a clean leave, exit 0 (a
# second signal: 130 at once); SIGKILL: the process dies at once and its reaper takes its children along.

PEER_GRACE = 20.0  # run.shutdown_grace of the matrix's peers: every clean leave must end well within it
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


def still_running(processes: dict[int, float]) -> list[str]:
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

    def __init__(self, name: str, proc: subprocess.Popen, sig: signal.Signals, bound: float, group: bool = False,
                 log: Path | None = None):
        self.name, self.proc, self.sig, self.bound = name, proc, sig, bound
        self.group = group
        """Signal the whole process group (the children too), as a terminal's Ctrl+C or systemd's stop do."""
        self.log = log
        """The process's log: its end is shown when it exits too late (where did the time go?)."""
        self.processes: dict[int, float] = {}
        self.sent = self.exited = 0.0
        self.waiter = threading.Thread(target=self._wait, daemon=True)

    def _wait(self) -> None:
        """The moment of the exit, taken as it happens: cases are checked one after another, and a check that
        started only when the previous case's tree was gone would count that wait as this case's."""
        self.proc.wait()
        self.exited = time.monotonic()

    def signal(self) -> None:
        self.processes = tree(self.proc)
        assert len(self.processes) > 1, f"{self.name}: no children to check (exited already?)"
        self.sent = time.monotonic()
        if self.group:
            os.killpg(self.proc.pid, self.sig)
        else:
            self.proc.send_signal(self.sig)
        self.waiter.start()

    def check(self, expected_code: int) -> float:
        """Waits for the exit and for every process of the tree to be gone; the seconds it took."""
        self.waiter.join(timeout=max(0.0, self.sent + self.bound + 30 - time.monotonic()))
        assert not self.waiter.is_alive(), f"{self.name}: still running {self.bound + 30:g}s after {self.sig.name}"
        code, took = self.proc.returncode, self.exited - self.sent
        assert code == expected_code, f"{self.name}: {self.sig.name} gave exit code {code}, not {expected_code}"
        tail = self.log.read_text()[-2000:] if self.log is not None and self.log.exists() else ""
        late = f"{self.name}: {self.sig.name} took {took:.1f}s to exit (bound {self.bound:g}s)"
        assert took < self.bound, f"{late}\n{tail}"
        deadline = time.monotonic() + 15
        while still_running(self.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = still_running(self.processes)
        assert not left, f"{self.name}: left behind after {self.sig.name}: {left}"
        assert not segments(self.processes), f"{self.name}: shared memory left after {self.sig.name}"
        return took


def _checkpoint_loads(workdir: Path, name: str, epoch: int) -> None:
    from diloco_peer.config import load_config
    from diloco_peer.state.checkpoint import load_file

    path = workdir / "checkpoints" / name / f"epoch-{epoch:06d}.pt"
    assert path.is_file(), f"{name}: no checkpoint of epoch {epoch}: {sorted(path.parent.glob('*'))}"
    load_file(path, load_config(None, [*FAST, f"run.run_id=life-{name}"]).fingerprint())


@pytest.mark.slow
def test_stop_while_joining_a_bootstrap_nobody_answers_and_bootstrap_nodes(local_swarm):
    """Joining (every bootstrap unreachable, retrying) and bootstrap nodes: each signal, side by side."""
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmPeMbo7XxwUThbbyhqGcsnaU5xpsvSDszHuGqvDCd8P4E"  # discard port: refused
    cases = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        peer = local_swarm.start_peer(f"joining-{sig.name}", "swarm.join_timeout=120",
                                      f"run.shutdown_grace={PEER_GRACE}", bootstraps=[nobody])
        boot = local_swarm.spawn(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0"], f"boot-{sig.name}.log")
        cases += [Case(f"joining peer ({sig.name})", peer, sig, bound=10,
                       log=local_swarm.workdir / f"joining-{sig.name}.log"),
                  Case(f"bootstrap ({sig.name})", boot, sig, bound=10,
                       log=local_swarm.workdir / f"boot-{sig.name}.log")]
    for case in cases[1::2]:
        wait_for_line(local_swarm.workdir / f"boot-{case.sig.name}.log", "diloco-peer join ", case.proc)
    for case in cases[0::2]:
        wait_for_line(local_swarm.workdir / f"joining-{case.sig.name}.log", "", case.proc)
    time.sleep(3)  # the peers are in their join retries now
    for case in cases:
        case.signal()
    for case in cases:
        case.check(KILLED if case.sig == signal.SIGKILL else 0)


@pytest.mark.slow
def test_stop_while_training_leaves_a_checkpoint_and_nothing_behind(local_swarm):
    """Peers in their inner steps (each alone in a run of its own), one per signal, and one SIGTERM sent to the
    peer's whole process group (systemd's stop, ``kill -- -PGID``): its children must not pass it on to the
    peer as a second signal (they did, through the event loop's wakeup fd: exit 130, no clean leave). (A second
    signal: see the unresponsive-DHT case below, where leaving lasts long enough to send one.)"""
    local_swarm.start_bootstrap()
    sigs = {f"train-{sig.name}": sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)}
    sigs["train-group-SIGTERM"] = signal.SIGTERM
    procs = {name: local_swarm.start_peer(
        name, f"run.run_id=life-{name}", "averaging.min_peers=1", "outer.inner_steps=400", "data.shard=0",
        f"run.shutdown_grace={PEER_GRACE}", f"checkpoint.dir={json.dumps(str(local_swarm.workdir / 'checkpoints'))}",
        "checkpoint.every_rounds=1") for name in sigs}
    for name in sigs:  # inner steps of round 1 under way
        wait_until(lambda: any(e["event"] == "progress" for e in local_swarm.events(name)), f"{name} training", 120)
    cases = {name: Case(name, proc, sigs[name], bound=PEER_GRACE, group="group" in name,
                         log=local_swarm.workdir / f"{name}.log")
             for name, proc in procs.items()}
    for case in cases.values():
        case.signal()
    took = {name: case.check(KILLED if case.sig == signal.SIGKILL else 0) for name, case in cases.items()}
    # the group's signal is the peer's alone (its children have groups of their own): p2pd used to get it too and
    # close at once, and the peer then waited 5 s to withdraw its record and 3 s for its DHT process (9.5 s against
    # 1.5 s for a SIGTERM to the peer alone; now 2.0 and 1.9). Compared in the same run: a loaded machine slows both
    assert took["train-group-SIGTERM"] < took["train-SIGTERM"] + 3, took
    for name in ("train-SIGINT", "train-SIGTERM", "train-group-SIGTERM"):  # a clean leave saves its round boundary
        stop = [e for e in local_swarm.events(name) if e["event"] == "stop"]
        assert stop and stop[0]["reason"] == "signal", stop
        _checkpoint_loads(local_swarm.workdir, name, 0)
        assert "second SIGTERM" not in (local_swarm.workdir / f"{name}.log").read_text()


@pytest.mark.slow
def test_stop_in_an_all_reduce_and_in_a_state_sync(local_swarm):
    """Two pairs of peers (a run each): one peer of each pair is signalled while its round's exchange is in flight
    (after its ``averaging`` event: matchmaking or all-reduce); then a newcomer joins each run and is signalled in
    the middle of its state download (the remaining partner serves slowly: fault ``slow_serve``). One run gets
    the signals that ask to leave (SIGTERM, then SIGINT: one handler for both, and SIGHUP), the other SIGKILL.
    The partners train on throughout."""
    local_swarm.start_bootstrap()
    common = [f"run.shutdown_grace={PEER_GRACE}", "outer.inner_steps=20", "averaging.matchmaking_time=3.0"]
    runs = {"leave": (signal.SIGTERM, signal.SIGINT), "kill": (signal.SIGKILL, signal.SIGKILL)}
    victims, partners = {}, {}
    for run in runs:
        victims[run] = local_swarm.start_peer(f"ar-{run}", f"run.run_id=life-{run}", *common)
        partners[run] = local_swarm.start_peer(f"partner-{run}", f"run.run_id=life-{run}", *common,
                                               env={FAULT_ENV: "slow_serve:6"})
    cases = []
    for run, (sig, _) in runs.items():
        name = f"ar-{run}"
        wait_until(lambda: any(e["event"] == "averaging" for e in local_swarm.events(name)), f"{name} averaging", 150)
        cases.append(Case(f"{name} in an all-reduce", victims[run], sig, bound=PEER_GRACE,
                          log=local_swarm.workdir / f"{name}.log"))
        cases[-1].signal()
    for case in cases:
        case.check(KILLED if case.sig == signal.SIGKILL else 0)

    # a newcomer has something to download only once its partner ended a round: the partner's first round can
    # outlast the victim's death by seconds (a member gone mid-round), and a newcomer that came meanwhile found the
    # partner at epoch 0 too, joined its round and never synced (a fresh clone's suite)
    for run in runs:
        wait_until(lambda: any(e["event"] == "round" for e in local_swarm.events(f"partner-{run}")),
                   f"partner-{run}'s round", 120)
    newcomers = {run: local_swarm.start_peer(f"sync-{run}", f"run.run_id=life-{run}", *common) for run in runs}
    cases = []
    for run, proc in newcomers.items():
        log = local_swarm.workdir / f"sync-{run}.log"
        wait_until(lambda: log.exists() and "state sync: " in log.read_text(), f"sync-{run} downloading", 120)
        cases.append(Case(f"sync-{run} in a state sync", proc, runs[run][1], bound=PEER_GRACE, log=log))
        cases[-1].signal()
    for case in cases:
        took = case.check(KILLED if case.sig == signal.SIGKILL else 0)
        assert took < 6 or case.sig == signal.SIGKILL, f"{case.name}: the download in flight held the leave {took:.1f}s"
    for run, partner in partners.items():
        assert partner.poll() is None, f"partner-{run} died: {partner.returncode}"


def dht_process(proc: subprocess.Popen) -> psutil.Process:
    """The peer's DHT process: its first child forked from it (hivemind starts the DHT first, the averager later)."""
    peer = psutil.Process(proc.pid)
    forked = [c for c in peer.children() if c.cmdline() == peer.cmdline()]
    return min(forked, key=lambda c: c.create_time())


@pytest.mark.slow
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
        cases[name] = Case(name, proc, plans[name][0], bound=grace, log=local_swarm.workdir / f"{name}.log")
        cases[name].processes = tree(proc)
        dht_process(proc).suspend()
        cases[name].signal()
    time.sleep(2)  # well into the withdraw, which waits on the stopped DHT
    cases["hung-twice"].proc.send_signal(signal.SIGINT)
    for name, case in cases.items():
        case.check({"hung-SIGKILL": KILLED, "hung-twice": 130}.get(name, 0))
        if name == "hung-SIGTERM":
            log = (local_swarm.workdir / f"{name}.log").read_text()
            assert "could not withdraw our progress record" in log, log[-2000:]

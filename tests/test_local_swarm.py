"""The swarm harness (``tools/local_swarm.py``) with stand-in programs: what it runs, the address it reads, what it
reaps. No DHT, no p2pd: the real swarms are the other tests'."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from diloco_peer.swarm.addresses import SwarmError
from diloco_peer.tools.local_swarm import LocalSwarm, in_cgroup

ECHO = [sys.executable, "-c", "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get('MARK')]))"]
"""Stands for ``diloco-peer``: prints its arguments and ``$MARK``."""
BOOTSTRAP = [sys.executable, "-c", """
import subprocess, sys, time
subprocess.Popen(["sleep", "600"])  # a child in its group, as a DHT process and p2pd
print("diloco-peer join /ip4/127.0.0.1/tcp/1/p2p/QmFake", flush=True)
time.sleep(600)
"""]
"""Stands for a bootstrap node: prints its join line, then runs (with a child) until it is stopped."""


def printed(swarm: LocalSwarm, name: str, proc) -> list:
    assert proc.wait(timeout=30) == 0
    return json.loads(swarm.log(name).read_text().splitlines()[-1])


def test_a_peer_runs_with_the_swarms_sets_then_its_log_dir_then_its_own(tmp_path, monkeypatch):
    # a relative workdir (bench/unequal.py's default) is the same directory for every process: each runs in it, and
    # a relative log_dir had put their event logs in a copy of the path below it, where nobody read them
    monkeypatch.chdir(tmp_path.parent)
    with LocalSwarm(Path(tmp_path.name), sets=["a=1", "b=2"], env={"MARK": "swarm"},
                    wrap=["env", "WRAPPED=1"]) as swarm:
        swarm.address = "/ip4/127.0.0.1/tcp/1/p2p/QmBoot"
        proc = swarm.start_peer("p", "b=3", program=ECHO, args=["--config", "x"], env={"MARK": "peer"})
        argv, mark = printed(swarm, "p", proc)
    assert argv == ["join", swarm.address, "--name", "p", "--config", "x", "--set", "a=1", "--set", "b=2",
                    "--set", f"run.log_dir={json.dumps(str(tmp_path))}", "--set", "b=3"]
    assert mark == "peer" and swarm.peers == {"p": proc}


def test_the_bootstrap_address_is_read_from_its_join_line_and_its_whole_group_is_reaped(tmp_path):
    swarm = LocalSwarm(tmp_path, bootstrap_args=["--report-every", "2"], program=BOOTSTRAP)
    try:
        address = swarm.start_bootstrap("--run-id", "r", listen="/ip4/127.0.0.1/tcp/0")
        assert address == swarm.address == "/ip4/127.0.0.1/tcp/1/p2p/QmFake"
        boot = swarm.bootstraps[0]
        child = psutil.Process(boot.pid).children()[0]
    finally:
        swarm.reap(grace=0.5)  # (the child outlives its parent: killed once the parent has exited)
    assert boot.returncode == -signal.SIGTERM  # stopped as a user would, the group killed after it
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    swarm.reap()  # twice: nothing to do


def test_a_workdir_used_before_gives_the_new_bootstraps_address_not_the_old_one(tmp_path):
    """Logs are appended to: a benchmark run again in its workdir had its peers join the address the last run's
    bootstrap printed, and they retried it until their join timeout."""
    (tmp_path / "bootstrap.log").write_text("diloco-peer join /ip4/127.0.0.1/tcp/9/p2p/QmOld\n")
    slow = [sys.executable, "-c", "import time; time.sleep(0.5); "
            "print('diloco-peer join /ip4/127.0.0.1/tcp/1/p2p/QmNew', flush=True); time.sleep(600)"]
    with LocalSwarm(tmp_path, program=slow) as swarm:
        assert swarm.start_bootstrap() == "/ip4/127.0.0.1/tcp/1/p2p/QmNew"


def test_a_bootstrap_that_exits_without_an_address_raises_with_its_log(tmp_path):
    swarm = LocalSwarm(tmp_path, program=[sys.executable, "-c", "print('no such key'); raise SystemExit(2)"])
    with swarm, pytest.raises(SwarmError, match="exited with code 2(.|\n)*no such key"):
        swarm.start_bootstrap()


def test_wait_for_stops_at_a_failed_process_or_the_timeout(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        assert swarm.wait_for("a thing", lambda: 42, timeout=1) == 42
        started = time.monotonic()
        with pytest.raises(SwarmError, match="no nothing within 0.3s"):
            swarm.wait_for("nothing", lambda: None, timeout=0.3, poll=0.05)
        assert time.monotonic() - started < 5
        swarm.spawn_external([sys.executable, "-c", "print('it broke'); raise SystemExit(3)"], "bad.log")
        with pytest.raises(SwarmError, match="exited with 3 while waiting for rounds(.|\n)*it broke"):
            swarm.wait_for("rounds", lambda: None, timeout=30, poll=0.05)


def test_a_process_started_fresh_in_a_cgroup_is_put_there_itself_before_it_runs(tmp_path):
    """A stand-in cgroup directory (the real one needs root): the pid written is the program's own (``exec``), by
    ``in_cgroup`` as a ``wrap`` or by ``cgroup=`` (what is not forked from a zygote starts so). The zygote's way:
    ``test_zygote.py``."""
    for how in ("wrap", "cgroup"):
        group = tmp_path / f"slowpeer-{how}"
        group.mkdir()
        (group / "cgroup.procs").touch()
        with LocalSwarm(tmp_path) as swarm:
            into = {"wrap": in_cgroup(group)} if how == "wrap" else {"cgroup": group}
            proc = swarm.spawn(["x y"], f"slow-{how}.log", program=ECHO, **into)
            assert printed(swarm, f"slow-{how}", proc) == [["x y"], None]
        assert int((group / "cgroup.procs").read_text()) == proc.pid, how


def test_kill_leaves_nothing_running_at_once(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        proc = swarm.spawn_external([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                     "signal.SIG_IGN); print('up', flush=True); time.sleep(600)"], "stubborn.log")
        swarm.wait_for("it to start", lambda: "up" in swarm.log("stubborn").read_text(), timeout=30, poll=0.05)
        swarm.kill()
        assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{proc.pid}/status") or proc.returncode is not None

"""Shared fixtures: real ``diloco-peer`` subprocesses on loopback, reaped whatever happens."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

from diloco_peer.tools.local_swarm import LocalSwarm
from diloco_peer.tools.local_swarm import diloco_command as diloco_cmd  # noqa: F401 (the tests import it from here)
from diloco_peer.tools.zygote import Zygote

# tests are small; several peers share two cores. Rounds of H steps: the tests compare swarms with the simulator
# (which trains H steps a round) and count steps and tokens, and on a loaded machine a round bounded by time fits
# fewer steps in one peer than in another (CI: a swarm ended 3% above its clean run). Rounds bounded by time, the
# default, are tested in-process (test_rounds.py) and by the swarms of test_unequal.py and test_many_peers.py.
FAST = [
    "outer.inner_steps=10", "outer.round_length=steps", "run.threads=1", "averaging.heartbeat=1.0",
    "averaging.matchmaking_time=2.0", "averaging.request_timeout=1.0", "data.max_bytes=1_000_000",
    "inner.batch_size=4", "data.seq_len=64",
]
"""The tests' peers: short rounds and timeouts, a small corpus, and half the default batch of sequences half the
default length: the suite's time is its peers' CPU, much of it training (BENCHMARKS.md, "The test suite's two
lanes")."""


SESSION_ENVIRONMENT = dict(os.environ)
"""The environment the tests started with, the zygote's (whichever test first needs it may have changed ours)."""

# the fuzzers (hypothesis) draw the same examples on every run, so that what fails in CI fails on a laptop too and a
# fuzzer never turns a green run red by chance; a test's own settings (more examples) keep this
settings.register_profile("derandomized", derandomize=True, database=None)
settings.load_profile("derandomized")


def pytest_collection_modifyitems(items):
    """Every test that starts real peers or DHT nodes is ``slow``: ``tests/lanes.py`` runs it in the swarm lane, one
    at a time (unless it is marked ``light`` as well). Those that use these fixtures are marked here; the others that
    start a DHT or p2pd (their own, or a ``diloco-peer`` subprocess's) say so with their own marks."""
    for item in items:
        if {"local_swarm", "dhts", "peers"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def p2pd_pids() -> set[int]:
    """Running libp2p daemons (hivemind's p2pd), to check that nothing is left behind."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"p2pd" in (entry / "cmdline").read_bytes().split(b"\0")[0]:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def orphaned_p2pd_pids() -> set[int]:
    """p2pd daemons whose owner died without them (re-parented to init); others' test swarms may run meanwhile."""
    orphans = set()
    for pid in p2pd_pids():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == "1":
                orphans.add(pid)
        except OSError:
            continue
    return orphans


def wait_for_line(path: Path, prefix: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before printing {prefix!r}:\n"
                                 f"{path.read_text() if path.exists() else ''}")
        time.sleep(0.2)
    raise AssertionError(f"no line starting with {prefix!r} in {path} after {timeout}s")


def forked_client(attacks: str) -> list[str]:
    """A forked client that runs ``attacks`` (``tests/attacker.py``, e.g. "sign_flip:9"), as a peer's ``program``:
    ``local_swarm.start_peer("evil", ..., program=forked_client("sign_flip:9"))``."""
    return [sys.executable, str(Path(__file__).with_name("attacker.py")), attacks, "--"]


def wait_until(condition, what: str, timeout: float = 90.0):
    """Poll ``condition()`` until it returns something truthy (returned); fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        time.sleep(0.2)
    return found


def require_tool(name: str, package: str) -> None:
    """Skip a test whose Debian tool is missing on a developer's machine; in CI (where `make test` installs it)
    a missing tool is a broken setup, so the test fails instead of passing silently."""
    if shutil.which(name) is None:
        message = f"{name} (Debian package {package}) is not installed; `make test` installs it"
        if os.environ.get("CI"):
            pytest.fail(f"{message}, but it is missing in CI")
        pytest.skip(message)


def namespaces_missing() -> str:
    """Why network namespaces and iptables (root) cannot be had here ("": they can)."""
    from diloco_peer.tools import netbed

    return netbed.available() or ("" if netbed.shutil.which("iptables") else "iptables is not installed")


def require_namespaces() -> None:
    """Skip a test that needs network namespaces and iptables (root) off CI, with the reason; fail it in CI."""
    why = namespaces_missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"NAT tests must run in CI: {why}")
        pytest.skip(why)


@pytest.fixture
def dhts():
    """``dhts(n)``: n real DHT nodes on loopback, joined through one more root node; all shut down after."""
    from hivemind.dht import DHT

    started = []

    def make(count: int) -> list:
        root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        started.append(root)
        addrs = [str(a) for a in root.get_visible_maddrs()]
        for _ in range(count):
            started.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addrs))
        return started[1:]

    yield make
    for dht in started:
        dht.shutdown()


@pytest.fixture
def peers():
    """``peers(**kwargs)``: state-sync peers in this process (``helpers.SyncPeer``: a DHT, an averager and an outer
    optimizer each), the first one the others' bootstrap; all closed after."""
    from diloco_peer.config import load_config
    from helpers import SYNC_SETS, SyncPeer

    cfg = load_config(None, SYNC_SETS)
    made = []

    def make(**kwargs):
        peer = SyncPeer(cfg, [str(a) for a in made[0].dht.get_visible_maddrs()] if made else [], **kwargs)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


@pytest.fixture(scope="session")
def zygote():
    """One warm process per pytest process that forks the local swarms' ``diloco-peer`` processes with torch and
    hivemind imported already (``tools/zygote.py``): a peer's start costs a fraction of the CPU it costs fresh."""
    with Zygote.start(env=SESSION_ENVIRONMENT) as warm:
        yield warm


@pytest.fixture
def local_swarm(tmp_path, zygote):
    """A ``LocalSwarm`` in the test's directory: its peers with the ``FAST`` overrides, its bootstrap nodes reporting
    every 2 s, forked by the ``zygote``; every process it started is reaped after the test, whatever happened."""
    with LocalSwarm(tmp_path, sets=FAST, bootstrap_args=["--report-every", "2"], zygote=zygote) as swarm:
        yield swarm

"""A swarm on this machine: a bootstrap node and peers as real ``diloco-peer`` processes, reaped whatever happens.

    with LocalSwarm(Path("runs/try"), sets=["outer.inner_steps=10", "run.threads=1"]) as swarm:
        swarm.start_bootstrap("--report-every", "10")
        a = swarm.start_peer("a", "run.max_rounds=3")
        b = swarm.start_peer("b", "run.max_rounds=3", "outer.inner_steps=20")
        swarm.wait_for("b's 3 rounds", lambda: len(swarm.events("b", "round")) >= 3, timeout=300)
    # here every process it started is gone: the peers, their DHT, averager and p2pd processes (torch's
    # shared-memory managers end on their own moments later; reap(until_gone=True) waits for them too)

What the demo (``demo.py``), the tests (``tests/conftest.py``) and the benchmarks (``bench/``) start their swarms
with. Each process runs exactly what a user types (``diloco-peer bootstrap`` / ``join``), from this Python, in a
session of its own (a terminal's Ctrl+C reaches it only through us; its process group is ours to kill), with its
output in ``workdir/NAME.log`` and, for a peer, its event log in ``workdir/NAME.jsonl`` (``run.log_dir``).

A process can be started inside a network namespace (``netns``: ``netbed.py``'s slow links and home routers),
under a prefix command (``wrap``: ``nice``), in a cpu cgroup (``cgroup``: a slow volunteer) and as another
program that takes ``diloco-peer``'s arguments (``program``: a forked client, ``tests/attacker.py``). What a
caller's peers have in common (the tests' short timeouts, a benchmark's model) it gives once, as ``sets``.

Only operator and test code uses this; a running peer never imports ``tools`` (``tests/test_layering.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..lifecycle.reaper import SHM_MANAGER, kill_trees, stop_in_order
from ..observe.events import read_events
from ..swarm.addresses import SwarmError
from .zygote import Zygote

JOIN_LINE = "diloco-peer join "
"""How a bootstrap node's line to join it begins (``bootstrap_node._announce``): the address follows."""
POLL_SECONDS = 0.2


def diloco_command(*args: str) -> list[str]:
    """``diloco-peer ARGS`` as this Python runs it: the processes use this very install."""
    return [sys.executable, "-m", "diloco_peer", *args]


def in_cgroup(cgroup: str | Path) -> list[str]:
    """A ``wrap`` that starts a process inside the cpu cgroup directory ``cgroup`` (made and limited by the caller,
    e.g. ``/sys/fs/cgroup/cpu/slowpeer`` with ``cpu.cfs_quota_us``): every process it forks stays in the group."""
    return ["sh", "-c", f'echo $$ > "{Path(cgroup) / "cgroup.procs"}" && exec "$@"', "sh"]


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log ("" if there is none): for an error that says a process failed."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class LocalSwarm:
    """Bootstrap nodes and peers as subprocesses on this machine; as a context manager, ``reap`` on exit.

    :param workdir: where each process runs and writes ``NAME.log`` (its output); a peer's ``run.log_dir``
      (``NAME.jsonl``, its event log). A restarted name appends to its log, as the peer to its event log.
    :param sets: ``--set KEY=VALUE`` overrides every peer gets, before its own (e.g. the tests' short timeouts)
    :param bootstrap_args: arguments every bootstrap node gets, before its own (e.g. ``["--report-every", "2"]``)
    :param env: variables added to every process's environment (e.g. a checkout's ``PYTHONPATH``)
    :param wrap: a command every process runs under (e.g. ``["nice", "-n", "5"]``); one given to ``start_peer``
      or ``spawn`` goes inside it
    :param program: what stands for ``diloco-peer`` (default: ``diloco_command()``, this Python's install), e.g. an
      installed console script; one given to ``start_peer`` or ``spawn`` replaces it
    :param zygote: a ``Zygote`` (``zygote.py``) that forks the ``diloco-peer`` processes, each with torch and
      hivemind imported already (in their network namespace, if they have one); those it cannot serve (another
      program than this Python, a ``wrap``, another environment at import time) start as fresh processes
    :param on_spawn: called with every process started, at once (the demo's reaper watches it)
    :param check: called whenever the swarm polls while it waits (a join address, ``wait_for``); it may raise to
      stop the wait (the demo's stop signals: ``demo.Interrupted``)

    The first bootstrap node's address is ``address``, the peers' default bootstrap; ``peers`` maps each peer's
    name to its latest process; ``procs`` holds every process started, in order (a test may add one it started
    itself: it is reaped with the rest).
    """

    def __init__(self, workdir: Path, sets: Sequence[str] = (), bootstrap_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, wrap: Sequence[str] = (), program: Sequence[str] = (),
                 zygote: Zygote | None = None, on_spawn: Callable[[subprocess.Popen], None] | None = None,
                 check: Callable[[], None] | None = None):
        self.workdir = Path(workdir).resolve()  # its processes run in it: a relative log_dir would nest
        self.sets, self.bootstrap_args, self.wrap = list(sets), list(bootstrap_args), list(wrap)
        self.program = list(program) or diloco_command()
        self.env, self.zygote = env or {}, zygote
        self.on_spawn, self.check = on_spawn, check or (lambda: None)
        self.procs: list[subprocess.Popen] = []
        self.bootstraps: list[subprocess.Popen] = []
        self.peers: dict[str, subprocess.Popen] = {}  # name -> its latest process (a restart replaces it)
        self.logs: dict[int, Path] = {}  # pid -> the log it writes to
        self.address = ""

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.reap()

    def spawn_external(self, cmd: list[str], log_name: str, env: dict[str, str] | None = None, netns: str = "",
                       wrap: Sequence[str] = (), cgroup: str | Path = "") -> subprocess.Popen:
        """Start any program (e.g. a real Prometheus, a demo), writing to ``workdir/log_name``, reaped with the swarm.

        :param netns: run it inside this network namespace (``ip netns exec``; root)
        :param wrap: a command to run it under, inside the swarm's ``wrap``
        :param cgroup: run it, and every process it starts, inside this cpu cgroup directory (a slower volunteer:
          ``cpu_quota.py``). Forked from the zygote it enters the group before anything else; a fresh process goes
          through ``in_cgroup``, and pays for its imports at the group's pace (at a fifth of a core, ~30 s)
        """
        where = ["ip", "netns", "exec", netns] if netns else []
        env = {**os.environ, **self.env, **(env or {})}
        forkable = self.zygote is not None and not (self.wrap or wrap) and self.zygote.forks(cmd, env)
        with (self.workdir / log_name).open("a") as log:
            if forkable:
                proc = self.zygote.spawn(cmd, stdout=log, env=env, cwd=self.workdir, netns=netns, cgroup=cgroup)
            else:
                into = in_cgroup(cgroup) if cgroup else []
                proc = subprocess.Popen([*self.wrap, *wrap, *into, *where, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=self.workdir, env=env)
        self.procs.append(proc)
        self.logs[proc.pid] = self.workdir / log_name
        if self.on_spawn:
            self.on_spawn(proc)
        return proc

    def spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None, netns: str = "",
              wrap: Sequence[str] = (), program: Sequence[str] = (), cgroup: str | Path = "") -> subprocess.Popen:
        """Start ``diloco-peer ARGS`` as it is (no ``sets``), writing to ``workdir/log_name``.

        :param program: what stands for ``diloco-peer`` instead of the swarm's ``program``, e.g. a forked client
          ``[python, "tests/attacker.py", "sign_flip:9", "--"]``
        """
        return self.spawn_external([*(program or self.program), *args], log_name, env, netns, wrap, cgroup)

    def start_bootstrap(self, *extra: str, listen: str = "/ip4/127.0.0.1/tcp/0", netns: str = "",
                        log_name: str = "bootstrap.log", timeout: float = 60.0) -> str:
        """Start ``diloco-peer bootstrap`` and return the address it prints to join it (the first one started
        becomes ``address``); ``SwarmError`` if it exits or prints none within ``timeout`` seconds.

        :param extra: its arguments after ``bootstrap_args`` (e.g. ``"--run-id", "bench"``)
        :param listen: its multiaddress; inside a namespace, an address of that namespace
        """
        log, deadline = self.workdir / log_name, time.monotonic() + timeout
        earlier = log.stat().st_size if log.exists() else 0  # a log is appended to: a workdir used before has one
        proc = self.spawn(["bootstrap", "--listen", listen, *self.bootstrap_args, *extra], log_name, netns=netns)
        self.bootstraps.append(proc)
        while time.monotonic() < deadline:
            self.check()
            with log.open("rb") as f:
                f.seek(earlier)
                lines = f.read().decode(errors="replace").splitlines()
            address = next((line.split()[2] for line in lines if line.startswith(JOIN_LINE)), "")
            if address:
                self.address = self.address or address
                return address
            if proc.poll() is not None:
                raise SwarmError(f"the bootstrap node exited with code {proc.returncode} before printing its address; "
                                 f"{log}:\n{tail(log)}")
            time.sleep(POLL_SECONDS)
        raise SwarmError(f"the bootstrap node printed no join address within {timeout:g}s; {log}:\n{tail(log)}")

    def start_peer(self, name: str, *sets: str, env: dict[str, str] | None = None, netns: str = "",
                   wrap: Sequence[str] = (), program: Sequence[str] = (), bootstraps: Sequence[str] = (),
                   args: Sequence[str] = (), cgroup: str | Path = "") -> subprocess.Popen:
        """Start ``diloco-peer join`` as peer ``name``, with the swarm's ``sets``, then ``run.log_dir=workdir``,
        then ``sets`` (a later override wins).

        :param env: variables for this peer only (e.g. the fault-injection variable of ``config/faults.py``)
        :param netns: run it inside this network namespace; its ``swarm.host_maddrs`` are the caller's to set
        :param wrap: a command to run it under (e.g. ``["nice", "-n", "5"]``)
        :param cgroup: run it inside this cpu cgroup directory: a slower volunteer (see ``spawn_external``)
        :param program: what stands for ``diloco-peer`` (see ``spawn``)
        :param bootstraps: the addresses it joins through (default: ``address``)
        :param args: more arguments of ``join`` (e.g. ``["--config", "llama-150m"]``)
        """
        cmd = ["join", *(bootstraps or [self.address]), "--name", name, *args]
        for item in [*self.sets, f"run.log_dir={json.dumps(str(self.workdir))}", *sets]:
            cmd += ["--set", item]
        self.peers[name] = self.spawn(cmd, f"{name}.log", env, netns, wrap, program, cgroup)
        return self.peers[name]

    def log(self, name: str) -> Path:
        """Process ``name``'s output (``NAME.log``)."""
        return self.workdir / f"{name}.log"

    def events(self, name: str, kind: str | None = None) -> list[dict]:
        """Peer ``name``'s events so far (only those of ``kind``, e.g. ``"round"``, if given)."""
        return [e for e in read_events(self.workdir / f"{name}.jsonl") if kind is None or e["event"] == kind]

    def wait_for(self, what: str, condition: Callable[[], object], timeout: float, poll: float = 0.5) -> object:
        """Poll ``condition()`` until it returns something truthy, and return that; ``SwarmError`` naming ``what``
        after ``timeout`` seconds, or as soon as one of our processes has exited with an error (its log's tail)."""
        deadline = time.monotonic() + timeout
        while not (found := condition()):
            self.check()
            failed = next((p for p in self.procs if p.poll() not in (None, 0)), None)
            if failed is not None:
                log = self.logs[failed.pid]
                raise SwarmError(f"a process exited with {failed.returncode} while waiting for {what}; {log}:\n"
                                 f"{tail(log)}")
            if time.monotonic() > deadline:
                raise SwarmError(f"no {what} within {timeout:g}s: see the logs in {self.workdir}")
            time.sleep(poll)
        return found

    def reap(self, signum: int = signal.SIGTERM, grace: float = 15.0, peers_first: bool = False,
             until_gone: bool = False) -> None:
        """Stop every process that still runs: ``signum`` to each (to the process, as a user's ``kill PID``), wait
        until they have exited, then SIGKILL what is left of them after ``grace`` seconds and of every process
        under them (DHT, averager, p2pd); then SIGKILL the process group of each that had not been reaped before
        (whatever still runs in it: a child that left the tree). Safe to call twice.

        :param peers_first: stop the other processes first and the bootstrap nodes after them, as a swarm that
          ends cleanly does (a peer's leave uses their DHT); otherwise all at once, which is quicker
        :param until_gone: return only once every process under them has exited by itself, torch's shared-memory
          managers included, which do so seconds after their clients (``lifecycle.reaper.stop_in_order``): the
          demo's way, nothing it started outlives it. Otherwise those managers finish on their own; they are never
          killed (killed, one leaves its clients' segments in /dev/shm)

        (A process reaped earlier keeps its group's id only while something runs in that group: once it is empty,
        the id may be a new process's, so its group is left alone.)
        """
        unreaped = [p for p in self.procs if p.returncode is None]
        others = [p for p in self.procs if p not in self.bootstraps]
        groups = [others, self.bootstraps] if peers_first else [self.procs]
        deadline = time.monotonic() + grace
        try:
            if until_gone:
                stop_in_order(groups, signum, deadline)
            else:
                _stop(groups, signum, deadline)
        finally:
            for proc in unreaped:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()

    def kill(self) -> None:
        """SIGKILL every process and every process under each, now, without waiting (a signal handler may call
        it while the main thread waits for one of them); ``reap`` afterwards collects them."""
        kill_trees(self.procs)


def _stop(groups: list[list[subprocess.Popen]], signum: int, deadline: float) -> None:
    """``signum`` to each group's processes that run, each group waited for in turn (until ``deadline`` at most),
    then SIGKILL to what is left of them and of the processes that were under them."""
    import psutil

    tree = []  # recorded first: a process's children are re-parented once it has exited
    for proc in (p for group in groups for p in group if p.poll() is None):
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(proc.pid)
            tree += [top, *(c for c in top.children(recursive=True) if _name(c) not in (SHM_MANAGER, ""))]
    for group in groups:
        for proc in group:
            if proc.poll() is None:
                proc.send_signal(signum)
        for proc in group:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in tree:
        with contextlib.suppress(psutil.Error):  # (psutil checks that the pid is still that process's)
            process.kill()
    psutil.wait_procs(tree, timeout=5)  # SIGKILLed: gone within moments


def _name(process) -> str:
    """A process's name ("" once it is gone)."""
    import psutil

    try:
        return process.name()
    except psutil.Error:
        return ""

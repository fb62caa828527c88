"""A warm process that forks ``diloco-peer`` commands, each one starting with torch and hivemind imported already.

    with Zygote.start() as zygote:
        with open("a.log", "w") as log:
            proc = zygote.spawn([sys.executable, "-m", "diloco_peer", "join", address, "--name", "a"], stdout=log,
                                env=dict(os.environ), cwd="runs/a")
        proc.wait()  # as much of subprocess.Popen as LocalSwarm and the tests use: poll, wait, send_signal, pid

Every ``diloco-peer`` process imports hivemind and with it torch before it does anything, and its first optimizer
imports torch's compiler (``torch._dynamo``: torch.optim's methods are wrapped to disable it, and the wrapper
imports it on first call). A test suite or a benchmark that starts peers by the hundred on two cores spends much of
its CPU there (BENCHMARKS.md, "Where the suite's time goes"). The zygote pays for those imports once and then forks
one child per command, as Android's zygote and Chromium's do. A command is this Python running a module
(``python -m diloco_peer ARGS``) or a script (``python tests/attacker.py ARGS``), and the child is what that command
would be: its own session (``start_new_session``), the given stdin/stdout/stderr, working directory and
environment, the module or script run as ``__main__`` (``runpy``, as ``python`` runs it) and an ordinary
interpreter exit (threads joined, ``atexit`` handlers, buffers flushed). It is not a fresh interpreter, which is
why only operator and test code uses it; where that shows:

- The environment variables read at import time are the zygote's: ``forks(cmd, env)`` says whether a child's
  environment agrees with the zygote's on all of them (``IMPORT_TIME_PREFIXES``; hivemind's log level as the CLI
  sets it, ``AS_THE_CLI_SETS``); ``LocalSwarm`` starts the others as fresh processes.
- Its standard streams are the zygote's Python objects on the child's file descriptors, made for a file or a pipe:
  a command on a terminal (line-buffered output, a progress bar) must be started as a fresh process.
- Its parent is the zygote, which reaps it and tells the caller its exit status over the connection the child was
  asked for on; ``Forked.returncode`` follows ``Popen``'s convention (``-N``: killed by signal N).
- The process-shared locks hivemind makes as it is imported are the zygote's until the child makes its own, which
  it does before the command runs (``_own_hivemind_locks``).

``multiprocessing``'s forkserver does the forking, but its children run a function as a ``multiprocessing``
child (no ``atexit`` handlers, ``os._exit``; a named child process with a parent process object), not a command.

The zygote calls ``gc.freeze()`` once its imports are done: a child's garbage collector never traverses torch's and
hivemind's import-time objects again, as a fresh process's does in every full collection.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ("uvloop", "hivemind", "torch.optim", "torch._dynamo", "diloco_peer.cli", "diloco_peer.commands",
           "diloco_peer.daemon", "diloco_peer.bootstrap_node", "diloco_peer.swarm.admission",
           "diloco_peer.swarm.run_config", "diloco_peer.config.swarm_wide")
"""What every ``diloco-peer`` command imports, or a peer imports as it starts (``torch._dynamo``: its first
optimizer), imported once in the zygote (by name: it runs the command line, it does not depend on it)."""
IMPORT_TIME_PREFIXES = ("HIVEMIND_", "OMP_", "MKL_", "PYTHON", "TORCH", "CUDA", "LD_")
"""Environment variables read as modules are imported (hivemind's logging and memory sharing, torch's threads and
devices, the interpreter's own): a child must agree with the zygote on every one of them..."""
SET_AT_RUN_TIME = ("TORCHINDUCTOR_CACHE_DIR",)
"""... but these, which torch puts in a process's environment itself (its default cache directory, the first time
something compiles: a test that ran before the child was started had set it in CI)."""
AS_THE_CLI_SETS = {"HIVEMIND_LOGLEVEL": "WARNING"}
"""What ``diloco-peer`` puts in its environment, where unset, before it imports hivemind (``cli._setup_logging``):
the zygote imports hivemind with it, and a child's environment without it counts as one with it. (``-v`` sets
DEBUG instead: a command with it starts fresh.)"""
LOST = 255
"""``Forked.returncode`` when the zygote died before the child: its exit status is unknown."""
MAX_REQUEST = 1 << 20
CLONE_NEWNET = 0x40000000
"""``setns``'s flag for a network namespace (``<sched.h>``)."""
READY = "zygote ready"
"""The line the zygote prints once it has imported ``PRELOAD`` and listens."""


class Forked:
    """A process the zygote forked: as much of ``subprocess.Popen`` as ``LocalSwarm`` and the tests use.

    Signals go to it directly (``pid``); its exit status comes over ``conn`` once the zygote has reaped it.
    """

    stdout = stderr = stdin = None

    def __init__(self, args: list[str], pid: int, conn: socket.socket):
        self.args, self.pid, self._conn = args, pid, conn
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # (as Popen: never a signal to a pid that may be another process's by now)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _collect(self) -> None:
        message = self._conn.recv(64)
        self.returncode = int(message) if message else LOST
        self._conn.close()


class Zygote:
    """The client's side: the zygote process (``start``) and ``spawn``. A context manager; ``close`` ends it (its
    children run on: whoever started them reaps them)."""

    def __init__(self, proc: subprocess.Popen, path: Path, env: Mapping[str, str]):
        self.proc, self.path, self.env = proc, path, dict(env)

    @classmethod
    def start(cls, env: Mapping[str, str] | None = None, timeout: float = 120.0) -> Zygote:
        """Start a zygote with ``env`` (default: ours) and wait until it has imported everything and listens."""
        env = {**AS_THE_CLI_SETS, **(os.environ if env is None else env)}
        path = Path(tempfile.mkdtemp(prefix="diloco-zygote-")) / "socket"
        proc = subprocess.Popen([sys.executable, "-m", "diloco_peer.tools.zygote", str(path)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, text=True)
        zygote = cls(proc, path, env)
        if not select.select([proc.stdout], [], [], timeout)[0] or proc.stdout.readline().strip() != READY:
            proc.kill()
            zygote.close()
            raise RuntimeError(f"the zygote did not start within {timeout:g}s (exit code {proc.returncode})")
        return zygote

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def forks(self, cmd: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``cmd`` is a command the zygote runs (this Python, ``-m MODULE`` or a script) and ``env`` one it
        can give it: the zygote is alive, and the variables read at import time are the same as its own."""
        def at_import(variables: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in {**AS_THE_CLI_SETS, **variables}.items()
                    if k.startswith(IMPORT_TIME_PREFIXES) and k not in SET_AT_RUN_TIME}
        runs = len(cmd) >= 2 and cmd[0] == sys.executable and (cmd[1] == "-m" and len(cmd) >= 3 or
                                                               cmd[1].endswith(".py"))
        verbose = bool({"-v", "--verbose"} & set(cmd))
        return runs and not verbose and self.proc.poll() is None and at_import(env) == at_import(self.env)

    def spawn(self, cmd: Sequence[str], stdout, env: Mapping[str, str], cwd: str | Path, stderr=None,
              netns: str = "", cgroup: str | Path = "") -> Forked:
        """Fork ``cmd`` (see ``forks``) with its output to the file ``stdout``, its errors to ``stderr`` (default:
        the same file), stdin from /dev/null; in the network namespace ``netns`` if one is named (root), as
        ``ip netns exec`` puts a command there; in the cpu cgroup directory ``cgroup`` if one is named, before it
        does anything else (a slower volunteer: ``cpu_quota.py``), as ``local_swarm.in_cgroup`` puts a command
        there."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(str(self.path))
        request = json.dumps({"argv": list(cmd[1:]), "env": dict(env), "cwd": str(cwd), "netns": netns,
                              "cgroup": str(cgroup or "")}).encode()
        with open(os.devnull) as stdin:
            fds = array.array("i", [stdin.fileno(), stdout.fileno(), (stderr or stdout).fileno()])
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            reply = conn.recv(64)
        if not reply:
            conn.close()
            raise RuntimeError(f"the zygote could not fork {' '.join(cmd)} (see its stderr)")
        return Forked(list(cmd), int(reply), conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # its signal to exit
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
            self.path.parent.rmdir()


def serve(path: str) -> dict:
    """The zygote's loop, until its stdin closes: fork a child per request, reap children and tell each one's
    client its exit status. Returns only in a child: its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    clients: dict[int, socket.socket] = {}  # pid -> the connection its exit status goes to
    print(READY, flush=True)
    while True:
        readable = select.select([listener, sys.stdin], [], [], 0.1)[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1024):
            return {}
        if listener in readable:
            conn = listener.accept()[0]
            request, fds = _receive(conn)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *clients.values()):
                    other.close()
                return {**request, "fds": fds}
            for fd in fds:
                os.close(fd)
            clients[pid] = conn
            with contextlib.suppress(OSError):  # (a client that went away: its child runs, and is reaped, anyway)
                conn.send(str(pid).encode())
        _reap(clients)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return json.loads(message), list(fds)


def _reap(clients: dict[int, socket.socket]) -> None:
    while clients:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # (a client that went away)
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            conn.close()


def become(request: dict) -> None:
    """In the forked child: take the command's streams, session, directory and environment, and run it as
    ``python ARGV`` would (``-m MODULE ARGS`` or ``SCRIPT ARGS``); its ``sys.exit`` ends the child."""
    os.setsid()
    if request["cgroup"]:  # first: everything the command does, and every process it starts, runs at its pace
        Path(request["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    if request["netns"]:
        _enter_network_namespace(request["netns"])
    stdin, stdout, stderr = request["fds"]
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in set(request["fds"]):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy

    numpy.random.seed()  # (``random`` reseeds itself in a forked child; numpy's global generator does not)
    _own_hivemind_locks()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # (runpy puts the module's path first, as ``python -m`` does)
        sys.path[0] = os.getcwd()  # (as ``python -m``: the working directory first)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)  # (as ``python SCRIPT``: the script's directory first)
        runpy.run_path(argv[0], run_name="__main__")


def _own_hivemind_locks() -> None:
    """Give this command the process-shared locks a fresh process's import of hivemind would make.

    hivemind makes some ``multiprocessing`` locks (semaphores in shared memory) as its modules are imported: the
    ones every ``MPFuture`` takes as it is made, and its process-wide executor's. A fresh peer shares them only with
    the processes it forks itself (its DHT and averager). Forked from the zygote, every command would share the
    zygote's, and one process SIGKILLed or stopped while it held one would hang every MPFuture of every command
    forked after it, in any swarm (a suite's run: the peers of every test after a SIGKILL test hung in their first
    DHT call, the bootstrap before its first line)."""
    import multiprocessing

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # (hivemind's own: new MPFuture and SharedBytes locks, no backend of the zygote's)
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _enter_network_namespace(name: str) -> None:
    """Move this process into the network namespace ``ip netns add NAME`` made, as ``ip netns exec`` does (not its
    remount of /sys nor its /etc/netns files: what runs here reads neither). A forked child has one thread, so the
    whole process moves, and every process it starts is born there."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name}")
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    for module in PRELOAD:
        __import__(module)
    gc.collect()
    gc.freeze()
    request = serve(argv[0])
    if request:
        become(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

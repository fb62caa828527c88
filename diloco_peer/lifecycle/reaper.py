"""The reaper: when a process dies hard (SIGKILL, OOM killer), the processes it started die with it.

hivemind runs the DHT and the averager in child processes and the libp2p daemon (p2pd) as a grandchild.
A graceful exit stops them all, but a process killed with SIGKILL runs no code at all, and its children
live on as orphans: a p2pd that still holds the port, an averager that still answers matchmaking. (This
is how OpenDiLoCo runs leave orphaned p2pd processes behind.) The same holds one level up: ``demo``
starts a bootstrap node and peers, and with ``--nat`` network namespaces that outlive every process.

So a peer, a bootstrap node and the demo each start this tiny watcher as a separate process and tell it,
through a pipe, what to take down if they die. Its protocol is one line per item:

    PID START_TIME    a process to SIGKILL (its start time, field 22 of /proc/PID/stat: a recycled pid
                      is never hit)
    netns NAME        a network namespace to delete (``ip netns del``), after killing what still runs in it
    done              we stopped everything ourselves: exit without touching anything

The watcher checks twice a second whether its parent (whose pid it gets on its command line: the parent may
die before the watcher has started) is still there; a dead parent's children are re-parented, so
``getppid()`` changes. The pipe alone is no signal: hivemind's forked children inherit its write end, and the
end of the pipe without "done" means only that the parent is going. When the parent is gone, the watcher reads
what is left in the pipe, kills the processes it was told about that still run, deletes the namespaces and
exits. A process that leads a process group of its own is killed with its group: hivemind's DHT process leads
one (``shutdown._forked_child``), and p2pd, which it starts, is in it.

The parent tells the watcher about every child it forks the moment it forks it (an ``os.register_at_fork`` hook):
a peer SIGKILLed while it joins, between two attempts to reach a bootstrap, left a DHT process's p2pd behind
(seen on a loaded machine: the children were only watched once joined). Children of a C library's fork
are seen at the next such fork; the owner may also name them (``watch``). Never torch's shared-memory manager
(``SHM_MANAGER``): when its clients die it unlinks the shared memory they made, and killed with them it left every
segment in /dev/shm, RAM gone until a reboot (measured: BENCHMARKS.md, "Memory per parameter at llama-150m").
It lives in its own session, so a Ctrl+C or a kill of its parent's process group does not take it down before its
job is done.

For a parent that is still alive: ``exit_with_children`` (exit at once, children killed), ``kill_leftovers`` (after
a leave, what did not stop), ``stop_in_order`` (pass a stop signal on and wait, within a deadline, until every
process under the children is gone too), ``kill_trees`` and ``remove_namespace``; at a peer's start,
``remove_orphaned_segments`` (what dead processes left in /dev/shm). This module imports nothing of the package:
anything may use it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


_watching: list[Reaper] = []
"""The reapers of this process that still watch: each is told about every child this process forks."""
_fork_hook_registered = False


def _after_fork_in_parent() -> None:
    for reaper in list(_watching):
        reaper.watch_new_children()


SHM_MANAGER = "torch_shm_manager"
"""torch's shared-memory manager (``file_system`` sharing, hivemind's): one per process that shares tensors, in a
session of its own. It must outlive its clients: it is what removes their segments from /dev/shm when they die."""


def _name(process) -> str:
    import psutil

    try:
        return process.name()
    except psutil.Error:  # gone meanwhile
        return ""


def _children() -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process().children() if _name(child) not in (SHM_MANAGER, "")]


INITIAL_PID_NAMESPACE = 0xEFFFFFFC
"""The inode of the host's pid namespace (the kernel's ``PROC_PID_INIT_INO``): in it, every process is visible."""


def remove_orphaned_segments(directory: str = "/dev/shm", min_age: float = 60.0) -> tuple[int, int]:
    """Remove torch's shared-memory segments in ``directory`` that processes which died with their manager left
    behind (``SHM_MANAGER``: before this was known, every SIGKILLed peer's; or a whole cgroup SIGKILLed): ours
    (this user's), named for a process that no longer runs (``torch_PID_...``), unchanged for ``min_age`` seconds
    (a segment on its way from one process to another is mapped by neither for a moment), and neither mapped nor
    open in any process. Nobody can reach such a segment any more; it holds RAM until a reboot. Only in the host's
    pid namespace: in a container that shares the host's /dev/shm, the processes using a segment may be invisible.
    Returns (segments removed, their bytes)."""
    uid = os.getuid()
    orphans = {}
    now = time.time()
    try:
        if os.stat("/proc/self/ns/pid").st_ino != INITIAL_PID_NAMESPACE:
            return 0, 0
        entries = list(os.scandir(directory))
    except OSError:  # no /dev/shm (macOS) or no /proc: nothing to do
        return 0, 0
    for entry in entries:
        parts = entry.name.split("_")
        if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit() or os.path.exists(f"/proc/{parts[1]}"):
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.st_uid == uid and now - max(stat.st_mtime, stat.st_ctime) >= min_age:
            orphans[entry.path] = stat.st_blocks * 512  # (what it holds, not its size: a segment may be sparse)
    for pid in os.listdir("/proc") if orphans else []:
        if pid.isdigit():
            for path in _shared_files(pid, directory):
                orphans.pop(path, None)
    count = removed = 0
    for path, size in orphans.items():
        try:
            os.unlink(path)
        except OSError:
            continue
        count += 1
        removed += size
    return count, removed


def _shared_files(pid: str, directory: str) -> list[str]:
    """The files of ``directory`` process ``pid`` maps or holds open ([] if it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            used = [line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)") for line in maps
                    if directory in line]
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            used.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    return used


def _descendants(process, managers: bool = False) -> list:
    """Every process under ``process`` (psutil), torch's shared-memory managers left out (``SHM_MANAGER``); with
    ``managers``, those managers only."""
    return [c for c in process.children(recursive=True) if (name := _name(c)) and (name == SHM_MANAGER) == managers]


class Reaper:
    """Handle held by the watched process: ``watch(pids)`` after starting children (those it forks are watched
    at once), ``watch_namespaces(names)`` before making network namespaces, ``close()`` once it has stopped them
    itself."""

    def __init__(self):
        global _fork_hook_registered
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_peer.lifecycle.reaper", str(os.getpid())], stdin=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self._lock = threading.Lock()  # the fork hook runs in whichever thread forked
        self._known = {*_children(), self.proc.pid}  # (children from before are not ours: e.g. a test's)
        _watching.append(self)
        if not _fork_hook_registered:  # (once per process: a hook cannot be unregistered)
            os.register_at_fork(after_in_parent=_after_fork_in_parent)
            _fork_hook_registered = True

    def watch(self, pids: list[int]) -> None:
        """Processes to SIGKILL if we die (those that have exited already are skipped)."""
        with self._lock:
            for pid in pids:
                started = _start_time(pid)
                if started is not None:
                    self.proc.stdin.write(f"{pid} {started}\n")
            self.proc.stdin.flush()

    def watch_new_children(self) -> None:
        """Watch the children started since the last call (called after every fork of this process)."""
        with self._lock:
            new = [pid for pid in _children() if pid not in self._known]
            self._known.update(new)
        if new:
            try:
                self.watch(new)
            except (OSError, ValueError):  # closed (a fork while we stop): nothing is watched any more
                pass

    def watch_namespaces(self, names: list[str]) -> None:
        """Network namespaces to delete if we die; named before they are made, so that none is missed (a name
        that was never made costs nothing)."""
        for name in names:
            self.proc.stdin.write(f"netns {name}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """What we watched is stopped: the watcher can go."""
        if self in _watching:
            _watching.remove(self)
        try:
            self.proc.stdin.write("done\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def exit_with_children(code: int) -> None:
    """Exit at once, but take our children (DHT and averager processes, p2pd) along: never leave orphans."""
    import psutil  # here, not at the top: the watcher process itself starts with as few imports as it can

    for child in _descendants(psutil.Process()):  # (torch's shared-memory manager cleans up after us, then exits)
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(code)


def _running(procs) -> list:
    """Those of ``procs`` (psutil processes) that still run; a zombie has finished."""
    import psutil

    def runs(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return [p for p in procs if runs(p)]


def _trees(procs: list[subprocess.Popen], managers: bool = False) -> list:
    """Those of ``procs`` that still run and every process under each, as psutil processes, the parents first
    (``managers``: torch's shared-memory managers under them instead, see ``SHM_MANAGER``)."""
    import psutil

    found = []
    for proc in procs:
        try:
            top = psutil.Process(proc.pid)
            if proc.poll() is None:
                found += _descendants(top, managers=True) if managers else [top, *_descendants(top)]
        except psutil.Error:
            continue
    return found


def kill_trees(procs: list[subprocess.Popen]) -> None:
    """SIGKILL those of ``procs`` that still run and every process under each (DHT, averager, p2pd, reaper).
    It does not wait for them: a signal handler may call it while the main thread waits for one of them."""
    import psutil

    for p in _trees(procs):  # the parents first: once gone, they start no new children
        try:
            p.kill()
        except psutil.Error:
            pass


def new_children(before: set[int], spare: int) -> list:
    """The processes under this one (psutil processes) that were not there in ``before``: those we started, but
    ``spare`` (the watcher) and torch's shared-memory manager (shared by the whole process, it exits by itself)."""
    import psutil

    return [c for c in _descendants(psutil.Process()) if c.pid not in before and c.pid != spare]


def kill_leftovers(procs: list) -> list[str]:
    """SIGKILL those of ``procs`` (psutil processes) that still run: children that did not stop when told (after a
    leave, before the watcher is told "done"). "PID NAME" of each one killed."""
    import psutil

    killed = []
    for p in _running(procs):
        try:
            killed.append(f"{p.pid} {p.name()}")
            p.kill()
        except psutil.Error:
            pass
    return killed


def stop_in_order(groups: list[list[subprocess.Popen]], signum: int, deadline: float) -> None:
    """Stop ``groups`` of our child processes one after the other: send ``signum`` to those of a group that still
    run, wait until they have exited, then go on to the next group; then wait until every process under them
    (DHT, averager, p2pd, reaper: recorded first, as they can outlive their parent by a moment) is gone too.
    At ``deadline`` (monotonic seconds) SIGKILL what is left, but torch's shared-memory managers, which exit
    by themselves once their clients are gone. Returns once all of them are gone."""
    import psutil

    procs = [proc for group in groups for proc in group]
    tree = _trees(procs)
    managers = _trees(procs, managers=True)  # waited for, never killed
    for group in groups:
        for proc in group:
            if proc.poll() is None:
                proc.send_signal(signum)
        for proc in group:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    while _running(tree + managers) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in _running(tree):
        try:
            p.kill()
        except psutil.Error:
            pass
    for proc in procs:
        proc.wait()
    psutil.wait_procs(_running(tree), timeout=5)  # SIGKILLed: gone within moments (or a zombie, reaped by init)
    psutil.wait_procs(_running(managers), timeout=5)  # their clients gone, they remove the segments and exit


def remove_namespace(name: str) -> None:
    """SIGKILL whatever still runs inside network namespace ``name`` (but torch's shared-memory managers, which
    exit by themselves once their clients are gone: ``SHM_MANAGER``), then delete it (its veths go with it); a
    namespace that does not exist is left as it is."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{int(pid)}/comm") as f:
                if f.read().strip() == SHM_MANAGER[:15]:  # (the kernel keeps 15 characters of a name)
                    continue
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _watch(parent: int, fd: int) -> tuple[dict[int, str], list[str]] | None:
    """Read the protocol while ``parent`` lives, and what is left of it once it is gone; then what to take
    down, or None after "done"."""
    watched = {}
    namespaces = []
    pending = b""
    reading = True
    while True:
        alive = os.getppid() == parent
        if reading and select.select([fd], [], [], 0.5 if alive else 0)[0]:
            chunk = os.read(fd, 4096)
            *lines, pending = (pending + chunk).split(b"\n")
            if b"done" in lines:
                return None
            reading = bool(chunk)  # the end of the pipe without "done": our parent is exiting, watch on
            for kind, value in (line.split() for line in lines if line.strip()):
                if kind == b"netns":
                    namespaces.append(value.decode())
                else:
                    watched[int(kind)] = value.decode()
        elif not alive:
            return watched, namespaces
        elif not reading:
            time.sleep(0.5)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only our parent's end ends us
    found = _watch(int(sys.argv[1]), sys.stdin.fileno())
    if found is None:
        return  # our parent stopped everything itself
    watched, namespaces = found
    for pid, started in watched.items():
        if _start_time(pid) == started:
            try:
                if os.getpgid(pid) == pid:  # it leads a group of its own: the group goes too (the DHT's p2pd)
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for name in reversed(namespaces):
        remove_namespace(name)


if __name__ == "__main__":
    main()

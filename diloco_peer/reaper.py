"""The reaper: when a peer dies hard (SIGKILL, OOM killer), its child processes die with it.

hivemind runs the DHT and the averager in child processes and the libp2p daemon (p2pd) as a grandchild.
A graceful exit stops them all, but a process killed with SIGKILL runs no code at all, and its children
live on as orphans: a p2pd that still holds the port, an averager that still answers matchmaking. (This
is how OpenDiLoCo runs leave orphaned p2pd processes behind.)

So the daemon starts this tiny watcher as a separate process and tells it, through a pipe, the pids of
its children. The watcher reads that pipe and checks twice a second whether its parent is still there
(a dead parent's children are re-parented, so ``getppid()`` changes; the pipe alone is no signal, as
hivemind's forked children inherit its write end). When the daemon is gone, the watcher kills the
children it was told about that still run (checking each pid's start time, so that a recycled pid is
never hit) and exits; after a clean shutdown the daemon says "done" and the watcher just exits. It lives in its own
session, so a Ctrl+C or a kill of the daemon's process group does not take it down before its job is done.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class Reaper:
    """Handle held by the daemon: ``watch(pids)`` after starting children, ``close()`` on a clean exit."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_peer.reaper"], stdin=subprocess.PIPE, text=True, start_new_session=True
        )

    def watch(self, pids: list[int]) -> None:
        for pid in pids:
            started = _start_time(pid)
            if started is not None:
                self.proc.stdin.write(f"{pid} {started}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Our children are stopped: the watcher can go."""
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

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(code)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only our parent's end ends us
    parent, fd = os.getppid(), sys.stdin.fileno()
    watched, pending = {}, b""
    while os.getppid() == parent:
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 4096)
            *lines, pending = (pending + chunk).split(b"\n")
            if not chunk or b"done" in lines:
                return  # the daemon shut its children down itself
            for line in lines:
                pid, started = line.split()
                watched[int(pid)] = started.decode()
    for pid, started in watched.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()

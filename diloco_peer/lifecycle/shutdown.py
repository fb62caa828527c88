"""Stopping a long-lived process (a peer, a bootstrap node): it always ends, and never leaves children behind.

- The first SIGTERM, SIGINT (Ctrl+C) or SIGHUP asks it to leave cleanly: a peer finishes its inner step, writes
  a checkpoint and withdraws from the swarm.
- A second one ends it at once (exit 130), its children (DHT, averager, p2pd) with it.
- A stop that overruns its grace period ends it too (exit 1): the last complete checkpoint stays valid, since
  checkpoints are written to a temporary file and renamed.

Signals sent to the whole process group (Ctrl+C on a terminal, ``kill -- -PGID``, ``timeout``) are for us
alone: we stop our children as we leave, through hivemind's pipes, and kill what is left
(``daemon.PeerDaemon._kill_leftover_children``, the reaper). So a child forked from us (hivemind's DHT and
averager processes) leaves our process group (``_forked_child``), and the libp2p daemon (p2pd) the DHT process
starts is in the child's group. p2pd used to get the group's SIGTERM or SIGINT and close at once: the DHT could
no longer withdraw our record (and waited out its timeout), the averager no longer unregister (a traceback), and
leaving took several times as long (``test_lifecycle.py``; measured: BENCHMARKS.md, "Leaving and installing").
(systemd's ``KillMode=control-group`` signals p2pd all the same.)

A forked child also stops sharing our event loop's signal wakeup fd (it inherits it: its SIGTERM was written into
*our* loop, which took it for a second signal and exited at once) and lets a SIGTERM or SIGHUP sent to its own pid
pass, silently (``pkill`` by name matches it: it has our command line).

The deadline is a daemon thread, not a timer of the event loop: it fires whatever the main thread is stuck in
(a blocking call, the loop closing). It is armed by the first signal and, for a run that ends by itself
(``run.max_rounds``), when leaving starts: leaving is bounded either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

from .reaper import exit_with_children

logger = logging.getLogger("diloco_peer")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


_fork_hook_registered = False


def _forked_child() -> None:
    """In a process forked from one with a ``Shutdown`` installed: a process group of its own, and its signals
    are no longer written to the parent's event loop (see the module docstring). SIGINT stays as hivemind sets
    it (ignored)."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _parents_to_handle)
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # out of the terminal's group, it may still write to it
    except ValueError:  # not the main thread of the main interpreter: nothing of ours was installed here
        pass
    os.setpgid(0, 0)


def _parents_to_handle(signum: int, frame) -> None:
    """A forked child's SIGTERM or SIGHUP: the process that forked it stops it (a handler, not SIG_IGN, so that
    a program the child executes, e.g. p2pd, starts with the default handling)."""


class Shutdown:
    """The stop request of one process, and the guarantee that it ends.

    :param grace: seconds from the stop request (or from ``arm()``) to a forced exit
    :param leaving: what the process does when asked, for the log line (e.g. "leaving after the current
      inner step")
    :param owns_process: this is the process's own run (the CLI), not one run among others (a test): after
      ``finished()``, a signal ends the process at once (the event loop, closing, would otherwise give SIGTERM
      back to the system's default, death by the signal, and the exit code would not say what happened)
    :param on_request: called (in the event loop) when the first stop request arrives, e.g. to wake a loop
    """

    def __init__(self, grace: float, leaving: str, owns_process: bool = False,
                 on_request: Callable[[], None] | None = None):
        self.grace = grace
        self.leaving = leaving
        self.owns_process = owns_process
        self.on_request = on_request
        self.requested = False
        """True once a signal asked us to stop (the loops check it)."""
        self._armed = False
        self._finished = threading.Event()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle SIGTERM, SIGINT and SIGHUP on ``loop`` (call it from the loop's thread)."""
        global _fork_hook_registered
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.request, sig.name)
        if not _fork_hook_registered:  # (once per process: a hook cannot be unregistered)
            os.register_at_fork(after_in_child=_forked_child)
            _fork_hook_registered = True

    def request(self, signame: str) -> None:
        """A stop was asked for (by ``signame``): the first time, leave cleanly; the second, exit at once."""
        if self.requested:
            logger.warning(f"second {signame}: exiting now")
            exit_with_children(130)
        self.requested = True
        logger.info(f"{signame}: {self.leaving}, within {self.grace:g}s (press Ctrl+C again to exit at once)")
        self.arm()
        if self.on_request is not None:
            self.on_request()

    def arm(self) -> None:
        """From now on, the process ends within ``grace`` seconds, whatever it is doing."""
        if self._armed:
            return
        self._armed = True
        threading.Thread(target=self._deadline, name="shutdown-deadline", daemon=True).start()

    def finished(self) -> None:
        """Everything is stopped: the deadline is off. Call it from the event loop's thread, last."""
        self._finished.set()
        if self.owns_process:  # only the interpreter's own teardown is left: a signal now just ends it
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, self._exit_now)

    def _exit_now(self, signum: int, frame) -> None:
        exit_with_children(130 if self.requested else 0)

    def _deadline(self) -> None:
        if not self._finished.wait(self.grace):
            logger.error(f"could not leave cleanly within {self.grace:g}s (run.shutdown_grace): exiting now "
                         f"(the last complete checkpoint stays valid)")
            exit_with_children(1)

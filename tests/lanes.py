"""`make test`: the suite as two pytest processes side by side, so that two cores are both busy.

Every test that starts real peers, DHT nodes or p2pd (in its own process, or as ``diloco-peer`` subprocesses) is
marked ``slow``: ``conftest.py`` marks those that use the ``local_swarm``, ``dhts`` or ``peers`` fixtures, the
others carry the mark themselves. Then:

- The **swarm lane** runs the ``slow`` tests that are not ``light``, one at a time: swarms of real peers, and any
  test that bounds the time something takes (a gate that must open at once when told, a state sync given up
  within its timeout, a member dropped within seconds). Another swarm's load breaks such bounds: a slow test
  with a swarm of its own in the other lane made this lane's tests flaky (a 4-peer round split into two groups,
  a leave over its bound).
- The **unit lane** runs everything else beside it, on one torch thread, so that it takes one core at most, with
  the ``light`` tests among them. ``light`` means: it starts a DHT or p2pd, but no wall-clock bound that another
  test's load could break: what it asserts is a record refused, a line of output, a state downloaded or refused,
  a process gone within a generous deadline; and it starts at most a bootstrap node and one peer, or DHT nodes
  and averagers in the test's own process. Such a test runs with the tests' short protocol timeouts (state sync
  gives a donor seconds): it passed beside the swarm lane at several times its time alone; one that ever fails
  there for lack of time loses its ``light`` mark.

The suite is CPU-bound: a test moved from one lane to the other lengthens that lane by about what it shortens
this one, so the lanes are arranged for bounds that hold, and the swarm lane, the longer one, decides the suite's
time. The unit lane runs at a lower CPU priority (``UNIT_NICENESS``): the swarm lane alone wants more than one
core at times (a dozen peers, a demo), and left to share the cores evenly it waited on the unit lane, then ran on
alone with a core idle once the unit lane was done. Niced, the unit lane takes what the swarm lane leaves, the
swarm lane's bounds see less load, and both end closer together. What each arrangement measured: BENCHMARKS.md,
"The test suite's two lanes".

The swarm lane's output streams live; the unit lane's is written to a log and printed after it. The exit status
is the worse of the two. Extra arguments go to both lanes (e.g. ``-x``). ``pytest`` alone still runs the whole
suite in one process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(extra: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    # every test of 5 s or more, with its setup (the suite's time is the swarm lane's: what to look at first)
    pytest = [sys.executable, "-m", "pytest", "-q", "--durations=0", "--durations-min=5", *extra]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as unit_log:
        units = subprocess.Popen(["nice", "-n", str(UNIT_NICENESS), *pytest, "-m", "not slow or light",
                                  "-p", "no:cacheprovider"], cwd=root,
                                 stdout=unit_log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        _lower_session_priority(units.pid)
        try:
            swarm_rc = subprocess.call([*pytest, "-m", "slow and not light"], cwd=root)
            unit_rc = units.wait()
        finally:
            if units.poll() is None:
                units.terminate()
                units.wait()
        unit_log.seek(0)
        print(f"\n==== unit lane (ran beside the swarm lane) ====\n{unit_log.read()}", flush=True)
    print(f"swarm lane exit {swarm_rc}, unit lane exit {unit_rc}; {time.monotonic() - started:.0f} s in all")
    if NO_TESTS in (swarm_rc, unit_rc) and {swarm_rc, unit_rc} != {NO_TESTS}:  # e.g. ``-k`` matched one lane only
        return max(rc for rc in (swarm_rc, unit_rc) if rc != NO_TESTS)
    return max(swarm_rc, unit_rc)


def _lower_session_priority(pid: int) -> None:
    """Where the kernel groups processes by session for the scheduler (``sched_autogroup``, on in this machine's
    kernel), ``nice`` weighs a process only against its own session, and each swarm peer runs in a session of its
    own: the unit lane, in a session of its own too, gets its whole session niced instead."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(UNIT_NICENESS))


UNIT_NICENESS = 5
"""The unit lane's ``nice``: the scheduler weighs a session at 5 a third of one at 0 when the cores are busy, and
gives it all of an idle core. At 10 (a tenth) the unit lane's own time-bound tests starved while a dozen peers
trained beside them (3 failures in a run: BENCHMARKS.md, "The test suite's two lanes")."""

NO_TESTS = 5
"""pytest's exit status when it collected no test."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

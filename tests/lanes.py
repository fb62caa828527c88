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
time. What each arrangement measured: BENCHMARKS.md, "The test suite's two lanes".

The swarm lane's output streams live; the unit lane's is written to a log and printed after it. The exit status
is the worse of the two. Extra arguments go to both lanes (e.g. ``-x``). ``pytest`` alone still runs the whole
suite in one process.
"""

from __future__ import annotations

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
        units = subprocess.Popen([*pytest, "-m", "not slow or light", "-p", "no:cacheprovider"], cwd=root,
                                 stdout=unit_log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
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


NO_TESTS = 5
"""pytest's exit status when it collected no test."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`make test`: the suite as two pytest processes side by side, so that two cores are both busy.

- The **swarm lane** runs the tests marked ``slow`` (real multi-process swarms and DHTs; ``conftest.py`` marks
  every test that uses ``local_swarm`` or ``dhts``) one at a time, as before: their timing bounds assume that no
  other swarm shares the machine.
- The **unit lane** runs everything else beside it, on one torch thread, so that it takes one core at most, and
  the slow tests marked ``light``: at most a bootstrap node and one peer, or DHT nodes and averagers in the
  test's own process, and no bound that the other lane's load could break. No swarm of peers, no demo.

Slow tests with swarms of their own in the unit lane made the swarm lane's tests flaky (2026-11-26, a fresh-clone
run with four more there: a 4-peer NAT round split into two groups of two, and leaves took 4.4 s against a 4 s
bound) and saved little (1509 s for the whole ``.ci/run`` against 1534 s without them): the suite is CPU-bound.
With 41 tests in the swarm lane: 1516 s for the whole ``.ci/run``, pytest 1396 s (1770 s and 1642 s in one
process the day before). With 36 (the bad-sender test's five, three averagers in the test's own process, moved
here; 2026-11-26 afternoon, with the faster install of the Makefile): 1464 s in all, pytest 1375 s, the swarm lane
1372 s against 1366 s with 41 in the same afternoon's run: on this CPU-bound machine the move did not shorten it,
the install saved ~60 s.

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

"""A member that dies (or freezes) mid all-reduce, before it sent anybody a part: how long its group's round takes.

    .venv/bin/python bench/dead_member.py                 # blocking and eager, 2 runs each (~4 min)
    .venv/bin/python bench/dead_member.py --modes eager --runs 1
    .venv/bin/python bench/dead_member.py --fault freeze  # the member stops instead, connected and silent

Each run is a bootstrap node and three peers on loopback (tiny-cpu, H=10, one thread each, the default
``averaging.allreduce_timeout`` of 60 s). ``p2`` runs with the fault ``crash_in_allreduce:3``: in its third
all-reduce it opens no stream to anybody, and dies (SIGKILL, with its DHT and p2pd) as soon as a first part
reaches it as a reducer. The two survivors go on for five rounds. Printed per run: the survivors' all-reduce
seconds of the round p2 died in, beside the median of their rounds without a death; and the ratio. hivemind on
its own waits ``sender_timeout`` (half the all-reduce timeout: 30 s) for a sender that never started.

``--fault freeze`` (``freeze_in_allreduce:3``): p2's averager process stops (SIGSTOP) as its third all-reduce
begins, before it sends anything. Its connections stay up and nothing comes through them, as from a member whose
laptop went to sleep or whose link went dead without a reset: nothing tells the others it is gone. Once both
survivors have logged that round, the bench kills p2 (its process group), so that the later rounds are those of two
peers.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm_bench import FAST  # noqa: E402

from diloco_peer.config.faults import FAULT_ENV  # noqa: E402
from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402

DIES_IN = 3
SURVIVORS = ("p0", "p1")


def run_swarm(workdir: Path, mode: str, rounds: int, fault: str = "crash") -> tuple[list[float], list[float]]:
    """One run: (the survivors' all-reduce seconds in the round p2 died in, in their other averaged rounds)."""
    with LocalSwarm(workdir, sets=FAST) as swarm:
        swarm.start_bootstrap()
        sets = [f"outer.overlap={mode}", "averaging.min_peers=3", f"run.max_rounds={rounds}"]
        procs = {name: swarm.start_peer(name, *sets, env={FAULT_ENV: f"{fault}_in_allreduce:{DIES_IN}"}
                                        if name == "p2" else None) for name in (*SURVIVORS, "p2")}
        if fault == "freeze":  # once both survivors are past that round, the frozen peer goes for good
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not all(
                    any(e["event"] == "round" and e["round"] >= DIES_IN for e in swarm.events(name))
                    for name in SURVIVORS):
                time.sleep(0.5)
            os.killpg(procs["p2"].pid, signal.SIGKILL)
        for name in SURVIVORS:
            if procs[name].wait(timeout=300) != 0:
                raise RuntimeError(f"{name} failed: see {workdir / (name + '.log')}")
        died, healthy = [], []
        for name in SURVIVORS:
            for e in swarm.events(name):
                if e["event"] != "round":
                    continue
                if e["outcome"] in ("partial", "failed") and e["group_size"] == 3:
                    died.append(e["allreduce_seconds"])
                elif e["outcome"] == "averaged":
                    healthy.append(e["allreduce_seconds"])
        return died, healthy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="blocking,eager", help="outer.overlap values, comma-separated")
    parser.add_argument("--runs", type=int, default=2, help="runs per mode")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per run")
    parser.add_argument("--fault", choices=("crash", "freeze"), default="crash",
                        help="p2 dies (SIGKILL) or its averager stops (SIGSTOP), connected and silent")
    args = parser.parse_args()
    done = "dies" if args.fault == "crash" else "freezes"
    print(f"3 peers on loopback, tiny-cpu, H=10; p2 {done} in its all-reduce {DIES_IN} having sent nothing")
    print(f"{'mode':9} {'run':>3}  {'round p2 died in (s)':>22}  {'other rounds, median (s)':>24}  {'ratio':>6}")
    for mode in args.modes.split(","):
        for run in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory(prefix="dead-member-") as tmp:
                died, healthy = run_swarm(Path(tmp), mode, args.rounds, args.fault)
            if not died:
                print(f"{mode:9} {run:>3}  no survivor saw p2 die mid-round (see the logs)")
                continue
            base = statistics.median(healthy)
            shown = ", ".join(f"{s:.2f}" for s in died)
            print(f"{mode:9} {run:>3}  {shown:>22}  {base:>24.2f}  {max(died) / base:>6.1f}")


if __name__ == "__main__":
    main()

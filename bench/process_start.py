"""What a peer's start costs, fresh against forked from the zygote (``tools/zygote.py``), side by side.

    .venv/bin/python bench/process_start.py              # 4 one-round peers a run, 2 runs of each (~2 min)
    .venv/bin/python bench/process_start.py --peers 8 --repeats 3

One run: a bootstrap node, then ``--peers`` tiny peers one after the other, each training one round alone
(``averaging.min_peers=1``, ``run.max_rounds=1``, H=10) and leaving: what the suite's swarms and the demo start by
the dozen. A fresh run starts each process as ``python -m diloco_peer``; a forked run starts a zygote first (its
imports are counted) and forks them all from it. Each run is a child process of this one, so its CPU-seconds are
those of everything it waited for (``RUSAGE_CHILDREN``: the peers, their DHT, averager and p2pd processes, the
zygote), and runs alternate (fresh, forked, fresh, ...) so that the machine's drifts hit both. Prints each run and
the ratios forked / fresh of the medians.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETS = ["averaging.min_peers=1", "run.max_rounds=1", "outer.inner_steps=10", "outer.round_length=steps",
        "run.threads=1", "data.max_bytes=1_000_000"]


def one_run(forked: bool, peers: int, workdir: Path) -> None:
    """A bootstrap and ``peers`` one-round peers, started fresh or forked (runs in its own process)."""
    sys.path.insert(0, str(ROOT))
    from diloco_peer.tools.local_swarm import LocalSwarm
    from diloco_peer.tools.zygote import Zygote

    zygote = Zygote.start() if forked else None
    try:
        with LocalSwarm(workdir, sets=SETS, zygote=zygote) as swarm:
            swarm.start_bootstrap()
            for i in range(peers):
                code = swarm.start_peer(f"peer-{i}").wait(timeout=300)
                if code != 0:
                    raise SystemExit(f"peer-{i} exited with {code}: see {workdir}/peer-{i}.log")
    finally:
        if zygote is not None:
            zygote.close()


def measure(forked: bool, peers: int) -> tuple[float, float]:
    """CPU-seconds and wall seconds of one run, in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dlp-start-") as tmp:
        subprocess.run([sys.executable, __file__, "--run", "forked" if forked else "fresh", "--peers", str(peers),
                        "--workdir", tmp], check=True)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--run", choices=["fresh", "forked"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        one_run(args.run == "forked", args.peers, Path(args.workdir))
        return
    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
    for i in range(args.repeats):
        for kind in ("fresh", "forked"):
            cpu, wall = measure(kind == "forked", args.peers)
            runs[kind].append((cpu, wall))
            print(f"run {i + 1} {kind:6s}: {cpu:6.1f} CPU-s, {wall:5.1f} s wall (a bootstrap and {args.peers} peers)",
                  flush=True)
    cpu = {kind: statistics.median(c for c, _ in r) for kind, r in runs.items()}
    wall = {kind: statistics.median(w for _, w in r) for kind, r in runs.items()}
    print(f"forked / fresh: CPU {cpu['forked'] / cpu['fresh']:.2f}x ({cpu['fresh']:.1f} -> {cpu['forked']:.1f} CPU-s; "
          f"{(cpu['fresh'] - cpu['forked']) / (args.peers + 1):.1f} CPU-s less per process), wall "
          f"{wall['forked'] / wall['fresh']:.2f}x")


if __name__ == "__main__":
    main()

"""What matchmaking's leader search costs a machine, paced (``averaging/leader_search.py``) and not.

Three ``RoundAverager``s (each with its own DHT node and averager process, as three peers have) average a
pseudo-gradient of the config's shapes in complete groups (``expected`` = 3, as the daemon's rounds do), but they
come to each round ``--stagger`` seconds apart, as peers of unequal speed, or on a loaded machine, come to theirs:
the first to come waits for the others as its group's leader or as a candidate. Per round: the machine's busy
CPU-seconds (``/proc/stat``, everything on it), the leader search's reads of the DHT (all three averagers), and the
last member's all-reduce. Two runs side by side, fresh averager processes each: the pace as shipped
(``POLL_SECONDS``), and none (the reads back to back, as hivemind makes them).

    .venv/bin/python bench/leader_search.py                      # tiny-cpu, 10 rounds each, 1 s apart
    .venv/bin/python bench/leader_search.py --stagger 0          # all three come at once
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import torch
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.dht import DHT

from diloco_peer.averaging import leader_search
from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.config.loading import load_config
from diloco_peer.training.model import parameter_shapes

READS = mp.Value("l", 0)
"""The leader search's reads of the DHT, in every averager process (they fork from this one)."""


def _count_reads() -> None:
    read = GroupKeyManager.get_averagers

    async def counted(self, group_key, only_active):
        with READS.get_lock():
            READS.value += 1
        return await read(self, group_key, only_active)

    GroupKeyManager.get_averagers = counted


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


async def _round(averagers, inputs, epoch: int, stagger: float):
    async def member(i):
        await asyncio.sleep(i * stagger)
        return await averagers[i].average(inputs[i], weight=1000, epoch=epoch, expected=len(averagers))

    return await asyncio.gather(*(member(i) for i in range(len(averagers))))


def _measure(nodes, shapes, cfg, rounds: int, pause: float, stagger: float, run_id: str) -> list[tuple]:
    """(busy CPU-seconds, reads, last member's all-reduce seconds) per round, fresh averager processes (they read
    ``POLL_SECONDS`` as it was when they forked)."""
    averagers = [RoundAverager(node, shapes, run_id, cfg.averaging) for node in nodes]
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in averagers]
    rows = []
    try:
        for epoch in range(rounds):
            time.sleep(pause)
            busy, reads = _busy_seconds(), READS.value
            results = asyncio.run(_round(averagers, inputs, epoch, stagger))
            if not all(r.ok and r.group_size == len(averagers) for r in results):
                raise SystemExit(f"round {epoch} did not average in one group: {[r.error for r in results]}")
            rows.append((_busy_seconds() - busy, READS.value - reads, results[-1].seconds))
            for a in averagers:
                a.release()
    finally:
        for a in averagers:
            a.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a shipped config name or a path (default: tiny-cpu)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between rounds (default 1.0)")
    parser.add_argument("--stagger", type=float, default=1.0, help="seconds between members' arrivals (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    shapes = parameter_shapes(cfg.model)
    print(f"{sum(s.numel() for s in shapes):,} parameters, 3 averagers on loopback coming {args.stagger:g} s apart, "
          f"matchmaking_time {cfg.averaging.matchmaking_time:g} s", flush=True)
    _count_reads()
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                 initial_peers=[str(a) for a in root.get_visible_maddrs()]) for _ in range(3)]
    shipped = leader_search.POLL_SECONDS
    runs = {}
    try:
        runs[f"paced ({shipped:g} s)"] = _measure(nodes, shapes, cfg, args.rounds, args.pause, args.stagger, "paced")
        leader_search.POLL_SECONDS = 0.0
        runs["back to back"] = _measure(nodes, shapes, cfg, args.rounds, args.pause, args.stagger, "unpaced")
    finally:
        leader_search.POLL_SECONDS = shipped
        for node in [*nodes, root]:
            node.shutdown()
    print(f"rounds 2-{args.rounds} of each run, medians:")
    for name, rows in runs.items():
        cpu, reads, seconds = (statistics.median(column) for column in zip(*rows[1:]))
        print(f"  {name:<16} {cpu:.2f} busy CPU-s a round, {reads:.0f} leader-search reads, "
              f"last member's all-reduce {seconds:.3f} s")
    paced, unpaced = (statistics.median(r[0] for r in rows[1:]) for rows in runs.values())
    print(f"ratio paced / back to back, busy CPU-s a round: {paced / unpaced:.2f}")


if __name__ == "__main__":
    main()

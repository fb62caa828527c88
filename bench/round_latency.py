"""Where a blocking round's all-reduce time goes at a small config, on loopback, with no training around it.

Three ``RoundAverager``s (each with its own DHT node and averager process, as three peers have) average a
pseudo-gradient of the config's shapes in complete groups, round after round, as the daemon's blocking rounds
do after the gate (``expected`` = 3: the group starts as soon as everyone is in). Printed per round: the
all-reduce as the daemon's record counts it (``allreduce_seconds``: group bits, matchmaking, exchange) and its
exchange alone (``transfer_seconds``). Then the same with the leader's assembly grace
(``hivemind_internals.ASSEMBLY_GRACE``) set to 0, in the same run, to show what that grace costs.

    .venv/bin/python bench/round_latency.py                  # tiny-cpu (0.36M parameters), 10 rounds each
    .venv/bin/python bench/round_latency.py --rounds 20 --set averaging.compression=int8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch
from hivemind.dht import DHT

from diloco_peer.averaging import hivemind_internals
from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.config.loading import load_config
from diloco_peer.training.model import parameter_shapes


async def _rounds(averagers: list[RoundAverager], inputs: list[list[torch.Tensor]], rounds: int
                  ) -> list[tuple[float, float]]:
    """(slowest member's all-reduce seconds, slowest member's exchange seconds) per round."""
    times = []
    for epoch in range(rounds):
        results = await asyncio.gather(*(a.average(x, weight=1000, epoch=epoch, expected=len(averagers))
                                         for a, x in zip(averagers, inputs)))
        if not all(r.ok and r.group_size == len(averagers) for r in results):
            raise SystemExit(f"round {epoch} did not average in one group: {[r.error for r in results]}")
        times.append((max(r.seconds for r in results), max(r.transfer_seconds for r in results)))
        for a in averagers:
            a.release()
    return times


def _measure(nodes: list[DHT], shapes, cfg, rounds: int, run_id: str) -> list[tuple[float, float]]:
    """Fresh averager processes (they read ``ASSEMBLY_GRACE`` as it was when they forked) for ``rounds`` rounds."""
    averagers = [RoundAverager(node, shapes, run_id, cfg.averaging) for node in nodes]
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in averagers]
    try:
        return asyncio.run(_rounds(averagers, inputs, rounds))
    finally:
        for a in averagers:
            a.shutdown()


def _summary(times: list[tuple[float, float]]) -> str:
    total, transfer = zip(*times[1:])  # the first round also opens the connections
    return (f"all-reduce median {statistics.median(total):.3f} s (min {min(total):.3f}, max {max(total):.3f}); "
            f"exchange median {statistics.median(transfer):.3f} s; matchmaking and calls "
            f"{statistics.median(total) - statistics.median(transfer):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a shipped config name or a path (default: tiny-cpu)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    shapes = parameter_shapes(cfg.model)
    print(f"{sum(s.numel() for s in shapes):,} parameters in {len(shapes)} tensors, codec "
          f"{cfg.averaging.compression}, aggregation {cfg.averaging.aggregation}, 3 peers on loopback", flush=True)
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                 initial_peers=[str(a) for a in root.get_visible_maddrs()]) for _ in range(3)]
    grace = hivemind_internals.ASSEMBLY_GRACE
    try:
        with_grace = _measure(nodes, shapes, cfg, args.rounds, "latency-grace")
        hivemind_internals.ASSEMBLY_GRACE = 0.0
        without = _measure(nodes, shapes, cfg, args.rounds, "latency-no-grace")
    finally:
        for node in [*nodes, root]:
            node.shutdown()
    print(f"assembly grace {grace} s: {_summary(with_grace)}")
    print(f"assembly grace 0 s:    {_summary(without)}")
    ratio = statistics.median(t for t, _ in with_grace[1:]) / statistics.median(t for t, _ in without[1:])
    print(f"ratio (with grace / without): {ratio:.2f}")


if __name__ == "__main__":
    main()

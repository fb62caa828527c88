"""Where a blocking round's all-reduce time goes at a small config, on loopback, with no training around it.

Three ``RoundAverager``s (each with its own DHT node and averager process, as three peers have) average a
pseudo-gradient of the config's shapes in complete groups, round after round, as the daemon's blocking rounds
do after the gate (``expected`` = 3: the group starts as soon as everyone is in). Printed per round: the
all-reduce as the daemon's record counts it (``allreduce_seconds``: group bits, matchmaking, exchange) and its
exchange alone (``transfer_seconds``). Rounds are ``--pause`` seconds apart (the inner steps' place). Three
runs side by side, fresh averager processes each: the leader's assembly grace as shipped (waited only while the
leader's event loop has not been on time, ``assembly_grace.LoopLag``), waited always, and never.

    .venv/bin/python bench/round_latency.py                  # tiny-cpu (0.36M parameters), 20 rounds each
    .venv/bin/python bench/round_latency.py --rounds 30 --set averaging.compression=int8
    .venv/bin/python bench/round_latency.py --first-rounds 4 --pause 3   # the first round, 3 s after the start
    .venv/bin/python bench/round_latency.py --aggregation                # what the robust aggregation costs
    .venv/bin/python bench/round_latency.py --flat                       # the model's tensors vs one buffer

``--aggregation``: instead, three runs of the grace as shipped, side by side: the robust aggregation (the default)
as shipped, with its coordinate median sorted by torch (``torch.median``, as until 2026-11-27), and the plain mean.

``--flat``: instead, the model's tensors side by side with one flat tensor of the same size (what averaging one
buffer instead of the model's tensors would save: hivemind cuts parts per tensor, so the exchange carries about a
part per tensor and reducer, each a message with its own checks).

``--first-rounds N``: instead, N pairs of fresh groups whose first round begins ``--pause`` seconds after their
averagers start, side by side: the loop watch as shipped (calm once it has run a join request's timeout) and
as it was until 2026-11-27 (a whole window, 5 s: a first round within 5 s of the start waited the grace).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch
from hivemind.dht import DHT

from diloco_peer.averaging import assembly_grace, robust_aggregation
from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.config.loading import load_config
from diloco_peer.training.model import parameter_shapes


async def _rounds(averagers: list[RoundAverager], inputs: list[list[torch.Tensor]], rounds: int, pause: float
                  ) -> list[tuple[float, float]]:
    """(slowest member's all-reduce seconds, slowest member's exchange seconds) per round."""
    times = []
    for epoch in range(rounds):
        await asyncio.sleep(pause)
        results = await asyncio.gather(*(a.average(x, weight=1000, epoch=epoch, expected=len(averagers))
                                         for a, x in zip(averagers, inputs)))
        if not all(r.ok and r.group_size == len(averagers) for r in results):
            raise SystemExit(f"round {epoch} did not average in one group: {[r.error for r in results]}")
        times.append((max(r.seconds for r in results), max(r.transfer_seconds for r in results)))
        for a in averagers:
            a.release()
    return times


def _measure(nodes: list[DHT], shapes, cfg, rounds: int, pause: float, run_id: str) -> list[tuple[float, float]]:
    """Fresh averager processes (they read ``ASSEMBLY_GRACE`` and ``LoopLag`` as they were when they forked)."""
    averagers = [RoundAverager(node, shapes, run_id, cfg.averaging) for node in nodes]
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in averagers]
    try:
        return asyncio.run(_rounds(averagers, inputs, rounds, pause))
    finally:
        for a in averagers:
            a.shutdown()


def _summary(times: list[tuple[float, float]], skip: int) -> str:
    total, transfer = zip(*times[skip:])
    return (f"all-reduce median {statistics.median(total):.3f} s (min {min(total):.3f}, max {max(total):.3f}); "
            f"exchange median {statistics.median(transfer):.3f} s; matchmaking and calls "
            f"{statistics.median(total) - statistics.median(transfer):.3f} s")


def _first_rounds(nodes: list[DHT], shapes, cfg, count: int, pause: float) -> None:
    """``count`` first rounds per loop watch, the two watches taking turns (fresh averager processes each)."""
    shipped = assembly_grace.LoopLag
    watches = {"as shipped": shipped, "a whole window": lambda watched=None: shipped()}
    firsts: dict[str, list[float]] = {name: [] for name in watches}
    try:
        for turn in range(count):
            for name, watch in watches.items():
                assembly_grace.LoopLag = watch
                firsts[name].append(_measure(nodes, shapes, cfg, 1, pause, f"first-{turn}-{len(firsts[name])}-"
                                             f"{name.replace(' ', '-')}")[0][0])
    finally:
        assembly_grace.LoopLag = shipped
    print(f"first rounds, {pause:g} s after the averagers start:")
    for name, times in firsts.items():
        print(f"  loop watch {name:<15} all-reduce {', '.join(f'{t:.3f}' for t in times)} s; median "
              f"{statistics.median(times):.3f} s")
    print(f"ratio as shipped / a whole window: "
          f"{statistics.median(firsts['as shipped']) / statistics.median(firsts['a whole window']):.2f}")


def _aggregations(nodes: list[DHT], shapes, args, rounds: int, pause: float) -> dict[str, list[tuple[float, float]]]:
    """Robust (as shipped, and with torch's median) and mean, each in fresh averager processes (forked: they see
    the module's ``coordinate_median`` as it is when they start)."""
    robust, mean = (load_config(args.config, [*args.set, f"averaging.aggregation={a}"]) for a in ("robust", "mean"))
    shipped = robust_aggregation.coordinate_median
    runs = {"robust": _measure(nodes, shapes, robust, rounds, pause, "latency-robust")}
    try:
        robust_aggregation.coordinate_median = lambda parts: torch.stack(parts).median(dim=0).values
        runs["robust, torch.median"] = _measure(nodes, shapes, robust, rounds, pause, "latency-torch-median")
    finally:
        robust_aggregation.coordinate_median = shipped
    runs["mean"] = _measure(nodes, shapes, mean, rounds, pause, "latency-mean")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a shipped config name or a path (default: tiny-cpu)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between rounds (default 1.0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--first-rounds", type=int, default=0, metavar="N",
                        help="measure N first rounds per loop watch instead (see the module docstring)")
    parser.add_argument("--flat", action="store_true",
                        help="compare the model's tensors with one flat tensor of the same size instead")
    parser.add_argument("--aggregation", action="store_true",
                        help="compare the robust aggregation with torch's median and the mean instead")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    shapes = parameter_shapes(cfg.model)
    print(f"{sum(s.numel() for s in shapes):,} parameters in {len(shapes)} tensors, codec "
          f"{cfg.averaging.compression}, aggregation {cfg.averaging.aggregation}, 3 peers on loopback", flush=True)
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                 initial_peers=[str(a) for a in root.get_visible_maddrs()]) for _ in range(3)]
    # the first rounds of a run: connections open, and the grace is waited until the loop watch has a window
    skip = min(args.rounds - 1, int(assembly_grace.LoopLag().window / (args.pause + 0.2)) + 2)
    try:
        if args.first_rounds:
            return _first_rounds(nodes, shapes, cfg, args.first_rounds, args.pause)
        if args.flat:
            return _report(_flat(nodes, shapes, cfg, args.rounds, args.pause), skip, f"{len(shapes)} tensors")
        if args.aggregation:
            return _report(_aggregations(nodes, shapes, args, args.rounds, args.pause), skip, "mean")
        return _report(_graces(nodes, shapes, cfg, args.rounds, args.pause), skip, "grace never")
    finally:
        for node in [*nodes, root]:
            node.shutdown()


def _flat(nodes: list[DHT], shapes, cfg, rounds: int, pause: float) -> dict[str, list[tuple[float, float]]]:
    """The model's tensors, and one flat tensor of as many values."""
    flat = [torch.Size([sum(s.numel() for s in shapes)])]
    return {f"{len(shapes)} tensors": _measure(nodes, shapes, cfg, rounds, pause, "latency-tensors"),
            "1 flat tensor": _measure(nodes, flat, cfg, rounds, pause, "latency-flat")}


def _graces(nodes: list[DHT], shapes, cfg, rounds: int, pause: float) -> dict[str, list[tuple[float, float]]]:
    """The leader's assembly grace as shipped, always and never, each in fresh averager processes."""
    grace, calm = assembly_grace.ASSEMBLY_GRACE, assembly_grace.LoopLag.calm
    runs = {}
    try:
        runs["as shipped"] = _measure(nodes, shapes, cfg, rounds, pause, "latency-shipped")
        assembly_grace.LoopLag.calm = lambda self: False
        runs[f"grace {grace} s always"] = _measure(nodes, shapes, cfg, rounds, pause, "latency-grace")
        assembly_grace.ASSEMBLY_GRACE = 0.0
        runs["grace never"] = _measure(nodes, shapes, cfg, rounds, pause, "latency-no-grace")
    finally:
        assembly_grace.ASSEMBLY_GRACE, assembly_grace.LoopLag.calm = grace, calm
    return runs


def _report(runs: dict[str, list[tuple[float, float]]], skip: int, baseline: str) -> None:
    print(f"rounds {skip + 1}-{len(next(iter(runs.values())))} of each run:")
    for name, times in runs.items():
        print(f"  {name:<22} {_summary(times, skip)}")
    base = statistics.median(t for t, _ in runs[baseline][skip:])
    for name in [n for n in runs if n != baseline]:
        print(f"ratio {name} / {baseline}: {statistics.median(t for t, _ in runs[name][skip:]) / base:.2f}")

if __name__ == "__main__":
    main()

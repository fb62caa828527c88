"""How far honest parts point from their group, where robust aggregation judges their direction.

K replicas train from the same start on their own data shards (as ``diloco-peer demo``'s peers: shard i of K),
H inner steps a round, blocking rounds with the group's mean. Every round their pseudo-gradients are cut into the
parts the swarm's reducers receive (``simulated_allreduce.reducer_spans``: the config's part size and codec), and
each part of ``MIN_DIRECTION_VALUES`` values or more is compared with the coordinate-wise median of the group's
parts, as a reducer in ``robust`` mode does (``robust_aggregation.aggregate``). Printed: the lowest cosines seen
(round, part size, the cosine in units of 1 / sqrt(values), the spread ``below`` allows), and how many of them a
reducer would refuse at ``averaging.min_cosine``. No peer here is dishonest: every refusal is of an honest part.

    .venv/bin/python bench/honest_directions.py                     # K=16, H=20, 6 rounds from scratch
    .venv/bin/python bench/honest_directions.py --replicas 8 --rounds 8
"""

from __future__ import annotations

import argparse
import math

import torch

from diloco_peer.averaging.compression import get_codec
from diloco_peer.averaging.robust_aggregation import MIN_DIRECTION_VALUES, below, coordinate_median
from diloco_peer.config.loading import load_config
from diloco_peer.tools.simulate import trainers_for
from diloco_peer.tools.simulated_allreduce import reducer_spans
from diloco_peer.training.outer_optimizer import OuterOptimizer


def reducer_parts(deltas: list[list[torch.Tensor]], codec, part_size_bytes: int) -> list[list[torch.Tensor]]:
    """For each part a reducer receives, the K replicas' values of it (what ``aggregate`` is called with)."""
    k = len(deltas)
    spans = [reducer_spans(d, k, codec, part_size_bytes) for d in deltas]
    return [[spans[s][j][p].double().flatten() for s in range(k)] for j in range(k) for p in range(len(spans[0][j]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--show", type=int, default=8, help="how many of the lowest cosines to print")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"outer.inner_steps={args.inner_steps}"])
    codec = get_codec(cfg.averaging.compression, cfg.averaging.topk_density, cfg.averaging.topk_bits)
    trainers = trainers_for(cfg, args.replicas, None)
    outers = [OuterOptimizer(t.model, cfg.outer) for t in trainers]
    seen = []  # (cosine, round, values, replica)
    for rnd in range(1, args.rounds + 1):
        deltas = []
        for trainer, outer in zip(trainers, outers):
            trainer.train_steps(args.inner_steps)
            deltas.append(outer.pseudo_gradient())
        for parts in reducer_parts(deltas, codec, cfg.averaging.part_size_bytes):
            if parts[0].numel() < MIN_DIRECTION_VALUES:
                continue
            median = coordinate_median(parts)
            seen += [(float(torch.nn.functional.cosine_similarity(p, median, dim=0)), rnd, p.numel(), i)
                     for i, p in enumerate(parts)]
        average = [torch.stack(ts).mean(0) for ts in zip(*deltas)]
        for outer in outers:
            outer.step(average)
        print(f"round {rnd}: eval loss {trainers[0].evaluate():.4f}", flush=True)
    seen.sort()
    refused = [s for s in seen if below(s[0], cfg.averaging.min_cosine, s[2])]
    print(f"K={args.replicas}, H={args.inner_steps}, {args.rounds} rounds: {len(seen)} honest parts of "
          f"{MIN_DIRECTION_VALUES}+ values judged; {len(refused)} below averaging.min_cosine="
          f"{cfg.averaging.min_cosine:g} beyond noise (refused)")
    for cosine, rnd, values, replica in seen[:args.show]:
        print(f"  cosine {cosine:+.3f} ({cosine * math.sqrt(values):+.1f} / sqrt(values)), round {rnd}, "
              f"{values} values, replica {replica}")


if __name__ == "__main__":
    main()

"""Sparse pseudo-gradients: how close to fp32 DiLoCo, at how many fewer bytes than DDP?

    .venv/bin/python bench/sparse_quality.py --methods fp32,topk --densities 0.01,0.05   # K=4, H=25, 30 rounds
    .venv/bin/python bench/sparse_quality.py --methods own-topk,agreed --densities 0.05 --block 256

K replicas (tiny-cpu, a shared warm start, data shard i of K each) train H inner steps a round; then, per run:

- ``fp32``, ``int4``: DiLoCo as the swarm runs it (``diloco-peer simulate``'s ``run_diloco``, mean aggregation): the
  mean pseudo-gradient, a Nesterov outer step (lr 0.7, momentum 0.9); int4 with error feedback.
- ``topk``: the swarm's sparse codec, as the swarm computes it (``run_diloco``, codec ``topk``; ``test_simulate.py``
  checks a real swarm against it): SparseLoCo's recipe (arXiv 2508.15706) in a butterfly all-reduce. Each replica
  adds its pseudo-gradient to an error-feedback buffer decayed by 0.95 and sends the top d of every chunk of 4096
  values, ``--bits`` each, to the chunk's reducer; the reducer averages what arrives and replies with the top d of
  the average, the same for all; a replica's values the reply dropped go back into its buffer. Plain SGD at lr 1
  (the error feedback stands in for the outer momentum). Per-peer bytes stay ~2(K-1)/K of one payload at any K.
- ``own-topk``: SparseLoCo as Covenant-72B ran it: each replica's top d per chunk, the round's update the mean of the
  K messages (up to K times d of the values). The replicas' places differ, so the messages cannot be summed along
  the way: every peer receives every other's (an all-gather), and what it downloads grows with K.
- ``agreed``: places every replica agrees on, so that the values travel in a butterfly all-reduce: first a small
  dense all-reduce of each block's summed |error feedback| (one fp16 per ``--block`` values), then the top d of the
  blocks by that sum, the same for everyone; each replica sends its error feedback's values in those blocks (2 bits
  each), the rest stays in its buffer. The same outer step as ``own-topk``.

``own-topk`` and ``agreed`` quantize a value to 2 bits as ``topk`` does (its sign, and which of two magnitudes per
chunk or block: the mean |value| of the smaller and of the larger half of those sent). Bytes per trained token
against DDP (one fp32 gradient all-reduced per inner step, in a butterfly): a butterfly run sends and receives
~2(K-1)/K of its payload a round, an all-gather 2(K-1) payloads. Results are appended to ``--out``; BENCHMARKS.md,
"Sparse pseudo-gradients".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import append_runs, study_arguments  # noqa: E402

from diloco_peer.averaging.compression import TopKCodec  # noqa: E402
from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.simulate import pretrain, run_diloco, trainers_for  # noqa: E402
from diloco_peer.training.outer_optimizer import OuterOptimizer, evaluate_outer  # noqa: E402

CHUNK = 4096
"""Values per chunk of ``own-topk`` (Covenant-72B's)."""
DECAY = 0.95
"""The error feedback's decay per round (SparseLoCo's)."""
OVERRIDES: list[str] = []
"""The command line's ``--set`` overrides, for the runs that load their own config."""


def two_bits(values: torch.Tensor) -> torch.Tensor:
    """Rows of values, each row quantized to its sign and one of two magnitudes (the means of its smaller and larger
    half by |value|); zeros stay zeros."""
    magnitude = values.abs()
    sent = magnitude > 0
    masked = torch.where(sent, magnitude, torch.full_like(magnitude, float("nan")))
    median = masked.nanmedian(dim=1, keepdim=True).values.nan_to_num(0.0)
    low, high = sent & (magnitude <= median), sent & (magnitude > median)
    low_mean = (magnitude * low).sum(dim=1, keepdim=True) / low.sum(dim=1, keepdim=True).clamp(min=1)
    high_mean = (magnitude * high).sum(dim=1, keepdim=True) / high.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.sign(values) * torch.where(high, high_mean, torch.where(low, low_mean, torch.zeros_like(magnitude)))


def rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """``flat`` zero-padded to whole rows of ``width``."""
    padded = torch.zeros(math.ceil(flat.numel() / width) * width)
    padded[:flat.numel()] = flat
    return padded.view(-1, width)


def own_topk(buffers: list[torch.Tensor], density: float) -> tuple[list[torch.Tensor], float]:
    """Each replica's message (its top ``density`` per chunk, in 2 bits: the swarm codec's encoding) and its size in
    bytes; the buffers keep the rest."""
    messages = []
    for i, buf in enumerate(buffers):
        message, size = TopKCodec(density, 2).roundtrip(buf)
        buffers[i] = buf - message
        messages.append(message)
    return messages, size


def agreed(buffers: list[torch.Tensor], density: float, block: int) -> tuple[list[torch.Tensor], float]:
    """Every replica's message over the blocks all agree on (the top ``density`` of the blocks by their summed
    |error feedback|, itself all-reduced), in 2 bits; the payload's size in bytes (the sketch's included)."""
    score = sum(rows(buf, block).abs().sum(dim=1) for buf in buffers)
    blocks = score.numel()
    chosen = score.topk(max(1, round(density * blocks))).indices
    messages = []
    for i, buf in enumerate(buffers):
        values = rows(buf, block)
        picked = torch.zeros_like(values)
        picked[chosen] = two_bits(values[chosen])
        message = picked.flatten()[:buf.numel()]
        buffers[i] = buf - message
        messages.append(message)
    return messages, blocks * 2 + len(chosen) * (block * 2 / 8 + 2 * 2)


SPARSELOCO = ["averaging.feedback_decay=0.95", "outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false"]
"""The outer step of the sparse runs (SparseLoCo's): the decayed error feedback stands in for the momentum."""


def run_swarm_codec(cfg, init, replicas: int, rounds: int, method: str, density: float, bits: int) -> dict:
    """One run of the swarm's own computation (``run_diloco``) with codec ``method``: fp32 (none), int4, topk."""
    codec = "none" if method == "fp32" else method
    sets = [f"averaging.compression='{codec}'", f"averaging.topk_density={density}", f"averaging.topk_bits={bits}",
            "averaging.aggregation='mean'", *(SPARSELOCO if codec == "topk" else [])]
    cfg = load_config(None, [f"outer.inner_steps={cfg.outer.inner_steps}", "run.threads=1", *OVERRIDES, *sets])
    sim = run_diloco(cfg, replicas, rounds, codec=codec, error_feedback=codec != "none", init=init)
    numel = sum(p.numel() for p in trainers_for(cfg, 1, init)[0].model.parameters())
    butterfly = 2 * (replicas - 1) / replicas
    per_round = sim.bytes_per_replica / rounds / 2  # (the simulator counts both ways; DDP below one way)
    ddp = cfg.outer.inner_steps * butterfly * 4.0 * numel
    return {"method": method, "density": density if codec == "topk" else 1.0, "bits": bits if codec == "topk" else 32,
            "params": numel, "replicas": replicas, "H": cfg.outer.inner_steps, "rounds": rounds,
            "eval_loss": sim.eval_loss, "final_ppl": sim.final_ppl, "payload_bytes": per_round / butterfly,
            "bytes_per_round": per_round, "vs_ddp": ddp / per_round, "tokens": sim.tokens[-1],
            "seconds": round(sim.seconds)}


def run(cfg, init, replicas: int, rounds: int, method: str, density: float, block: int) -> dict:
    """One run of ``method``; its eval loss per round, its payload and bytes per trained token against DDP."""
    started = time.perf_counter()
    outer_cfg = cfg.outer if method == "fp32" else cfg.outer.model_copy(update={"lr": 1.0, "momentum": 0.0,
                                                                                 "nesterov": False})
    trainers = trainers_for(cfg, replicas, init)
    outers = [OuterOptimizer(t.model, outer_cfg) for t in trainers]
    numel = sum(p.numel() for p in outers[0].params)
    buffers = [torch.zeros(numel) for _ in trainers]
    losses = [trainers[0].evaluate()]
    payload = 4.0 * numel
    tokens = 0
    for _ in range(rounds):
        deltas = []
        for trainer, outer in zip(trainers, outers):
            tokens += trainer.train_steps(cfg.outer.inner_steps).tokens
            deltas.append(torch.cat([d.flatten() for d in outer.pseudo_gradient()]))
        if method == "fp32":
            messages = deltas
        else:
            buffers = [DECAY * buf + d for buf, d in zip(buffers, deltas)]
            messages, payload = (own_topk(buffers, density) if method == "own-topk" else
                                 agreed(buffers, density, block))
        average = torch.stack(messages).mean(dim=0)
        update = list(torch.split(average, [p.numel() for p in outers[0].params]))
        update = [u.view_as(p) for u, p in zip(update, outers[0].params)]
        for outer in outers:
            outer.step(update)
        losses.append(evaluate_outer(outers[0], trainers[0].evaluate))
    # bytes a peer sends and receives per round, against DDP's per round (H butterfly all-reduces of fp32 gradients)
    butterfly = 2 * (replicas - 1) / replicas
    per_round = payload * (2 * (replicas - 1) if method == "own-topk" else butterfly)
    ddp = cfg.outer.inner_steps * butterfly * 4.0 * numel
    return {"method": method, "density": density if method != "fp32" else 1.0, "block": block, "params": numel,
            "replicas": replicas,
            "H": cfg.outer.inner_steps, "rounds": rounds, "eval_loss": losses, "final_ppl": math.exp(losses[-1]),
            "payload_bytes": payload, "bytes_per_round": per_round, "vs_ddp": ddp / per_round, "tokens": tokens,
            "seconds": round(time.perf_counter() - started)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser, Path(__file__).resolve().parent / "sparse_quality.json", codecs="none")
    parser.set_defaults(H=25, steps=750)
    parser.add_argument("--densities", default="0.05,0.2", help="comma-separated fractions (default 0.05,0.2)")
    parser.add_argument("--methods", default="fp32,topk", help="comma-separated, of fp32, int4, topk, own-topk and "
                                                               "agreed (default fp32,topk)")
    parser.add_argument("--bits", type=int, default=2, choices=[2, 4], help="bits per value of topk (default 2)")
    parser.add_argument("--block", type=int, default=64, help="values per block of 'agreed' (default 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OVERRIDES.extend(args.overrides)
    cfg = load_config(None, [f"outer.inner_steps={args.H}", "run.threads=1", *args.overrides])
    rounds = args.steps // args.H
    init = pretrain(cfg, args.pretrain)
    plan = [(m, d) for m in args.methods.split(",") for d in ([1.0] if m in ("fp32", "int4") else
                                                             [float(v) for v in args.densities.split(",")])]
    results = []
    for method, density in plan:
        if method in ("fp32", "int4", "topk"):
            result = run_swarm_codec(cfg, init, args.replicas, rounds, method, density, args.bits)
        else:
            result = run(cfg, init, args.replicas, rounds, method, density, args.block)
        results.append(result)
        reference = next((r for r in results if r["method"] == "fp32"), None)
        versus = f"{(result['final_ppl'] / reference['final_ppl'] - 1) * 100:+.1f}%" if reference else "-"
        print(f"{method:>8} d={density:<5g} H={args.H} K={args.replicas} ppl {result['final_ppl']:.3f} "
              f"({versus} vs fp32), payload "
              f"{result['payload_bytes'] / 1e3:.1f} kB, {result['vs_ddp']:,.0f}x fewer bytes per token than DDP "
              f"({result['seconds']}s)", flush=True)
    append_runs(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

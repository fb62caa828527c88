"""Rounds bounded by time, in the simulator: does a swarm of unequal peers train as well as an equal one, per token?

    .venv/bin/python bench/unequal_quality.py                                   # K=4, H=20, 30 rounds: ~10 min
    .venv/bin/python bench/unequal_quality.py --spreads 1:1:1:0.2 --contributions per_step --H 10

In a round bounded by time (``outer.round_length = "time"``) a peer of relative speed v (the fastest: 1) trains
about v * H inner steps where the fastest trains H, its inner LR schedule striding H over them
(``tools/simulate.run_diloco(speeds=...)``: the swarm's own parts, ``steps_in_round``). Its pseudo-gradient is
weighted by its tokens, and counts either as it is (``tokens``) or per inner step, times H (``per_step``, FedNova's
normalization): ``training.outer_optimizer.contribution_scale``.

Each spread is compared with the equal-speed swarm (``1:1:1:1``) at equal tokens: the equal swarm runs T inner steps
(``--steps``, in rounds of H), the unequal one as many more rounds as it takes to train as many tokens (slow peers
train fewer per round), each with an inner LR schedule as long as its run; its eval loss is read at the equal
swarm's final token count (linear between the two eval points around it). Prints each run and its perplexity
against the equal swarm, and appends the runs to ``--out`` (the table of BENCHMARKS.md comes from it).
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

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.simulate import pretrain, run_diloco, steps_in_round  # noqa: E402


def at_tokens(tokens: list[int], losses: list[float], target: int) -> float:
    """The eval loss at ``target`` tokens, linear between the eval points around it (the last one past the end)."""
    for (t0, l0), (t1, l1) in zip(zip(tokens, losses), zip(tokens[1:], losses[1:])):
        if t0 <= target <= t1:
            return l0 + (l1 - l0) * (target - t0) / max(t1 - t0, 1)
    return losses[-1]


def parse_spread(text: str) -> list[float]:
    speeds = [float(v) for v in text.split(":")]
    if not speeds or min(speeds) <= 0 or max(speeds) != 1.0:
        raise SystemExit(f"bad spread {text!r}: speeds relative to the fastest, e.g. 1:1:1:0.2")
    return speeds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser, Path(__file__).resolve().parent / "unequal_quality.json", codecs="none")
    parser.set_defaults(H=20, steps=600)
    parser.add_argument("--spreads", default="1:1:1:0.2,1:0.5:0.25:0.1", help="comma-separated speed spreads, "
                        "one speed per replica relative to the fastest (default: 1:1:1:0.2,1:0.5:0.25:0.1)")
    parser.add_argument("--contributions", default="tokens,per_step", help="comma-separated: tokens, per_step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = [f"outer.inner_steps={args.H}", "run.threads=1", *args.overrides]
    init = pretrain(load_config(None, [*base, f"inner.total_steps={args.steps}"]), args.pretrain) \
        if args.pretrain else None
    codec = args.codecs.split(",")[0]
    rounds = args.steps // args.H
    plan = [("1" + ":1" * (args.replicas - 1), "tokens")]
    plan += [(spread, c) for spread in args.spreads.split(",") for c in args.contributions.split(",")]
    runs, reference = [], None
    for spread, contribution in plan:
        speeds = parse_spread(spread)
        if len(speeds) != args.replicas:
            raise SystemExit(f"spread {spread} has {len(speeds)} speeds for --replicas {args.replicas}")
        cfg = load_config(None, base)
        tokens_per_step = cfg.inner.batch_size * cfg.inner.grad_accum * cfg.data.seq_len
        per_round = sum(steps_in_round(args.H, v) for v in speeds) * tokens_per_step  # tokens a round
        run_rounds = rounds if reference is None else math.ceil(reference["tokens"] / per_round) + 1
        cfg = load_config(None, [*base, f"inner.total_steps={run_rounds * args.H}"])
        started = time.perf_counter()
        run = run_diloco(cfg, args.replicas, run_rounds, codec, init=init, speeds=speeds, contribution=contribution)
        tokens = run.tokens[-1] if reference is None else reference["tokens"]
        loss = at_tokens(run.tokens, run.eval_loss, tokens)
        runs.append({"replicas": args.replicas, "H": args.H, "steps": args.steps, "pretrain": args.pretrain,
                     "codec": codec, "spread": spread, "contribution": contribution, "rounds": run_rounds,
                     "steps_per_round": [steps_in_round(args.H, v) for v in speeds], "overrides": args.overrides,
                     "tokens": tokens, "eval_loss_at_tokens": loss, "eval_loss": run.eval_loss, "refused": run.refused,
                     "tokens_curve": run.tokens, "seconds": round(time.perf_counter() - started, 1)})
        reference = reference or runs[-1]
        gap = math.exp(loss - reference["eval_loss_at_tokens"]) - 1
        print(f"K={args.replicas} H={args.H} spread {spread:16} {contribution:8} {run_rounds:3} rounds: eval loss "
              f"{loss:.4f} at {tokens:,} tokens (ppl {math.exp(loss):.3f}, {gap * 100:+.2f}% vs equal), {run.refused} "
              f"honest contributions refused, in {runs[-1]['seconds']:.0f}s", flush=True)
    append_runs(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

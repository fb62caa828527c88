"""``diloco-peer simulate``: K DiLoCo replicas in one process, no network, plus the two baselines.

    diloco-peer simulate --replicas 4 --rounds 20 --out runs/sim
    diloco-peer simulate --replicas 8 --rounds 20 --codec int8 --overlap eager --set outer.inner_steps=25

It runs exactly what a swarm of K peers computes, built from the same parts (``build_model``,
``Corpus`` shard i of K as ``diloco-peer demo`` gives peer i, ``Trainer``, ``OuterOptimizer``):
every round each replica takes H inner steps from the outer weights, its pseudo-gradient goes
through the codec, the reducers aggregate it part by part as the swarm's do, their replies go through the
codec again, and every replica applies the same outer step. The equivalence test runs a real swarm and this with the
same config and checks that the weights after every round agree (tests/test_simulate.py).

Two baselines, at the same number of inner steps:
- ``single``: one replica with batch B on the whole corpus (the "no replica" baseline, 1/K the compute);
- ``kx_batch``: one replica with batch K*B (as gradient accumulation), what data-parallel training of
  K workers computes; the same compute as DiLoCo with K replicas.

Overlapped rounds (``eager``, ``delayed``): round t's pseudo-gradient is the replica's own progress during
round t (weights at the start of the round minus weights at its end). It is averaged while round t+1
trains; at the end of round t+1 the outer step applies the average of round t to the outer weights, and
the replica continues from them plus ``overlap_offset``: ``eager``, the outer step it predicts from its own
pseudo-gradient of round t+1 (not sent yet); ``delayed`` (DiLoCoX's one-step delay), that progress as it
is. ``arrival`` says when the average of round t reaches the replicas while round t+1 trains (as
``outer.apply_on_arrival`` does in the swarm): after d of its H inner steps the replica moves onto where the
average puts the outer weights, keeping its progress since (``correct_on_arrival``); by default d = H, the round's
end. The outer step itself is taken at the round's end either way. d = 0 computes what blocking rounds compute.
Blocking mode (the default) waits for the average and restarts every round from the outer weights.

Aggregation is the swarm's own, part by part (``simulated_allreduce.py``); every contribution the swarm's
checks would refuse is counted in ``SimRun.refused`` (in a swarm, an offense against an honest peer).

Eval loss is measured on the outer weights (in overlapped modes they lag one round behind the replicas;
the last round's average is applied when the run ends, so the final number includes every round).
Bytes are what a butterfly all-reduce of K peers moves per peer and round (``allreduce_bytes``); for
``kx_batch`` the same for an fp32 gradient all-reduce every inner step (what DDP sends).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..averaging.compression import ErrorFeedback, get_codec
from ..config import InnerConfig, PeerConfig
from ..observe.report import save_figure
from ..training.data import Corpus
from ..training.model import build_model
from ..training.outer_optimizer import (
    OuterOptimizer,
    contribution_scale,
    correct_on_arrival,
    evaluate_outer,
    overlap_offset,
    progress_since,
    replica_copy,
)
from ..training.trainer import Trainer
from .simulated_allreduce import allreduce_bytes, group_average, roundtrip_all


@dataclass
class SimRun:
    """One simulated run: its eval curve and what it would have sent."""

    name: str
    kind: str
    replicas: int
    codec: str = "none"
    overlap: str = "blocking"
    aggregation: str = "mean"
    refused: int = 0
    """Honest contributions the swarm's checks would have refused (offenses; see the module docstring)."""
    tokens: list[int] = field(default_factory=list)
    """Tokens processed by all replicas together, at each eval point."""
    eval_loss: list[float] = field(default_factory=list)
    bytes_per_replica: int = 0
    seconds: float = 0.0

    @property
    def final_ppl(self) -> float:
        """Perplexity at the end of the run."""
        return math.exp(self.eval_loss[-1])

    def to_dict(self) -> dict:
        """The run as ``simulate.json`` holds it."""
        return {**self.__dict__, "final_eval_loss": self.eval_loss[-1], "final_ppl": self.final_ppl}


def _corpus(cfg: PeerConfig, shard: int, shards: int) -> Corpus:
    """Data shard ``shard`` of ``shards``, as ``diloco-peer demo`` gives peer ``shard``."""
    return Corpus(cfg.data.model_copy(update={"num_shards": shards, "shard": shard}), shard, cfg.model.vocab_size)


def pretrain(cfg: PeerConfig, steps: int) -> dict[str, torch.Tensor]:
    """A warm start: ``steps`` inner steps of one replica (batch B, whole corpus, its own LR schedule).

    The DiLoCo paper starts every run, baselines included, from a model pretrained for 24k steps; DiLoCo's
    outer step extrapolates the replicas' mean displacement, which is sound once training is past its
    first, most non-linear phase. ``run_diloco``/``run_baseline`` take the result as ``init``."""
    inner = cfg.inner.model_copy(update={"total_steps": steps, "warmup_steps": min(cfg.inner.warmup_steps, steps)})
    trainer = Trainer(build_model(cfg.model, cfg.run.seed), _corpus(cfg, 0, 1), inner)
    trainer.train_steps(steps)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _model(cfg: PeerConfig, init: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The config's model, with the weights ``init`` when given (a warm start, see ``pretrain``)."""
    model = build_model(cfg.model, cfg.run.seed)
    if init is not None:
        model.load_state_dict(init)
    return model


def trainers_for(cfg: PeerConfig, replicas: int, init: dict[str, torch.Tensor] | None,
                 inner: list[InnerConfig] | None = None) -> list[Trainer]:
    """K replicas as K peers train them: a trainer on data shard i of K (with ``inner[i]``, else ``cfg.inner``)."""
    return [Trainer(_model(cfg, init), _corpus(cfg, i, replicas), inner[i] if inner else cfg.inner)
            for i in range(replicas)]


def _local_round(trainer: Trainer, outer: OuterOptimizer, fb: ErrorFeedback | None, start: list[torch.Tensor],
                 wire, overlap: str, steps: int, arrived: tuple[int, list[torch.Tensor]] | None = None,
                 scale: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    """One replica's part of a round: ``steps`` inner steps, then its pseudo-gradient as the averager holds it
    (with error feedback: already through the codec) and as it arrives after crossing the wire; returns both,
    its encoded size in bytes and the tokens trained on. ``arrived``: (d, the previous round's average), applied
    to the replica after d inner steps (overlapped; ``start`` moves with it). ``scale``: the pseudo-gradient is
    sent times this (``contribution_scale``)."""
    tokens = 0
    if arrived is not None and arrived[0] < steps:
        tokens += trainer.train_steps(arrived[0]).tokens
        correct_on_arrival(outer, arrived[1], start)
        steps -= arrived[0]
    tokens += trainer.train_steps(steps).tokens
    if overlap == "blocking":
        delta = outer.pseudo_gradient()
    else:  # this round's own progress, fp32 on the host as the swarm's averager holds it
        delta = [-d for d in progress_since(trainer.model, start)]
    if scale != 1.0:
        delta = [d * scale for d in delta]
    if fb is not None:
        delta, size = fb.roundtrip(delta)
        return delta, delta, size, tokens
    arrived, size = roundtrip_all(wire, delta)
    return delta, arrived, size, tokens


def continue_overlapped(outer: OuterOptimizer, start: list[torch.Tensor], pending: list[torch.Tensor] | None,
                        overlap: str) -> None:
    """Overlap at the end of a round, for one replica (``outer.model``): the previous round's average
    (``pending``) moves the outer weights, and the replica continues from them plus what ``overlap_offset`` puts
    on top: ``delayed``, its own progress of this round (not sent yet); ``eager``, the outer step it predicts
    from that progress."""
    progress = progress_since(outer.model, start)
    if pending is not None:
        outer.step(pending)  # loads the new outer weights into the replica
    else:
        outer.load_into_model()
    with torch.no_grad():
        for p, d in zip(outer.model.parameters(), overlap_offset(outer, overlap, progress)):
            p.add_(d.to(p.device, p.dtype))


def steps_in_round(inner_steps: int, speed: float) -> int:
    """The inner steps a replica of relative ``speed`` (the fastest: 1.0) fits in a round of ``inner_steps`` of the
    fastest's: at least one."""
    return max(1, round(inner_steps * speed))


def _apply(outers: list[OuterOptimizer], starts: list[list[torch.Tensor]], average: list[torch.Tensor],
           pending: list[torch.Tensor] | None, overlap: str) -> list[torch.Tensor] | None:
    """The end of a round for every replica: blocking, the outer step with this round's ``average``; overlapped,
    ``continue_overlapped`` with the previous round's (``pending``). Returns what is pending now."""
    if overlap == "blocking":
        for outer in outers:
            outer.step(average)
        return pending
    for outer, start in zip(outers, starts):
        continue_overlapped(outer, start, pending, overlap)
    return average


def arrival_step(arrival, rnd: int, replica: int, H: int) -> int:
    """The inner step of round ``rnd`` at which replica ``replica`` applies the previous round's average:
    ``arrival`` is None (the round's end, H), an int for all, a dict ``{(rnd, replica): d}`` (missing or None:
    H) or a callable ``(rnd, replica) -> d``; clamped to 0..H."""
    if callable(arrival):
        d = arrival(rnd, replica)
    else:
        d = arrival.get((rnd, replica)) if isinstance(arrival, dict) else arrival
    return H if d is None else max(0, min(H, int(d)))


def run_diloco(cfg: PeerConfig, replicas: int, rounds: int, codec: str = "none", overlap: str = "blocking",
               error_feedback: bool = False, on_round=None, init: dict[str, torch.Tensor] | None = None,
               inner: list[InnerConfig] | None = None, arrival=None, speeds: list[float] | None = None,
               contribution: str = "tokens", refusals: frozenset[tuple[int, int]] = frozenset()) -> SimRun:
    """K replicas for ``rounds`` outer rounds, from ``init`` (see ``pretrain``) or from scratch.
    ``on_round(round, outer_params)`` is called after each round. ``inner``: each replica's inner config, for
    peers that differ (e.g. batch sizes, so that their pseudo-gradients weigh differently); default ``cfg.inner``.
    ``arrival`` (overlapped): the inner step d of round r at which replica i applies round r-1's average
    (``arrival_step``: an int, a dict ``{(r, i): d}`` or a callable; default the round's end, d = H).
    ``speeds``: each replica's speed relative to the fastest (1.0), as in rounds bounded by time: replica i trains
    ``steps_in_round(H, speeds[i])`` inner steps a round, its LR schedule striding H over them (``Trainer.stride``);
    ``contribution``: how its pseudo-gradient counts (``contribution_scale``). ``refusals``: (round, replica) pairs
    where the replica refused the round's average and took the others' state instead, as a swarm's peer does: its
    weights are the others', and its error feedback goes back to before the round (``ErrorFeedback.undo``)."""
    started = time.perf_counter()
    wire = get_codec(codec, cfg.averaging.topk_density, cfg.averaging.topk_bits)
    aggregation = cfg.averaging.aggregation
    suffix = "" if aggregation == "mean" else f"-{aggregation}"
    run = SimRun(f"diloco-k{replicas}-{codec}-{overlap}{suffix}", "diloco", replicas, codec, overlap, aggregation)
    trainers = trainers_for(cfg, replicas, init, inner)
    outers = [OuterOptimizer(t.model, cfg.outer) for t in trainers]
    error_feedback = error_feedback or wire.returns_dropped  # (a sparse codec's always, as in the swarm)
    feedback = [ErrorFeedback(wire, cfg.averaging.feedback_decay) if error_feedback else None for _ in trainers]
    run.tokens.append(0)
    run.eval_loss.append(trainers[0].evaluate())
    pending = None  # overlapped: the average of the previous round, applied at the end of this one
    tokens = all_bytes = 0
    for rnd in range(1, rounds + 1):
        starts = [replica_copy(t.model) for t in trainers]  # (fp32 on the host, as the swarm keeps it)
        weights = []
        own = []
        sent = []
        for i, (trainer, outer, fb, start) in enumerate(zip(trainers, outers, feedback, starts)):
            H = cfg.outer.inner_steps
            steps = steps_in_round(H, speeds[i]) if speeds else H
            trainer.stride = H / steps
            arrived = None if pending is None else (arrival_step(arrival, rnd, i, steps), pending)
            held, delta, size, trained = _local_round(trainer, outer, fb, start, wire, overlap, steps, arrived,
                                                      contribution_scale(contribution, steps, H))
            trainer.step = rnd * H  # the round's end, whatever the steps
            tokens += trained
            weights.append(trained)
            own.append(held)
            sent.append(delta)
            all_bytes += allreduce_bytes(replicas, size)
        average, refused = _group_round(own, sent, weights, wire, cfg, feedback,
                                        {i for r, i in refusals if r == rnd})
        run.refused += refused
        pending = _apply(outers, starts, average, pending, overlap)
        if on_round is not None:
            on_round(rnd, outers[0].params)
        run.tokens.append(tokens)
        run.eval_loss.append(evaluate_outer(outers[0], trainers[0].evaluate))
    if pending is not None:  # overlapped: the last round's average arrives after the run; apply it to score
        for outer in outers:
            outer.step(pending)
        run.eval_loss[-1] = trainers[0].evaluate()
    run.bytes_per_replica = round(all_bytes / replicas)
    run.seconds = time.perf_counter() - started
    return run


def _group_round(own: list[list[torch.Tensor]], sent: list[list[torch.Tensor]], weights: list[int], wire,
                 cfg: PeerConfig, feedback: list[ErrorFeedback | None],
                 refusing: set[int]) -> tuple[list[torch.Tensor], int]:
    """The round's average as the swarm computes it (``group_average``; a lone replica's own, through the wire) and
    the contributions its checks would refuse. Then each replica's error feedback, as its averager in a swarm: the
    ``refusing`` replicas' goes back to before the round, the others' takes back what the average dropped."""
    if len(sent) == 1:  # nothing to average with
        average, refused = roundtrip_all(wire, sent[0])[0], 0
    else:
        average, refused = group_average(own, sent, weights, wire, cfg.averaging)
    for i, fb in enumerate(feedback):
        if fb is not None and i in refusing:
            fb.undo()
        elif fb is not None:
            fb.settle(average)
    return average, refused


def run_baseline(cfg: PeerConfig, kind: str, replicas: int, rounds: int,
                 init: dict[str, torch.Tensor] | None = None) -> SimRun:
    """``single`` (batch B) or ``kx_batch`` (batch K*B) for rounds*H inner steps on the whole corpus."""
    started = time.perf_counter()
    accum = cfg.inner.grad_accum * (replicas if kind == "kx_batch" else 1)
    inner = cfg.inner.model_copy(update={"grad_accum": accum})
    trainer = Trainer(_model(cfg, init), _corpus(cfg, 0, 1), inner)
    workers = replicas if kind == "kx_batch" else 1
    run = SimRun(f"{kind}-k{replicas}" if kind == "kx_batch" else "single", kind, workers)
    run.tokens.append(0)
    run.eval_loss.append(trainer.evaluate())
    H = cfg.outer.inner_steps
    tokens = 0
    gradient_bytes = 4 * sum(p.numel() for p in trainer.model.parameters())
    for _ in range(rounds):
        tokens += trainer.train_steps(H).tokens
        run.bytes_per_replica += H * allreduce_bytes(workers, gradient_bytes)
        run.tokens.append(tokens)
        run.eval_loss.append(trainer.evaluate())
    run.seconds = time.perf_counter() - started
    return run


def plot_runs(runs: list[SimRun], png: Path) -> Path:
    """Eval loss against tokens processed, one curve per run, into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        ax.plot(run.tokens, run.eval_loss, marker=".", label=f"{run.name} (ppl {run.final_ppl:.2f})")
    ax.set(xlabel="tokens processed (all replicas)", ylabel="eval loss", title="DiLoCo vs baselines")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


def format_table(runs: list[SimRun]) -> str:
    """The runs side by side: tokens, final eval loss and perplexity, perplexity against Kx-batch, traffic."""
    kx = {r.replicas: r for r in runs if r.kind == "kx_batch"}
    lines = [f"{'run':<28} {'tokens':>11} {'eval loss':>9} {'ppl':>8} {'vs Kx-batch':>11} {'MB/replica':>11}"]
    for r in runs:
        ref = kx.get(r.replicas)
        rel = f"{(r.final_ppl / ref.final_ppl - 1) * 100:+.2f}%" if ref is not None else "-"
        lines.append(f"{r.name:<28} {r.tokens[-1]:>11,} {r.eval_loss[-1]:>9.4f} {r.final_ppl:>8.3f} {rel:>11} "
                     f"{r.bytes_per_replica / 1e6:>11.2f}")
    return "\n".join(lines)


def run_simulate(args, cfg: PeerConfig) -> int:
    """``diloco-peer simulate``: the baselines and the DiLoCo run, then ``simulate.json``, the plot and the table."""
    if args.replicas < 1 or args.rounds < 1 or args.pretrain < 0:
        print(f"diloco-peer: error: --replicas ({args.replicas}) and --rounds ({args.rounds}) must be >= 1 "
              f"and --pretrain ({args.pretrain}) >= 0", file=sys.stderr)
        return 2
    get_codec(args.codec)  # a bad name fails before anything runs
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    out = Path(args.out)
    init = None
    if args.pretrain:
        started = time.perf_counter()
        init = pretrain(cfg, args.pretrain)
        print(f"simulate: pretrained {args.pretrain} steps in {time.perf_counter() - started:.0f}s", flush=True)
    runs = []
    plan = [("diloco", args.codec, args.overlap)]
    if not args.no_baselines:
        plan = [("single", "", ""), ("kx_batch", "", ""), *plan]
    for kind, codec, overlap in plan:
        if kind == "diloco":
            run = run_diloco(cfg, args.replicas, args.rounds, codec, overlap, args.error_feedback, init=init)
        else:
            run = run_baseline(cfg, kind, args.replicas, args.rounds, init=init)
        runs.append(run)
        refused = f", {run.refused} honest contributions refused by the checks" if run.refused else ""
        print(f"simulate: {run.name}: eval loss {run.eval_loss[0]:.4f} -> {run.eval_loss[-1]:.4f} "
              f"(ppl {run.final_ppl:.3f}) in {run.seconds:.0f}s{refused}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps({"runs": [r.to_dict() for r in runs], "rounds": args.rounds,
                                                   "inner_steps": cfg.outer.inner_steps, "pretrain": args.pretrain},
                                                  indent=2))
    png = plot_runs(runs, out / "eval_loss.png")
    print(format_table(runs))
    print(f"simulate: results in {out / 'simulate.json'}, plot in {png}")
    return 0

"""Rounds by fragments (Streaming DiLoCo), simulated: what a swarm would compute if it synced its parameters in
P fragments staggered through the round instead of all at once. A study engine for ``bench/overlap_quality.py
--fragments``; the swarm itself syncs all its parameters in one all-reduce per round.

Why it matters to overlapped rounds: an eager replica trains on a stand-in for the round's average (its own
pseudo-gradient, ``overlap_offset``) until the average arrives, and what this costs grows with the stand-in's
lifetime (measured: BENCHMARKS.md, "The average applied as soon as it arrives"). On a link where the exchange of
all parameters takes f*H inner steps, a
fragment of 1/P of the bytes takes f*H/P: each fragment's stand-in lives P times shorter, whatever the link.

The schedule (Douillard et al. 2025, "Streaming DiLoCo"): the parameters are cut into P fragments of about equal
size, in the model's order (``fragments_of``). Fragment p's rounds end at the inner steps s with
``(s + o_p) % H == 0``, ``o_p = round(p * H / P)``: every fragment syncs every H steps (its first round is
H - o_p steps long), and the syncs of the P fragments are spread evenly over the round, so one fragment's
exchange is in flight at a time while it takes under H/P steps. At the run's end every fragment syncs what it
has (a last, shorter round), so that the score includes every step.

Each fragment's round is computed as ``simulate.run_diloco`` computes a round over all parameters: its own
``OuterOptimizer`` over the fragment's parameters (the replica's own tensors, so that it loads into the
replica), its pseudo-gradient through the codec, the reducers' part-by-part aggregation
(``simulated_allreduce.group_average``), and then either the outer step at once (blocking) or, overlapped, the
previous average's outer step plus ``overlap_offset`` from the own progress, with the average applied ``arrival``
inner steps after the sync (``correct_on_arrival``). With P = 1 this computes what ``run_diloco`` computes, to the
bit (tests/test_simulate.py).
"""

from __future__ import annotations

import time

import torch

from ..averaging.compression import get_codec
from ..config import PeerConfig
from ..training.outer_optimizer import OuterOptimizer, correct_on_arrival, progress_since, replica_copy
from .simulate import SimRun, continue_overlapped, trainers_for
from .simulated_allreduce import allreduce_bytes, group_average, roundtrip_all


def fragments_of(model: torch.nn.Module, count: int) -> list[list[int]]:
    """The indices of ``model.parameters()`` in each of ``count`` fragments: consecutive tensors, about
    equal in size (a tensor goes where its middle falls). A tensor is never split."""
    sizes = [p.numel() for p in model.parameters()]
    if not 1 <= count <= len(sizes):
        raise ValueError(f"fragments={count}: the model has {len(sizes)} parameter tensors; pick 1..{len(sizes)}")
    total = sum(sizes)
    done = 0
    fragments: list[list[int]] = [[] for _ in range(count)]
    for index, size in enumerate(sizes):
        fragments[min(count - 1, (2 * done + size) * count // (2 * total))].append(index)
        done += size
    if not all(fragments):
        raise ValueError(f"fragments={count}: a fragment would be empty (one tensor outweighs the rest); pick fewer")
    return fragments


class _Fragment:
    """One fragment of every replica: its outer optimizers, where its round started, its average in flight."""

    def __init__(self, cfg: PeerConfig, trainers, indices: list[int], offset: int):
        self.offset = offset
        self.outers = []
        for trainer in trainers:
            params = list(trainer.model.parameters())
            self.outers.append(OuterOptimizer(torch.nn.ParameterList([params[i] for i in indices]), cfg.outer))
        self.starts = [replica_copy(o.model) for o in self.outers]
        self.tokens = [0] * len(trainers)
        """Tokens each replica trained since this fragment's last sync (its weight in the average)."""
        self.pending: list[torch.Tensor] | None = None
        """Overlapped: the last sync's average, in flight until its outer step at the next sync."""
        self.arrives_at: int | None = None
        """The inner step at which ``pending`` reaches the replicas (None: at the next sync)."""

    def syncs_at(self, step: int, H: int, last: int) -> bool:
        return (step + self.offset) % H == 0 or step == last

    def arrive(self) -> None:
        """Overlapped: the average in flight reaches every replica (``correct_on_arrival``)."""
        for outer, start in zip(self.outers, self.starts):
            correct_on_arrival(outer, self.pending, start)
        self.arrives_at = None

    def sync(self, cfg: PeerConfig, wire, codec: str, overlap: str, run: SimRun) -> int:
        """This fragment's round ends on every replica: average, outer step, next round's start. Returns the bytes
        all replicas together moved."""
        own = []
        sent = []
        moved = 0
        for outer, start in zip(self.outers, self.starts):
            if overlap == "blocking":
                delta = outer.pseudo_gradient()
            else:  # this round's own progress, fp32 on the host
                delta = [-d for d in progress_since(outer.model, start)]
            arrived, size = roundtrip_all(wire, delta)
            own.append(delta)
            sent.append(arrived)
            moved += allreduce_bytes(len(self.outers), size)
        if len(self.outers) == 1:
            average = sent[0]
        else:
            average, refused = group_average(own, sent, self.tokens, wire, cfg.averaging)
            run.refused += refused
        self.tokens = [0] * len(self.outers)
        for outer, start in zip(self.outers, self.starts):
            if overlap == "blocking":
                outer.step(average)
            else:
                continue_overlapped(outer, start, self.pending, overlap)
        self.starts = [replica_copy(o.model) for o in self.outers]
        if overlap != "blocking":
            self.pending = average
        return moved

    def finish(self) -> None:
        """Overlapped, at the run's end: the last average arrives and is applied, to score every step."""
        if self.pending is not None:
            for outer in self.outers:
                outer.step(self.pending)
            self.pending = None


def _evaluate(trainer, fragments: list[_Fragment]) -> float:
    """Eval loss of replica 0's outer weights, all fragments' (the replica's own weights are put back after)."""
    live = [p.detach().clone() for p in trainer.model.parameters()]
    for fragment in fragments:
        fragment.outers[0].load_into_model()
    try:
        return trainer.evaluate()
    finally:
        with torch.no_grad():
            for p, saved in zip(trainer.model.parameters(), live):
                p.copy_(saved)


def run_streaming(cfg: PeerConfig, replicas: int, rounds: int, fragments: int, codec: str = "none",
                  overlap: str = "blocking", init: dict[str, torch.Tensor] | None = None,
                  arrival: int | None = None) -> SimRun:
    """K replicas for ``rounds`` * H inner steps, synced by ``fragments`` staggered fragments (module doc), from
    ``init`` (``simulate.pretrain``) or from scratch. ``arrival`` (overlapped): the inner steps between a
    fragment's sync and its average reaching the replicas (default: at the fragment's next sync). Eval loss is
    measured every H steps on the outer weights."""
    started = time.perf_counter()
    H = cfg.outer.inner_steps
    wire = get_codec(codec, cfg.averaging.topk_density, cfg.averaging.topk_bits)
    if wire.returns_dropped:
        raise ValueError(f"codec {codec!r} needs error feedback, which rounds by fragments do not model: "
                         f"use run_diloco for it")
    last = rounds * H
    run = SimRun(f"streaming-p{fragments}-k{replicas}-{codec}-{overlap}", "diloco", replicas, codec, overlap,
                 cfg.averaging.aggregation)
    trainers = trainers_for(cfg, replicas, init)
    parts = [_Fragment(cfg, trainers, indices, round(p * H / fragments))
             for p, indices in enumerate(fragments_of(trainers[0].model, fragments))]
    run.tokens.append(0)
    run.eval_loss.append(trainers[0].evaluate())
    step = tokens = moved = 0
    while step < last:
        syncs = (s for s in range(step + 1, last + 1) if any(f.syncs_at(s, H, last) for f in parts))
        until = min([f.arrives_at for f in parts if f.arrives_at is not None] + [next(syncs)])
        for i, trainer in enumerate(trainers):
            trained = trainer.train_steps(until - step).tokens
            tokens += trained
            for fragment in parts:
                fragment.tokens[i] += trained
        step = until
        for fragment in parts:  # fragments hold disjoint tensors: the order of their events does not matter
            if fragment.arrives_at == step:
                fragment.arrive()
            if fragment.syncs_at(step, H, last):
                moved += fragment.sync(cfg, wire, codec, overlap, run)
                if fragment.pending is not None and arrival is not None and arrival < H and step + arrival < last:
                    fragment.arrives_at = step + arrival
                    if arrival == 0:  # before any inner step of the next round (the next sync is ahead)
                        fragment.arrive()
        if step % H == 0:
            if step == last:
                for fragment in parts:
                    fragment.finish()
            run.tokens.append(tokens)
            run.eval_loss.append(_evaluate(trainers[0], parts))
    run.bytes_per_replica = round(moved / replicas)
    run.seconds = time.perf_counter() - started
    return run

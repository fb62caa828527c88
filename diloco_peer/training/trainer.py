"""The inner loop: H steps of AdamW on this peer's shard, between two outer rounds.

Plain PyTorch with no swarm in sight: linear warmup + cosine decay, gradient accumulation, gradient
clipping and bf16 autocast where the device supports it. The loop never talks to the DHT and never
syncs with the host more than once per step (the loss for the log), so the daemon costs nothing here.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from ..config import ConfigError, InnerConfig
from .data import Corpus


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"inner.device={name!r} but this machine has no usable CUDA GPU: "
                          f"use inner.device=auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("inner.device='mps' but Apple's MPS backend is not available: use inner.device=auto or cpu")
    return torch.device(name)


def lr_factor(step: int, cfg: InnerConfig) -> float:
    """Multiplier of ``cfg.lr`` at inner step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class InnerStats:
    steps: int
    tokens: int
    loss: float
    """Mean training loss over the steps."""
    seconds: float
    lr: float


class Trainer:
    """Owns the model replica on its device and the inner AdamW; counts inner steps for the schedule.

    :param model: the replica (moved to ``device`` here)
    :param corpus: where batches come from
    :param cfg: the ``[inner]`` section
    """

    def __init__(self, model: torch.nn.Module, corpus: Corpus, cfg: InnerConfig):
        self.cfg = cfg
        self.corpus = corpus
        self.device = pick_device(cfg.device)
        self.model = model.to(self.device)
        use_bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        )
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms: no weight decay
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.betas), fused=self.device.type == "cuda",
        )
        self.position = 0.0
        """The LR-schedule position, in inner steps (``step`` is its whole part)."""
        self.stride = 1.0
        """How far one inner step moves ``position``: 1, unless a round bounded by time gives this peer fewer steps
        than the round's H (then H over its steps: its schedule keeps pace with the swarm's, see rounds/pace.py)."""

    @property
    def step(self) -> int:
        """The LR-schedule position in whole inner steps: where a checkpoint or a synced state puts it."""
        return int(self.position)

    @step.setter
    def step(self, value: int) -> None:
        self.position = float(value)

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def current_lr(self) -> float:
        return self.cfg.lr * lr_factor(self.step, self.cfg)

    def train_steps(self, num_steps: int, should_stop=lambda: False) -> InnerStats:
        """Run up to ``num_steps`` inner steps; stops early (after a whole step) when ``should_stop()``."""
        self.model.train()
        started = time.perf_counter()
        tokens = 0
        done = 0
        loss_sum = torch.zeros((), device=self.device)
        lr = self.current_lr()
        for _ in range(num_steps):
            if should_stop():
                break
            lr = self.current_lr()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            for _ in range(self.cfg.grad_accum):
                batch = self.corpus.train_batch(self.cfg.batch_size).to(self.device, non_blocking=True)
                with self._autocast():
                    loss = self.model(batch[:, :-1], batch[:, 1:]) / self.cfg.grad_accum
                loss.backward()
                loss_sum += loss.detach()
                tokens += batch[:, :-1].numel()
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.position += self.stride
            done += 1
        mean_loss = loss_sum.item() / max(done, 1)  # the only host sync of the whole call
        return InnerStats(done, tokens, mean_loss, time.perf_counter() - started, lr)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed eval windows (identical on every peer)."""
        self.model.eval()
        losses = []
        for batch in self.corpus.eval_batches(self.cfg.batch_size):
            batch = batch.to(self.device)
            with self._autocast():
                losses.append(self.model(batch[:, :-1], batch[:, 1:]).float())
        return torch.stack(losses).mean().item()


class ComputeThread:
    """The one thread that runs a peer's torch work (training, eval, outer steps) with ``threads``
    intra-op threads; every other thread of the process runs torch single-threaded from then on.

    Why one: each thread that runs a parallel torch op leads its own OpenMP team, and once libgomp manages
    more threads than there are cores it stops spin-waiting between ops and puts its workers to sleep
    after each one: training steps sent to whichever ``asyncio.to_thread`` worker was free ran at half a bare
    loop's speed, on this thread at its full speed (``bench/daemon_overhead.py``; measured: BENCHMARKS.md,
    "Hiding the network", "What the numbers say", daemon overhead).
    """

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=_own_threads,
                                        initargs=(threads,))
        self._pool.submit(int).result()  # the initializer has run: that thread keeps ``threads``
        torch.set_num_threads(1)  # the calling thread, and every thread that starts torch work from now on

    async def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _own_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    # torch applies the thread count to a thread at its first parallel op, from a process-wide value that
    # ComputeThread resets to 1 next; get_num_threads() makes this thread take ``threads`` now
    torch.get_num_threads()


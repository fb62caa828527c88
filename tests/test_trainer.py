"""The inner loop: LR schedule, learning, early stop, accumulation, weight-decay groups, precision."""

import itertools
import math
import subprocess
import sys

import pytest
import torch

from diloco_peer.config import ConfigError, InnerConfig, load_config
from diloco_peer.training.data import Corpus
from diloco_peer.training.model import build_model
from diloco_peer.training.trainer import Trainer, lr_factor, pick_device

SMALL = ["data.max_bytes=300_000", "data.seq_len=32", "data.num_shards=2", "model.max_seq_len=32",
         "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "inner.batch_size=8",
         "inner.device=cpu"]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """One shard for the whole module: the trainers only differ in their [inner] settings."""
    cfg = load_config(None, SMALL)
    return Corpus(cfg.data, 0, cfg.model.vocab_size)


def make_trainer(corpus: Corpus, *overrides: str) -> Trainer:
    cfg = load_config(None, [*SMALL, *overrides])
    return Trainer(build_model(cfg.model, 0), corpus, cfg.inner)


def test_linear_warmup():
    cfg = InnerConfig(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    for step in range(10):
        assert math.isclose(lr_factor(step, cfg), (step + 1) / 10)


def test_cosine_decay_to_the_floor():
    cfg = InnerConfig(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_factor(10, cfg) == 1.0
    assert math.isclose(lr_factor(60, cfg), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(110, cfg), 0.1)
    assert all(math.isclose(lr_factor(step, cfg), 0.1) for step in (111, 500, 10**6))
    decay = [lr_factor(step, cfg) for step in range(10, 111)]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_no_warmup_starts_at_the_peak():
    assert lr_factor(0, InnerConfig(warmup_steps=0, total_steps=100)) == 1.0


def test_loss_goes_down(corpus):
    trainer = make_trainer(corpus, "inner.lr=3e-3", "inner.warmup_steps=5")
    before = trainer.evaluate()
    stats = trainer.train_steps(30)
    assert stats.steps == 30 and trainer.step == 30
    assert math.isfinite(stats.loss)
    assert trainer.evaluate() < before - 0.5


def test_step_counts_across_calls_and_drives_the_schedule(corpus):
    trainer = make_trainer(corpus, "inner.warmup_steps=10")
    trainer.train_steps(2)
    stats = trainer.train_steps(3)
    assert trainer.step == 5 and stats.steps == 3
    assert math.isclose(stats.lr, trainer.cfg.lr * 5 / 10)
    assert math.isclose(trainer.current_lr(), trainer.cfg.lr * 6 / 10)


def test_should_stop_ends_the_call_early(corpus):
    trainer = make_trainer(corpus)
    stats = trainer.train_steps(10, should_stop=lambda: trainer.step >= 2)
    assert stats.steps == 2 and trainer.step == 2


def test_tokens_per_step_with_gradient_accumulation(corpus):
    trainer = make_trainer(corpus, "inner.grad_accum=2", "inner.batch_size=4")
    stats = trainer.train_steps(3)
    assert stats.steps == 3
    assert stats.tokens == 3 * 2 * 4 * corpus.cfg.seq_len


def test_norm_weights_have_no_weight_decay(corpus):
    trainer = make_trainer(corpus, "inner.weight_decay=0.05")
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    no_decay_ids = {id(p) for p in no_decay["params"]}
    norms = [p for name, p in trainer.model.named_parameters() if name.endswith("norm.weight")]
    assert norms and all(id(p) in no_decay_ids for p in norms)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))


def test_bf16_autocast_on_cpu_trains(corpus):
    trainer = make_trainer(corpus, "inner.precision=bf16")
    assert trainer.autocast_dtype == torch.bfloat16
    stats = trainer.train_steps(2)
    assert math.isfinite(stats.loss) and math.isfinite(trainer.evaluate())


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_fp32_on_cpu(corpus, precision):
    assert make_trainer(corpus, f"inner.precision={precision}").autocast_dtype is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_asking_for_a_missing_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="inner.device='cuda'.*auto or cpu"):
        pick_device("cuda")


COMPUTE_THREAD_PROBE = """
import asyncio, threading, torch
from diloco_peer.training.trainer import ComputeThread

async def main():
    compute = ComputeThread(3)
    try:
        on_compute = await compute.run(lambda: (threading.current_thread().name, torch.get_num_threads()))
        elsewhere = await asyncio.to_thread(torch.get_num_threads)
        print(on_compute[0].split("_")[0], on_compute[1], torch.get_num_threads(), elsewhere)
    finally:
        compute.close()

asyncio.run(main())
"""


def test_the_compute_thread_alone_runs_torch_multithreaded():
    # in a subprocess: the probe changes this process's torch thread settings for good
    out = subprocess.run([sys.executable, "-c", COMPUTE_THREAD_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["compute", "3", "1", "1"]  # compute thread, event loop thread, a worker

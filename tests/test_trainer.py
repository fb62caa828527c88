"""The inner loop: schedule, learning, early stop, accumulation, weight-decay groups, bf16 autocast."""

import math

import pytest
import torch

from diloco_peer.config import ConfigError, InnerConfig, load_config
from diloco_peer.data import Corpus
from diloco_peer.model import build_model
from diloco_peer.trainer import Trainer, lr_factor, pick_device

SMALL = ["data.max_bytes=400_000", "data.seq_len=32", "data.num_shards=2", "model.max_seq_len=32",
         "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "inner.batch_size=8"]


def make_trainer(*extra):
    cfg = load_config(None, [*SMALL, *extra])
    return Trainer(build_model(cfg.model, 0), Corpus(cfg.data, 0, cfg.model.vocab_size), cfg.inner), cfg


def test_warmup_then_cosine():
    cfg = InnerConfig(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr_factor(10, cfg) == 1.0
    assert math.isclose(lr_factor(60, cfg), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(110, cfg), 0.1) and math.isclose(lr_factor(500, cfg), 0.1)
    factors = [lr_factor(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


def test_loss_goes_down():
    trainer, _ = make_trainer()
    before = trainer.evaluate()
    stats = trainer.train_steps(30)
    assert stats.steps == 30 and trainer.step == 30
    assert trainer.evaluate() < before - 0.5


def test_stops_early_and_counts_tokens_with_accumulation():
    trainer, cfg = make_trainer("inner.grad_accum=2", "inner.batch_size=4")
    calls = []
    stats = trainer.train_steps(10, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert stats.steps == 2 and trainer.step == 2
    assert stats.tokens == 2 * 2 * 4 * cfg.data.seq_len


def test_norms_have_no_weight_decay():
    trainer, cfg = make_trainer()
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == cfg.inner.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() < 2 for p in no_decay["params"]) and all(p.dim() >= 2 for p in decay["params"])


def test_bf16_autocast_on_cpu_trains():
    trainer, _ = make_trainer("inner.precision=bf16")
    assert trainer.autocast_dtype is not None
    stats = trainer.train_steps(3)
    assert math.isfinite(stats.loss) and math.isfinite(trainer.evaluate())


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_fp32_on_cpu(precision):
    trainer, _ = make_trainer(f"inner.precision={precision}")
    assert trainer.autocast_dtype is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_asking_for_a_missing_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="inner.device='cuda'.*auto or cpu"):
        pick_device("cuda")

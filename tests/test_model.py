"""The Llama-style decoder: deterministic init, shapes, initial loss, causality, GQA, tied embeddings."""

import math
import subprocess
import sys

import pytest
import torch

from diloco_peer.config import load_config
from diloco_peer.training.model import build_model, meta_model, param_sha256

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.max_seq_len=32",
         "data.seq_len=32"]


def small_model(*overrides: str, seed: int = 0):
    return build_model(load_config(None, [*SMALL, *overrides]).model, seed)


def random_tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_init_is_a_function_of_the_seed():
    first = param_sha256(small_model(seed=0).parameters())
    assert param_sha256(small_model(seed=0).parameters()) == first
    assert param_sha256(small_model(seed=1).parameters()) != first


def test_logits_shape_and_initial_loss():
    model = small_model()
    tokens = random_tokens(3, 17)
    with torch.no_grad():
        assert model(tokens).shape == (3, 17, 256)
        loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.5


def test_changing_a_token_only_changes_later_logits():
    model = small_model()
    tokens = random_tokens(1, 16)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_grouped_query_attention_runs_forward_and_backward():
    model = small_model("model.num_heads=4", "model.num_kv_heads=2")
    attn = model.blocks[0].attn
    assert attn.q_proj.weight.shape == (32, 32) and attn.k_proj.weight.shape == (16, 32)
    tokens = random_tokens(2, 9)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item())
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert attn.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings(tied):
    model = small_model(f"model.tie_embeddings={str(tied).lower()}")
    assert (model.lm_head.weight is model.embed.weight) == tied


def test_a_meta_model_has_the_real_ones_shapes_and_costs_no_meta_op():
    """``meta_model``: the parameters' names and shapes of ``build_model``'s, on the meta device, built without an op
    on a meta tensor: torch's meta ops are Python imported at first use, which took every peer's start about a
    CPU-second (twice: the memory check, the averager's buffers). Timed in a fresh process, where that import has
    not happened yet; in CPU time, which another process's load does not inflate."""
    cfg = load_config(None, SMALL).model
    real, meta = build_model(cfg, 0), meta_model(cfg)
    assert [(n, p.shape) for n, p in real.named_parameters()] == [(n, p.shape) for n, p in meta.named_parameters()]
    assert all(p.device.type == "meta" for p in meta.parameters())
    code = ("import time; from diloco_peer.config import load_config; from diloco_peer.training.model import "
            "meta_model; cfg = load_config('llama-1b', []).model; started = time.process_time(); meta_model(cfg); "
            "print(time.process_time() - started)")
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert seconds < 0.3, seconds  # a model built on the meta device the plain way: ~1 s here


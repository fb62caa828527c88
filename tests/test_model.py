"""The Llama-style decoder: deterministic init, shapes, causality, GQA, tied embeddings."""

import math

import pytest
import torch

from diloco_peer.config import load_config
from diloco_peer.model import build_model, param_sha256

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.max_seq_len=32",
         "data.seq_len=32"]


def small_model(*extra: str, seed: int = 0):
    return build_model(load_config(None, [*SMALL, *extra]).model, seed)


def test_init_is_a_function_of_the_seed():
    assert param_sha256(small_model().parameters()) == param_sha256(small_model().parameters())
    assert param_sha256(small_model().parameters()) != param_sha256(small_model(seed=1).parameters())


def test_shapes_and_initial_loss():
    model = small_model()
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    assert model(tokens).shape == (3, 17, 256)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.5


def test_causal():
    model = small_model()
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_grouped_query_attention_trains():
    model = small_model("model.num_heads=4", "model.num_kv_heads=2")
    assert model.blocks[0].attn.k_proj.weight.shape == (16, 32)
    tokens = torch.randint(0, 256, (2, 9))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings(tied):
    model = small_model(f"model.tie_embeddings={str(tied).lower()}")
    assert (model.lm_head.weight is model.embed.weight) == tied

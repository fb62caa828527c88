"""The outer optimizer against the reference formulas of Nesterov and classic momentum SGD."""

import pytest
import torch

from diloco_peer.config import OuterConfig, load_config
from diloco_peer.training.model import build_model
from diloco_peer.training.outer_optimizer import OuterOptimizer

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.max_seq_len=32",
         "data.seq_len=32"]


def make(cfg: OuterConfig) -> tuple[torch.nn.Module, OuterOptimizer]:
    """A tiny Llama (tied embeddings: a shared parameter must be handled once) and its outer optimizer."""
    model = build_model(load_config(None, SMALL).model, seed=0)
    return model, OuterOptimizer(model, cfg)


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Stand-in for H inner steps: move every weight a little."""
    torch.manual_seed(seed)
    for p in model.parameters():
        p.add_(0.01 * torch.randn_like(p))


def test_outer_weights_start_as_a_copy_of_the_replica():
    model, outer = make(OuterConfig())
    replica = list(model.parameters())
    assert len(outer.params) == len(replica)
    for o, p in zip(outer.params, replica):
        assert torch.equal(o, p.detach()) and o.data_ptr() != p.data_ptr()


def test_pseudo_gradient_is_outer_minus_replica():
    model, outer = make(OuterConfig())
    perturb(model)
    grads = outer.pseudo_gradient()
    assert len(grads) == len(outer.params)
    for g, o, p in zip(grads, outer.params, model.parameters()):
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        assert torch.equal(g, o.detach() - p.detach())
        assert g.abs().sum() > 0


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "classic"])
def test_three_steps_match_the_reference_formula(nesterov):
    lr, momentum = 0.7, 0.9
    model, outer = make(OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov))
    expected = [p.detach().double().clone() for p in model.parameters()]
    buffers = [None] * len(expected)
    torch.manual_seed(1)
    for step in range(3):
        grads = [0.01 * torch.randn(p.shape) for p in expected]
        outer.step(grads)
        for i, g in enumerate(grads):
            g = g.double()
            buffers[i] = g.clone() if step == 0 else momentum * buffers[i] + g
            update = g + momentum * buffers[i] if nesterov else buffers[i]
            expected[i] = expected[i] - lr * update
        for got, want in zip(outer.params, expected):
            torch.testing.assert_close(got.detach(), want.float(), rtol=1e-6, atol=1e-7)


def test_step_loads_the_outer_weights_into_the_replica():
    model, outer = make(OuterConfig())
    for epoch in range(1, 3):
        perturb(model, seed=epoch)
        outer.step(outer.pseudo_gradient())
        assert outer.epoch == epoch
        for p, o in zip(model.parameters(), outer.params):
            assert torch.equal(p.detach(), o.detach())


def test_step_leaves_the_callers_pseudo_gradient_alone():
    model, outer = make(OuterConfig())
    perturb(model)
    grads = outer.pseudo_gradient()
    kept = [g.clone() for g in grads]
    outer.step(grads)
    outer.step(grads)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept))


def test_unit_lr_without_momentum_adopts_the_replica():
    model, outer = make(OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    perturb(model)
    trained = [p.detach().clone() for p in model.parameters()]
    outer.step(outer.pseudo_gradient())
    for o, t in zip(outer.params, trained):
        torch.testing.assert_close(o.detach(), t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (False, 0.0)])
def test_lookahead_is_the_displacement_of_the_step_it_predicts(nesterov, momentum):
    """Eager rounds start from ``outer + lookahead(g)``: exactly where ``step(g)`` would take the outer weights,
    momentum included (a first step and a later one), while the outer state itself does not move."""
    cfg = OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov)
    model, outer = make(cfg)
    for seed in (1, 2):
        perturb(model, seed)
        g = outer.pseudo_gradient()
        before = [p.clone() for p in outer.params]
        buffers = outer.momentum_buffers()
        predicted = outer.lookahead(g)
        assert all(torch.equal(a, b) for a, b in zip(before, outer.params))  # predicting moves nothing
        assert all(torch.equal(a, b) for a, b in zip(buffers, outer.momentum_buffers()))
        outer.step(g)
        for b, p, d in zip(before, outer.params, predicted):
            torch.testing.assert_close(b + d, p, rtol=0, atol=1e-6)


def test_overlap_offset_per_mode():
    """delayed keeps the own progress; eager predicts the outer step from it (plain SGD: -lr * (-progress))."""
    from diloco_peer.training.outer_optimizer import overlap_offset

    model, outer = make(OuterConfig(lr=0.5, momentum=0.0, nesterov=False))
    progress = [torch.full_like(p, 0.2) for p in outer.params]
    assert overlap_offset(outer, "delayed", progress) is progress
    assert all(torch.allclose(d, torch.full_like(d, 0.1)) for d in overlap_offset(outer, "eager", progress))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run it on the device machine)")
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "classic"])
def test_a_step_with_the_momentum_on_a_gpu_gives_the_same_bits(nesterov):
    """A GPU peer keeps its momentum on its GPU (``outer.momentum_on``); a CPU peer on the host. Averaging together,
    they must stay bit-identical: every operation of the step rounds once, on either device."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    model = build_model(load_config(None, SMALL).model, seed=0)
    on_host, on_gpu = OuterOptimizer(model, cfg), OuterOptimizer(model, cfg, momentum_device="cuda")
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # magnitudes spread over orders of magnitude, where a fused multiply-add would round apart
        update = [torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-6, 2, p.shape, generator=gen)
                  for p in on_host.params]
        on_host.step(update)
        on_gpu.step(update)
    assert on_gpu.momentum_views[0].device.type == "cuda"
    assert all(torch.equal(a, b) for a, b in zip(on_host.params, on_gpu.params))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_host.momentum_views, on_gpu.momentum_views))
    estimate = [torch.randn(p.shape, generator=gen) for p in on_host.params]
    assert all(torch.equal(a, b) for a, b in zip(on_host.lookahead(estimate), on_gpu.lookahead(estimate)))

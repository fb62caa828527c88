"""The outer optimizer against the reference formula of Nesterov / classic momentum SGD."""

import pytest
import torch

from diloco_peer.config import OuterConfig
from diloco_peer.outer_optimizer import OuterOptimizer


def make(cfg: OuterConfig):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    return model, OuterOptimizer(model, cfg)


def test_pseudo_gradient_is_outer_minus_replica():
    model, outer = make(OuterConfig())
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    for g, s, p in zip(outer.pseudo_gradient(), start, model.parameters()):
        torch.testing.assert_close(g, s - p.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_three_steps_match_the_reference_formula(nesterov):
    lr, mu = 0.7, 0.9
    model, outer = make(OuterConfig(lr=lr, momentum=mu, nesterov=nesterov))
    params = [p.detach().double().clone() for p in model.parameters()]
    buffers = [None] * len(params)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        outer.step(grads)
        for i, g in enumerate(grads):
            g = g.double()
            buffers[i] = g.clone() if buffers[i] is None else mu * buffers[i] + g
            update = g + mu * buffers[i] if nesterov else buffers[i]
            params[i] = params[i] - lr * update
        for got, want in zip(outer.params, params):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        for replica, o in zip(model.parameters(), outer.params):
            assert torch.equal(replica.detach(), o.detach()), "the replica must be loaded with the outer weights"
        assert outer.epoch == step + 1


def test_unit_lr_without_momentum_copies_the_replica():
    model, outer = make(OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(0.1)
    trained = [p.detach().clone() for p in model.parameters()]
    outer.step(outer.pseudo_gradient())
    for o, t in zip(outer.params, trained):
        torch.testing.assert_close(o.detach(), t, rtol=1e-6, atol=1e-7)

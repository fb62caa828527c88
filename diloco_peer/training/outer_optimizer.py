"""The outer optimizer: the "global" weights of DiLoCo, kept on the CPU, and Nesterov SGD over rounds.

At the start of a round the replica equals the outer weights. After H inner steps the
*pseudo-gradient* is ``outer - replica`` (a step direction, like a gradient). The swarm averages it,
then every peer applies the same SGD step to its outer weights and copies them into its replica:

    buf   <- momentum * buf + g            (buf = g on the first step)
    step  <- g + momentum * buf            (Nesterov)   or   buf   (classic momentum)
    outer <- outer - lr * step

This is torch.optim.SGD(nesterov=True) semantics, which is what DiLoCo and OpenDiLoCo use. Peers that
start from identical outer weights and receive bit-identical averages stay bit-identical.
"""

from __future__ import annotations

import torch

from ..config import OuterConfig


class OuterOptimizer:
    """Outer weights (fp32, CPU) of a replica and the SGD optimizer that moves them.

    :param model: the replica; its parameters define the order and shapes of everything here
    :param cfg: the ``[outer]`` section (lr, momentum, nesterov)
    """

    def __init__(self, model: torch.nn.Module, cfg: OuterConfig):
        self.model = model
        self.params = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True), requires_grad=False)
            for p in model.parameters()
        ]
        self.optimizer = torch.optim.SGD(
            self.params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
        self.epoch = 0
        """Outer rounds applied so far."""
        self.lr, self.momentum, self.nesterov = cfg.lr, cfg.momentum, cfg.nesterov

    @torch.no_grad()
    def pseudo_gradient(self) -> list[torch.Tensor]:
        """``outer - replica`` for every parameter, as new fp32 CPU tensors."""
        return [outer - p.detach().to("cpu", torch.float32) for outer, p in zip(self.params, self.model.parameters())]

    @torch.no_grad()
    def step(self, averaged_pseudo_gradient: list[torch.Tensor]) -> None:
        """Apply one outer step with the (averaged) pseudo-gradient and load the result into the replica."""
        for outer, grad in zip(self.params, averaged_pseudo_gradient):
            outer.grad = grad.to(torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.epoch += 1
        self.load_into_model()

    @torch.no_grad()
    def lookahead(self, estimate: list[torch.Tensor]) -> list[torch.Tensor]:
        """The displacement ``step(estimate)`` would make, without making it (eager overlapped rounds).

        Nesterov: ``-lr * ((1 + m) * g + m^2 * buf)``; classic momentum: ``-lr * (g + m * buf)``; plain SGD
        ``-lr * g``, where ``buf`` is the momentum buffer as it is now (zeros before the first step, as in
        ``step``). Every peer adds its own to the same outer weights; the true average replaces it later."""
        m, out = self.momentum, []
        for p, g, buf in zip(self.params, estimate, self.momentum_buffers()):
            g = g.to(torch.float32)
            if self.nesterov:
                out.append(-self.lr * ((1 + m) * g + (m * m) * buf))
            else:
                out.append(-self.lr * (g + m * buf))
        return out

    @torch.no_grad()
    def load_into_model(self) -> None:
        for outer, p in zip(self.params, self.model.parameters()):
            p.copy_(outer.to(p.device, p.dtype), non_blocking=True)

    @torch.no_grad()
    def momentum_buffers(self) -> list[torch.Tensor]:
        """Copies of the Nesterov buffers (zeros before the first step: the same update, bit for bit)."""
        buffers = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            buffers.append(torch.zeros_like(p) if buf is None else buf.clone())
        return buffers

    @torch.no_grad()
    def load_state(self, params: list[torch.Tensor], buffers: list[torch.Tensor], epoch: int) -> None:
        """Replace outer weights, momentum and epoch (a checkpoint or a peer's state), then the replica."""
        if len(params) != len(self.params) or len(buffers) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors each, got {len(params)} and {len(buffers)}")
        for mine, value, buf in zip(self.params, params, buffers):
            if value.shape != mine.shape or buf.shape != mine.shape:
                raise ValueError(f"shape mismatch: {tuple(value.shape)} / {tuple(buf.shape)} vs {tuple(mine.shape)}")
            mine.copy_(value.to(torch.float32))
            self.optimizer.state[mine]["momentum_buffer"] = buf.to(torch.float32).clone()
        self.epoch = epoch
        self.load_into_model()


@torch.no_grad()
def overlap_offset(outer: OuterOptimizer, mode: str, progress: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an overlapped replica trains from, on top of the outer weights, while its last round's average is
    still in flight (``outer.overlap``; the swarm and ``diloco-peer simulate`` both call this).

    ``progress`` is the replica's own progress of the round just ended (its pseudo-gradient, negated), which
    the swarm is averaging now. ``delayed`` keeps it as it is. ``eager`` takes the outer step it predicts from
    it instead (``lookahead`` of the own pseudo-gradient, standing in for the average): the replica starts the
    next round where the swarm's outer weights will probably be, rather than one outer step behind them.
    (Predicting with the last average mixed in, ``w * own + (1 - w) * last``, diverged in the study in
    BENCHMARKS.md: averages of consecutive rounds point against each other at DiLoCo's outer lr.)"""
    if mode == "delayed":
        return progress
    return outer.lookahead([-d for d in progress])

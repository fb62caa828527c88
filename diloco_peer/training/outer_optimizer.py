"""The outer optimizer: the "global" weights of DiLoCo, kept on the CPU, and Nesterov SGD over rounds.

At the start of a round the replica equals the outer weights. After H inner steps the
*pseudo-gradient* is ``outer - replica`` (a step direction, like a gradient). The swarm averages it,
then every peer applies the same SGD step to its outer weights and copies them into its replica:

    buf   <- momentum * buf + g            (buf = 0 before the first step)
    step  <- g + momentum * buf            (Nesterov)   or   buf   (classic momentum)
    outer <- outer - lr * step

This is torch.optim.SGD(nesterov=True) semantics, which is what DiLoCo and OpenDiLoCo use, computed here one
operation at a time: each multiplication and addition rounds once (no fused multiply-add, which a GPU kernel and a
CPU's vector code may or may not use), so a step gives the same bits wherever the momentum lives. Peers that
start from identical outer weights and receive bit-identical averages stay bit-identical, CPU and GPU peers alike.

Memory: the outer weights are one flat buffer (``shared``: in shared memory, so that the averager process serves
them to a downloading peer without a copy, see ``state/state_sync.py``), 4 bytes per parameter. The momentum is
another such buffer on the host, or (``momentum_device``, a GPU peer's default: ``outer.momentum_on``) lives on
the GPU beside the replica: 4 bytes per parameter off the host, served from a copy written for each download. It
exists from the start (zeros: SGD's first step ``buf = g`` becomes ``0 * m + g``, the same value). Whoever reads
these while they may change (a checkpoint being written, a state being served) registers in ``before_change``: it
is called before every change, and either finishes reading or takes a copy of what it has not read yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Callable, Iterator

import torch

from ..config import OuterConfig

MADV_REMOVE = 9  # linux: free a range of shared memory (it reads as zeros afterwards, in every process mapping it)


def flat_tensors(shapes: list[torch.Size], shared: bool = False) -> list[torch.Tensor]:
    """fp32 zeros of ``shapes`` as views of one buffer (in shared memory if ``shared``: one file descriptor for
    all of them, where one shared tensor each would hold hundreds open)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    if shared:  # a new shared-memory file reads as zeros and takes no memory until written (no copy into it)
        storage = torch.UntypedStorage._new_shared(4 * sum(sizes))
        flat = torch.empty(0, dtype=torch.float32).set_(storage, 0, (sum(sizes),), (1,))
    else:
        flat = torch.zeros(sum(sizes), dtype=torch.float32)
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def release_pages(tensors: list[torch.Tensor]) -> bool:
    """Give the memory of shared ``flat_tensors`` back to the system until they are written again, here and in every
    process that maps them. Their values are undefined afterwards (zeros, but for a few values at the ends, which
    share a page with what lies around them): for buffers that are written whole before each use. False (nothing
    done) if they are not in shared memory."""
    if not tensors or not tensors[0].is_shared():
        return False
    storage = tensors[0].untyped_storage()
    # whole pages inside the buffer (torch's "file_system" sharing, which hivemind picks, puts a header before it)
    start = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return False
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_REMOVE) == 0


def trim_heap() -> None:
    """Hand the heap memory freed since the last call back to the system (glibc keeps it for reuse otherwise: the
    inner steps' gradients, freed after every step, would stay resident through the round, 4 bytes per
    parameter). A no-op where the C library has no ``malloc_trim``."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@torch.no_grad()
def step_tensor(outer: torch.Tensor, buf: torch.Tensor, grad: torch.Tensor, lr: float, momentum: float,
                nesterov: bool) -> None:
    """One tensor's outer step, in place: ``buf`` (the momentum) and ``outer`` (the weights) move by ``grad``. The
    one definition of the step's arithmetic: ``OuterOptimizer.step`` and a replay of logged rounds
    (``averaging/round_log.py``) must give the same bits."""
    g = grad.to(buf.device, torch.float32)  # computed where the momentum lives, one tensor at a time
    if momentum:
        buf.mul_(momentum).add_(g)
        g = buf * momentum + g if nesterov else buf  # (two operations, each rounded: see the module's doc)
    outer.sub_((g * lr).to(outer.device))


class OuterOptimizer:
    """Outer weights (fp32, CPU) of a replica and the SGD optimizer that moves them.

    :param model: the replica; its parameters define the order and shapes of everything here
    :param cfg: the ``[outer]`` section (lr, momentum, nesterov)
    :param shared: keep weights and momentum in shared memory (the daemon: its averager process serves them)
    :param momentum_device: where the momentum lives, if not on the host (a GPU peer: its training device)
    """

    def __init__(self, model: torch.nn.Module, cfg: OuterConfig, shared: bool = False,
                 momentum_device: torch.device | str | None = None):
        self.model = model
        shapes = [p.shape for p in model.parameters()]
        self.params = [torch.nn.Parameter(t, requires_grad=False) for t in flat_tensors(shapes, shared)]
        with torch.no_grad():
            for outer, p in zip(self.params, model.parameters()):
                outer.copy_(p.detach())
        device = torch.device(momentum_device or "cpu")
        # (also without momentum, which then stays zeros: a state always has one, and serves and hashes the same)
        # on a GPU one allocation per tensor: a checkpoint copies each GPU storage it writes to the host whole
        self._momentum = flat_tensors(shapes, shared) if device.type == "cpu" else \
            [torch.zeros(shape, device=device) for shape in shapes]
        self.epoch = 0
        """Outer rounds applied so far."""
        self.lr = cfg.lr
        self.momentum = cfg.momentum
        self.nesterov = cfg.nesterov
        self.pseudo_gradient_buffers: list[torch.Tensor] | None = None
        """Where ``pseudo_gradient`` writes, if set (the averager's input buffers: no copy of the model per round)."""
        self.before_change: list[Callable[[], None]] = []
        """Called before the weights, momentum or epoch change (readers that must see them unchanged)."""
        self.after_change: list[Callable[[], None]] = []
        """Called after they changed (e.g. the round's buffers, consumed now, give their memory back)."""
        self.on_step: list[Callable[[list[torch.Tensor]], None]] = []
        """Called with the update of each ``step`` before it is applied (``averaging/round_log.py`` keeps it for a peer
        that is one round behind)."""

    @property
    def momentum_views(self) -> list[torch.Tensor]:
        """The live momentum buffers (zeros before the first step, and always without momentum): read only."""
        return list(self._momentum)

    @torch.no_grad()
    def pseudo_gradient(self) -> list[torch.Tensor]:
        """``outer - replica`` for every parameter, fp32 on the CPU: in ``pseudo_gradient_buffers`` if set (valid
        until the next call), else as new tensors. Buffers that are the replica's own parameters (the daemon's
        blocking rounds on a CPU: ``model.move_parameters``) get it in place: until ``step`` or ``load_state``
        load the outer weights back into it, the replica holds the pseudo-gradient, not weights."""
        trim_heap()  # the round's buffers are about to be written: the inner steps' freed gradients go back first
        # one tensor at a time: a GPU replica comes to the host a tensor at a time, never as a whole extra copy
        replica = (p.detach().to("cpu", torch.float32) for p in self.model.parameters())
        if self.pseudo_gradient_buffers is None:
            return [outer - p for outer, p in zip(self.params, replica)]
        for outer, p, out in zip(self.params, replica, self.pseudo_gradient_buffers):
            torch.sub(outer, p, out=out)
        return list(self.pseudo_gradient_buffers)

    def _changing(self) -> None:
        for hook in list(self.before_change):
            hook()

    def _changed(self) -> None:
        for hook in list(self.after_change):
            hook()

    @torch.no_grad()
    def step(self, averaged_pseudo_gradient: list[torch.Tensor]) -> None:
        """Apply one outer step with the (averaged) pseudo-gradient and load the result into the replica."""
        for hook in list(self.on_step):
            hook(averaged_pseudo_gradient)
        self._changing()
        for outer, grad, buf in zip(self.params, averaged_pseudo_gradient, self._momentum):
            step_tensor(outer, buf, grad, self.lr, self.momentum, self.nesterov)
        self.epoch += 1
        self.load_into_model()
        self._changed()

    @torch.no_grad()
    def lookahead(self, estimate: list[torch.Tensor]) -> list[torch.Tensor]:
        """The displacement ``step(estimate)`` would make, without making it (eager overlapped rounds).

        Nesterov: ``-lr * ((1 + m) * g + m^2 * buf)``; classic momentum: ``-lr * (g + m * buf)``; plain SGD
        ``-lr * g``, where ``buf`` is the momentum buffer as it is now (zeros before the first step, as in
        ``step``). Every peer adds its own to the same outer weights; the true average replaces it later."""
        return list(self.lookahead_each(estimate))

    def lookahead_each(self, estimate: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """``lookahead``, one tensor at a time (no full-model temporary where the caller consumes each at once)."""
        m = self.momentum  # (no grad mode switched here: a generator would leave it switched between items)
        for g, buf in zip(estimate, self.momentum_views):
            g, buf = g.to(torch.float32), buf.to(g.device)
            if not m:
                yield -self.lr * g
            elif self.nesterov:
                yield -self.lr * ((1 + m) * g + (m * m) * buf)
            else:
                yield -self.lr * (g + m * buf)

    @torch.no_grad()
    def load_into_model(self) -> None:
        for outer, p in zip(self.params, self.model.parameters()):
            p.copy_(outer.to(p.device, p.dtype), non_blocking=True)

    @torch.no_grad()
    def momentum_buffers(self) -> list[torch.Tensor]:
        """Copies of the Nesterov buffers (zeros before the first step)."""
        return [buf.clone() for buf in self.momentum_views]

    @torch.no_grad()
    def load_state(self, params: list[torch.Tensor], buffers: list[torch.Tensor], epoch: int,
                   release: Callable[[torch.Tensor], None] | None = None) -> None:
        """Replace outer weights, momentum and epoch (a checkpoint or a peer's state), then the replica. Copied
        into our buffers tensor by tensor; ``release(t)`` is called once ``t`` is copied (a loader that frees
        what it read as it goes: a state is never held twice)."""
        if len(params) != len(self.params) or len(buffers) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors each, got {len(params)} and {len(buffers)}")
        for mine, value, buf in zip(self.params, params, buffers):
            if value.shape != mine.shape or buf.shape != mine.shape:
                raise ValueError(f"shape mismatch: {tuple(value.shape)} / {tuple(buf.shape)} vs {tuple(mine.shape)}")
        self._changing()
        for mine, value, buf, live in zip(self.params, params, buffers, self.momentum_views):
            mine.copy_(value.to(torch.float32))
            live.copy_(buf.to(torch.float32))
            if release is not None:
                release(value)
                release(buf)
        self.epoch = epoch
        self.load_into_model()
        self._changed()


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


def replica_copy(model: torch.nn.Module) -> list[torch.Tensor]:
    """The replica's weights, fp32 on the CPU (an overlapped round's start)."""
    return [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]


def progress_since(model: torch.nn.Module, start: list[torch.Tensor]) -> list[torch.Tensor]:
    """``replica - start``: the round's progress (relative to the true outer weights once the average arrived)."""
    return [p.detach().to("cpu", torch.float32) - s for p, s in zip(model.parameters(), start)]


@torch.no_grad()
def correct_on_arrival(outer: OuterOptimizer, average: list[torch.Tensor], start: list[torch.Tensor]) -> None:
    """Overlapped rounds: the last round's ``average`` arrived while this round trains; move the replica
    (``outer.model``) onto where it puts it. The round started at ``start`` (outer weights + the stand-in,
    ``overlap_offset``); the average's outer step will take the outer weights to ``target = outer +
    lookahead(average)`` (the displacement ``step(average)`` makes at the round's end): ``replica += target -
    start`` and ``start := target``, tensor by tensor, so that ``replica - start`` stays this round's progress,
    now relative to the true outer weights. The outer weights, momentum and epoch do not change here (the swarm
    and ``diloco-peer simulate`` both call this)."""
    for p, s, o, step in zip(outer.model.parameters(), start, outer.params, outer.lookahead_each(average)):
        target = o + step
        p.add_((target - s).to(p.device, p.dtype))
        s.copy_(target)


@torch.no_grad()
def evaluate_outer(outer: OuterOptimizer, evaluate: Callable[[], float]) -> float:
    """``evaluate()`` on the outer weights: an overlapped replica holds them plus its own progress, which is
    put back afterwards."""
    live = [p.detach().clone() for p in outer.model.parameters()]
    outer.load_into_model()
    try:
        return evaluate()
    finally:
        for p, saved in zip(outer.model.parameters(), live):
            p.copy_(saved)


CONTRIBUTIONS = ("tokens", "per_step")
"""How a pseudo-gradient of fewer inner steps than the round's H counts in the average (``contribution_scale``)."""


def contribution_scale(contribution: str, steps: int, inner_steps: int) -> float:
    """What a pseudo-gradient of ``steps`` inner steps is multiplied by before it is averaged, weighted by its tokens,
    in a round of ``inner_steps`` (H): ``tokens``, 1 (as it is: its weight is its tokens, its size its steps');
    ``per_step``, H / steps (FedNova's normalization, Wang et al. 2020: the update per inner step, times H, so that
    a peer of fewer steps moves the average in proportion to its tokens alone, not its tokens times its steps)."""
    if contribution not in CONTRIBUTIONS:
        raise ValueError(f"unknown contribution {contribution!r}: expected one of {CONTRIBUTIONS}")
    return inner_steps / max(steps, 1) if contribution == "per_step" else 1.0


def scaled(pseudo_gradient: Callable[[], list[torch.Tensor]], scale: float) -> list[torch.Tensor]:
    """``pseudo_gradient()`` multiplied in place by ``scale`` (``contribution_scale``)."""
    tensors = pseudo_gradient()
    if scale != 1.0:
        for tensor in tensors:
            tensor.mul_(scale)
    return tensors

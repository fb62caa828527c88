"""The round log: a peer one or a few rounds behind catches up with the rounds' updates, not the whole state.

Why: a joiner downloads the swarm's state (outer weights and momentum, 8 bytes per parameter) while the swarm
trains on. If a round ends during the download, the joiner holds the state of the epoch before and, until now,
downloaded the whole state again; where downloads outlast rounds it never caught up (``state_sync.FALLING_BEHIND``).
What it misses is small: the averages of the rounds since, one outer step each. The outer step is exact arithmetic
(``outer_optimizer.step_tensor``: the same bits on every peer), so the joiner computes the swarm's new state itself.

Donor side. While a download of our state is in flight, or one (or a replay) began within the last two rounds
(``RoundLog.wanted``), each outer step's update is kept for the peer that may need it (``RoundLog.record``, an
``OuterOptimizer.on_step`` hook): with the hash of our state before it, as a copy in memory or, if the
``averaging.log_rounds`` kept would be over ``averaging.serve_copy_in_memory_mb``, a file
(``ServedStates._copy_out``). The averager process keeps the last ``log_rounds`` and serves them (``serve``, our
``rpc_download_rounds``). When nobody downloaded for two rounds, the log is dropped. A swarm averaging in fp16 or
bf16 has bit-identical averages that are fp16 (bf16) values: they are sent as such, 2 bytes per parameter per
round, checked lossless tensor by tensor; otherwise fp32.

Joiner side (``replay``): ask a holder of the swarm's state for the rounds after ours, named by our epoch and state
hash (a donor holding another chain serves nothing), only if they are fewer bytes than the state; apply each
round's update to a copy of our state, a tensor at a time, written to a file (``state_files.spilled``), and take
the result only if its state hash is the swarm's published hash,
the check a downloaded state passes. Anything else (no log, a broken stream, a mismatch) falls back to downloading
the state (``StateSync.sync``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from pathlib import Path

import torch

from ..lifecycle import hivemind_calls
from ..swarm.p2pd_internals import until_the_caller_hangs_up
from ..training.model import param_sha256, state_digest
from ..training.outer_optimizer import OuterOptimizer, flat_tensors, step_tensor
from . import hivemind_internals as internals
from .state_files import SpilledTensor, SpilledTensors, spilled
from .state_transfer import tensor_messages

logger = logging.getLogger(__name__)

MIN_WINDOW = 60.0
"""Seconds after a download (or a replay) began during which outer steps are logged, at least (else two rounds)."""
NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The swarm codecs whose averages are exactly values of a narrower dtype: logged rounds are sent in it."""


class RoundLog:
    """The donor's decisions, in the host process: which outer steps to log, and handing them to the averager.

    :param averager: the running ``PseudoGradientAverager`` (its process serves the log); updates whose ``keep``
      would be over its in-memory limit for served copies go to files of its ``spill_dir`` (``ServedStates.spill_to``)
    :param keep: rounds kept (``averaging.log_rounds``; 0: none)
    """

    def __init__(self, averager, keep: int):
        self.averager = averager
        self.keep = keep
        self.served_at = -math.inf
        """``time.time()`` when a download of our state last began (``StateSync`` sets it)."""
        self.logged = 0
        """Rounds logged since the log last started (0: nothing kept)."""
        self._last_step = None
        self._round = 0.0

    def remove_files(self) -> None:
        """Leaving: the files of the rounds kept (the averager process, which removes them as they go, has stopped)."""
        spill = self.averager.served.spill_dir
        for path in spill.glob(f"round-{os.getpid()}-*.bin") if spill is not None and spill.is_dir() else []:
            path.unlink(missing_ok=True)

    def wanted(self, now: float) -> bool:
        """Is a peer likely to need the next round's update: a download of our state in flight, or one (or a
        replay) begun within two rounds?"""
        served = self.averager.served
        served._prune()
        if served._served:
            return True
        began = max(self.served_at, float(self.averager.replayed_at[0]))
        return now - began < max(MIN_WINDOW, 2 * self._round)

    def record(self, epoch: int, state_hash: str, update: list[torch.Tensor]) -> None:
        """Before the outer step from ``epoch`` (our state hashing to ``state_hash``) with ``update``: log it if
        wanted, else drop what is logged."""
        now = time.time()
        self._round = now - self._last_step if self._last_step else 0.0
        self._last_step = now
        if not self.keep or not self.wanted(now):
            if self.logged:
                internals.send_to_averager_process(self.averager, "_keep_round", epoch + 1, state_hash, None, 0)
                self.logged = 0
            return
        self.logged += 1
        served = self.averager.served
        size = sum(t.numel() * 4 for t in update)
        big = served.spill_dir is not None and size * self.keep > served.in_memory_limit
        path = served.spill_dir / f"round-{os.getpid()}-{epoch + 1}-{self.logged}.bin" if big else None
        copies = served._copy_out(update, path, "a round's update, kept for a peer that is behind")
        internals.send_to_averager_process(self.averager, "_keep_round", epoch + 1, state_hash, copies, self.keep)


def keep(averager, epoch: int, state_hash: str, update, keep_last: int) -> None:
    """In the averager process: log round ``epoch``'s ``update`` (None: drop the whole log), the last
    ``keep_last`` only."""
    log = averager.round_log
    for old in list(log) if update is None else [e for e in log if e >= epoch]:
        _drop(log.pop(old))
    if update is None:
        return
    log[epoch] = (state_hash, update)
    for old in sorted(log)[:-keep_last]:
        _drop(log.pop(old))


def _drop(entry) -> None:
    if isinstance(entry[1], SpilledTensors):
        entry[1].remove()


def _narrow(tensor) -> torch.Tensor | None:
    """``tensor`` as fp16 or bf16 if that holds exactly the same values (the average of a swarm that sends them)."""
    tensor = tensor.load() if isinstance(tensor, SpilledTensor) else tensor
    for dtype in NARROW.values():
        narrow = tensor.to(dtype)
        if narrow.to(torch.float32).equal(tensor):
            return narrow
    return None


def chain(log: dict, after: int, state_hash: str) -> list[int]:
    """The epochs of ``log`` that take a state at epoch ``after`` hashing to ``state_hash`` on, in order: each
    following the last without a gap, the first logged from exactly that state."""
    epochs = []
    while after + 1 in log and (epochs or log[after + 1][0] == state_hash):
        after += 1
        epochs.append(after)
    return epochs


async def serve(averager, raw: bytes):
    """In the averager process: the ``DownloadData`` messages of a replay's download (``rpc_download_rounds``):
    metadata ``{"epochs": [...]}``, then each round's update, tensor by tensor; nothing logged or over the
    request's ``max_bytes``: the epochs list is empty."""
    try:
        asked = averager.serializer.loads(raw)
        after = int(asked["after"])
        state_hash = str(asked["state_hash"])
        max_bytes = int(asked["max_bytes"])
    except Exception:
        return
    averager.replayed_at[0] = time.time()
    log = averager.round_log
    epochs = chain(log, after, state_hash)
    entries = [log[epoch][1] for epoch in epochs]  # (held here: a round logged meanwhile does not drop them)
    per_round = sum(t.numel() for t in averager.inputs) * (2 if entries and _narrow(entries[0][0]) is not None else 4)
    if per_round * len(epochs) >= max_bytes:
        epochs = []
        entries = []

    def sent():  # each round's update, tensor by tensor, as fp16 or bf16 where that holds the same values
        for update in entries:
            for tensor in update:
                tensor = tensor.load() if isinstance(tensor, SpilledTensor) else tensor
                narrow = _narrow(tensor)
                yield narrow if narrow is not None else tensor
        averager.replayed_at[0] = time.time()

    for message in tensor_messages(averager, sent(), {"epochs": epochs}):
        yield message  # (ending with the end mark: ``state_transfer.download`` hangs up on it)
    await until_the_caller_hangs_up()


async def replay(averager, outer: OuterOptimizer, state_hash: str, target, inner_steps: int, timeout: float,
                 donors: list[str], keep: int) -> tuple[str, list, list[str], int] | None:
    """The swarm's state ``target`` computed from ours and the rounds after it, logged by one of ``donors`` (who
    keep ``keep``): (donor, the state's tensors, their digests, bytes received), or None (the caller downloads the
    state instead)."""
    behind = target.epoch - outer.epoch
    if not 0 < behind <= keep or not donors:
        return None
    spill = averager.served.spill_dir
    state_bytes = 8 * sum(p.numel() for p in outer.params)
    shapes = [p.shape for p in outer.params] * behind
    if spill is not None:
        spill.mkdir(parents=True, exist_ok=True)
    updates = flat_tensors(shapes, shared=True) if spill is None else \
        SpilledTensors.create(spill / f"download-{os.getpid()}-rounds.bin", shapes).items()
    try:
        for donor in donors[:2]:
            ask = {"after": outer.epoch, "state_hash": state_hash, "max_bytes": state_bytes}
            started = time.perf_counter()
            try:
                metadata, tensors, received = await hivemind_calls.call(
                    averager.download_state_from, donor, timeout, into=updates, rounds=ask)
            except Exception as e:
                logger.info(f"state sync: no rounds from {donor[-8:]} ({e})")
                continue
            epochs = metadata.get("epochs") if isinstance(metadata, dict) else None
            if epochs != list(range(outer.epoch + 1, target.epoch + 1)) or len(tensors) != len(updates) or \
                    any(t.shape != u.shape or t.dtype != torch.float32 for t, u in zip(tensors, updates)):
                continue  # not logged there (or not all of them): the next donor, or the whole state
            downloaded = time.perf_counter()
            state, digests = await asyncio.to_thread(_apply, outer, updates, behind, spill)
            if state_digest(digests, target.epoch, target.epoch * inner_steps) == target.state_hash:
                logger.info(f"state sync: caught up {behind} round(s) from {donor[-8:]} with their updates, "
                            f"{received / 1e6:,.1f} MB (the state is {state_bytes / 1e6:,.1f} MB): downloaded in "
                            f"{downloaded - started:.2f}s, replayed and hashed in "
                            f"{time.perf_counter() - downloaded:.2f}s")
                return donor, state, digests, received
            logger.warning(f"state sync: the {behind} round(s) {donor[-8:]} logged do not lead to the swarm's state; "
                           f"downloading the state")
            return None
        return None
    finally:
        if spill is not None:
            updates[0].file.remove()


@torch.no_grad()
def _apply(outer: OuterOptimizer, updates: list, rounds: int, spill: Path | None) -> tuple[list, list[str]]:
    """A copy of ``outer``'s state moved by ``rounds`` logged updates (round-major in ``updates``), and its tensor
    digests (``model.state_digest``). Computed a tensor at a time; with a ``spill`` directory the result goes to a
    file there (checked against the swarm's hash before it replaces ours, it would otherwise be a second state in
    memory beside ours: 8 bytes per parameter, the CPU joiner's peak), else to memory."""
    n = len(outer.params)
    shapes = [p.shape for p in outer.params] * 2
    state = (spilled(spill, "replay", shapes) if spill is not None else None) or flat_tensors(shapes)
    digests = [""] * (2 * n)
    for i, (param, buf) in enumerate(zip(outer.params, outer.momentum_views)):
        weights = param.detach().to("cpu", torch.float32, copy=True)
        momentum = buf.detach().to("cpu", torch.float32, copy=True)
        for r in range(rounds):
            update = updates[r * n + i]
            update = update.load() if isinstance(update, SpilledTensor) else update
            step_tensor(weights, momentum, update, outer.lr, outer.momentum, outer.nesterov)
        for j, value in ((i, weights), (n + i, momentum)):
            digests[j] = param_sha256([value])
            state[j].copy_(value)
    return state, digests

"""Checkpoints: the peer's whole training state on disk, written in the background, never half-written.

    diloco-peer join ADDR --name alice            # resumes from checkpoints/alice/ when it holds one
    diloco-peer join ADDR --set checkpoint.dir=""  # no checkpoints

A checkpoint is taken at an outer-round boundary, where the replica equals the outer weights, and holds
everything needed to go on exactly where the peer stopped: outer weights and Nesterov momentum, the outer
epoch, the inner AdamW state, the inner step (the LR-schedule position) and the data sampler's RNG.

Why it is safe:
- *atomic*: the file is written as ``.tmp``, flushed, fsynced, then renamed over its final name, and the
  directory is fsynced. A crash or SIGKILL at any moment leaves either the old set of files or the new
  one, never a torn file under a real name. Leftover ``.tmp`` files are ignored and cleaned up.
- *asynchronous*: the state is copied in memory on the caller's thread (a fast copy), the slow part
  (serialise + fsync) runs in a background thread; training goes on meanwhile. If the previous write
  is still running, the new one waits for it (writes never overlap; older files are pruned in order).
- *safe to load*: ``torch.load(weights_only=True)``: plain tensors, numbers and strings only, no pickle
  code execution. A checkpoint from a different model or run (another config fingerprint) is refused
  with a clear error rather than loaded into the wrong shapes.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import CheckpointConfig, ConfigError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^epoch-(\d{6,})\.pt$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (other model, unreadable); the message says what to do."""


@dataclass
class PeerState:
    """What a checkpoint holds, as plain tensors and numbers (CPU)."""

    fingerprint: str
    epoch: int
    inner_step: int
    outer_params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    inner_optimizer: dict
    data_rng: torch.Tensor

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, **self.__dict__}


def capture(trainer, outer, fingerprint: str) -> PeerState:
    """Copy the peer's state now (call it between rounds); the copy is independent of training."""
    inner = trainer.optimizer.state_dict()
    inner_copy = {
        "state": {k: {n: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for n, v in s.items()}
                  for k, s in inner["state"].items()},
        "param_groups": [dict(g) for g in inner["param_groups"]],
    }
    return PeerState(
        fingerprint=fingerprint, epoch=outer.epoch, inner_step=trainer.step,
        outer_params=[p.detach().clone() for p in outer.params], momentum=outer.momentum_buffers(),
        inner_optimizer=inner_copy, data_rng=trainer.corpus.rng_state().clone(),
    )


def restore(state: PeerState, trainer, outer) -> None:
    """Put a loaded state back into the trainer and outer optimizer (the replica gets the outer weights)."""
    outer.load_state(state.outer_params, state.momentum, state.epoch)
    trainer.optimizer.load_state_dict(state.inner_optimizer)
    trainer.step = state.inner_step
    trainer.corpus.set_rng_state(state.data_rng)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(state: PeerState, path: Path) -> int:
    """Write ``state`` to ``path`` so that ``path`` is either absent/old or complete. Returns its size."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        torch.save(state.to_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path.stat().st_size


def load_file(path: Path, fingerprint: str) -> PeerState:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}): delete it to skip it") from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a diloco-peer v{FORMAT_VERSION} checkpoint: delete it "
                              f"or choose another checkpoint.dir")
    if raw["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} belongs to another model or run (fingerprint {raw['fingerprint']}, this config "
            f"{fingerprint}): use the config it was written with, or another checkpoint.dir / --name"
        )
    raw.pop("format_version")
    return PeerState(**raw)


class CheckpointManager:
    """Periodic, atomic, background checkpoints of one peer in ``{cfg.dir}/{name}/``; keeps the last K.

    :param cfg: the ``[checkpoint]`` section (dir, every_rounds, keep)
    :param name: the peer's name: its checkpoints live in a directory of that name
    :param fingerprint: the config fingerprint every checkpoint must match (model shape, seed, run id)
    """

    def __init__(self, cfg: CheckpointConfig, name: str, fingerprint: str):
        self.cfg, self.fingerprint = cfg, fingerprint
        self.dir = Path(cfg.dir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("*.tmp"):  # a write that was killed halfway: never a valid checkpoint
            stale.unlink(missing_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.last_epoch = -1

    def files(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def load_latest(self) -> PeerState | None:
        """The newest checkpoint, or None if there is none. A foreign checkpoint raises CheckpointError."""
        files = self.files()
        if not files:
            return None
        state = load_file(files[0], self.fingerprint)
        self.last_epoch = state.epoch
        return state

    def due(self, epoch: int) -> bool:
        return epoch > self.last_epoch and epoch % self.cfg.every_rounds == 0

    def save(self, state: PeerState, on_done=None) -> Future:
        """Write ``state`` in the background; ``on_done(path, seconds, size)`` runs when it is on disk."""
        with self._lock:
            previous = self._pending
            self.last_epoch = state.epoch
            self._pending = self._executor.submit(self._write, state, previous, on_done)
            return self._pending

    def _write(self, state: PeerState, previous: Future | None, on_done) -> Path:
        if previous is not None:
            previous.exception()  # writes happen in order; a failed one was already logged
        started = time.perf_counter()
        path = self.dir / f"epoch-{state.epoch:06d}.pt"
        try:
            size = write_atomically(state, path)
        except OSError as e:
            logger.error(f"could not write checkpoint {path}: {e} (the previous checkpoint is still valid)")
            raise
        for old in self.files()[self.cfg.keep:]:
            old.unlink(missing_ok=True)
        seconds = time.perf_counter() - started
        logger.info(f"checkpoint of epoch {state.epoch} written to {path} ({size / 1e6:.1f} MB, {seconds:.2f}s)")
        if on_done is not None:
            on_done(path, seconds, size)
        return path

    def close(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout`` seconds) for the last write, then stop the writer thread."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result(timeout=timeout)
            except Exception as e:
                logger.error(f"the last checkpoint was not written: {type(e).__name__}: {e}")
        self._executor.shutdown(wait=False)

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
- *asynchronous, and no copy of the state*: ``capture`` takes no copy. A background thread writes the live
  tensors straight from where they are (the AdamW moments first: the next inner step changes them; the outer
  weights and momentum change only at the next outer step). Until the writer is past them, whoever is about to
  change them waits for it (``_Snapshot``: the first optimizer step of the next round, if the disk is slower
  than a forward and backward pass); a wait longer than ``CHANGE_WAIT`` abandons that checkpoint rather than
  stalling training (logged; the previous one stays valid). Writes never overlap; older files are pruned in order.
- *loaded without doubling memory*: the file is memory-mapped (``torch.load(mmap=True)``) and ``restore`` copies
  it into the live tensors one tensor at a time, handing each one's pages back once copied.
- *safe to load*: ``torch.load(weights_only=True)``: plain tensors, numbers and strings only, no pickle
  code execution. A checkpoint from a different model or run (another config fingerprint) is refused
  with a clear error rather than loaded into the wrong shapes.

The file is an ordinary ``torch.save`` file (written by torch's own serializer, record by record, without the
CRC32s torch.load does not check), so ``torch.load(path, weights_only=True)`` reads it anywhere.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.serialization as serialization

from ..config import CheckpointConfig, ConfigError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_NAME = re.compile(r"^epoch-(\d{6,})\.pt$")
CHANGE_WAIT = 10.0
"""Seconds training waits, at most, for the checkpoint writer to be past the tensors it is about to change."""
MADV_DONTNEED = 4


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (other model, unreadable); the message says what to do."""


class _Abandoned(RuntimeError):
    """Training could not wait longer for the writer: the checkpoint being written is dropped."""


class _Snapshot:
    """The live tensors of a captured state, by group ("inner": the AdamW state, "outer": outer weights and
    momentum), as the writer goes through them: ``wait(group)`` returns once it is past that group (or the write
    ended), at most ``CHANGE_WAIT`` seconds; past that, the write is abandoned (``check`` raises in the writer)."""

    def __init__(self):
        self._done: set[str] = set()
        self._closed = self.abandoned = False
        self._cond = threading.Condition()
        self._unhooks: list = []
        self.waited = 0.0
        """Seconds the training waited for the writer."""

    def wait(self, group: str) -> None:
        with self._cond:
            if group in self._done or self._closed or self.abandoned:
                return
            started = time.perf_counter()
            if not self._cond.wait_for(lambda: group in self._done or self._closed, timeout=CHANGE_WAIT):
                self.abandoned = True
            self.waited += time.perf_counter() - started

    def done(self, group: str) -> None:
        with self._cond:
            self._done.add(group)
            self._cond.notify_all()

    def check(self) -> None:
        if self.abandoned:
            raise _Abandoned(f"training waited {self.waited:.1f}s for the writer, the most it may "
                             f"(checkpoint.CHANGE_WAIT): this checkpoint is dropped")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for unhook in self._unhooks:
            unhook()
        self._unhooks = []


@dataclass
class PeerState:
    """What a checkpoint holds, as plain tensors and numbers (CPU, except a GPU trainer's AdamW state as
    ``capture`` found it)."""

    fingerprint: str
    epoch: int
    inner_step: int
    outer_params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    inner_optimizer: dict
    data_rng: torch.Tensor
    snapshot: _Snapshot | None = field(default=None, repr=False, compare=False)
    """A captured state: its tensors are live, see ``_Snapshot``."""
    mapped: bool = field(default=False, repr=False, compare=False)
    """A loaded state: its tensors are pages of the memory-mapped file (``release`` hands them back)."""

    def to_dict(self) -> dict:
        """What the file holds, in the order it is written: the AdamW state first (see the module docstring)."""
        return {"format_version": FORMAT_VERSION, "inner_optimizer": self.inner_optimizer,
                "fingerprint": self.fingerprint, "epoch": self.epoch, "inner_step": self.inner_step,
                "outer_params": self.outer_params, "momentum": self.momentum, "data_rng": self.data_rng}

    def release(self, tensor: torch.Tensor) -> None:
        """Done with ``tensor`` (a loaded state): its pages of the mapped file go back, whole pages within it
        only; the file stays mapped (the state can still be read, from disk)."""
        if not self.mapped or tensor.device.type != "cpu" or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


def capture(trainer, outer, fingerprint: str) -> PeerState:
    """The peer's state now (call it between rounds), for ``CheckpointManager.save``: the live tensors, not a copy.
    Until they are written, the inner and the outer optimizer wait for the writer before changing them."""
    snapshot = _Snapshot()
    inner = trainer.optimizer.state_dict()  # the live state tensors; the hyper-parameters below are copied
    inner = {"state": inner["state"], "param_groups": [dict(g) for g in inner["param_groups"]]}
    hook = trainer.optimizer.register_step_pre_hook(lambda *args: snapshot.wait("inner"))

    def before_outer_change() -> None:
        snapshot.wait("outer")

    outer.before_change.append(before_outer_change)
    snapshot._unhooks = [hook.remove, lambda: outer.before_change.remove(before_outer_change)]
    return PeerState(
        fingerprint=fingerprint, epoch=outer.epoch, inner_step=trainer.step,
        outer_params=[p.detach() for p in outer.params], momentum=list(outer.momentum_views),
        inner_optimizer=inner, data_rng=trainer.corpus.rng_state().clone(), snapshot=snapshot,
    )


def restore(state: PeerState, trainer, outer) -> None:
    """Put a loaded state back into the trainer and outer optimizer (the replica gets the outer weights), one
    tensor at a time: a memory-mapped state hands each tensor's pages back once it is copied."""
    outer.load_state(state.outer_params, state.momentum, state.epoch, release=state.release)
    trainer.optimizer.load_state_dict(_owned(state, trainer.optimizer))
    trainer.step = state.inner_step
    trainer.corpus.set_rng_state(state.data_rng)


def _owned(state: PeerState, optimizer: torch.optim.Optimizer) -> dict:
    """The saved inner optimizer state with every tensor copied onto its parameter's device (``load_state_dict``
    then keeps them as they are), releasing the mapped pages as it goes."""
    inner = state.inner_optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [i for group in inner.get("param_groups", []) for i in group["params"]]
    device = dict(zip(saved_ids, (p.device for p in params)))
    owned = {}
    for key, values in inner.get("state", {}).items():
        owned[key] = {}
        for name, value in values.items():
            if torch.is_tensor(value):
                target = value.device if name == "step" else device.get(key, value.device)
                copied = value.to(target, copy=True)
                state.release(value)
                value = copied
            owned[key][name] = value
    return {"state": owned, "param_groups": inner.get("param_groups", [])}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Records:
    """torch's zip writer, watched: after each tensor storage it writes, the snapshot learns which groups are done.

    ``torch.serialization._save`` writes the storages in the order it first meets them while pickling (``groups``
    lists that order: the group of each storage), one record each, straight from the tensor's memory."""

    def __init__(self, writer, groups: list[str], snapshot: _Snapshot | None):
        self._writer = writer
        self._snapshot = snapshot
        self._left = {g: groups.count(g) for g in set(groups)}
        self._groups = groups
        if snapshot is not None:
            for group in ("inner", "outer"):
                if not self._left.get(group):
                    snapshot.done(group)

    def write_record(self, name: str, data, size: int) -> None:
        if self._snapshot is not None:
            self._snapshot.check()
        self._writer.write_record(name, data, size)
        if name.startswith("data/") and self._snapshot is not None:
            self._snapshot.check()  # a change that began while this record was written: torn, dropped
            group = self._groups[int(name.split("/", 1)[1])]
            self._left[group] -= 1
            if self._left[group] == 0:
                self._snapshot.done(group)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)


def _storage_groups(obj, group: str = "other", seen: dict | None = None) -> list[str]:
    """The group of each distinct tensor storage in ``obj``, in the order pickling meets them."""
    seen = {} if seen is None else seen
    if torch.is_tensor(obj):
        seen.setdefault(obj.untyped_storage()._cdata, group)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _storage_groups(value, {"inner_optimizer": "inner", "outer_params": "outer",
                                    "momentum": "outer"}.get(key, group), seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _storage_groups(value, group, seen)
    return list(seen.values())


def write_atomically(state: PeerState, path: Path) -> int:
    """Write ``state`` to ``path`` so that ``path`` is either absent/old or complete. Returns its size."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    obj = state.to_dict()
    try:
        with tmp.open("wb") as f:
            # torch.save's own writer, minus the CRC32 of every record: torch.load never checks it, and computing
            # it is most of what the next inner step would wait for (the rename is the integrity; measured:
            # BENCHMARKS.md, "Memory per parameter at llama-150m")
            writer = torch._C.PyTorchFileWriter(f, False, serialization._get_storage_alignment())
            try:
                records = _Records(writer, _storage_groups(obj), state.snapshot)
                serialization._save(obj, records, serialization.pickle, serialization.DEFAULT_PROTOCOL, False)
            finally:  # while the file is open: torch's writer would otherwise finish it when collected (an abort)
                writer.write_end_of_file()
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # written: no need to keep it cached
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if state.snapshot is not None:
            state.snapshot.close()
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path.stat().st_size


def load_file(path: Path, fingerprint: str) -> PeerState:
    """The state in checkpoint ``path``, memory-mapped (nothing is read until used). Raises ``CheckpointError``."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip(path))
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
    return PeerState(**raw, mapped=_is_zip(path))


def _is_zip(path: Path) -> bool:
    # torch.load maps zip files only; anything else (garbage, an old-style file) is read, and refused, as it is
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


class CheckpointManager:
    """Periodic, atomic, background checkpoints of one peer in ``{cfg.dir}/{name}/``; keeps the last K.

    :param cfg: the ``[checkpoint]`` section (dir, every_rounds, keep)
    :param name: the peer's name: its checkpoints live in a directory of that name
    :param fingerprint: the config fingerprint every checkpoint must match (model shape, seed, run id)
    """

    def __init__(self, cfg: CheckpointConfig, name: str, fingerprint: str):
        self.cfg = cfg
        self.fingerprint = fingerprint
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
        with self._lock:  # (a captured state waits in the queue with its hooks on: training waits, at most
            previous = self._pending  # CHANGE_WAIT, then the state is dropped, see _Snapshot)
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
        except _Abandoned as e:
            logger.warning(f"checkpoint of epoch {state.epoch} not written: {e} (the previous one is still valid)")
            raise
        except OSError as e:
            logger.error(f"could not write checkpoint {path}: {e} (the previous checkpoint is still valid)")
            raise
        for old in self.files()[self.cfg.keep:]:
            old.unlink(missing_ok=True)
        seconds = time.perf_counter() - started
        waited = f", training waited {state.snapshot.waited:.2f}s for it" if state.snapshot is not None else ""
        logger.info(f"checkpoint of epoch {state.epoch} written to {path} ({size / 1e6:.1f} MB, {seconds:.2f}s"
                    f"{waited})")
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

"""A state's tensors in a file instead of memory: what a GB-scale peer would otherwise hold twice.

Four users, in ``state_transfer.py``, ``round_log.py`` and ``state/state_sync.py``:

- a donor whose state changes during a download writes the part that download has not read yet to a file
  (``ServedStates.freeze``);
- a GPU peer serves its momentum, which the averager process cannot read where it lives, from a copy written
  for each download (``ServedStates.readable``);
- a peer downloads the momentum half of a state into a file (``staging_for``): checked, then copied into its
  momentum (a GPU peer's on its GPU) tensor by tensor, it never needs 4 bytes per parameter of the host's memory;
- a peer that catches up with logged rounds writes the state it computes to a file (``round_log.replay``) until
  its hash is checked: our own state and a second one would otherwise both be in memory.

The page cache holds these files (the kernel may evict them); nothing maps them, so they are in no process's
memory. ``SpilledTensors`` pickles as its path and layout: the averager process opens the file the host made.
``SpilledTensor`` stands for one of its tensors in a state's tensor list and answers the few tensor calls made
on such a list (``shape``, ``dtype``, ``numel``, ``copy_``, ``to``, ``detach``, ``cpu``...), reading or writing
the file.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from pathlib import Path

import torch

from ..training.outer_optimizer import flat_tensors

logger = logging.getLogger(__name__)
_staged = itertools.count(1)  # numbers the files states are staged in (``spilled``)


class SpilledTensors:
    """Tensors laid out one after another in a file, read and written one at a time.

    :param path: the file
    :param layout: (shape, dtype) of each tensor, in the file's order
    """

    def __init__(self, path: Path, layout: list[tuple[torch.Size, torch.dtype]]):
        self.path = path
        self.layout = layout
        self.offsets = [0]
        for shape, dtype in layout:
            self.offsets.append(self.offsets[-1] + shape.numel() * dtype.itemsize)

    @classmethod
    def write(cls, path: Path, tensors: list[torch.Tensor]) -> SpilledTensors:
        """Write ``tensors`` to ``path``, without a copy in memory (the bytes go from the tensors' pages; a GPU
        tensor's through one host copy of it)."""
        with open(path, "wb") as file:
            for tensor in tensors:  # (a GPU tensor comes to the host one at a time)
                file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return cls(path, [(t.shape, t.dtype) for t in tensors])

    @classmethod
    def create(cls, path: Path, shapes: list[torch.Size]) -> SpilledTensors:
        """An fp32 file of ``shapes`` to be written tensor by tensor (``SpilledTensor.copy_``); it takes no disk
        until then (a sparse file)."""
        layout = [(torch.Size(shape), torch.float32) for shape in shapes]
        spilled = cls(path, layout)
        with open(path, "wb") as file:
            file.truncate(spilled.offsets[-1])
        return spilled

    def __len__(self) -> int:
        return len(self.layout)

    def __getitem__(self, index: int) -> torch.Tensor:
        shape, dtype = self.layout[index]
        data = bytearray(self.offsets[index + 1] - self.offsets[index])
        with open(self.path, "rb") as file:
            file.seek(self.offsets[index])
            if file.readinto(data) != len(data):
                raise RuntimeError(f"{self.path} ends before tensor {index}: it was cut short or removed")
        return torch.frombuffer(data, dtype=dtype).view(shape) if data else torch.empty(shape, dtype=dtype)

    def store(self, index: int, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (of the layout's shape and dtype) in place ``index``."""
        shape, dtype = self.layout[index]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {index} of {self.path} is {tuple(shape)} {dtype}, got {tuple(tensor.shape)} "
                             f"{tensor.dtype}")
        with open(self.path, "r+b") as file:
            file.seek(self.offsets[index])
            file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def items(self) -> list[SpilledTensor]:
        """Each tensor of the file as an item of a state's tensor list (read when its turn comes)."""
        return [SpilledTensor(self, index) for index in range(len(self))]


class SpilledTensor:
    """One tensor of a ``SpilledTensors`` file, standing in a state's tensor list."""

    requires_grad = False

    def __init__(self, file: SpilledTensors, index: int):
        self.file = file
        self.index = index

    @property
    def shape(self) -> torch.Size:
        return self.file.layout[self.index][0]

    @property
    def dtype(self) -> torch.dtype:
        return self.file.layout[self.index][1]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def load(self) -> torch.Tensor:
        return self.file[self.index]

    def copy_(self, tensor: torch.Tensor) -> SpilledTensor:
        """Written to the file (a download landing in it), in the file's dtype; the item stays the file's."""
        self.file.store(self.index, tensor.to(self.dtype))
        return self

    def to(self, *args, **kwargs) -> torch.Tensor:
        """Read from the file, then as ``torch.Tensor.to`` (e.g. onto the GPU it is loaded into)."""
        return self.load().to(*args, **kwargs)

    # hivemind's pipe to the averager process brings each served tensor to the CPU first
    # (``tensor.cpu().detach().requires_grad_(...)``, see hivemind_internals): this one stays the file's item
    def cpu(self) -> SpilledTensor:
        return self

    def detach(self) -> SpilledTensor:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> SpilledTensor:
        return self


def spilled(spill_dir: Path, name: str, shapes: list[torch.Size]) -> list[SpilledTensor] | None:
    """A new fp32 file of ``shapes`` in ``spill_dir`` as a state's tensor list, or None (logged) if it cannot be
    made there. The file goes when the last reference to it does."""
    path = spill_dir / f"{name}-{os.getpid()}-{next(_staged)}.bin"
    try:
        spill_dir.mkdir(parents=True, exist_ok=True)
        staged = SpilledTensors.create(path, shapes)
    except OSError as e:
        path.unlink(missing_ok=True)
        logger.warning(f"state sync: could not make {path} ({e}); keeping that state in memory")
        return None
    weakref.finalize(staged, path.unlink, missing_ok=True)
    return staged.items()


def staging_for(params: list[torch.Tensor], spill_dir: Path | None) -> list:
    """Where a download of a state shaped like ``params`` (weights, then momentum) lands: the weights in one
    shared-memory buffer, the momentum half in a file of ``spill_dir`` (without one, in that buffer too: 8 bytes per
    parameter). The page cache holds the file, and each tensor is read back once for the checks and once into our
    momentum (on the host, or a GPU peer's on its GPU): 4 bytes per parameter less for the length of a sync, the
    peak of a CPU joiner and of a peer restored from its checkpoint (31.4 and 31.8 at llama-150m, 2026-11-27).
    The file goes when the last reference to it does (a state kept for later, ``SyncResult.later``, keeps it)."""
    shapes = [p.shape for p in params]
    if spill_dir is None:
        return flat_tensors(shapes * 2, shared=True)
    staged = spilled(spill_dir, "download", shapes)
    return flat_tensors(shapes * 2, shared=True) if staged is None else flat_tensors(shapes, shared=True) + staged

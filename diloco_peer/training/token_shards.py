"""Token shards on disk: what ``diloco-peer prepare`` writes and what peers read in place.

A prepared directory holds

- ``eval.bin``: the eval split, the first ``eval_tokens`` tokens of the input (the same on every peer);
- ``train-00000.bin``, ``train-00001.bin``, ...: the rest, ``shard_tokens`` tokens each (the last one shorter);
- ``manifest.json``: tokenizer, vocab size, dtype, and per file its token count, sha256 and where in the
  input it ends (so that an interrupted prepare resumes there), plus the settings and input files;
- ``tokenizer.json`` when the tokenizer is a local or trained BPE (the directory is self-contained).

Files are raw little-endian ids, uint16 when the vocab fits (<= 65536 ids), else uint32 (uint8 for bytes).
Each is written under a temporary name and renamed when complete, then listed in the manifest, which is
itself replaced atomically: a killed prepare leaves only complete, listed files.

Peers (``TokenShards``) read only the windows they sample, each with one positional read (``pread``):
start-up time and memory do not grow with the dataset (BENCHMARKS.md, "Data at any size"). Not ``mmap``:
a mapped page stays in the process's resident set once touched, and the kernel maps 64 KB around each
touched page, so random windows over the shards grew a peer's RSS by nearly what they covered (with
``MADV_RANDOM`` too), where ``pread`` leaves the pages in the page cache, outside the process, and was faster
(measured: BENCHMARKS.md, "Data at any size"). The training files are cut into blocks of
``BLOCK_TOKENS`` and block ``g`` (counted over all files) belongs to data shard ``g % data.num_shards``:
every peer's shard is spread over the whole dataset, and no window crosses into another shard's block.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..config import DataError

MANIFEST = "manifest.json"
FORMAT = "diloco-peer token shards"
VERSION = 1
EVAL_FILE = "eval.bin"
BLOCK_TOKENS = 1 << 16
"""Training files are dealt to data shards in blocks of this many tokens (the last block of a file is longer)."""
MAX_OPEN_FILES = 64
"""Training files a peer keeps open (a 10 TB dataset has 50,000 of 200 MB; a process may open ~1,000 files)."""


def train_file(index: int) -> str:
    return f"train-{index:05d}.bin"


def write_json_atomically(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path``: the old or the new content, never a torn file."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_manifest(directory: Path) -> dict | None:
    """The manifest of ``directory``, finished or not; None if there is none."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError("not a token-shards manifest")
    except (ValueError, AttributeError) as e:
        raise DataError(f"'{path}' is not a diloco-peer prepare manifest ({e}): prepare into an empty "
                        f"directory") from None
    if manifest.get("version") != VERSION:
        raise DataError(f"'{path}' has format version {manifest.get('version')}, this diloco-peer reads "
                        f"{VERSION}: prepare the data again with this version")
    return manifest


def load_manifest(directory: str | Path) -> dict:
    """The manifest of a finished prepare run in ``directory`` (``data.shards_dir``)."""
    manifest = read_manifest(Path(directory))
    if manifest is None:
        raise DataError(f"data.shards_dir '{directory}' holds no {MANIFEST}: run diloco-peer prepare INPUT... "
                        f"--out {directory} first, or fix data.shards_dir")
    if not manifest.get("complete"):
        raise DataError(f"'{directory}' is not fully prepared (its prepare run was interrupted): run the same "
                        f"diloco-peer prepare command again to finish it")
    return manifest


class TokenFile:
    """One file of token ids, read by slices (``tokens[a:b]``, a numpy array) with one ``pread`` each.

    The file is opened at the first read and stays open until ``close`` (``TokenShards`` keeps a bounded
    number open: a dataset may have more files than a process may open).
    """

    def __init__(self, path: Path, dtype: np.dtype, tokens: int):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.tokens = tokens
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.tokens)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, max(stop - start, 0) * size, start * size), dtype=self.dtype)

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWriter:
    """Appends a token stream to ``eval.bin`` (until it holds ``eval_tokens``), then to training files of
    ``shard_tokens`` each, and lists each finished file in the manifest.

    :param directory: the output directory (exists)
    :param manifest: the manifest dict, with the files finished so far (it is updated and saved here)
    :param dtype: the id type of the files
    """

    def __init__(self, directory: Path, manifest: dict, dtype: np.dtype):
        self.directory = directory
        self.manifest = manifest
        self.dtype = np.dtype(dtype)
        self._file = self._hash = None
        self._name = ""
        self._count = 0
        self._capacity = 0

    @property
    def eval_done(self) -> bool:
        return self.manifest["eval"] is not None

    @property
    def open_tokens(self) -> int:
        """Tokens in the file being written (not listed yet)."""
        return self._count if self._file is not None else 0

    def _open(self) -> None:
        settings = self.manifest["settings"]
        if self.eval_done:
            self._name = train_file(len(self.manifest["train"]))
            self._capacity = settings["shard_tokens"]
        else:
            self._name = EVAL_FILE
            self._capacity = settings["eval_tokens"]
        self._file = (self.directory / (self._name + ".tmp")).open("wb")
        self._hash = hashlib.sha256()
        self._count = 0

    def _close(self, end: dict) -> None:
        """Finish the open file: flush, rename into place, then list it in the manifest (in this order: a
        file the manifest lists is always complete)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.directory / (self._name + ".tmp"), self.directory / self._name)
        entry = {"file": self._name, "tokens": self._count, "sha256": self._hash.hexdigest(), "end": end}
        if self.eval_done:
            self.manifest["train"].append(entry)
        else:
            self.manifest["eval"] = entry
        self.save()
        self._file = None

    def feed(self, tokens: np.ndarray, where: dict, first: int) -> None:
        """Append ``tokens``: those of input unit ``where`` from its token number ``first`` on. ``where`` is
        ``{"unit": number, "pos": Position.to_json()}``, what the manifest records as a file's end."""
        done = 0
        while done < len(tokens):
            if self._file is None:
                self._open()
            take = min(len(tokens) - done, self._capacity - self._count)
            data = tokens[done:done + take].astype(self.dtype, copy=False).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            done += take
            if self._count == self._capacity:
                self._close({**where, "skip": first + done})

    def finish(self, end: dict) -> None:
        """The input is used up: close the last (short) training file and mark the manifest complete."""
        if self._file is not None and self._count:
            self._close(end)
        elif self._file is not None:
            self._file.close()
            (self.directory / (self._name + ".tmp")).unlink()
        self.manifest["complete"] = True
        self.save()

    def abandon(self) -> None:
        """Close the open file without listing it (an error or an interruption): a rerun rewrites it."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def save(self) -> None:
        write_json_atomically(self.directory / MANIFEST, self.manifest)


class TokenShards:
    """A prepared directory, read in place: the eval split and this peer's blocks of the training files.

    :param directory: ``data.shards_dir``, written by ``diloco-peer prepare``
    :param num_shards: ``data.num_shards``: how many parts the training blocks are dealt into
    :param shard: which part this peer reads
    :param window: tokens per sample (``seq_len + 1``)
    """

    def __init__(self, directory: str | Path, num_shards: int, shard: int, window: int):
        self.directory = Path(directory)
        self.manifest = load_manifest(directory)
        self.num_shards = num_shards
        self.shard = shard
        self.window = window
        if window > BLOCK_TOKENS:
            raise DataError(f"data.seq_len={window - 1} is too long for prepared shards: use at most "
                            f"{BLOCK_TOKENS - 1}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.eval = self._file(self.manifest["eval"])
        self.files = [self._file(entry) for entry in self.manifest["train"]]
        self._open: list[int] = []
        """Indices of the training files open now, least recently opened first (at most ``MAX_OPEN_FILES``)."""
        self._blocks = [self._block_count(len(f)) for f in self.files]
        self._first_block = np.cumsum([0, *self._blocks]).tolist()
        self.num_blocks = len(range(shard, self._first_block[-1], num_shards))
        """Blocks of this peer's data shard."""
        if not self.num_blocks:
            raise DataError(f"'{directory}' has {self._first_block[-1]} training blocks of {BLOCK_TOKENS} tokens, "
                            f"none for data shard {shard} of data.num_shards={num_shards}: use fewer shards or "
                            f"prepare more text")

    def _file(self, entry: dict) -> TokenFile:
        path = self.directory / entry["file"]
        expected = entry["tokens"] * self.dtype.itemsize
        size = path.stat().st_size if path.is_file() else -1
        if size != expected:  # a size check costs nothing; the sha256s are checked by prepare, not at start-up
            raise DataError(f"'{path}' has {max(size, 0)} bytes, the manifest says {expected}: the prepared data "
                            f"is damaged; run the same diloco-peer prepare again (it checks and redoes files)")
        return TokenFile(path, self.dtype, entry["tokens"])

    def _block_count(self, tokens: int) -> int:
        """Blocks of a file: whole blocks (the remainder joins the last), or one if shorter but >= a window."""
        if tokens >= BLOCK_TOKENS:
            return tokens // BLOCK_TOKENS
        return 1 if tokens >= self.window else 0

    def train_window(self, block: int, fraction: float) -> np.ndarray:
        """The window at ``fraction`` (in [0, 1)) of the valid starts of this shard's ``block``-th block."""
        g = block * self.num_shards + self.shard
        f = bisect.bisect_right(self._first_block, g) - 1
        j = g - self._first_block[f]
        start = j * BLOCK_TOKENS
        end = len(self.files[f]) if j == self._blocks[f] - 1 else start + BLOCK_TOKENS
        begin = start + int(fraction * (end - start - self.window + 1))
        if not self.files[f].is_open:
            self._open.append(f)
            if len(self._open) > MAX_OPEN_FILES:
                self.files[self._open.pop(0)].close()
        return self.files[f][begin:begin + self.window]

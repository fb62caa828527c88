"""Tokenizers: text -> token ids, offline by default.

``data.tokenizer`` (and ``prepare --tokenizer``) names one of three kinds:

- ``bytes``: the UTF-8 bytes of the text, vocab 256, no download, no separator between documents;
- a local ``tokenizer.json`` file (or a folder holding one), loaded with the Hugging Face ``tokenizers``
  library: no ``transformers``, no internet. ``diloco-peer prepare --train-tokenizer 8192`` trains such a
  byte-level BPE on the user's own text (``train_bpe``);
- any other name is a Hugging Face hub tokenizer (``mistralai/Mistral-7B-v0.1``), loaded through
  ``transformers`` (needs internet the first time, and ``pip install ".[hf]"``).

Subword tokenizers end every document with their end-of-text token, so that a window spanning two
documents shows the model where one ends. Nothing here imports torch: ``prepare``'s worker processes
load this module and start fast.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..config import DataError

END_OF_TEXT = "<|endoftext|>"
"""The end-of-document token of the BPEs that ``train_bpe`` writes (id 0)."""
_EOS_CANDIDATES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
MIN_BPE_VOCAB = 257
"""256 byte tokens (a byte-level BPE can spell any text) plus the end-of-text token."""
_HF_EXTRAS = 'pip install ".[hf]"'


def is_local(name: str) -> bool:
    """Whether ``name`` means a local tokenizer.json (a path) rather than ``bytes`` or a hub name."""
    return name != "bytes" and (name.endswith(".json") or Path(name).exists())


def local_file(name: str) -> Path:
    """The tokenizer.json that ``name`` (a file, or a folder holding one) points to; a DataError if none."""
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer file '{path}' does not exist: give a tokenizer.json (e.g. one written by "
                        f"diloco-peer prepare --train-tokenizer), 'bytes' or a Hugging Face tokenizer name")
    return path


CHUNK_CHARS = 16_384
"""Longer texts are encoded in chunks of about this many characters, cut after a line end where there is one."""


def _chunks(text: str) -> list[str]:
    """``text`` in chunks of at most ``CHUNK_CHARS``, each (but the last) ending after a line end if it has one
    in its second half; a cut changes at most the tokens at the cut, the same way every time."""
    chunks = []
    start = 0
    while len(text) - start > CHUNK_CHARS:
        cut = text.rfind("\n", start + CHUNK_CHARS // 2, start + CHUNK_CHARS) + 1 or start + CHUNK_CHARS
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return chunks


class Tokenizer:
    """Encodes text into token ids (numpy arrays); build it with ``load_tokenizer``.

    :ivar name: what it was loaded from (``bytes``, a path, a hub name)
    :ivar vocab_size: number of token ids, special tokens included: the model needs ``model.vocab_size`` >= it
    :ivar eos_id: the end-of-text id appended to every document, or None (``bytes`` appends nothing)
    """

    def __init__(self, name: str, vocab_size: int, eos_id: int | None, backend=None, hub=None):
        self.name = name
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self._backend = backend  # a tokenizers.Tokenizer, or a transformers tokenizer
        self._hub = hub

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned type that holds every id: uint8 (bytes), uint16 up to 65536 ids, else uint32."""
        if self.vocab_size <= 256:
            return np.dtype(np.uint8)
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def encode(self, text: str, *, end_of_document: bool = True) -> np.ndarray:
        """The ids of ``text`` (no special tokens), plus ``eos_id`` if it ends a document and there is one."""
        return self.encode_batch([text], [end_of_document])[0]

    def encode_batch(self, texts: list[str], ends: Iterable[bool] | None = None) -> list[np.ndarray]:
        """``encode`` for several texts at once (``ends[i]``: text i ends its document; default all do)."""
        ends = [True] * len(texts) if ends is None else list(ends)
        if self._backend is None and self._hub is None:  # bytes: one buffer, much faster than any list of ints
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        # long texts in chunks: one long string encodes slower than the same text in short ones (BENCHMARKS.md,
        # "Data at any size")
        chunks = [_chunks(text) for text in texts]
        flat = [chunk for text_chunks in chunks for chunk in text_chunks]
        if self._backend is not None:
            rows = [e.ids for e in self._backend.encode_batch(flat, add_special_tokens=False)]
        else:
            rows = self._hub(flat, add_special_tokens=False)["input_ids"]
        out = []
        at = 0
        for text_chunks, end in zip(chunks, ends):
            parts = rows[at:at + len(text_chunks)] + ([[self.eos_id]] if end and self.eos_id is not None else [])
            out.append(np.concatenate([np.asarray(part, dtype=self.dtype) for part in parts]))
            at += len(text_chunks)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens dropped); bytes that are no valid UTF-8 become U+FFFD."""
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        if self._hub is not None:
            return self._hub.decode(ids, skip_special_tokens=True)
        return bytes(ids).decode("utf-8", errors="replace")


def _load_local(name: str) -> Tokenizer:
    path = local_file(name)
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError:
        raise DataError(f"tokenizer '{name}' needs the Hugging Face tokenizers library: {_HF_EXTRAS}") from None
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file that is no tokenizer
        reason = " ".join(str(e).splitlines())[:120]
        raise DataError(f"tokenizer file '{path}' cannot be loaded ({reason}): give a tokenizer.json "
                        f"written by the Hugging Face tokenizers library") from None
    eos = next((backend.token_to_id(t) for t in _EOS_CANDIDATES if backend.token_to_id(t) is not None), None)
    return Tokenizer(str(path), backend.get_vocab_size(with_added_tokens=True), eos, backend=backend)


def _load_hub(name: str) -> Tokenizer:  # pragma: no cover - needs internet (or a filled Hugging Face cache)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"tokenizer '{name}' needs the Hugging Face extras: {_HF_EXTRAS}") from None
    try:
        hub = AutoTokenizer.from_pretrained(name)
    except OSError as e:
        raise DataError(f"tokenizer '{name}' cannot be loaded ({' '.join(str(e).splitlines())[:120]}): give "
                        f"'bytes', a local tokenizer.json, or a Hugging Face tokenizer name (needs internet)") from None
    return Tokenizer(name, len(hub), hub.eos_token_id, hub=hub)


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name`` means: ``bytes``, a local tokenizer.json (or a folder with one), or a hub name."""
    if name == "bytes":
        return Tokenizer("bytes", 256, None)
    return _load_local(name) if is_local(name) else _load_hub(name)


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path, progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids on ``texts`` and save it to ``path`` (a tokenizer.json).

    Byte-level: the 256 byte values are its alphabet, so it spells any text without an unknown token, as
    GPT-2's does. Id 0 is ``<|endoftext|>``, appended to every document. The file is written to a temporary
    name and renamed: ``path`` is complete or absent, whenever the process is killed.
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"--train-tokenizer {vocab_size} is too small: a byte-level BPE needs at least "
                        f"{MIN_BPE_VOCAB} ids (256 bytes + end of text); use e.g. 8192")
    try:
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError(f"--train-tokenizer needs the Hugging Face tokenizers library: {_HF_EXTRAS}") from None
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    temporary = path.with_name(path.name + ".tmp")
    backend.save(str(temporary))
    os.replace(temporary, path)
    return Tokenizer(str(path), backend.get_vocab_size(with_added_tokens=True), 0, backend=backend)


_WORKER: Tokenizer | None = None
"""The tokenizer of a ``prepare`` worker process (``init_worker``)."""


def init_worker(name: str) -> None:
    """Start of a ``prepare`` worker process: load the tokenizer once. One process per core already uses
    every core, so the Rust tokenizer's own thread pool would only oversubscribe them. Ctrl+C reaches the
    whole process group: the main process handles it (and stops the pool), the workers ignore it."""
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = load_tokenizer(name)


def encode_unit(texts: list[str], ends: list[bool]) -> np.ndarray:
    """One unit of ``prepare``'s work, in a worker process: the ids of ``texts``, concatenated."""
    return concatenate(_WORKER.encode_batch(texts, ends), _WORKER.dtype)


def concatenate(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

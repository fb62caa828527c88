"""``data.source = "hf"``: a Hugging Face dataset streamed into a bounded buffer, never read whole.

A peer holds two things in memory, whatever the dataset's size:

- the eval split: the first ``data.eval_tokens`` tokens of the (whole, unsplit) stream, the same on every
  peer. The documents they come from are remembered by an 8-byte digest and never trained on;
- a buffer of ``data.buffer_tokens`` consecutive tokens of this peer's part of the stream (``datasets``'
  ``split_dataset_by_node``: whole files of the dataset per peer when they divide evenly, every
  ``num_shards``-th document otherwise). Batches are random windows of the buffer; once as many tokens were
  drawn as it holds (each token seen about once), the next ``buffer_tokens`` of the stream replace it.
  At the end of its part a peer starts it again (the next epoch).

Resuming exactly: ``state()`` is the sampler's RNG state followed by where the buffer starts in the stream
(``datasets``' own ``state_dict``, which seeks to the right file and row, plus the tokens of that document
already used) and how much of it was drawn; ``restore`` re-reads that one buffer and goes on from there,
the same batches as a peer that never stopped.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from ..config import DataConfig, DataError
from .documents import open_hf_stream
from .tokenizer import Tokenizer, concatenate


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()


class TokenStream:
    """This peer's part of a streamed dataset, as a bounded buffer of tokens, and the held-out eval head.

    :param cfg: the ``[data]`` section: ``hf_dataset``, ``hf_split``, ``paths`` (data files for a local
        builder such as ``json``), ``text_field``, ``eval_tokens``, ``buffer_tokens``, ``num_shards``
    :param shard: this peer's part of the stream, in ``0..num_shards-1``
    :param tokenizer: text -> ids
    :param window: tokens per sample (``seq_len + 1``)
    """

    def __init__(self, cfg: DataConfig, shard: int, tokenizer: Tokenizer, window: int):
        self.cfg = cfg
        self.shard = shard
        self.tokenizer = tokenizer
        self.window = window
        self.eval, self._held_out = self._read_head()
        self.epoch = 0
        self._open(None)
        self.buffer = np.zeros(0, dtype=tokenizer.dtype)
        self.consumed = 0
        self._mark: dict | None = None
        """Where the buffer starts: epoch, the stream's state before its first document, tokens of it skipped."""

    def _read_head(self) -> tuple[np.ndarray, set[bytes]]:
        parts = []
        count = 0
        held_out = set()
        for row in open_hf_stream(self.cfg.hf_dataset, self.cfg.hf_split, self.cfg.paths):
            text = self._text(row)
            held_out.add(_digest(text))
            parts.append(self.tokenizer.encode(text))
            count += len(parts[-1])
            if count >= self.cfg.eval_tokens:
                break
        return concatenate(parts, self.tokenizer.dtype)[:self.cfg.eval_tokens], held_out

    def _text(self, row: dict) -> str:
        text = row.get(self.cfg.text_field)
        if not isinstance(text, str):
            raise DataError(f"a row of '{self.cfg.hf_dataset}' has no '{self.cfg.text_field}' string (it has "
                            f"{sorted(row)}): fix data.text_field")
        return text

    def _split(self, state: dict | None):
        """This peer's part of the stream, at ``state`` (``datasets``' ``state_dict``) or at its start."""
        from datasets.distributed import split_dataset_by_node

        stream = open_hf_stream(self.cfg.hf_dataset, self.cfg.hf_split, self.cfg.paths)
        dataset = split_dataset_by_node(stream, rank=self.shard, world_size=self.cfg.num_shards)
        if state is not None:
            dataset.load_state_dict(state)
        return dataset

    def _open(self, mark: dict | None) -> None:
        """Read this peer's part from ``mark`` on (None: from its start). The document there, less the tokens
        already used, is the carry that the next buffer starts with."""
        self.epoch = mark["epoch"] if mark else 0
        self._dataset = self._split(mark["stream"] if mark else None)
        self._documents = self._read()
        self._carry = np.zeros(0, dtype=self.tokenizer.dtype)
        self._carry_mark = None
        if mark:
            _, tokens = next(self._documents)
            self._carry = tokens[mark["skip"]:]
            self._carry_mark = mark

    def _read(self):
        """((epoch, stream state before the document), its tokens) for each document of this peer's part that
        is not held out, epoch after epoch."""
        empty_passes = 0
        while empty_passes < 2:  # the first pass may have started mid-way; the second one read it all
            empty_passes += 1
            state = self._dataset.state_dict()
            for row in self._dataset:
                text = self._text(row)
                if _digest(text) not in self._held_out:
                    empty_passes = 0
                    yield (self.epoch, state), self.tokenizer.encode(text)
                state = self._dataset.state_dict()
            self.epoch += 1
            self._dataset = self._split(None)
        raise DataError(f"data shard {self.shard} of '{self.cfg.hf_dataset}' has no document besides the eval "
                        f"head: use fewer data.num_shards or a smaller data.eval_tokens")

    def _fill(self) -> None:
        """The next ``buffer_tokens`` tokens of the stream: the carry of the document cut last time, then more."""
        parts = []
        count = 0
        tokens = self._carry
        mark = self._carry_mark
        start = mark
        while count + len(tokens) < self.cfg.buffer_tokens:
            parts.append(tokens)
            count += len(tokens)
            (epoch, state), tokens = next(self._documents)
            mark = {"epoch": epoch, "stream": state, "skip": 0}
            start = start or mark
        used = self.cfg.buffer_tokens - count  # this document ends the buffer; the rest of it starts the next
        parts.append(tokens[:used])
        self._carry = tokens[used:]
        self._carry_mark = {**mark, "skip": mark["skip"] + used}
        self._mark = start
        self.buffer = concatenate(parts, self.tokenizer.dtype)
        self.consumed = 0

    def batch(self, generator: torch.Generator, batch_size: int) -> torch.Tensor:
        """[batch_size, window] random windows of the buffer (refilled once as many tokens were drawn as it holds)."""
        if self.consumed >= len(self.buffer):
            self._fill()
        starts = torch.randint(0, len(self.buffer) - self.window + 1, (batch_size,), generator=generator)
        self.consumed += batch_size * self.window
        return torch.stack([torch.from_numpy(self.buffer[s:s + self.window].astype(np.int64))
                            for s in starts.tolist()])

    def position(self) -> bytes:
        """Where the sampler is in the stream (JSON): the buffer's start and how much of it was drawn."""
        return json.dumps({"mark": self._mark, "consumed": self.consumed}).encode()

    def restore(self, position: bytes) -> None:
        """Go back to ``position`` (from ``position()``, maybe of another process): the same buffer, the
        same draws to come."""
        saved = json.loads(position)
        self._open(saved["mark"])
        self.buffer = np.zeros(0, dtype=self.tokenizer.dtype)
        self.consumed = 0
        if saved["mark"] is not None:
            self._fill()
            self.consumed = saved["consumed"]

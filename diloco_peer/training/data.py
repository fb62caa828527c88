"""Training text as the trainer sees it: a held-out eval split and this peer's training shard, sampled.

``data.source`` picks where the tokens come from (``documents.py`` reads text, ``tokenizer.py`` encodes it):

- ``stdlib`` (the default): the Python standard library's own source, real text on every machine that can
  run this program, read with the byte-level tokenizer (no download); ``files``: local .txt / .jsonl /
  .parquet files. Both are read whole into memory at start-up (``data.max_bytes``, a few megabytes), and
  split deterministically, identically on every peer: documents are cut into blocks of ``BLOCK_CHARS``
  characters (so that a corpus of a few large files still splits evenly), every k-th block,
  k = 1 / ``eval_fraction``, is held out for eval, and the training blocks are dealt round-robin into
  ``num_shards`` shards;
- ``shards``: a directory written by ``diloco-peer prepare`` (``token_shards.py``), read in place: any size,
  start-up in milliseconds, memory for the windows sampled only;
- ``hf``: a Hugging Face dataset, streamed into a bounded buffer (``streaming.py``).

Each peer reads one shard (``data.shard``, or a hash of its peer id) and samples windows with an RNG
seeded by (seed, shard); ``rng_state`` / ``set_rng_state`` resume the sampling exactly from a checkpoint.
The eval windows are fixed, evenly spaced over the eval split: the same on every peer.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..config import DataConfig, DataError
from .documents import file_documents, stdlib_documents
from .token_shards import TokenShards
from .tokenizer import Tokenizer, load_tokenizer

BLOCK_CHARS = 2048


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % num_shards


def _read_blocks(cfg: DataConfig, shard: int, tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """stdlib / files: (this shard's training tokens, the eval tokens), read whole."""
    if cfg.source == "stdlib":
        documents = stdlib_documents(cfg.max_bytes)
    else:
        documents = file_documents(cfg.paths, cfg.text_field, cfg.max_bytes)
    eval_every = max(2, round(1 / cfg.eval_fraction))
    blocks = train_blocks = 0
    eval_parts = []
    shard_parts = []
    for doc in documents:
        for start in range(0, len(doc.text), BLOCK_CHARS):
            text = doc.text[start:start + BLOCK_CHARS]
            blocks += 1
            if blocks % eval_every == eval_every // 2:
                eval_parts.append(text)
            else:
                if train_blocks % cfg.num_shards == shard:
                    shard_parts.append(text)
                train_blocks += 1
    # the texts of a split are encoded at once: one pass of the (Rust or bytes) tokenizer, not one per block
    return tuple(torch.from_numpy(tokenizer.encode("".join(parts)).astype(np.int64))
                 for parts in (shard_parts, eval_parts))


class Corpus:
    """The eval split and one training shard of ``cfg``, with the batch samplers over them.

    :param cfg: the ``[data]`` section
    :param shard: this peer's training shard, in ``0..cfg.num_shards-1``
    :param vocab_size: ``model.vocab_size``: every token id must be below it
    """

    def __init__(self, cfg: DataConfig, shard: int, vocab_size: int):
        self.cfg = cfg
        self.shard = shard
        self.window = cfg.seq_len + 1
        if not 0 <= shard < cfg.num_shards:
            raise DataError(f"data.shard={shard} is out of range: use 0..{cfg.num_shards - 1} or -1 (auto)")
        self.generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard)
        self.shards: TokenShards | None = None
        self.stream = None
        self.train_tokens: torch.Tensor | None = None
        """stdlib / files: this shard's tokens (int64); None for the other sources."""
        if cfg.source == "shards":
            self.shards = TokenShards(cfg.shards_dir, cfg.num_shards, shard, self.window)
            self._check_vocab(self.shards.manifest["vocab_size"], vocab_size, f"the tokenizer of {cfg.shards_dir}")
            self.eval_tokens = self.shards.eval
        elif cfg.source == "hf":
            from .streaming import TokenStream  # imports the Hugging Face datasets library

            if cfg.buffer_tokens < 2 * self.window:
                raise DataError(f"data.buffer_tokens={cfg.buffer_tokens} must hold two windows of data.seq_len + 1 "
                                f"tokens: raise it to at least {2 * self.window}")
            tokenizer = load_tokenizer(cfg.tokenizer)
            self._check_vocab(tokenizer.vocab_size, vocab_size, f"tokenizer '{cfg.tokenizer}'")
            self.stream = TokenStream(cfg, shard, tokenizer, self.window)
            self.eval_tokens = self.stream.eval
        else:
            self.train_tokens, self.eval_tokens = _read_blocks(cfg, shard, load_tokenizer(cfg.tokenizer))
        self._check_sizes()
        if self.train_tokens is not None:  # read whole: look at every id (a bytes tokenizer has no vocab_size)
            too_big = max(self.train_tokens.max().item(), self.eval_tokens.max().item())
            if too_big >= vocab_size:
                raise DataError(f"token id {too_big} >= model.vocab_size={vocab_size}: raise model.vocab_size")

    @staticmethod
    def _check_vocab(needed: int, vocab_size: int, what: str) -> None:
        if needed > vocab_size:
            raise DataError(f"{what} has {needed} token ids but model.vocab_size={vocab_size}: set "
                            f"model.vocab_size={needed} (or more)")

    def _check_sizes(self) -> None:
        need = self.window * 2
        sizes = [("eval split", len(self.eval_tokens))]
        if self.train_tokens is not None:
            sizes.insert(0, ("training shard", len(self.train_tokens)))
        for what, size in sizes:
            if size < need:
                raise DataError(f"the {what} has only {size} tokens (need >= {need}): give more text "
                                f"(data.max_bytes, data.paths, data.eval_tokens) or fewer data.num_shards")

    def _window(self, tokens, start: int) -> torch.Tensor:
        window = tokens[start:start + self.window]
        return window if torch.is_tensor(window) else torch.from_numpy(window.astype(np.int64))

    def train_batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] random windows of this peer's shard (inputs = [:, :-1], targets = [:, 1:])."""
        if self.stream is not None:
            return self.stream.batch(self.generator, batch_size)
        if self.shards is not None:
            blocks = torch.randint(0, self.shards.num_blocks, (batch_size,), generator=self.generator)
            fractions = torch.rand(batch_size, generator=self.generator, dtype=torch.float64)
            return torch.stack([torch.from_numpy(self.shards.train_window(b, f).astype(np.int64))
                                for b, f in zip(blocks.tolist(), fractions.tolist())])
        starts = torch.randint(0, len(self.train_tokens) - self.window, (batch_size,), generator=self.generator)
        return torch.stack([self.train_tokens[s:s + self.window] for s in starts.tolist()])

    def eval_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The same fixed, evenly spaced eval windows on every peer."""
        count = self.cfg.eval_batches * batch_size
        last = len(self.eval_tokens) - self.window
        starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
        windows = torch.stack([self._window(self.eval_tokens, s) for s in starts])
        return list(windows.split(batch_size))

    def rng_state(self) -> torch.Tensor:
        """The sampler's state (uint8): the RNG's, and for a streamed dataset where the stream is."""
        state = self.generator.get_state()
        if self.stream is None:
            return state
        return torch.cat([state, torch.frombuffer(bytearray(self.stream.position()), dtype=torch.uint8)])

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Resume sampling where ``rng_state()`` was taken (in this process or another)."""
        size = len(self.generator.get_state())
        self.generator.set_state(state[:size].clone())
        if self.stream is not None and len(state) > size:
            self.stream.restore(bytes(state[size:].tolist()))

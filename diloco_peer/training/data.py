"""Training text: documents -> tokens -> a held-out eval split and per-peer training shards.

The default corpus is the Python standard library's own source (``data.source = "stdlib"``): real text
that exists on every machine that can run this program, read with a byte-level tokenizer that needs no
download. Local ``.txt``/``.jsonl`` files and Hugging Face datasets/tokenizers work the same way.

Splitting is deterministic and identical on every peer. Documents are cut into blocks of
``BLOCK_CHARS`` characters (so that a corpus of a few large files still splits evenly), then:
- every k-th block, k = 1 / ``eval_fraction``, is held out for eval (evenly spread over the corpus);
- training blocks are dealt round-robin into ``num_shards`` shards; each peer reads one shard
  (``data.shard``, or a hash of its peer id), sampling windows with an RNG seeded by (seed, shard).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DataConfig, DataError

BLOCK_CHARS = 2048


@dataclass
class Document:
    name: str
    text: str


def stdlib_documents(max_bytes: int) -> Iterator[Document]:
    """The standard library's *.py files in sorted order (site-packages excluded: it differs per machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield Document(rel, text)
        total += len(text)
        if total >= max_bytes:
            return


def file_documents(paths: list[str], text_field: str, max_bytes: int) -> Iterator[Document]:
    """Plain text files (one document each) and JSONL files (one document per line, ``text_field``)."""
    total = 0
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise DataError(f"data file '{raw}' does not exist: fix data.paths")
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[text_field]
                        if not isinstance(text, str):
                            raise TypeError(text_field)
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(f"{path}:{lineno} is not a JSON object with a '{text_field}' string: "
                                        f"fix the file or data.text_field") from None
                    yield Document(f"{path}:{lineno}", text)
                    total += len(text)
                    if total >= max_bytes:
                        return
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            yield Document(str(path), text)
            total += len(text)
            if total >= max_bytes:
                return


def hf_documents(cfg: DataConfig) -> Iterator[Document]:  # pragma: no cover - needs internet
    try:
        import datasets
    except ImportError:
        raise DataError('data.source="hf" needs the Hugging Face extras: pip install ".[hf]"') from None
    name, _, subset = cfg.hf_dataset.partition(":")
    stream = datasets.load_dataset(name, subset or None, split=cfg.hf_split, streaming=True)
    total = 0
    for i, row in enumerate(stream):
        text = row[cfg.text_field]
        yield Document(f"{cfg.hf_dataset}#{i}", text)
        total += len(text)
        if total >= cfg.max_bytes:
            return


def build_tokenizer(name: str) -> Callable[[str], bytes | list[int]]:
    if name == "bytes":
        return lambda text: text.encode("utf-8")
    try:  # pragma: no cover - needs internet or a local tokenizer folder
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"tokenizer '{name}' needs the Hugging Face extras: pip install \".[hf]\"") from None
    tokenizer = AutoTokenizer.from_pretrained(name)  # pragma: no cover
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _as_tensor(tokens: bytearray | list[int]) -> torch.Tensor:
    if isinstance(tokens, bytearray):
        return torch.frombuffer(tokens, dtype=torch.uint8).long()
    return torch.tensor(tokens, dtype=torch.long)


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % num_shards


class Corpus:
    """Token streams of the eval split and of one training shard, plus batch samplers over them."""

    def __init__(self, cfg: DataConfig, shard: int, vocab_size: int):
        self.cfg, self.shard = cfg, shard
        if not 0 <= shard < cfg.num_shards:
            raise DataError(f"data.shard={shard} is out of range: use 0..{cfg.num_shards - 1} or -1 (auto)")
        if cfg.source == "stdlib":
            documents = stdlib_documents(cfg.max_bytes)
        elif cfg.source == "files":
            documents = file_documents(cfg.paths, cfg.text_field, cfg.max_bytes)
        else:
            documents = hf_documents(cfg)
        tokenize = build_tokenizer(cfg.tokenizer)

        # bytearray for the byte tokenizer: 10x faster than a list of ints for megabytes of text
        eval_every = max(2, round(1 / cfg.eval_fraction))
        blocks = train_blocks = 0
        eval_tokens, shard_tokens = (bytearray(), bytearray()) if cfg.tokenizer == "bytes" else ([], [])
        for doc in documents:
            for start in range(0, len(doc.text), BLOCK_CHARS):
                text = doc.text[start:start + BLOCK_CHARS]
                blocks += 1
                if blocks % eval_every == eval_every // 2:
                    eval_tokens.extend(tokenize(text))
                else:
                    if train_blocks % cfg.num_shards == shard:
                        shard_tokens.extend(tokenize(text))
                    train_blocks += 1
        window = cfg.seq_len + 1
        for what, tokens in (("training shard", shard_tokens), ("eval split", eval_tokens)):
            if len(tokens) < window * 2:
                raise DataError(
                    f"the {what} has only {len(tokens)} tokens (need >= {window * 2}): "
                    f"give more text (data.max_bytes, data.paths) or fewer data.num_shards"
                )
        self.train_tokens, self.eval_tokens = _as_tensor(shard_tokens), _as_tensor(eval_tokens)
        too_big = max(self.train_tokens.max().item(), self.eval_tokens.max().item())
        if too_big >= vocab_size:
            raise DataError(f"token id {too_big} >= model.vocab_size={vocab_size}: raise model.vocab_size")
        self.generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard)

    def train_batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] random windows of this peer's shard (inputs = [:, :-1], targets = [:, 1:])."""
        window = self.cfg.seq_len + 1
        starts = torch.randint(0, len(self.train_tokens) - window, (batch_size,), generator=self.generator)
        return torch.stack([self.train_tokens[s:s + window] for s in starts.tolist()])

    def eval_batches(self, batch_size: int) -> list[torch.Tensor]:
        """The same fixed, evenly spaced eval windows on every peer."""
        window = self.cfg.seq_len + 1
        count = self.cfg.eval_batches * batch_size
        last = len(self.eval_tokens) - window
        starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
        windows = torch.stack([self.eval_tokens[s:s + window] for s in starts])
        return list(windows.split(batch_size))

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

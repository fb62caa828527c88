"""``diloco-peer prepare``: text of any size -> token shards that peers read in place (``token_shards.py``).

    diloco-peer prepare corpus/ --out data/corpus --train-tokenizer 8192      # own text, own BPE, offline
    diloco-peer prepare --hf-dataset allenai/c4:en --tokenizer mistralai/Mistral-7B-v0.1 \\
        --max-tokens 2_000_000_000 --out data/c4                             # with internet, streamed

The input is read in order, in pieces (``documents.read_pieces``), grouped into units of about
``UNIT_CHARS`` characters; worker processes tokenize the units in parallel and the main process writes
their tokens, in input order, into ``eval.bin`` (the first ``eval_tokens``) and then the training files.
At most two units per worker are in flight, so memory stays flat whatever the input's size.

Resuming: each finished file is listed in the manifest with where in the input it ends (unit number, the
unit's position in the input, tokens of that unit already used). Run again with the same arguments, a
killed prepare checks the files it lists (sha256; a damaged one is redone with everything after it),
seeks to where the last one ended and goes on. Units are cut the same way whether reading started at the
beginning or at a unit's position, so the result is the same byte for byte as an uninterrupted run.
"""

from __future__ import annotations

import multiprocessing
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..config import DataError
from .documents import PIECE_BYTES, Piece, Position, collect_inputs, hf_pieces, read_pieces
from .token_shards import FORMAT, VERSION, ShardWriter, read_manifest, sha256_file, write_json_atomically
from .tokenizer import Tokenizer, concatenate, encode_unit, init_worker, is_local, load_tokenizer, local_file, train_bpe

UNIT_CHARS = 1 << 20
"""Characters of text per unit of work handed to a worker process."""
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class PrepareJob:
    """What to prepare (``diloco-peer prepare``'s arguments).

    :param inputs: .txt / .jsonl / .parquet files or directories of them; with ``hf_dataset``, data files
        for a local builder (``json``, ``parquet``, ``text``)
    :param out: the output directory (created; an interrupted run there is resumed)
    :param tokenizer: ``bytes``, a tokenizer.json path, or a Hugging Face name (ignored with ``train_tokenizer``)
    :param train_tokenizer: if > 0, train a byte-level BPE of this many ids on the input first
    :param tokenizer_sample_bytes: train it on (about) the first this many characters of the input
    :param text_field: the text of a .jsonl line, a .parquet row or a dataset's row
    :param hf_dataset: stream this Hugging Face dataset (``name`` or ``name:config``) instead of files
    :param hf_split: its split
    :param shard_tokens: tokens per training file
    :param eval_tokens: tokens of the eval split (the head of the input)
    :param max_tokens: stop after this many tokens in all (0: the whole input)
    :param workers: tokenizer processes (1: in this process)
    :param unit_chars: characters per unit of work (smaller: more, shorter tasks; tests use small ones)
    :param piece_bytes: longest piece of a .txt file read at once
    """

    inputs: tuple[str, ...] = ()
    out: str = "data"
    tokenizer: str = "bytes"
    train_tokenizer: int = 0
    tokenizer_sample_bytes: int = 100_000_000
    text_field: str = "text"
    hf_dataset: str = ""
    hf_split: str = "train"
    shard_tokens: int = 100_000_000
    eval_tokens: int = 1_000_000
    max_tokens: int = 0
    workers: int = 1
    unit_chars: int = UNIT_CHARS
    piece_bytes: int = PIECE_BYTES

    def pieces(self, start: Position = Position()) -> Iterator[Piece]:
        if self.hf_dataset:
            return hf_pieces(self.hf_dataset, self.hf_split, list(self.inputs), self.text_field, start)
        return read_pieces(collect_inputs(list(self.inputs)), self.text_field, start, self.piece_bytes)

    def settings(self) -> dict:
        """What the output depends on: a rerun must ask for the same to resume."""
        if self.hf_dataset:
            inputs = [{"hf_dataset": self.hf_dataset, "split": self.hf_split, "data_files": list(self.inputs)}]
        else:
            inputs = [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in collect_inputs(list(self.inputs))]
        if self.train_tokenizer:
            tokenizer = {"train_bpe": self.train_tokenizer, "sample_bytes": self.tokenizer_sample_bytes}
        elif is_local(self.tokenizer):
            tokenizer = {"file_sha256": sha256_file(local_file(self.tokenizer))}
        else:
            tokenizer = {"name": self.tokenizer}
        return {"inputs": inputs, "text_field": self.text_field, "tokenizer": tokenizer,
                "shard_tokens": self.shard_tokens, "eval_tokens": self.eval_tokens, "max_tokens": self.max_tokens,
                "unit_chars": self.unit_chars, "piece_bytes": self.piece_bytes}


def _sample(pieces: Iterator[Piece], chars: int) -> Iterator[str]:
    total = 0
    for piece in pieces:
        yield piece.text
        total += len(piece.text)
        if total >= chars:
            return


def _tokenizer(job: PrepareJob, out: Path, manifest: dict | None) -> tuple[Tokenizer, str]:
    """The tokenizer, and its name in the manifest: ``tokenizer.json`` (in ``out``) for a local or trained BPE."""
    path = out / TOKENIZER_FILE
    if job.train_tokenizer:
        if manifest is not None and path.is_file() and sha256_file(path) == manifest.get("tokenizer_sha256"):
            return load_tokenizer(str(path)), TOKENIZER_FILE  # trained by the run we resume
        print(f"training a byte-level BPE tokenizer of {job.train_tokenizer} ids on up to "
              f"{job.tokenizer_sample_bytes:,} characters of the input")
        texts = _sample(job.pieces(), job.tokenizer_sample_bytes)
        return train_bpe(texts, job.train_tokenizer, path, progress=sys.stderr.isatty()), TOKENIZER_FILE
    if is_local(job.tokenizer):
        source = local_file(job.tokenizer)
        if source.resolve() != path.resolve():
            shutil.copyfile(source, path.with_name(path.name + ".tmp"))
            path.with_name(path.name + ".tmp").replace(path)
        return load_tokenizer(str(path)), TOKENIZER_FILE
    return load_tokenizer(job.tokenizer), job.tokenizer


def _verified(out: Path, manifest: dict) -> dict:
    """``manifest`` without the files that are missing or damaged and everything after the first of them."""
    entries = ([manifest["eval"]] if manifest["eval"] else []) + manifest["train"]
    good = 0
    for entry in tqdm(entries, desc="checking finished files", unit="file", disable=None):
        path = out / entry["file"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            print(f"{path} is missing or damaged: preparing it again, and everything after it")
            break
        good += 1
    if good == len(entries):
        return manifest
    kept = entries[:good]
    return {**manifest, "eval": kept[0] if kept else None, "train": kept[1:], "complete": False}


def _start(job: PrepareJob, out: Path) -> tuple[dict, Tokenizer]:
    """The manifest to continue (resumed, or new and saved) and the tokenizer."""
    settings = job.settings()
    manifest = read_manifest(out)
    if manifest is not None and manifest["settings"] != settings:
        if manifest["eval"] is not None:  # finished files that other settings would not produce
            changed = [key for key in settings if settings[key] != manifest["settings"].get(key)]
            raise DataError(f"--out {out} holds data prepared with other settings ({', '.join(changed)} differ): "
                            f"use another --out, or delete {out} to start over")
        manifest = None  # nothing finished yet: start over with these settings
    if manifest is not None:
        manifest = _verified(out, manifest)
    tokenizer, name = _tokenizer(job, out, manifest)
    if manifest is not None and name == TOKENIZER_FILE and \
            manifest.get("tokenizer_sha256") != sha256_file(out / TOKENIZER_FILE):
        manifest = None  # a tokenizer trained again: the finished files may hold other ids
    if manifest is None:
        manifest = {"format": FORMAT, "version": VERSION, "settings": settings, "eval": None, "train": [],
                    "complete": False}
    manifest.update(tokenizer=name, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                    dtype=tokenizer.dtype.name)
    if name == TOKENIZER_FILE:
        manifest["tokenizer_sha256"] = sha256_file(out / TOKENIZER_FILE)
    for leftover in out.glob("*.tmp"):  # a file being written when the last run died: never listed
        leftover.unlink()
    write_json_atomically(out / "manifest.json", manifest)
    return manifest, tokenizer


def _units(pieces: Iterator[Piece], number: int, size: int) -> Iterator[tuple[dict, list[str], list[bool]]]:
    """Pieces grouped into units of ``size`` characters: (``{"unit": number, "pos": its start}``, texts, ends)."""
    texts = []
    ends = []
    chars = 0
    start = None
    for piece in pieces:
        start = start or piece.start
        texts.append(piece.text)
        ends.append(piece.ends_document)
        chars += len(piece.text)
        if chars >= size:
            yield {"unit": number, "pos": start.to_json()}, texts, ends
            texts = []
            ends = []
            chars = 0
            start = None
            number += 1
    if texts:
        yield {"unit": number, "pos": start.to_json()}, texts, ends


def _tokenized(units, tokenizer: Tokenizer, workers: int):
    """``(where, tokens)`` per unit, in input order; units are tokenized by ``workers`` processes."""
    if workers <= 1:
        for where, texts, ends in units:
            yield where, concatenate(tokenizer.encode_batch(texts, ends), tokenizer.dtype)
        return
    # spawn, not fork: the parent may hold threads (torch's, the Rust tokenizer's) that a fork would break
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker,
                             initargs=(tokenizer.name,)) as pool:
        pending = deque()
        try:
            for where, texts, ends in units:
                pending.append((where, pool.submit(encode_unit, texts, ends)))
                if len(pending) >= 2 * workers:
                    where, future = pending.popleft()
                    yield where, future.result()
            while pending:
                where, future = pending.popleft()
                yield where, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def _input_progress(job: PrepareJob):
    """(the input's size in bytes, position -> bytes of input before it) for a progress bar with an end;
    (None, None) for a stream, whose size is unknown. A .parquet file's rows count as equal shares of it."""
    if job.hf_dataset:
        return None, None
    paths = collect_inputs(list(job.inputs))
    sizes = [p.stat().st_size for p in paths]
    rows = [0] * len(paths)
    if any(p.suffix == ".parquet" for p in paths):
        import pyarrow.parquet as pq

        rows = [pq.ParquetFile(p).metadata.num_rows if p.suffix == ".parquet" else 0 for p in paths]
    before = [sum(sizes[:i]) for i in range(len(paths) + 1)]

    def done(pos: list) -> int:
        file, offset = pos[0], pos[1]
        return before[-1] if file >= len(paths) else before[file] + (offset * sizes[file] // rows[file]
                                                                      if rows[file] else offset)

    return before[-1], done


def _write(job: PrepareJob, out: Path, manifest: dict, tokenizer: Tokenizer) -> None:
    """Tokenize the input from where the finished files end and write the rest of the files."""
    last = manifest["train"][-1] if manifest["train"] else manifest["eval"]
    end = last["end"] if last else {"unit": 0, "pos": [0, 0, 1], "skip": 0}
    written = (manifest["eval"] or {}).get("tokens", 0) + sum(e["tokens"] for e in manifest["train"])
    writer = ShardWriter(out, manifest, tokenizer.dtype)
    units = _units(job.pieces(Position(*end["pos"])), end["unit"], job.unit_chars)
    total, done = _input_progress(job)  # a bar over the input's bytes (a unit late), or over tokens for a stream
    bar = tqdm(desc=f"prepare -> {out}", unit="B" if total else "tok", unit_scale=True, total=total,
               initial=done(end["pos"]) if total else written, disable=None)
    where = end
    skip = end["skip"]
    try:
        for where, tokens in _tokenized(units, tokenizer, job.workers):
            tokens = tokens[skip:]
            if job.max_tokens:
                tokens = tokens[:job.max_tokens - written]
            writer.feed(tokens, where, skip)
            written += len(tokens)
            bar.update(done(where["pos"]) - bar.n if total else len(tokens))
            bar.set_postfix_str(f"{written:,} tokens", refresh=False)
            skip = 0
            if job.max_tokens and written >= job.max_tokens:
                break
        if not writer.eval_done:
            raise DataError(f"the input has only {written:,} tokens, fewer than --eval-tokens {job.eval_tokens:,}: "
                            f"give more text or a smaller --eval-tokens")
        if not manifest["train"] and not writer.open_tokens:
            raise DataError(f"no tokens are left for training after the eval split of {job.eval_tokens:,}: give "
                            f"more text, or prepare into a new --out with a smaller --eval-tokens")
        writer.finish({**where, "skip": skip})
        if total:
            bar.update(total - bar.n)
    finally:
        writer.abandon()
        bar.close()


def prepare(job: PrepareJob) -> dict:
    """Run ``job`` (resuming an interrupted run in ``job.out``); returns the finished manifest."""
    out = Path(job.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out} cannot be created ({e.strerror}): choose another directory") from None
    manifest, tokenizer = _start(job, out)
    if not manifest["complete"]:
        _write(job, out, manifest, tokenizer)
    return manifest

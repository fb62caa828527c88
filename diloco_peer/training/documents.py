"""Where text comes from: the standard library, local .txt / .jsonl / .parquet files, a Hugging Face dataset.

Two ways to read them:

- whole documents (``stdlib_documents``, ``file_documents``), for the in-memory corpora of
  ``data.source = "stdlib"`` and ``"files"`` (a few megabytes);
- pieces with positions (``read_pieces``), for ``diloco-peer prepare`` on inputs of any size: a piece is
  at most ``PIECE_BYTES`` of text (a long .txt file is cut at line ends) and knows where it starts, so
  that an interrupted prepare resumes by seeking to it instead of reading everything again.

A .txt file is one document; a .jsonl file holds one document per line (its ``text_field``); a .parquet
file one per row (its ``text_field`` column). Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import DataError

PIECE_BYTES = 1 << 20
"""Largest piece of a .txt file that ``read_pieces`` yields by default (bytes of input)."""
INPUT_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""What ``collect_inputs`` takes from a directory."""


@dataclass
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class Position:
    """Where reading (re)starts: the input's index, then the byte offset in it (.txt, .jsonl) or the row
    (.parquet; a streamed dataset's document number), and for .jsonl the line number (for error messages).
    A streamed dataset's position also carries its ``state_dict`` (which file, which row), to seek there."""

    file: int = 0
    offset: int = 0
    line: int = 1
    stream: dict | None = None

    def to_json(self) -> list:
        return [self.file, self.offset, self.line, *([self.stream] if self.stream is not None else [])]


@dataclass
class Piece:
    text: str
    ends_document: bool
    start: Position


def stdlib_documents(max_bytes: int) -> Iterator[Document]:
    """The standard library's *.py files in sorted order (site-packages excluded: it differs per machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(_stdlib_sources(root)):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield Document(rel, text)
        total += len(text)
        if total >= max_bytes:
            return


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """The *.py files under ``root``, not looking into its site-packages (or dist-packages) at all: an interpreter's
    own site-packages can hold far more files than the standard library (IPython, pytest...), and walking them took
    most of a corpus's start-up. Symlinked directories are not followed (as ``Path.rglob`` does not)."""
    for folder, subfolders, files in os.walk(root):
        if folder == str(root):
            subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        yield from (Path(folder, name) for name in files if name.endswith(".py"))


def _json_text(line: str, where: str, text_field: str) -> str:
    try:
        text = json.loads(line)[text_field]
        if not isinstance(text, str):
            raise TypeError(text_field)
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"{where} is not a JSON object with a '{text_field}' string: "
                        f"fix the file or the text field (data.text_field, --text-field)") from None
    return text


def file_documents(paths: list[str], text_field: str, max_bytes: int) -> Iterator[Document]:
    """Whole documents of .txt, .jsonl and .parquet files, until ``max_bytes`` characters were read."""
    total = 0
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise DataError(f"data file '{raw}' does not exist: fix data.paths")
        if path.suffix in (".jsonl", ".parquet"):
            docs = (Document(f"{path}:{p.start.line if path.suffix == '.jsonl' else p.start.offset}", p.text)
                    for p in read_pieces([path], text_field))
        else:
            docs = iter([Document(str(path), path.read_text(encoding="utf-8", errors="replace"))])
        for doc in docs:
            yield doc
            total += len(doc.text)
            if total >= max_bytes:
                return


def collect_inputs(raw_paths: list[str]) -> list[Path]:
    """The input files ``raw_paths`` name: files as given, directories expanded into their .txt, .jsonl and
    .parquet files (recursively, sorted: the same order on every machine)."""
    found = []
    for raw in raw_paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.suffix in INPUT_SUFFIXES and p.is_file())
            if not inside:
                raise DataError(f"input directory '{raw}' holds no .txt, .jsonl or .parquet file: give text files")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise DataError(f"input '{raw}' does not exist: give .txt, .jsonl or .parquet files or directories")
    return found


def _utf8_cut(chunk: bytes) -> int:
    """Where to cut ``chunk`` so that both halves decode: after its last line end, else before a character."""
    cut = chunk.rfind(b"\n") + 1
    if cut:
        return cut
    cut = len(chunk)
    while cut > len(chunk) - 3 and (chunk[cut - 1] & 0xC0) == 0x80:  # UTF-8 continuation bytes
        cut -= 1
    return cut - 1 if chunk[cut - 1] >= 0xC0 else cut  # and the lead byte they continue


def _txt_pieces(path: Path, index: int, offset: int, piece_bytes: int) -> Iterator[Piece]:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        while offset < size:
            f.seek(offset)
            chunk = f.read(piece_bytes)
            if offset + len(chunk) < size:
                chunk = chunk[:_utf8_cut(chunk)]
            yield Piece(chunk.decode("utf-8", errors="replace"), offset + len(chunk) >= size,
                        Position(index, offset))
            offset += len(chunk)


def _jsonl_pieces(path: Path, index: int, offset: int, line: int, text_field: str) -> Iterator[Piece]:
    with path.open("rb") as f:
        f.seek(offset)
        for raw in f:
            start = Position(index, offset, line)
            offset += len(raw)
            line += 1
            text = raw.decode("utf-8", errors="replace")
            if text.strip():
                yield Piece(_json_text(text, f"{path}:{start.line}", text_field), True, start)


def _parquet_pieces(path: Path, index: int, row: int, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading '{path}' needs pyarrow: pip install \".[hf]\"") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a parquet file
        raise DataError(f"'{path}' is not a readable parquet file ({e}): fix or remove it") from None
    if text_field not in parquet.schema_arrow.names:
        raise DataError(f"'{path}' has no column '{text_field}' (it has {parquet.schema_arrow.names}): "
                        f"fix the text field (data.text_field, --text-field)")
    first = 0  # skip whole row groups before ``row`` without reading them
    group_start = 0
    while first < parquet.num_row_groups and group_start + parquet.metadata.row_group(first).num_rows <= row:
        group_start += parquet.metadata.row_group(first).num_rows
        first += 1
    at = group_start
    for batch in parquet.iter_batches(batch_size=1024, row_groups=list(range(first, parquet.num_row_groups)),
                                      columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if at >= row:
                if not isinstance(text, str):
                    raise DataError(f"{path} row {at}: '{text_field}' is not a string: fix the file")
                yield Piece(text, True, Position(index, at))
            at += 1


def read_pieces(paths: list[Path], text_field: str, start: Position = Position(),
                piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """The text of ``paths`` from ``start`` on, in pieces of at most ``piece_bytes`` (whole documents for
    .jsonl and .parquet); the same pieces whether reading began at the start or at a piece's position."""
    for index in range(start.file, len(paths)):
        path = paths[index]
        offset, line = (start.offset, start.line) if index == start.file else (0, 1)
        if path.suffix == ".jsonl":
            yield from _jsonl_pieces(path, index, offset, line, text_field)
        elif path.suffix == ".parquet":
            yield from _parquet_pieces(path, index, offset, text_field)
        else:
            yield from _txt_pieces(path, index, offset, piece_bytes)


def open_hf_stream(dataset: str, split: str, data_files: list[str]):
    """A Hugging Face dataset as a stream (``datasets.IterableDataset``): nothing is downloaded ahead.

    :param dataset: ``name`` or ``name:config`` on the hub (``allenai/c4:en``), or a local builder
        (``json``, ``parquet``, ``text``) with ``data_files``: the same code path, no internet needed
    :param data_files: files for a local builder; empty for a hub dataset
    """
    try:
        import datasets
    except ImportError:
        raise DataError('a Hugging Face dataset needs the Hugging Face extras: pip install ".[hf]"') from None
    name, _, subset = dataset.partition(":")
    if data_files:  # local files: no reason to tell the hub (its download counter, a request that waits offline)
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        return datasets.load_dataset(name, subset or None, split=split, streaming=True,
                                     data_files=list(data_files) or None)
    except Exception as e:  # not found, offline, bad split: datasets raises many kinds, all about this input
        reason = " ".join(str(e).splitlines())[:160]
        raise DataError(f"cannot stream dataset '{dataset}' split '{split}' ({type(e).__name__}: {reason}): "
                        f"check the name, split and internet connection") from None


def hf_pieces(dataset: str, split: str, data_files: list[str], text_field: str,
              start: Position = Position()) -> Iterator[Piece]:
    """A streamed dataset's documents from ``start`` on (document number ``start.offset``), as pieces. The
    stream seeks to ``start.stream`` (``datasets``' state: file and row), rather than reading up to it."""
    stream = open_hf_stream(dataset, split, data_files)
    if start.stream is not None:
        stream.load_state_dict(start.stream)
    elif start.offset:
        stream = stream.skip(start.offset)
    state = stream.state_dict()
    for number, row in enumerate(stream, start.offset):
        text = row.get(text_field)
        if not isinstance(text, str):
            raise DataError(f"document {number} of '{dataset}' has no '{text_field}' string: fix the text "
                            f"field (data.text_field, --text-field)")
        yield Piece(text, True, Position(0, number, 1, state))
        state = stream.state_dict()

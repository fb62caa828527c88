"""``diloco-peer prepare``: text -> token shards + manifest; exact content, resume after a kill, the offline BPE.

The inputs are small local files (stdlib source as text), so that the whole file takes a few seconds: byte
tokens where the content is checked byte for byte, a 300-id BPE where a real subword tokenizer matters.
"""

import json
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco_peer import cli
from diloco_peer.config import DataError
from diloco_peer.training.prepare import PrepareJob, prepare
from diloco_peer.training.token_shards import EVAL_FILE, MANIFEST
from diloco_peer.training.tokenizer import END_OF_TEXT, load_tokenizer, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_texts(count: int, skip: int = 0) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(STDLIB.glob("*.py"))[skip:skip + count]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[list[Path], bytes]:
    """A .txt (with multi-byte characters), a .jsonl and a .parquet (row groups of 3), and the UTF-8 bytes
    of their documents in order: what a byte-tokenized prepare must write."""
    folder = tmp_path_factory.mktemp("inputs")
    txt = "".join(stdlib_texts(4)) + "\n".join(f"ünïcödé {i} €𝄞" for i in range(2000))
    docs = stdlib_texts(12, skip=4)
    rows = stdlib_texts(7, skip=16)
    (folder / "a.txt").write_text(txt, encoding="utf-8")
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n\n" for d in docs), encoding="utf-8")
    pq.write_table(pa.table({"text": rows, "id": list(range(len(rows)))}), folder / "c.parquet", row_group_size=3)
    expected = "".join([txt, *docs, *rows]).encode("utf-8")
    return [folder / "a.txt", folder / "b.jsonl", folder / "c.parquet"], expected


def files_of(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != MANIFEST}


def small_job(inputs, out, **kw) -> PrepareJob:
    """Small units, pieces and files: resume points fall everywhere (in .txt pieces, .jsonl lines, parquet rows)."""
    settings = dict(inputs=tuple(str(p) for p in inputs), out=str(out), shard_tokens=30_000, eval_tokens=7_000,
                    unit_chars=20_000, piece_bytes=9_000)
    return PrepareJob(**{**settings, **kw})


def test_byte_shards_hold_the_input_in_order_and_the_manifest_describes_them(inputs, tmp_path):
    paths, expected = inputs
    manifest = prepare(small_job(paths, tmp_path))
    eval_bytes = (tmp_path / EVAL_FILE).read_bytes()
    train = b"".join((tmp_path / e["file"]).read_bytes() for e in manifest["train"])
    assert eval_bytes + train == expected  # nothing lost, duplicated or reordered; UTF-8 cut cleanly
    assert len(eval_bytes) == 7_000 and all(e["tokens"] == 30_000 for e in manifest["train"][:-1])
    assert manifest["complete"] and manifest["dtype"] == "uint8" and manifest["vocab_size"] == 256
    assert manifest["tokenizer"] == "bytes" and manifest["eos_id"] is None
    assert [Path(i["path"]).name for i in manifest["settings"]["inputs"]] == ["a.txt", "b.jsonl", "c.parquet"]
    import hashlib

    for entry in [manifest["eval"], *manifest["train"]]:
        data = (tmp_path / entry["file"]).read_bytes()
        assert entry["tokens"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert not list(tmp_path.glob("*.tmp"))


def test_an_interrupted_run_resumes_from_any_file_to_the_same_bytes(inputs, tmp_path):
    """The state a kill leaves after file k (files up to k listed, the next one half-written under its
    temporary name, maybe renamed but unlisted), resumed, gives the uninterrupted result."""
    paths, _ = inputs
    reference = prepare(small_job(paths, tmp_path / "full"))
    expected = files_of(tmp_path / "full")
    entries = reference["train"]
    for kept in (0, 1, len(entries) // 2, len(entries) - 1):
        out = tmp_path / f"cut{kept}"
        prepare(small_job(paths, out))
        manifest = json.loads((out / MANIFEST).read_text())
        for entry in entries[kept + 1:]:
            (out / entry["file"]).unlink()  # never written; entries[kept] stays: renamed, not yet listed
        (out / (entries[-1]["file"] + ".tmp")).write_bytes(b"half a file")
        manifest.update(train=entries[:kept], complete=False)
        (out / MANIFEST).write_text(json.dumps(manifest))
        kept_inode = (out / entries[0]["file"]).stat().st_ino if kept else None
        resumed = prepare(small_job(paths, out))
        assert files_of(out) == expected and resumed["train"] == entries, kept
        if kept:  # finished files are kept (checked, not rewritten)
            assert (out / entries[0]["file"]).stat().st_ino == kept_inode


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe(stdlib_texts(20), 300, path)
    return path


def test_a_killed_prepare_resumes_and_matches_a_parallel_run(bpe, tmp_path):
    """A real SIGKILL mid-run, a damaged finished file, then the same job again: the result equals an
    uninterrupted run with 2 worker processes, file for file."""
    (tmp_path / "big.txt").write_text("".join(stdlib_texts(30, skip=20))[:400_000])
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in stdlib_texts(10)))
    job = dict(inputs=(str(tmp_path / "big.txt"), str(tmp_path / "docs.jsonl")), tokenizer=str(bpe),
               shard_tokens=10_000, eval_tokens=5_000, unit_chars=40_000, workers=1)
    out = tmp_path / "killed"
    code = f"from diloco_peer.training.prepare import *; prepare(PrepareJob(**{job!r}, out={str(out)!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            manifest = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else {}
            if len(manifest.get("train", [])) >= 2:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    killed = json.loads((out / MANIFEST).read_text())
    assert not killed["complete"] and len(killed["train"]) >= 2, "the run ended before it could be killed"
    damaged = out / killed["train"][1]["file"]
    damaged.write_bytes(b"\0" + damaged.read_bytes()[1:])

    resumed = prepare(PrepareJob(**job, out=str(out)))
    reference = prepare(PrepareJob(**{**job, "workers": 2}, out=str(tmp_path / "parallel")))
    assert resumed["train"] == reference["train"] and files_of(out) == files_of(tmp_path / "parallel")
    ids = np.concatenate([np.fromfile(out / e["file"], dtype=np.uint16) for e in resumed["train"]])
    assert resumed["dtype"] == "uint16" and ids.max() < 300
    assert (ids == 0).sum() == 11, "each document (1 .txt, 10 .jsonl lines) ends with <|endoftext|> (id 0)"


def test_train_tokenizer_writes_a_bpe_that_loads_offline(inputs, tmp_path, capsys):
    paths, _ = inputs
    out = tmp_path / "bpe"
    assert cli.main(["prepare", *map(str, paths), "--out", str(out), "--train-tokenizer", "320",
                     "--eval-tokens", "3000", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "data.source=shards" in printed and "model.vocab_size=320" in printed
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tokenizer"] == "tokenizer.json" and manifest["vocab_size"] == 320
    tokenizer = load_tokenizer(str(out / "tokenizer.json"))  # tokenizers only: no transformers, no internet
    assert tokenizer.eos_id == 0 and tokenizer.vocab_size == 320
    text = "def prepare(job):\n    return 'ünïcödé'\n"
    ids = tokenizer.encode(text, end_of_document=False)
    assert len(ids) < len(text.encode()) and tokenizer.decode(ids) == text
    assert tokenizer.encode(text)[-1] == tokenizer._backend.token_to_id(END_OF_TEXT)
    # the same command again finds the run complete and keeps the trained tokenizer
    before = (out / "tokenizer.json").stat().st_mtime_ns
    assert cli.main(["prepare", *map(str, paths), "--out", str(out), "--train-tokenizer", "320",
                     "--eval-tokens", "3000", "--workers", "1"]) == 0
    assert (out / "tokenizer.json").stat().st_mtime_ns == before


def test_prepare_streams_a_dataset_through_the_hugging_face_path_and_resumes(inputs, tmp_path):
    """--hf-dataset with a local builder: the streaming code path, without internet; an interrupted run
    seeks back into the stream (``datasets``' state) rather than reading it again."""
    paths, _ = inputs
    job = PrepareJob(inputs=(str(paths[1]),), out=str(tmp_path), hf_dataset="json", eval_tokens=2000,
                     shard_tokens=20_000, unit_chars=30_000, max_tokens=120_000)
    manifest = prepare(job)
    docs = [json.loads(line)["text"] for line in paths[1].read_text().splitlines() if line.strip()]
    written = (tmp_path / EVAL_FILE).read_bytes() + b"".join((tmp_path / e["file"]).read_bytes()
                                                              for e in manifest["train"])
    assert written == "".join(docs).encode()[:120_000]
    expected, entries = files_of(tmp_path), manifest["train"]
    assert entries[2]["end"]["pos"][3]["examples_iterable"]  # the stream's own state, to seek to
    for entry in entries[3:]:
        (tmp_path / entry["file"]).unlink()
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "train": entries[:3], "complete": False}))
    assert prepare(job)["train"] == entries and files_of(tmp_path) == expected


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["prepare", *args])
    return code, capsys.readouterr().err.strip()


def test_bad_inputs_are_one_line_errors(inputs, tmp_path, capsys):
    paths, _ = inputs
    out = str(tmp_path / "out")
    for args, message in [
        ([], "needs INPUT"),
        ([str(tmp_path / "nope.txt")], "nope.txt' does not exist"),
        ([str(paths[0]), "--eval-tokens", "100000000", "--workers", "1"], "fewer than --eval-tokens"),
        ([str(paths[0]), "--train-tokenizer", "100"], "too small"),
        ([str(paths[2]), "--text-field", "body", "--workers", "1"], "has no column 'body'"),
        ([str(paths[0]), "--tokenizer", str(tmp_path / "missing.json")], "missing.json' does not exist"),
    ]:
        code, err = run_cli(capsys, *args, "--out", out)
        assert code == cli.EXIT_USAGE and err.startswith("diloco-peer: error:") and message in err, (args, err)
        assert len(err.splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    code, err = run_cli(capsys, str(bad), "--out", out, "--workers", "1")
    assert code == cli.EXIT_USAGE and "bad.jsonl:2" in err


def test_other_settings_on_finished_files_are_refused(inputs, tmp_path):
    paths, _ = inputs
    prepare(small_job(paths, tmp_path))
    with pytest.raises(DataError, match="other settings .*shard_tokens.*another --out"):
        prepare(small_job(paths, tmp_path, shard_tokens=40_000))

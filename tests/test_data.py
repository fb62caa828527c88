"""Corpora and splits: deterministic, the same eval split on every shard, distinct shards, clear errors."""

import json

import pytest
import torch

from diloco_peer.config import load_config
from diloco_peer.training.data import Corpus, DataError, shard_for_peer

SMALL = ["data.max_bytes=300_000", "data.seq_len=32"]


def corpus(shard: int = 0, *overrides: str) -> Corpus:
    cfg = load_config(None, [*SMALL, *overrides])
    return Corpus(cfg.data, shard, cfg.model.vocab_size)


def files_corpus(*paths, shard: int = 0, overrides=()) -> Corpus:
    """A corpus of local files; paths go through --set as JSON-quoted TOML strings."""
    listed = ", ".join(json.dumps(str(p)) for p in paths)
    return corpus(shard, 'data.source="files"', f"data.paths=[{listed}]", *overrides)


@pytest.fixture(scope="module")
def shards() -> tuple[Corpus, Corpus]:
    """Shards 0 and 1 of the stdlib corpus, only read (never sampled) by the tests that use them."""
    return corpus(0), corpus(1)


def test_stdlib_eval_split_is_shared_and_shards_differ(shards):
    a, b = shards
    assert len(a.eval_tokens) >= 66 and len(a.train_tokens) >= 66
    assert torch.equal(a.eval_tokens, b.eval_tokens)
    assert not torch.equal(a.train_tokens[:1000], b.train_tokens[:1000])
    assert a.train_tokens.dtype == torch.long and 0 <= a.train_tokens.min() and a.train_tokens.max() < 256


def test_eval_batches_are_fixed_and_the_same_on_every_shard(shards):
    a, b = shards
    first = a.eval_batches(8)
    assert len(first) == a.cfg.eval_batches
    for batch, again, other in zip(first, a.eval_batches(8), b.eval_batches(8)):
        assert batch.shape == (8, 33)
        assert torch.equal(batch, again) and torch.equal(batch, other)


def test_train_batches_depend_only_on_seed_and_shard():
    first, again, other, reseeded = corpus(0), corpus(0), corpus(1), corpus(0, "data.seed=1")
    batches = [first.train_batch(4) for _ in range(3)]
    assert all(batch.shape == (4, 33) for batch in batches)
    assert all(torch.equal(batch, again.train_batch(4)) for batch in batches)
    assert not torch.equal(batches[0], other.train_batch(4))
    assert not torch.equal(batches[0], reseeded.train_batch(4))
    assert not torch.equal(batches[0], batches[1])


def test_rng_state_restores_the_sampler():
    sampler = corpus(0)
    state = sampler.rng_state()
    expected = sampler.train_batch(4)
    sampler.set_rng_state(state)
    assert torch.equal(sampler.train_batch(4), expected)


def test_text_and_jsonl_files_are_read(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, this is plain text. " * 1000)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} " * 100}) + "\n" for i in range(50)))
    c = files_corpus(txt, jsonl, overrides=["data.num_shards=1", "data.eval_fraction=0.2"])
    text = bytes(c.train_tokens.tolist()).decode() + bytes(c.eval_tokens.tolist()).decode()
    assert "hello world" in text and "document 49" in text


def test_jsonl_text_field_is_configurable(tmp_path):
    jsonl = tmp_path / "body.jsonl"
    jsonl.write_text("".join(json.dumps({"body": f"body {i} " * 100}) + "\n" for i in range(50)))
    c = files_corpus(jsonl, overrides=["data.num_shards=1", "data.text_field=body"])
    assert "body 0" in bytes(c.train_tokens.tolist()).decode()


def test_jsonl_line_without_the_text_field_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:3 .*'text'"):
        files_corpus(bad)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"missing\.txt.*data\.paths"):
        files_corpus(tmp_path / "missing.txt")


def test_too_little_text_says_how_to_fix_it(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    with pytest.raises(DataError, match="max_bytes|num_shards"):
        files_corpus(tiny)


@pytest.mark.parametrize("shard", [-1, 64, 100])
def test_shard_out_of_range(shard):
    with pytest.raises(DataError, match=f"data.shard={shard}"):
        corpus(shard)


def test_shard_for_peer_is_stable_and_in_range():
    ids = [f"12D3KooWpeer{i}" for i in range(50)]
    shards = [shard_for_peer(p, 7) for p in ids]
    assert shards == [shard_for_peer(p, 7) for p in ids]
    assert set(shards) <= set(range(7)) and len(set(shards)) > 3
    assert shard_for_peer("any-peer", 1) == 0


@pytest.mark.parametrize("value", [None, 5, ["a", "b"]], ids=["null", "number", "list"])
def test_jsonl_text_that_is_not_a_string_is_a_data_error(tmp_path, value):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x" * 20_000}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        files_corpus(bad, overrides=["data.num_shards=1", "data.eval_fraction=0.2"])


def test_non_utf8_jsonl_is_read_or_a_data_error(tmp_path):
    """Either decoded with replacement like a .txt file, or a DataError that names the file."""
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9 ' + b"x" * 20_000 + b'"}\n')
    try:
        files_corpus(bad, overrides=["data.num_shards=1", "data.eval_fraction=0.2"])
    except DataError as e:
        assert "latin1.jsonl" in str(e)


# --- data.source = "shards": a prepared directory, read in place --------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A byte-tokenized prepared directory of ~300 KB of stdlib source: 2 files of 2-3 blocks of 65536 tokens."""
    from diloco_peer.training.documents import stdlib_documents
    from diloco_peer.training.prepare import PrepareJob, prepare

    folder = tmp_path_factory.mktemp("prepared")
    (folder / "in.txt").write_text("".join(d.text for d in stdlib_documents(300_000)))
    prepare(PrepareJob(inputs=(str(folder / "in.txt"),), out=str(folder / "out"), shard_tokens=140_000,
                       eval_tokens=20_000))
    return folder / "out"


def shards_corpus(directory, shard: int = 0, *overrides: str) -> Corpus:
    return corpus(shard, 'data.source="shards"', f"data.shards_dir={json.dumps(str(directory))}",
                  "data.num_shards=2", *overrides)


def test_shards_are_read_in_place_with_a_shared_eval_split_and_disjoint_blocks(prepared):
    from diloco_peer.training.token_shards import BLOCK_TOKENS

    a, b = shards_corpus(prepared, 0), shards_corpus(prepared, 1)
    assert a.train_tokens is None and len(a.eval_tokens) == 20_000
    blocks = []  # each file in blocks of BLOCK_TOKENS, the last one taking the rest; block g is shard g % 2's
    for entry in a.shards.manifest["train"]:
        data = (prepared / entry["file"]).read_bytes()
        count = max(1, len(data) // BLOCK_TOKENS)
        blocks += [data[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS if j < count - 1 else None] for j in range(count)]
    for c in (a, b):
        assert [torch.equal(x, y) for x, y in zip(c.eval_batches(8), a.eval_batches(8))] == [True] * 4
        own = blocks[c.shard::2]
        assert c.shards.num_blocks == len(own)
        for _ in range(5):
            batch = c.train_batch(8)
            assert batch.shape == (8, 33) and batch.dtype == torch.long
            assert all(any(bytes(row.tolist()) in block for block in own) for row in batch)
    assert bytes(a.eval_batches(1)[0][0].tolist()) in (prepared / "eval.bin").read_bytes()


def test_shard_sampling_is_seeded_and_resumes_from_the_rng_state(prepared):
    first, again, reseeded = shards_corpus(prepared, 0), shards_corpus(prepared, 0), shards_corpus(
        prepared, 0, "data.seed=1")
    batches = [first.train_batch(4) for _ in range(3)]
    assert all(torch.equal(batch, again.train_batch(4)) for batch in batches)
    assert not torch.equal(batches[0], reseeded.train_batch(4))
    state = first.rng_state()
    expected = [first.train_batch(4) for _ in range(2)]
    restored = shards_corpus(prepared, 0)
    restored.set_rng_state(state)
    assert all(torch.equal(restored.train_batch(4), batch) for batch in expected)


def test_unusable_shards_are_one_line_errors(prepared, tmp_path):
    from diloco_peer.config import ConfigError

    with pytest.raises(ConfigError, match="needs data.shards_dir"):
        load_config(None, ['data.source="shards"'])
    with pytest.raises(DataError, match="holds no manifest.json: run diloco-peer prepare"):
        shards_corpus(tmp_path)
    with pytest.raises(DataError, match="none for data shard 5 of data.num_shards=8"):
        shards_corpus(prepared, 5, "data.num_shards=8")
    broken = tmp_path / "broken"
    broken.mkdir()
    manifest = json.loads((prepared / "manifest.json").read_text())
    for entry in [manifest["eval"], *manifest["train"]]:
        (broken / entry["file"]).write_bytes((prepared / entry["file"]).read_bytes())
    (broken / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DataError, match="interrupted.*run the same diloco-peer prepare"):
        shards_corpus(broken)
    (broken / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 300}))
    with pytest.raises(DataError, match="300 token ids but model.vocab_size=256: set model.vocab_size=300"):
        shards_corpus(broken)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    (broken / "train-00001.bin").write_bytes(b"short")
    with pytest.raises(DataError, match="train-00001.bin' has 5 bytes, the manifest says"):
        shards_corpus(broken)


def test_a_local_tokenizer_json_is_used_offline(tmp_path):
    from diloco_peer.training.documents import stdlib_documents
    from diloco_peer.training.tokenizer import train_bpe

    train_bpe((d.text for d in stdlib_documents(100_000)), 300, tmp_path / "tokenizer.json")
    c = corpus(0, f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}", "model.vocab_size=300",
               "data.num_shards=1", "data.max_bytes=60_000")
    assert 256 < c.train_tokens.max() < 300  # merged tokens, not bytes
    with pytest.raises(DataError, match="300 token ids but model.vocab_size=280"):
        corpus(0, 'data.source="hf"', 'data.hf_dataset="json"', "model.vocab_size=280",
               f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}")


def test_parquet_files_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i} " * 300 for i in range(30)]}), tmp_path / "rows.parquet")
    c = files_corpus(tmp_path / "rows.parquet", overrides=["data.num_shards=1", "data.eval_fraction=0.2"])
    assert "row 29" in bytes(c.train_tokens.tolist()).decode() + bytes(c.eval_tokens.tolist()).decode()


# --- data.source = "hf": streamed into a bounded buffer, tested on local files (no internet) ---------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> list[str]:
    """Three JSONL files of 40 numbered documents each, as --set values for data.paths."""
    folder = tmp_path_factory.mktemp("dataset")
    for f in range(3):
        lines = [json.dumps({"text": f"<f{f}d{i}> " + "lorem ipsum dolor sit amet " * (3 + i % 5)})
                 for i in range(40)]
        (folder / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    return [json.dumps(str(folder / f"part{f}.jsonl")) for f in range(3)]


def stream_corpus(dataset, shard: int = 0, shards: int = 2, *overrides: str) -> Corpus:
    return corpus(shard, 'data.source="hf"', 'data.hf_dataset="json"', f"data.paths=[{', '.join(dataset)}]",
                  f"data.num_shards={shards}", "data.eval_tokens=600", "data.buffer_tokens=700", *overrides)


def documents_in(tokens) -> set[str]:
    import re

    return set(re.findall(r"<f\dd\d+>", bytes(torch.as_tensor(tokens).tolist()).decode()))


@pytest.mark.parametrize("shards", [2, 3], ids=["every-other-document", "a-file-each"])
def test_a_stream_holds_a_bounded_buffer_and_never_trains_on_the_eval_head(dataset, shards):
    peers = [stream_corpus(dataset, s, shards) for s in range(shards)]
    head = documents_in(peers[0].eval_tokens)
    assert len(peers[0].eval_tokens) == 600 and head
    seen = []
    for c in peers:
        assert torch.equal(c.eval_tokens if torch.is_tensor(c.eval_tokens) else torch.from_numpy(c.eval_tokens),
                           torch.from_numpy(peers[0].eval_tokens))
        docs = set()
        for _ in range(75):  # 75 x 4 windows of 33 tokens: 14 buffers of 700 tokens, more than an epoch
            c.train_batch(4)
            assert len(c.stream.buffer) == 700  # bounded, whatever the dataset's size
            docs |= documents_in(c.stream.buffer)
        assert c.stream.epoch >= 1 and not docs & head
        seen.append(docs)
    assert not set.intersection(*seen)  # each document belongs to one peer's part
    everything = {f"<f{f}d{i}>" for f in range(3) for i in range(40)}
    assert set.union(*seen) == everything - head  # and every one but the eval head to some peer


def test_a_stream_resumes_exactly_from_the_rng_state(dataset):
    c = stream_corpus(dataset, 1, 3)
    states, batches = [], []
    for _ in range(60):
        states.append(c.rng_state())
        batches.append(c.train_batch(4))
    assert c.stream.epoch == 1
    for k in (0, 4, 11, 23, 50):  # before the first buffer, inside one, at refills, in the second epoch
        restored = stream_corpus(dataset, 1, 3)
        restored.set_rng_state(states[k])
        assert all(torch.equal(restored.train_batch(4), batch) for batch in batches[k:]), k

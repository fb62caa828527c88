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

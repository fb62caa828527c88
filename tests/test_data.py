"""Corpora and splits: deterministic, the same eval split everywhere, distinct shards, clear errors."""

import json

import pytest
import torch

from diloco_peer.config import load_config
from diloco_peer.data import Corpus, DataError, shard_for_peer

SMALL = ["data.max_bytes=400_000", "data.seq_len=32", "data.num_shards=4"]


def corpus(shard=0, *extra):
    cfg = load_config(None, [*SMALL, *extra])
    return Corpus(cfg.data, shard, cfg.model.vocab_size)


def test_stdlib_split_eval_shared_shards_distinct():
    a, b = corpus(0), corpus(1)
    assert torch.equal(a.eval_tokens, b.eval_tokens)
    assert not torch.equal(a.train_tokens[:1000], b.train_tokens[:1000])
    for x, y in zip(a.eval_batches(8), b.eval_batches(8)):
        assert torch.equal(x, y) and x.shape == (8, 33)
    assert a.train_tokens.max() < 256


def test_sampling_is_deterministic_per_seed_and_shard():
    first, again, other = corpus(0), corpus(0), corpus(1)
    batches = [first.train_batch(4) for _ in range(3)]
    assert all(torch.equal(x, again.train_batch(4)) for x in batches)
    assert batches[0].shape == (4, 33)
    assert not torch.equal(batches[0], other.train_batch(4))
    # the next window of the RNG can be restored (resume)
    state = first.rng_state()
    nxt = first.train_batch(4)
    first.set_rng_state(state)
    assert torch.equal(first.train_batch(4), nxt)


def test_local_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world, this is plain text. " * 3000)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} " * 200}) + "\n" for i in range(100)))
    c = corpus(0, "data.source=files", f"data.paths=[{json.dumps(str(txt))}, {json.dumps(str(jsonl))}]",
               "data.num_shards=1", "data.eval_fraction=0.2")
    text = bytes(c.train_tokens.tolist()).decode()
    assert "hello world" in text and "document" in text


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2 .*'text'"):
        corpus(0, "data.source=files", f"data.paths=[{json.dumps(str(bad))}]")
    with pytest.raises(DataError, match="missing.txt"):
        corpus(0, "data.source=files", f"data.paths=[{json.dumps(str(tmp_path / 'missing.txt'))}]")


def test_too_little_text_and_bad_shard(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    with pytest.raises(DataError, match="max_bytes|num_shards"):
        corpus(0, "data.source=files", f"data.paths=[{json.dumps(str(tiny))}]")
    with pytest.raises(DataError, match="data.shard=9"):
        corpus(9)


def test_shard_for_peer_is_stable_and_in_range():
    ids = [f"12D3KooWpeer{i}" for i in range(50)]
    shards = [shard_for_peer(p, 7) for p in ids]
    assert shards == [shard_for_peer(p, 7) for p in ids]
    assert set(shards) <= set(range(7)) and len(set(shards)) > 3

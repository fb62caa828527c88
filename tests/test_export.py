"""``diloco-peer export``: a peer's checkpoint becomes a Hugging Face Llama that ``transformers`` loads and that
computes what our model computes: the same logits on the same input, the same greedy continuation, the same
token ids from the exported tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import diloco_peer
from diloco_peer import cli
from diloco_peer.config import load_config
from diloco_peer.state.checkpoint import CheckpointManager, capture, load_file
from diloco_peer.training.data import Corpus
from diloco_peer.training.model import build_model
from diloco_peer.training.outer_optimizer import OuterOptimizer
from diloco_peer.training.tokenizer import load_tokenizer, train_bpe
from diloco_peer.training.trainer import Trainer

transformers = pytest.importorskip("transformers")

TEXT = "def héllo(name):\n\treturn f'{name} costs 5 €'  # ünïcode\n"
GQA = ["model.num_kv_heads=2"]
SMALL_DATA = ["data.max_bytes=60_000", "data.num_shards=1", "data.shard=0", "run.threads=1", "inner.batch_size=4"]


def peer_checkpoint(tmp_path, overrides: list[str]):
    """A checkpoint folder as a peer writes it: 3 inner AdamW steps (lr high enough to move every weight, the
    norms included), one outer step, ``capture`` and ``CheckpointManager``. Returns (config, folder, file)."""
    text = tmp_path / "text.txt"  # our own source: real text, and no walk over the standard library
    text.write_text("".join(path.read_text() for path in sorted(Path(diloco_peer.__file__).parent.glob("*.py"))))
    cfg = load_config("tiny-cpu", [*SMALL_DATA, *overrides, "inner.lr=0.02", "inner.warmup_steps=0",
                                   f"checkpoint.dir={json.dumps(str(tmp_path / 'checkpoints'))}",
                                   "data.source=files", f"data.paths=[{json.dumps(str(text))}]"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.run.seed)
    trainer = Trainer(model, Corpus(cfg.data, 0, cfg.model.vocab_size), cfg.inner)
    outer = OuterOptimizer(trainer.model, cfg.outer)
    trainer.train_steps(3)
    outer.step(outer.pseudo_gradient())
    manager = CheckpointManager(cfg.checkpoint, "alice", cfg.fingerprint())
    written = manager.save(capture(trainer, outer, cfg.fingerprint())).result()
    manager.close()
    return cfg, written.parent, written


def our_logits(cfg, checkpoint, tokens: torch.Tensor) -> torch.Tensor:
    """Our model with the checkpoint's outer weights, through the checkpoint module's own loader."""
    state = load_file(checkpoint, cfg.fingerprint())
    model = build_model(cfg.model, cfg.run.seed).eval()
    with torch.no_grad():
        for param, value in zip(model.parameters(), state.outer_params):
            param.copy_(value)
        return model(tokens)


@pytest.fixture(scope="module")
def gqa_checkpoint(tmp_path_factory):
    """One peer checkpoint with tied embeddings and grouped-query attention, for the tests that need one."""
    return peer_checkpoint(tmp_path_factory.mktemp("gqa"), GQA)


def export_and_compare(tmp_path, capsys, trained, overrides: list[str], tokenizer_name: str) -> None:
    cfg, folder, checkpoint = trained
    out = tmp_path / "hf"
    args = ["export", str(folder), "--out", str(out), "--sample", "def ", "--max-new-tokens", "8"]
    for item in [*SMALL_DATA, *overrides]:
        args += ["--set", item]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"wrote {out}: model.safetensors") and "epoch 1" in printed[0]

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = our_logits(cfg, checkpoint, tokens)
    assert ours.std() > 0.1  # trained weights, not a flat output that would match anything
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=0), (theirs - ours).abs().max()

    ids = load_tokenizer(tokenizer_name).encode(TEXT, end_of_document=False).tolist()
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert exported.decode(ids) == TEXT

    # --sample's greedy continuation is transformers' greedy continuation of the same prompt
    prompt = load_tokenizer(tokenizer_name).encode("def ", end_of_document=False).tolist()
    generated = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    continuation = load_tokenizer(tokenizer_name).decode(generated.tolist())
    assert "\n".join(printed[1:]) == "def " + continuation


def test_export_with_the_byte_tokenizer_tied_embeddings_and_gqa(tmp_path, capsys, gqa_checkpoint):
    export_and_compare(tmp_path, capsys, gqa_checkpoint, GQA, "bytes")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    assert config["eos_token_id"] is None and config["bos_token_id"] is None  # bytes 1 and 2 are no special tokens


def test_export_with_a_local_bpe_untied_and_other_rope_and_norm(tmp_path, capsys):
    bpe = tmp_path / "tokenizer.json"
    train_bpe([TEXT * 20, "import os\nprint(os.getcwd())\n" * 50], 300, bpe)
    overrides = [f"data.tokenizer={json.dumps(str(bpe))}", "model.vocab_size=300", "model.tie_embeddings=false",
                 "model.rope_theta=500000.0", "model.norm_eps=1e-6"]
    export_and_compare(tmp_path, capsys, peer_checkpoint(tmp_path, overrides), overrides, str(bpe))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6 and config["eos_token_id"] == 0  # <|endoftext|>, ending every document


def test_export_refuses_a_checkpoint_of_another_config(tmp_path, capsys, gqa_checkpoint):
    _, folder, checkpoint = gqa_checkpoint  # trained with num_kv_heads=2: tiny-cpu as it is differs
    code = cli.main(["export", str(checkpoint), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and err.count("\n") == 1
    assert "was written by another config" in err and "--config and --set it was trained with" in err
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == cli.EXIT_USAGE
    assert "holds no checkpoint" in capsys.readouterr().err

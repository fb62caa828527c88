"""``diloco-peer export``: a checkpoint's outer weights as a Hugging Face Llama, the format people use.

    diloco-peer export checkpoints/alice/epoch-000010.pt --out llama-hf            # the config it trained with
    diloco-peer export checkpoints/alice --out llama-hf --sample "def main(" --max-new-tokens 80

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("llama-hf")   # LlamaForCausalLM, fp32
    tokenizer = AutoTokenizer.from_pretrained("llama-hf")

It writes ``model.safetensors`` (the outer weights: what the swarm agreed on, not one replica's inner
progress), ``config.json`` for ``LlamaForCausalLM``, and the tokenizer: for ``bytes`` a byte-level
``tokenizer.json`` whose ids are the byte values, as ours; a local tokenizer.json (or the one of a
``prepare``d shards folder) copied; a hub tokenizer saved through ``transformers``.

Our model and Hugging Face's Llama compute the same function (``tests/test_export.py`` compares logits):
- RoPE: we rotate the two halves ``(x[:d/2], x[d/2:])`` of each head, as Hugging Face's ``rotate_half`` does,
  with the same frequencies ``theta^(-2i/d)``, so q and k need no permutation (Meta's original checkpoints
  rotate interleaved pairs; that is why Hugging Face's converter permutes theirs, and why we must not);
- RMSNorm in fp32 with ``norm_eps`` (``rms_norm_eps``), scaled after casting back; SwiGLU ``down(silu(gate) * up)``;
  no biases; attention scaled by ``head_dim ** -0.5``;
- grouped-query attention: KV head j serves query heads ``j * r .. j * r + r - 1`` (``repeat_interleave``), as
  Hugging Face's ``repeat_kv``;
- tied embeddings: one tensor, ``model.embed_tokens.weight``, with ``tie_word_embeddings``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from ..config import DataError, ModelConfig, PeerConfig
from ..state.checkpoint import FORMAT_VERSION, CheckpointError
from ..training.model import LlamaModel, meta_model, parameter_shapes, rope_tables

_EPOCH_FILE = re.compile(r"^epoch-(\d+)\.pt$")
_HF_NAMES = [  # our parameter name -> Hugging Face Llama's (the first match of each pattern)
    (re.compile(r"^embed\.weight$"), "model.embed_tokens.weight"),
    (re.compile(r"^blocks\.(\d+)\.attn_norm\.weight$"), r"model.layers.\1.input_layernorm.weight"),
    (re.compile(r"^blocks\.(\d+)\.attn\.([qkvo])_proj\.weight$"), r"model.layers.\1.self_attn.\2_proj.weight"),
    (re.compile(r"^blocks\.(\d+)\.ffn_norm\.weight$"), r"model.layers.\1.post_attention_layernorm.weight"),
    (re.compile(r"^blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight$"), r"model.layers.\1.mlp.\2_proj.weight"),
    (re.compile(r"^norm\.weight$"), "model.norm.weight"),
    (re.compile(r"^lm_head\.weight$"), "lm_head.weight"),
]


def checkpoint_file(path: Path) -> Path:
    """``path`` itself, or for a peer's checkpoint folder its newest ``epoch-NNNNNN.pt``."""
    try:
        return _checkpoint_file(path)
    except OSError as e:  # e.g. a name too long for the file system
        raise CheckpointError(f"checkpoint {str(path)[:60]!r} cannot be read ({e.strerror}): give a checkpoint "
                              f"file") from None


def _checkpoint_file(path: Path) -> Path:
    if path.is_dir():
        found = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := _EPOCH_FILE.match(p.name)))
        if not found:
            raise CheckpointError(f"{path} holds no checkpoint (epoch-NNNNNN.pt): give a checkpoint file or a "
                                  f"peer's checkpoint folder, e.g. checkpoints/alice")
        return found[-1][1]
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: give a checkpoint file, e.g. "
                              f"checkpoints/alice/epoch-000010.pt")
    return path


def read_outer_weights(path: Path, fingerprint: str) -> tuple[int, list[torch.Tensor]]:
    """(epoch, outer weights) of the checkpoint at ``path``, memory-mapped: the momentum and AdamW moments in the
    same file are never read (``state/checkpoint.py``'s format; ``load_file`` reads all of it)."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}): give a diloco-peer "
                              f"checkpoint") from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a diloco-peer v{FORMAT_VERSION} checkpoint")
    if raw["fingerprint"] != fingerprint:
        # the fingerprint covers the model section: a wrong rope_theta, norm_eps or tie_embeddings would
        # export other weights' meaning without any shape telling
        raise CheckpointError(f"checkpoint {path} was written by another config (fingerprint {raw['fingerprint']}, "
                              f"this config {fingerprint}): give the --config and --set it was trained with")
    return int(raw["epoch"]), list(raw["outer_params"])


def hf_names(cfg: ModelConfig) -> list[str]:
    """Hugging Face Llama's names of our parameters, in ``model.parameters()`` order (a tied lm_head has none)."""
    model = meta_model(cfg)
    names = []
    for name, _ in model.named_parameters():
        pattern, target = next((p, t) for p, t in _HF_NAMES if p.match(name))
        names.append(pattern.sub(target, name))
    return names


def hf_config(cfg: ModelConfig, eos_id: int | None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with our model's shape (transformers 4 and 5 both read it)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,  # transformers 4; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
        # explicit: LlamaConfig's defaults (bos 1, eos 2) are bytes of our byte tokenizer, not special tokens
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None, "torch_dtype": "float32",
    }


def byte_tokenizer():
    """A ``tokenizers`` tokenizer whose ids are the UTF-8 bytes of the text, as ``data.tokenizer="bytes"``: a BPE
    without merges over GPT-2's byte-to-character alphabet, behind a byte-level pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's table: printable bytes stand for themselves, the others for the characters from U+0100 on
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tokenizer_name(cfg: PeerConfig) -> str:
    """What the peers tokenized with: ``data.tokenizer``, or for ``data.source="shards"`` the manifest's."""
    if cfg.data.source != "shards":
        return cfg.data.tokenizer
    from ..training.token_shards import load_manifest

    name = load_manifest(cfg.data.shards_dir)["tokenizer"]
    local = Path(cfg.data.shards_dir) / name
    return str(local) if local.is_file() else name


def write_tokenizer(name: str, out: Path, max_length: int) -> int | None:
    """The tokenizer ``name`` into ``out`` (what ``AutoTokenizer.from_pretrained(out)`` reads); its eos id."""
    from ..training.tokenizer import is_local, load_tokenizer, local_file

    if name != "bytes" and not is_local(name):  # a hub tokenizer: transformers saves its own files
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"exporting tokenizer '{name}' needs the Hugging Face extras: "
                            f"pip install \".[hf]\"") from None
        hub = AutoTokenizer.from_pretrained(name)
        hub.save_pretrained(str(out))
        return hub.eos_token_id
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                "clean_up_tokenization_spaces": False}
    eos_id = None
    if name == "bytes":
        byte_tokenizer().save(str(out / "tokenizer.json"))
    else:
        from tokenizers import Tokenizer

        shutil.copyfile(local_file(name), out / "tokenizer.json")
        eos_id = load_tokenizer(name).eos_id  # the id training appended to every document
        if eos_id is not None:
            settings["eos_token"] = Tokenizer.from_file(str(out / "tokenizer.json")).id_to_token(eos_id)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=1) + "\n")
    return eos_id


def export(checkpoint: Path, cfg: PeerConfig, out: Path) -> tuple[Path, int, list[torch.Tensor]]:
    """Write the Hugging Face folder ``out`` from ``checkpoint``; (the checkpoint file, its epoch, its weights)."""
    from safetensors.torch import save_file

    path = checkpoint_file(checkpoint)
    epoch, weights = read_outer_weights(path, cfg.fingerprint())
    names = hf_names(cfg.model)
    shapes = parameter_shapes(cfg.model)
    if [w.shape for w in weights] != shapes:
        raise CheckpointError(f"checkpoint {path} holds {len(weights)} tensors that do not match the model of this "
                              f"config ({len(shapes)} tensors): give the config it was trained with")
    out.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer(tokenizer_name(cfg), out, cfg.model.max_seq_len)
    save_file({name: w.contiguous() for name, w in zip(names, weights)}, str(out / "model.safetensors"),
              metadata={"format": "pt", "diloco_epoch": str(epoch), "diloco_fingerprint": cfg.fingerprint()})
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, eos_id), indent=1) + "\n")
    return path, epoch, weights


def load_model(cfg: ModelConfig, weights: list[torch.Tensor]) -> LlamaModel:
    """Our model with ``weights`` (in ``parameters()`` order), without initialising it first."""
    model = meta_model(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty gives the two modules a tensor each
        model.lm_head.weight = model.embed.weight
    cos, sin = rope_tables(cfg.hidden_size // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
    with torch.no_grad():
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
        for param, value in zip(model.parameters(), weights):
            param.copy_(value)
    return model.eval()


@torch.no_grad()
def generate(model: LlamaModel, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             eos_id: int | None = None, seed: int = 0) -> list[int]:
    """The ids ``model`` continues ``ids`` with: greedy at ``temperature`` 0, else sampled (seeded); stops at
    ``eos_id``. The context is the last ``max_seq_len`` ids (no KV cache: samples are short)."""
    generator = torch.Generator().manual_seed(seed)
    new = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new)[-model.cfg.max_seq_len:]])
        logits = model(context)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        if token == eos_id:
            break
        new.append(token)
    return new


def run_export(args: argparse.Namespace, cfg: PeerConfig) -> int:
    """``diloco-peer export``: write the folder, say how to load it, and print a sample if asked."""
    out = Path(args.out)
    path, epoch, weights = export(Path(args.checkpoint), cfg, out)
    count = sum(w.numel() for w in weights)
    print(f"wrote {out}: model.safetensors ({count / 1e6:.2f}M parameters, the outer weights of epoch {epoch} from "
          f"{path}), config.json, tokenizer; load it with transformers.AutoModelForCausalLM.from_pretrained("
          f"{str(out)!r})")
    if args.sample is None:
        return 0
    from ..training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name(cfg))
    ids = [int(i) for i in tokenizer.encode(args.sample, end_of_document=False)]
    if not ids:
        raise DataError("--sample needs a prompt of at least one token, e.g. --sample 'def '")
    new = generate(load_model(cfg.model, weights), ids, args.max_new_tokens, args.temperature, tokenizer.eos_id)
    print(args.sample + tokenizer.decode(new))
    return 0

"""A Llama-style decoder-only transformer: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

Small enough to read in one sitting; the same code builds the 0.4M-parameter CPU demo model and
OpenDiLoCo's 150M / 1.1B shapes (see the top-level ``configs/``). Initialisation is a pure function of the seed,
so every peer of a swarm starts from bit-identical weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 even under bf16 autocast: the mean of squares underflows otherwise
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables, on the CPU (the model moves them with itself; inside ``meta_model`` too, see there)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device="cpu"), inv_freq)  # [seq, head_dim / 2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[..., :d/2], x[..., d/2:]) of x: [batch, heads, seq, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:  # grouped-query attention: share each KV head
            repeat = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.hidden_size // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
        # buffers, not parameters: never averaged, never in the optimizer, rebuilt identically everywhere
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic init (GPT-2 style: N(0, 0.02), residual projections scaled by depth)."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(cfg: ModelConfig, seed: int) -> LlamaModel:
    model = LlamaModel(cfg)
    model.reset_parameters(seed)
    return model


INIT_FUNCTIONS = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_"})
"""``torch.nn.init``'s functions our modules' constructors call (``nn.Linear``, ``nn.Embedding``, ``RMSNorm``)."""


class _NoInit(TorchFunctionMode):
    """Skips ``INIT_FUNCTIONS``: a meta tensor holds no values to initialize."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in INIT_FUNCTIONS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig) -> LlamaModel:
    """``LlamaModel(cfg)`` with its parameters on the meta device: their shapes, no memory, no values. Built without
    running an op on a meta tensor (init skipped, the rotary tables on the CPU): torch's meta versions of ``normal_``,
    ``arange`` and most other ops are Python, imported on first use, and that import cost every peer's start about a
    CPU-second (the memory check and the averager's buffers build one each, before the model itself)."""
    with torch.device("meta"), _NoInit():
        return LlamaModel(cfg)


def parameter_shapes(cfg: ModelConfig) -> list[torch.Size]:
    """The shapes of ``build_model(cfg)``'s parameters, in order (what the averager's buffers need before the model
    itself is built)."""
    return [p.shape for p in meta_model(cfg).parameters()]


@torch.no_grad()
def move_parameters(model: nn.Module, buffers: list[torch.Tensor]) -> None:
    """Put the model's parameters (values kept) into ``buffers`` (one per parameter, same shapes, e.g. shared memory
    another process reads): the replica then lives there, and its old memory is freed."""
    for param, buffer in zip(model.parameters(), buffers):
        if buffer.shape != param.shape:
            raise ValueError(f"a buffer of shape {tuple(buffer.shape)} for a parameter of shape {tuple(param.shape)}")
        buffer.copy_(param)
        param.data = buffer


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def state_digest(digests: list[str], epoch: int, inner_step: int) -> str:
    """The hash a peer publishes of its state (``state_hash``, ``state/target.py``), from the ``param_sha256([t])``
    of each of its tensors (outer weights, then momentum): a download can check each tensor on its own as it
    arrives."""
    digest = hashlib.sha256(f"epoch={epoch};inner_step={inner_step};".encode())
    for tensor_digest in digests:
        digest.update(tensor_digest.encode())
    return digest.hexdigest()


def param_sha256(params) -> str:
    """sha256 over the raw bytes of the tensors, in order: equal iff the replicas are bit-identical."""
    digest = hashlib.sha256()
    for tensor in params:  # hashed where it lies (a CPU fp32 tensor is not copied)
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy())
    return digest.hexdigest()

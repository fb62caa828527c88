"""Pseudo-gradient codecs: what a replica's update looks like on the wire, and how many bytes it takes.

    codec = get_codec("int8")
    payload = codec.encode(pseudo_gradient)      # compact tensors; payload.nbytes is the real size
    restored = codec.decode(payload)             # same shape, fp32

- ``none``: fp32, 4 bytes per value, exact.
- ``fp16`` / ``bf16``: 2 bytes per value (fp16: 10-bit mantissa, range +-65504; bf16: 7-bit mantissa,
  fp32's range).
- ``int8``: values split into blocks of ``BLOCK`` (1024); each block stores one fp32 scale
  (its largest magnitude / 127) and one signed byte per value, rounded to nearest. The error of a value
  is at most half a step: ``|x - decode(encode(x))| <= absmax(block) / 254``. ~1.004 bytes per value.
  This is INTELLECT-1's choice for pseudo-gradients.
- ``int4``: the same with 15 levels (-7..7), two values per byte: error <= absmax(block) / 14,
  ~0.504 bytes per value (Streaming DiLoCo's 4-bit setting).

Per-block scales keep one large value (an outlier) from flattening every other value of the tensor
to zero, which a single per-tensor scale would do. :class:`ErrorFeedback` carries what a lossy codec
dropped into the next round, so that nothing is lost for good, only delayed.

Used by ``diloco-peer simulate`` to study codecs; the wire codecs of the swarm's all-reduce are in
``averaging_round.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 1024


@dataclass
class Payload:
    """An encoded tensor: the tensors that would cross the wire, and how to undo the encoding."""

    data: torch.Tensor
    scales: torch.Tensor | None
    shape: torch.Size
    numel: int

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales


class Codec:
    name = "none"

    def encode(self, x: torch.Tensor) -> Payload:
        return Payload(x.detach().to(torch.float32).clone(), None, x.shape, x.numel())

    def decode(self, p: Payload) -> torch.Tensor:
        return p.data.to(torch.float32).reshape(p.shape)

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """What the receiver gets, and the bytes it took."""
        payload = self.encode(x)
        return self.decode(payload), payload.nbytes


class _HalfCodec(Codec):
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def encode(self, x: torch.Tensor) -> Payload:
        return Payload(x.detach().to(self.dtype), None, x.shape, x.numel())


class _BlockQuantCodec(Codec):
    """Symmetric per-block absmax quantization to ``levels`` steps each side of zero."""

    def __init__(self, name: str, levels: int, pack_nibbles: bool):
        self.name, self.levels, self.pack = name, levels, pack_nibbles

    def encode(self, x: torch.Tensor) -> Payload:
        flat = x.detach().to(torch.float32).flatten()
        n = flat.numel()
        padded = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
        scales = padded.abs().amax(dim=1) / self.levels
        safe = scales.clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero block stays zero
        q = torch.round(padded / safe[:, None]).clamp_(-self.levels, self.levels).to(torch.int8).flatten()[:n]
        if self.pack:
            q = (q + self.levels).to(torch.uint8)  # 0..14 fits in a nibble
            q = torch.nn.functional.pad(q, (0, n % 2))
            q = q[0::2] | (q[1::2] << 4)
        return Payload(q, scales, x.shape, n)

    def decode(self, p: Payload) -> torch.Tensor:
        q = p.data
        if self.pack:
            q = torch.stack([q & 0x0F, q >> 4], dim=1).flatten()[: p.numel].to(torch.int16) - self.levels
        values = q.to(torch.float32)
        values = torch.nn.functional.pad(values, (0, (-p.numel) % BLOCK)).view(-1, BLOCK)
        return (values * p.scales[:, None]).flatten()[: p.numel].reshape(p.shape)


CODECS = {
    "none": Codec(),
    "fp16": _HalfCodec("fp16", torch.float16),
    "bf16": _HalfCodec("bf16", torch.bfloat16),
    "int8": _BlockQuantCodec("int8", 127, pack_nibbles=False),
    "int4": _BlockQuantCodec("int4", 7, pack_nibbles=True),
}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        from .config import ConfigError

        raise ConfigError(f"unknown codec '{name}': use one of {', '.join(CODECS)}")
    return CODECS[name]


class ErrorFeedback:
    """Carries each tensor's quantization residual into the next round: send codec(x + residual)."""

    def __init__(self, codec: Codec):
        self.codec, self.residuals = codec, None

    def roundtrip(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        if self.residuals is None:
            self.residuals = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        out, total = [], 0
        for i, t in enumerate(tensors):
            corrected = t.to(torch.float32) + self.residuals[i]
            sent, size = self.codec.roundtrip(corrected)
            self.residuals[i] = corrected - sent
            out.append(sent)
            total += size
        return out, total

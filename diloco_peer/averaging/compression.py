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

The swarm's all-reduce sends exactly these encodings: :class:`WireCompression` plugs a codec into
hivemind's compression framework (``averager.py`` uses it), and ``diloco-peer simulate`` uses the
same codecs to study them. hivemind's own protobuf enum has no bf16, per-block int8 or int4 (its
blockwise 8-bit needs bitsandbytes), so our encodings travel under compression codes of their own
(``WIRE_CODES``, outside hivemind's range); ``deserialize`` reads both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

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
        self.name = name
        self.dtype = dtype

    def encode(self, x: torch.Tensor) -> Payload:
        return Payload(x.detach().to(self.dtype), None, x.shape, x.numel())


class _BlockQuantCodec(Codec):
    """Symmetric per-block absmax quantization to ``levels`` steps each side of zero."""

    def __init__(self, name: str, levels: int, pack_nibbles: bool):
        self.name = name
        self.levels = levels
        self.pack = pack_nibbles

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
        from ..config import ConfigError

        raise ConfigError(f"unknown codec '{name}': use one of {', '.join(CODECS)}")
    return CODECS[name]


class ErrorFeedback:
    """Carries each tensor's quantization residual into the next round: send codec(x + residual)."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residuals = None
        self._before: list[torch.Tensor] | None = None

    def roundtrip(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        if self.residuals is None:
            self.residuals = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        self._before = list(self.residuals)  # the tensors are replaced below, never changed in place
        out = []
        total = 0
        for i, t in enumerate(tensors):
            corrected = t.to(torch.float32) + self.residuals[i]
            sent, size = self.codec.roundtrip(corrected)
            self.residuals[i] = corrected - sent
            out.append(sent)
            total += size
        return out, total

    def undo(self) -> None:
        """The last ``roundtrip`` did not reach anyone (its round failed): keep the residual from before it.
        What the codec dropped in earlier rounds was never applied anywhere and goes out with the next round;
        the failed round's own pseudo-gradient is applied uncompressed (a solo step) or replaced (a state sync)."""
        if self._before is not None:
            self.residuals = self._before
            self._before = None


WIRE_CODES = {"bf16": 65, "int8": 66, "int4": 67}
"""Compression codes of our encodings on the wire (hivemind's own enum ends at 5; proto3 enums are open)."""
_BY_CODE = {code: CODECS[name] for name, code in WIRE_CODES.items()}
_STORAGE = {torch.float32: (torch.float32, np.float32), torch.bfloat16: (torch.int16, np.int16),
            torch.int8: (torch.int8, np.int8), torch.uint8: (torch.uint8, np.uint8)}
"""How each payload dtype becomes bytes (numpy has no bfloat16: its bits travel as int16)."""


class WireCompression(CompressionBase):
    """A codec of this module as a hivemind compression: what an all-reduce part looks like on the wire.

    The message's buffer holds the per-block fp32 scales (if any) followed by the encoded values; its
    ``size`` is the part's shape. Parts are split by hivemind at multiples of ``BLOCK`` values of a tensor
    (see ``estimate_compression_ratio``), so a part's blocks are the whole tensor's blocks.
    """

    def __init__(self, name: str):
        self.codec = get_codec(name)
        self.compression_type = WIRE_CODES[name]

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        payload = self.codec.encode(tensor.detach().cpu())
        storage, _ = _STORAGE[payload.data.dtype]
        scales = b"" if payload.scales is None else payload.scales.numpy().tobytes()
        return runtime_pb2.Tensor(compression=self.compression_type, size=list(tensor.shape), dtype="float32",
                                  buffer=scales + payload.data.view(storage).numpy().tobytes())

    def extract(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        shape = torch.Size(message.size)
        numel = shape.numel()
        codec = self.codec
        buffer = bytearray(message.buffer)  # writable, so torch does not warn
        if isinstance(codec, _BlockQuantCodec):
            blocks = -(-numel // BLOCK)
            scales = torch.frombuffer(buffer, dtype=torch.float32, count=blocks) if blocks else torch.zeros(0)
            count = (numel + 1) // 2 if codec.pack else numel
            data = torch.frombuffer(buffer, dtype=torch.uint8 if codec.pack else torch.int8, count=count,
                                    offset=4 * blocks) if count else torch.zeros(0, dtype=torch.int8)
            expected = 4 * blocks + count
        else:  # bf16
            data = torch.frombuffer(buffer, dtype=torch.int16).view(torch.bfloat16) if numel else torch.zeros(0)
            scales = None
            expected = 2 * numel
        if len(buffer) != expected:
            raise ValueError(f"a {codec.name} part of shape {tuple(shape)} must be {expected} bytes, got {len(buffer)}")
        return codec.decode(Payload(data, scales, shape, numel))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # exact powers of two: hivemind then cuts parts at multiples of BLOCK values (2**19 bytes per part)
        return {"bf16": 0.5, "int8": 0.25, "int4": 0.125}[self.codec.name]


def deserialize(message: runtime_pb2.Tensor) -> torch.Tensor:
    """A tensor from an all-reduce message: our encodings by their code, hivemind's own otherwise."""
    codec = _BY_CODE.get(message.compression)
    if codec is None:
        return deserialize_torch_tensor(message)
    return WireCompression(codec.name).extract(message)

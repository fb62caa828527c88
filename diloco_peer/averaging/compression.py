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
- ``topk``: sparse: the largest ``density`` of every chunk of 4096 values, 2 or 4 bits each, with their places
  (``sparse.py``). Most of a pseudo-gradient stays behind, so it needs error feedback; a reducer's reply keeps the
  top of the average the same way, and what it dropped of ours goes back into our residual (``settle``).

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

from . import sparse

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
    returns_dropped = False
    """Whether what a reducer's reply drops of our values goes back into the error-feedback residual
    (``ErrorFeedback.settle``): a sparse reply leaves most places out on purpose."""

    @property
    def wire_name(self) -> str:
        """The name its encoding travels under (``WIRE_CODES``)."""
        return self.name

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


class TopKCodec(Codec):
    """The largest ``density`` of every chunk, ``bits`` bits a value (``sparse.py``)."""

    name = "topk"
    returns_dropped = True

    def __init__(self, density: float = 0.02, bits: int = 2):
        if not 0 < density <= 1 or bits not in sparse.BITS:
            raise ValueError(f"a topk codec keeps a density in (0, 1] at {sparse.BITS} bits, not {density}, {bits}")
        self.density = density
        self.bits = bits

    @property
    def wire_name(self) -> str:
        return f"topk{self.bits}"

    def encode(self, x: torch.Tensor) -> Payload:
        data, scales = sparse.encode(x.detach().to(torch.float32).flatten(), self.density, self.bits)
        return Payload(data, scales, x.shape, x.numel())

    def decode(self, p: Payload) -> torch.Tensor:
        return sparse.decode(p.data, p.scales, p.numel, self.bits).reshape(p.shape)


CODECS = {
    "none": Codec(),
    "fp16": _HalfCodec("fp16", torch.float16),
    "bf16": _HalfCodec("bf16", torch.bfloat16),
    "int8": _BlockQuantCodec("int8", 127, pack_nibbles=False),
    "int4": _BlockQuantCodec("int4", 7, pack_nibbles=True),
    "topk": TopKCodec(),
}


def get_codec(name: str, density: float = 0.02, bits: int = 2) -> Codec:
    """The codec ``name``; ``topk`` keeps ``density`` of every chunk at ``bits`` bits (the others ignore both)."""
    if name not in CODECS:
        from ..config import ConfigError

        raise ConfigError(f"unknown codec '{name}': use one of {', '.join(CODECS)}")
    return TopKCodec(density, bits) if name == "topk" else CODECS[name]


def configured_codec(cfg) -> Codec:
    """The codec an ``[averaging]`` section names, with its ``topk_density`` and ``topk_bits``."""
    return get_codec(cfg.compression, cfg.topk_density, cfg.topk_bits)


class ErrorFeedback:
    """Carries each tensor's quantization residual into the next round: send codec(x + decay * residual).

    :param decay: how much of the residual a round carries on (SparseLoCo's 0.95 forgets what stayed behind for
      long; 1 loses nothing)
    """

    def __init__(self, codec: Codec, decay: float = 1.0):
        self.codec = codec
        self.decay = decay
        self.residuals = None
        self._before: list[torch.Tensor] | None = None
        self._sent: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (places, values) sent, per tensor

    def roundtrip(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        if self.residuals is None:
            self.residuals = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        self._before = list(self.residuals)  # replaced below, not changed: settle changes only the new ones
        out = []
        total = 0
        for i, t in enumerate(tensors):
            corrected = t.to(torch.float32) + self.decay * self.residuals[i]
            sent, size = self.codec.roundtrip(corrected)
            self.residuals[i] = corrected - sent
            out.append(sent)
            total += size
        if self.codec.returns_dropped:  # only the places sent: a few percent of the tensors' memory
            self._sent = [(places, sent.flatten()[places]) for sent in out
                          for places in [sent.flatten().nonzero().flatten()]]
        return out, total

    def settle(self, average: list[torch.Tensor]) -> None:
        """The round's ``average`` came back: our sent values at places the reducers' replies dropped (zero in the
        average) were applied nowhere, and go back into the residual (a sparse codec's; dense ones drop nothing)."""
        if self._sent is None:
            return
        for residual, (places, values), averaged in zip(self.residuals, self._sent, average):
            dropped = averaged.flatten()[places] == 0
            residual.view(-1)[places[dropped]] += values[dropped]
        self._sent = None

    def undo(self) -> None:
        """The last ``roundtrip`` did not reach anyone (its round failed): keep the residual from before it.
        What the codec dropped in earlier rounds was never applied anywhere and goes out with the next round;
        the failed round's own pseudo-gradient is applied uncompressed (a solo step) or replaced (a state sync)."""
        if self._before is not None:
            self.residuals = self._before
            self._before = None
        self._sent = None


WIRE_CODES = {"bf16": 65, "int8": 66, "int4": 67, "topk2": 68, "topk4": 69}
"""Compression codes of our encodings on the wire (hivemind's own enum ends at 5; proto3 enums are open). A sparse
message says how many values each chunk keeps, so one code serves every density."""
_BY_CODE = {code: TopKCodec(bits=int(name[-1])) if name.startswith("topk") else CODECS[name]
            for name, code in WIRE_CODES.items()}
_STORAGE = {torch.float32: (torch.float32, np.float32), torch.bfloat16: (torch.int16, np.int16),
            torch.int8: (torch.int8, np.int8), torch.uint8: (torch.uint8, np.uint8)}
"""How each payload dtype becomes bytes (numpy has no bfloat16: its bits travel as int16)."""


class WireCompression(CompressionBase):
    """A codec of this module as a hivemind compression: what an all-reduce part looks like on the wire.

    The message's buffer holds the per-block (or per-chunk) fp32 scales, if any, followed by the encoded values; its
    ``size`` is the part's shape. Parts are split by hivemind at multiples of ``BLOCK`` values of a tensor, and of
    ``sparse.CHUNK`` for ``topk`` (see ``estimate_compression_ratio``), so a part's blocks are the whole tensor's.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.compression_type = WIRE_CODES[codec.wire_name]

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
        if isinstance(codec, TopKCodec):  # its decode checks the sizes it reads
            count = -(-numel // sparse.CHUNK) * sparse.scales_per_chunk(codec.bits)
            if len(buffer) < 4 * count:
                raise ValueError(f"a topk part of shape {tuple(shape)} needs {4 * count} bytes of scales")
            scales = torch.frombuffer(buffer, dtype=torch.float32, count=count) if count else torch.zeros(0)
            data = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * count) if len(buffer) > 4 * count else \
                torch.zeros(0, dtype=torch.uint8)
            return codec.decode(Payload(data, scales, shape, numel))
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
        # exact powers of two: hivemind then cuts parts at multiples of BLOCK values (2**19 bytes per part), and of
        # sparse.CHUNK for topk (parts of 2**22 values; ``averaging.part_size_bytes`` is a multiple of 1024)
        return {"bf16": 0.5, "int8": 0.25, "int4": 0.125, "topk": 1 / 32}[self.codec.name]


def deserialize(message: runtime_pb2.Tensor) -> torch.Tensor:
    """A tensor from an all-reduce message: our encodings by their code, hivemind's own otherwise."""
    codec = _BY_CODE.get(message.compression)
    if codec is None:
        return deserialize_torch_tensor(message)
    return WireCompression(codec).extract(message)

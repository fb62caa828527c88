"""Sparse pseudo-gradients: the largest values of every chunk, in 2 or 4 bits each, with their places.

A flat tensor is cut into chunks of ``CHUNK`` values (Covenant-72B's); of each chunk only the ``density`` largest by
magnitude are kept (SparseLoCo, arXiv 2508.15706), a short last chunk keeps its share of its own length. Kept values
are quantized per chunk:

- **2 bits**: a sign, and which of two magnitudes: the mean |value| of the chunk's smaller half and of its larger
  half of the kept values (two fp32 scales per chunk);
- **4 bits**: a sign, and one of 8 steps up to the chunk's largest |value| (one fp32 scale per chunk).

A kept value that is exactly zero is not sent (it costs nothing and decodes to zero). Encoding a decoded tensor
again gives it back bit for bit: the means are taken in float64, and a chunk that holds at most its share of
values keeps them all. That matters because the swarm encodes twice: error feedback computes what we send on whole
tensors (``compression.ErrorFeedback``), then hivemind's all-reduce encodes it again part by part; parts are cut at
multiples of ``CHUNK`` values of a tensor (``compression.WireCompression``), so their chunks are the tensor's.

The encoding, for ``n`` values in ``R = ceil(n / CHUNK)`` chunks holding ``E`` kept values in all::

    scales   fp32 x R x (2 for 2 bits, 1 for 4 bits)
    counts   int16 x R                   values kept in each chunk
    places   12 bits x E, two in 3 bytes  each value's place in its chunk, chunk by chunk
    codes    2 or 4 bits x E             sign and magnitude, in the order of the places

At 2% density and 2 bits that is ~0.037 bytes per value against fp32's 4, indices included.
"""

from __future__ import annotations

import torch

CHUNK = 4096
"""Values per chunk: a place fits 12 bits."""
BITS = (2, 4)
"""Bits per kept value that the codec knows."""


def kept_per_chunk(length: int, density: float) -> int:
    """How many values a chunk of ``length`` keeps at ``density``: its share, at least one."""
    return min(length, max(1, round(density * length)))


def kept(numel: int, density: float) -> int:
    """How many of ``numel`` values (one tensor, or one part of it) an encoding at ``density`` keeps, at most."""
    if numel == 0:
        return 0
    chunks = -(-numel // CHUNK)
    return (chunks - 1) * kept_per_chunk(CHUNK, density) + kept_per_chunk(numel - (chunks - 1) * CHUNK, density)


def scales_per_chunk(bits: int) -> int:
    return 2 if bits == 2 else 1


def encode(flat: torch.Tensor, density: float, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``density`` of every chunk of ``flat`` (1-d, fp32) in ``bits`` bits: (data, scales), where ``data``
    (uint8) holds the counts, places and codes and ``scales`` (fp32) the chunks' scales."""
    n = flat.numel()
    chunks = -(-n // CHUNK)
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    rows = torch.nn.functional.pad(flat, (0, chunks * CHUNK - n)).view(chunks, CHUNK)
    k = kept_per_chunk(CHUNK, density) if chunks > 1 else kept_per_chunk(n, density)
    magnitudes, places = rows.abs().topk(k, dim=1)  # (sorted: the largest first)
    quota = torch.full((chunks, 1), k)
    quota[-1] = kept_per_chunk(n - (chunks - 1) * CHUNK, density)
    kept = (torch.arange(k) < quota) & (magnitudes > 0)
    values = rows.gather(1, places)
    codes, scales = _quantize(values, magnitudes, kept, bits)
    counts = kept.sum(dim=1).to(torch.int16)
    data = torch.cat([counts.view(torch.uint8), _pack_places(places[kept]), _pack_codes(codes[kept], bits)])
    return data, scales.flatten()


def decode(data: torch.Tensor, scales: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The flat fp32 tensor of ``numel`` values that ``encode`` gave (data, scales) for. Raises ``ValueError`` on an
    encoding that does not fit ``numel`` (a sender's bytes are not trusted)."""
    chunks = -(-numel // CHUNK)
    if scales.numel() != chunks * scales_per_chunk(bits) or data.numel() < 2 * chunks:
        raise ValueError(f"a sparse encoding of {numel} values needs {chunks} chunks' scales and counts")
    counts = data[:2 * chunks].clone().view(torch.int16).to(torch.int64)
    lengths = torch.full((chunks,), CHUNK)
    if chunks:
        lengths[-1] = numel - (chunks - 1) * CHUNK
    if bool(((counts < 0) | (counts > lengths)).any()):
        raise ValueError("a sparse encoding keeps more values in a chunk than the chunk holds")
    total = int(counts.sum())
    place_bytes, code_bytes = 3 * -(-total // 2), -(-total * bits // 8)
    if data.numel() != 2 * chunks + place_bytes + code_bytes:
        raise ValueError(f"a sparse encoding of {total} values must be {2 * chunks + place_bytes + code_bytes} bytes "
                         f"of counts, places and codes, got {data.numel()}")
    places = _unpack_places(data[2 * chunks:2 * chunks + place_bytes], total)
    chunk_of = torch.repeat_interleave(torch.arange(chunks), counts)
    if bool((places >= lengths[chunk_of]).any()):
        raise ValueError("a sparse encoding names a place past its chunk's end")
    codes = _unpack_codes(data[2 * chunks + place_bytes:], total, bits)
    values = _dequantize(codes, scales.view(chunks, -1)[chunk_of], bits)
    out = torch.zeros(chunks * CHUNK)
    out[chunk_of * CHUNK + places] = values
    return out[:numel]


def nbytes(numel: int, kept: int, bits: int) -> int:
    """Bytes of an encoding of ``numel`` values that keeps ``kept`` of them."""
    chunks = -(-numel // CHUNK)
    return chunks * (4 * scales_per_chunk(bits) + 2) + 3 * -(-kept // 2) + -(-kept * bits // 8)


def _quantize(values: torch.Tensor, magnitudes: torch.Tensor, kept: torch.Tensor,
              bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, one per kept place) and per-chunk scales of ``values`` (rows of kept candidates)."""
    negative = (values < 0).to(torch.uint8)
    wide = magnitudes.to(torch.float64)
    if bits == 2:
        masked = torch.where(kept, wide, torch.full_like(wide, float("nan")))
        median = masked.nanmedian(dim=1, keepdim=True).values
        high = kept & (wide > median)
        low = kept & ~high
        low_mean = (wide * low).sum(dim=1) / low.sum(dim=1).clamp(min=1)
        high_mean = (wide * high).sum(dim=1) / high.sum(dim=1).clamp(min=1)
        scales = torch.stack([low_mean, high_mean], dim=1).to(torch.float32)
        return negative << 1 | high.to(torch.uint8), scales
    largest = (wide * kept).amax(dim=1, keepdim=True)
    steps = torch.round(wide / largest.clamp(min=torch.finfo(torch.float64).tiny) * 8).clamp(1, 8).to(torch.uint8)
    return negative << 3 | (steps - 1), largest.to(torch.float32)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of ``codes``, each with its chunk's ``scales`` (one row per code)."""
    if bits == 2:
        negative, high = (codes >> 1).bool(), (codes & 1).long()
        magnitude = scales.gather(1, high.view(-1, 1)).flatten()
    else:
        negative = (codes >> 3).bool()
        magnitude = scales[:, 0] * ((codes & 7).to(torch.float32) + 1) / 8
    return torch.where(negative, -magnitude, magnitude)


def _pack_places(places: torch.Tensor) -> torch.Tensor:
    """12-bit places, two in three bytes."""
    p = torch.nn.functional.pad(places.to(torch.int32), (0, places.numel() % 2))
    a, b = p[0::2], p[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).flatten().to(torch.uint8)


def _unpack_places(data: torch.Tensor, count: int) -> torch.Tensor:
    triples = data.to(torch.int64).view(-1, 3)
    a = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([a, b], dim=1).flatten()[:count]


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    c = torch.nn.functional.pad(codes, (0, (-codes.numel()) % per_byte)).view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=1).to(torch.uint8)


def _unpack_codes(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return ((data.to(torch.int32).view(-1, 1) >> shifts) & ((1 << bits) - 1)).flatten()[:count].to(torch.uint8)


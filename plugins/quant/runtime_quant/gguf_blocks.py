"""llama.cpp's (ggml's) quantized blocks, read with torch: the seven types ``gguf`` keeps packed.

A GGUF matrix [out, in] is stored row by row, each row ``in / block`` blocks of ``nbytes``
bytes; a layer keeps them as uint8 [out, in / block * nbytes]. Every one of the seven types
decodes to ``w = scale * (code - zero) + offset`` per sub-block of ``sub`` inputs, with an
unsigned ``code`` of ``bits`` bits, a type-wide integer ``zero`` and float32 ``scale`` /
``offset`` (``offset`` 0 where the type has none). In that order of operations the values
are bit-identical to gguf-py's ``gguf.quants.dequantize`` (llama.cpp's reference):

======  =====  ======  ===  ====  ====  ===========================================================
type    block  nbytes  sub  bits  zero  layout (``d``, ``dmin``: float16)
======  =====  ======  ===  ====  ====  ===========================================================
Q4_0    32     18      32   4     8     d, 16 bytes of nibbles (low: inputs 0-15, high: 16-31)
Q4_1    32     20      32   4     0     d, m (offset), nibbles as Q4_0
Q5_0    32     22      32   5     16    d, 4 bytes of fifth bits (bit j: input j), nibbles as Q4_0
Q8_0    32     34      32   8     128   d, 32 int8 codes (stored signed: code - 128)
Q4_K    256    144     32   4     0     d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
                                        nibbles (byte l of 64-input chunk c: inputs 64c + l, + 32)
Q5_K    256    176     32   5     0     d, dmin, scales as Q4_K, 32 bytes of fifth bits (bit s of
                                        byte l: input 32s + l), nibbles as Q4_K
Q6_K    256    210     16   6     32    128 bytes of low nibbles, 64 of high bit pairs, 16 int8
                                        scales, d last
======  =====  ======  ===  ====  ====  ===========================================================

K-quants' sub-block scale is ``d * sc`` and offset ``-(dmin * m)``; Q6_K's scale ``d * sc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml: int  # gguf.GGMLQuantizationType value
    block: int  # inputs per block
    nbytes: int  # bytes per block
    sub: int  # inputs per sub-block (one scale / offset)
    bits: int
    zero: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block * self.nbytes


BLOCK_TYPES: dict[int, BlockType] = {t.ggml: t for t in (
    BlockType("Q4_0", 2, 32, 18, 32, 4, 8),
    BlockType("Q4_1", 3, 32, 20, 32, 4, 0),
    BlockType("Q5_0", 6, 32, 22, 32, 5, 16),
    BlockType("Q8_0", 8, 32, 34, 32, 8, 128),
    BlockType("Q4_K", 12, 256, 144, 32, 4, 0),
    BlockType("Q5_K", 13, 256, 176, 32, 5, 0),
    BlockType("Q6_K", 14, 256, 210, 16, 6, 32),
)}
BY_NAME = {t.name: t for t in BLOCK_TYPES.values()}
F32, F16, BF16 = 0, 1, 30  # unquantized ggml types (kept dense)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 8, n]: bit s of byte l at [s, l]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts[:, None]) & 1


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> 6-bit scales and mins [..., 8] (gguf's get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def decode(raw: torch.Tensor, t: BlockType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Raw rows [rows, row bytes] -> (codes uint8 [rows, in], scale and offset float32
    [rows, in / sub]; offset None where the type has none)."""
    rows = raw.shape[0]
    b = raw.view(rows, -1, t.nbytes)  # [rows, blocks, nbytes]
    offset = None
    if t.name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        scale = _f16(b[..., 0:2])
        if t.name == "Q8_0":
            codes = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        elif t.name == "Q5_0":
            high = _bits(b[..., 2:6]).transpose(-1, -2).reshape(rows, -1, 32)  # bit j%8 of byte j//8
            codes = _nibbles(b[..., 6:22]) | (high << 4)
        else:
            codes = _nibbles(b[..., 4 if t.name == "Q4_1" else 2 :])
            offset = _f16(b[..., 2:4]) if t.name == "Q4_1" else None
    elif t.name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        scale = _f16(b[..., 0:2])[..., None] * sc  # [rows, blocks, 8]
        offset = -(_f16(b[..., 2:4])[..., None] * mn)
        qs = b[..., 16:144] if t.name == "Q4_K" else b[..., 48:176]
        codes = _nibbles(qs.reshape(rows, -1, 4, 1, 32).transpose(-2, -3)).reshape(rows, -1, 4, 64)
        if t.name == "Q5_K":
            codes = codes | (_bits(b[..., 16:48]).reshape(rows, -1, 4, 64) << 4)
    else:  # Q6_K
        ql = b[..., 0:128].reshape(rows, -1, 2, 64)
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
        high = ((qh >> shifts[:, None]) & 3).reshape(rows, -1, 2, 128)
        codes = _nibbles(ql) | (high << 4)
        scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    return codes.reshape(rows, -1), scale.reshape(rows, -1), None if offset is None else offset.reshape(rows, -1)


def dequantize(raw: torch.Tensor, t: BlockType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw rows [rows, row bytes] -> weights [rows, in], computed in float32 (gguf-py's values)."""
    codes, scale, offset = decode(raw, t)
    rows = codes.shape[0]
    q = codes.view(rows, -1, t.sub).float() - t.zero
    w = scale[..., None] * q
    if offset is not None:
        w = w + offset[..., None]
    return w.view(rows, -1).to(dtype)


def random_blocks(t: BlockType, rows: int, in_features: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Random raw rows uint8 [rows, row bytes] for tests and benchmarks: random code and scale
    bytes, the float16 fields (``d``, ``m`` / ``dmin``) small normals (never inf or NaN)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = in_features // t.block
    raw = torch.randint(0, 256, (rows, blocks, t.nbytes), generator=gen, dtype=torch.uint8, device=device)
    span = (208, 210) if t.name == "Q6_K" else (0, 4 if t.name in ("Q4_1", "Q4_K", "Q5_K") else 2)
    halves = torch.randn(rows, blocks, (span[1] - span[0]) // 2, generator=gen, device=device) * 0.01
    raw[..., span[0] : span[1]] = halves.half().view(torch.uint8)
    return raw.view(rows, -1)

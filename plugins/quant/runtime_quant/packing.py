"""Pack and unpack sub-byte integer codes held in int32 words.

Every 4/8-bit checkpoint layout this plugin reads packs ``32 // bits`` codes into one int32,
code ``j`` of a word at bits ``[bits * j, bits * (j + 1))``, along one dimension:

- GPTQ ``qweight`` [in / pack, out] packs along the input dimension (rows), ``qzeros``
  [groups, out / pack] along the output dimension (columns);
- AWQ ``qweight`` [in, out / 8] and ``qzeros`` [groups, out / 8] pack along columns in the
  interleaved order :data:`AWQ_ORDER` (word slot ``j`` holds column ``8 * c + AWQ_ORDER[j]``);
- compressed-tensors ``weight_packed`` [out, in / pack] packs along columns, its
  ``weight_zero_point`` [out / pack, groups] along rows.

Codes are unsigned (``0 .. 2**bits - 1``); the sign bit of an int32 word is just bit 31.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: slot j holds column AWQ_ORDER[j]


def pack_factor(bits: int) -> int:
    """Codes per int32 word."""
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)  # [pack]


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> uint8 codes, ``pack_factor(bits)`` times longer along ``dim`` (0 or 1)."""
    shifts, mask = _shifts(bits, packed.device), (1 << bits) - 1
    rows, cols = packed.shape
    if dim == 0:  # [words, cols] -> [words, pack, cols] -> [words * pack, cols]
        codes = (packed.unsqueeze(1) >> shifts[:, None]) & mask
        return codes.to(torch.uint8).reshape(rows * pack_factor(bits), cols)
    codes = (packed.unsqueeze(-1) >> shifts) & mask  # [rows, words, pack]
    return codes.to(torch.uint8).reshape(rows, cols * pack_factor(bits))


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned codes -> int32 words along ``dim`` (its length a multiple of the pack factor)."""
    if dim == 0:
        return pack(codes.t(), bits, 1).t().contiguous()
    rows, cols = codes.shape
    factor = pack_factor(bits)
    if cols % factor:
        raise ValueError(f"cannot pack {cols} {bits}-bit codes into int32 words of {factor}")
    grouped = codes.to(torch.int32).reshape(rows, cols // factor, factor) << _shifts(bits, codes.device)
    # Slots hold disjoint bits: their sum is their bitwise or (bit 31 wraps to the sign as intended).
    return grouped.sum(dim=-1, dtype=torch.int32)


def awq_to_sequential(codes: torch.Tensor) -> torch.Tensor:
    """Columns unpacked from AWQ words (in slot order) -> columns in their real order."""
    rows, cols = codes.shape
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=codes.device)
    return codes.reshape(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)


def sequential_to_awq(codes: torch.Tensor) -> torch.Tensor:
    """Columns in their real order -> AWQ slot order (for :func:`pack`); tests write checkpoints with it."""
    rows, cols = codes.shape
    return codes.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols)

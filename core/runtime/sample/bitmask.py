"""Apply a structured-output token bitmask to logits, on the logits' device.

The bitmask is ``[rows, ceil(V / 32)]`` int32 (``runtime.structured_output``): bit ``t % 32`` of
word ``t // 32`` set means token ``t`` may be sampled. Unpacking is one broadcast shift over
the whole batch, so no Python loop ever touches the vocabulary.
"""

from __future__ import annotations

import torch

from runtime.sample.upload import upload

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, >= vocab_size]`` uint8 0/1, bit by bit (through the
    words' little-endian bytes: a quarter of the memory of shifting the int32 words)."""
    if bitmask.shape[1] * 32 < vocab_size:
        bitmask = torch.nn.functional.pad(bitmask, (0, (vocab_size + 31) // 32 - bitmask.shape[1]))  # not allowed
    data = bitmask.contiguous().view(torch.uint8)  # [rows, 4 * words]
    return ((data.unsqueeze(-1) >> _bit_shifts(bitmask.device)) & 1).view(bitmask.shape[0], -1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, vocab_size]`` bool, True where allowed (tokens past
    the bitmask's width are not allowed)."""
    return _bits(bitmask, vocab_size)[:, :vocab_size].to(torch.bool)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place: row ``rows[i]`` of ``logits`` (or row
    ``i`` when ``rows`` is None) by row ``i`` of ``bitmask`` (on any device; copied to the logits')."""
    bitmask = upload(bitmask, torch.int32, logits.device)  # queued: the host does not wait for the forward pass
    disallowed = _bits(bitmask, logits.shape[1])[:, : logits.shape[1]] == 0
    if rows is None or rows == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        index = upload(rows, torch.int64, logits.device)
        logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits

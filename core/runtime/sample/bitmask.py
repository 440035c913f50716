"""Apply a structured-output token bitmask to logits, on the logits' device.

The bitmask is ``[rows, ceil(V / 32)]`` int32 (``runtime.structured_output``): bit ``t % 32`` of
word ``t // 32`` set means token ``t`` may be sampled. Unpacking is one broadcast shift over
the whole batch, so no Python loop ever touches the vocabulary.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from runtime.sample.upload import upload
from runtime.structured_output import gather_slot_rows

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


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None, slots: np.ndarray | None = None
) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place: row ``rows[i]`` of ``logits`` (or row
    ``i`` when ``rows`` is None) by row ``i`` of ``bitmask`` (on any device; copied to the logits').

    With ``slots`` (int32, one per masked row), ``bitmask`` is a table and row ``i`` is masked by
    its row ``slots[i]``, or not at all where ``slots[i] < 0``."""
    if slots is not None:
        bitmask = _gather_slots(bitmask, slots)
    bitmask = upload(bitmask, torch.int32, logits.device)  # queued: the host does not wait for the forward pass
    disallowed = _bits(bitmask, logits.shape[1])[:, : logits.shape[1]] == 0
    if rows is None or rows == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        index = upload(rows, torch.int64, logits.device)
        logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def takes_slots(op) -> bool:
    """True where an ``apply_token_bitmask`` op accepts ``slots`` (the platform ops' contract
    gained it later: a platform's older op gets dense bitmasks)."""
    try:
        return "slots" in inspect.signature(op).parameters
    except (TypeError, ValueError):
        return False


def _gather_slots(table: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    if table.device.type == "cpu":
        return gather_slot_rows(table, slots)
    slots = np.asarray(slots, dtype=np.intp)
    index = upload(np.maximum(slots, 0), torch.int64, table.device)
    keep = upload(slots < 0, torch.bool, table.device)
    return table[index].masked_fill(keep.unsqueeze(1), -1)


class DeviceMaskTable:
    """A copy of a guided backend's mask table (see :class:`runtime.structured_output.SlotBitmask`)
    on one device, refreshed with only the rows it has not seen: after the first steps of a
    workload a step uploads its slots and nothing else.

    On the CPU the backend's own table is used as it is, unless ``copy`` (tests)."""

    def __init__(self, device: torch.device | str, copy: bool | None = None):
        self.device = torch.device(device)
        self.copy = self.device.type != "cpu" if copy is None else copy
        self.rows: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._synced = 0  # rows [0, _synced) of the table are on the device

    def sync(self, slot_bitmask) -> torch.Tensor:
        """The device table holding every row ``slot_bitmask`` may name."""
        source = slot_bitmask.rows
        if not self.copy:
            return source
        key = (slot_bitmask.table_id, slot_bitmask.generation)
        if key != self._key:  # another table, or the table started over: every row is new
            self._key, self._synced = key, 0
        count = slot_bitmask.count
        if count > self._synced:
            if self.rows is None or self.rows.shape[0] < count or self.rows.shape[1] != source.shape[1]:
                capacity = max(count, 2 * self.rows.shape[0] if self.rows is not None else 0, 64)
                grown = torch.empty((capacity, source.shape[1]), dtype=torch.int32, device=self.device)
                if self._synced:
                    grown[: self._synced] = self.rows[: self._synced]
                self.rows = grown
            new_rows = source[self._synced : count]
            if self.device.type == "cuda":  # staged in pinned memory: queued, the host goes on
                new_rows = new_rows.pin_memory()
            self.rows[self._synced : count].copy_(new_rows, non_blocking=True)
            self._synced = count
        return self.rows

"""Bitmask rows of grammar states, shared by every compiled spec of one backend.

A grammar state's allowed tokens never change, so each (spec, state) gets one row of a
``[rows, words]`` int32 table the first time a grammar is in it (outlines-core writes the row:
~0.1 ms for a string state of a 49k vocabulary, where a row is 6 KB). A step's bitmask is
then one gather of the table by the rows' slots, whatever the number of rows, specs
and states. Row 0 allows only the end token (a grammar that accepted EOS).

The table is cleared once it holds ``max_bytes`` (after the fill that filled it, so a step's
slots stay valid while it gathers); the states in use get rows again on their next fill.
A written row is never changed: growing and clearing allocate a new tensor (``num_resets``
counts the clears), so a step's :class:`runtime.structured_output.SlotBitmask` can keep
naming rows of the tensor it was taken from, and a device copy needs only the new rows.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

MAX_TABLE_BYTES = 64 << 20  # 10,922 rows of a 49k vocabulary
INITIAL_ROWS = 64
ENDED_SLOT = 0  # only the end token


class MaskTable:
    """The rows of one vocabulary's grammar states; ``slots`` maps are per compiled spec."""

    def __init__(self, num_words: int, end_token_id: int, max_bytes: int = MAX_TABLE_BYTES):
        self.num_words = num_words
        self.end_token_id = end_token_id
        self.max_rows = max(INITIAL_ROWS, max_bytes // (4 * num_words))
        self.rows = torch.zeros((INITIAL_ROWS, num_words), dtype=torch.int32)
        self._set_end_bit(self.rows[ENDED_SLOT])
        self.count = 1
        self.num_resets = 0
        self._needs_reset = False
        self._owners: weakref.WeakSet = weakref.WeakSet()  # specs whose slot maps point into the table
        self._lock = threading.Lock()  # specs register from the compile threads

    def _set_end_bit(self, words: torch.Tensor) -> None:
        word, bit = divmod(self.end_token_id, 32)
        if word < self.num_words:  # an end token past the logits (no EOS): nothing to allow
            words[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)

    def register(self, owner) -> dict[int, int]:
        """A new, empty ``state -> slot`` map for ``owner`` (a compiled spec), cleared with the table."""
        with self._lock:
            self._owners.add(owner)
        return {}

    def add(self, guide) -> int:
        """A new row holding the allowed tokens of ``guide``'s current state; its slot."""
        if self.count == self.rows.shape[0]:
            grown = torch.zeros((2 * self.count, self.num_words), dtype=torch.int32)
            grown[: self.count] = self.rows
            self.rows = grown
        row = self.rows[self.count]
        guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        self.count += 1
        if self.count >= self.max_rows:
            self._needs_reset = True  # after this fill: its slots are in use until it gathers
        return self.count - 1

    def gather(self, slots: list[int], out: torch.Tensor) -> None:
        """``out[i] = row slots[i]`` (``out`` a contiguous CPU tensor), one copy for every row.

        numpy's ``take`` rather than torch's ``index_select``: it runs on the calling thread,
        where torch would split a 1.5 MB copy over its intra-op threads, and waits for all of
        them (milliseconds when another process holds a core)."""
        index = np.fromiter(slots, dtype=np.intp, count=len(slots))
        np.take(self.rows.numpy(), index, axis=0, out=out.numpy())
        self.end_fill()

    def end_fill(self) -> None:
        """Clear the table if it grew past its limit during the fill that just ended."""
        if not self._needs_reset:
            return
        with self._lock:
            for owner in list(self._owners):
                owner.slots.clear()
        self.rows = torch.zeros((INITIAL_ROWS, self.num_words), dtype=torch.int32)
        self._set_end_bit(self.rows[ENDED_SLOT])
        self.count = 1
        self.num_resets += 1
        self._needs_reset = False

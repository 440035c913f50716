"""Structured output's token bitmask applied to the logits in one launch (no temporaries).

The reference, :func:`runtime.sample.bitmask.apply_token_bitmask`, unpacks the bitmask into
``[rows, vocab]`` bytes first: on a GPU whose memory the KV cache fills, allocating those
temporaries each step can make the caching allocator release memory, which waits for the
device. This kernel reads the packed words and writes ``-inf`` where a bit is clear.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.sample.upload import upload
from runtime_kernels.utils import cdiv, check_last_dim_contiguous, require_triton

BLOCK = 2048  # tokens per program


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None, slots: np.ndarray | None = None
) -> torch.Tensor:
    """The reference's contract: row ``rows[i]`` of ``logits`` [N, V] (row ``i`` when ``rows`` is None)
    keeps only the tokens that row ``i`` of ``bitmask`` [R, ceil(V / 32)] int32 allows; in place.
    With ``slots``, ``bitmask`` is a table and row ``i`` uses its row ``slots[i]`` (none where < 0)."""
    require_triton("apply_token_bitmask")
    from runtime_kernels.jit.bitmask import apply_token_bitmask_kernel

    check_last_dim_contiguous("logits", logits)
    bitmask = upload(bitmask, torch.int32, logits.device)  # queued: the host does not wait for the forward pass
    num_rows, vocab_size = (bitmask.shape[0] if slots is None else len(slots)), logits.shape[1]
    has_rows = rows is not None and rows != list(range(logits.shape[0]))
    if not has_rows and num_rows != logits.shape[0]:
        raise ValueError(f"a bitmask of {num_rows} rows for {logits.shape[0]} logits rows needs `rows`")
    index = upload(rows, torch.int64, logits.device) if has_rows else bitmask  # any pointer when unused
    slot_index = upload(slots, torch.int32, logits.device) if slots is not None else bitmask
    if num_rows:
        apply_token_bitmask_kernel[(num_rows, cdiv(vocab_size, BLOCK))](
            logits, bitmask, index, slot_index, vocab_size, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
            HAS_ROWS=has_rows, HAS_SLOTS=slots is not None, BLOCK=BLOCK,
        )
    return logits

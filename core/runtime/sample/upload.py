"""Host values to the device without waiting for the device.

A copy from pageable host memory to a CUDA device first waits for every kernel already
queued on the stream, so a small index tensor built after a step's forward pass was launched
would hold the host until that pass ends. Staged through pinned memory, the copy is queued
like a kernel and the host goes on (torch keeps the pinned block until the copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as a tensor of ``dtype`` on ``device``."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":  # already on a device
        return values.to(device=device, dtype=dtype)
    host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)

"""Persistent host/device buffers for a step's inputs and sampled tokens.

Every step writes its inputs into the same host arrays and copies them to the same
device tensors, so a captured graph can replay on new inputs, and copies come from
pinned memory and do not block the host. On a CPU device host and device are one
tensor and nothing is copied.
"""

from __future__ import annotations

import torch


def _pinned(device: torch.device) -> bool:
    return device.type != "cpu"


class StagedBuffer:
    """A host array (numpy view ``np``) and its device twin ``dev`` of the same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=_pinned(device))
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device (asynchronously) and return them there."""
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class CopyFence:
    """Orders host writes after the device has consumed the previous step's copies.

    The host buffers are pinned and copied asynchronously, so a step must not overwrite
    them while the previous step's copies may still be queued (a step that samples
    nothing never waits for the device).
    """

    def __init__(self, device: torch.device):
        self.event = torch.Event(device=device) if device.type != "cpu" else None
        self.pending = False

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
            self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.event.synchronize()
            self.pending = False


class StepBuffers:
    """The flat batch of a step: per-token and per-request arrays, sized for the largest step."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks
        self.input_ids = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.positions = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = StagedBuffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer((max_num_reqs,), torch.int32, device)
        # Block tables travel compact ([n, w] for the step's widest request) and, for graph
        # replays, are spread on the device into the full-width table the graphs captured.
        self.block_table_flat = StagedBuffer((max_num_reqs * max_blocks,), torch.int32, device)
        self.block_table = torch.zeros((max_num_reqs, max_blocks), dtype=torch.int32, device=device)
        # Where the next step's inputs take tokens that are still on the device.
        self.forward_dst = StagedBuffer((max_num_tokens,), torch.int64, device)
        self.forward_src = StagedBuffer((max_num_tokens,), torch.int64, device)
        # Two pinned landing places for sampled ids: a step's copy may be queued while
        # the previous step's ids are still being read.
        self.sampled = [torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=_pinned(device)) for _ in range(2)]
        self.num_downloads = 0
        self.fence = CopyFence(device)

    def upload_block_table(self, rows: int, width: int, full_rows: int | None) -> torch.Tensor:
        """The step's ``[rows, width]`` table on the device; ``full_rows`` returns the graphs' full-width view."""
        compact = self.block_table_flat.upload(rows * width).view(rows, width)
        if full_rows is None:
            return compact
        self.block_table[:rows, :width].copy_(compact)
        return self.block_table[:full_rows]

    def start_download(self, token_ids: torch.Tensor) -> TokenDownload:
        """Begin copying sampled ids ``[n]`` to the host; ``wait()`` returns them there."""
        if token_ids.device.type == "cpu":
            return TokenDownload(token_ids, None)
        host = self.sampled[self.num_downloads % 2][: token_ids.shape[0]]
        self.num_downloads += 1
        host.copy_(token_ids, non_blocking=True)
        event = torch.Event(device=token_ids.device)
        event.record()
        return TokenDownload(host, event)


class TokenDownload:
    """Sampled ids on their way to the host."""

    def __init__(self, host: torch.Tensor, event):
        self.host = host
        self.event = event

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once."""
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host

"""The eager step that graph-capturing platforms run before capture: a decode, then a prefill chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.worker.buffers import StepBuffers
from runtime.worker.graphs import DecodeGraphs


class RecordingBackend:
    def __init__(self):
        self.metadata = []

    def build_metadata(self, metadata):
        self.metadata.append(metadata)
        return metadata


@pytest.mark.parametrize("max_num_reqs", [4, 1])
def test_warm_up_runs_a_leading_decode_and_a_prefill_chunk(max_num_reqs):
    """A mixed step in the scheduler's order (the decode first), so backends that launch leading decodes apart
    compile those launches before capture; one request (``--max-num-seqs 1``): the chunk alone."""
    backend, seen = RecordingBackend(), []
    graphs = DecodeGraphs((1,), SimpleNamespace(synchronize=lambda: None), lambda ids, pos: seen.append(pos.clone()),
                          backend, [], StepBuffers(max_num_reqs, 64, 8, torch.device("cpu")), 16, 128)
    graphs.warm_up_prefill(20)
    # chunks of 2, 4, 8, 16 and 20 queries: every power-of-two launch shape up to the longest chunk
    assert [m.max_query_len for m in backend.metadata] == [2, 4, 8, 16, 20]
    metadata = backend.metadata[-1]
    if max_num_reqs > 1:
        assert metadata.query_start_loc_cpu.tolist() == [0, 1, 21] and metadata.seq_lens_cpu.tolist() == [1, 20]
        assert seen[-1].tolist() == [0] + list(range(20))
        assert backend.metadata[0].query_start_loc_cpu.tolist() == [0, 1, 3] and seen[0].tolist() == [0, 0, 1]
    else:
        assert metadata.query_start_loc_cpu.tolist() == [0, 20] and metadata.seq_lens_cpu.tolist() == [20]
        assert seen[-1].tolist() == list(range(20))
        assert backend.metadata[0].query_start_loc_cpu.tolist() == [0, 2] and seen[0].tolist() == [0, 1]
    assert all((m.slot_mapping == -1).all() for m in backend.metadata)  # nothing is written to the cache


def test_warm_up_chunk_fits_the_buffers():
    """The longest chunk is bounded by the step's token buffers (a decode beside it) and the model length."""
    backend = RecordingBackend()
    graphs = DecodeGraphs((1,), SimpleNamespace(synchronize=lambda: None), lambda ids, pos: None,
                          backend, [], StepBuffers(4, 16, 8, torch.device("cpu")), 16, 128)
    graphs.warm_up_prefill(256)
    assert [m.max_query_len for m in backend.metadata] == [2, 4, 8, 15]

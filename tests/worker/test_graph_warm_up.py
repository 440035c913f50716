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
    (metadata,) = backend.metadata
    if max_num_reqs > 1:
        assert metadata.query_start_loc_cpu.tolist() == [0, 1, 21] and metadata.seq_lens_cpu.tolist() == [1, 20]
        assert seen[0].tolist() == [0] + list(range(20))
    else:
        assert metadata.query_start_loc_cpu.tolist() == [0, 20] and metadata.seq_lens_cpu.tolist() == [20]
        assert seen[0].tolist() == list(range(20))
    assert metadata.max_query_len == 20 and (metadata.slot_mapping == -1).all()  # nothing is written to the cache

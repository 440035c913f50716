"""``Linear.rank_part``: the part of a checkpoint tensor in a quantized layout that each
tensor-parallel rank loads (tests/plugins/quant/test_quant_tensor_parallel.py runs whole models on
it with real worker processes; this checks the layouts rank by rank, at TP=4 too).

Tensors here are labelled by position: each index of a split dimension holds its own index, so
the part a rank gets shows which indices it took.
"""

from __future__ import annotations

import pytest
import torch

from runtime.distributed import parallel_state
from runtime.models.linear import ColumnParallelLinear, Linear, MergedLinear, ParallelLMHead, RowParallelLinear


def at_rank(monkeypatch, rank: int, tp: int) -> None:
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState(tp_rank=rank, tp_size=tp))


def labels(*shape: int, dim: int) -> torch.Tensor:
    """A tensor whose entries are their index along ``dim``."""
    index = torch.arange(shape[dim]).view([-1 if d == dim else 1 for d in range(len(shape))])
    return index.expand(*shape).contiguous()


def taken(part: torch.Tensor, dim: int) -> list[int]:
    return part.select(1 - dim, 0).tolist() if part.dim() == 2 else part.tolist()


@pytest.mark.parametrize("rank", range(4))
def test_fused_projections_with_kv_heads_shared_by_two_ranks(monkeypatch, rank):
    """q/k/v at TP=4 with 2 KV heads: q in quarters; k and v in halves, ranks 0-1 the first, 2-3 the
    second; packed 8 columns a word along the output (GPTQ's qzeros), or 1 (its scales)."""
    at_rank(monkeypatch, rank, 4)
    layer = MergedLinear(64, {"q": 64, "k": 32, "v": 32}, bias=False, replicas={"k": 2, "v": 2})
    assert taken(layer.rank_part(labels(2, 64, dim=1), 0, out_dim=1), 1) == list(range(16 * rank, 16 * rank + 16))
    k_words = layer.rank_part(labels(2, 4, dim=1), 1, out_dim=1, out_unit=8)  # 32 columns, 8 a word
    assert taken(k_words, 1) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    v_rows = layer.rank_part(labels(32, 64, dim=0), 2, out_dim=0)  # compressed-tensors: [out, in / pack]
    assert taken(v_rows, 0) == list(range(16 * (rank // 2), 16 * (rank // 2) + 16))
    whole = labels(4, 64, dim=1)
    assert layer.rank_part(whole, 0, out_dim=None, in_dim=1) is whole  # a column-parallel layer keeps its inputs


@pytest.mark.parametrize("rank", range(4))
def test_row_parallel_inputs_in_packed_words_groups_and_blocks(monkeypatch, rank):
    at_rank(monkeypatch, rank, 4)
    layer = RowParallelLinear(256, 32, bias=False)  # 64 inputs a rank
    words = layer.rank_part(labels(32, 32, dim=0), in_dim=0, in_unit=8)  # GPTQ qweight [in / 8, out]
    assert taken(words, 0) == list(range(8 * rank, 8 * rank + 8))
    groups = layer.rank_part(labels(8, 32, dim=0), in_dim=0, in_unit=32)  # scales [groups of 32, out]
    assert taken(groups, 0) == [2 * rank, 2 * rank + 1]
    whole = labels(32, 256, dim=1)
    assert layer.rank_part(whole, out_dim=0) is whole  # a row-parallel layer keeps its outputs
    with pytest.raises(ValueError, match="each rank's 64 input features are not a multiple of 128"):
        layer.rank_part(labels(2, 32, dim=0), in_dim=0, in_unit=128)
    with pytest.raises(ValueError, match="has 30 along dimension 0, expected 32"):
        layer.rank_part(labels(30, 32, dim=0), in_dim=0, in_unit=8)


def test_column_parallel_replicated_and_output_layers(monkeypatch):
    at_rank(monkeypatch, 1, 2)
    column = ColumnParallelLinear(64, 128, bias=False)
    assert taken(column.rank_part(labels(128, 8, dim=0), out_dim=0), 0) == list(range(64, 128))
    replicated, whole = Linear(64, 128, bias=False), labels(128, 64, dim=0)
    assert replicated.rank_part(whole, out_dim=0, in_dim=1) is whole

def test_output_layer_takes_its_vocabulary_slice_padded_with_zeros(monkeypatch):
    """1,001 tokens over 2 ranks: 501 rows each, the last one past the vocabulary zero; a tensor that
    already is the rank's slice (a tied embedding's) passes as it is."""
    whole = labels(1001, 8, dim=0) + 1  # no label 0: padding shows as 0
    for rank in range(2):
        at_rank(monkeypatch, rank, 2)
        head = ParallelLMHead(8, 1001)
        part = head.rank_part(whole, out_dim=0)
        assert part.shape == (501, 8)
        expected = list(range(1 + 501 * rank, min(1002, 502 + 501 * rank))) + [0] * rank
        assert taken(part, 0) == expected
        own = torch.ones(501, 8)
        assert head.rank_part(own, out_dim=0) is own
        with pytest.raises(ValueError, match="packed 8 rows an index"):
            head.rank_part(labels(126, 8, dim=0), out_dim=0, out_unit=8)
        with pytest.raises(ValueError, match="has 1000 along dimension 0, expected the vocabulary's 1001"):
            head.rank_part(labels(1000, 8, dim=0), out_dim=0)

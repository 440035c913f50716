"""The AVX-512 BF16 panel kernel of 4-bit GGUF layers (``runtime_quant.gguf_cpu_panels``) against
gguf-py's ``dequantize`` (llama.cpp's reference) then a matmul.

Both of its ways (scales folded into the sums up to ``FOLDED_MAX_ROWS`` rows, a dequantized
panel above) at odd row counts on either side of the threshold and of its 4- and 12-row blocks;
above the threshold the panel's weights must be the dequantize-at-load path's bf16 weights for
Q4_0 and Q4_1 (results one bf16 rounding from their float32 product). The torch int4 tiles stay the fallback, and the
op compiles with a symbolic batch as the CPU's compiled decode step takes it.
"""

from __future__ import annotations

import pytest
import torch

from runtime_quant import gguf_cpu_panels as panels
from runtime_quant.gguf_blocks import BY_NAME, decode, random_blocks
from runtime_quant.gguf_cpu import Int4Part, cpu_part

# Only the CPU decides: on one with AVX-512 BF16 the kernel must build (a failed build fails
# test_the_kernel_builds_here rather than skipping the file).
pytestmark = pytest.mark.skipif(not panels.cpu_has_avx512_bf16(), reason="needs a CPU with AVX-512 BF16")


def test_the_kernel_builds_here():
    assert panels.available(), "the AVX-512 BF16 kernel did not build (see the warning logged by gguf_cpu_panels)"

ROWS = [1, 3, 4, 5, 13, panels.FOLDED_MAX_ROWS, panels.FOLDED_MAX_ROWS + 1, 37, 300]


def reference(raw: torch.Tensor, name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize as gguf_dequantize

    t = BY_NAME[name]
    return torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(t.ggml)).copy())


def packed(raw: torch.Tensor, name: str):
    t = BY_NAME[name]
    codes, scale, offset = decode(raw, t)
    return panels.pack(codes, scale, (offset if offset is not None else 0) - scale * t.zero)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", ROWS)
def test_panels_match_gguf_py(name, rows):
    raw = random_blocks(BY_NAME[name], 96, 768, seed=rows)  # three panels, 24 groups (three Q4_K blocks)
    w = reference(raw, name)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = panels.panels_mm(x, *packed(raw, name))
    expected = x.float() @ w.t()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    torch.testing.assert_close(y.float(), expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    if rows > panels.FOLDED_MAX_ROWS and name != "Q4_K":  # float16 scales exact: the bf16 path's weights
        exact = x.float() @ w.bfloat16().float().t()  # those weights, float32 sums: one bf16 rounding away
        torch.testing.assert_close(y.float(), exact, atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_both_ways_agree_at_any_row_count(rows):
    raw = random_blocks(BY_NAME["Q4_1"], 64, 256, seed=5)
    pk = packed(raw, "Q4_1")
    x = torch.randn(rows, 256).bfloat16()
    folded, dequantized = panels.panels_mm(x, *pk, folded_max_rows=10**6), panels.panels_mm(x, *pk, folded_max_rows=0)
    torch.testing.assert_close(folded.float(), dequantized.float(), atol=0.01 * dequantized.abs().max().item(), rtol=0)


def test_two_threads_give_one_thread_results():
    raw = random_blocks(BY_NAME["Q4_1"], 320, 512, seed=6)
    pk, x = packed(raw, "Q4_1"), torch.randn(29, 512).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panels.panels_mm(x, *pk)
        torch.set_num_threads(2)
        assert torch.equal(panels.panels_mm(x, *pk), one)
    finally:
        torch.set_num_threads(threads)


def test_bf16_parts_use_panels_else_tiles():
    raw = random_blocks(BY_NAME["Q4_1"], 48, 256)  # 48 rows: whole int4 tiles of 16, not panels of 32
    assert not cpu_part(raw, BY_NAME["Q4_1"], torch.bfloat16).is_panels
    part = cpu_part(random_blocks(BY_NAME["Q4_1"], 64, 256), BY_NAME["Q4_1"], torch.bfloat16)
    assert isinstance(part, Int4Part) and part.is_panels
    assert part.nbytes() == 64 * 256 // 2 + 2 * 2 * 64 * 256 // 32  # 4-bit codes, float16 scale and offset
    assert not cpu_part(raw, BY_NAME["Q4_1"], torch.float16).is_panels  # the kernel is bf16


def test_compiles_with_a_symbolic_batch():
    raw = random_blocks(BY_NAME["Q4_0"], 64, 256, seed=7)
    part = cpu_part(raw, BY_NAME["Q4_0"], torch.bfloat16)

    def f(x):
        out = torch.empty(x.shape[0], 64, dtype=x.dtype)
        part.matmul(x, out)
        return out * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    w = reference(raw, "Q4_0")
    for rows in (3, 40):
        x = torch.randn(rows, 256).bfloat16()
        expected = 2 * (x.float() @ w.t())
        torch.testing.assert_close(compiled(x).float(), expected, atol=0.01 * expected.abs().max().item(), rtol=0)

"""On a GPU: once the engine has started (its warm-up and graph capture done), serving compiles no Triton kernel.

Triton compiles a kernel again for each new class of an integer argument (divisible by 16, equal to 1, neither) and
of a pointer's alignment; a compile inside a request costs it seconds (W2's first mixed steps, benchmarks/RESULTS.md,
session 31: the block table's width). Prompts of many lengths, chunked, beside decodes (launched apart by the Triton
backend), and rows sampled in twos and threes, all after start-up, must find every kernel compiled.
"""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_serving_compiles_nothing_after_start_up(tmp_path, kv_cache_dtype):
    triton = pytest.importorskip("triton")
    llm = LLM(build_untokenized_model("llama", tmp_path / "llama"), platform="cuda", dtype="bfloat16",
              skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=256 << 20,
              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, async_scheduling=True)
    compiled: list[str] = []

    def hook(*, repr: str, **_) -> bool:
        compiled.append(repr)
        return False  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 97 + 3 for j in range(n)]}
                   for i, n in enumerate((3, 17, 40, 63, 100, 129, 250, 31))]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert [len(out.outputs[0].token_ids) for out in outs] == [24] * len(prompts)
    assert compiled == [], "compiled after start-up:\n" + "\n".join(c[:300] for c in compiled)

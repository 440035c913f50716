"""Quantized checkpoints split over tensor-parallel ranks (real worker processes, gloo on the CPU):
GPTQ, AWQ, compressed-tensors, FP8 and GGUF blocks.

Each rank loads its part of every packed tensor (``Linear.rank_part``): column-parallel layers
(q/k/v, gate/up) their output columns, row-parallel ones (o, down) their input rows with the
groups or blocks that cover them. Weight-only layers compute in float32 on both sides, so greedy
tokens equal one worker's and the dequantized transformers reference's exactly. FP8 quantizes
activations: its ranks' inputs differ from one worker's by float noise, which can move an 8-bit
rounding, so FP8 compares logprobs until the first differing token. Layouts that cannot be split
are refused naming the tensor.
"""

from __future__ import annotations

import gc

import pytest
import torch
from quant_checkpoints import write_fp8_checkpoint
from wna16_checkpoints import dequantized_reference, write_awq_checkpoint, write_gptq_checkpoint, write_pack_quantized_checkpoint

from transformers import AutoModelForCausalLM

from runtime import LLM, SamplingParams
from runtime.testing.reference import check_logprobs_close_until_divergence, check_outputs_equal, hf_greedy, make_prompts

NUM_NEW_TOKENS = 8
CASES = {  # name -> (arch, writer, engine arguments)
    "gptq_4bit_g32_asym": ("llama", lambda s, d: write_gptq_checkpoint(s, d, 4, 32, symmetric=False), dict(async_scheduling=True)),
    "gptq_8bit_channel": ("qwen3", lambda s, d: write_gptq_checkpoint(s, d, 8, -1), dict(enable_prefix_caching=True, block_size=4)),
    "awq_g32": ("qwen2", lambda s, d: write_awq_checkpoint(s, d, 32), dict()),
    "ct_w4a16_asym_g32": ("qwen3", lambda s, d: write_pack_quantized_checkpoint(s, d, 4, 32, symmetric=False), dict()),
}


def generate(llm: LLM, prompts, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def run(path: str, tp: int, prompts=None, **settings):
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=tp, **settings)
    try:
        if tp > 1:
            assert type(llm.llm_engine.engine_core.executor).__name__ == "MultiprocExecutor"
        return generate(llm, prompts or make_prompts()[:4], logprobs=5)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize("name", list(CASES))
def test_weight_only_checkpoints_split_over_two_ranks(float_checkpoints, tmp_path, name):
    arch, write, settings = CASES[name]
    src = float_checkpoints(arch)
    path, real = write(src, str(tmp_path / "quantized"))
    expected = hf_greedy(dequantized_reference(src, real), make_prompts()[:4], NUM_NEW_TOKENS)
    one, two = run(path, 1, **settings), run(path, 2, **settings)
    check_outputs_equal([tokens for tokens, _ in expected], [o.token_ids for o in two], f"{name} tp=2 vs reference")
    check_outputs_equal([o.token_ids for o in one], [o.token_ids for o in two], f"{name} tp=2 vs tp=1")


def mean_deviation(expected, outputs) -> float:
    """The mean top-5 logprob difference from ``expected`` (transformers' (tokens, steps)) over the
    positions whose context still agrees (up to the first differing token, included)."""
    deviations = []
    for (tokens, steps), out in zip(expected, outputs):
        for pos, (token, ours) in enumerate(zip(tokens, out.token_ids)):
            deviations += [abs(steps[pos][t] - out.logprobs[pos][t].logprob) for t in set(steps[pos]) & set(out.logprobs[pos])]
            if token != ours:
                break
    return sum(deviations) / len(deviations)


def test_fp8_checkpoint_and_online_fp8_split_over_two_ranks(float_checkpoints, tmp_path):
    src = float_checkpoints("llama")
    # The checkpoint's scales are the same on every rank: only float noise differs from one worker.
    static = write_fp8_checkpoint(src, str(tmp_path / "fp8"), "static")
    one, two = run(static, 1), run(static, 2)
    for a, b in zip(one, two):
        steps = [{token: lp.logprob for token, lp in step.items()} for step in a.logprobs]
        check_logprobs_close_until_divergence(a.token_ids, steps, b.token_ids, b.logprobs, atol=0.05, label="fp8 tp=2 vs tp=1")
    # Online FP8 computes each rank's per-channel weight scales over its own part of o/down's rows, and
    # per-token activation scales over its part of their inputs (as vLLM does): another quantized model,
    # which must stay as close to the float model as one worker's.
    prompts = make_prompts()
    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), prompts, NUM_NEW_TOKENS)
    one, two = run(src, 1, prompts, quantization="fp8"), run(src, 2, prompts, quantization="fp8")
    deviation = {tp: mean_deviation(expected, outputs) for tp, outputs in ((1, one), (2, two))}
    assert 0 < deviation[1] < 0.2 and deviation[2] <= 1.25 * deviation[1] + 0.01, deviation


@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_0"])
def test_gguf_blocks_split_over_two_ranks(float_checkpoints, tmp_path, linear_type):
    """``--quantization gguf`` keeps a GGUF file's blocks; each rank keeps its rows of q/k/v and
    gate/up and whole 32-input blocks of o and down: the same greedy tokens as one worker's packed
    model and as the file dequantized at load."""
    import gguf
    from spec_decode.gguf_models import write_qwen2_gguf

    path = write_qwen2_gguf(float_checkpoints("qwen2"), tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[linear_type])
    dequantized, one, two = run(path, 1), run(path, 1, quantization="gguf"), run(path, 2, quantization="gguf")
    check_outputs_equal([o.token_ids for o in dequantized], [o.token_ids for o in one], f"{linear_type} packed vs dequantized")
    check_outputs_equal([o.token_ids for o in one], [o.token_ids for o in two], f"{linear_type} tp=2 vs tp=1")


def test_layouts_that_cannot_be_split_are_refused(float_checkpoints, tmp_path):
    """Groups of 64 input rows over ranks holding 32 of o_proj's; act-order over a row-parallel
    layer: the engine does not start, and the error names the tensor and the reason."""
    src = float_checkpoints("llama")
    g64, _ = write_gptq_checkpoint(src, str(tmp_path / "g64"), 4, 64)
    with pytest.raises(Exception, match=r"(?s)o_proj.*not a multiple of 64"):
        LLM(g64, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2)
    act_order, _ = write_gptq_checkpoint(src, str(tmp_path / "act_order"), 4, 32, act_order=True)
    with pytest.raises(Exception, match=r"(?s)g_idx.*act-order.*tensor_parallel_size 1"):
        LLM(act_order, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2)


def test_tensor_of_the_wrong_rank_is_named_before_it_is_split(float_checkpoints, tmp_path):
    """k_proj's [2, 32] scales stored flat: each rank's part is cut along dimension 1, which the tensor lacks;
    the error names the tensor and the layout expected (was an IndexError, 'tuple index out of range')."""
    from test_quant_bad_input import edit_tensors

    path, _ = write_gptq_checkpoint(float_checkpoints("llama"), str(tmp_path / "gptq"), 4, 32)
    name = "model.layers.0.self_attn.k_proj.scales"
    edit_tensors(path, lambda s: s.__setitem__(name, s[name].flatten()))
    with pytest.raises(Exception, match=rf"(?s)'{name}' has shape \[64\], expected float \[2, 16\] \(\[groups, out\]\)"):
        LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2)

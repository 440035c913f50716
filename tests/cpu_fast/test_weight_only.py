"""Weight-only int8 and int4 on the CPU (``int8_weight_only``, ``int4_weight_only``, issue 17).

A layer's output equals a bfloat16 matmul with its dequantized weight; an engine quantizing
a float32 checkpoint on load follows transformers on the same checkpoint with the same
dequantized weights (its decoder linears rounding inputs and outputs to bfloat16, as the
kernels compute) up to near-ties, with logprobs close.
"""

from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.testing.models import build_untokenized_model
from runtime.testing.reference import check_logprobs_close_until_divergence, hf_greedy, make_prompts
from runtime_cpu.weight_only import (
    INT4_GROUP,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    Int8WeightOnlyMethod,
    dequantize_groups,
    quantize_groups,
    quantize_rows,
)

NUM_NEW_TOKENS = 8
# The reference rounds as the kernels do, so most logprobs agree to 1e-6 (median 5e-7). The float32
# parts (attention, norms) sum in another order than transformers', and a 1e-7 difference there can
# flip one bfloat16 rounding of a linear's input or output (2^-8 relative): seen to move a logprob by
# 3.2e-3 on an AVX512-BF16 machine, so the bound is a few such flips, not the float32 noise.
LOGPROB_ATOL = 1e-2


def dequantized(method: str, weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight a layer of ``method`` computes with."""
    if method == "int8_weight_only":
        rows, scales = quantize_rows(weight)
        return rows.float() * scales.float()[:, None]
    return dequantize_groups(*quantize_groups(weight))


@pytest.mark.parametrize("method", ["int8_weight_only", "int4_weight_only"])
def test_fused_layer_matches_its_dequantized_weight(method):
    torch.manual_seed(0)
    linear = Int8WeightOnlyLinear() if method == "int8_weight_only" else Int4WeightOnlyLinear()
    layer = torch.nn.Module()
    linear.create_weights(layer, 64, [48, 16], torch.float32)
    parts = [torch.randn(48, 64), torch.randn(16, 64) * 3 + 1]
    for shard, part in enumerate(parts):
        linear.load(layer, "weight", part, shard)
    linear.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight")
    weight = torch.cat(parts)
    expected_weight = dequantized(method, weight)
    if method == "int8_weight_only":
        step = weight.abs().amax(dim=1, keepdim=True) / 127
    else:
        groups = weight.view(64, -1, INT4_GROUP)
        step = ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    # half a step, plus the bfloat16 rounding of scales (and offsets) the codes were taken against
    assert ((expected_weight - weight).abs() <= step / 2 + weight.abs() / 128 + 1e-6).all()
    x, bias = torch.randn(3, 64), torch.randn(64)
    expected = x.bfloat16().float() @ expected_weight.t() + bias
    out = linear.apply(layer, x, bias)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, rtol=2e-2, atol=5e-2)


def test_bad_input_names_the_layout():
    linear, layer = Int4WeightOnlyLinear(), torch.nn.Module()
    linear.create_weights(layer, 8, [4, 4], torch.bfloat16)
    with pytest.raises(ValueError, match=r"has shape \[5, 8\] .* expected a float \[4, 8\]"):
        linear.load(layer, "weight", torch.zeros(5, 8), 1)
    with pytest.raises(ValueError, match="expects only 'weight'"):
        linear.load(layer, "weight_scale", torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"inputs in groups of 32 and outputs in tiles of 16, got \[8, 8\]"):
        linear.process_weights_after_loading(layer)
    with pytest.raises(ValueError, match="int8_weight_only quantizes .* already quantized .*'gptq'"):
        Int8WeightOnlyMethod().get_config({"quant_method": "gptq"}, None)


def reference_model(path, method: str):
    """transformers on ``path`` with each decoder linear's weight as ``method`` stores it, its inputs
    and outputs rounded to bfloat16 (bfloat16 in, float32 accumulation, bfloat16 out)."""
    from transformers import AutoModelForCausalLM

    def to_bf16(tensor):
        return tensor.to(torch.bfloat16).to(tensor.dtype)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.weight.data = dequantized(method, module.weight.data)
            module.register_forward_pre_hook(lambda mod, args: tuple(to_bf16(a) for a in args))
            module.register_forward_hook(lambda mod, args, out: to_bf16(out))
    return model


# int4 also with compiled decode steps: the CPU platform's default, and the batch-1 fast path
@pytest.mark.parametrize("method, compiled", [("int8_weight_only", False), ("int4_weight_only", False),
                                              ("int4_weight_only", True)])
def test_engine_matches_transformers_with_the_dequantized_weights(method, compiled, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RUNTIME_CPU_COMPILE", "1" if compiled else "0")
    path = build_untokenized_model("llama", tmp_path_factory.mktemp("llama"))
    prompts = make_prompts()[:4]
    expected = hf_greedy(reference_model(path, method), prompts, NUM_NEW_TOKENS)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, quantization=method, enforce_eager=not compiled)
    layer = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.layers[0].mlp.gate_up_proj
    assert not hasattr(layer, "weight") and type(layer.quant_method).__name__.lower().startswith(method[:4])
    assert llm.llm_engine.engine_core.executor.worker.model_runner.model.lm_head.quant_method is None  # float32 logits
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, ((tokens, steps), out) in enumerate(zip(expected, outputs)):
        check_logprobs_close_until_divergence(tokens, steps, out.outputs[0].token_ids, out.outputs[0].logprobs,
                                              atol=LOGPROB_ATOL, label=f"{method} prompt {i}")
    graphs = llm.llm_engine.engine_core.executor.worker.model_runner.graphs
    if compiled:
        assert graphs.compiled is not None and sum(graphs.replay_counts.values()) >= NUM_NEW_TOKENS - 1
    else:
        assert graphs is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied and a tied output layer
@pytest.mark.parametrize("method", ["int8_weight_only", "int4_weight_only"])
def test_a_16_bit_model_computes_its_logits_with_int8_rows(arch, method, tmp_path_factory):
    """bfloat16 models: the output layer (tied: a copy of the embedding) holds int8 rows and its
    logits are the dequantized rows times the bfloat16 hidden state; the token lookup keeps the
    embedding as loaded."""
    path = build_untokenized_model(arch, tmp_path_factory.mktemp(arch))
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, quantization=method, enforce_eager=True)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    head = model.lm_head
    assert isinstance(head.quant_method, Int8WeightOnlyLinear) and not hasattr(head, "weight")
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.bfloat16
    source = embedding if model.tie_word_embeddings else None
    if source is not None:  # the copy is the embedding's weight quantized as any int8 layer's
        rows, scales = quantize_rows(source.data)
        assert torch.equal(head.int8_rows, rows) and torch.equal(head.row_scales, scales)
    hidden = torch.randn(3, embedding.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = hidden.float() @ (head.int8_rows.float() * head.row_scales.float()[:, None]).t()
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=2e-2, atol=2e-2)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("arch, method, dtype", [("llama", "int4_weight_only", "float32"),
                                                 ("llama", "int8_weight_only", "bfloat16"),
                                                 ("qwen2", "int4_weight_only", "bfloat16")])
def test_two_tensor_parallel_ranks_quantize_their_parts(arch, method, dtype, tmp_path_factory):
    """TP=2 worker processes: each rank quantizes its part of every layer (and, in 16-bit models, its
    vocabulary slice of the output layer; qwen2's is a copy of its embedding's). int4 groups of inputs
    never straddle the ranks, so the codes equal one worker's; int8 rows of o/down get a scale per
    rank. Logprobs stay close to one worker's until the first differing token."""
    path = build_untokenized_model(arch, tmp_path_factory.mktemp(arch))
    prompts = make_prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    runs = []
    for tp in (1, 2):
        llm = LLM(path, dtype=dtype, skip_tokenizer_init=True, quantization=method, enforce_eager=True,
                  tensor_parallel_size=tp)
        runs.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        llm.llm_engine.engine_core.shutdown()
        del llm
    # The kernels compute in bfloat16 (COMPUTE_DTYPE): each rank's partial product of o/down is rounded
    # to it before the sum, one more rounding than one worker's.
    atol = 3 * LOGPROB_ATOL if dtype == "float32" else 0.1
    for i, (one, two) in enumerate(zip(*runs)):
        steps = [{token: lp.logprob for token, lp in step.items()} for step in one.logprobs]
        check_logprobs_close_until_divergence(one.token_ids, steps, two.token_ids, two.logprobs, atol=atol,
                                              label=f"{method} {dtype} tp=2 vs tp=1, prompt {i}")

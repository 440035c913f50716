"""GPTQ, AWQ and compressed-tensors ``pack-quantized`` models against a dequantized reference.

Each checkpoint is written in its project's published layout by an independent packer
(:mod:`wna16_checkpoints`); the reference is transformers' model with the same weights
dequantized to float32. Weight-only layers compute in float32 on both sides (only the
summation order differs), so logits agree to ~1e-5 and greedy tokens are identical.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from support.paged_batch import PagedRunner
from test_quant_parity import check_paged_logits, load_quantized
from wna16_checkpoints import (
    dequantized_reference,
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_pack_quantized_checkpoint,
)

from runtime import LLM, SamplingParams
from runtime.model_loader import load_model, resolve_model
from runtime.quantization import build_quant_config
from runtime.testing.reference import check_outputs_equal, hf_greedy, make_prompts

LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 8

CASES = {
    "gptq_4bit_g32_asym": lambda src, dst: write_gptq_checkpoint(src, dst, 4, 32, symmetric=False),
    "gptq_4bit_g64_act_order": lambda src, dst: write_gptq_checkpoint(src, dst, 4, 64, act_order=True),
    "gptq_4bit_g128_v2": lambda src, dst: write_gptq_checkpoint(src, dst, 4, 128, checkpoint_format="gptq_v2"),
    "gptq_4bit_channel_act_order": lambda src, dst: write_gptq_checkpoint(src, dst, 4, -1, False, act_order=True),
    "gptq_8bit_g32_act_order": lambda src, dst: write_gptq_checkpoint(src, dst, 8, 32, False, act_order=True),
    "gptq_8bit_channel": lambda src, dst: write_gptq_checkpoint(src, dst, 8, -1),
    "awq_g32": lambda src, dst: write_awq_checkpoint(src, dst, 32),
    "awq_g64": lambda src, dst: write_awq_checkpoint(src, dst, 64),
    # groups longer than q/k/v and gate/up's 64 inputs: one (short) group, as AutoAWQ / AutoGPTQ write it
    "awq_g128": lambda src, dst: write_awq_checkpoint(src, dst, 128),
    "gptq_8bit_g256_act_order": lambda src, dst: write_gptq_checkpoint(src, dst, 8, 256, act_order=True),
    "ct_w4a16_g32": lambda src, dst: write_pack_quantized_checkpoint(src, dst, 4, 32, symmetric=True),
    "ct_w4a16_asym_g32": lambda src, dst: write_pack_quantized_checkpoint(src, dst, 4, 32, symmetric=False),
    "ct_w8a16_channel": lambda src, dst: write_pack_quantized_checkpoint(src, dst, 8, None, symmetric=True),
}
LOGITS_CASES = [("llama", c) for c in CASES] + [
    ("qwen2", "gptq_4bit_g32_asym"), ("qwen3", "awq_g32"), ("gemma3", "ct_w4a16_asym_g32"),
    ("qwen2", "gptq_8bit_g32_act_order"),
]
GREEDY_CASES = [("llama", "gptq_4bit_g64_act_order"), ("qwen2", "awq_g64"), ("qwen3", "ct_w4a16_g32")]


def make_case(float_checkpoints, tmp_path, arch: str, name: str):
    src = float_checkpoints(arch)
    path, real = CASES[name](src, str(tmp_path / "quantized"))
    return f"{arch}/{name}", path, dequantized_reference(src, real), real


@pytest.mark.parametrize("arch,name", LOGITS_CASES)
@torch.no_grad()
def test_logits_match_dequantized_reference(float_checkpoints, tmp_path, arch, name):
    label, path, reference, real = make_case(float_checkpoints, tmp_path, arch, name)
    ours = load_quantized(path, None)
    layers = [m for m in ours.modules() if getattr(m, "quant_method", None) is not None]
    assert len(layers) == 4 * ours.config.num_hidden_layers, f"{label}: not every projection was quantized"
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and p.shape[0] > 1 for m in layers
                   for n, p in m.named_parameters() if n not in ("scales", "scales_and_zeros")), "weights unpacked"
    check_paged_logits(ours, reference, label, LOGITS_ATOL)


@pytest.mark.parametrize("arch,name", GREEDY_CASES)
def test_greedy_tokens_match_dequantized_reference(float_checkpoints, tmp_path, arch, name):
    label, path, reference, _ = make_case(float_checkpoints, tmp_path, arch, name)
    prompts = make_prompts()[:3]
    expected = hf_greedy(reference, prompts, NUM_NEW_TOKENS)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
    del llm
    gc.collect()


def test_quantization_really_changes_the_weights(float_checkpoints, tmp_path):
    """The reference is not the float model: 4-bit rounding moves every weight matrix."""
    from safetensors.torch import load_file

    src = float_checkpoints("llama")
    _, real = CASES["gptq_4bit_g32_asym"](src, str(tmp_path / "q"))
    state = load_file(f"{src}/model.safetensors")
    for prefix, w in real.items():
        err = (w - state[f"{prefix}.weight"]).abs()
        scale = state[f"{prefix}.weight"].abs().amax()
        assert 0 < err.max() <= scale / 15 + 1e-6, prefix  # within one 4-bit step of a group, never zero


@torch.no_grad()
def test_bf16_model_runs_on_torch_int4_tiles(float_checkpoints, tmp_path):
    """A bfloat16 model takes torch's int4 CPU kernel (weights stay packed); its logits stay
    within bf16 rounding of the float32 dequantized reference."""
    label, path, reference, _ = make_case(float_checkpoints, tmp_path, "llama", "gptq_4bit_g32_asym")
    resolved = resolve_model(path)
    config = build_quant_config(SimpleNamespace(quantization="gptq", hf_config=resolved.hf_config))
    ours = load_model(resolved, dtype=torch.bfloat16, quant_config=config)
    kernels = {m.quant_kernel.name for m in ours.modules() if getattr(m, "quant_method", None) is not None}
    assert kernels == {"int4pack_mm"}
    assert not any(n.endswith("qweight") for n, _ in ours.named_parameters())  # replaced by the int4 tiles
    prompt = make_prompts()[0]
    logits = PagedRunner(ours, num_requests=1, block_size=4, seed=3).step([prompt])[0].float()
    expected = reference(torch.tensor([prompt])).logits[0]
    # bf16 activations and sums: measured 0.03 on logits of magnitude ~3
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0, msg=label)

"""Models built with runtime_kernels' fused ops compute what the plain-torch models compute.

Both models load the same tiny random checkpoint; the fused one is built inside
``custom_ops_scope`` with the Triton kernels (run by Triton's CPU interpreter unless a
GPU compiles them). Steps mix prefills, prefill chunks that continue from the paged
cache and decodes, and the final hidden states are compared in float32.
"""

from __future__ import annotations

import pytest
import torch
from support.counting import counted
from support.paged_batch import PagedRunner
from runtime.testing.models import build_untokenized_model

from runtime.model_loader import load_model, resolve_model
from runtime.models.ops import CUSTOM_OPS, custom_ops_scope

pytest.importorskip("triton")

ATOL = {"cpu": 1e-5, "cuda": 2e-5}  # float32; a few ulps apart (rsqrt vs 1/sqrt, FMA)
PROMPT_LENS = (3, 10)  # gemma3's window is 8: the longer prompt crosses it
SCHEDULE = ([1, 2], [1, 1])  # a decode with a prefill chunk, then two decodes
# Ops each architecture calls (Gemma 3's MLP is gelu-tanh, which has no fused op).
# gemv and the fused ops that end in one serve one-row steps in 16-bit dtypes only (tested on
# their own below and in test_models_one_row_fusion.py); top_k_top_p and argmax are the sampler's
# (tests/kernels/test_kernel_sampling.py) and apply_token_bitmask structured output's
# (tests/kernels/test_kernel_bitmask.py).
NOT_USED = {"gemv", "silu_and_mul_gemv", "rms_norm_gemv", "top_k_top_p", "argmax", "apply_token_bitmask"}
USED_OPS = {
    "llama": set(CUSTOM_OPS) - NOT_USED,
    "qwen3": set(CUSTOM_OPS) - NOT_USED,
    "gemma3": {"rms_norm", "fused_add_rms_norm", "rotary_embedding"},
}


def kernel_ops() -> dict:
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.norm import fused_add_rms_norm, rms_norm
    from runtime_kernels.rotary import rotary_embedding

    return {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "rotary_embedding": rotary_embedding,
        "silu_and_mul": silu_and_mul,
    }


def run_schedule(model, vocab_size: int, backend=None, cache_dtype=None, block_size=4) -> list[torch.Tensor]:
    """Final hidden states ``[num_tokens, hidden]`` of each step of the fixed schedule."""
    generator = torch.Generator().manual_seed(7)
    runner = PagedRunner(model, num_requests=len(PROMPT_LENS), block_size=block_size, seed=3, backend=backend,
                         cache_dtype=cache_dtype)
    steps = [[torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]]
    steps += [[torch.randint(0, vocab_size, (q,), generator=generator).tolist() for q in lens] for lens in SCHEDULE]
    return [runner.step_hidden(tokens).float().cpu() for tokens in steps]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_fused_model_matches_plain_model(arch, kernel_device, tmp_path):
    resolved = resolve_model(build_untokenized_model(arch, tmp_path))
    plain = load_model(resolved, dtype=torch.float32, device=kernel_device)
    calls: dict[str, int] = {}
    with custom_ops_scope(counted(kernel_ops(), calls)):
        fused = load_model(resolved, dtype=torch.float32, device=kernel_device)

    vocab_size = resolved.hf_config.vocab_size
    expected, got = run_schedule(plain, vocab_size), run_schedule(fused, vocab_size)
    assert set(calls) == USED_OPS[arch]
    for step, (want, have) in enumerate(zip(expected, got)):
        assert want.abs().max() > 0.5, "hidden states too small for the comparison to mean much"
        torch.testing.assert_close(have, want, atol=ATOL[kernel_device], rtol=0, msg=f"{arch} step {step}")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_rotary_fused_into_the_triton_cache_write(arch, kernel_device, tmp_path, monkeypatch):
    """Through the Triton attention backend, which rotates queries and keys as it stores them, a model computes the
    same hidden states, bit for bit, as when its layers rotate them first (a backend without ``fuses_rotary``)."""
    from runtime_kernels import attention_backend
    from runtime_kernels.attention_backend import TritonAttentionBackend

    class RotationApart(TritonAttentionBackend):
        fuses_rotary = False

    resolved = resolve_model(build_untokenized_model(arch, tmp_path))
    with custom_ops_scope(kernel_ops()):
        model = load_model(resolved, dtype=torch.float32, device=kernel_device)
    calls: dict[str, int] = {}
    monkeypatch.setattr(attention_backend, "rotary_reshape_and_cache",
                        counted({"fused": attention_backend.rotary_reshape_and_cache}, calls)["fused"])
    vocab_size = resolved.hf_config.vocab_size
    apart = run_schedule(model, vocab_size, RotationApart())
    assert calls == {}
    fused = run_schedule(model, vocab_size, TritonAttentionBackend())
    assert calls["fused"] == len(model.attention_specs()) * (1 + len(SCHEDULE))  # every layer, every step
    for step, (want, have) in enumerate(zip(apart, fused)):
        assert want.abs().max() > 0.5, "hidden states too small for the comparison to mean much"
        assert torch.equal(have, want), f"{arch} step {step}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp8_cache_with_slot_minor_values_through_the_triton_backend(arch, kernel_device, tmp_path):
    """By default the backend's write and attention keep an 8-bit cache's values slot-minor within each block, and a
    model computes the same hidden states as over the usual layout (RUNTIME_FP8_V_SLOT_MINOR=0)."""
    from runtime_kernels import attention_backend
    from runtime_kernels.attention_backend import TritonAttentionBackend

    class UsualValues(TritonAttentionBackend):
        slot_minor_values = False

    assert TritonAttentionBackend.slot_minor_values
    # the order the KV offload disk tier keeps apart
    assert TritonAttentionBackend().kv_block_layout(torch.float8_e4m3fn) == "values-slot-minor"
    assert TritonAttentionBackend().kv_block_layout(torch.bfloat16) == UsualValues().kv_block_layout(torch.float8_e4m3fn) == ""
    resolved = resolve_model(build_untokenized_model(arch, tmp_path))
    with custom_ops_scope(kernel_ops()):
        model = load_model(resolved, dtype=torch.float32, device=kernel_device)
    vocab_size = resolved.hf_config.vocab_size
    fp8 = torch.float8_e4m3fn
    usual = run_schedule(model, vocab_size, UsualValues(), fp8, block_size=16)
    views = []
    real_slot_minor = attention_backend.slot_minor

    def recording_slot_minor(cache):
        views.append(real_slot_minor(cache))
        return views[-1]

    attention_backend.slot_minor = recording_slot_minor
    try:
        minor = run_schedule(model, vocab_size, TritonAttentionBackend(), fp8, block_size=16)
    finally:
        attention_backend.slot_minor = real_slot_minor
    assert len(views) == len(model.attention_specs()) * (1 + len(SCHEDULE))  # every layer, every step
    for step, (want, have) in enumerate(zip(usual, minor)):
        assert want.abs().max() > 0.5, "hidden states too small for the comparison to mean much"
        torch.testing.assert_close(have, want, atol=ATOL[kernel_device], rtol=0, msg=f"{arch} step {step}")


def test_norm_kernel_without_fused_add(kernel_device, tmp_path):
    """A platform with ``rms_norm`` only: the residual add, rotary and MLP stay in torch."""
    resolved = resolve_model(build_untokenized_model("qwen3", tmp_path))
    plain = load_model(resolved, dtype=torch.float32, device=kernel_device)
    calls: dict[str, int] = {}
    ops = {"rms_norm": kernel_ops()["rms_norm"]}
    with custom_ops_scope(counted(ops, calls)):
        fused = load_model(resolved, dtype=torch.float32, device=kernel_device)

    vocab_size = resolved.hf_config.vocab_size
    for want, have in zip(run_schedule(plain, vocab_size), run_schedule(fused, vocab_size)):
        torch.testing.assert_close(have, want, atol=ATOL[kernel_device], rtol=0)
    assert set(calls) == {"rms_norm"}


def test_one_row_steps_use_gemv_in_bfloat16(kernel_device, tmp_path):
    """A batch-1 decode in bfloat16 runs every linear layer (and the logits) through gemv."""
    from runtime_kernels.gemv import gemv

    resolved = resolve_model(build_untokenized_model("llama", tmp_path))
    plain = load_model(resolved, dtype=torch.bfloat16, device=kernel_device)
    calls: dict[str, int] = {}
    with custom_ops_scope(counted({"gemv": gemv}, calls)):
        fused = load_model(resolved, dtype=torch.bfloat16, device=kernel_device)

    def decode(model) -> tuple[torch.Tensor, torch.Tensor]:
        runner = PagedRunner(model, num_requests=1, block_size=4, seed=3)
        runner.step_hidden([[5, 17, 99, 3]])  # the prompt: several rows, no gemv
        hidden = runner.step_hidden([[42]])  # one row
        return hidden.float().cpu(), model.compute_logits(hidden).cpu()

    (want_hidden, want_logits), (have_hidden, have_logits) = decode(plain), decode(fused)
    layers = resolved.hf_config.num_hidden_layers
    assert calls == {"gemv": 4 * layers + 1}  # qkv, o, gate_up, down per layer, and the logits
    torch.testing.assert_close(have_hidden, want_hidden, atol=0.05, rtol=0.02)
    torch.testing.assert_close(have_logits, want_logits, atol=0.05, rtol=0.02)

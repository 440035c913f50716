"""Quantized models against a dequantize-then-matmul transformers reference.

Every scheme is loaded from a checkpoint in its published layout (or quantized on load
from the float checkpoint) for every tiny architecture. The reference is transformers'
model with the same dequantized weights and the same 8-bit rounding of each quantized
layer's input (:func:`quant_checkpoints.reference_model`): our logits must be within
``LOGITS_ATOL`` of its logits, prefill and decode over a paged cache, and the engine's
greedy tokens identical to its greedy tokens.

Tolerance: both sides compute in float32, but not in the same order (``torch._int_mm``
accumulates in int32 and scales afterwards). An activation within float32 noise of an 8-bit
rounding boundary could round one way in our model and the other in the reference, one int8
step (amax / 127) or fp8 step (1/8 of the value), and move later logits by up to ~1e-1; the
logits check therefore has the reference quantize our inputs after checking they equal its
own within 1e-4 (``ForcedActivations``). They then agree to ~1e-6.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from quant_checkpoints import FP8, reference_model, write_compressed_tensors_checkpoint, write_fp8_checkpoint
from support.paged_batch import PagedRunner

from runtime import LLM, SamplingParams
from runtime.model_loader import load_model, resolve_model
from runtime.quantization import build_quant_config, select_quant_method
from runtime.testing.models import TINY_ARCHS
from runtime.testing.reference import check_outputs_equal, hf_greedy, make_prompts

LOGITS_ATOL = 2e-2
NUM_NEW_TOKENS = 12
BLOCK = [128, 128]

# name: (how to write the checkpoint (None: quantize on load), --quantization, reference activations, dtype, blocks)
CASES = {
    "fp8_static": (lambda src, dst: write_fp8_checkpoint(src, dst, "static"), None, "tensor", FP8, None),
    "fp8_dynamic": (lambda src, dst: write_fp8_checkpoint(src, dst, "dynamic"), None, "token", FP8, None),
    "fp8_block": (lambda src, dst: write_fp8_checkpoint(src, dst, "dynamic", BLOCK), None, "group", FP8, BLOCK),
    "fp8_online": (None, "fp8", "token", FP8, None),
    "int8_online": (None, "int8", "token", torch.int8, None),
    "ct_fp8_static": (lambda src, dst: write_compressed_tensors_checkpoint(src, dst, "FP8", ["lm_head"]), None,
                      "tensor", FP8, None),
    "ct_fp8_dynamic": (lambda src, dst: write_compressed_tensors_checkpoint(src, dst, "FP8_DYNAMIC", ["lm_head"]),
                       None, "token", FP8, None),
    # lm_head quantized too (not ignored): the logits come from the quantized head
    "ct_w8a8": (lambda src, dst: write_compressed_tensors_checkpoint(src, dst, "W8A8", []), None, "token",
                torch.int8, None),
}


# Logits: every case on llama (untied head: ct_w8a8 quantizes lm_head too), the main layouts on
# the others. Greedy tokens through the engine: each case once, two per architecture.
LOGITS_CASES = [("llama", c) for c in CASES] + [
    (arch, c) for arch in TINY_ARCHS[1:] for c in ("fp8_static", "fp8_block", "int8_online", "ct_w8a8")
]
GREEDY_CASES = [(TINY_ARCHS[i // 2], c) for i, c in enumerate(CASES)]


def make_case(float_checkpoints, tmp_path, arch: str, name: str):
    src = float_checkpoints(arch)
    write, quantization, act, dtype, block = CASES[name]
    path = write(src, str(tmp_path / "quantized")) if write else src
    reference = reference_model(src, act, dtype, quant_path=path if write else None, block=block)
    return f"{arch}/{name}", path, quantization, reference


def load_quantized(path: str, quantization: str | None):
    resolved = resolve_model(path)
    name = select_quant_method(quantization, resolved.hf_config)
    config = build_quant_config(SimpleNamespace(quantization=name, hf_config=resolved.hf_config))
    return load_model(resolved, dtype=torch.float32, quant_config=config)


@pytest.mark.parametrize("arch,name", LOGITS_CASES)
@torch.no_grad()
def test_logits_match_dequantized_reference(float_checkpoints, tmp_path, arch, name):
    label, path, quantization, reference = make_case(float_checkpoints, tmp_path, arch, name)
    ours = load_quantized(path, quantization)
    assert any(p.dtype in (FP8, torch.int8) for p in ours.parameters()), f"{label}: nothing was quantized"
    check_paged_logits(ours, reference, label, LOGITS_ATOL)


def check_paged_logits(ours, reference, label: str, atol: float) -> None:
    """Prefill of three prompts, then a decode step mixed with a two-token chunk, over a paged
    cache: each step's logits within ``atol`` of ``reference``'s over the whole sequence.

    The reference takes our rounding decisions (:class:`ForcedActivations`): at every quantized
    layer its input must equal ours within float32 noise, and it then quantizes our input, so
    an activation within noise of an 8-bit rounding boundary cannot round one way here and the
    other way there (one such flip early in a model moves its logits by up to ~1e-1).
    """
    prompts = make_prompts()[:3]
    runner = PagedRunner(ours, num_requests=len(prompts), block_size=4, seed=3)
    forced = ForcedActivations(reference, label)
    for prompt, logits in zip(prompts, forced.step(runner, prompts)):
        expected = forced.reference_logits(runner, prompts.index(prompt))
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0, msg=f"{label} prefill")
    new = [[7], [8, 9], [10]]  # a decode step mixed with a two-token chunk
    for i, logits in enumerate(forced.step(runner, new)):
        expected = forced.reference_logits(runner, i)[-len(new[i]) :]
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0, msg=f"{label} decode, request {i}")


class ForcedActivations:
    """Records our quantized layers' inputs per step (``runtime_quant.kernels.quantize_activations``)
    and feeds them to the reference's quantized layers in its place, checking they agree first.

    Our calls of a forward, in order, are the reference's distinct inputs of its quantized
    linears in order (q/k/v and gate/up share one input, as our fused projections do)."""

    def __init__(self, reference, label: str):
        self.reference, self.label = reference, label
        self.steps: list[list[torch.Tensor]] = []  # per step: each call's input [rows, in]
        self.where: dict[tuple[int, int], tuple[int, int]] = {}  # (request, position) -> (step, row)
        self.layers = [m for m in reference.modules() if isinstance(m, torch.nn.Linear) and m._forward_pre_hooks]

    def step(self, runner: PagedRunner, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        from runtime_quant import kernels

        calls: list[torch.Tensor] = []
        original = kernels.quantize_activations

        def record(x, scheme, input_scale):
            calls.append(x.detach().clone())
            return original(x, scheme, input_scale)

        row = 0
        for i, toks in enumerate(new_tokens):
            for p in range(len(runner.tokens[i]), len(runner.tokens[i]) + len(toks)):
                self.where[i, p] = (len(self.steps), row)
                row += 1
        kernels.quantize_activations = record
        try:
            logits = runner.step(new_tokens)
        finally:
            kernels.quantize_activations = original
        self.steps.append(calls)
        return logits

    def reference_logits(self, runner: PagedRunner, request: int) -> torch.Tensor:
        """The reference's logits ``[len, vocab]`` over request ``request``'s tokens so far."""
        tokens = runner.tokens[request]
        seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a reference input -> (it, kept alive; ours)

        def force(module, args):
            x = args[0]
            if id(x) not in seen:
                call = len(seen)
                ours = torch.stack([self.steps[s][call][r] for s, r in (self.where[request, p] for p in range(len(tokens)))])
                torch.testing.assert_close(x[0], ours, atol=1e-4, rtol=1e-4,
                                           msg=f"{self.label}: input of quantized call {call}, request {request}")
                seen[id(x)] = (x, ours[None])
            return (seen[id(x)][1],)

        hooks = [layer.register_forward_pre_hook(force, prepend=True) for layer in self.layers] if self.steps[0] else []
        try:
            logits = self.reference(torch.tensor([tokens])).logits[0]
        finally:
            for hook in hooks:
                hook.remove()
        assert not hooks or len(seen) == len(self.steps[0]), f"{self.label}: {len(self.steps[0])} quantized calls, reference {len(seen)}"
        return logits


@pytest.mark.parametrize("arch,name", GREEDY_CASES)
def test_greedy_tokens_match_dequantized_reference(float_checkpoints, tmp_path, arch, name):
    label, path, quantization, reference = make_case(float_checkpoints, tmp_path, arch, name)
    prompts = make_prompts()[:3]
    expected = hf_greedy(reference, prompts, NUM_NEW_TOKENS)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, quantization=quantization, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_outputs_equal([e[0] for e in expected], [o.outputs[0].token_ids for o in outputs], label)
    del llm
    gc.collect()

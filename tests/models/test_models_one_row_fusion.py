"""Batch-1 decode steps with the norms and the SiLU activation fused into the gemvs give the
logits of the unfused ops.

Two models load the same tiny random checkpoint in bfloat16, each built inside
``custom_ops_scope``: one offered the unfused ops (``gemv``, the norms, ``silu_and_mul``), the
other the same and ``rms_norm_gemv`` / ``silu_and_mul_gemv``. With the torch references as the
ops, a fused op is the very arithmetic of the ops it replaces, so the logits are bit-identical;
with the Triton kernels (the interpreter on the CPU) they agree within bfloat16 rounding (the
norm's mean square is summed in another order). Calls are counted: on a one-row step every norm
before q/k/v and gate/up fuses, and a SiLU MLP's activation goes with its norm and gate/up
(``rms_norm_gemv`` with ``gated``), or, without ``rms_norm_gemv``, into down; on longer steps none does.
"""

from __future__ import annotations

import pytest
import torch
from support.counting import counted
from support.paged_batch import PagedRunner

from runtime.model_loader import load_model, resolve_model
from runtime.models.ops import custom_ops_scope
from runtime.testing.models import build_untokenized_model

pytest.importorskip("triton")

from runtime_kernels import gemv as gemv_module  # noqa: E402
from runtime_kernels.activation import silu_and_mul_ref  # noqa: E402
from runtime_kernels.norm import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402

FUSED = ("rms_norm_gemv", "silu_and_mul_gemv")
COUNTED = (*FUSED, "rms_norm_gemv(gated)")
REFERENCE_OPS = {
    "gemv": gemv_module.gemv_ref,
    "rms_norm": rms_norm_ref,
    "fused_add_rms_norm": fused_add_rms_norm_ref,
    "silu_and_mul": silu_and_mul_ref,
    "rms_norm_gemv": gemv_module.rms_norm_gemv_ref,
    "silu_and_mul_gemv": gemv_module.silu_and_mul_gemv_ref,
}
NUM_LAYERS = {"llama": 2, "qwen2": 2, "qwen3": 2, "gemma3": 4}
PROMPT, DECODES = [5, 17, 99, 3], ([42], [7])


def kernel_ops() -> dict:
    from runtime_kernels.activation import silu_and_mul
    from runtime_kernels.norm import fused_add_rms_norm, rms_norm

    return {"gemv": gemv_module.gemv, "rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm,
            "silu_and_mul": silu_and_mul, "rms_norm_gemv": gemv_module.rms_norm_gemv,
            "silu_and_mul_gemv": gemv_module.silu_and_mul_gemv}


def build_pair(resolved, ops: dict, device) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, int]]:
    """(unfused model, fused model, the fused model's op calls)."""
    with custom_ops_scope({name: op for name, op in ops.items() if name not in FUSED}):
        unfused = load_model(resolved, dtype=torch.bfloat16, device=device)
    calls: dict[str, int] = {}
    with custom_ops_scope(counted(ops, calls)):
        fused = load_model(resolved, dtype=torch.bfloat16, device=device)
    return unfused, fused, calls


def run_steps(model, calls: dict[str, int] | None = None) -> list[torch.Tensor]:
    """Logits of a 4-token prompt, then of two one-token decodes, then of two requests decoding
    together; with ``calls``, the fused ops' counts of each step (a dict per step) instead."""
    runner = PagedRunner(model, num_requests=2, block_size=4, seed=3)
    steps = [[PROMPT, [8]], [DECODES[0], []], [DECODES[1], []], [[11], [12]]]
    results = []
    for tokens in steps:
        before = dict(calls or {})
        logits = torch.cat(runner.step(tokens)).float().cpu()
        results.append(logits if calls is None else {n: calls.get(n, 0) - before.get(n, 0) for n in COUNTED})
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("offered", ["both", "silu_and_mul_gemv"])
def test_reference_fused_ops_give_identical_logits(arch, offered, tmp_path):
    resolved = resolve_model(build_untokenized_model(arch, tmp_path))
    ops = REFERENCE_OPS if offered == "both" else {n: op for n, op in REFERENCE_OPS.items() if n != "rms_norm_gemv"}
    unfused, fused, calls = build_pair(resolved, ops, "cpu")
    for step, (want, have) in enumerate(zip(run_steps(unfused), run_steps(fused))):
        assert torch.equal(have, want), f"{arch} step {step}"

    layers = NUM_LAYERS[arch]
    silu = 0 if arch == "gemma3" else layers  # Gemma's gelu-tanh MLP has no fused op
    if offered == "both":  # the SiLU with the norm and gate/up, down plain
        one_row = {"rms_norm_gemv": 2 * layers, "silu_and_mul_gemv": 0, "rms_norm_gemv(gated)": silu}
    else:  # the norms apart, the SiLU into down
        one_row = {"rms_norm_gemv": 0, "silu_and_mul_gemv": silu, "rms_norm_gemv(gated)": 0}
    none = dict.fromkeys(COUNTED, 0)
    calls.clear()
    assert run_steps(fused, calls) == [none, one_row, one_row, none]  # the prompt (5 rows) and 2 rows: unfused


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kernels_in_a_tiny_model(arch, kernel_device, tmp_path):
    """The Triton kernels themselves (interpreted on the CPU): bf16 logits of 4-7 within 0.05."""
    resolved = resolve_model(build_untokenized_model(arch, tmp_path))
    unfused, fused, calls = build_pair(resolved, kernel_ops(), kernel_device)
    for step, (want, have) in enumerate(zip(run_steps(unfused), run_steps(fused))):
        assert want.abs().max() > 1, "logits too small for the comparison to mean much"
        torch.testing.assert_close(have, want, atol=0.05, rtol=0.02, msg=lambda m: f"{arch} step {step}: {m}")
    layers = NUM_LAYERS[arch]
    assert calls["rms_norm_gemv"] == 2 * 2 * layers and calls["rms_norm_gemv(gated)"] == 2 * layers, calls
    assert "silu_and_mul_gemv" not in calls


class CountingAllReduce:
    """A stand-in platform for tensor parallelism in one process: the all-reduce returns its input."""

    def __init__(self):
        self.num_calls = 0

    def all_reduce(self, tensor, group):
        self.num_calls += 1
        return tensor


def test_tensor_parallel_ranks_fuse_their_parts(monkeypatch):
    """TP=2 run rank by rank in one process: each rank's post-attention norm fused into its part
    of gate/up and its SiLU fused into its part of down give exactly what its unfused ops give,
    rank 0 alone adds down's bias, and down's output goes through the all-reduce once."""
    from runtime.distributed import parallel_state
    from runtime.models.layers import MLP, RMSNorm, norm_into

    size, inter, dtype = 64, 96, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    whole = {name: (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype) for name, shape in
             [("gate", (inter, size)), ("up", (inter, size)), ("down", (size, inter)), ("bias", (size,)), ("norm", (size,))]}
    x, residual = (torch.randn(1, size, generator=g).to(dtype) for _ in range(2))

    def rank_output(rank: int, ops: dict, after_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        platform = CountingAllReduce()
        monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState(tp_rank=rank, tp_size=2, platform=platform))
        with custom_ops_scope(ops):
            norm, mlp = RMSNorm(size), MLP(size, inter, "silu", bias=True)
        with torch.no_grad():
            norm.weight.copy_(whole["norm"].float() + 1)
            mlp.gate_up_proj.bias.zero_()
            for shard in ("gate", "up"):
                mlp.gate_up_proj.load_shard("weight", shard, whole[shard].float())
            mlp.down_proj.load_param("weight", whole["down"].float())
            mlp.down_proj.load_param("bias", whole["bias"].float())
        norm.to(dtype), mlp.to(dtype)
        if after_norm:
            out, summed = mlp.after_norm(norm, x, residual)
            return out, summed, platform.num_calls
        gate_up, summed = norm_into(norm, mlp.gate_up_proj, x, residual)
        return mlp.down(gate_up), summed, platform.num_calls

    calls: dict[str, int] = {}
    unfused_ops = {n: op for n, op in REFERENCE_OPS.items() if n not in FUSED}
    parts = []
    for rank in (0, 1):
        want, want_summed, _ = rank_output(rank, unfused_ops)
        have, have_summed, num_reduces = rank_output(rank, counted(REFERENCE_OPS, calls))
        assert torch.equal(have, want) and torch.equal(have_summed, want_summed) and num_reduces == 1
        parts.append(have.float())
    assert calls["rms_norm_gemv"] == calls["silu_and_mul_gemv"] == 2
    normed = rms_norm_ref(x + residual, whole["norm"] + 1, 1e-6)
    gate, up = normed.float() @ whole["gate"].float().t(), normed.float() @ whole["up"].float().t()
    expected = (torch.nn.functional.silu(gate) * up) @ whole["down"].float().t() + whole["bias"].float()
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=0.05, rtol=0.02)  # the bias once

    # MLP.after_norm: each rank's norm, gate/up part and SiLU in one gated call, its down part plain
    calls.clear()
    for rank in (0, 1):
        want, want_summed, _ = rank_output(rank, unfused_ops)
        have, have_summed, num_reduces = rank_output(rank, counted(REFERENCE_OPS, calls), after_norm=True)
        assert torch.equal(have, want) and torch.equal(have_summed, want_summed) and num_reduces == 1
    assert calls["rms_norm_gemv(gated)"] == 2 and "silu_and_mul_gemv" not in calls, calls


class DenseStandInMethod:
    """A linear method over a dense weight (``layer.dense``) that, like the quant plugin's 4-bit one
    on a GPU, fuses the norm or the SiLU before its layer for up to ``max_rows`` rows; with the torch
    references as the arithmetic, fused and separate ops give identical results."""

    def __init__(self, max_rows: int, calls: list):
        self.max_rows, self.calls = max_rows, calls

    def apply(self, layer, x, bias=None):
        out = x.float() @ layer.dense.float().t()
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def apply_rms_norm(self, layer, x, residual, norm_weight, eps, gemma, bias=None):
        if x.shape[0] > self.max_rows:
            return None
        self.calls.append(("apply_rms_norm", bias is not None))
        summed = x if residual is None else x + residual
        return self.apply(layer, rms_norm_ref(summed, norm_weight, eps, gemma), bias), summed

    def apply_silu_and_mul(self, layer, x, bias=None):
        if x.shape[0] > self.max_rows:
            return None
        self.calls.append(("apply_silu_and_mul", bias is not None))
        return self.apply(layer, silu_and_mul_ref(x), bias)


class PlainStandInMethod(DenseStandInMethod):
    """The same method without the fused forms (as the methods that offer none)."""

    apply_rms_norm = apply_silu_and_mul = None


@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_layers_fuse_through_their_linear_method(rows, monkeypatch):
    """Where the platform's fused gemv does not run (here: no ``rms_norm_gemv`` / ``silu_and_mul_gemv``
    offered), a linear method's ``apply_rms_norm`` / ``apply_silu_and_mul`` take the norm and the SiLU
    (``Linear.quant_fused``): at TP=2 rank by rank, each rank's fused result equals its separate ops',
    down's bias reaches rank 0's method alone, down's output goes through the all-reduce once; a
    method that declines (3 rows here) or has no fused forms leaves the ops apart."""
    from runtime.distributed import parallel_state
    from runtime.models.layers import MLP, RMSNorm

    size, inter, dtype = 64, 96, torch.bfloat16
    g = torch.Generator().manual_seed(1)
    whole = {name: (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype) for name, shape in
             [("gate", (inter, size)), ("up", (inter, size)), ("down", (size, inter)), ("bias", (size,))]}
    norm_weight = (torch.randn(size, generator=g) * 0.1 + 1).to(dtype)
    x, residual = (torch.randn(rows, size, generator=g).to(dtype) for _ in range(2))

    def rank_output(rank: int, method: DenseStandInMethod):
        platform = CountingAllReduce()
        monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState(tp_rank=rank, tp_size=2, platform=platform))
        with custom_ops_scope({n: op for n, op in REFERENCE_OPS.items() if n not in FUSED}):
            norm, mlp = RMSNorm(size), MLP(size, inter, "silu", bias=True)
        half = inter // 2
        with torch.no_grad():
            norm.weight.data = norm_weight.clone()
            mlp.gate_up_proj.bias.data = torch.zeros(inter, dtype=dtype)
            mlp.down_proj.bias.data = whole["bias"].clone()
        mlp.gate_up_proj.dense = torch.cat([whole["gate"][rank * half:(rank + 1) * half],
                                            whole["up"][rank * half:(rank + 1) * half]])
        mlp.down_proj.dense = whole["down"][:, rank * half:(rank + 1) * half]
        mlp.gate_up_proj.quant_method = mlp.down_proj.quant_method = method
        out, summed = mlp.after_norm(norm, x, residual)  # as the models call it: no gated form here
        return out, summed, platform.num_calls

    for rank in (0, 1):
        calls: list = []
        want, want_summed, _ = rank_output(rank, PlainStandInMethod(4, []))
        have, have_summed, num_reduces = rank_output(rank, DenseStandInMethod(2, calls))
        assert torch.equal(have, want) and torch.equal(have_summed, want_summed) and num_reduces == 1
        fused = [("apply_rms_norm", True), ("apply_silu_and_mul", rank == 0)]  # gate_up's (zero) bias on both ranks
        assert calls == (fused if rows <= 2 else []), (rank, calls)

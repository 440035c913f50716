"""Matrix-vector product for batch-1 decode steps, with the op before it fused in or not, and references.

``gemv(x, weight, bias)`` computes ``F.linear(x, weight, bias)`` for ``x`` of one row
(``[1, K]`` or ``[K]``), accumulating in float32. A decode step of one sequence reads
every weight once and does little arithmetic, so its speed is the rate at which the
weights stream from memory; cuBLAS's general kernels leave some of that on the table for
a single row.

``silu_and_mul_gemv`` and ``rms_norm_gemv`` also compute the gated activation or the
(fused-add) RMSNorm that feeds the product, as they read its input, and ``rms_norm_gemv``
with ``gated`` the activation of a fused gate/up projection's product as it stores it, so that
a decode step of one sequence launches neither of those small kernels. On a GPU that measured slower
than the small launches (each program computes the prologue again), so there the norm and the
activation before the product run apart unless the CUDA GEMV takes them (see :func:`rms_norm_gemv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from runtime.envs import env_flag

from runtime_kernels.utils import cdiv, check_last_dim_contiguous, interpreting, require_triton

INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_K = 4, 64
SILU_AND_MUL, RMS_NORM = 1, 2  # the kernel's PROLOGUE
# 16-bit weights on a GPU: the norm / SiLU in the Triton gemv's programs rather than apart (slower; see rms_norm_gemv)
FUSED_PROLOGUES = env_flag("RUNTIME_GEMV_FUSED_PROLOGUES", False)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [1, K] or [K], ``weight`` [N, K], ``bias`` [N] -> ``x @ weight.T + bias`` shaped like ``x``'s rows.

    ``scale`` (float32 [N]): ``weight`` holds 8-bit codes (FP8) whose row ``i`` is worth
    ``weight[i] * scale[i]``; the product is the dequantized weight's, ``x`` not quantized.
    """
    vec = _one_row("gemv", x, weight.shape[1])
    return _launch(vec, weight, bias, scale).view(*x.shape[:-1], weight.shape[0])


def silu_and_mul_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``gemv(silu_and_mul(x), weight, bias, scale)`` in one launch: ``x`` [1, 2 * K] or [2 * K] =
    ``[gate | up]``, ``weight`` [N, K]; ``silu(gate) * up`` is rounded to ``x.dtype`` as
    :func:`runtime_kernels.activation.silu_and_mul` rounds it (two launches on a GPU, as
    :func:`rms_norm_gemv`'s norm)."""
    vec = _one_row("silu_and_mul_gemv", x, 2 * weight.shape[1])
    if _prologue_apart(vec, weight, bias, scale):
        from runtime_kernels.activation import silu_and_mul

        return _launch(silu_and_mul(vec), weight, bias, scale).view(*x.shape[:-1], weight.shape[0])
    return _launch(vec, weight, bias, scale, prologue=SILU_AND_MUL).view(*x.shape[:-1], weight.shape[0])


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gemma: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(norm, weight, bias, scale), s)`` in one launch, where ``s = x + residual`` (``x``
    without a residual) and ``norm`` is ``rms_norm(s, norm_weight, eps, gemma)``, both rounded
    as :mod:`runtime_kernels.norm` rounds them. ``x``, ``residual`` [1, K] or [K]; inputs untouched
    (``s`` is a new tensor, or ``x`` itself without a residual).

    ``gated``: ``weight`` [2 * N, K] holds a fused gate/up projection's rows ``[gate | up]`` (``bias``,
    ``scale`` [2 * N] likewise) and the first result is ``silu_and_mul`` of the product, [..., N]: each
    product rounded to ``x.dtype``, then ``silu(gate) * up`` rounded as :func:`runtime_kernels.activation.silu_and_mul`.

    On a GPU the norm is a launch of its own before the gemv, unless the CUDA GEMV runs them: the Triton
    gemv's programs each compute the norm, which costs more than the launch it saves (W3 a token, apart
    against fused: 3.63 against 3.92 ms with 8-bit weights on an H100, session 15; 4.20 against 4.43 ms in
    bf16 on an H200, session 27; benchmarks/RESULTS.md). ``RUNTIME_GEMV_FUSED_PROLOGUES=1`` fuses it for
    16-bit weights again.
    """
    k = weight.shape[1]
    vec = _one_row("rms_norm_gemv", x, k)
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight shape {tuple(norm_weight.shape)} does not match the {k} input features")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gated needs [gate | up] weight rows, an even number; got {weight.shape[0]}")
    rows = weight.shape[0] // 2 if gated else weight.shape[0]
    if _prologue_apart(vec, weight, bias, scale, gated):
        from runtime_kernels.norm import fused_add_rms_norm, rms_norm

        if residual is None:
            normed, summed = rms_norm(vec, norm_weight, eps, gemma=gemma), x
        else:
            normed, summed = fused_add_rms_norm(vec, residual.reshape(-1), norm_weight, eps, gemma=gemma)
            summed = summed.view(x.shape)
        return _launch(normed, weight, bias, scale, gated=gated).view(*x.shape[:-1], rows), summed
    norm = dict(norm_w_ptr=norm_weight, eps=float(eps), prologue=RMS_NORM, GEMMA=bool(gemma), gated=gated)
    if residual is None:
        return _launch(vec, weight, bias, scale, **norm).view(*x.shape[:-1], rows), x
    summed = torch.empty_like(vec)
    out = _launch(vec, weight, bias, scale, residual_ptr=residual.reshape(-1).contiguous(), residual_out_ptr=summed,
                  HAS_RESIDUAL=True, **norm)
    return out.view(*x.shape[:-1], rows), summed.view(x.shape)


def _prologue_apart(vec, weight, bias, scale, gated: bool = False) -> bool:
    """Whether the op before a one-row gemv of ``weight`` (the norm, the activation) runs as a launch of
    its own: on a GPU, unless the CUDA GEMV takes the call with its prologues (see :func:`rms_norm_gemv`)."""
    if vec.device.type != "cuda" or interpreting() or (FUSED_PROLOGUES and weight.element_size() != 1):
        return False
    return gated or not _cuda_prologues() or not _cuda_runs(vec, weight, bias, scale, {})


def _cuda_prologues() -> bool:
    from runtime_kernels import gemv_cuda

    return gemv_cuda.PROLOGUES


def _one_row(what: str, x: torch.Tensor, features: int) -> torch.Tensor:
    """``x``'s one row as a contiguous vector of ``features``."""
    require_triton(what)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] != 1:
        raise ValueError(f"{what} takes one row, got {rows.shape[0]}; use F.linear for batches")
    if rows.shape[1] != features:
        raise ValueError(f"x has {rows.shape[1]} features but {what} of this weight expects {features}")
    return rows[0].contiguous()


def _launch(vec, weight, bias, scale, prologue: int = 0, gated: bool = False, **prologue_args) -> torch.Tensor:
    """``out`` of the kernel with ``prologue`` (0: none) and its arguments (``prologue_args``): [N], or
    [N / 2] with the gated activation (``gated``)."""
    from runtime_kernels.jit import gemv as jit

    n, k = weight.shape
    if scale is not None and scale.shape != (n,):
        raise ValueError(f"scale must be one float32 per weight row, shape ({n},), got {tuple(scale.shape)}")
    check_last_dim_contiguous("weight", weight)
    if gated:  # the Triton kernel's own: its programs take rows n and n + N / 2
        n //= 2
        prologue_args["GATED"] = True
    out = torch.empty(n, dtype=vec.dtype, device=vec.device)
    if not gated and _cuda_runs(vec, weight, bias, scale, prologue_args):
        from runtime_kernels import gemv_cuda

        return gemv_cuda.gemv(vec, weight, bias, scale, out, prologue, prologue_args.get("residual_ptr"),
                              prologue_args.get("norm_w_ptr"), prologue_args.get("residual_out_ptr"),
                              prologue_args.get("eps", 0.0), prologue_args.get("GEMMA", False))
    has_bias, has_scale = bias is not None, scale is not None
    args = (vec, weight, scale if has_scale else out, bias if has_bias else out, out, n, k, weight.stride(0))
    if prologue:
        prologue_args["PROLOGUE"] = prologue  # left out otherwise: the plain launch is as it always was
    if interpreting():
        grid = (cdiv(n, INTERPRETER_BLOCK_N),)
        jit.gemv_kernel[grid](*args, HAS_SCALE=has_scale, HAS_BIAS=has_bias, BLOCK_N=INTERPRETER_BLOCK_N,
                              BLOCK_K=INTERPRETER_BLOCK_K, **prologue_args)
    else:
        is_8bit = weight.element_size() == 1
        if gated:
            tuned = jit.gemv_8bit_gated_kernel_tuned if is_8bit else jit.gemv_gated_kernel_tuned
        elif prologue:
            tuned = jit.gemv_8bit_prologue_kernel_tuned if is_8bit else jit.gemv_prologue_kernel_tuned
        else:
            tuned = jit.gemv_8bit_kernel_tuned if is_8bit else jit.gemv_kernel_tuned
        tuned[lambda meta: (cdiv(n, meta["BLOCK_N"]),)](*args, HAS_SCALE=has_scale, HAS_BIAS=has_bias, **prologue_args)
    return out


def _cuda_runs(vec, weight, bias, scale, prologue_args) -> bool:
    """Whether the CUDA GEMV (:mod:`runtime_kernels.gemv_cuda`) takes this call: on a GPU where it compiles,
    operands of the activations' dtype (float32 contiguous scales)."""
    if vec.device.type != "cuda" or interpreting():
        return False
    from runtime_kernels import gemv_cuda

    return (
        gemv_cuda.supports(vec, weight)
        and (scale is None or (scale.dtype == torch.float32 and scale.is_contiguous()))
        and gemv_cuda.operands_fit(vec, bias, prologue_args.get("residual_ptr"), prologue_args.get("norm_w_ptr"))
    )


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` in float32, rounded to ``x.dtype``; ``scale`` as :func:`gemv`'s (a dequantized weight)."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def silu_and_mul_gemv_ref(x, weight, bias=None, scale=None) -> torch.Tensor:
    from runtime_kernels.activation import silu_and_mul_ref

    return gemv_ref(silu_and_mul_ref(x), weight, bias, scale)


def rms_norm_gemv_ref(x, residual, norm_weight, eps, gemma, weight, bias=None, scale=None, gated=False):
    from runtime_kernels.activation import silu_and_mul_ref
    from runtime_kernels.norm import rms_norm_ref

    summed = x if residual is None else x + residual
    out = gemv_ref(rms_norm_ref(summed, norm_weight, eps, gemma), weight, bias, scale)
    return (silu_and_mul_ref(out) if gated else out), summed

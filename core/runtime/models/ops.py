"""Fused ops a platform offers the models, picked up once while a model is built.

A platform's :meth:`~runtime.platforms.Platform.custom_ops` returns a dict of fused
kernels by name. The model runner builds the model inside
``custom_ops_scope(platform.custom_ops())``; each module that has a fused form calls
:func:`lookup` in its ``__init__`` and keeps the op (or ``None``, meaning "use plain
torch"). Nothing is looked up while the model runs, so a forward pass is the same
Python code on every step (what CUDA graph capture needs).

The names and signatures a platform may provide (:data:`CUSTOM_OPS`):

* ``rms_norm(x, weight, eps, gemma=False) -> out``: ``x`` [..., hidden]; the mean square
  in float32; Llama rounds the normalized value to ``x.dtype`` then scales by
  ``weight``; ``gemma=True`` scales by ``1 + weight`` in float32 and rounds once.
* ``fused_add_rms_norm(x, residual, weight, eps, gemma=False) -> (out, x + residual)``:
  the sum rounded to ``x.dtype``, then normalized as ``rms_norm``; inputs untouched.
* ``rotary_embedding(positions, query, key, cos_sin_cache) -> (query, key)``: rotates
  ``query`` [T, heads, head_size] and ``key`` [T, kv_heads, head_size] in place (NeoX
  "rotate half" layout); ``cos_sin_cache`` is [max_position, head_size] float32 with the
  cosines of each position's angles in the first half and the sines in the second.
* ``silu_and_mul(x) -> out``: ``x`` [..., 2 * d] = ``[gate | up]`` -> ``silu(gate) * up``.
* ``gemv(x, weight, bias=None) -> out``: ``F.linear`` for one row ``x`` [1, K]
  (batch-1 decode steps), accumulating in float32; linear layers use it for one-row
  inputs in 16-bit dtypes and cuBLAS otherwise.
* ``silu_and_mul_gemv(x, weight, bias=None, scale=None) -> out``: ``gemv(silu_and_mul(x),
  weight, bias)`` in one kernel for one row ``x`` [1, 2 * K] = ``[gate | up]``, ``weight``
  [N, K]; ``silu(gate) * up`` rounded to ``x.dtype`` as ``silu_and_mul``. ``scale`` (float32
  [N]): ``weight`` holds FP8 codes, row ``i`` worth ``weight[i] * scale[i]``.
* ``rms_norm_gemv(x, residual, norm_weight, eps, gemma, weight, bias=None, scale=None, gated=False) ->
  (out, s)``: ``s = x + residual`` (``x`` itself when ``residual`` is None) and ``out =
  gemv(rms_norm(s, norm_weight, eps, gemma), weight, bias)`` in one kernel for one row ``x``
  [1, K], rounded as ``fused_add_rms_norm``; ``scale`` as above. Inputs untouched. With
  ``gated``, ``weight`` [2 * N, K] is a fused ``[gate | up]`` projection (``bias``, ``scale``
  [2 * N]) and ``out`` [1, N] is ``silu_and_mul`` of that product, each half rounded to
  ``x.dtype`` first.

  Both serve batch-1 decode steps: a norm (:meth:`~runtime.models.layers.RMSNorm.fused_into`)
  or the SiLU MLP activation (:meth:`~runtime.models.layers.SiluAndMul.fused_into`) uses one
  in place of itself and the linear layer after it only where that layer would have run the
  one-row ``gemv`` kernel anyway (:meth:`~runtime.models.linear.Linear.gemv_operands`); a SiLU
  MLP after an RMSNorm takes the norm, gate/up and the activation as one gated call
  (:meth:`~runtime.models.layers.MLP.after_norm`). A platform may run an op as two launches
  where its fused kernel would be slower for the weights given.
* ``top_k_top_p(logits, top_k, top_p, max_top_k) -> logits``: the sampler's top-k then
  top-p filters (filtered logits at -inf, a new tensor) for batches where every row that
  top-p filters also has a top-k (``top_p`` may be ``None``); no host sync. The sampler
  picks it up when it is built inside the scope and keeps its sort otherwise.
* ``argmax(logits) -> token_ids``: ``logits.argmax(dim=1)`` of ``[N, V]`` float32 logits, exactly (the
  first of equal maxima; a NaN counts as the largest), for the sampler's greedy rows.
* ``apply_token_bitmask(logits, bitmask, rows=None, slots=None) -> logits``: structured output's
  mask, in place, with :func:`runtime.sample.bitmask.apply_token_bitmask`'s contract (a packed
  int32 bitmask on any device; logits row ``rows[i]`` takes bitmask row ``i``, or with ``slots``
  table row ``slots[i]``). An op without the ``slots`` parameter is given dense bitmasks.

Names outside :data:`CUSTOM_OPS` are ignored, so a platform may offer ops that only
newer models use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

logger = logging.getLogger(__name__)

CUSTOM_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gemv", "top_k_top_p",
              "apply_token_bitmask", "silu_and_mul_gemv", "rms_norm_gemv", "argmax")

_current_ops: ContextVar[Mapping[str, Callable]] = ContextVar("runtime_custom_ops", default={})


@contextmanager
def custom_ops_scope(ops: Mapping[str, Callable]) -> Iterator[None]:
    """Make ``ops`` the fused ops that modules built inside this block pick up.

    Unknown names are ignored; a known name bound to something not callable is a
    ``ValueError``. Scopes nest; leaving one restores the outer ops.
    """
    known: dict[str, Callable] = {}
    for name, op in ops.items():
        if name not in CUSTOM_OPS:
            logger.debug("ignoring custom op %r: models use only %s", name, ", ".join(CUSTOM_OPS))
            continue
        if not callable(op):
            raise ValueError(f"custom op {name!r} must be callable, got {type(op).__name__}")
        known[name] = op
    token = _current_ops.set(known)
    try:
        yield
    finally:
        _current_ops.reset(token)


def lookup(name: str) -> Callable | None:
    """The fused op ``name`` of the current scope, or ``None`` (no scope, or not offered)."""
    if name not in CUSTOM_OPS:
        raise ValueError(f"unknown custom op {name!r}; known: {', '.join(CUSTOM_OPS)}")
    return _current_ops.get().get(name)

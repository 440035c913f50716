"""The linear method of weight-only 4/8-bit layers: GPTQ, AWQ and compressed-tensors ``pack-quantized``.

Before :meth:`WNA16LinearMethod.process_weights_after_loading` a layer holds its checkpoint's
tensors under their checkpoint names, fused projections side by side (GPTQ/AWQ pack their
output columns, compressed-tensors its output rows). Afterwards every layout is the same
canonical one (:mod:`runtime_quant.wna16_kernels`): ``qweight`` int32 [in / pack, out]
(GPTQ's packing), ``scales`` float32 [groups, out], ``zeros`` uint8 [groups, out] and, with
act-order, ``perm`` [in] (the input columns in group order); then the chosen kernel may
repack them once more for its own use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime_quant import wna16_gpu
from runtime_quant.packing import awq_to_sequential, pack, unpack
from runtime_quant.wna16_kernels import select_wna16_kernel
from runtime_quant.wna16_scheme import WNA16Scheme

INT = "int32"
FLOAT = "float"  # any floating dtype (float16, bfloat16, float32): stored as float32


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor of a layer: dtype kind, stacked shape, how shards split it, and how
    tensor parallelism splits it along the input (row-parallel layers)."""

    kind: str  # INT or FLOAT
    shape: tuple[int, ...]
    dim: int  # the dimension fused projections are stacked along (the output features)
    unit: int = 1  # output features per index along ``dim`` (codes per word when packed there)
    note: str = ""
    in_dim: int | None = None  # the dimension along the input features (None: not split along them)
    in_unit: int = 1  # input features per index along ``in_dim`` (codes per word, rows per group)


def _layout(s: WNA16Scheme, input_size: int, out: int, shards: int) -> dict[str, Tensor]:
    groups, p = s.groups(input_size), s.pack
    group_dim = None if s.group_size <= 0 else 0  # one group per output channel: not split along the input
    if s.layout == "gptq":
        tensors = {
            "qweight": Tensor(INT, (input_size // p, out), 1, note="[in / pack, out], packed along in", in_dim=0, in_unit=p),
            "qzeros": Tensor(INT, (groups, out // p), 1, p, "[groups, out / pack]", group_dim, s.group_size),
            "scales": Tensor(FLOAT, (groups, out), 1, note="[groups, out]", in_dim=group_dim, in_unit=s.group_size),
        }
        if s.act_order:
            tensors["g_idx"] = Tensor(INT, (shards, input_size), 0, note="[in]: each input row's group", in_dim=0)
        return tensors
    if s.layout == "awq":
        return {
            "qweight": Tensor(INT, (input_size, out // p), 1, p, "[in, out / 8], AWQ order", in_dim=0),
            "qzeros": Tensor(INT, (groups, out // p), 1, p, "[groups, out / 8], AWQ order", group_dim, s.group_size),
            "scales": Tensor(FLOAT, (groups, out), 1, note="[groups, out]", in_dim=group_dim, in_unit=s.group_size),
        }
    group_dim = None if group_dim is None else 1
    tensors = {
        "weight_packed": Tensor(INT, (out, input_size // p), 0, note="[out, in / pack]", in_dim=1, in_unit=p),
        "weight_scale": Tensor(FLOAT, (out, groups), 0, note="[out, groups]", in_dim=group_dim, in_unit=s.group_size),
    }
    if s.act_order:
        tensors["weight_g_idx"] = Tensor(INT, (shards, input_size), 0, note="[in]: each input column's group", in_dim=0)
    if not s.symmetric:
        tensors["weight_zero_point"] = Tensor(INT, (out // p, groups), 0, p, "[out / pack, groups], packed along out",
                                              group_dim, s.group_size)
    return tensors


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))


@dataclass(frozen=True)
class WNA16LinearMethod:
    """:class:`runtime.quantization.LinearMethod` for one :class:`WNA16Scheme` (stateless)."""

    scheme: WNA16Scheme

    # ------------------------------------------------------------ create
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        s = self.scheme
        packs_out = s.layout != "compressed-tensors" or not s.symmetric  # zero points (or codes) packed along out
        for size in output_sizes if packs_out else ():
            if size % s.pack:
                raise ValueError(f"{s.describe}: output size {size} is not a multiple of {s.pack} (codes per int32)")
        if input_size % s.pack:
            raise ValueError(f"{s.describe}: input size {input_size} is not a multiple of {s.pack} (codes per int32)")
        layer.quant_output_sizes = list(output_sizes)
        layer.quant_params_dtype = params_dtype
        for name, t in _layout(s, input_size, sum(output_sizes), len(output_sizes)).items():
            _param(layer, name, torch.empty(t.shape, dtype=torch.int32 if t.kind == INT else torch.float32))

    # ------------------------------------------------------------ load
    def load(self, layer: nn.Module, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        s = self.scheme
        shard = 0 if shard is None else shard
        sizes = layer.quant_output_sizes
        input_size = layer.in_features
        layout = _layout(s, input_size, sum(sizes), len(sizes))
        g_idx = name == s.g_idx_name
        if g_idx and not s.act_order:
            return  # groups in order (desc_act false): row k is in group k // group_size
        if name == "weight_shape" and s.layout == "compressed-tensors":
            whole = [int(v) for v in tensor.flatten()]
            local = [sizes[shard], input_size]
            # split over ranks: each dimension a multiple of this rank's part
            fits = whole == local or (layer.tp_size > 1 and len(whole) == 2 and all(w % n == 0 for w, n in zip(whole, local)))
            if not fits:
                raise ValueError(f"is {tensor.tolist()}, expected [{sizes[shard]}, {input_size}] ([out, in])")
            return
        if name not in layout:
            raise ValueError(f"is not part of {s.describe}; expected: {', '.join(layout)}")
        t = layout[name]
        param = getattr(layer, name)
        if g_idx:
            target = param[shard]
        else:
            offset = sum(sizes[:shard]) // t.unit
            target = param.narrow(t.dim, offset, sizes[shard] // t.unit)
        expected = f"{t.kind} {list(target.shape)} ({t.note})"
        if tensor.dim() != target.dim():  # before the rank's part is cut along dimensions it may lack
            raise ValueError(f"has shape {list(tensor.shape)}, expected {expected}")
        whole = tensor
        tensor = layer.rank_part(tensor, shard, None if g_idx else t.dim, t.unit, t.in_dim, t.in_unit)
        if g_idx and tensor.shape != whole.shape:
            raise ValueError(f"({s.describe}) orders the input rows by group (act-order), so the layer cannot be split "
                             f"along its input over {layer.tp_size} ranks; use tensor_parallel_size 1 or a checkpoint "
                             "without desc_act")
        if list(tensor.shape) != list(target.shape):
            raise ValueError(f"has shape {list(tensor.shape)}, expected {expected}")
        kind_ok = tensor.dtype.is_floating_point if t.kind == FLOAT else tensor.dtype in (torch.int32, torch.int64)
        if not kind_ok or (not g_idx and t.kind == INT and tensor.dtype != torch.int32):
            raise ValueError(f"has dtype {str(tensor.dtype).removeprefix('torch.')}, expected {expected}")
        target.copy_(tensor)

    # ------------------------------------------------------------ repack
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Bring the checkpoint's layout to the canonical one; let the kernel repack it."""
        s = self.scheme
        input_size, out = layer.in_features, sum(layer.quant_output_sizes)
        codes, zeros, scales = self._unpacked(layer, input_size, out)  # [in, out] x2, [groups, out]
        perm = self._group_order(layer, input_size) if s.act_order else None
        for name in _layout(s, input_size, out, len(layer.quant_output_sizes)):
            delattr(layer, name)
        if perm is not None:
            codes = codes.index_select(0, perm)
            _param(layer, "perm", perm)
        _param(layer, "qweight", pack(codes, s.bits, dim=0))
        _param(layer, "scales", scales.contiguous())
        _param(layer, "zeros", zeros.contiguous())
        layer.quant_group_rows = s.rows_per_group(input_size)
        layer.quant_bits = s.bits
        kernel = select_wna16_kernel(s, layer)
        kernel.prepare(layer)
        layer.quant_kernel = kernel

    def _unpacked(self, layer: nn.Module, input_size: int, out: int):
        s = self.scheme
        mask = (1 << s.bits) - 1
        if s.layout == "gptq":
            codes = unpack(layer.qweight.data, s.bits, dim=0)
            zeros = (unpack(layer.qzeros.data, s.bits, dim=1).int() + s.zero_offset) & mask
            scales = layer.scales.data
        elif s.layout == "awq":
            codes = awq_to_sequential(unpack(layer.qweight.data, s.bits, dim=1))
            zeros = awq_to_sequential(unpack(layer.qzeros.data, s.bits, dim=1))
            scales = layer.scales.data
        else:
            codes = unpack(layer.weight_packed.data, s.bits, dim=1).t()
            scales = layer.weight_scale.data.t()
            if s.symmetric:
                zeros = torch.full_like(scales, s.midpoint, dtype=torch.uint8)
            else:
                zeros = unpack(layer.weight_zero_point.data, s.bits, dim=0).t()
        return codes, zeros.to(torch.uint8), scales.float()

    def _group_order(self, layer: nn.Module, input_size: int) -> torch.Tensor:
        """The permutation that brings act-ordered input rows into contiguous groups."""
        g_idx = getattr(layer, self.scheme.g_idx_name).data.long()  # [shards, in]
        if not bool((g_idx == g_idx[:1]).all()):
            raise ValueError(
                f"{self.scheme.describe}: the projections fused into this layer have different g_idx; "
                "fused act-order layers need one input order"
            )
        groups = self.scheme.groups(input_size)
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"{self.scheme.describe}: g_idx holds groups from {int(g_idx.min())} to {int(g_idx.max())}; "
                             f"expected 0 .. {groups - 1} ({input_size} input rows)")
        perm = torch.argsort(g_idx[0], stable=True)
        expected = torch.arange(input_size, device=perm.device) // self.scheme.rows_per_group(input_size)
        if not torch.equal(g_idx[0][perm], expected):
            raise ValueError(
                f"{self.scheme.describe}: g_idx does not give every group {self.scheme.group_size} rows "
                f"(group sizes {torch.bincount(g_idx[0]).tolist()[:8]}...)"
            )
        return perm

    # ------------------------------------------------------------ compute
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out] in x's dtype
        perm = getattr(layer, "perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return layer.quant_kernel.run(layer, x, bias)

    # The op before the layer fused into its decode GEMV (see runtime.quantization.LinearMethod): on a
    # GPU, 4-bit layers of up to 4 rows without act-order; None elsewhere (the ops run apart).
    def _fuses(self, layer: nn.Module) -> bool:
        return getattr(layer, "perm", None) is None and layer.quant_kernel.name == "triton_wna16"

    def apply_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float, gemma: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._fuses(layer):
            return None
        return wna16_gpu.rms_norm_gemv(layer, self.scheme.bits, x, residual, norm_weight, eps, gemma, bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        if not self._fuses(layer):
            return None
        return wna16_gpu.silu_and_mul_gemv(layer, self.scheme.bits, x, bias)

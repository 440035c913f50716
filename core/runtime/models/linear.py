"""Linear layers and embeddings, whole or split across the tensor-parallel ranks.

Column-parallel layers keep ``1/tp`` of the output rows (their output stays split);
row-parallel layers keep ``1/tp`` of the input columns and sum their outputs over the
ranks (one all-reduce). The vocabulary of the embedding and the LM head is split in
rows too, padded to a multiple of ``tp``. Each layer's :meth:`load_param` takes the whole
checkpoint tensor and copies in the rank's part, so any weight source (safetensors,
dequantized GGUF) loads unchanged. With one rank every layer is the plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import tp_all_reduce, tp_rank, tp_size
from runtime.models.ops import lookup


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head: 1, or ``tp / num_kv_heads`` when there are fewer heads than ranks."""
    if tp <= num_kv_heads:
        divide(num_kv_heads, tp, "the number of KV heads")
        return 1
    return divide(tp, num_kv_heads, "the tensor-parallel size, above the number of KV heads,")


def one_row_linear(gemv):
    """``F.linear``, with ``gemv`` (if given) for one-row inputs in 16-bit dtypes."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if gemv is not None and x.shape[0] == 1 and x.dtype != torch.float32:
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    return linear


def copy_part(param: torch.Tensor, tensor: torch.Tensor, expected: tuple[int, ...], dim: int, start: int) -> None:
    """Copy ``param.shape[dim]`` slices of the checkpoint's whole ``tensor`` (shape ``expected``) from ``start``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    param.data.copy_(tensor.narrow(dim, start, param.shape[dim]))


class Linear(nn.Linear):
    """``nn.Linear`` that uses the platform's one-row kernel (``gemv``) for batch-1 steps.

    A quantized layer (see :mod:`runtime.models.quantize`) has a ``quant_method``
    (:class:`runtime.quantization.LinearMethod`) that owns its weights and computes it.
    This one is whole on every rank (replicated).
    """

    quant_method = None  # runtime.quantization.LinearMethod of a quantized layer

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        gemv = lookup("gemv")
        self._linear = one_row_linear(gemv)
        self._has_gemv = gemv is not None
        self.tp_rank, self.tp_size = tp_rank(), tp_size()

    @property
    def output_sizes(self) -> list[int]:
        """The fused projections' sizes in row order (one entry when not fused)."""
        return [self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return self._linear(x, self.weight, self.bias)

    def rank_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (all of it: the layer is whole; :meth:`forward` reads ``self.bias``)."""
        return self.bias

    def reduce_output(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's product ``out`` (``out`` itself: the layer is whole;
        :meth:`forward` skips the call, a fused op's caller makes it)."""
        return out

    def gemv_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``(weight, bias, scale)`` that :meth:`forward` hands the one-row ``gemv`` kernel for an
        input of ``x``'s rows and dtype, or None where it takes another path.

        The gemv runs for one row in float16 or bfloat16, in an unquantized layer built where the
        platform offers ``gemv`` (``scale`` None), or in a quantized one whose linear method opts in
        with ``gemv_weights(layer, dtype) -> (weight, scale) | None`` (FP8 codes and float32 row
        scales; see :class:`runtime.quantization.LinearMethod`). A fused op that computes this
        layer's input as it reads it may then take the place of that gemv; the result goes through
        :meth:`reduce_output` as :meth:`forward`'s does. Only shapes and build-time state decide.
        """
        if x.shape[0] != 1 or x.dtype not in (torch.float16, torch.bfloat16):
            return None
        if self.quant_method is None:
            return (self.weight, self.rank_bias(), None) if self._has_gemv else None
        gemv_weights = getattr(self.quant_method, "gemv_weights", None)
        weights = None if gemv_weights is None else gemv_weights(self, x.dtype)
        return None if weights is None else (weights[0], self.rank_bias(), weights[1])

    def quant_fused(self, name: str, x: torch.Tensor, *args):
        """The linear method's fused form ``name`` of the op before this layer and the layer
        (``apply_rms_norm`` / ``apply_silu_and_mul``, see :class:`runtime.quantization.LinearMethod`)
        on ``x`` and ``args`` with this rank's bias, before :meth:`reduce_output`; None where the
        layer is not quantized, its method has no such form or does not run it for ``x``."""
        fused = None if self.quant_method is None else getattr(self.quant_method, name, None)
        return None if fused is None else fused(self, x, *args, self.rank_bias())

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of the checkpoint's whole ``tensor`` into ``param_name``."""
        param = getattr(self, param_name)
        copy_part(param, tensor, tuple(param.shape), 0, 0)

    def rank_part(self, tensor: torch.Tensor, shard: int | None = None, out_dim: int | None = None, out_unit: int = 1,
                  in_dim: int | None = None, in_unit: int = 1) -> torch.Tensor:
        """This rank's part of a checkpoint tensor of the layer (or of projection ``shard`` of a
        fused one) in a quantized layout, for its linear method: ``out_dim`` / ``in_dim`` are the
        tensor's dimensions along the output / input features (None: it does not span them),
        ``out_unit`` / ``in_unit`` the features per index there (codes per packed word, rows per
        group or block). The whole tensor on a replicated layer; raises ValueError naming the
        dimension when it cannot be split evenly."""
        return tensor

    def _split(self, tensor: torch.Tensor, dim: int | None, unit: int, rank_features: int, parts: int, index: int,
               what: str) -> torch.Tensor:
        if dim is None or parts == 1:
            return tensor
        if rank_features % unit:
            raise ValueError(f"cannot be split over {self.tp_size} ranks: each rank's {rank_features} {what} features "
                             f"are not a multiple of {unit} (the features per index of dimension {dim})")
        size = rank_features // unit
        if tensor.shape[dim] != size * parts:
            raise ValueError(f"has {tensor.shape[dim]} along dimension {dim}, expected {size * parts} "
                             f"({size * unit * parts} {what} features / {unit})")
        return tensor.narrow(dim, index * size, size)


class ColumnParallelLinear(Linear):
    """Each rank holds ``out_features / tp`` consecutive output rows; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, divide(out_features, tp_size(), "the output size"), bias)

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        rows = param.shape[0]
        copy_part(param, tensor, (rows * self.tp_size, *param.shape[1:]), 0, self.tp_rank * rows)

    def rank_part(self, tensor: torch.Tensor, shard: int | None = None, out_dim: int | None = None, out_unit: int = 1,
                  in_dim: int | None = None, in_unit: int = 1) -> torch.Tensor:
        return self._split(tensor, out_dim, out_unit, self.out_features, self.tp_size, self.tp_rank, "output")


class RowParallelLinear(Linear):
    """Each rank holds ``in_features / tp`` input columns; outputs are summed over the ranks.

    The input is the column-parallel output of the layer before (already split); the bias
    is added once, by rank 0, before the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(divide(in_features, tp_size(), "the input size"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        bias = self.rank_bias()
        if self.quant_method is not None:
            return self.reduce_output(self.quant_method.apply(self, x, bias))
        return self.reduce_output(self._linear(x, self.weight, bias))

    def rank_bias(self) -> torch.Tensor | None:
        """Rank 0's alone: the ranks' products of their input columns ``[T, in / tp]`` are summed."""
        return self.bias if self.tp_rank == 0 else None

    def reduce_output(self, out: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial products ``[T, out]`` (one all-reduce)."""
        return tp_all_reduce(out)

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        if param_name == "bias" or self.tp_size == 1:
            return super().load_param(param_name, tensor)
        cols = param.shape[1]
        copy_part(param, tensor, (param.shape[0], cols * self.tp_size), 1, self.tp_rank * cols)

    def rank_part(self, tensor: torch.Tensor, shard: int | None = None, out_dim: int | None = None, out_unit: int = 1,
                  in_dim: int | None = None, in_unit: int = 1) -> torch.Tensor:
        return self._split(tensor, in_dim, in_unit, self.in_features, self.tp_size, self.tp_rank, "input")


class MergedLinear(Linear):
    """Several column-parallel projections of the same input stored as one matrix, rows stacked.

    ``shard_sizes`` names each projection with its whole size (``{"q": ..., "k": ..., "v": ...}``)
    in row order; each rank keeps its part of every projection. ``replicas`` gives the
    projections whose parts are shared by several ranks (KV heads when there are fewer than
    ranks). Checkpoints keep the projections apart, and :meth:`load_shard` copies one in place.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, replicas: dict[str, int] | None = None):
        tp, rank = tp_size(), tp_rank()
        self.replicas = {shard: (replicas or {}).get(shard, 1) for shard in shard_sizes}
        sizes = {s: divide(size * self.replicas[s], tp, f"the size of projection {s!r}") for s, size in shard_sizes.items()}
        super().__init__(in_features, sum(sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.shard_index = {s: rank // self.replicas[s] for s in sizes}  # which part of the whole projection

    @property
    def output_sizes(self) -> list[int]:
        return [size for _, size in self.shard_offsets.values()]

    def load_shard(self, param_name: str, shard: str, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        offset, size = self.shard_offsets[shard]
        target = param.data.narrow(0, offset, size)
        num_parts = self.tp_size // self.replicas[shard]
        expected = (size * num_parts, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
        target.copy_(tensor.narrow(0, self.shard_index[shard] * size, size))

    def rank_part(self, tensor: torch.Tensor, shard: int | None = None, out_dim: int | None = None, out_unit: int = 1,
                  in_dim: int | None = None, in_unit: int = 1) -> torch.Tensor:
        name = list(self.shard_offsets)[shard or 0]
        _, size = self.shard_offsets[name]
        return self._split(tensor, out_dim, out_unit, size, self.tp_size // self.replicas[name], self.shard_index[name],
                           f"{name!r} output")


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """``(first row, rows per rank)`` of this rank's part of a vocabulary padded to a multiple of tp."""
    rows = -(-vocab_size // tp_size())
    return tp_rank() * rows, rows


def load_vocab_rows(param: torch.Tensor, tensor: torch.Tensor, start: int, vocab_size: int) -> None:
    """Copy rows ``start..`` of the checkpoint's ``[vocab, hidden]`` tensor; padding rows get zeros."""
    expected = (vocab_size, param.shape[1])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
    count = max(0, min(param.shape[0], vocab_size - start))
    param.data[:count].copy_(tensor.narrow(0, start, count))
    param.data[count:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings, each rank holding a slice of the vocabulary; lookups are summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int):
        self.vocab_size = vocab_size
        self.vocab_start, rows = vocab_shard(vocab_size)
        super().__init__(rows, hidden_size)
        self.tp_size = tp_size()

    def reset_parameters(self) -> None:
        """Nothing: the weights come from the checkpoint (or the dummy init). ``nn.Embedding``'s
        random init on the meta device would import ``torch._dynamo``, seconds in a fresh worker."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        hidden = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return tp_all_reduce(hidden * mine.unsqueeze(-1).to(hidden.dtype))

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        load_vocab_rows(self.weight, tensor, self.vocab_start, self.vocab_size)


class ParallelLMHead(Linear):
    """The output projection, each rank holding the rows of its vocabulary slice (as the embedding)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.vocab_start, rows = vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, bias=False)

    def load_param(self, param_name: str, tensor: torch.Tensor) -> None:
        if self.tp_size == 1:
            return super().load_param(param_name, tensor)
        load_vocab_rows(self.weight, tensor, self.vocab_start, self.vocab_size)

    def rank_part(self, tensor: torch.Tensor, shard: int | None = None, out_dim: int | None = None, out_unit: int = 1,
                  in_dim: int | None = None, in_unit: int = 1) -> torch.Tensor:
        """This rank's vocabulary rows, zero past the vocabulary (the last slice is padded); a tensor
        that already has this rank's rows (a tied embedding's) is returned as it is."""
        if self.tp_size == 1 or out_dim is None:
            return tensor
        rows = self.out_features
        if out_unit != 1:
            raise ValueError(f"is part of an output layer packed {out_unit} rows an index, which is not split over "
                             f"{self.tp_size} ranks (its padded vocabulary slices); use tensor_parallel_size 1")
        if tensor.shape[out_dim] == rows:
            return tensor
        if tensor.shape[out_dim] != self.vocab_size:
            raise ValueError(f"has {tensor.shape[out_dim]} along dimension {out_dim}, expected the vocabulary's "
                             f"{self.vocab_size}")
        start = min(self.vocab_start, self.vocab_size)
        part = tensor.narrow(out_dim, start, min(rows, self.vocab_size - start))
        if part.shape[out_dim] == rows:
            return part
        pad = list(part.shape)
        pad[out_dim] = rows - part.shape[out_dim]
        return torch.cat([part, part.new_zeros(pad)], dim=out_dim)

"""What a weight-only 4/8-bit linear layer stores: GPTQ, AWQ and compressed-tensors ``pack-quantized``.

All three quantize each output column in groups of ``group_size`` input rows (or the whole
column): ``w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]`` with unsigned ``bits``-bit codes
``q``, zero points ``z`` (``2**(bits - 1)`` when symmetric) and scales ``s``. They differ in
how the codes are packed (:mod:`runtime_quant.packing`), in the zero points' conventions,
and GPTQ may order the groups by activation (``desc_act``: ``g_idx`` gives each input row
its group), as may compressed-tensors (``actorder: group``, its ``weight_g_idx``).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime_quant.packing import SUPPORTED_BITS

LAYOUTS = ("gptq", "awq", "compressed-tensors")
GROUP_SIZES = (-1, 16, 32, 64, 128, 256)
G_IDX_NAMES = {"gptq": "g_idx", "compressed-tensors": "weight_g_idx"}  # each input row's group, per layout  # -1: one group per column (per-channel scales)


def check_bits(what: str, bits) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what} {bits!r} is not supported; supported: {', '.join(map(str, SUPPORTED_BITS))}")


def check_group_size(what: str, group_size) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{what} {group_size!r} is not supported; supported: {', '.join(map(str, GROUP_SIZES))}")


@dataclass(frozen=True)
class WNA16Scheme:
    """``bits``-bit weights in groups of ``group_size`` input rows, 16/32-bit activations."""

    layout: str  # one of LAYOUTS: which tensors the checkpoint holds and how they are packed
    bits: int
    group_size: int  # -1: the whole input dimension is one group
    symmetric: bool  # no zero points: z = 2 ** (bits - 1)
    act_order: bool = False  # GPTQ desc_act (compressed-tensors actorder group): rows reach their groups by g_idx
    zero_offset: int = 0  # GPTQ's original format stores z - 1 (checkpoint_format "gptq"): 1

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}; supported: {', '.join(LAYOUTS)}")
        check_bits(f"{self.layout} bits", self.bits)
        check_group_size(f"{self.layout} group_size", self.group_size)
        if self.act_order and self.layout not in G_IDX_NAMES:
            raise ValueError(f"act-order (g_idx) is read for {' and '.join(G_IDX_NAMES)} checkpoints only, not {self.layout}")

    @property
    def g_idx_name(self) -> str | None:
        """The checkpoint's name of the tensor that gives each input row its group (act-order)."""
        return G_IDX_NAMES.get(self.layout)

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def midpoint(self) -> int:
        """The zero point of symmetric codes."""
        return 1 << (self.bits - 1)

    def groups(self, input_size: int) -> int:
        return 1 if self.group_size == -1 else -(-input_size // self.group_size)

    def rows_per_group(self, input_size: int) -> int:
        return input_size if self.group_size == -1 else self.group_size

    @property
    def describe(self) -> str:
        """``gptq 4-bit weights in groups of 128 (act-order), asymmetric`` (for error messages)."""
        groups = "per channel" if self.group_size == -1 else f"in groups of {self.group_size}"
        order = " (act-order)" if self.act_order else ""
        return f"{self.layout} {self.bits}-bit weights {groups}{order}, {'symmetric' if self.symmetric else 'asymmetric'}"

"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch.

Detection, the worker's device and the KV cache budget are the shared
:class:`runtime.platforms.gpu.GpuPlatform`'s: devices are counted through NVML
(``libnvidia-ml``, torch's ``_device_count_nvml``, which honours ``CUDA_VISIBLE_DEVICES``)
without initializing CUDA, or in a short-lived child process without NVML. What is
CUDA's own: the fused Triton ops the models use, CUDA graphs for decode steps, and the
tensor-parallel all-reduce: one-shot over CUDA IPC buffers for small messages on one host,
NCCL for the rest (:mod:`runtime_cuda.collectives`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from runtime.envs import env_flag

from runtime.platforms.gpu import GpuPlatform


class CudaPlatform(GpuPlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    label = "CUDA"
    torch_build = "cuda"
    count_hook = "_device_count_nvml"
    visible_devices_envs = ("CUDA_VISIBLE_DEVICES",)

    def __init__(self):
        self.one_shots: dict[int, Any] = {}  # id(process group) -> its OneShotAllReduce

    def is_torch_build(self) -> bool:
        return super().is_torch_build() and torch.version.hip is None  # not a ROCm build

    def custom_ops(self) -> dict[str, Callable]:
        """The fused Triton ops of ``runtime_kernels`` that the models use on this platform.

        The model runner builds the model inside ``custom_ops_scope`` of this dict, so
        the norms, the SiLU MLP activation and the rotary embedding run these kernels
        (see ``Platform.custom_ops`` for the names and signatures): ``rms_norm``,
        ``fused_add_rms_norm``, ``rotary_embedding`` (in place, from a cos/sin cache),
        ``silu_and_mul``, ``gemv`` (one-row linear layers of batch-1 decode steps) with
        ``silu_and_mul_gemv`` and ``rms_norm_gemv`` (the same with the activation or norm before
        the layer; on the GPU that op runs as a launch of its own, measured faster than in every
        gemv program, and gate/up's SiLU stays fused after it), and
        ``top_k_top_p`` for the sampler (top-p within top-k from one ``topk``, no sort), ``argmax``
        for its greedy rows (each row over many programs; RUNTIME_TRITON_ARGMAX=0: torch's) and
        ``apply_token_bitmask`` for structured output (one launch, no temporaries).
        """
        from runtime_kernels.activation import silu_and_mul
        from runtime_kernels.gemv import gemv, rms_norm_gemv, silu_and_mul_gemv
        from runtime_kernels.norm import fused_add_rms_norm, rms_norm
        from runtime_kernels.rotary import rotary_embedding
        from runtime_kernels.bitmask import apply_token_bitmask
        from runtime_kernels.sampling import argmax, top_k_top_p_bounded

        return {
            "rms_norm": rms_norm,
            "fused_add_rms_norm": fused_add_rms_norm,
            "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul,
            "gemv": gemv,
            "top_k_top_p": top_k_top_p_bounded,
            "apply_token_bitmask": apply_token_bitmask,
            "silu_and_mul_gemv": silu_and_mul_gemv,
            "rms_norm_gemv": rms_norm_gemv,
            **({"argmax": argmax} if env_flag("RUNTIME_TRITON_ARGMAX") else {}),
        }

    supports_graphs = True

    def graph_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool) -> Callable[[], torch.Tensor]:
        """Record ``fn`` into a CUDA graph; the replay returns the tensor ``fn`` returned during capture."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # A garbage collection inside the capture could finalize an engine's leftovers (graphs, events) and
        # invalidate it; another thread's CUDA call in the default ("global") mode would too. torch.cuda.graph
        # collects garbage on entry, so none is left for the capture itself.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                output = fn()
        finally:
            if collecting:
                gc.enable()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    # ---------------------------------------------------------------- collectives
    def prepare_collectives(self, group) -> str:
        """Build the one-shot all-reduce of ``group`` when its ranks can use it (all agree; see
        :mod:`runtime_cuda.collectives`); says which messages take it, or why all take NCCL."""
        from runtime_cuda.collectives import setup_one_shot

        one_shot, reason = setup_one_shot(group)
        if one_shot is None:
            return f"NCCL only: {reason}"
        self.one_shots[id(group)] = one_shot
        return f"one-shot over CUDA IPC up to {one_shot.max_bytes} bytes, NCCL above"

    def destroy_collectives(self) -> None:
        for one_shot in self.one_shots.values():
            one_shot.close()
        self.one_shots.clear()

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """One-shot for the messages its group's all-reduce takes (small ones), NCCL for the others."""
        one_shot = self.one_shots.get(id(group))
        if one_shot is not None and one_shot.can_reduce(tensor):
            return one_shot(tensor)
        return super().all_reduce(tensor, group)

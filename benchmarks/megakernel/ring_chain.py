"""W3's FP8 GEMV chain (32 layers x qkv, o, gate_up, down; 7 GB of distinct weights) as 128 launches of the tuned
Triton gemv in one CUDA graph, against one persistent kernel (ring_chain.cu here). Needs a GPU with FP8 tensor
cores (sm_89+) and CuPy.

    python3 benchmarks/megakernel/ring_chain.py [VARIANT ...]     ms a step (median of 7 x 20 graph replays),
                                                                  max rel diff of the chain's last output
    CHECK=1 python3 benchmarks/megakernel/ring_chain.py            one layer, each op against torch with x in e4m3
    TRACE=1 python3 benchmarks/megakernel/ring_chain.py 0          where the op boundaries' time goes (globaltimer)

Variants (stages, L2 evict_first, mode, L2 prefetch distance): see VARIANTS; mode 1 leaves out the arithmetic and
the staging of x (the copies and the waits between ops alone)."""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton

from bench_common import captured, fp8_weights, replay_ms
from runtime_kernels import cuda_launch
from runtime_kernels.jit import gemv as jit

SH = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
VARIANTS = [(6, 1, 0, 0), (6, 1, 1, 0), (5, 1, 0, 0), (6, 0, 0, 0), (6, 1, 0, 6), (6, 1, 0, 12)]
THREADS = 384  # 8 consumer warps + 4 control warps
X_BYTES = 14336  # x of the widest op as e4m3, after the ring


def main():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    W, S = fp8_weights(dev, LAYERS, SH)
    h0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    h = torch.empty(4096, device=dev, dtype=torch.bfloat16)
    buf = {"qkv": torch.empty(6144, device=dev, dtype=torch.bfloat16), "o": torch.empty(4096, device=dev, dtype=torch.bfloat16),
           "gate_up": torch.empty(28672, device=dev, dtype=torch.bfloat16), "down": h}
    src = {"qkv": h, "o": buf["qkv"], "gate_up": buf["o"], "down": buf["gate_up"]}
    ops = [(W[name][l], S[name][l], src[name], buf[name], n, k) for l in range(LAYERS) for name, n, k in SH]
    check = bool(os.environ.get("CHECK"))
    if check:
        del ops[4:]

    def launches():
        for w, s, x, out, n, k in ops:
            jit.gemv_8bit_kernel_tuned[lambda m, n=n: (triton.cdiv(n, m["BLOCK_N"]),)](
                x[:k], w, s, out, out, n, k, k, HAS_SCALE=True, HAS_BIAS=False)

    def column(i, dtype):
        return torch.tensor([o[i].data_ptr() if i < 4 else o[i] for o in ops], dtype=dtype, device=dev)

    table = [column(0, torch.int64), column(1, torch.int64), column(2, torch.int64), column(3, torch.int64),
             column(4, torch.int32), column(5, torch.int32)]
    unused = torch.zeros(len(ops), dtype=torch.int32, device=dev)  # the kernel's rows / base arguments
    done = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    amax = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    trace = torch.zeros(cuda_launch.num_sms(0) * len(ops) * 3, dtype=torch.int64, device=dev)
    tracing = bool(os.environ.get("TRACE"))
    picked = [VARIANTS[int(i)] for i in sys.argv[1:]] or VARIANTS[:1 if check else None]
    names = [f"ring_chain::chain<{st}, {'true' if e else 'false'}, {m}, {pf}>" for st, e, m, pf in picked]
    kernels = cuda_launch.compile_kernels(Path(__file__).with_name("ring_chain.cu").read_text(), names, 0)
    assert kernels is not None, "compile failed (see log)"
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))
    sms = cuda_launch.num_sms(0)

    def persistent(name, stages):
        done.zero_()
        amax.zero_()
        args = tuple(t.data_ptr() for t in table) + (unused.data_ptr(), unused.data_ptr(), np.int32(len(ops)),
                                                     np.int32(0), done.data_ptr(), amax.data_ptr(),
                                                     trace.data_ptr() if tracing else 0)
        cuda_launch.launch(kernels[name], (sms,), THREADS, args, 8 * stages * 4096 + X_BYTES, dev)

    def timed(fn):
        def step():
            h.copy_(h0)
            fn()
        graph = captured(step)
        return replay_ms(graph), h.clone()

    for name, (stages, *_) in zip(names, picked):
        set_attr(kernels[name].ptr, 8, 8 * stages * 4096 + X_BYTES)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if check:
        h.copy_(h0)
        persistent(names[0], picked[0][0])
        torch.cuda.synchronize()
        got = [o[3].clone() for o in ops]
        prev_max = None
        for i, (w, s_, x, out, n, k) in enumerate(ops):
            xin = (h0 if i == 0 else got[i - 1])[:k].float()
            scale = (xin.abs().max() if i == 0 else prev_max) / 448.0  # the kernel's: the whole previous output's max
            xq = (xin / scale).to(torch.float8_e4m3fn).float() * scale
            ref = ((xq @ w.float().T) * s_).to(torch.bfloat16).float()
            err = ((got[i].float() - ref).abs().max() / ref.abs().max()).item()
            print(f"| op {i} ({n} x {k}) | max rel diff {err:.2e} |", flush=True)
            prev_max = got[i].float().abs().max()
        return
    if tracing:
        for _ in range(3):
            persistent(names[0], picked[0][0])
        torch.cuda.synchronize()
        report_trace(trace.view(-1, len(ops), 3).double())
        return
    t, ref = timed(launches)
    print(f"| 128 launches of the tuned Triton gemv, one graph | {t:.3f} | - |", flush=True)
    for name, (stages, *_) in zip(names, picked):
        ms, out = timed(lambda: persistent(name, stages))
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"| {name} | {ms:.3f} ({7.0 / ms:.2f} TB/s) | {err:.1e} |", flush=True)


def report_trace(tr):
    """The op boundaries of the last launch, from every block's timestamps (us)."""
    done_t, polled_t, staged_t = tr[..., 0], tr[..., 1], tr[..., 2]
    rows = {
        "blocks' finish spread in an op (last block - first)": (done_t.max(0).values - done_t.min(0).values)[:-1],
        "a block through with an op -> its poll sees every block": (polled_t - done_t)[:, :-1],
        "poll -> the next op's x staged": (staged_t - polled_t)[:, :-1],
    }
    for label, v in rows.items():
        print(f"| {label} | mean {v.mean().item() / 1e3:.2f}, median {v.median().item() / 1e3:.2f} |")
    gap = done_t[:, 1:] - staged_t[:, :-1]
    for r, (kind, mb) in enumerate([("o", 16.8), ("gate_up", 117.4), ("down", 58.7), ("qkv", 25.2)]):
        print(f"| x staged -> through with {kind} ({mb / 4.6:.1f} at 4.6 TB/s) | median {gap[:, r::4].median().item() / 1e3:.2f} |")


if __name__ == "__main__":
    main()

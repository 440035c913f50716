"""W3's FP8 GEMV chain (32 layers x qkv, o, gate_up, down; 7 GB of distinct weights): 128 launches of the tuned
Triton gemv in one CUDA graph, design 5 (ring_chain.cu: grid barriers between ops) and design 6 (flow_chain.cu: ops
meet by chunk counters). Needs a GPU with FP8 tensor cores (sm_89+) and CuPy.

    python3 benchmarks/megakernel/flow_chain.py [STAGES/ACC[/MODE]:G,G,G,G ...]  ms a step (median of 7 x 20 graph replays) and the
                                                                  max rel diff of the chain's last output against
                                                                  the launches
    CHECK=1 python3 benchmarks/megakernel/flow_chain.py            one layer, each op against torch (float32 sums)
    WAITS=1 ...                                                    also where design 6's blocks wait (µs a step)"""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton

from runtime_kernels import cuda_launch
from runtime_kernels.jit import gemv as jit

SH = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
THREADS = 384  # 8 consumer warps + 4 control warps
KC = 2048


def main():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    W, S = {}, {}
    for name, n, k in SH:
        W[name] = (torch.randn(LAYERS, n, k, device=dev) * 0.3).to(torch.float8_e4m3fn)
        S[name] = (torch.rand(LAYERS, n, device=dev) * 0.2 + 0.9) / (0.3 * k ** 0.5)
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
    sms = cuda_launch.num_sms(0)
    unused = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    done = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    amax = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    counters = torch.zeros(len(ops) * 16, dtype=torch.int32, device=dev)
    waits = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
    tracing = bool(os.environ.get("WAITS"))
    # STAGES[/ACC] and the super-tiles a group for qkv, o, gate_up and down
    picked = [(a.split(":")[0], tuple(int(g) for g in a.split(":")[1].split(","))) for a in sys.argv[1:]]
    picked = picked or [("5/1", (4, 1, 8, 1))]
    groups = {g: torch.tensor(list(g) * (len(ops) // 4), dtype=torch.int32, device=dev) for _, g in picked}
    ring5 = "ring_chain::chain<6, true, 0, 0>"
    names = [f"flow_chain::chain<{st.replace('/', ', ')}>" for st, _ in picked]
    picked = [(int(st.split("/")[0]), g) for st, g in picked]
    here = Path(__file__).parent
    code = (here / "ring_chain.cu").read_text() + (here / "flow_chain.cu").read_text()
    kernels = cuda_launch.compile_kernels(code, sorted(set(names)) + [ring5], 0)
    assert kernels is not None, "compile failed (see log)"
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))

    def smem(stages, flow):
        return 8 * stages * 4096 + (2 * 7 * 2 * KC if flow else 14336)

    for name, (stages, _) in zip(names, picked):
        set_attr(kernels[name].ptr, 8, smem(stages, True))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    set_attr(kernels[ring5].ptr, 8, smem(6, False))

    def design5():
        done.zero_()
        amax.zero_()
        args = tuple(t.data_ptr() for t in table) + (unused.data_ptr(), unused.data_ptr(), np.int32(len(ops)),
                                                     np.int32(0), done.data_ptr(), amax.data_ptr(), 0)
        cuda_launch.launch(kernels[ring5], (sms,), THREADS, args, smem(6, False), dev)

    def design6(name, stages, group):
        counters.zero_()
        args = tuple(t.data_ptr() for t in table) + (groups[group].data_ptr(), np.int32(len(ops)), counters.data_ptr(),
                                                     waits.data_ptr() if tracing else 0)
        cuda_launch.launch(kernels[name], (sms,), THREADS, args, smem(stages, True), dev)

    def timed(fn):
        h.copy_(h0)
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            h.copy_(h0)
            fn()
        g.replay()
        torch.cuda.synchronize()
        out = h.clone()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(7):
            s.record()
            for _ in range(20):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 20)
        return sorted(ts)[3], out

    if check:
        h.copy_(h0)
        design6(names[0], *picked[0])
        torch.cuda.synchronize()
        for i, (w, s_, x, out, n, k) in enumerate(ops):
            xin = (h0 if i == 0 else ops[i - 1][3].clone())[:k].double()
            ref = ((xin @ w.double().T) * s_.double()).to(torch.bfloat16).float()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"| op {i} ({n} x {k}) | max rel diff {err:.2e} |", flush=True)
        return
    t, ref = timed(launches)
    print(f"| 128 launches of the tuned Triton gemv, one graph | {t:.3f} | - |", flush=True)
    ms, out = timed(design5)
    print(f"| design 5 ({ring5}) | {ms:.3f} | {rel(out, ref):.1e} |", flush=True)
    for name, (stages, group) in zip(names, picked):
        ms, out = timed(lambda: design6(name, stages, group))
        print(f"| design 6 ({name}, groups {group}) | {ms:.3f} ({7.0 / ms:.2f} TB/s) | {rel(out, ref):.1e} |", flush=True)
        if tracing:
            wt = waits.view(sms, 2).double() / 1e3
            print(f"|   waits, µs a step: consumers for staged chunks mean {wt[:, 0].mean():.1f} max {wt[:, 0].max():.1f}; "
                  f"control for chunk counters mean {wt[:, 1].mean():.1f} |", flush=True)


def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


if __name__ == "__main__":
    main()

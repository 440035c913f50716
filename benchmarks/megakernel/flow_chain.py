"""W3's FP8 GEMV chain (32 layers x qkv, o, gate_up, down; 7 GB of distinct weights): 128 launches of the tuned
Triton gemv in one CUDA graph, design 5 (ring_chain.cu: grid barriers between ops), design 6 (flow_chain.cu: ops meet
by chunk counters) and design 7 (flow_chain.cu with TAGGED: by tags in the activations themselves). Needs a GPU with
FP8 support (sm_89+) and CuPy.

    python3 benchmarks/megakernel/flow_chain.py [STAGES/ACC/MODE/TAGGED:G,G,G,G ...]
        ms a step (median of 7 x 20 graph replays) and the max rel diff of the chain's last output against the
        launches; G: the super-tiles a group for qkv, o, gate_up and down
    CHECK=1 ...   one layer, each op against torch (float64 sums)
    WAITS=1 ...   also where the blocks wait (µs a step)"""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton

from bench_common import captured, fp8_weights, print_waits, rel, replay_ms
from runtime_kernels import cuda_launch
from runtime_kernels.jit import gemv as jit

SH = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
THREADS = 384  # 8 consumer warps + 4 control warps
KC = 2048


def main():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    W, S = fp8_weights(dev, LAYERS, SH)
    h0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    check = bool(os.environ.get("CHECK"))

    def chain(dtype):  # the ops over activation buffers of dtype (int32: design 7's tagged values)
        h = torch.zeros(4096, device=dev, dtype=dtype)
        buf = {name: torch.zeros(n, device=dev, dtype=dtype) for name, n, _ in SH[:3]}
        buf["down"] = h
        src = {"qkv": h, "o": buf["qkv"], "gate_up": buf["o"], "down": buf["gate_up"]}
        ops = [(W[name][l], S[name][l], src[name], buf[name], n, k) for l in range(LAYERS) for name, n, k in SH]
        ops = ops[:4] if check else ops
        table = [torch.tensor([o[i].data_ptr() if i < 4 else o[i] for o in ops], dtype=torch.int64 if i < 4 else torch.int32,
                              device=dev) for i in range(6)]
        return h, ops, table

    h, ops, table = chain(torch.bfloat16)
    h32, ops32, table32 = chain(torch.int32)
    h0_32 = h0.view(torch.int16).to(torch.int32) & 0xFFFF

    def decode(t32):  # tagged values to bf16
        return (t32 & 0xFFFF).to(torch.int16).view(torch.bfloat16)

    def launches():
        for w, s, x, out, n, k in ops:
            jit.gemv_8bit_kernel_tuned[lambda m, n=n: (triton.cdiv(n, m["BLOCK_N"]),)](
                x[:k], w, s, out, out, n, k, k, HAS_SCALE=True, HAS_BIAS=False)

    sms = cuda_launch.num_sms(0)
    unused = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    done = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    amax = torch.zeros(len(ops), dtype=torch.int32, device=dev)
    counters = torch.zeros(len(ops) * 16, dtype=torch.int32, device=dev)
    epoch = torch.zeros(2, dtype=torch.int32, device=dev)  # design 7: the epoch and the blocks through
    waits = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
    tracing = bool(os.environ.get("WAITS"))
    # STAGES/ACC/MODE/TAGGED and the super-tiles a group for qkv, o, gate_up and down
    picked = []
    for a in sys.argv[1:] or ["5/2/0/1:4,1,8,1"]:
        spec, grp = a.split(":")
        st, acc, mode, tagged = (spec.split("/") + ["1", "0", "0"][len(spec.split("/")) - 1:])[:4]
        picked.append((f"flow_chain::chain<{st}, {acc}, {mode}, {'true' if tagged == '1' else 'false'}>", int(st),
                       tuple(int(g) for g in grp.split(",")), tagged == "1"))
    groups = {g: torch.tensor(list(g) * (len(ops) // 4), dtype=torch.int32, device=dev) for _, _, g, _ in picked}  # meta
    no_ptrs = torch.zeros(len(ops), dtype=torch.int64, device=dev)  # aux and res: no norm, no residual
    ring5 = "ring_chain::chain<6, true, 0, 0>"
    here = Path(__file__).parent
    code = "".join((here / name).read_text() for name in ("ring_chain.cu", "flow_common.cu", "flow_attention.cu", "flow_chain.cu"))
    kernels = cuda_launch.compile_kernels(code, sorted({p[0] for p in picked}) + [ring5], 0)
    assert kernels is not None, "compile failed (see log)"
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))

    def smem(stages, flow):
        return 8 * stages * 4096 + (2 * 7 * 2 * KC if flow else 14336)

    for name, stages, _, _ in picked:
        set_attr(kernels[name].ptr, 8, smem(stages, True))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    set_attr(kernels[ring5].ptr, 8, smem(6, False))

    def design5():
        done.zero_()
        amax.zero_()
        args = tuple(t.data_ptr() for t in table) + (unused.data_ptr(), unused.data_ptr(), np.int32(len(ops)),
                                                     np.int32(0), done.data_ptr(), amax.data_ptr(), 0)
        cuda_launch.launch(kernels[ring5], (sms,), THREADS, args, smem(6, False), dev)

    def design6(name, stages, group, tagged):
        if not tagged:
            counters.zero_()
        args = tuple(t.data_ptr() for t in (table32 if tagged else table)) + (
            groups[group].data_ptr(), no_ptrs.data_ptr(), no_ptrs.data_ptr(), np.int32(len(ops)),
            (epoch if tagged else counters).data_ptr(),
            waits.data_ptr() if tracing else 0)
        cuda_launch.launch(kernels[name], (sms,), THREADS, args, smem(stages, True), dev)

    def timed(fn, tagged=False):
        def step():
            if tagged:
                h32.copy_(h0_32)
            else:
                h.copy_(h0)
            fn()
        graph = captured(step)
        out = decode(h32) if tagged else h.clone()
        return replay_ms(graph), out

    if check:
        for name, stages, group, tagged in picked:
            (h32.copy_(h0_32) if tagged else h.copy_(h0))
            design6(name, stages, group, tagged)
            torch.cuda.synchronize()
            outs = [decode(o[3]) if tagged else o[3].clone() for o in (ops32 if tagged else ops)]
            for i, (w, s_, x, out, n, k) in enumerate(ops):
                xin = (h0 if i == 0 else outs[i - 1])[:k].double()
                ref = ((xin @ w.double().T) * s_.double()).to(torch.bfloat16).float()
                err = ((outs[i].float() - ref).abs().max() / ref.abs().max()).item()
                print(f"| {name} op {i} ({n} x {k}) | max rel diff {err:.2e} |", flush=True)
        return
    t, ref = timed(launches)
    print(f"| 128 launches of the tuned Triton gemv, one graph | {t:.3f} | - |", flush=True)
    ms, out = timed(design5)
    print(f"| design 5 ({ring5}) | {ms:.3f} | {rel(out, ref):.1e} |", flush=True)
    for name, stages, group, tagged in picked:
        ms, out = timed(lambda: design6(name, stages, group, tagged), tagged)
        print(f"| design {7 if tagged else 6} ({name}, groups {group}) | {ms:.3f} ({7.0 / ms:.2f} TB/s) | {rel(out, ref):.1e} |",
              flush=True)
        if tracing:
            print_waits(waits, sms)


if __name__ == "__main__":
    main()

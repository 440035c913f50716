"""W3's 32 layers without attention as one persistent kernel (design 8: flow_chain.cu with TAGGED and the ops'
kinds). A layer, FP8 weights (7 GB in all), bf16 activations, as a Llama layer rounds them:

    qkv = W_qkv RMSNorm(h)                    (the norm's 1 / rms folded into qkv's rows)
    h1 = h + W_o qkv[:4096]                   (qkv's first 4,096 values stand in for attention's output)
    gate_up = W_gu RMSNorm(h1)
    h = h1 + W_down (SiLU(gate) * up)

    python3 benchmarks/megakernel/layer_chain.py [STAGES/ACC[/i]:G,G,G,G ...]   ms a step (median of 7 x 20 graph
        replays) and the max rel diff of the last h against torch in a model's rounding order; i: gate/up's rows
        interleaved by 2,048 (gate, up, gate, ...), which down's staging reads as such
    CHECK=1 ...   one layer, each op against torch from the kernel's own inputs
    WAITS=1 ...   also where the blocks wait (µs a step)"""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch

from runtime_kernels import cuda_launch

SH = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
KINDS = {"qkv": 1, "o": 0, "gate_up": 1, "down": 2}  # flow_common.cu's Ops: norm, as written, SiLU * up (3: interleaved)
LAYERS = 32
THREADS = 384
EPS = 1e-5


def rms_norm(h, g):
    hf = h.float()
    return ((hf * torch.rsqrt(hf.pow(2).mean() + EPS)).bfloat16().float() * g.float()).bfloat16()


def linear(x, w, s):
    return ((x.float() @ w.float().T) * s).bfloat16()


def silu_mul(gu):
    gate, up = gu.float().chunk(2)
    return (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16()


def add(a, b):
    return (a.float() + b.float()).bfloat16()


def main():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    check = bool(os.environ.get("CHECK"))
    layers = 1 if check else LAYERS
    W = {name: (torch.randn(layers, n, k, device=dev) * 0.3).to(torch.float8_e4m3fn) for name, n, k in SH}
    S = {name: (torch.rand(layers, n, device=dev) * 0.2 + 0.9) / (0.3 * k ** 0.5) for name, n, k in SH}
    G = {name: (1 + 0.1 * torch.randn(layers, 4096, device=dev)).bfloat16() for name in ("qkv", "gate_up")}
    h0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    buf = {"hA": 4096, "hB": 4096, "qkv": 6144, "gate_up": 28672}
    buf = {name: torch.zeros(n, device=dev, dtype=torch.int32) for name, n in buf.items()}
    io = {"qkv": ("hA", "qkv", None), "o": ("qkv", "hB", "hA"), "gate_up": ("hB", "gate_up", None),
          "down": ("gate_up", "hA", "hB")}  # x, out, residual
    ops = [(name, l) for l in range(layers) for name, _, _ in SH]

    def ptrs(values):
        return torch.tensor(values, dtype=torch.int64, device=dev)

    # gate/up's rows interleaved by 2,048 (for the "i" variants): gate chunk c, then up chunk c
    order = torch.arange(28672, device=dev).view(2, 7, 2048).transpose(0, 1).reshape(-1)
    Wi = W["gate_up"].view(torch.uint8)[:, order].contiguous().view(torch.float8_e4m3fn)  # (no fp8 indexing)
    Si = S["gate_up"][:, order].contiguous()
    table = [ptrs([W[name][l].data_ptr() for name, l in ops]), ptrs([S[name][l].data_ptr() for name, l in ops]),
             ptrs([buf[io[name][0]].data_ptr() for name, l in ops]), ptrs([buf[io[name][1]].data_ptr() for name, l in ops]),
             torch.tensor([n for name, n, k in SH] * layers, dtype=torch.int32, device=dev),
             torch.tensor([k for name, n, k in SH] * layers, dtype=torch.int32, device=dev)]
    aux = ptrs([G[name][l].data_ptr() if name in G else 0 for name, l in ops])
    res = ptrs([buf[io[name][2]].data_ptr() if io[name][2] else 0 for name, l in ops])
    h0_32 = h0.view(torch.int16).to(torch.int32) & 0xFFFF

    def decode(t32):
        return (t32 & 0xFFFF).to(torch.int16).view(torch.bfloat16)

    sms = cuda_launch.num_sms(0)
    epoch = torch.zeros(2, dtype=torch.int32, device=dev)
    waits = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
    tracing = bool(os.environ.get("WAITS"))
    interleaved = [ptrs([(Wi if name == "gate_up" else W[name])[l].data_ptr() for name, l in ops]),
                   ptrs([(Si if name == "gate_up" else S[name])[l].data_ptr() for name, l in ops])]
    picked = []
    for a in sys.argv[1:] or ["5/2/i:4,1,8,2"]:
        spec, grp = a.split(":")
        stages, acc, il = (spec.split("/") + ["2", ""])[:3]
        kinds = dict(KINDS, down=3) if il == "i" else KINDS
        groups = [int(g) for g in grp.split(",")]
        meta = torch.tensor([g | kinds[name] << 8 for name, g in zip([n for n, _, _ in SH], groups)] * layers,
                            dtype=torch.int32, device=dev)
        picked.append((f"flow_chain::chain<{stages}, {acc}, 0, true>", int(stages), meta, spec + ":" + grp))
    here = Path(__file__).parent
    code = "".join((here / name).read_text() for name in ("ring_chain.cu", "flow_common.cu", "flow_chain.cu"))
    kernels = cuda_launch.compile_kernels(code, sorted({p[0] for p in picked}), 0)
    assert kernels is not None, "compile failed (see log)"
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))
    smem = {stages: 8 * stages * 4096 + 2 * 7 * 2 * 2048 for _, stages, _, _ in picked}
    for name, stages, _, _ in picked:
        set_attr(kernels[name].ptr, 8, smem[stages])

    def step(name, stages, meta, spec):
        buf["hA"].copy_(h0_32)
        weights = interleaved if "/i:" in spec else table[:2]
        args = tuple(t.data_ptr() for t in weights + table[2:]) + (meta.data_ptr(), aux.data_ptr(), res.data_ptr(), np.int32(len(ops)),
                                                     epoch.data_ptr(), waits.data_ptr() if tracing else 0)
        cuda_launch.launch(kernels[name], (sms,), THREADS, args, smem[stages], dev)

    if check:
        name, stages, meta, spec = picked[0]
        step(name, stages, meta, spec)
        torch.cuda.synchronize()
        out = {key: decode(t) for key, t in buf.items()}
        if "/i:" in spec:  # gate/up's output back in the weight's own row order
            out["gate_up"] = out["gate_up"].view(7, 2, 2048).transpose(0, 1).reshape(-1)
        refs = {"qkv": linear(rms_norm(h0, G["qkv"][0]), W["qkv"][0], S["qkv"][0]),
                "o (h1)": add(h0, linear(out["qkv"][:4096], W["o"][0], S["o"][0])),
                "gate_up": linear(rms_norm(out["hB"], G["gate_up"][0]), W["gate_up"][0], S["gate_up"][0]),
                "down (h)": add(out["hB"], linear(silu_mul(out["gate_up"]), W["down"][0], S["down"][0]))}
        for (label, ref), got in zip(refs.items(), [out["qkv"], out["hB"], out["gate_up"], out["hA"]]):
            print(f"| {label} | max rel diff {rel(got, ref):.2e} |", flush=True)
        return
    h = h0
    for l in range(layers):  # the reference, as a model rounds it
        h1 = add(h, linear(linear(rms_norm(h, G["qkv"][l]), W["qkv"][l], S["qkv"][l])[:4096], W["o"][l], S["o"][l]))
        gu = linear(rms_norm(h1, G["gate_up"][l]), W["gate_up"][l], S["gate_up"][l])
        h = add(h1, linear(silu_mul(gu), W["down"][l], S["down"][l]))
    for name, stages, meta, spec in picked:
        step(name, stages, meta, spec)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(name, stages, meta, spec)
        g.replay()
        torch.cuda.synchronize()
        err = rel(decode(buf["hA"]), h)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(7):
            s.record()
            for _ in range(20):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) / 20)
        ms = sorted(ts)[3]
        print(f"| design 8 ({name}, {spec}) | {ms:.3f} ({7.0 / ms:.2f} TB/s) | {err:.1e} |", flush=True)
        if tracing:
            wt = waits.view(sms, 2).double() / 1e3
            print(f"|   waits, µs a step: consumers for staged chunks mean {wt[:, 0].mean():.1f} max {wt[:, 0].max():.1f}; "
                  f"stagers for their chunks mean {wt[:, 1].mean():.1f} |", flush=True)


def rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


if __name__ == "__main__":
    main()

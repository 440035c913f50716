"""W3's 32 layers as one persistent kernel (flow_chain.cu with TAGGED and the ops' kinds). A layer, FP8 weights (7 GB
in all), bf16 activations, as a Llama layer rounds them:

    qkv = W_qkv RMSNorm(h)                    (the norm's 1 / rms folded into qkv's rows)
    a = attention(qkv)                        (design 9, "a" variants: rotary, the new k and v into the cache,
                                               split-KV over positions 0..pos, the splits merged; design 8: a is
                                               qkv's first 4,096 values)
    h1 = h + W_o a
    gate_up = W_gu RMSNorm(h1)
    h = h1 + W_down (SiLU(gate) * up)

    python3 benchmarks/megakernel/layer_chain.py [STAGES/ACC/FLAGS:G,G,G,G ...]   ms a step (median of 7 x 20 graph
        replays) and the max rel diff of the last h against torch in a model's rounding order. FLAGS: i: gate/up's rows
        interleaved by 2,048 (gate, up, gate, ...), which down's staging reads as such; a: attention (8 KV heads, 32
        q heads, the KV cache's positions 0..POS - 1 random; POS=383, SPLITS=16 by default); A: attention with lanes
        over positions (design 10; SPLITS a multiple of 4, up to 32, each of at most MAX_SPAN (16) positions). G: the super-tiles
        a group for qkv, o, gate_up and down.
    CHECK=1 ...   one layer, each op against torch from the kernel's own inputs
    WAITS=1 ...   also where the blocks wait (µs a step)
    WAITS=1 TRACE=L ...   also layer L's timeline: when the blocks' stagers start and finish each op, and when consumer
        warp 0 of each block has its first unit's x and stores its last rows (min / median / max over the blocks)"""
import ctypes
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from bench_common import captured, fp8_weights, print_waits, rel, replay_ms
from runtime_kernels import cuda_launch

SH = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
THREADS = 384
EPS = 1e-5
KV_HEADS, GROUP, HEAD = 8, 4, 128
ROPE_THETA = 500000.0


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


def rotary(x, cos, sin):  # x [heads, 128] bf16, as a model in bf16 computes x cos + rotate_half(x) sin
    half = torch.cat([-x[:, HEAD // 2:], x[:, :HEAD // 2]], dim=1)
    return add((x.float() * cos).bfloat16(), (half.float() * sin).bfloat16())


def attention(qkv, k_cache, v_cache, pos, cos, sin):
    """The attention output [4096] bf16, and the new k and v (rotary on k) as the cache should hold them."""
    q = rotary(qkv[:4096].view(-1, HEAD), cos, sin)
    k = rotary(qkv[4096:5120].view(KV_HEADS, HEAD), cos, sin)
    v = qkv[5120:].view(KV_HEADS, HEAD)
    keys = torch.cat([k_cache[:pos], k[None]]).float()  # [pos + 1, kv heads, 128]
    values = torch.cat([v_cache[:pos], v[None]]).float()
    out = []
    for head in range(q.shape[0]):
        logits = keys[:, head // GROUP] @ q[head].float() / math.sqrt(HEAD)
        out.append(torch.softmax(logits, 0) @ values[:, head // GROUP])
    return torch.cat(out).bfloat16(), k, v


TRACE_OPS = 8  # flow_common.cu's kTraceOps


def table_ops_a_layer(flags):
    return 6 if "a" in flags or "A" in flags else 4


def print_timeline(t, ops_a_layer):
    """t: [blocks][TRACE_OPS][4] globaltimer ns (0: not recorded)."""
    names = (["qkv", "attention", "merge", "o", "gate_up", "down"] if ops_a_layer == 6 else ["qkv", "o", "gate_up", "down"])
    names += ["next qkv", "next +1", "next +2", "next +3"]
    t = t.double()
    t0 = t[:, 0, 0][t[:, 0, 0] > 0].min()
    print("| op | stagers start | stagers done | consumers' first x | consumers' last rows |  (µs from the first start: min / median / max)")
    for d in range(min(TRACE_OPS, ops_a_layer + 2)):
        cells = []
        for e in range(4):
            v = t[:, d, e]
            v = (v[v > 0] - t0) / 1e3
            cells.append(f"{v.min():.1f} / {v.median():.1f} / {v.max():.1f}" if v.numel() else "-")
        print(f"| {names[d]} | " + " | ".join(cells) + " |", flush=True)


def main():
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    check = bool(os.environ.get("CHECK"))
    layers = 1 if check else LAYERS
    assert layers * 6 <= 256, "design 11's grab counters: 256 ops at most"
    pos, splits = int(os.environ.get("POS", 383)), int(os.environ.get("SPLITS", 16))
    assert 1 <= splits <= 32 and pos < 1024, "the merge reads at most 32 splits (flow_attention.cu); the cache holds 1,024"
    assert all("A" not in a.split(":")[0] for a in sys.argv[1:]) or (splits % 4 == 0 and -(-(pos + 1) // splits) <= int(os.environ.get('MAX_SPAN', 16))), (
        "design 10 takes splits in fours, each of at most 16 positions (flow_attention.cu's kMaxSpan)")
    W, S = fp8_weights(dev, layers, [(name, n, k) for name, (n, k) in SH.items()])
    G = {name: (1 + 0.1 * torch.randn(layers, 4096, device=dev)).bfloat16() for name in ("qkv", "gate_up")}
    K = torch.randn(layers, 1024, KV_HEADS, HEAD, device=dev).bfloat16()
    V = torch.randn(layers, 1024, KV_HEADS, HEAD, device=dev).bfloat16()
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD, 2, device=dev).float() / HEAD)
    emb = torch.cat([pos * inv_freq, pos * inv_freq])
    cos, sin = emb.cos().bfloat16().float(), emb.sin().bfloat16().float()
    h0 = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    buf = {"hA": 4096, "hB": 4096, "qkv": 6144, "gate_up": 28672, "attn": 4096}
    buf = {name: torch.zeros(n, device=dev, dtype=torch.int32) for name, n in buf.items()}
    partials = torch.zeros(32 * splits * 130, device=dev, dtype=torch.int64)
    desc = torch.tensor([[K[l].data_ptr(), V[l].data_ptr(), cos.data_ptr(), sin.data_ptr(), pos, splits, KV_HEADS, GROUP]
                         for l in range(layers)], dtype=torch.int64, device=dev)
    # gate/up's rows interleaved by 2,048 (the "i" variants): gate chunk c, then up chunk c
    order = torch.arange(28672, device=dev).view(2, 7, 2048).transpose(0, 1).reshape(-1)
    Wi = W["gate_up"].view(torch.uint8)[:, order].contiguous().view(torch.float8_e4m3fn)  # (no fp8 indexing)
    Si = S["gate_up"][:, order].contiguous()

    def build(flags, groups):
        """The kernel's op tables: w, s, x, o, n, k, meta, aux, res."""
        rows = []
        for l in range(layers):
            w = {name: (Wi if name == "gate_up" and "i" in flags else W[name])[l] for name in SH}
            s = {name: (Si if name == "gate_up" and "i" in flags else S[name])[l] for name in SH}
            gemv = {name: (w[name].data_ptr(), s[name].data_ptr(), *SH[name]) for name in SH}
            rows.append((*gemv["qkv"], buf["hA"], buf["qkv"], groups[0] | 1 << 8, G["qkv"][l].data_ptr(), 0))
            if "a" in flags or "A" in flags:
                d = desc[l].data_ptr()
                rows.append((0, 0, 0, 0, buf["qkv"], partials, 1 | (6 if "A" in flags else 4) << 8, d, 0))
                rows.append((0, 0, 0, 0, partials, buf["attn"], 1 | 5 << 8, d, 0))
                rows.append((*gemv["o"], buf["attn"], buf["hB"], groups[1] | 4 << 16, 0, buf["hA"]))
            else:
                rows.append((*gemv["o"], buf["qkv"], buf["hB"], groups[1], 0, buf["hA"]))
            rows.append((*gemv["gate_up"], buf["hB"], buf["gate_up"], groups[2] | 1 << 8, G["gate_up"][l].data_ptr(), 0))
            rows.append((*gemv["down"], buf["gate_up"], buf["hA"], groups[3] | (3 if "i" in flags else 2) << 8, 0,
                         buf["hB"]))
        cols = list(zip(*rows))

        def ptr(v):
            return v.data_ptr() if isinstance(v, torch.Tensor) else v
        table = [torch.tensor([ptr(v) for v in cols[i]], dtype=torch.int64, device=dev) for i in (0, 1, 4, 5)]
        table += [torch.tensor(cols[i], dtype=torch.int32, device=dev) for i in (2, 3, 6)]
        table += [torch.tensor([ptr(v) for v in cols[i]], dtype=torch.int64, device=dev) for i in (7, 8)]
        return [table[0], table[1], table[2], table[3], table[4], table[5], table[6], table[7], table[8]]

    h0_32 = h0.view(torch.int16).to(torch.int32) & 0xFFFF

    def decode(t32):
        return (t32 & 0xFFFF).to(torch.int16).view(torch.bfloat16)

    sms = cuda_launch.num_sms(0)
    # the epoch, the blocks through, the traced op + 1, (spare), then design 11's grab counters (DEFINES=DYNAMIC=1)
    epoch = torch.zeros(4 + 256, dtype=torch.int32, device=dev)
    waits = torch.zeros(sms * 2 + sms * TRACE_OPS * 4, dtype=torch.int64, device=dev)
    tracing = bool(os.environ.get("WAITS"))
    traced_layer = int(os.environ.get("TRACE", -1))
    picked = []
    table_flags = {}
    for a in sys.argv[1:] or ["5/2/ia:4,1,8,1"]:
        spec, grp = a.split(":")
        stages, acc, flags = (spec.split("/") + ["2", ""])[:3]
        picked.append((f"flow_chain::chain<{stages}, {acc}, 0, true>", int(stages), build(flags, [int(g) for g in grp.split(",")]),
                       spec + ":" + grp))
        table_flags[id(picked[-1][2])] = flags
    here = Path(__file__).parent
    defines = "".join(f"#define {d.replace('=', ' ')}\n" for d in os.environ.get("DEFINES", "").split(";") if d)
    code = defines + "".join((here / name).read_text() for name in ("ring_chain.cu", "flow_common.cu", "flow_attention.cu", "flow_chain.cu"))
    kernels = cuda_launch.compile_kernels(code, sorted({p[0] for p in picked}), 0)
    assert kernels is not None, "compile failed (see log)"
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))
    smem = {stages: 8 * stages * 4096 + 2 * 7 * 2 * 2048 for _, stages, _, _ in picked}
    for name, stages, _, _ in picked:
        set_attr(kernels[name].ptr, 8, smem[stages])

    def step(name, stages, table):
        buf["hA"].copy_(h0_32)
        epoch[2:3].fill_(traced_layer * table_ops_a_layer(table_flags[id(table)]) + 1 if traced_layer >= 0 else 0)
        args = tuple(t.data_ptr() for t in table) + (np.int32(table[0].numel()), epoch.data_ptr(),
                                                     waits.data_ptr() if tracing else 0)
        cuda_launch.launch(kernels[name], (sms,), THREADS, args, smem[stages], dev)

    if check:
        name, stages, table, spec = picked[0]
        k_before = K[0, pos].clone()
        step(name, stages, table)
        torch.cuda.synchronize()
        out = {key: decode(t) for key, t in buf.items()}
        if "i" in spec.split(":")[0]:  # gate/up's output back in the weight's own row order
            out["gate_up"] = out["gate_up"].view(7, 2, 2048).transpose(0, 1).reshape(-1)
        checks = [("qkv", out["qkv"], linear(rms_norm(h0, G["qkv"][0]), W["qkv"][0], S["qkv"][0]))]
        x_o = out["qkv"][:4096]
        if ("a" in spec.split(":")[0] or "A" in spec.split(":")[0]):
            ref, k_new, v_new = attention(out["qkv"], K[0], V[0], pos, cos, sin)
            checks += [("attention", out["attn"], ref), ("k into the cache", K[0, pos], k_new),
                       ("v into the cache", V[0, pos], v_new)]
            x_o = out["attn"]
            assert not torch.equal(k_before, K[0, pos]), "the cache's k at pos was not written"
            if os.environ.get("DEBUG"):
                print("qkv k", out["qkv"][4096:4100].tolist(), "k_new", k_new[0, :4].tolist(), "cache", K[0, pos, 0, :4].tolist())
                print("cache row h1", K[0, pos, 1, :4].tolist(), "k_new h1", k_new[1, :4].tolist())
                print("v", out["qkv"][5120:5124].tolist(), V[0, pos, 0, :4].tolist())
                words = partials.view(32, splits, 130)
                print("partial h0 s0", (words[0, 0, :4] & 0xFFFFFFFF).to(torch.int32).view(torch.float32).tolist(),
                      (words[0, 0, 128:] & 0xFFFFFFFF).to(torch.int32).view(torch.float32).tolist(), (words[0, 0, :2] >> 32).tolist())
                print("attn", out["attn"][:4].tolist(), ref[:4].tolist())
        checks += [("o (h1)", out["hB"], add(h0, linear(x_o, W["o"][0], S["o"][0]))),
                   ("gate_up", out["gate_up"], linear(rms_norm(out["hB"], G["gate_up"][0]), W["gate_up"][0], S["gate_up"][0])),
                   ("down (h)", out["hA"], add(out["hB"], linear(silu_mul(out["gate_up"]), W["down"][0], S["down"][0])))]
        for label, got, ref in checks:
            print(f"| {label} | max rel diff {rel(got, ref):.2e} |", flush=True)
        return
    refs = {}
    for with_attention in sorted({("a" in spec.split(":")[0] or "A" in spec.split(":")[0]) for _, _, _, spec in picked}):
        h = h0
        for l in range(layers):  # the reference, as a model rounds it
            qkv = linear(rms_norm(h, G["qkv"][l]), W["qkv"][l], S["qkv"][l])
            x_o = attention(qkv, K[l], V[l], pos, cos, sin)[0] if with_attention else qkv[:4096]
            h1 = add(h, linear(x_o, W["o"][l], S["o"][l]))
            gu = linear(rms_norm(h1, G["gate_up"][l]), W["gate_up"][l], S["gate_up"][l])
            h = add(h1, linear(silu_mul(gu), W["down"][l], S["down"][l]))
        refs[with_attention] = h
    for name, stages, table, spec in picked:
        graph = captured(lambda: step(name, stages, table))
        err = rel(decode(buf["hA"]), refs[("a" in spec.split(":")[0] or "A" in spec.split(":")[0])])
        ms = replay_ms(graph)
        flags = spec.split(":")[0]
        design = 10 if "A" in flags else 9 if "a" in flags else 8
        print(f"| design {design} ({name}, {spec}) | {ms:.3f} ({7.0 / ms:.2f} TB/s) | {err:.1e} |", flush=True)
        if tracing:
            print_waits(waits[:sms * 2], sms)
        if traced_layer >= 0:
            print_timeline(waits[sms * 2:].view(sms, TRACE_OPS, 4), table_ops_a_layer(flags))


if __name__ == "__main__":
    main()

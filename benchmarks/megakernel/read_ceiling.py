"""The H200's read ceiling for W3's bytes: 7 GB (the layers' FP8 weights) read once, as a persistent kernel streams
them, by (1) a plain grid-stride kernel of 16-byte loads (BLOCKS x 1,024 threads, UNROLL loads in flight a thread),
(2) cp.async into shared memory rings as the chain's consumers do (one block an SM), and (3) torch's sum.
Prints GB/s (median of 7 x 10 CUDA-graph replays). The chain's figures (layer_chain.py) compare against these.

    python3 benchmarks/megakernel/read_ceiling.py"""
import ctypes

import numpy as np
import torch

from bench_common import captured, replay_ms
from runtime_kernels import cuda_launch

CODE = r"""
template <int UNROLL>
__global__ void read_plain(const uint4* p, long long n, unsigned int* sink) {
  unsigned int acc = 0;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n; i += stride * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = i + u * stride < n ? __ldcs(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // (never: keeps the loads)
}
// one block an SM, each warp a ring of STAGES x 4 KB filled by cp.async (as the chain's consumers: 2,048-byte rows)
template <int STAGES>
__global__ void read_async(const uint4* p, long long n, unsigned int* sink) {
  extern __shared__ uint4 ring[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  uint4* mine = ring + warp * STAGES * 256;
  const long long units = n / 256, first = static_cast<long long>(blockIdx.x) * warps + warp, step = static_cast<long long>(gridDim.x) * warps;
  unsigned int acc = 0;
  long long next = first;
  auto issue = [&](int slot) {
    if (next < units) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(mine + slot * 256 + 32 * i + lane));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(p + next * 256 + 32 * i + lane) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    next += step;
  };
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  int slot = 0;
  for (long long u = first; u < units; u += step) {
    issue(slot == 0 ? STAGES - 1 : slot - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) acc ^= mine[slot * 256 + 32 * i + lane].x;
    __syncwarp();
    if (++slot == STAGES) slot = 0;
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (acc == 0x12345678u) sink[0] = acc;
}
"""


def main():
    dev = torch.device("cuda", 0)
    gb = 7.0
    data = torch.empty(int(gb * 1e9) // 16 * 16, dtype=torch.uint8, device=dev).random_()
    n = data.numel() // 16
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = cuda_launch.num_sms(0)
    names = [f"read_plain<{u}>" for u in (2, 4, 8)] + [f"read_async<{s}>" for s in (3, 4, 5, 8)]
    kernels = cuda_launch.compile_kernels(CODE, names, 0)
    set_attr = cuda_launch._driver_function("cuFuncSetAttribute", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))

    def report(label, ms):
        print(f"| {label} | {ms:.3f} ms | {gb / ms:.2f} TB/s |", flush=True)
    for name in names:
        if name.startswith("read_plain"):
            for blocks_an_sm in (2, 4):
                grid, threads, smem = sms * blocks_an_sm, 1024, 0
                graph = captured(lambda: cuda_launch.launch(kernels[name], (grid,), threads, (data.data_ptr(), np.int64(n), sink.data_ptr()), smem, dev))
                report(f"{name}, {blocks_an_sm} blocks an SM", replay_ms(graph, replays=10))
        else:
            stages = int(name.split("<")[1].rstrip(">"))
            for warps in (8, 12):
                smem = warps * stages * 4096
                if smem > 227 * 1024:  # an SM's shared memory
                    continue
                set_attr(kernels[name].ptr, 8, smem)
                graph = captured(lambda: cuda_launch.launch(kernels[name], (sms,), 32 * warps, (data.data_ptr(), np.int64(n), sink.data_ptr()), smem, dev))
                report(f"{name}, {warps} warps", replay_ms(graph, replays=10))
    graph = captured(lambda: data.view(torch.int64).sum())
    report("torch sum (int64)", replay_ms(graph, replays=10))


if __name__ == "__main__":
    main()

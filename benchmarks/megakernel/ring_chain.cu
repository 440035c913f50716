// A first step towards one kernel for a whole batch-1 decode step (issues #14, #16, #18): W3's chain of FP8 GEMVs
// (32 layers x qkv, o, gate/up, down; 7 GB of distinct weights) in one persistent launch, measured against 128
// launches of the tuned Triton GEMV in one CUDA graph (benchmarks/megakernel/ring_chain.py; RESULTS.md, session 35).
//
// One block an SM, every block resident. 8 consumer warps each own 2 rows of a 16-row super-tile; the weights come in
// 32 KB sub-tiles (16 rows x 2,048 bytes, 4 KB a warp) that every lane copies for itself with cp.async (16 bytes,
// L2 evict_first), STAGES - 1 sub-tiles ahead of the one it computes, across op boundaries: weights depend on no op,
// so the copies run ahead through the waits between ops. The products run on FP8 tensor cores (mma.m16n8k32 e4m3,
// described at mma_e4m3) with x quantized to e4m3 under one scale an op (its |x| max / 448), as a W8A8 GEMM with
// dynamic activation scales quantizes it.
//
#include "gemv_common.cuh"

namespace ring_chain {
using namespace gemv_common;

constexpr int kConsumers = 256;

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}

struct Ops {  // device arrays, one entry an op
  const long long *w, *s, *x, *out;
  const int *n, *k, *rows, *base;  // rows: unused here (16 a super-tile); base: the op's first global sub-tile
};

// FP8 tensor cores for one row of x: mma.m16n8k32 (e4m3 x e4m3 -> f32). A warp owns 2 weight rows (r, r') of a
// super-tile of 16 rows; its lane l reads 16-byte vector 32 p + l of each row and of x (quantized to e4m3 with
// one scale for the op). In the mma, row g of A (g = l / 4) is row r's bytes that lanes 4 g .. 4 g + 3 hold, row g + 8
// is row r''s, and column g of B the same bytes of x; so C[g][g] and C[g + 8][g] are the two rows' dot products
// over those bytes, and the rest of C is never read. A 16-byte vector feeds two mmas (bytes 0-7, 8-15).
__device__ __forceinline__ void mma_e4m3(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned int e4m3x4(float a, float b, float c, float d) {  // 4 floats to 4 e4m3 codes
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(c), "f"(d));
  return static_cast<unsigned int>(lo) | (static_cast<unsigned int>(hi) << 16);
}

constexpr int kKc = 2048;  // bytes of a row in a sub-tile: a sub-tile is 16 rows x 2048 = 32 KB, 4 KB a warp
constexpr int kRows = 16;
template <bool EVICT>
__device__ __forceinline__ void copy16(void* dst, const void* src, unsigned long long policy) {
  if constexpr (EVICT)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "l"(policy) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// v5: 8 consumer warps (copies, mma, output stores) that never fence, poll or stage; 4 control warps that, per op,
// wait for the block's consumers (named barrier kDone), add the block to the op's counter, poll until every block is
// in, stage the next op's x as e4m3 in shared memory (one pass: the op's |x| max is gathered as its rows are stored,
// a max a warp, one atomicMax a block) and release the consumers (named barrier kReady).
// MODE 0: normal; 1: no arithmetic and no staging (copies and op waits). PF > 0: each warp also asks for the
// sub-tile PF ahead of its copies into L2 (cp.async.bulk.prefetch.L2; measured slower, session 35).
constexpr int kControl = 128;
constexpr int kDone = 2, kReady = 3;

template <int STAGES, bool EVICT, int MODE, int PF = 0>
__global__ void __launch_bounds__(kConsumers + kControl, 1) chain(
    const long long* w, const long long* s, const long long* x, const long long* o, const int* n, const int* k,
    const int* rows, const int* base, int num_ops, int total_tiles, unsigned int* done, unsigned int* amax,
    unsigned long long* trace) {
  const Ops ops{w, s, x, o, n, k, rows, base};
  constexpr int kShare = 2 * kKc / 16;
  extern __shared__ __align__(128) uint4 ring[];  // [kWarps][STAGES][kShare], then x as e4m3 (14336 bytes)
  uint4* xq = ring + kWarps * STAGES * kShare;
  __shared__ float x_scale;
  __shared__ float row_max[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto chunks_of = [&](int j) { return ops.k[j] / kKc; };
  auto supers = [&](int j) { return (ops.n[j] + kRows - 1) / kRows; };

  if (warp >= kWarps) {  // control
    const int ct = threadIdx.x - kConsumers;
    auto stage_x = [&](int j) {  // all of x's loads in flight at once, then their conversion
      constexpr int kMaxV = 14336 / 8 / kControl;
      const uint4* xb = reinterpret_cast<const uint4*>(ops.x[j]);
      const int vectors = ops.k[j] / 8;
      uint4 v[kMaxV];
#pragma unroll
      for (int u = 0; u < kMaxV; ++u)
        if (ct + u * kControl < vectors) v[u] = __ldcg(xb + ct + u * kControl);
      float m;
      if (j == 0) {  // the first op's x comes from before the launch: its max here
        float mm = 0.0f;
#pragma unroll
        for (int u = 0; u < kMaxV; ++u) {
          if (ct + u * kControl < vectors) {
            const unsigned int words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int q = 0; q < 4; ++q)
              mm = fmaxf(mm, fmaxf(fabsf(__uint_as_float(words[q] << 16)), fabsf(__uint_as_float(words[q] & 0xFFFF0000u))));
          }
        }
        mm = warp_max(mm);
        if (lane == 0) row_max[warp - kWarps] = mm;
        asm volatile("bar.sync 4, 128;" ::: "memory");
        m = fmaxf(fmaxf(row_max[0], row_max[1]), fmaxf(row_max[2], row_max[3]));
        asm volatile("bar.sync 4, 128;" ::: "memory");
      } else {
        m = __uint_as_float(__ldcg(amax + j - 1));
      }
      const float inv = m > 0.0f ? 448.0f / m : 1.0f;
      if (ct == 0) x_scale = m > 0.0f ? m / 448.0f : 1.0f;
      uint2* xw = reinterpret_cast<uint2*>(xq);
#pragma unroll
      for (int u = 0; u < kMaxV; ++u) {
        if (ct + u * kControl < vectors) {
          const unsigned int words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
          float f[8];
#pragma unroll
          for (int q = 0; q < 4; ++q) f[2 * q] = __uint_as_float(words[q] << 16) * inv, f[2 * q + 1] = __uint_as_float(words[q] & 0xFFFF0000u) * inv;
          xw[ct + u * kControl] = make_uint2(e4m3x4(f[0], f[1], f[2], f[3]), e4m3x4(f[4], f[5], f[6], f[7]));
        }
      }
    };
    if (MODE == 0) stage_x(0);
    asm volatile("bar.arrive %0, %1;" ::"n"(kReady), "n"(kConsumers + kControl) : "memory");
    // trace (or null): [blocks][ops][3] globaltimer ns: the block's consumers are through with op j, the poll has
    // seen every block, x of op j + 1 is staged.
    auto now = [] { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; };
    const bool tracing = trace != nullptr && ct == 0;
    for (int j = 0; j < num_ops; ++j) {
      asm volatile("bar.sync %0, %1;" ::"n"(kDone), "n"(kConsumers + kControl) : "memory");
      if (tracing) trace[(blockIdx.x * num_ops + j) * 3] = now();
      if (ct == 0) {
        float m = 0.0f;
        for (int i = 0; i < kWarps; ++i) m = fmaxf(m, row_max[i]);
        __threadfence();
        atomicMax(amax + j, __float_as_uint(m));
        __threadfence();
        atomicAdd(done + j, 1u);
        unsigned int seen;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(done + j) : "memory");
        } while (seen < gridDim.x);
      }
      if (tracing) trace[(blockIdx.x * num_ops + j) * 3 + 1] = now();
      asm volatile("bar.sync 4, 128;" ::: "memory");
      if (j + 1 < num_ops) {
        if (MODE == 0) stage_x(j + 1);
        if (trace != nullptr) {  // every control thread: x is staged once all 128 are through
          asm volatile("bar.sync 4, 128;" ::: "memory");
          if (tracing) trace[(blockIdx.x * num_ops + j) * 3 + 2] = now();
        }
        asm volatile("bar.arrive %0, %1;" ::"n"(kReady), "n"(kConsumers + kControl) : "memory");
      }
    }
    return;
  }

  // The consumers.
  uint4* slots = ring + warp * STAGES * kShare;
  unsigned long long policy = 0;
  if (EVICT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  struct Pos { int j, st, c; };
  auto settle = [&](Pos& p) {
    while (p.j < num_ops && p.st >= supers(p.j)) p.st -= supers(p.j), ++p.j;
    return p.j < num_ops;
  };
  auto next_pos = [&](Pos& p) {
    if (++p.c < chunks_of(p.j)) return true;
    p.c = 0;
    p.st += gridDim.x;
    return settle(p);
  };
  Pos ahead{0, static_cast<int>(blockIdx.x), 0};
  bool more = settle(ahead);
  Pos pf{0, static_cast<int>(blockIdx.x), 0};  // PF sub-tiles in front of `ahead`: prefetched into L2
  bool pf_more = settle(pf);
  for (int i = 0; i < PF + STAGES - 1 && pf_more; ++i) pf_more = next_pos(pf);
  auto issue_next = [&](int slot) {
    if (PF > 0 && pf_more) {
      if (lane < 2) {
        const int row = min(pf.st * kRows + 2 * warp + lane, ops.n[pf.j] - 1);
        const unsigned char* src = reinterpret_cast<const unsigned char*>(ops.w[pf.j]) + static_cast<long long>(row) * ops.k[pf.j] + pf.c * kKc;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(kKc) : "memory");
      }
      pf_more = next_pos(pf);
    }
    if (more) {
      const int kj = ops.k[ahead.j], nj = ops.n[ahead.j];
      const uint4* wj = reinterpret_cast<const uint4*>(ops.w[ahead.j]);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = min(ahead.st * kRows + 2 * warp + rr, nj - 1);
        const uint4* src = wj + (static_cast<long long>(row) * kj + ahead.c * kKc) / 16;
#pragma unroll
        for (int i = 0; i < kKc / 16 / 32; ++i)
          copy16<EVICT>(slots + slot * kShare + rr * (kKc / 16) + 32 * i + lane, src + 32 * i + lane, policy);
      }
      more = next_pos(ahead);
    }
    commit();
  };
  for (int i = 0; i < STAGES - 1; ++i) issue_next(i);

  Pos cur{0, static_cast<int>(blockIdx.x), 0};
  bool have = settle(cur);
  int j = -1, slot = 0;
  float c[4] = {};
  float my_max = 0.0f;
  auto op_done = [&]() {  // this warp's outputs of op j are stored (and its |max| is in row_max)
    if (lane == 0) row_max[warp] = my_max;
    my_max = 0.0f;
    __syncwarp();
    asm volatile("bar.arrive %0, %1;" ::"n"(kDone), "n"(kConsumers + kControl) : "memory");
  };
  asm volatile("bar.sync %0, %1;" ::"n"(kReady), "n"(kConsumers + kControl) : "memory");  // x of op 0
  j = 0;
  while (true) {
    if (have) issue_next(slot == 0 ? STAGES - 1 : slot - 1);  // before any wait: the copies keep flowing
    const int jn = have ? cur.j : num_ops;
    for (; j < jn; ++j) {  // ops this block is through with (its last tile's, or none of its tiles)
      op_done();
      if (j + 1 < num_ops) asm volatile("bar.sync %0, %1;" ::"n"(kReady), "n"(kConsumers + kControl) : "memory");
    }
    if (!have) break;
    wait_groups<STAGES - 1>();
    if (MODE == 0) {
      const uint4* mine = slots + slot * kShare;
      const uint4* xs = xq + cur.c * (kKc / 16);
#pragma unroll
      for (int i = 0; i < kKc / 16 / 32; ++i) {
        const uint4 a = mine[32 * i + lane], b = mine[kKc / 16 + 32 * i + lane], xv = xs[32 * i + lane];
        mma_e4m3(c, a.x, b.x, a.y, b.y, xv.x, xv.y);
        mma_e4m3(c, a.z, b.z, a.w, b.w, xv.z, xv.w);
      }
      if (cur.c + 1 == chunks_of(j)) {
        const int g = lane >> 2, t = lane & 3;
        const bool holds = t == (g >> 1);
        float r0 = holds ? ((g & 1) ? c[1] : c[0]) : 0.0f;
        float r1 = holds ? ((g & 1) ? c[3] : c[2]) : 0.0f;
        r0 = warp_sum(r0), r1 = warp_sum(r1);
        const int row = cur.st * kRows + 2 * warp;
        const float* scale = reinterpret_cast<const float*>(ops.s[j]);
        bf16* out = reinterpret_cast<bf16*>(ops.out[j]);
        if (lane == 0 && row < ops.n[j]) {
          const bf16 v = bf16::round(r0 * x_scale * scale[row]);
          out[row] = v;
          my_max = fmaxf(my_max, fabsf(v.value()));
        }
        if (lane == 0 && row + 1 < ops.n[j]) {
          const bf16 v = bf16::round(r1 * x_scale * scale[row + 1]);
          out[row + 1] = v;
          my_max = fmaxf(my_max, fabsf(v.value()));
        }
        c[0] = c[1] = c[2] = c[3] = 0.0f;
      }
    }
    if (++slot == STAGES) slot = 0;
    have = next_pos(cur);
  }
  wait_groups<0>();
}
}  // namespace ring_chain

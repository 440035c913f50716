// Decode attention over an FP8 (e4m3) paged KV cache: one query token per request, G query heads per KV head, head
// size D, on CUDA cores. q [tokens, heads, D] (16-bit T), caches [blocks, block_size, kv_heads, D] (one byte a value),
// block_table [requests, max_blocks] int32, seq_lens [requests] int32; token r is request r's query.
//
// Why CUDA beside the Triton kernel (runtime_kernels.jit.attention): with G = 4 real rows of the 16 a tensor-core dot
// needs, the Triton kernel spends its time shuffling 8-bit tiles into dot operands and runs a 16-row online softmax
// for 4 rows; it reads an FP8 cache at ~2.5 TB/s on an H200 where the bf16 one reads 4 TB/s. Here nothing is
// transposed and no row is padding:
//   - L = D / 16 lanes share a key: lane l reads 16 bytes (16 values) of the key's D, the warp 32 / L keys per load;
//   - scores: the 16 codes go to float16 pairs (cvt.rn.f16x2.e4m3x2, exact), times the lane's 16 values of each of
//     the G queries (scaled by softmax_scale * log2(e), in float16, as the Triton kernel's F16_DOTS scales it) in
//     packed half2 FMAs (8 a head), then float32 across the L lanes (shuffles);
//   - the online softmax in base 2, per warp, G rows;
//   - values: each lane adds p * v for its keys and its 16 values in float32 (v exact in float).
// A warp takes tiles of U loads (U * 32 / L keys), the next tile's codes in flight while it computes one; the block's
// warps take alternate tiles of the block's key range (a segment of the request's keys, grid.z), then add their
// states in shared memory. With one segment the block writes out; with several, its unnormalized sums, max (natural
// log) and sum into partial [tokens, heads, segments, D_PAD + 2] for runtime_kernels.jit.attention's merge kernel.
// Requires D in {64, 128, 256}, 16-byte aligned cache rows, a power-of-two block size (block_shift = its log2).

#include "gemv_common.cuh"  // the 16-bit activation types, streaming loads, packed half2 arithmetic

namespace fp8_decode_attention {

using namespace gemv_common;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kLoads = 4;  // U: 16-byte loads of keys (and of values) a lane has in flight per tile

// Four e4m3 codes (a word) as two float16 pairs: codes 0-1 and 2-3 (exact).
__device__ __forceinline__ void e4m3x4_to_half2(unsigned int word, unsigned int& low, unsigned int& high) {
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;}"
      : "=r"(low), "=r"(high) : "r"(word));
}
__device__ __forceinline__ float exp2_approx(float x) {  // 2^x; 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float minus_infinity() { return __int_as_float(0xff800000); }

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int G, int D>
__global__ void __launch_bounds__(kThreads) decode(
    const T* __restrict__ q, const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    T* __restrict__ out, float* __restrict__ partial, const int* __restrict__ block_table,
    const int* __restrict__ seq_lens, float scale, int stride_q_tok, int stride_q_head, int stride_o_tok,
    int stride_o_head, long long stride_k_block, int stride_k_slot, int stride_k_head, long long stride_v_block,
    int stride_v_slot, int stride_v_head, int stride_table, int block_shift) {
  constexpr int L = D / 16;               // lanes a key
  constexpr int kKeysPerLoad = 32 / L;    // keys a warp load covers
  constexpr int kTileKeys = kLoads * kKeysPerLoad;
  constexpr int kDPad = D;                // D is a power of two: the merge layout's HEAD_PAD
  static_assert(D == 64 || D == 128 || D == 256, "head size 64, 128 or 256");
  __shared__ float warp_acc[kWarps][G][D];
  __shared__ float warp_m[kWarps][G], warp_l[kWarps][G];

  const int req = blockIdx.x, kv_head = blockIdx.y, segment = blockIdx.z, segments = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = lane % L, group = lane / L;  // the lane's 16 values of a key; which of the load's keys
  const int seq_len = seq_lens[req];
  const int tiles = (seq_len + kTileKeys - 1) / kTileKeys;
  const int per_segment = (tiles + segments - 1) / segments;
  const int first_tile = segment * per_segment, end_tile = min(tiles, first_tile + per_segment);

  // The lane's 16 values of each query, times scale * log2(e), as float16 pairs.
  unsigned int qh[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const T* qp = q + static_cast<size_t>(req) * stride_q_tok + static_cast<size_t>(kv_head * G + h) * stride_q_head + part * 16;
    float v[16];
    load8<T>(qp, *reinterpret_cast<float(*)[8]>(v));
    load8<T>(qp + 8, *reinterpret_cast<float(*)[8]>(v + 8));
#pragma unroll
    for (int i = 0; i < 8; ++i) qh[h][i] = half2_of(v[2 * i] * scale * kLog2e, v[2 * i + 1] * scale * kLog2e);
  }

  const int* table = block_table + static_cast<size_t>(req) * stride_table;
  const int block_mask = (1 << block_shift) - 1;
  // Where this lane's keys of tile t lie, and whether they exist.
  auto key_of = [&](int t, int u) { return t * kTileKeys + u * kKeysPerLoad + group; };
  auto load_tile = [&](int t, uint4 (&kw)[kLoads], uint4 (&vw)[kLoads]) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int key = key_of(t, u);
      const bool on = t < end_tile && key < seq_len;
      const long long block = on ? table[key >> block_shift] : 0;
      const int slot = key & block_mask;
      load_streaming(kw[u], k_cache + block * stride_k_block + static_cast<long long>(slot) * stride_k_slot +
                        static_cast<long long>(kv_head) * stride_k_head + part * 16, on);
      load_streaming(vw[u], v_cache + block * stride_v_block + static_cast<long long>(slot) * stride_v_slot +
                        static_cast<long long>(kv_head) * stride_v_head + part * 16, on);
    }
  };

  float m[G], l[G], acc[G][16];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = minus_infinity();
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[h][i] = 0.0f;
  }

  uint4 kw[kLoads], vw[kLoads], next_k[kLoads], next_v[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) kw[u] = vw[u] = next_k[u] = next_v[u] = make_uint4(0, 0, 0, 0);
  int t = first_tile + warp;
  load_tile(t, kw, vw);
  for (; t < end_tile; t += kWarps) {
    load_tile(t + kWarps, next_k, next_v);  // in flight while this tile is computed

    // Scores of the lane's kLoads keys for the G queries (all L lanes of a key hold them).
    float s[kLoads][G];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const unsigned int words[4] = {kw[u].x, kw[u].y, kw[u].z, kw[u].w};
      unsigned int kh[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) e4m3x4_to_half2(words[i], kh[2 * i], kh[2 * i + 1]);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        unsigned int dot = 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fma_half2(kh[i], qh[h][i], dot);
        float v = sum_half2(dot);
#pragma unroll
        for (int offset = 1; offset < L; offset <<= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        s[u][h] = key_of(t, u) < seq_len ? v : minus_infinity();
      }
    }
    // The online softmax: the tile's max over the warp's keys, then p and the running sums.
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float tile_max = s[0][h];
#pragma unroll
      for (int u = 1; u < kLoads; ++u) tile_max = fmaxf(tile_max, s[u][h]);
#pragma unroll
      for (int offset = L; offset < 32; offset <<= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
      if (tile_max > m[h]) {  // the same on every lane: rescale only when the max grows (finite: a tile holds a key)
        const float alpha = exp2_approx(m[h] - tile_max);
        m[h] = tile_max;
        l[h] *= alpha;
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[h][i] *= alpha;
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        s[u][h] = exp2_approx(s[u][h] - m[h]);
        l[h] += s[u][h];
      }
    }
    // Values: acc += p * v, the lane's 16 values of each of its keys.
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const unsigned int words[4] = {vw[u].x, vw[u].y, vw[u].z, vw[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        unsigned int low, high;
        e4m3x4_to_half2(words[i], low, high);
        const float2 a = float2_of(low), b = float2_of(high);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          acc[h][4 * i] = fmaf(s[u][h], a.x, acc[h][4 * i]);
          acc[h][4 * i + 1] = fmaf(s[u][h], a.y, acc[h][4 * i + 1]);
          acc[h][4 * i + 2] = fmaf(s[u][h], b.x, acc[h][4 * i + 2]);
          acc[h][4 * i + 3] = fmaf(s[u][h], b.y, acc[h][4 * i + 3]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) kw[u] = next_k[u], vw[u] = next_v[u];
  }

  // The warp's state: l and acc summed over its key groups (lanes with the same part), into shared memory.
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int offset = L; offset < 32; offset <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[h][i] += __shfl_xor_sync(0xffffffffu, acc[h][i], offset);
    }
    if (group == 0) {
#pragma unroll
      for (int i = 0; i < 16; ++i) warp_acc[warp][h][part * 16 + i] = acc[h][i];
    }
    if (lane == 0) warp_m[warp][h] = m[h], warp_l[warp][h] = l[h];
  }
  __syncthreads();

  // The block's result: the warps' states rescaled to their common max and added (a warp without keys has
  // m = -inf and adds nothing).
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float m_max = warp_m[0][h];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m_max = fmaxf(m_max, warp_m[w][h]);
    float total = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = warp_m[w][h] == minus_infinity() ? 0.0f : exp2_approx(warp_m[w][h] - m_max);
      total += weight * warp_l[w][h];
      sum += weight * warp_acc[w][h][d];
    }
    const int head = kv_head * G + h;
    if (segments == 1) {
      out[static_cast<size_t>(req) * stride_o_tok + static_cast<size_t>(head) * stride_o_head + d] =
          T::round(total == 0.0f ? 0.0f : sum / total);
    } else {  // the merge kernel's row: D_PAD sums, the max in natural log, the sum
      float* row = partial + ((static_cast<size_t>(req) * gridDim.y * G + head) * segments + segment) * (kDPad + 2);
      row[d] = sum;
      if (d == 0) {
        row[kDPad] = m_max == minus_infinity() ? minus_infinity() : m_max * kLn2;
        row[kDPad + 1] = total;
      }
    }
  }
}

}  // namespace fp8_decode_attention

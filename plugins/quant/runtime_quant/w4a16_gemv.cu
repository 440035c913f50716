// One row of activations times a 4-bit weight-only layer (the batch-1 decode step), in the canonical
// layout of runtime_quant.wna16_kernels: qweight uint32 [K / 8, N] (code k of column n at bits 4 * (k % 8) of
// word k / 8), scales float32 and zeros uint8 [groups, N]; out[n] = sum_k x[k] * (q[k, n] - zero) * scale.
//
// Why CUDA and not Triton: the Triton GEMV spends ~5.6 instructions a weight (one a quarter-rate int-to-float
// conversion), and Triton has no packed half2 arithmetic. Here a weight costs ~1.7 instructions, two weights at
// a time in f16x2 registers:
//   - one LOP3 puts two nibbles (bits 0-3 and 16-19, or 4-7 and 20-23) into the mantissas of two halves of
//     1024.0: the halves are exactly 1024 + q (or 1024 + 16 q);
//   - one f16x2 subtraction of 1024 + zero (or 1024 + 16 zero) leaves q - zero (or 16 (q - zero)), exactly;
//   - one f16x2 FMA multiplies by x (x / 16 for the shifted pair) into a half2 sum of two words (8 products a
//     lane), which then goes to float32. The group's scale multiplies the float sum of its 128 rows.
// x enters as half after a power-of-two scaling that puts the block's largest |x| below 1, so no half sum can
// overflow (|sum| <= 8 * 15) whatever the activations' range (bfloat16's is wider); the block's result is
// scaled back exactly.
//
// A prologue (template P) may compute x from the previous op's output while the block reads its rows of x, so that
// the op needs no launch of its own (decode steps): kSiluAndMul takes [gate | up] rows of 2 K and uses
// silu(gate) * up; kRmsNorm / kGemmaRmsNorm take the rows before the norm (plus a residual, whose sum with them
// block (0, 0) also writes out) and use rms_norm(x + residual) (Llama's rounding, or Gemma's 1 + weight). Each
// block adds the whole row's squares itself, in one order, so all blocks use the same 1 / rms. Rounded to T as the
// separate kernels round (runtime_kernels.norm, runtime_kernels.activation).
//
// A block is 8 warps over 32 C columns (C = 4 or 2 a lane: one 16- or 8-byte load per word row) and a run of
// 128-row chunks of K; each warp takes whole chunks. Its first chunk's loads are issued before x is prepared, and while it
// computes one half of a chunk (8 word rows) the loads of the next chunk's other half are in flight. Blocks along K
// (grid.y) add their partial sums in block order, deterministic, with no zeroing kernel and no atomics on the output:
// launched as clusters of the blocks along K (template kCluster, sm_90+), block 0 of a cluster reads the others' sums
// from their shared memory; else each block writes its sums to global memory, and the last block of a column run to
// finish (an atomic counter, which it resets) adds them.

#include "gemv_common.cuh"  // runtime_kernels/cuda: the types, loads, PDL and prologues this GEMV shares

namespace w4a16 {

using namespace gemv_common;

constexpr int kChunkWords = 16;       // word rows of a chunk
constexpr int kChunkRows = kChunkWords * 8;
constexpr int kHalfWords = kChunkWords / 2;
constexpr unsigned int kLowNibbles = 0x000F000Fu;
constexpr unsigned int kHighNibbles = 0x00F000F0u;
constexpr unsigned int kHalf1024 = 0x64006400u;  // two halves of 1024.0: their mantissa's unit is 1

__device__ __forceinline__ unsigned int sub_half2(unsigned int a, unsigned int b) {
  unsigned int out;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(a), "r"(b));
  return out;
}
__device__ __forceinline__ unsigned int and_or(unsigned int a, unsigned int mask, unsigned int bits) {  // one LOP3
  unsigned int out;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(out) : "r"(a), "r"(mask), "r"(bits));
  return out;
}
// A group's scales and zero points of a lane's C columns.
template <int C> struct GroupParams {
  float scale[C];
  unsigned int zero1[C], zero16[C];  // 1024 + zero and 1024 + 16 zero, in both halves
};

template <int C>
__device__ __forceinline__ void load_scales(float (&scale)[C], unsigned int& zeros, const float* s, const unsigned char* z) {
  if constexpr (C == 4) {
    const float4 v = *reinterpret_cast<const float4*>(s);
    scale[0] = v.x, scale[1] = v.y, scale[2] = v.z, scale[3] = v.w;
    zeros = *reinterpret_cast<const unsigned int*>(z);
  } else {
    const float2 v = *reinterpret_cast<const float2*>(s);
    scale[0] = v.x, scale[1] = v.y;
    zeros = *reinterpret_cast<const unsigned short*>(z);
  }
}

// The 8 codes of `word` as (q - zero) in four half2 pairs, in the order of x's pairs (x0, x4), (x1, x5) / 16,
// (x2, x6), (x3, x7) / 16 (the second and fourth pairs hold 16 (q - zero)). `zero1` = 1024 + zero and `zero16` =
// 1024 + 16 zero, in both halves.
__device__ __forceinline__ uint4 codes_of(unsigned int word, unsigned int zero1, unsigned int zero16) {
  const unsigned int high = word >> 8;
  return make_uint4(sub_half2(and_or(word, kLowNibbles, kHalf1024), zero1),
                    sub_half2(and_or(word, kHighNibbles, kHalf1024), zero16),
                    sub_half2(and_or(high, kLowNibbles, kHalf1024), zero1),
                    sub_half2(and_or(high, kHighNibbles, kHalf1024), zero16));
}

// acc + the word's codes times x's 8 rows (`xs`, pairs as codes_of gives them), in half2.
__device__ __forceinline__ unsigned int dot_codes(uint4 codes, uint4 xs, unsigned int acc) {
  acc = fma_half2(codes.x, xs.x, acc);
  acc = fma_half2(codes.y, xs.y, acc);
  acc = fma_half2(codes.z, xs.z, acc);
  return fma_half2(codes.w, xs.w, acc);
}

// A warp's weights of one half chunk (8 word rows x C columns a lane), in flight while it computes the other.
template <int C> struct HalfChunk {
  unsigned int words[kHalfWords][C];
};

template <int C>
__device__ __forceinline__ void load_half(HalfChunk<C>& h, const unsigned int* rows, int stride_q, bool on) {
#pragma unroll
  for (int i = 0; i < kHalfWords; ++i) load_streaming(h.words[i], rows + static_cast<size_t>(i) * stride_q, on);
}

// The half chunk's products with each of the M rows of x (`xs`: the rows' pairs, `words` apart), in float: half2
// sums of two word rows (8 products a lane), then added in float.
template <int C, int M>
__device__ __forceinline__ void dot_half(const HalfChunk<C>& h, const uint4* xs, int words, const GroupParams<C>& g,
                                         float (&sums)[M][C]) {
#pragma unroll
  for (int i = 0; i < kHalfWords; i += 2) {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const uint4 codes0 = codes_of(h.words[i][j], g.zero1[j], g.zero16[j]);
      const uint4 codes1 = codes_of(h.words[i + 1][j], g.zero1[j], g.zero16[j]);
#pragma unroll
      for (int r = 0; r < M; ++r)
        sums[r][j] += sum_half2(dot_codes(codes1, xs[r * words + i + 1], dot_codes(codes0, xs[r * words + i], 0u)));
    }
  }
}

// M rows of x [M, k] (1-4: decode batches, speculative verification; rows x_stride apart, [gate | up] of 2 k with
// kSiluAndMul) into out [M, n]; each row's weights are dequantized once for all rows. grid (up to ceil(n / (32 C))
// column runs, blocks along K): a block takes column runs blockIdx.x, blockIdx.x + gridDim.x, ... over the same
// rows of x (one grid that the GPU holds at once prepares x once a block); dynamic shared memory:
// M * chunks_per_block * 16 * 16 bytes; at most 16 chunks a block. kMinBlocks: the blocks an SM must hold at once
// (2 caps registers at 128 a thread). parts: [blocks along K, M, n] float32.
// Requires k % 128 == 0, n % 4 == 0, group_rows % 128 == 0 or >= k, 16-byte aligned rows of qweight and scales,
// 4-byte aligned rows of zeros, 16-byte aligned x. kCluster: launched with clusters of (1, gridDim.y, 1) blocks
// (gridDim.y <= 8); parts and locks are then unused.
// The norm prologues: residual [M, k] or null, norm_weight [k], residual_out [M, k] (x + residual) or null, eps.
template <typename T, int C, int kMinBlocks, int M, int P, int kCluster>
__global__ void __launch_bounds__(kThreads, kMinBlocks) gemv(
    const T* __restrict__ x, const unsigned int* __restrict__ qweight, const float* __restrict__ scales,
    const unsigned char* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ parts, int* __restrict__ locks, int n, int k, int group_rows, int chunks_per_block,
    int stride_q, int stride_s, int stride_z, int has_bias, int x_stride, const T* __restrict__ residual,
    const T* __restrict__ norm_weight, T* __restrict__ residual_out, float eps) {
  constexpr bool kNorm = P == kRmsNorm || P == kGemmaRmsNorm;
  extern __shared__ uint4 xs[];  // [M][words]: per row, per word row of the block's rows: x's 4 half2 pairs
  constexpr int kCols = 32 * C;  // the block's columns
  __shared__ float partial[kWarps][kCols];
  __shared__ float block_max[M][kWarps];
  __shared__ float block_squares[kNorm ? M : 1][kWarps];
  __shared__ int is_last;
  __shared__ float cluster_sums[kCluster ? M : 1][kCluster ? kCols : 1];  // this block's sums, read by block 0

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk0 = blockIdx.y * chunks_per_block;
  const int chunks = min(chunks_per_block, k / kChunkRows - chunk0);
  const int words = chunks * kChunkWords;
  const int x0 = chunk0 * kChunkRows;  // the block's first row of x
  const int tiles = (n + kCols - 1) / kCols;  // the column runs of kCols; this block takes blockIdx.x + i gridDim.x
  // A lane's first column in a run; past N it reads column 0 (always there) and its sums are never stored.
  auto column_of = [&](int tile) {
    const int col = tile * kCols + lane * C;
    return col < n ? col : 0;
  };
  auto chunk_rows = [&](int col, int c) { return qweight + col + static_cast<size_t>((chunk0 + c) * kChunkWords) * stride_q; };
  auto group_of = [&](int c) { return static_cast<size_t>((chunk0 + c) * kChunkRows / group_rows); };

  // 1. The first chunk's weights are requested before anything else; meanwhile the block's rows of x are
  //    scaled by 2^-e (the largest |x| below 1) into shared memory, once for all its column runs.
  HalfChunk<C> first = {}, second = {};
  const int c0 = min(warp, chunks - 1);  // a warp without chunks loads nothing and computes nothing
  int col = column_of(blockIdx.x);
  load_half(first, chunk_rows(col, c0), stride_q, warp < chunks);
  load_half(second, chunk_rows(col, c0) + static_cast<size_t>(kHalfWords) * stride_q, stride_q, warp < chunks);
  float scale[C];
  unsigned int zeros_packed;
  load_scales<C>(scale, zeros_packed, scales + col + group_of(c0) * stride_s, zeros + col + group_of(c0) * stride_z);
  wait_for_previous_kernel();  // x, the residual and the counters are the previous kernels'
  // Thread r holds word row r of each row of x (chunks_per_block <= 16: one word row a thread at most); with a
  // norm, also its norm weights, and its share of the whole row's squares.
  float v[M][8];
  float w[8] = {};
  if (kNorm && threadIdx.x < words) load8<T>(norm_weight + x0 + threadIdx.x * 8, w);
#pragma unroll
  for (int r = 0; r < M; ++r) {
    const T* xr = x + static_cast<size_t>(r) * x_stride;
    const T* rr = kNorm && residual != nullptr ? residual + static_cast<size_t>(r) * k : nullptr;
    float m = 0.0f;
    if constexpr (kNorm) {
      float squares = 0.0f;
      const bool stores = residual_out != nullptr && blockIdx.x == 0 && blockIdx.y == 0;
      for (int i = threadIdx.x; i < k / 8; i += kThreads) {
        float s[8];
        load_sum8<T>(xr + i * 8, rr == nullptr ? nullptr : rr + i * 8, s);
        if (stores) store8<T>(residual_out + static_cast<size_t>(r) * k + i * 8, s);
#pragma unroll
        for (int j = 0; j < 8; ++j) squares += s[j] * s[j];
      }
      squares = warp_sum(squares);
      if (lane == 0) block_squares[r][warp] = squares;
    }
    if (threadIdx.x < words) {
      const int at = x0 + threadIdx.x * 8;
      if constexpr (P == kSiluAndMul) {
        float gate_up[8];
        load8<T>(xr + at, v[r]);
        load8<T>(xr + k + at, gate_up);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[r][j] = rounded<T>(rounded<T>(v[r][j] / (1.0f + expf(-v[r][j]))) * gate_up[j]);
      } else if constexpr (kNorm) {
        load_sum8<T>(xr + at, rr == nullptr ? nullptr : rr + at, v[r]);
      } else {
        load8<T>(xr + at, v[r]);
      }
      // With a norm, a bound of the normalized values before 1 / rms: |x w| (Llama) or |x (1 + w)| (Gemma).
#pragma unroll
      for (int j = 0; j < 8; ++j)
        m = fmaxf(m, fabsf(P == kRmsNorm ? v[r][j] * w[j] : P == kGemmaRmsNorm ? v[r][j] * (1.0f + w[j]) : v[r][j]));
    }
    m = warp_max(m);
    if (lane == 0) block_max[r][warp] = m;
  }
  __syncthreads();
  float up[M];  // 2^e of each row
#pragma unroll
  for (int r = 0; r < M; ++r) {
    float m = block_max[r][0];
    for (int i = 1; i < kWarps; ++i) m = fmaxf(m, block_max[r][i]);
    float inv_rms = 1.0f;
    if constexpr (kNorm) {
      float squares = 0.0f;
      for (int i = 0; i < kWarps; ++i) squares += block_squares[r][i];
      inv_rms = 1.0f / sqrtf(squares / static_cast<float>(k) + eps);
      m *= inv_rms;  // the normalized values' bound (rounding may pass it by a few parts in 1000: no harm)
    }
    const int biased = (__float_as_uint(m) >> 23) & 0xFF;  // m = f * 2^e, f in [0.5, 1): e = biased - 126
    const int e = biased == 0 ? 0 : min(max(biased - 126, -120), 120);
    const float down = __uint_as_float(static_cast<unsigned int>(127 - e) << 23);  // 2^-e
    up[r] = __uint_as_float(static_cast<unsigned int>(127 + e) << 23);
    if (threadIdx.x < words) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float value = v[r][j];
        if constexpr (P == kRmsNorm) value = rounded<T>(rounded<T>(value * inv_rms) * w[j]);
        if constexpr (P == kGemmaRmsNorm) value = rounded<T>(value * inv_rms * (1.0f + w[j]));
        v[r][j] = value * down;
      }
      xs[r * words + threadIdx.x] = make_uint4(half2_of(v[r][0], v[r][4]), half2_of(v[r][1] * 0.0625f, v[r][5] * 0.0625f),
                                               half2_of(v[r][2], v[r][6]), half2_of(v[r][3] * 0.0625f, v[r][7] * 0.0625f));
    }
  }
  __syncthreads();

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // 2. Each warp's chunks (c = warp, warp + 8, ...), a half chunk computed while the next one's loads fly (the
    //    next column run's first chunk after the last).
    const int next_tile = tile + gridDim.x;
    const int next_col = next_tile < tiles ? column_of(next_tile) : col;
    float acc[M][C] = {};
    for (int c = warp; c < chunks; c += kWarps) {
      const bool in_run = c + kWarps < chunks;
      const bool more = in_run || next_tile < tiles;
      const int next = in_run ? c + kWarps : warp;
      const int load_col = in_run ? col : next_col;
      GroupParams<C> g;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const float z = static_cast<float>((zeros_packed >> (8 * j)) & 0xFF);
        g.scale[j] = scale[j];
        g.zero1[j] = half2_of(1024.0f + z, 1024.0f + z);
        g.zero16[j] = half2_of(1024.0f + 16.0f * z, 1024.0f + 16.0f * z);
      }
      float sums[M][C] = {};
      dot_half<C, M>(first, xs + c * kChunkWords, words, g, sums);
      load_half(first, chunk_rows(load_col, next), stride_q, more);
      load_scales<C>(scale, zeros_packed, scales + load_col + group_of(next) * stride_s,
                     zeros + load_col + group_of(next) * stride_z);
      dot_half<C, M>(second, xs + c * kChunkWords + kHalfWords, words, g, sums);
      load_half(second, chunk_rows(load_col, next) + static_cast<size_t>(kHalfWords) * stride_q, stride_q, more);
#pragma unroll
      for (int r = 0; r < M; ++r)
#pragma unroll
        for (int j = 0; j < C; ++j) acc[r][j] += sums[r][j] * g.scale[j];
    }
    col = next_col;
    if (next_tile >= tiles) allow_next_kernel();

    // 3. The block's sums (warps added in order), then the output or this block's partial sums, row by row.
    const int out_col = tile * kCols + threadIdx.x;
    const bool writes = threadIdx.x < kCols && out_col < n;
    float total[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      __syncthreads();  // the previous row's (or column run's) partial sums are read
#pragma unroll
      for (int j = 0; j < C; ++j) partial[warp][lane * C + j] = acc[r][j];
      __syncthreads();
      total[r] = 0.0f;
      if (writes) {
        for (int w = 0; w < kWarps; ++w) total[r] += partial[w][threadIdx.x];
        total[r] *= up[r];
      }
    }
    if (gridDim.y == 1) {
      if (writes)
#pragma unroll
        for (int r = 0; r < M; ++r)
          out[static_cast<size_t>(r) * n + out_col] = T::round(has_bias ? total[r] + bias[out_col].value() : total[r]);
      continue;
    }
    if constexpr (kCluster) {
      if (writes)
#pragma unroll
        for (int r = 0; r < M; ++r) cluster_sums[r][threadIdx.x] = total[r];
      cluster_sync();  // every block's sums are in its shared memory
      if (cluster_rank() == 0 && writes) {
#pragma unroll
        for (int r = 0; r < M; ++r) {
          float sum = 0.0f;
          for (int s = 0; s < static_cast<int>(gridDim.y); ++s) sum += load_cluster_shared(&cluster_sums[r][threadIdx.x], s);
          out[static_cast<size_t>(r) * n + out_col] = T::round(has_bias ? sum + bias[out_col].value() : sum);
        }
      }
      cluster_sync();  // block 0 has read them: they may be overwritten (the next column run) or freed
      continue;
    }
    if (writes)
#pragma unroll
      for (int r = 0; r < M; ++r) parts[(static_cast<size_t>(blockIdx.y) * M + r) * n + out_col] = total[r];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&locks[tile], 1) == static_cast<int>(gridDim.y) - 1;
    __syncthreads();
    if (!is_last) continue;
    __threadfence();
    if (writes) {
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float sum = 0.0f;
        for (int s = 0; s < static_cast<int>(gridDim.y); ++s) sum += __ldcg(parts + (static_cast<size_t>(s) * M + r) * n + out_col);
        out[static_cast<size_t>(r) * n + out_col] = T::round(has_bias ? sum + bias[out_col].value() : sum);
      }
    }
    if (threadIdx.x == 0) locks[tile] = 0;  // ready for the next call
  }
}

}  // namespace w4a16

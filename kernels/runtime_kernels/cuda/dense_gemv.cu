// One row of activations times a dense weight [N, K] (row-major, rows stride_w elements apart): the batch-1 decode
// step's linear layers, out[n] = scale[n] * sum_k w[n, k] x[k] + bias[n], accumulated in float32. W is the weight's
// element: FP8 e4m3 codes (one byte; `scale` their rows' float32 scales) or the activations' own 16-bit type.
//
// Why CUDA beside the Triton gemv (runtime_kernels.jit.gemv): a grid that the GPU holds at once (each block takes
// rows n = task, task + tasks a round, ...), so a prologue (the op before the layer, gemv_common's) is computed once a
// block rather than once a program; and programmatic dependent launch, so that a layer's GEMVs overlap: each requests
// its first weights before it waits for the kernel before it (griddepcontrol.wait), and lets the next one start once
// its last weights are requested.
//
// A warp takes R rows at a time: lane l reads 16 bytes of each row at a time (16 FP8 codes or 8 16-bit weights), a
// warp a whole 512-byte stretch, U stretches per row in flight before any is used; x (after the prologue, rounded to
// T) sits in shared memory, read once for the R rows. The R sums are reduced across the warp at the end.

#include "gemv_common.cuh"

namespace dense_gemv {

using namespace gemv_common;

struct e4m3 {
  unsigned char bits;
};

// 8 weights of a 16-bit type (the activations' own).
template <typename W> struct Weights {
  static constexpr int kPerVector = 8;
  static __device__ __forceinline__ void to_float(const uint4& v, float (&out)[kPerVector]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = W{static_cast<unsigned short>(words[i] & 0xFFFF)}.value();
      out[2 * i + 1] = W{static_cast<unsigned short>(words[i] >> 16)}.value();
    }
  }
};
// 16 FP8 codes: two e4m3 pairs to half2 (exact), each half to float.
template <> struct Weights<e4m3> {
  static constexpr int kPerVector = 16;
  static __device__ __forceinline__ void to_float(const uint4& v, float (&out)[kPerVector]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      asm("{.reg .b16 lo, hi;\n .reg .b32 h0, h1;\n .reg .f16 a, b, c, d;\n"
          " mov.b32 {lo, hi}, %4;\n cvt.rn.f16x2.e4m3x2 h0, lo;\n cvt.rn.f16x2.e4m3x2 h1, hi;\n"
          " mov.b32 {a, b}, h0;\n mov.b32 {c, d}, h1;\n"
          " cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n cvt.f32.f16 %2, c;\n cvt.f32.f16 %3, d;}"
          : "=f"(out[4 * i]), "=f"(out[4 * i + 1]), "=f"(out[4 * i + 2]), "=f"(out[4 * i + 3])
          : "r"(words[i]));
  }
};

// kPerVector values of x (T, in shared memory) as float: 16 bytes a load.
template <typename T, int V> __device__ __forceinline__ void load_x(const T* p, float (&v)[V]) {
#pragma unroll
  for (int i = 0; i < V; i += 8) {
    float part[8];
    load8<T>(p + i, part);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[i + j] = part[j];
  }
}

// x [k] (or [gate | up] of 2 k with kSiluAndMul) through prologue P into out [n]: out = (P(x) @ w.T) * scale + bias.
// grid: as many blocks as the GPU holds at once, at most one per 8 R rows; dynamic shared memory 2 k bytes.
// Requires k % 16 == 0 (k % 8 for 16-bit weights), 16-byte aligned x, w and rows of w (stride_w).
// The norm prologues: residual [k] or null, norm_weight [k], residual_out [k] (x + residual, written by block 0) or
// null, eps. scale (has_scale) float32 [n]; bias (has_bias) [n].
template <typename T, typename W, int R, int U, int P>
__global__ void __launch_bounds__(kThreads) gemv(
    const T* __restrict__ x, const W* __restrict__ w, const float* __restrict__ scale, const T* __restrict__ bias,
    T* __restrict__ out, int n, int k, long long stride_w, int has_scale, int has_bias, const T* __restrict__ residual,
    const T* __restrict__ norm_weight, T* __restrict__ residual_out, float eps) {
  constexpr bool kNorm = P == kRmsNorm || P == kGemmaRmsNorm;
  constexpr int V = Weights<W>::kPerVector;
  extern __shared__ uint4 shared_x[];
  T* xs = reinterpret_cast<T*>(shared_x);  // [k]: x after the prologue
  __shared__ float block_squares[kWarps];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int vectors = k / V;  // 16-byte vectors a row
  const int steps = (vectors + 31) / 32;  // 512-byte stretches a row
  const int tasks = (n + R - 1) / R;
  const int warps_total = gridDim.x * kWarps;
  int task = blockIdx.x * kWarps + warp;

  uint4 tile[R][U];
  // Stretches s0 .. s0 + U - 1 of the task's rows (rows past n read row n - 1; stretches past k nothing).
  auto load_tile = [&](int t, int s0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(t * R + r, n - 1);
      const unsigned int* base = reinterpret_cast<const unsigned int*>(w + static_cast<long long>(row) * stride_w);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int vec = (s0 + u) * 32 + lane;
        unsigned int (&words)[4] = *reinterpret_cast<unsigned int (*)[4]>(&tile[r][u]);
        load_streaming(words, base + 4 * static_cast<long long>(min(vec, vectors - 1)), vec < vectors);
      }
    }
  };

  // 1. The first stretches are requested before anything else; then, once the kernel before has finished, x goes
  //    through the prologue into shared memory.
  if (task < tasks) load_tile(task, 0);
  wait_for_previous_kernel();  // x, the residual are the previous kernels'
  if constexpr (kNorm) {
    float squares = 0.0f;
    const bool stores = residual_out != nullptr && blockIdx.x == 0;
    for (int i = threadIdx.x; i < k / 8; i += kThreads) {
      float s[8];
      load_sum8<T>(x + i * 8, residual == nullptr ? nullptr : residual + i * 8, s);
      if (stores) store8<T>(residual_out + i * 8, s);
      store8<T>(xs + i * 8, s);
#pragma unroll
      for (int j = 0; j < 8; ++j) squares += s[j] * s[j];
    }
    squares = warp_sum(squares);
    if (lane == 0) block_squares[warp] = squares;
    __syncthreads();
    squares = 0.0f;
    for (int i = 0; i < kWarps; ++i) squares += block_squares[i];
    const float inv_rms = 1.0f / sqrtf(squares / static_cast<float>(k) + eps);
    for (int i = threadIdx.x; i < k / 8; i += kThreads) {  // the same elements this thread wrote
      float s[8], nw[8];
      load8<T>(xs + i * 8, s);
      load8<T>(norm_weight + i * 8, nw);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        s[j] = P == kRmsNorm ? rounded<T>(rounded<T>(s[j] * inv_rms) * nw[j]) : rounded<T>(s[j] * inv_rms * (1.0f + nw[j]));
      store8<T>(xs + i * 8, s);
    }
  } else if constexpr (P == kSiluAndMul) {
    for (int i = threadIdx.x; i < k / 8; i += kThreads) {
      float gate[8], up[8];
      load8<T>(x + i * 8, gate);
      load8<T>(x + k + i * 8, up);
#pragma unroll
      for (int j = 0; j < 8; ++j) gate[j] = rounded<T>(rounded<T>(gate[j] / (1.0f + expf(-gate[j]))) * up[j]);
      store8<T>(xs + i * 8, gate);
    }
  } else {
    for (int i = threadIdx.x; i < k / 8; i += kThreads) shared_x[i] = reinterpret_cast<const uint4*>(x)[i];
  }
  __syncthreads();
  if (task >= tasks) allow_next_kernel();  // a warp without rows

  // 2. The warp's tasks: U stretches of its R rows in flight, then their products with x.
  for (; task < tasks; task += warps_total) {
    float acc[R] = {};
    for (int s0 = 0; s0 < steps; s0 += U) {
      if (s0 > 0) load_tile(task, s0);  // the first tile of the first task is already in flight
      if (task + warps_total >= tasks && s0 + U >= steps) allow_next_kernel();
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int vec = (s0 + u) * 32 + lane;
        if (vec < vectors) {
          float xv[V];
          load_x<T, V>(xs + vec * V, xv);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float wv[V];
            Weights<W>::to_float(tile[r][u], wv);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[r] = fmaf(wv[j], xv[j], acc[r]);
          }
        }
      }
    }
    // The next task's first tile (a warp with another task); the sums are then reduced while it flies.
    const int next = task + warps_total;
    if (next < tasks) load_tile(next, 0);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float sum = warp_sum(acc[r]);
      const int row = task * R + r;
      if (lane == 0 && row < n) {
        float value = has_scale ? sum * scale[row] : sum;
        if (has_bias) value += bias[row].value();
        out[row] = T::round(value);
      }
    }
  }
}

}  // namespace dense_gemv

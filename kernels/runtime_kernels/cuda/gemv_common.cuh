// What the one-row CUDA GEMVs share (runtime_kernels/cuda/dense_gemv.cu, runtime-plugin-quant's w4a16_gemv.cu): the
// activations' 16-bit types, streaming weight loads, programmatic dependent launch, warp reductions, and the prologues
// (the op before the layer, computed as x is read), rounded as runtime_kernels.norm / runtime_kernels.activation round.
#pragma once

namespace gemv_common {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The activations' 16-bit types: their bits, read as float and rounded (to nearest even) from float.
struct f16 {
  unsigned short bits;
  __device__ __forceinline__ float value() const {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(bits));
    return v;
  }
  static __device__ __forceinline__ f16 round(float v) {
    f16 out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
    return out;
  }
};
struct bf16 {
  unsigned short bits;
  __device__ __forceinline__ float value() const { return __uint_as_float(static_cast<unsigned int>(bits) << 16); }
  static __device__ __forceinline__ bf16 round(float v) {
    bf16 out;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(v));
    return out;
  }
};


// Packed half2 arithmetic: two float16 values in a 32-bit register (the low half first).
__device__ __forceinline__ unsigned int half2_of(float low, float high) {
  unsigned int out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(high), "f"(low));
  return out;
}
__device__ __forceinline__ unsigned int fma_half2(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int out;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(c));
  return out;
}
__device__ __forceinline__ float2 float2_of(unsigned int a) {
  float low, high;
  asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(low), "=f"(high) : "r"(a));
  return make_float2(low, high);
}
__device__ __forceinline__ float sum_half2(unsigned int a) {
  const float2 v = float2_of(a);
  return v.x + v.y;
}

// Weights are read once: not kept in L1. Predicated rather than branched, so that the compiler keeps the
// next half chunk's loads where they are written (ahead of the other half's arithmetic).
__device__ __forceinline__ void load_streaming(unsigned int (&v)[4], const unsigned int* address, bool on) {
  asm volatile(
      "{.reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];}"
      : "+r"(v[0]), "+r"(v[1]), "+r"(v[2]), "+r"(v[3]) : "l"(address), "r"(static_cast<int>(on)));
}
__device__ __forceinline__ void load_streaming(unsigned int (&v)[2], const unsigned int* address, bool on) {
  asm volatile("{.reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];}"
               : "+r"(v[0]), "+r"(v[1]) : "l"(address), "r"(static_cast<int>(on)));
}

// Programmatic dependent launch (sm_90+; elsewhere no-ops): a GEMV launched with it may start while the kernel before
// it finishes; it requests its first weights (which no kernel writes) before it waits for that kernel's results, and
// lets the kernel after it start once its own weights are all read.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Thread block clusters (sm_90+; launched with a cluster dimension): the blocks of a cluster meet at a barrier
// (release / acquire: each sees the shared memory the others wrote before it) and read one another's shared memory.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;\n barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned int cluster_rank() {
  unsigned int rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
  return rank;
}
// The float at `p` (this block's shared memory) in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float load_cluster_shared(const float* p, unsigned int rank) {
  float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

constexpr int kPlain = 0, kSiluAndMul = 1, kRmsNorm = 2, kGemmaRmsNorm = 3;  // the prologues

template <typename T> __device__ __forceinline__ float rounded(float v) { return T::round(v).value(); }

// 8 consecutive values at `p` (16-byte aligned) as float.
template <typename T> __device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned int packed[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = T{static_cast<unsigned short>(packed[j] & 0xFFFF)}.value();
    v[2 * j + 1] = T{static_cast<unsigned short>(packed[j] >> 16)}.value();
  }
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  unsigned int packed[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    packed[j] = static_cast<unsigned int>(T::round(v[2 * j]).bits) | (static_cast<unsigned int>(T::round(v[2 * j + 1]).bits) << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}
// x + residual (rounded to T; x alone without a residual).
template <typename T> __device__ __forceinline__ void load_sum8(const T* x, const T* residual, float (&v)[8]) {
  load8<T>(x, v);
  if (residual != nullptr) {
    float r[8];
    load8<T>(residual, r);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = rounded<T>(v[j] + r[j]);
  }
}


}  // namespace gemv_common

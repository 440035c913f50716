// One-shot all-reduce over CUDA IPC buffers for small messages on the GPUs of one host.
//
// Every rank owns one IPC-shared allocation (its "workspace") and maps its peers':
//
//   [0, kFlagsBytes)              flags[kMaxBlocks][kMaxRanks]: flags[b][src] = the epoch src's block b reached
//   [kFlagsBytes, +kCountersBytes) counters[kMaxBlocks]: this rank's epoch of each block index (local use only)
//   [kHeaderBytes, ...)           data[2][kRanks][max_blocks][region_vecs] of 16-byte vectors: the halves are
//                                 used in turn (by epoch parity), one slot per source rank
//
// Block b of a call takes a contiguous run of the message's 16-byte vectors and puts it in slot `rank` of its
// region: of every rank's workspace (push: remote stores, so the sum reads local memory only) or of its own
// (pull: the sum reads the peers' workspaces). Then it raises its flag in every peer's workspace (release,
// system scope), waits for every peer's block b to raise theirs (acquire), sums the run's slots in rank order
// (float32 accumulators, rounded once) and writes the sum over its input (in place).
//
// Why this is safe under CUDA-graph replay, with no host involvement: epochs live in device memory and each
// block index advances its own by one per call, so a replayed graph keeps counting. Every rank makes the same
// calls with the same sizes (the same grids), so block b has the same epoch on every rank. A region written
// at epoch e was last read at epoch e - 2; between them this block passed the barrier of epoch e - 1 with
// every peer, which means each peer's previous kernel (that of e - 2) had finished. Flags only grow, and a
// waiter accepts any epoch at or past its own (a peer may already have moved on), compared modulo 2^32.
// The sum order is rank 0, 1, ... on every rank, so all ranks get bitwise-identical results.

namespace one_shot {

constexpr int kMaxBlocks = 64;
constexpr int kMaxRanks = 8;
constexpr int kFlagsBytes = kMaxBlocks * kMaxRanks * 4;
constexpr int kCountersBytes = kMaxBlocks * 4;
constexpr int kHeaderBytes = 4096;
static_assert(kFlagsBytes + kCountersBytes <= kHeaderBytes, "the header holds flags and counters");

__device__ __forceinline__ void store_release(unsigned int* address, unsigned int value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* address) {
  unsigned int value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// 16-bit floats as their bits, converted by PTX (no CUDA headers, so NVRTC needs no include path).
struct f16 {
  unsigned short bits;
};
struct bf16 {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(x.bits));
  return value;
}
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(static_cast<unsigned int>(x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 out;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(x));
  return out;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {  // round to nearest even, as torch
  bf16 out;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out.bits) : "f"(x));
  return out;
}

// data: this rank's message (num_vecs 16-byte vectors, 16-byte aligned), replaced by the sum.
// workspaces: every rank's workspace as mapped in this process, in rank order.
template <typename T, int kRanks, bool kPush>
__global__ void __launch_bounds__(512) all_reduce(uint4* data, const unsigned long long* workspaces, int rank,
                                                  int num_vecs, int max_blocks, int region_vecs) {
  constexpr int kPerVec = 16 / sizeof(T);
  const int block = blockIdx.x;
  char* bases[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; ++r) bases[r] = reinterpret_cast<char*>(workspaces[r]);
  char* own = reinterpret_cast<char*>(workspaces[rank]);
  unsigned int* flags = reinterpret_cast<unsigned int*>(own);
  unsigned int* counters = reinterpret_cast<unsigned int*>(own + kFlagsBytes);

  __shared__ unsigned int epoch_shared;
  if (threadIdx.x == 0) {
    epoch_shared = counters[block] + 1;
    counters[block] = epoch_shared;
  }
  __syncthreads();
  const unsigned int epoch = epoch_shared;

  const int per_block = (num_vecs + gridDim.x - 1) / gridDim.x;
  const int first = block * per_block;
  const int count = min(per_block, num_vecs - first);
  const long long slot_bytes = (long long)max_blocks * region_vecs * 16LL;  // one source rank's slot of a half
  const long long region = kHeaderBytes + (long long)(epoch & 1) * kRanks * slot_bytes + (long long)block * region_vecs * 16LL;
  uint4* run = data + first;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const uint4 value = run[i];
    if (kPush) {
#pragma unroll
      for (int r = 0; r < kRanks; ++r) reinterpret_cast<uint4*>(bases[r] + region + rank * slot_bytes)[i] = value;
    } else {
      reinterpret_cast<uint4*>(own + region + rank * slot_bytes)[i] = value;
    }
  }
  __syncthreads();

  if (threadIdx.x < kRanks) {  // thread t signals rank t and waits for rank t
    unsigned int* peer_flags = reinterpret_cast<unsigned int*>(workspaces[threadIdx.x]);  // t is not a constant
    store_release(peer_flags + block * kMaxRanks + rank, epoch);
    const unsigned int* waited = flags + block * kMaxRanks + threadIdx.x;
    while (static_cast<int>(load_acquire(waited) - epoch) < 0) {
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    float sum[kPerVec];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      const char* slot = (kPush ? own : bases[r]) + region + r * slot_bytes;
      uint4 packed = reinterpret_cast<const uint4*>(slot)[i];
      const T* values = reinterpret_cast<const T*>(&packed);
#pragma unroll
      for (int k = 0; k < kPerVec; ++k) sum[k] = r == 0 ? to_float(values[k]) : sum[k] + to_float(values[k]);
    }
    uint4 out;
    T* outs = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) outs[k] = from_float<T>(sum[k]);
    run[i] = out;
  }
}

}  // namespace one_shot

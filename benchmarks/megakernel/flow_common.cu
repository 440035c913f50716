// The parts of designs 6 and 7 (flow_chain.cu) that are not a role of a warp: constants, PTX helpers, the walk over a
// block's units, the block's shared state and the x loads. Compiled after ring_chain.cu and before flow_chain.cu.
namespace flow_chain {
using namespace gemv_common;
using ring_chain::commit;
using ring_chain::copy16;
using ring_chain::kControl;
using ring_chain::kConsumers;
using ring_chain::kKc;
using ring_chain::kRows;
using ring_chain::wait_groups;

constexpr int kMaxChunks = 7;  // k <= 14,336
constexpr int kMaxGroup = 8;
constexpr int kCounters = 16;  // chunk counters an op: n <= 32,768
constexpr int kChunkVectors = kKc / 8;  // 16-byte vectors of a 16-bit chunk of x: the same for bf16 in and f16 out
// Stager threads: control warps 1-3 (warp 0 stores rows and raises the counters), or all 4 with tagged data.
template <bool TAGGED> constexpr int kStagersOf = TAGGED ? kControl : kControl - 32;
constexpr int kTiles = 64;  // the ring of finished super-tiles a block hands from its consumers to its releaser

__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned int load_relaxed(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A 16-byte load the compiler may not assume unchanged between iterations of a polling loop (a plain load's loop was
// compiled as if it ended at once).
__device__ __forceinline__ uint4 load_relaxed128(const uint4* p) {
  uint4 w;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ int load_acquire_cta(const volatile int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(v) : "r"(ring_chain::smem_addr(const_cast<int*>(p))) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_cta(volatile int* p, int v) {
  asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(ring_chain::smem_addr(const_cast<int*>(p))), "r"(v) : "memory");
}
// A = rows g (a0, a2) and g + 8 (a1, a3) of a 16 x 16 float16 tile, B = its 16 x 8 transposed column block.
__device__ __forceinline__ void mma_f16(float (&c)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                        unsigned int b0, unsigned int b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// 4 FP8 codes to two float16 pairs: bytes 0-1 to lo, 2-3 to hi (the lower byte to the lower half).
__device__ __forceinline__ void e4m3_pairs(unsigned int word, unsigned int& lo, unsigned int& hi) {
  asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi) : "r"(word));
}
__device__ __forceinline__ unsigned int f16x2(float lo, float hi) {
  unsigned int v;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  return v;
}
__device__ __forceinline__ float round_bf16(float v) { return bf16::round(v).value(); }
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A block's work, one unit at a time: chunk c of super-tile st0 + g * grid of op j, in a group of gs super-tiles
// from st0 (chunk-major within the group). Super-tiles past an op's end carry on into the next op (round-robin over
// the ops' concatenation).
struct Unit {
  int j, st0, gs, c, g;
  int stride = static_cast<int>(gridDim.x), e = 0;  // super-tiles between a group's; (design 11) the block's entry
  __device__ __forceinline__ int st() const { return st0 + g * stride; }
};
struct Walk {
  const int *n, *k, *meta;  // meta[j] & 0xFF: op j's group
  int num_ops;
  __device__ __forceinline__ int supers(int j) const { return (n[j] + kRows - 1) / kRows; }
  __device__ __forceinline__ bool start_group(Unit& u) const {
    while (u.j < num_ops && u.st0 >= supers(u.j)) u.st0 -= supers(u.j), ++u.j;
    if (u.j >= num_ops) return false;
    u.gs = min(meta[u.j] & 0xFF, (supers(u.j) - 1 - u.st0) / static_cast<int>(gridDim.x) + 1);
    u.c = u.g = 0;
    return true;
  }
  __device__ __forceinline__ bool first(Unit& u) const {
    u = Unit{0, static_cast<int>(blockIdx.x), 0, 0, 0, static_cast<int>(gridDim.x), 0};
    return start_group(u);
  }
  __device__ __forceinline__ bool next(Unit& u) const {
    if (++u.g < u.gs) return true;
    u.g = 0;
    if (++u.c < k[u.j] / kKc) return true;
    u.st0 += u.gs * gridDim.x;
    return start_group(u);
  }
};

// Design 11 (DYNAMIC): a block takes op j's groups (group[j] consecutive super-tiles, chunk-major) from a counter
// of op j (grab[j], zero at each launch), so fast blocks take more and no block is left with the op's last rows.
// Consumer warp 0's lane 0 grabs for the block as its copies run ahead: the queue in shared memory holds the
// block's next entries (kDepth ahead of warp 0's copies, one grab in flight); every warp reads them in order.
constexpr int kGrabQueue = 16, kDepth = 3;
struct DynWalk {
  const int *n, *k, *meta;
  int num_ops;
  unsigned int* grab;
  volatile int* queue;
  volatile int* count;
  volatile int* used;
  int pj = 0, pending = -1;  // the producer's: the op it grabs from, the grab in flight
  bool done = false;
  __device__ __forceinline__ int supers(int j) const { return (n[j] + kRows - 1) / kRows; }
  __device__ __forceinline__ int group(int j) const { return meta[j] & 0xFF; }
  __device__ __forceinline__ int groups(int j) const { return (supers(j) + group(j) - 1) / group(j); }
  __device__ __forceinline__ int take(int j) { return groups(j) > 0 ? static_cast<int>(atomicAdd(grab + j, 1u)) : 1 << 30; }
  __device__ __forceinline__ void produce() {  // the grab in flight becomes an entry; the next grab goes out
    if (done) return;
    int entry = -1;
    for (int idx = pending;;) {
      if (idx < groups(pj)) {
        entry = pj << 16 | idx;
        break;
      }
      if (++pj >= num_ops) break;
      idx = take(pj);
    }
    int slowest = *count;
    do {  // the slot must be read by every warp's walk first
      slowest = *count;
      for (int w = 0; w < kWarps; ++w) slowest = min(slowest, used[w]);
    } while (*count - slowest >= kGrabQueue);
    queue[*count % kGrabQueue] = entry;
    __threadfence_block();
    *count = *count + 1;
    if (entry < 0) {
      done = true;
      return;
    }
    pending = take(pj);
  }
  __device__ void start() {  // thread 0 of the block, before the walks
    pending = take(0);
    for (int i = 0; i < kDepth; ++i) produce();
  }
  __device__ __forceinline__ bool load(Unit& u) const {
    while (*count <= u.e) {
    }
    const int entry = queue[u.e % kGrabQueue];
    if (entry < 0) return false;
    u.j = entry >> 16;
    u.st0 = (entry & 0xFFFF) * group(u.j);
    u.gs = min(group(u.j), supers(u.j) - u.st0);
    u.c = u.g = 0;
    u.stride = 1;
    return true;
  }
  __device__ __forceinline__ bool first(Unit& u) const {
    u.e = 0;
    return load(u);
  }
  __device__ __forceinline__ bool next(Unit& u) const {
    if (++u.g < u.gs) return true;
    u.g = 0;
    if (++u.c < k[u.j] / kKc) return true;
    ++u.e;
    return load(u);
  }
};

// The block's shared state besides the weight ring and the staged x.
struct Shared {
  float x_scale[2][kMaxChunks];
  volatile int staged[2][kMaxChunks];  // the op whose chunk a buffer holds (-1: none yet)
  volatile int progress[kWarps];       // every consumer warp is through with the ops before this one
  float part[kWarps][kMaxGroup][2];    // lane 0's partial sums of its two rows, a super-tile of the group
  union {
    volatile unsigned long long tiles[kTiles][kWarps];  // (tile number + 1) << 32 | the warp's 2 rows, bf16
    struct {  // TAGGED (which has no releaser): kind 6's q of the GQA group, and the new k and v, bf16 bits
      unsigned short q[4][128], k[128], v[128];
    } attention;
  };
  float chunk_max[kControl / 32];
  float chunk_sq[kControl / 32];  // a norm's sums of squares, a stager warp's share of a chunk
  float rnorm[2];                 // a norm's 1 / rms, an x buffer's (written with its last chunk)
  unsigned int epoch;
  int trace_j0;
  volatile int grabbed[16];   // design 11: the block's groups, j << 16 | group (-1: no more), in order
  volatile int grabbed_count; // entries written
  volatile int used[8];       // the entry each consumer warp's units come from
};
// An op's input and output (TAGGED only; kind 0 and no residual otherwise), in meta[j] = group | kind << 8 |
// (how many ops back its residual was written, 0: 2) << 16:
//   kind 0: x as the previous op wrote it;
//   kind 1: RMSNorm(x) * aux[j] (the norm's weight, bf16), with the norm's 1 / rms folded into the output rows
//           (W (x g) / rms: x g is staged, each chunk as it comes, and the rows are scaled once all are in);
//   kind 2: SiLU(x[:k]) * x[k:2k] (a gate/up output), each rounded to bf16 as a model's MLP rounds it;
//   kind 3: the same of a gate/up output whose rows alternate 2,048 of gate and 2,048 of up (its weight's rows so
//           permuted), so that a chunk's gate and up rows are finished at about the same time.
//   kinds 4 and 5: attention and its merge (flow_attention.cu), ops without rows; kind 6: attention with lanes over
//           positions (its merge is kind 5 too).
// res[j] (or 0): a residual added to the output rows (an op before wrote it, or it came before the launch), as
// bf16(res + bf16(row)).
struct Ops {
  const long long *w, *s, *x, *o;
  const int *n, *k, *meta;
  const long long *aux, *res;
  int num_ops;
  unsigned int* counters;
  unsigned long long* waits;
  unsigned int epoch;
  int trace_j0;  // TAGGED with waits: the first of kTraceOps ops whose times the blocks record (-1: none)
  __device__ __forceinline__ unsigned int tag_of(int j) const {  // of op j's output (TAGGED; > 0xFFFF: none to check)
    return j < 0 ? 0x10000u : (epoch * static_cast<unsigned int>(num_ops) + j + 1) & 0xFFFFu;
  }
  __device__ __forceinline__ int kind(int j) const { return (meta[j] >> 8) & 0xFF; }
  __device__ __forceinline__ int residual_from(int j) const {  // the op that wrote op j's residual
    const int back = (meta[j] >> 16) & 0xFF;
    return j - (back ? back : 2);
  }
};

// A stager's share of a chunk of x, E vectors of 8 activations (vector ct + u * stride, those below kChunkVectors), as
// float: bf16 (a 16-byte vector each), or with TAGGED 32-bit tagged values (two vectors each), all read at once, and
// again (all) until every tag is `tag` (tag > 0xFFFF: no check). With P = 2 (TAGGED), the same share of a second
// chunk at base2 as well, polled together (f[E + u]: base2's).
template <bool TAGGED, int E, int P = 1>
__device__ __forceinline__ void load_x(const long long base, const long long base2, int ct, int stride, unsigned int tag,
                                       float (&f)[P * E][8]) {
  if constexpr (TAGGED) {
    unsigned int words[P * E][8];
    while (true) {
#pragma unroll
      for (int u = 0; u < P * E; ++u) {
        if (ct + (u % E) * stride >= kChunkVectors) continue;
        const uint4* src = reinterpret_cast<const uint4*>(u < E ? base : base2) + 2 * (ct + (u % E) * stride);
        const uint4 a = load_relaxed128(src), b = load_relaxed128(src + 1);
        words[u][0] = a.x, words[u][1] = a.y, words[u][2] = a.z, words[u][3] = a.w;
        words[u][4] = b.x, words[u][5] = b.y, words[u][6] = b.z, words[u][7] = b.w;
      }
      bool ready = true;
#pragma unroll
      for (int u = 0; u < P * E; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q)
          ready = ready && (tag > 0xFFFFu || ct + (u % E) * stride >= kChunkVectors || (words[u][q] >> 16) == tag);
      if (ready) break;
      __nanosleep(20);
    }
#pragma unroll
    for (int u = 0; u < P * E; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) f[u][q] = __uint_as_float(words[u][q] << 16);
  } else {
    static_assert(P == 1, "a second chunk is read with tagged data only");
#pragma unroll
    for (int u = 0; u < E; ++u) {
      if (ct + u * stride >= kChunkVectors) continue;
      const uint4 v = __ldcg(reinterpret_cast<const uint4*>(base) + ct + u * stride);
      const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) f[u][2 * q] = __uint_as_float(words[q] << 16), f[u][2 * q + 1] = __uint_as_float(words[q] & 0xFFFF0000u);
    }
  }
}

// The timeline (WAITS with TRACE): after waits' [blocks][2], [blocks][kTraceOps][4] globaltimer ns of op trace_j0 + d:
// 0: the stagers start on it, 1: they are through with it, 2: consumer warp 0's first unit of it has its x,
// 3: that warp's last unit of it stored its rows.
constexpr int kTraceOps = 8;
// Ops without rows (attention, the merge) record their own steps in 2 and 3 (flow_attention.cu says which).
__device__ __forceinline__ unsigned long long* trace_slots(const Ops& ops, int j) {  // op j's 4, or null
  const int d = j - ops.trace_j0;
  if (ops.waits == nullptr || ops.trace_j0 < 0 || d < 0 || d >= kTraceOps) return nullptr;
  return ops.waits + 2 * gridDim.x + (blockIdx.x * kTraceOps + d) * 4;
}
__device__ __forceinline__ void trace(const Ops& ops, int j, int event) {
  if (unsigned long long* slots = trace_slots(ops, j)) slots[event] = now();
}

}  // namespace flow_chain

// Design 9's attention (benchmarks/megakernel/layer_chain.py): batch-1 decode attention as two ops of the persistent
// kernel that no consumer warp computes (they have no rows): the stager warps of the blocks run them between their
// stagings. Compiled after flow_common.cu and before flow_chain.cu.
//
// kind 4, split-KV attention: unit u < kv_heads * splits (block u, u + grid, ...) takes KV head u / splits and split
// u % splits of the positions 0..pos. Its 4 stager warps are the GQA group's q heads (a warp a head, lane l holding dims 4l..4l+3):
// rotary (rotate-half) on q and on the new k, rounded as a model rounds it; online softmax over the split's positions
// (the cache's, and the new k and v at pos); the partial (128 sums, max, sum of exps) stored as 64-bit words, the
// float and above it the op's tag. The split holding pos also writes the new k and v into the cache.
// kind 5, the merge: block h < q_heads merges head h's splits into its 128 outputs, bf16 with the op's 16-bit tag, as
// the next op's x.
#ifndef INLINE_ATTENTION
#define INLINE_ATTENTION __forceinline__  // (__noinline__: 2.79 against 2.71 ms, session 37)
#endif
namespace flow_chain {

struct Attention {  // aux[j] of both ops: int64 words
  long long k_cache, v_cache, cos, sin;  // caches [positions][kv_heads][128] bf16; cos, sin [128] float (bf16 values)
  long long pos, splits, kv_heads, group;  // group: q heads a KV head
};
constexpr int kHeadDim = 128;
constexpr int kPartial = kHeadDim + 2;  // a partial's words: 128 sums, the max, the sum of exps
constexpr int kBatch = 4;               // positions whose k and v a lane has in flight at once

__device__ __forceinline__ void store_tagged64(unsigned long long* p, float v, unsigned int tag) {
  const unsigned long long word = __float_as_uint(v) | static_cast<unsigned long long>(tag) << 32;
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(word) : "memory");
}
__device__ __forceinline__ unsigned long long load_relaxed64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// 4 tagged activations (bf16 | tag << 16) at p, read until their tags are `tag`.
__device__ __forceinline__ void load_tagged4(const unsigned int* p, unsigned int tag, float (&v)[4]) {
  uint4 w;
  do {
    w = load_relaxed128(reinterpret_cast<const uint4*>(p));
  } while ((w.x >> 16) != tag || (w.y >> 16) != tag || (w.z >> 16) != tag || (w.w >> 16) != tag);
  v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.y << 16);
  v[2] = __uint_as_float(w.z << 16), v[3] = __uint_as_float(w.w << 16);
}
// Rotate-half rotary on the 4 dims 4 lane .. 4 lane + 3 (the partner dims are 64 away: lane ^ 16), rounded to bf16 at
// each step as a model in bf16 computes x cos + rotate_half(x) sin.
__device__ __forceinline__ void rotary(float (&v)[4], const float* cos, const float* sin, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float partner = __shfl_xor_sync(0xffffffffu, v[i], 16);
    const int d = 4 * lane + i;
    const float rot = d < kHeadDim / 2 ? -partner : partner;
    v[i] = round_bf16(round_bf16(v[i] * cos[d]) + round_bf16(rot * sin[d]));
  }
}
__device__ __forceinline__ void load_bf16x4(const bf16* p, float (&v)[4]) {
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
  v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.x & 0xFFFF0000u);
  v[2] = __uint_as_float(w.y << 16), v[3] = __uint_as_float(w.y & 0xFFFF0000u);
}

__device__ __forceinline__ void attention_unit(const Attention& a, int unit, long long x, long long o, unsigned int tag,
                                               unsigned int own, int stager_warp) {
  const int lane = threadIdx.x & 31, splits = static_cast<int>(a.splits);
  const int kv_heads = static_cast<int>(a.kv_heads), group = static_cast<int>(a.group), pos = static_cast<int>(a.pos);
  const int h = unit / splits, s = unit % splits, head = h * group + stager_warp, len = pos + 1;
  const int span = (len + splits - 1) / splits, p0 = min(s * span, len), p1 = min(p0 + span, len);
  const unsigned int* qkv = reinterpret_cast<const unsigned int*>(x);
  const float* cos = reinterpret_cast<const float*>(a.cos);
  const float* sin = reinterpret_cast<const float*>(a.sin);
  const int q_size = kv_heads * group * kHeadDim, kv_size = kv_heads * kHeadDim;
  float q[4], k_new[4], v_new[4];
  load_tagged4(qkv + head * kHeadDim + 4 * lane, tag, q);
  rotary(q, cos, sin, lane);
  if (p1 == len) {  // the new token's k and v are in this split
    load_tagged4(qkv + q_size + h * kHeadDim + 4 * lane, tag, k_new);
    load_tagged4(qkv + q_size + kv_size + h * kHeadDim + 4 * lane, tag, v_new);
    rotary(k_new, cos, sin, lane);
    if (stager_warp == 0) {  // into the cache, for the steps after this one
      const long long at = (static_cast<long long>(pos) * kv_heads + h) * kHeadDim + 4 * lane;
      bf16* kc = reinterpret_cast<bf16*>(a.k_cache) + at;
      bf16* vc = reinterpret_cast<bf16*>(a.v_cache) + at;
#pragma unroll
      for (int i = 0; i < 4; ++i) kc[i] = bf16::round(k_new[i]), vc[i] = bf16::round(v_new[i]);
    }
  }
  const float scale = rsqrtf(static_cast<float>(kHeadDim));
  float m = -__int_as_float(0x7f800000), l = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int p = p0; p < p1; p += kBatch) {
    float keys[kBatch][4], values[kBatch][4];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {  // every load of the batch in flight at once
      const int at = p + b;
      if (at >= p1 || at == pos) continue;
      const long long off = (static_cast<long long>(at) * kv_heads + h) * kHeadDim + 4 * lane;
      load_bf16x4(reinterpret_cast<const bf16*>(a.k_cache) + off, keys[b]);
      load_bf16x4(reinterpret_cast<const bf16*>(a.v_cache) + off, values[b]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int at = p + b;
      if (at >= p1) continue;  // (not break: the loop must unroll, its arrays stay in registers)
      const bool fresh = at == pos;  // (no pointer into the register arrays: that would put them in memory)
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) dot += q[i] * (fresh ? k_new[i] : keys[b][i]);
      const float logit = warp_sum(dot) * scale;
      const float m_new = fmaxf(m, logit), correction = __expf(m - m_new), weight = __expf(logit - m_new);
      l = l * correction + weight;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = acc[i] * correction + weight * (fresh ? v_new[i] : values[b][i]);
      m = m_new;
    }
  }
  unsigned long long* out = reinterpret_cast<unsigned long long*>(o) + (head * splits + s) * kPartial;
#pragma unroll
  for (int i = 0; i < 4; ++i) store_tagged64(out + 4 * lane + i, acc[i], own);
  if (lane == 0) store_tagged64(out + kHeadDim, m, own), store_tagged64(out + kHeadDim + 1, l, own);
}

// kind 4 (by the 4 stager warps of a block: 4 = group). x: the qkv output (tagged, `tag`), o: the partials (tagged
// `own`). Not inlined: the stagers' registers would be the sum of both.
__device__ __noinline__ void attention_split(long long aux, long long x, long long o, unsigned int tag, unsigned int own,
                                             int stager_warp) {
  const Attention& a = *reinterpret_cast<const Attention*>(aux);
  if (stager_warp >= a.group) return;
  for (int unit = blockIdx.x; unit < a.kv_heads * a.splits; unit += gridDim.x)
    attention_unit(a, unit, x, o, tag, own, stager_warp);
}

// kind 5 (by the 128 stager threads of the grid's last q-heads blocks: head h on block grid - 1 - h, which kind 6
// leaves without attention units): x: the partials, o: the attention output. Lane s of each warp reads split s's max
// and sum of exps (so a warp holds them all); thread d reads every split's sum d, all in one round. Traced (slots): 2,
// every split's max, sum of exps and sums are in; 3, merged.
__device__ INLINE_ATTENTION void attention_merge(long long aux, long long x, long long o, unsigned int tag, unsigned int own,
                                             int ct, unsigned long long* slots) {
  const Attention& a = *reinterpret_cast<const Attention*>(aux);
  const int head = gridDim.x - 1 - blockIdx.x, splits = static_cast<int>(a.splits), lane = ct & 31;
  if (head >= a.kv_heads * a.group) return;
  const unsigned long long* parts = reinterpret_cast<const unsigned long long*>(x) + head * splits * kPartial;
  // one round: split `lane`'s max and sum of exps, and every split's sum d, polled together until all are in
  constexpr int kAtOnce = 32;  // (a merge reads up to 32 splits)
  const int mine = min(lane, splits - 1);  // (lanes past the splits read the last split's, and weigh 0)
  unsigned long long ml[2], words[kAtOnce];
  bool ready;
  do {  // unconditional loads, nothing carried from one poll to the next: all in registers
    ml[0] = load_relaxed64(parts + mine * kPartial + kHeadDim), ml[1] = load_relaxed64(parts + mine * kPartial + kHeadDim + 1);
#pragma unroll
    for (int i = 0; i < kAtOnce; ++i) words[i] = load_relaxed64(parts + min(i, splits - 1) * kPartial + ct);
    unsigned int stale = static_cast<unsigned int>(ml[0] >> 32) ^ tag | static_cast<unsigned int>(ml[1] >> 32) ^ tag;
#pragma unroll
    for (int i = 0; i < kAtOnce; ++i) stale |= static_cast<unsigned int>(words[i] >> 32) ^ tag;
    ready = __all_sync(0xffffffffu, stale == 0);
    if (!ready) __nanosleep(20);
  } while (!ready);
  const float split_max = lane < splits ? __uint_as_float(static_cast<unsigned int>(ml[0])) : -__int_as_float(0x7f800000);
  const float split_exps = lane < splits ? __uint_as_float(static_cast<unsigned int>(ml[1])) : 0.0f;
  const float m = warp_max(split_max);
  if (slots != nullptr) slots[2] = now();
  const float weight = split_exps > 0.0f ? __expf(split_max - m) : 0.0f;  // an empty split (max -inf) weighs 0
  const float l = warp_sum(split_exps * weight);
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < kAtOnce; ++i) acc += __uint_as_float(static_cast<unsigned int>(words[i])) * __shfl_sync(0xffffffffu, weight, i);
  if (slots != nullptr) slots[3] = now();
  unsigned int* out = reinterpret_cast<unsigned int*>(o) + head * kHeadDim + ct;
  const unsigned int word = bf16::round(acc / l).bits | own << 16;
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(out), "r"(word) : "memory");
}
// kind 6, split-KV attention with lanes over positions (design 10): block b takes KV head b / (splits / 4) and 4 of
// its splits, a stager warp a split of at most kMaxSpan (16) positions. Lanes 2p and 2p + 1 hold position p0 + p's k
// row, a half each (dims 0-63, 64-127), and lane l its positions' v dims 4l..4l+3: 64 registers, no spills. The cache
// does not wait for qkv, so these loads go out first, and arrive while the warps poll for q (session 37). The 4 warps
// put the group's 4 rotated q heads and the new k and v (rounded to bf16) into shared memory; a lane pair computes its
// position's 4 logits against q, the warp its 4 softmaxes, and each lane the 4 heads' sums over its 4 dims, the
// weights passed along by shuffles. Partials as kind 4 writes them. Traced (slots): 2, q is in shared memory; 3, the
// softmaxes are done.
// Kind 6's cache rows into L2, asked for by the same stager warps one op ahead (at the start of qkv): under the
// weights' streaming a load from memory waits ~10 µs, an L2 hit far less. Lane l: lines of positions p0 + l / 4 ..
// (k's two 128-byte lines of the head's row, then v's).
__device__ __forceinline__ void prefetch_kv(long long aux, int stager_warp) {
  const Attention& a = *reinterpret_cast<const Attention*>(aux);
  const int lane = threadIdx.x & 31, splits = static_cast<int>(a.splits), kv_heads = static_cast<int>(a.kv_heads);
  const int blocks_a_head = splits / 4, len = static_cast<int>(a.pos) + 1, span = (len + splits - 1) / splits;
  for (int b = blockIdx.x; b < kv_heads * blocks_a_head; b += gridDim.x) {
    const int h = b / blocks_a_head, s = (b % blocks_a_head) * 4 + stager_warp;
    const int p0 = min(s * span, len), p1 = min(p0 + span, len);
    for (int i = lane; i < 4 * (p1 - p0); i += 32) {
      const int at = p0 + i / 4, line = i % 4;
      const char* row = reinterpret_cast<const char*>(line < 2 ? a.k_cache : a.v_cache) +
                        ((static_cast<long long>(at) * kv_heads + h) * kHeadDim) * 2 + (line % 2) * 128;
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row));
    }
  }
}
#ifndef MAX_SPAN
#define MAX_SPAN 16
#endif
constexpr int kMaxSpan = MAX_SPAN;  // positions a split (at most, <= 16: a lane pair each)
__device__ INLINE_ATTENTION void attention_lanes(long long aux, long long x, long long o, unsigned int tag, unsigned int own,
                                             int stager_warp, Shared& sh, unsigned long long* slots) {
  static_assert(kMaxSpan <= 16, "a lane pair a position");
  const Attention& a = *reinterpret_cast<const Attention*>(aux);
  const int lane = threadIdx.x & 31, splits = static_cast<int>(a.splits), half = lane & 1;
  const int kv_heads = static_cast<int>(a.kv_heads), group = static_cast<int>(a.group), pos = static_cast<int>(a.pos);
  const int blocks_a_head = splits / 4, len = pos + 1, span = (len + splits - 1) / splits;
  const unsigned int* qkv = reinterpret_cast<const unsigned int*>(x);
  const float* cos = reinterpret_cast<const float*>(a.cos);
  const float* sin = reinterpret_cast<const float*>(a.sin);
  const int q_size = kv_heads * group * kHeadDim, kv_size = kv_heads * kHeadDim;
  for (int b = blockIdx.x; b < kv_heads * blocks_a_head; b += gridDim.x) {
    const int h = b / blocks_a_head, s = (b % blocks_a_head) * 4 + stager_warp;
    const int p0 = min(s * span, len), p1 = min(p0 + span, len);
    const int at = p0 + (lane >> 1);
    const bool mine = at < p1, cached = mine && at != pos;
    constexpr int kHalf = kHeadDim / 2 / 8;  // 16-byte vectors in half a row
    uint4 khalf[kHalf];
    if (cached) {
      const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const bf16*>(a.k_cache) +
                                                        (static_cast<long long>(at) * kv_heads + h) * kHeadDim) + half * kHalf;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) khalf[i] = __ldg(src + i);
    }
    uint2 vals[kMaxSpan];
#pragma unroll
    for (int p = 0; p < kMaxSpan; ++p) {
      const int vat = p0 + p;
      if (vat < p1 && vat != pos)
        vals[p] = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const bf16*>(a.v_cache) +
                                                       (static_cast<long long>(vat) * kv_heads + h) * kHeadDim) + lane);
    }
    {  // warp w: q head 4h + w, and warps 0 and 1 the new k and v, rotated and rounded, into shared memory
      float v4[4];
      load_tagged4(qkv + (h * group + stager_warp) * kHeadDim + 4 * lane, tag, v4);
      rotary(v4, cos, sin, lane);
#pragma unroll
      for (int i = 0; i < 4; ++i) sh.attention.q[stager_warp][4 * lane + i] = bf16::round(v4[i]).bits;
      if (stager_warp == 0) {
        load_tagged4(qkv + q_size + h * kHeadDim + 4 * lane, tag, v4);
        rotary(v4, cos, sin, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i) sh.attention.k[4 * lane + i] = bf16::round(v4[i]).bits;
      }
      if (stager_warp == 1) {
        load_tagged4(qkv + q_size + kv_size + h * kHeadDim + 4 * lane, tag, v4);
#pragma unroll
        for (int i = 0; i < 4; ++i) sh.attention.v[4 * lane + i] = bf16::round(v4[i]).bits;
      }
    }
    asm volatile("bar.sync 4, 128;" ::: "memory");
    if (slots != nullptr) slots[2] = now();
    if (p1 == len && p0 < p1) {  // the split holding pos writes the new k and v into the cache
      const long long at_new = (static_cast<long long>(pos) * kv_heads + h) * kHeadDim + 4 * lane;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        reinterpret_cast<bf16*>(a.k_cache)[at_new + i] = bf16{sh.attention.k[4 * lane + i]};
        reinterpret_cast<bf16*>(a.v_cache)[at_new + i] = bf16{sh.attention.v[4 * lane + i]};
      }
    }
    if (!cached) {
#pragma unroll
      for (int i = 0; i < kHalf; ++i) khalf[i] = reinterpret_cast<const uint4*>(sh.attention.k)[half * kHalf + i];
    }
#pragma unroll
    for (int p = 0; p < kMaxSpan; ++p) {
      const int vat = p0 + p;
      if (!(vat < p1 && vat != pos)) vals[p] = reinterpret_cast<const uint2*>(sh.attention.v)[lane];
    }
    float logit[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const unsigned int kw[4] = {khalf[i].x, khalf[i].y, khalf[i].z, khalf[i].w};
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const uint4 qv = reinterpret_cast<const uint4*>(sh.attention.q[g])[half * kHalf + i];
        const unsigned int qw[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
          logit[g] += __uint_as_float(qw[e] << 16) * __uint_as_float(kw[e] << 16) +
                      __uint_as_float(qw[e] & 0xFFFF0000u) * __uint_as_float(kw[e] & 0xFFFF0000u);
      }
    }
    const float scale = rsqrtf(static_cast<float>(kHeadDim));
    float m[4], l[4], w[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float dot = logit[g] + __shfl_xor_sync(0xffffffffu, logit[g], 1);  // the pair's two halves
      const float z = mine ? dot * scale : -__int_as_float(0x7f800000);
      m[g] = warp_max(z);
      w[g] = mine ? __expf(z - m[g]) : 0.0f;
      l[g] = warp_sum(half == 0 ? w[g] : 0.0f);
    }
    if (slots != nullptr) slots[3] = now();
    float acc[4][4] = {};
#pragma unroll
    for (int p = 0; p < kMaxSpan; ++p) {
      const float v[4] = {__uint_as_float(vals[p].x << 16), __uint_as_float(vals[p].x & 0xFFFF0000u),
                          __uint_as_float(vals[p].y << 16), __uint_as_float(vals[p].y & 0xFFFF0000u)};
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const float wp = __shfl_sync(0xffffffffu, w[g], 2 * p);  // 0 past the split's end
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g][i] += wp * v[i];
      }
    }
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      unsigned long long* out = reinterpret_cast<unsigned long long*>(o) + ((h * group + g) * splits + s) * kPartial;
#pragma unroll
      for (int i = 0; i < 4; ++i) store_tagged64(out + 4 * lane + i, acc[g][i], own);
      if (lane == 0) {
        const bool empty = p0 >= p1;
        store_tagged64(out + kHeadDim, empty ? -__int_as_float(0x7f800000) : m[g], own);
        store_tagged64(out + kHeadDim + 1, empty ? 0.0f : l[g], own);
      }
    }
    asm volatile("bar.sync 4, 128;" ::: "memory");  // before the next unit's q overwrites shared memory
  }
}
}  // namespace flow_chain

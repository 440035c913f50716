// Design 6 of W3's FP8 GEMV chain in one persistent launch (benchmarks/megakernel/flow_chain.py; RESULTS.md,
// session 36): design 5 (ring_chain.cu, compiled before flow_common.cu and this file) without grid barriers.
// Ops meet by data instead. Each 2,048-row chunk of an op's output has a counter; a block's stager warps stage chunk c
// of the next op's x into one of two x buffers as soon as the rows it holds are all stored, and the consumers wait in shared memory for the chunk they compute, not for
// the whole op. So a block done early with op j starts op j + 1 on the chunks that are ready.
//
// No consumer warp fences (a fence in a warp with copies in flight stalls its stream): a consumer hands each finished
// super-tile's two rows to the block's releaser warp in one 64-bit shared store tagged with the tile's number; the
// releaser stores them, fences and raises the chunk's counter (red.release.gpu).
//
// The products: FP8 weights to float16 pairs (cvt.rn.f16x2.e4m3x2, exact), x staged as float16 (exact: bf16 values
// under a power-of-two scale a chunk that keeps them in float16's range), mma.m16n8k16 with float32 sums, the mma
// arranged as in ring_chain.cu's mma_e4m3 (the diagonal of C). On sm_90 that PTX mma on e4m3 is itself converted to
// float16 HMMAs, x included; staging x as float16 once a block saves a third of the conversions.
//
// Work order: a block's super-tiles (16 rows) of op j, group[j] (<= 8) at a time, chunk-major within the group: a
// large group lets the op start on its x's first chunk while the previous op finishes the rows of the next chunks; a
// group of 1 finishes the op's rows early, chunk by chunk, for the next op. The super-tiles are dealt round-robin over
// the ops' concatenation (as in design 5).
#ifndef PREFETCH_KV  // kind 6's cache rows into L2 an op ahead
#define PREFETCH_KV 1
#endif
#ifndef DYNAMIC  // design 11: groups taken from per-op counters (TAGGED only)
#define DYNAMIC 0
#endif
#ifndef CONSUMER_SLEEP
#define CONSUMER_SLEEP 64
#endif
namespace flow_chain {
// The releaser warp (counters): stores each finished super-tile's rows, then counts them in their chunk.
__device__ __forceinline__ void release_rows(const Walk& walk, const Ops& ops, Shared& sh) {
  const int lane = threadIdx.x & 31;
  Unit u;
  unsigned int q = 0;  // super-tiles finished, in the consumers' order
  for (bool more = walk.first(u); more; more = walk.next(u)) {
    if (u.c + 1 != ops.k[u.j] / kKc) continue;  // a super-tile's rows are finished with its last chunk
    const int st = u.st(), nj = ops.n[u.j];
    if (lane < kWarps) {
      unsigned long long v;
      do {
        v = sh.tiles[q % kTiles][lane];
      } while (static_cast<unsigned int>(v >> 32) != q + 1);
      const int row = st * kRows + 2 * lane;
      bf16* out = reinterpret_cast<bf16*>(ops.o[u.j]);
      if (row + 1 < nj) {
        *reinterpret_cast<unsigned int*>(out + row) = static_cast<unsigned int>(v);
      } else if (row < nj) {
        out[row] = bf16{static_cast<unsigned short>(v & 0xFFFF)};
      }
      __threadfence();
    }
    __syncwarp();
    if (lane == 0) {
      const unsigned int rows = min(kRows, nj - st * kRows);
      asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ops.counters + u.j * kCounters + st * kRows / kKc), "r"(rows) : "memory");
    }
    ++q;
  }
}

// The stagers: every op's x, chunk by chunk, in order, as float16 in the consumers' layout.
template <bool TAGGED>
__device__ __forceinline__ void stage(const Ops& ops, Shared& sh, uint4* xq) {
  constexpr int kStagers = kStagersOf<TAGGED>, kEach = (kChunkVectors + kStagers - 1) / kStagers;
  const int ct = threadIdx.x - (kConsumers + kControl - kStagers), lane = threadIdx.x & 31;
  unsigned long long waited = 0;
  float sum_sq = 0.0f;  // stager 0: a norm's sum of squares over the chunks so far
  for (int j = 0; j < ops.num_ops; ++j) {
    const int buf = j & 1;
    if (ct == 0) trace(ops, j, 0);
    if (TAGGED && PREFETCH_KV && j + 1 < ops.num_ops && ops.kind(j + 1) == 6) prefetch_kv(ops.aux[j + 1], ct / 32);
    if constexpr (TAGGED) {
      const int kind = ops.kind(j);
      if (kind == 4) attention_split(ops.aux[j], ops.x[j], ops.o[j], ops.tag_of(j - 1), ops.tag_of(j), ct / 32);
      unsigned long long* slots = ct == 0 ? trace_slots(ops, j) : nullptr;
      if (kind == 5) attention_merge(ops.aux[j], ops.x[j], ops.o[j], ops.tag_of(j - 1), ops.tag_of(j), ct, slots);
      if (kind == 6) attention_lanes(ops.aux[j], ops.x[j], ops.o[j], ops.tag_of(j - 1), ops.tag_of(j), ct / 32, sh, slots);
      if (kind >= 4) {
        if (ct == 0) trace(ops, j, 1);
        continue;
      }
    }
    if (j >= 2 && ct == 0) {  // the buffer held op j - 2's x: every consumer warp must be through with it
      for (int i = 0; i < kWarps; ++i)
        while (load_acquire_cta(sh.progress + i) < j - 1) {
        }
    }
    for (int c = 0; c < ops.k[j] / kKc; ++c) {
      const unsigned long long t0 = ops.waits != nullptr && ct == 0 ? now() : 0;
      if (!TAGGED && j > 0 && ct == 0) {
        const unsigned int need = min(kKc, ops.n[j - 1] - c * kKc);
        // relaxed polls (an acquire load invalidates the SM's L1 each time), one acquire once it is there
        const unsigned int* counter = ops.counters + (j - 1) * kCounters + c;
        while (load_relaxed(counter) < need) __nanosleep(32);
        load_acquire(counter);
      }
      asm volatile("bar.sync 4, %0;" ::"n"(kStagers) : "memory");
      const long long base = ops.x[j] + c * kKc * (TAGGED ? 4 : 2);
      const unsigned int tag = ops.tag_of(j - 1);
      const int kind = TAGGED ? ops.kind(j) : 0;
      float f[kEach][8];
      float m = 0.0f, sq = 0.0f;
      uint4 norm_weight[kEach];
      if (kind == 1) {  // the norm's weight, asked for before x (it does not wait for x)
        const uint4* weight = reinterpret_cast<const uint4*>(ops.aux[j]) + c * kChunkVectors;
#pragma unroll
        for (int u = 0; u < kEach; ++u)
          if (ct + u * kStagers < kChunkVectors) norm_weight[u] = __ldg(weight + ct + u * kStagers);
      }
      bool loaded = false;
      if constexpr (TAGGED) {
        if (kind >= 2) {  // SiLU(gate) * up, both polled at once
          float gate_up[2 * kEach][8];
          const long long gate = kind == 2 ? base : ops.x[j] + 2LL * c * kKc * 4;  // kind 3: the chunks interleaved
          load_x<TAGGED, kEach, 2>(gate, kind == 2 ? gate + ops.k[j] * 4LL : gate + kKc * 4LL, ct, kStagers, tag, gate_up);
#pragma unroll
          for (int u = 0; u < kEach; ++u)
#pragma unroll
            for (int q = 0; q < 8; ++q) {
              const float g = gate_up[u][q];
              f[u][q] = round_bf16(round_bf16(g / (1.0f + __expf(-g))) * gate_up[kEach + u][q]);
            }
          loaded = true;
        }
      }
      if (!loaded) load_x<TAGGED, kEach>(base, 0, ct, kStagers, tag, f);
      if (kind == 1) {  // x times the norm's weight; the sum of squares of x for its 1 / rms
#pragma unroll
        for (int u = 0; u < kEach; ++u) {
          if (ct + u * kStagers >= kChunkVectors) continue;
          const uint4 gv = norm_weight[u];
          const unsigned int gw[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            const float g = __uint_as_float(q & 1 ? gw[q / 2] & 0xFFFF0000u : gw[q / 2] << 16);
            sq += f[u][q] * f[u][q];
            f[u][q] = round_bf16(f[u][q] * g);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kEach; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) m = ct + u * kStagers < kChunkVectors ? fmaxf(m, fabsf(f[u][q])) : m;
      if (ops.waits != nullptr && ct == 0) waited += now() - t0;
      m = warp_max(m);
      if (kind == 1) sq = warp_sum(sq);
      if (lane == 0) sh.chunk_max[(threadIdx.x - kConsumers) / 32] = m, sh.chunk_sq[(threadIdx.x - kConsumers) / 32] = sq;
      asm volatile("bar.sync 4, %0;" ::"n"(kStagers) : "memory");
      m = 0.0f;
#pragma unroll
      for (int i = kControl / 32 - kStagers / 32; i < kControl / 32; ++i) m = fmaxf(m, sh.chunk_max[i]);
      if (kind == 1 && ct == 0) {  // before the op's last chunk is flagged, its 1 / rms
#pragma unroll
        for (int i = kControl / 32 - kStagers / 32; i < kControl / 32; ++i) sum_sq += sh.chunk_sq[i];
        if (c + 1 == ops.k[j] / kKc) sh.rnorm[buf] = rsqrtf(sum_sq / ops.k[j] + 1e-5f), sum_sq = 0.0f;
      }
      // x / 2^(e - 14) with |x| max in [2^e, 2^(e + 1)): below 2^15, in float16's range, and exact
      const int e = m > 0.0f ? max(static_cast<int>((__float_as_uint(m) >> 23) & 0xFF) - 127, -100) : 14;
      const float inv = __uint_as_float(static_cast<unsigned int>(14 - e + 127) << 23);
      // lane l of a consumer reads x's 16 values of vector 32 i + l as two 16-byte halves, 32 lanes apart
      uint4* out = xq + (buf * kMaxChunks + c) * kChunkVectors;
#pragma unroll
      for (int u = 0; u < kEach; ++u) {
        const int vi = ct + u * kStagers, p = vi >> 1;
        if (vi >= kChunkVectors) continue;
        const float* g = f[u];
        out[(p >> 5) * 64 + (vi & 1) * 32 + (p & 31)] = make_uint4(f16x2(g[0] * inv, g[1] * inv), f16x2(g[2] * inv, g[3] * inv),
                                                                   f16x2(g[4] * inv, g[5] * inv), f16x2(g[6] * inv, g[7] * inv));
      }
      if (ct == 0) sh.x_scale[buf][c] = __uint_as_float(static_cast<unsigned int>(e - 14 + 127) << 23);
      asm volatile("bar.sync 4, %0;" ::"n"(kStagers) : "memory");
      if (ct == 0) store_release_cta(&sh.staged[buf][c], j);
    }
    if (ct == 0) trace(ops, j, 1);
  }
  if (ops.waits != nullptr && ct == 0) ops.waits[2 * blockIdx.x + 1] = waited;
}

// The consumers: copies STAGES - 1 units ahead; products; a finished super-tile's two rows to the releaser, or
// (TAGGED) straight to memory with their tags.
template <int STAGES, int ACC, int MODE, bool TAGGED, class W>
__device__ __forceinline__ void consume(W& walk, const Ops& ops, Shared& sh, uint4* ring, const uint4* xq) {
  constexpr int kShare = 2 * kKc / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint4* slots = ring + warp * STAGES * kShare;
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  Unit ahead;
  bool more = walk.first(ahead);
  auto issue_next = [&](int slot) {
    if (MODE == 1) {
      if (more) more = walk.next(ahead);
    } else if (more) {
      const int kj = ops.k[ahead.j], nj = ops.n[ahead.j], st = ahead.st();
      const uint4* wj = reinterpret_cast<const uint4*>(ops.w[ahead.j]);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = min(st * kRows + 2 * warp + rr, nj - 1);
        const uint4* src = wj + (static_cast<long long>(row) * kj + ahead.c * kKc) / 16;
#pragma unroll
        for (int i = 0; i < kKc / 16 / 32; ++i)
          copy16<true>(slots + slot * kShare + rr * (kKc / 16) + 32 * i + lane, src + 32 * i + lane, policy);
      }
      more = walk.next(ahead);
      if constexpr (DYNAMIC && TAGGED) {  // warp 0's copies started the block's next entry: one more grabbed
        if (more && warp == 0 && lane == 0 && ahead.g == 0 && ahead.c == 0) walk.produce();
      }
    }
    commit();
  };
  for (int i = 0; i < STAGES - 1; ++i) issue_next(i);

  Unit cur;
  bool have = walk.first(cur);
  int slot = 0, at_op = 0;
  bool first_of_op = false;  // (the timeline's)
  unsigned int q = 0;  // super-tiles finished
  unsigned long long waited = 0, res_ahead = 0;
  while (have) {
    issue_next(slot == 0 ? STAGES - 1 : slot - 1);
    if (cur.j != at_op) {  // through with every op before cur.j: its x buffer may be restaged
      at_op = cur.j, first_of_op = true;
      if (lane == 0) sh.progress[warp] = at_op;  // no fence: its reads of that buffer fed mmas issued before this
    }
    const int buf = cur.j & 1;
    if (load_acquire_cta(&sh.staged[buf][cur.c]) != cur.j) {
      const unsigned long long t0 = ops.waits != nullptr ? now() : 0;
      // the stagers share the SM: past a few polls, 8 warps spinning on shared memory slow them (attention's waits)
      for (int polls = 0; load_acquire_cta(&sh.staged[buf][cur.c]) != cur.j; ++polls)
        if (CONSUMER_SLEEP > 0 && polls > 4) __nanosleep(CONSUMER_SLEEP);
      if (ops.waits != nullptr) waited += now() - t0;
    }
    if (warp == 0 && lane == 0 && first_of_op) trace(ops, cur.j, 2);
    first_of_op = false;
    wait_groups<STAGES - 1>();
    const uint4* mine = slots + slot * kShare;
    const uint4* xs = xq + (buf * kMaxChunks + cur.c) * kChunkVectors;
    float accs[ACC][4] = {};
#pragma unroll
    for (int i = 0; i < (MODE == 2 ? 0 : kKc / 16 / 32); ++i) {
      const uint4 a = mine[32 * i + lane], b = mine[kKc / 16 + 32 * i + lane], x0 = xs[64 * i + lane], x1 = xs[64 * i + 32 + lane];
      const unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
      const unsigned int xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        unsigned int a_lo, a_hi, b_lo, b_hi;
        e4m3_pairs(aw[q], a_lo, a_hi);
        e4m3_pairs(bw[q], b_lo, b_hi);
        mma_f16(accs[(4 * i + q) % ACC], a_lo, b_lo, a_hi, b_hi, xw[2 * q], xw[2 * q + 1]);
      }
    }
    float acc[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[e] = accs[0][e];
#pragma unroll
      for (int a = 1; a < ACC; ++a) acc[e] += accs[a][e];
    }
    const int g = lane >> 2, t = lane & 3;
    const bool holds = t == (g >> 1);
    float r0 = warp_sum(holds ? ((g & 1) ? acc[1] : acc[0]) : 0.0f);
    float r1 = warp_sum(holds ? ((g & 1) ? acc[3] : acc[2]) : 0.0f);
    const bool last = cur.c + 1 == ops.k[cur.j] / kKc;
    if (TAGGED && lane == 0 && cur.c == 0 && cur.gs == 1 && ops.res[cur.j] != 0) {
      // the residual of this super-tile's rows, asked for now and used at its last chunk (complete by now: this op's
      // x needed all of the op before, which needed all of the residual)
      const unsigned int* rp = reinterpret_cast<const unsigned int*>(ops.res[cur.j]) + cur.st() * kRows + 2 * warp;
      asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(res_ahead) : "l"(rp) : "memory");
    }
    if (lane == 0) {
      const float xscale = sh.x_scale[buf][cur.c];
      r0 *= xscale, r1 *= xscale;
      if (cur.c > 0) r0 += sh.part[warp][cur.g][0], r1 += sh.part[warp][cur.g][1];
      if (!last) {
        sh.part[warp][cur.g][0] = r0, sh.part[warp][cur.g][1] = r1;
      } else {
        const int row = cur.st() * kRows + 2 * warp, nj = ops.n[cur.j];
        const float* scale = reinterpret_cast<const float*>(ops.s[cur.j]);
        if (TAGGED && ops.kind(cur.j) == 1) r0 *= sh.rnorm[buf], r1 *= sh.rnorm[buf];
        unsigned int lo = row < nj ? bf16::round(r0 * scale[row]).bits : 0;
        unsigned int hi = row + 1 < nj ? bf16::round(r1 * scale[row + 1]).bits : 0;
        if constexpr (TAGGED) {  // requires an even n: both rows exist
          if (ops.res[cur.j] != 0) {  // + the residual (an op before wrote it, or it came before the launch)
            const unsigned int* res = reinterpret_cast<const unsigned int*>(ops.res[cur.j]) + row;
            const unsigned int want = ops.tag_of(ops.residual_from(cur.j));
            unsigned long long v = res_ahead;
            auto stale = [&] { return want <= 0xFFFFu && ((v >> 16 & 0xFFFF) != want || (v >> 48) != want); };
            if (cur.gs > 1 || stale()) {  // not asked for ahead, or (never seen) not there yet
              do {
                asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(res) : "memory");
              } while (stale());
            }
            lo = bf16::round(__uint_as_float(static_cast<unsigned int>(v) << 16) + bf16{static_cast<unsigned short>(lo)}.value()).bits;
            hi = bf16::round(__uint_as_float(static_cast<unsigned int>(v >> 32) << 16) + bf16{static_cast<unsigned short>(hi)}.value()).bits;
          }
          const unsigned long long tag = ops.tag_of(cur.j);
          const unsigned long long v = (lo | tag << 16) | (static_cast<unsigned long long>(hi) | tag << 16) << 32;
          unsigned int* out = reinterpret_cast<unsigned int*>(ops.o[cur.j]) + row;
          asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(out), "l"(v) : "memory");
        } else {
          sh.tiles[q % kTiles][warp] = (static_cast<unsigned long long>(q + 1) << 32) | lo | (hi << 16);
        }
      }
    }
    if (warp == 0 && lane == 0 && last) trace(ops, cur.j, 3);
    q += last;
    if (++slot == STAGES) slot = 0;
    have = walk.next(cur);
    if (DYNAMIC && TAGGED && lane == 0) sh.used[warp] = cur.e;
  }
  wait_groups<0>();
  if (DYNAMIC && TAGGED && lane == 0) sh.used[warp] = 1 << 30;  // (the producer waits for no one through)
  if (lane == 0) sh.progress[warp] = ops.num_ops;
  if (ops.waits != nullptr && warp == 0 && lane == 0) ops.waits[2 * blockIdx.x] = waited;
}

// counters: [num_ops][kCounters], zero at the launch. waits (or null): [blocks][2] ns: consumer warp 0's time waiting
// for staged chunks, and the stagers' time waiting for their chunks (stager 0's view).
// ACC: independent accumulators a unit (the 16 mmas of a unit in ACC chains rather than one). MODE 0: normal; 1: no
// weight copies (the arithmetic on whatever the ring holds); 2: no arithmetic (the copies, staging and waits alone).
// Modes 1 and 2 give wrong results.
//
// TAGGED (design 7): no counters and no releaser. Every activation (op 0's x and every op's output) is 32 bits: the
// bf16 value, and above it a 16-bit tag, (epoch * num_ops + j + 1) mod 2^16 for op j's output. A consumer stores its
// two rows with their tags in one 64-bit store; a stager polls the chunk's values themselves until every tag is the
// producing op's. A value and its tag arrive together, so nothing is fenced anywhere. counters[0] is the epoch, which
// the last block through raises (counters[1] counts the blocks through), so every replay of a graph tags anew.
template <int STAGES, int ACC = 1, int MODE = 0, bool TAGGED = false>
__global__ void __launch_bounds__(kConsumers + kControl, 1) chain(
    const long long* w, const long long* s, const long long* x, const long long* o, const int* n, const int* k,
    const int* meta, const long long* aux, const long long* res, int num_ops, unsigned int* counters,
    unsigned long long* waits) {
  extern __shared__ __align__(128) uint4 ring[];  // [kWarps][STAGES][2 kKc / 16], then x as f16: [2][kMaxChunks][256]
  uint4* xq = ring + kWarps * STAGES * (2 * kKc / 16);
  __shared__ Shared sh;
  if (threadIdx.x < 2 * kMaxChunks) sh.staged[threadIdx.x / kMaxChunks][threadIdx.x % kMaxChunks] = -1;
  if (threadIdx.x < kWarps) sh.progress[threadIdx.x] = 0;
  for (int i = threadIdx.x; i < kTiles * kWarps; i += blockDim.x) sh.tiles[i / kWarps][i % kWarps] = 0;
  if (TAGGED && threadIdx.x == 0) sh.epoch = __ldcg(counters), sh.trace_j0 = waits != nullptr ? static_cast<int>(__ldcg(counters + 2)) - 1 : -1;
  __syncthreads();
  const Walk walk{n, k, meta, num_ops};
  DynWalk dyn{n, k, meta, num_ops, counters + 4, sh.grabbed, &sh.grabbed_count, sh.used};
  if (DYNAMIC && TAGGED) {
    if (threadIdx.x < kWarps) sh.used[threadIdx.x] = 0;
    if (threadIdx.x == 0) sh.grabbed_count = 0;
    __syncthreads();
    if (threadIdx.x == 0) dyn.start();
    __syncthreads();
  }
  const Ops ops{w, s, x, o, n, k, meta, aux, res, num_ops, counters, waits, TAGGED ? sh.epoch : 0u, TAGGED ? sh.trace_j0 : -1};
  const int warp = threadIdx.x >> 5;
  if (warp < kWarps)
  {
    if constexpr (DYNAMIC && TAGGED) {
      consume<STAGES, ACC, MODE, TAGGED>(dyn, ops, sh, ring, xq);
    } else {
      Walk plain = walk;
      consume<STAGES, ACC, MODE, TAGGED>(plain, ops, sh, ring, xq);
    }
  }
  else if (!TAGGED && warp == kWarps)
    release_rows(walk, ops, sh);
  else
    stage<TAGGED>(ops, sh, xq);
  if (TAGGED) {  // the last block through raises the epoch for the next launch
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(counters + 1, 1u) == gridDim.x - 1) {
      counters[1] = 0;
      counters[0] = ops.epoch + 1;
      if (DYNAMIC && TAGGED)
        for (int j = 0; j < num_ops; ++j) counters[4 + j] = 0;  // design 11's grab counters
    }
  }
}
}  // namespace flow_chain

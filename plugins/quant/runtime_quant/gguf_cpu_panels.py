"""4-bit GGUF weights in panels of 32 output columns, multiplied by an AVX-512 BF16 kernel.

torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) dequantizes every weight again for
every input row in float32 FMAs, so its time grows with the rows: at 16-512 rows it costs
1.1-2.4x a bf16 matmul (``benchmarks/RESULTS.md``, issue #18, session 13). This kernel (C++,
built by ``torch.utils.cpp_extension`` at first use and cached under ``~/.cache/torch_extensions``)
does what a dequantize-at-load model does, a panel at a time:

- more than :data:`FOLDED_MAX_ROWS` rows: the panel's 32 columns x ``in`` weights are
  dequantized into a bf16 scratch (``in`` x 64 bytes, in L2) as gguf-py then ``.to(bfloat16)``
  does (``s * q + z`` in float32 without FMA, rounded to nearest even: the same weights for Q4_0
  and Q4_1, whose float16 scales are exact), and multiplied by ``vdpbf16ps`` 12 rows at a time
  with float32 sums;
- up to that many rows (decode): the codes go to bf16 by a 16-entry table (exact) and the scale
  and offset are applied per group of 32 to float32 sums (``s * sum(x q) + z * sum(x)``).

Layout (:func:`pack`): ``codes`` uint8 [out / 32, in / 32, 16, 32]: per panel and group, 16
pairs of inputs; byte ``2i + e`` of pair ``j`` holds the code of column ``i`` (low nibble) and
``16 + i`` (high nibble) at input ``32g + 2j + e``, i.e. the VNNI pairs ``vdpbf16ps`` takes.
``scales`` and ``zeros`` float16 [in / 32, out]: ``w = scales * q + zeros``.
"""

from __future__ import annotations

import functools
import logging

import torch

from runtime.platforms import cpu_flags

logger = logging.getLogger(__name__)

PANEL = 32  # output columns per panel
GROUP = 32  # inputs per scale and offset
FOLDED_MAX_ROWS = 24  # rows up to which the scales are applied to the sums (measured crossing ~32, one thread)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t PANEL = 32, GROUP = 32, PAIRS = GROUP / 2, GROUP_BYTES = GROUP * PANEL / 2;
constexpr int64_t MR = 12, FR = 4;  // rows at a time: dequantized panel, folded scales

inline __m512 load_half16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// 32 codes (u16 lanes) -> bf16 of s * q + z; lane 2i + e belongs to column i (s, z duplicated per pair)
inline __m512i dequant32(__m512i q, __m512 s_lo, __m512 s_hi, __m512 z_lo, __m512 z_hi) {
  __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
  __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
  __m512 w_lo = _mm512_add_ps(_mm512_mul_ps(q_lo, s_lo), z_lo);
  __m512 w_hi = _mm512_add_ps(_mm512_mul_ps(q_hi, s_hi), z_hi);
  return (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo);
}

// The panel's weights as bf16 VNNI pairs: buf [in / 2][64] (columns 0-15, then 16-31).
void dequant_panel(const uint8_t* codes, const at::Half* scales, const at::Half* zeros, int64_t N, int64_t G, uint16_t* buf) {
  const __m512i mask = _mm512_set1_epi16(0x0F);
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  for (int64_t g = 0; g < G; ++g) {
    __m512 s0 = load_half16(scales + g * N), s1 = load_half16(scales + g * N + 16);
    __m512 z0 = load_half16(zeros + g * N), z1 = load_half16(zeros + g * N + 16);
    __m512 s0l = _mm512_permutexvar_ps(dup_lo, s0), s0h = _mm512_permutexvar_ps(dup_hi, s0);
    __m512 s1l = _mm512_permutexvar_ps(dup_lo, s1), s1h = _mm512_permutexvar_ps(dup_hi, s1);
    __m512 z0l = _mm512_permutexvar_ps(dup_lo, z0), z0h = _mm512_permutexvar_ps(dup_hi, z0);
    __m512 z1l = _mm512_permutexvar_ps(dup_lo, z1), z1h = _mm512_permutexvar_ps(dup_hi, z1);
    const uint8_t* c = codes + g * GROUP_BYTES;
    uint16_t* b = buf + g * PAIRS * 64;
    for (int64_t j = 0; j < PAIRS; ++j) {
      __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + 32 * j)));
      _mm512_storeu_si512(b + 64 * j, dequant32(_mm512_and_si512(v, mask), s0l, s0h, z0l, z0h));
      _mm512_storeu_si512(b + 64 * j + 32, dequant32(_mm512_srli_epi16(v, 4), s1l, s1h, z1l, z1h));
    }
  }
}

inline void store_bf16(at::BFloat16* y, __m512 v) { _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(v)); }

// y[R, 32] = x[R, K] @ panel, the panel dequantized in buf
template <int R>
void gemm_rows(const uint16_t* x, int64_t ldx, const uint16_t* buf, int64_t K, at::BFloat16* y, int64_t ldy) {
  __m512 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(buf + 64 * j), b1 = (__m512bh)_mm512_loadu_si512(buf + 64 * j + 32);
#pragma GCC unroll 12
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * j, 4);
      __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
  for (int m = 0; m < R; ++m) {
    store_bf16(y + m * ldy, acc[m][0]);
    store_bf16(y + m * ldy + 16, acc[m][1]);
  }
}

// y[R, 32] = x[R, K] @ panel with the scales applied to each group's sums; xsum [R][G]
template <int R>
void folded_rows(const uint16_t* x, int64_t ldx, const float* xsum, const uint8_t* codes, const at::Half* scales,
                 const at::Half* zeros, int64_t N, int64_t G, at::BFloat16* y, int64_t ldy) {
  const __m512i mask = _mm512_set1_epi16(0x0F);
  const __m512i lut = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0);
  __m512 tot[R][2];
  for (int m = 0; m < R; ++m) tot[m][0] = tot[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const uint8_t* c = codes + g * GROUP_BYTES;
    for (int64_t j = 0; j < PAIRS; ++j) {
      __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + 32 * j)));
      __m512bh b0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, mask), lut);
      __m512bh b1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
      for (int m = 0; m < R; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + g * GROUP + 2 * j, 4);
        __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
      }
    }
    __m512 s0 = load_half16(scales + g * N), s1 = load_half16(scales + g * N + 16);
    __m512 z0 = load_half16(zeros + g * N), z1 = load_half16(zeros + g * N + 16);
    for (int m = 0; m < R; ++m) {
      __m512 xs = _mm512_set1_ps(xsum[m * G + g]);
      tot[m][0] = _mm512_fmadd_ps(acc[m][0], s0, _mm512_fmadd_ps(xs, z0, tot[m][0]));
      tot[m][1] = _mm512_fmadd_ps(acc[m][1], s1, _mm512_fmadd_ps(xs, z1, tot[m][1]));
    }
  }
  for (int m = 0; m < R; ++m) {
    store_bf16(y + m * ldy, tot[m][0]);
    store_bf16(y + m * ldy + 16, tot[m][1]);
  }
}

template <int R>
void gemm_dispatch(int r, const uint16_t* x, int64_t ldx, const uint16_t* buf, int64_t K, at::BFloat16* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (r == R) return gemm_rows<R>(x, ldx, buf, K, y, ldy);
    return gemm_dispatch<R - 1>(r, x, ldx, buf, K, y, ldy);
  }
}

template <int R>
void folded_dispatch(int r, const uint16_t* x, int64_t ldx, const float* xsum, const uint8_t* codes, const at::Half* s,
                     const at::Half* z, int64_t N, int64_t G, at::BFloat16* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (r == R) return folded_rows<R>(x, ldx, xsum, codes, s, z, N, G, y, ldy);
    return folded_dispatch<R - 1>(r, x, ldx, xsum, codes, s, z, N, G, y, ldy);
  }
}

at::Tensor panels_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t folded_max_rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2, "panels_mm takes bf16 [rows, in]");
  at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP, N = scales.size(1), P = N / PANEL;
  TORCH_CHECK(K %% GROUP == 0 && N %% PANEL == 0 && codes.numel() * 2 == N * K && scales.size(0) == G &&
              zeros.sizes() == scales.sizes(), "panels_mm: x ", x.sizes(), ", codes ", codes.sizes(), ", scales ",
              scales.sizes(), ", zeros ", zeros.sizes(), " do not match (see gguf_cpu_panels.pack)");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(), "panels_mm: packed tensors must be contiguous");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* zp = zeros.data_ptr<at::Half>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  std::vector<float> xsum;
  const bool folded = M <= folded_max_rows;
  if (folded) {
    xsum.resize(M * G);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0;
        for (int64_t k = 0; k < GROUP; ++k) s += (float)((const at::BFloat16*)xp)[m * K + g * GROUP + k];
        xsum[m * G + g] = s;
      }
  }
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint16_t> buf(folded ? 0 : K * PANEL);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* c = cp + p * G * GROUP_BYTES;
      if (folded) {
        for (int64_t m = 0; m < M; m += FR)
          folded_dispatch<FR>(std::min(FR, M - m), xp + m * K, K, xsum.data() + m * G, c, sp + p * PANEL, zp + p * PANEL, N, G,
                              yp + m * N + p * PANEL, N);
        continue;
      }
      dequant_panel(c, sp + p * PANEL, zp + p * PANEL, N, G, buf.data());
      for (int64_t m = 0; m < M; m += MR)
        gemm_dispatch<MR>(std::min(MR, M - m), xp + m * K, K, buf.data(), K, yp + m * N + p * PANEL, N);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(runtime_gguf_cpu, m) { m.def("panels_mm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int folded_max_rows) -> Tensor"); }
TORCH_LIBRARY_IMPL(runtime_gguf_cpu, CPU, m) { m.impl("panels_mm", &panels_mm); }
"""

CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mf16c", "-ffp-contract=off", "-fopenmp"]  # OpenMP: at::parallel_for


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: an x86 CPU with AVX-512 BF16 and a C++ compiler (built once)."""
    if not cpu_has_avx512_bf16():
        return False
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline("runtime_gguf_cpu_panels", cpp_sources=_SOURCE.replace("%%", "%"),
                    extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, or one without AVX-512 BF16: torch's int4 kernel instead
        logger.warning("the AVX-512 BF16 GGUF kernel did not build (%s); 4-bit layers use torch's int4 kernel", e)
        return False

    @torch.library.register_fake("runtime_gguf_cpu::panels_mm")
    def _(x, codes, scales, zeros, folded_max_rows):
        return x.new_empty(x.shape[0], scales.shape[1])

    return True


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [out, in] (0..15), scale and zero float32 [out, in / 32] -> (codes in panels,
    scales, zeros) as described in the module docstring."""
    n, k = codes.shape
    c = codes.view(n // PANEL, 2, 16, k // GROUP, GROUP // 2, 2)  # [panel, half, col, group, pair, e]
    c = c.permute(0, 3, 4, 1, 2, 5).reshape(n // PANEL, k // GROUP, GROUP // 2, 2, PANEL)
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).contiguous()  # [panel, group, pair, 32]
    return packed, scale.t().half().contiguous(), zero.t().half().contiguous()


def panels_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              folded_max_rows: int | None = None) -> torch.Tensor:
    """x bf16 [rows, in] @ the panels' weights .T -> bf16 [rows, out]."""
    folded = FOLDED_MAX_ROWS if folded_max_rows is None else folded_max_rows
    return torch.ops.runtime_gguf_cpu.panels_mm(x, codes, scales, zeros, folded)

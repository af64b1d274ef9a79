// Weight-only quantized GEMM on the CPU's bfloat16 matrix units, for prefill chunks: y = x W^T
// with x float32 [M, K] rounded to bfloat16 once, W in int4 or int8 codes (gemm.cpp's formats)
// dequantized into bfloat16 panels 32 columns at a time (never whole: no second copy of the
// weights), float32 sums, float32 out.
//   AMX (unit 2): a 32x32 block of y is four 16x16 float32 tiles; each 32 k, two 16x32 tiles
//                 of x and two 16-pair tiles of the panel meet in four tile products.
//   AVX-512 BF16 (unit 1): the same panels, a 12x32 register tile of vdpbf16ps (each a pair
//                 of k products into 16 float32 lanes).
// Each weight is dequantized exactly as in gemm.cpp (scale * q + min in float32) and then
// rounded to bfloat16, so the result is x_bf16 @ bf16(dequantized W)^T summed in float32.
// matrix_units() says which units this build and CPU run (asking Linux for AMX's tile state).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
#include "simd.h"

namespace radixserve {
namespace {

#ifdef RS_AVX512_BF16
constexpr int64_t kBlockCols = 32;  // weight rows (output columns) per panel: two tiles
constexpr int64_t kTileWords = 256;  // 16 pairs x 16 columns

// The panel tile of weight rows n..n+15 (rows >= N zero) over group g (32 k) of an int4 W:
// each row's 32 weights dequantized and rounded in k order (16 pairs), then the 16 rows
// transposed so each 64-byte row holds one pair of every column.
inline void q4_tile(const uint8_t* qp, const float* sp, const float* mp, int64_t N, int64_t K,
                    int64_t n, int64_t g, uint32_t* dst) {
  const int64_t G = K / 32;
  const __m512i low = _mm512_set1_epi32(0x0F);
  __m512i r[16];
  for (int j = 0; j < 16; ++j) {
    if (n + j >= N) {
      r[j] = _mm512_setzero_si512();
      continue;
    }
    // Byte b holds element b (low nibble) and element b + 16 (high).
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + (n + j) * (K / 2) + g * 16)));
    const __m512 s = _mm512_set1_ps(sp[(n + j) * G + g]), m = _mm512_set1_ps(mp[(n + j) * G + g]);
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), s, m);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, m);
    r[j] = bf16_x32(lo, hi);
  }
  transpose16(r);
  for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + p * 16, r[p]);
}

// q4_tile for int8 codes (w = scale * q).
inline void q8_tile(const int8_t* qp, const float* sp, int64_t N, int64_t K, int64_t n,
                    int64_t g, uint32_t* dst) {
  const int64_t G = K / 32;
  __m512i r[16];
  for (int j = 0; j < 16; ++j) {
    if (n + j >= N) {
      r[j] = _mm512_setzero_si512();
      continue;
    }
    const int8_t* q = qp + (n + j) * K + g * 32;
    const __m512 s = _mm512_set1_ps(sp[(n + j) * G + g]);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
                                    s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))),
                                    s);
    r[j] = bf16_x32(lo, hi);
  }
  transpose16(r);
  for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + p * 16, r[p]);
}

// x [M, K] float32 (row stride ldx) -> xb [Mp, K] bfloat16 pairs, rows M..Mp zero.
void rows_to_bf16(const float* x, int64_t ldx, int64_t M, int64_t Mp, int64_t K, uint32_t* xb) {
  at::parallel_for(0, Mp, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* dst = xb + m * (K / 2);
      if (m >= M) {
        std::memset(dst, 0, K * 2);
        continue;
      }
      for (int64_t k = 0; k < K; k += 32)
        _mm512_storeu_si512(dst + k / 2, bf16_x32(x + m * ldx + k));
    }
  });
}

// out[m0 + i, n0 : n0 + 16 * nt] for i < rows from a float32 block [16 or 32 rows, 32] at src.
inline void copy_rows(const float* src, int64_t rows, int64_t nt, float* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i) std::memcpy(out + i * ldo, src + i * 32, nt * 16 * 4);
}

#ifdef RS_AMX
// One 32-column panel (nt = 1 or 2 tiles wide) times every 32-row block of xb [Mp, K] on the
// tiles: tmm0-3 the 2x2 accumulators, tmm4-5 x, tmm6-7 the panel.
template <int NT>
void panel_amx(const uint32_t* xb, int64_t M, int64_t Mp, int64_t K, const uint32_t* panel,
               float* out, int64_t N, int64_t n, float* scratch) {
  const int64_t G = K / 32, lda = K * 2;
  for (int64_t m = 0; m < Mp; m += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* a = xb + m * (K / 2);
    for (int64_t g = 0; g < G; ++g) {
      _tile_loadd(4, a + g * 16, lda);
      _tile_loadd(5, a + 16 * (K / 2) + g * 16, lda);
      _tile_loadd(6, panel + (2 * g) * kTileWords, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (NT == 2) {
        _tile_loadd(7, panel + (2 * g + 1) * kTileWords, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (m + 32 <= M) {  // straight into out
      float* o = out + m * N + n;
      _tile_stored(0, o, N * 4);
      _tile_stored(2, o + 16 * N, N * 4);
      if (NT == 2) {
        _tile_stored(1, o + 16, N * 4);
        _tile_stored(3, o + 16 * N + 16, N * 4);
      }
    } else {  // the last rows: through the scratch block [32, 32]
      _tile_stored(0, scratch, 128);
      _tile_stored(2, scratch + 16 * 32, 128);
      if (NT == 2) {
        _tile_stored(1, scratch + 16, 128);
        _tile_stored(3, scratch + 16 * 32 + 16, 128);
      }
      copy_rows(scratch, std::min<int64_t>(32, M - m), NT, out + m * N + n, N);
    }
  }
}
#endif

// C[i, 0 : 16 NT] = sum_p A[i, p] . B[p, 0 : 16 NT] for i < MR: A rows of bfloat16 pairs
// (row stride lda words), B the panel (tiles of 16 pairs, NT tiles side by side).
template <int MR, int NT>
inline void tile_dp(const uint32_t* A, int64_t lda, const uint32_t* panel, int64_t G, float* C,
                    int64_t ldc) {
  __m512 c[MR][NT];
  RS_UNROLL for (int i = 0; i < MR; ++i)
    RS_UNROLL for (int t = 0; t < NT; ++t) c[i][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint32_t* b0 = panel + 2 * g * kTileWords;
    for (int p = 0; p < 16; ++p) {
      const __m512i w0 = _mm512_load_si512(b0 + p * 16);
      const __m512i w1 = NT == 2 ? _mm512_load_si512(b0 + kTileWords + p * 16) : w0;
      RS_UNROLL for (int i = 0; i < MR; ++i) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(A[i * lda + g * 16 + p]));
        c[i][0] = _mm512_dpbf16_ps(c[i][0], as_bh(a), as_bh(w0));
        if (NT == 2) c[i][NT - 1] = _mm512_dpbf16_ps(c[i][NT - 1], as_bh(a), as_bh(w1));
      }
    }
  }
  RS_UNROLL for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(C + i * ldc, c[i][0]);
    if (NT == 2) _mm512_storeu_ps(C + i * ldc + 16, c[i][NT - 1]);
  }
}

constexpr int kDpRows = 12;  // vdpbf16ps tile: 12 x 2 accumulators + 2 panel vectors

// One panel times every row of xb on AVX-512 BF16 (rows of out written straight).
template <int NT>
void panel_avx512(const uint32_t* xb, int64_t M, int64_t K, const uint32_t* panel, float* out,
                  int64_t N, int64_t n) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += kDpRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kDpRows, M - m));
    with_rows<kDpRows>(mr, [&](auto R) {
      tile_dp<R, NT>(xb + m * (K / 2), K / 2, panel, G, out + m * N + n, N);
    });
  }
}

// out [M, N] = x W^T on `unit`, W's panels filled by tile(n, g, dst).
template <typename Tile>
void gemm_bf16(const at::Tensor& x, int64_t N, const at::Tensor& out, int64_t unit, Tile tile) {
  const int64_t M = x.size(0), K = x.size(1);
  check(x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 rows");
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M &&
            out.size(1) == N,
        "out must be contiguous float32 [M, N]");
  check(K % 32 == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  const bool amx = unit == static_cast<int64_t>(MatrixUnit::kAmx);
#ifdef RS_AMX
  check(!amx || amx_ready(), "AMX is unavailable: Linux refused the tile permission");
#else
  check(!amx, "this build has no AMX code");
#endif
  check(amx || unit == static_cast<int64_t>(MatrixUnit::kAvx512Bf16), "unknown matrix unit");
  if (M == 0) return;
  const int64_t Mp = amx ? (M + 31) / 32 * 32 : M;
  WordBuffer xb(Mp * K / 2);
  rows_to_bf16(x.data_ptr<float>(), x.stride(0), M, Mp, K, xb.data());
  float* op = out.data_ptr<float>();
  const int64_t G = K / 32, blocks = (N + kBlockCols - 1) / kBlockCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    WordBuffer panel(G * 2 * kTileWords);
#ifdef RS_AMX
    alignas(64) float scratch[32 * 32];
    if (amx) amx_begin();
#endif
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kBlockCols, nt = std::min<int64_t>(2, (N - n) / 16);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < nt; ++t) tile(n + 16 * t, g, panel.data() + (2 * g + t) * kTileWords);
#ifdef RS_AMX
      if (amx) {
        nt == 2 ? panel_amx<2>(xb.data(), M, Mp, K, panel.data(), op, N, n, scratch)
                : panel_amx<1>(xb.data(), M, Mp, K, panel.data(), op, N, n, scratch);
        continue;
      }
#endif
      nt == 2 ? panel_avx512<2>(xb.data(), M, K, panel.data(), op, N, n)
              : panel_avx512<1>(xb.data(), M, K, panel.data(), op, N, n);
    }
#ifdef RS_AMX
    if (amx) amx_end();
#endif
  });
}
#endif  // RS_AVX512_BF16

// The matrix units this build and CPU run, by the names kernels/matrix.py uses: "avx512-bf16"
// and "amx-bf16" (asking Linux for AMX's tile state once; refused: not listed).
std::vector<std::string> matrix_units() {
  std::vector<std::string> units;
#ifdef RS_AVX512_BF16
  if (cpu_has_avx512_bf16()) units.push_back("avx512-bf16");
#ifdef RS_AMX
  if (amx_ready() && cpu_has_avx512_bf16()) units.push_back("amx-bf16");
#endif
#endif
  return units;
}

// out = x W^T for int4 codes on a matrix unit (see the top of this file).
void q4_gemm_bf16([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& qs,
                  [[maybe_unused]] const at::Tensor& scale, [[maybe_unused]] const at::Tensor& minv,
                  [[maybe_unused]] const at::Tensor& out, [[maybe_unused]] int64_t unit) {
#ifdef RS_AVX512_BF16
  const int64_t N = qs.size(0), K = x.size(1);
  check(qs.size(1) == K / 2 && qs.is_contiguous() && scale.is_contiguous() &&
            minv.is_contiguous(),
        "int4 codes, scale and min must be contiguous [N, K/2], [N, K/32]");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  gemm_bf16(x, N, out, unit, [&](int64_t n, int64_t g, uint32_t* dst) {
    q4_tile(qp, sp, mp, N, K, n, g, dst);
  });
#else
  check(false, "this build has no bfloat16 matrix code (no AVX-512 BF16)");
#endif
}

void q8_gemm_bf16([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& qs,
                  [[maybe_unused]] const at::Tensor& scale,
                  [[maybe_unused]] const at::Tensor& out, [[maybe_unused]] int64_t unit) {
#ifdef RS_AVX512_BF16
  const int64_t N = qs.size(0), K = x.size(1);
  check(qs.size(1) == K && qs.is_contiguous() && scale.is_contiguous(),
        "int8 codes and scale must be contiguous [N, K], [N, K/32]");
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  gemm_bf16(x, N, out, unit,
            [&](int64_t n, int64_t g, uint32_t* dst) { q8_tile(qp, sp, N, K, n, g, dst); });
#else
  check(false, "this build has no bfloat16 matrix code (no AVX-512 BF16)");
#endif
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("matrix_units() -> str[]", &radixserve::matrix_units);  // no tensors: no key
  m.def(
      "q4_gemm_bf16(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out, int unit) "
      "-> ()");
  m.def("q8_gemm_bf16(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out, int unit) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q4_gemm_bf16", &radixserve::q4_gemm_bf16);
  m.impl("q8_gemm_bf16", &radixserve::q8_gemm_bf16);
}

// The register-blocked GEMM tile over a packed panel: the quantized GEMM's many-row path
// multiplies input rows by panels of dequantized weight rows with it, and prefill attention
// multiplies queries by panels of K rows (and, without AVX-512, probabilities by V rows).
// B is a panel of 16 rows packed k-major: B[k * 16 + j] = W[n + j, k].
#pragma once

#include <cstdint>

#include "simd.h"

namespace radixserve {
namespace {

#ifdef RS_AVX512
constexpr int kTileRows = 12;  // input rows per tile: 12 accumulators + 1 B
#else
constexpr int kTileRows = 6;   // input rows per tile: 12 accumulators + 2 B + 1 broadcast
#endif
constexpr int kPanel = 16;     // weight rows per packed panel (two 8-lane vectors)

// Rows of the next tile when `left` input rows remain: kTileRows, except that a rest of
// kTileRows + 1 to 2 kTileRows - 2 rows splits into two near-equal tiles (50 rows on AVX2:
// 6 x 7 + 4 + 4, not 6 x 8 + 2), since a tile of a few rows waits on its FMAs' latency.
// Each row's sums are its own, so the split changes no result.
inline int next_tile_rows(int64_t left) {
  if (left <= kTileRows || left >= 2 * kTileRows - 1)
    return static_cast<int>(left < kTileRows ? left : kTileRows);
  return static_cast<int>((left + 1) / 2);
}

// C[i, 0:16] (+)= sum_k A[i * lda + k] * B[k * ldb + 0:16] for i < MR (C row stride ldc).
// LDA > 0: A's row stride known at compile time (lda ignored), so the broadcasts address one
// pointer at constant offsets instead of a register per row.
template <int MR, bool ACC, int LDA = 0>
inline void tile_x16(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K,
                     float* C, int64_t ldc) {
  if constexpr (LDA > 0) lda = LDA;
#if defined(RS_AVX512)
  // One 16-lane vector per row: half the FMAs of the AVX2 tile, the A values broadcast
  // straight from memory into each FMA.
  __m512 c[MR];
  RS_UNROLL for (int i = 0; i < MR; ++i) {
    c[i] = ACC ? _mm512_loadu_ps(C + i * ldc) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_loadu_ps(B + k * ldb);
    RS_UNROLL for (int i = 0; i < MR; ++i) {
      c[i] = _mm512_fmadd_ps(_mm512_set1_ps(A[i * lda + k]), b, c[i]);
    }
  }
  RS_UNROLL for (int i = 0; i < MR; ++i) _mm512_storeu_ps(C + i * ldc, c[i]);
#elif defined(RS_AVX2)
  __m256 c0[MR], c1[MR];
  RS_UNROLL for (int i = 0; i < MR; ++i) {
    c0[i] = ACC ? _mm256_loadu_ps(C + i * ldc) : _mm256_setzero_ps();
    c1[i] = ACC ? _mm256_loadu_ps(C + i * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    RS_UNROLL for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
      c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
    }
  }
  RS_UNROLL for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(C + i * ldc, c0[i]);
    _mm256_storeu_ps(C + i * ldc + 8, c1[i]);
  }
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 16; ++j) {
      float acc = ACC ? C[i * ldc + j] : 0.f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * lda + k] * B[k * ldb + j];
      C[i * ldc + j] = acc;
    }
#endif
}

// tile_x16 for mr = 1..kTileRows rows.
template <bool ACC = false, int LDA = 0>
inline void tile_rows(int mr, const float* A, int64_t lda, const float* B, int64_t ldb,
                      int64_t K, float* C, int64_t ldc) {
  with_rows<kTileRows>(mr, [&](auto R) { tile_x16<R, ACC, LDA>(A, lda, B, ldb, K, C, ldc); });
}

#ifdef RS_AVX2
// Store the 8x8 block v (v[i] = 8 consecutive k of row i) transposed at o, kPanel apart: o[j *
// kPanel + i] = v[i][j], one half of 8 rows of a panel over 8 k.
inline void store_transposed8(const __m256* v, float* o) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(o + 0 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(o + 1 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(o + 2 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(o + 3 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(o + 4 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(o + 5 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(o + 6 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(o + 7 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

// Transpose 16 rows of length K (K % 8 == 0) into the k-major panel [K, 16].
inline void pack_panel(const float* const* rows, int64_t K, float* panel) {
#ifdef RS_AVX2
  for (int half = 0; half < 2; ++half) {
    const float* const* r = rows + half * 8;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(r[i] + k);
      store_transposed8(v, panel + k * kPanel + half * 8);
    }
  }
#else
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kPanel; ++j) panel[k * kPanel + j] = rows[j][k];
#endif
}

}  // namespace
}  // namespace radixserve

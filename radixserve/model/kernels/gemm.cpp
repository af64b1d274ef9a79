// Weight-only quantized GEMM: y = x W^T for float32 x and W in int4 or int8 codes.
// One input row runs straight from the codes (gemv_codes); 2-16 rows from the codes in
// registers (gemm_codes_small; without AVX2 over 4-row dequantized blocks), or, while
// exact_rows() is on (a step verifying speculative drafts), each row by gemv_codes' own
// arithmetic so that its result is bit for bit the row's alone (gemm_codes_exact); many rows over
// packed 16-row panels and a 6x16 register tile (with AVX-512 an 8x32 tile over pairs of panels
// into which int4 codes are dequantized straight).
//
// Quantized formats (both in groups of 32 consecutive weights along K, as llama.cpp's):
//   int4 ("Q4_1"): w = scale * q + min, q in [0, 15]; byte j of a group holds element j in its
//                  low nibble and element j + 16 in its high nibble. qs [N, K/2] uint8,
//                  scale/min [N, K/32] float32.
//   int8 ("Q8_0"): w = scale * q, q in [-128, 127]. qs [N, K] int8, scale [N, K/32] float32.
// Inputs and outputs are float32; accumulation is float32 (x is never quantized). Each weight
// is dequantized first (scale * q + min: exact in float32, since q has at most 8 bits and the
// scale and min come from float16), then multiplied, so the result equals
// x @ dequantized(W)^T up to summation order: no factored min term that could cancel. The
// exceptions are the one-row GEMV (gemv_codes) and its many-row twin (gemm_codes_exact),
// bound by unpacking the codes, which sum scale_g * (q_g . x_g) + min_g * sum(x_g) per group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "tile.h"

namespace radixserve {
namespace {

constexpr int64_t kGroup = 32;

#ifdef RS_AVX2
// 8 bytes at p, each widened to a 32-bit lane (zero- or sign-extended) in one load + shuffle.
inline __m256i u8x8_at(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 i8x8_at_ps(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The 32 codes of one int4 group at q as floats, in element order: each byte is widened to a
// 32-bit lane first and split into its nibbles there (fewer shuffles than splitting the 16
// bytes first; the one-row GEMV is bound by this unpacking).
inline void q4_group_to_ps(const uint8_t* q, __m256* c) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256i b0 = u8x8_at(q), b1 = u8x8_at(q + 8);
  c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));  // elements 0-7
  c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));  // 8-15
  c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));   // 16-23
  c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));   // 24-31
}

// One group's code products c . x, 8 lanes, summed in element order by one chain of FMAs:
// the one-row GEMV and its exact many-row twin (gemv_codes, exact_block) both sum a group so,
// then scale it into a row's one accumulator (five FP operations a group and input row).
inline __m256 group_dot(const __m256* c, __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  const __m256 t = _mm256_fmadd_ps(c[1], x1, _mm256_mul_ps(c[0], x0));
  return _mm256_fmadd_ps(c[3], x3, _mm256_fmadd_ps(c[2], x2, t));
}
#endif

// Unpack one group of 32 weights (without scale/min) into w[32].
inline void unpack_q4(const uint8_t* q, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<float>(q[j] & 0x0F);
    w[j + 16] = static_cast<float>(q[j] >> 4);
  }
}

// Dequantize rows [n, n + nr) of an int4 weight into buf [nr, K] float32.
void dequant_rows_q4(const uint8_t* qp, const float* sp, const float* mp, int64_t n, int64_t nr,
                     int64_t K, float* buf) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* q = qp + (n + r) * (K / 2);
    const float* s = sp + (n + r) * G;
    const float* mn = mp + (n + r) * G;
    float* o = buf + r * K;
    for (int64_t g = 0; g < G; ++g, q += 16, o += kGroup) {
#ifdef RS_AVX2
      __m256 c[4];
      q4_group_to_ps(q, c);
      const __m256 sc = _mm256_set1_ps(s[g]), mv = _mm256_set1_ps(mn[g]);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(sc, c[j], mv));
#else
      unpack_q4(q, o);
      for (int j = 0; j < kGroup; ++j) o[j] = s[g] * o[j] + mn[g];
#endif
    }
  }
}

// Dequantize rows [n, n + nr) of an int8 weight into buf [nr, K] float32.
void dequant_rows_q8(const int8_t* qp, const float* sp, int64_t n, int64_t nr, int64_t K,
                     float* buf) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < nr; ++r) {
    const int8_t* q = qp + (n + r) * K;
    const float* s = sp + (n + r) * G;
    float* o = buf + r * K;
    for (int64_t g = 0; g < G; ++g, q += kGroup, o += kGroup) {
#ifdef RS_AVX2
      const __m256 sc = _mm256_set1_ps(s[g]);
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(sc, i8x8_at_ps(q + 8 * j)));
#else
      for (int j = 0; j < kGroup; ++j) o[j] = s[g] * static_cast<float>(q[j]);
#endif
    }
  }
}

#ifdef RS_AVX2
// Rows n..n+15 of an int8 weight dequantized straight into the k-major panel [K, 16] (K % 32
// == 0): each 8 codes of 8 rows become floats times their group's scale (as dequant_rows_q8
// computes them) and are stored transposed, with no row-major copy between.
void dequant_panel_q8(const int8_t* qp, const float* sp, int64_t n, int64_t K, float* panel) {
  const int64_t G = K / kGroup;
  for (int half = 0; half < 2; ++half) {
    const int64_t r0 = n + half * 8;
    for (int64_t g = 0; g < G; ++g) {
      __m256 sc[8];
      for (int i = 0; i < 8; ++i) sc[i] = _mm256_set1_ps(sp[(r0 + i) * G + g]);
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_mul_ps(sc[i], i8x8_at_ps(qp + (r0 + i) * K + k));
        store_transposed8(v, panel + k * kPanel + half * 8);
      }
    }
  }
}
#endif

constexpr int64_t kRowBlock = 4;  // weight rows dequantized together (kept in L1)

// out[m, n + r] = x[m, :] . w[r, :] for the nr <= 4 dequantized rows w = buf [nr, K].
// Two input rows x four weight rows per pass: 8 independent accumulators, 6 loads per 8 FMAs.
void dot_block(const float* buf, int64_t nr, const float* x, int64_t M, int64_t K, float* out,
               int64_t N, int64_t n) {
  int64_t m = 0;
#ifdef RS_AVX2
  if (nr == kRowBlock && K % 8 == 0) {
    const float *w0 = buf, *w1 = buf + K, *w2 = buf + 2 * K, *w3 = buf + 3 * K;
    for (; m + 2 <= M; m += 2) {
      const float *xa = x + m * K, *xb = xa + K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 u = _mm256_loadu_ps(xa + k), v = _mm256_loadu_ps(xb + k);
        __m256 w = _mm256_loadu_ps(w0 + k);
        a0 = _mm256_fmadd_ps(w, u, a0);
        b0 = _mm256_fmadd_ps(w, v, b0);
        w = _mm256_loadu_ps(w1 + k);
        a1 = _mm256_fmadd_ps(w, u, a1);
        b1 = _mm256_fmadd_ps(w, v, b1);
        w = _mm256_loadu_ps(w2 + k);
        a2 = _mm256_fmadd_ps(w, u, a2);
        b2 = _mm256_fmadd_ps(w, v, b2);
        w = _mm256_loadu_ps(w3 + k);
        a3 = _mm256_fmadd_ps(w, u, a3);
        b3 = _mm256_fmadd_ps(w, v, b3);
      }
      float* oa = out + m * N + n;
      float* ob = oa + N;
      oa[0] = hsum(a0), oa[1] = hsum(a1), oa[2] = hsum(a2), oa[3] = hsum(a3);
      ob[0] = hsum(b0), ob[1] = hsum(b1), ob[2] = hsum(b2), ob[3] = hsum(b3);
    }
    for (; m < M; ++m) {
      const float* xa = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 u = _mm256_loadu_ps(xa + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), u, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), u, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), u, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), u, a3);
      }
      float* oa = out + m * N + n;
      oa[0] = hsum(a0), oa[1] = hsum(a1), oa[2] = hsum(a2), oa[3] = hsum(a3);
    }
    return;
  }
#endif
  for (; m < M; ++m)
    for (int64_t r = 0; r < nr; ++r) {
      const float* w = buf + r * K;
      const float* xa = x + m * K;
      float d = 0;
      for (int64_t k = 0; k < K; ++k) d += w[k] * xa[k];
      out[m * N + n + r] = d;
    }
}

// y = x W^T for a quantized W: each thread dequantizes 4 weight rows at a time into a buffer
// that stays in L1 and multiplies every input row by them.
template <typename Dequant>
void quant_gemm(const at::Tensor& x, int64_t N, const at::Tensor& out, Dequant dequant) {
  const int64_t M = x.size(0), K = x.size(1);
  check(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  check(out.is_contiguous() && out.size(0) == M && out.size(1) == N, "out shape");
  check(K % kGroup == 0, "K must be a multiple of 32");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(kRowBlock * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRowBlock, nr = std::min(kRowBlock, N - n);
      dequant(n, nr, buf.data());
      dot_block(buf.data(), nr, xp, M, K, op, N, n);
    }
  });
}

constexpr int64_t kPanelMinRows = 8;  // from 8 input rows on, packed panels beat dot_block
constexpr int64_t kSliceK = 192;  // AVX-512 panel GEMM: K per slice (two 12 KB panel slices)

#ifdef RS_AVX512
constexpr int kPackRows = 8;  // AVX-512 panel GEMM: rows of x per packed block

// C[i, 0:16 NP] (+)= sum_k Ap[k * 8 + i] * (B0 | B1)[k * 16 + 0:16] for i < MR <= 8: a block
// of 8 rows of x packed k-major against one or two panels (8x32: 16 accumulators, 2 loads
// and 8 broadcasts per 16 FMAs, so the FMAs and not the loads set the pace).
template <int MR, bool ACC, int NP>
inline void tile_x8(const float* Ap, const float* B0, const float* B1, int64_t K, float* C,
                    int64_t ldc) {
  __m512 c[MR][NP];
  RS_UNROLL for (int i = 0; i < MR; ++i)
    RS_UNROLL for (int j = 0; j < NP; ++j)
      c[i][j] = ACC ? _mm512_loadu_ps(C + i * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, Ap += kPackRows, B0 += kPanel, B1 += kPanel) {
    const __m512 b0 = _mm512_loadu_ps(B0);
    const __m512 b1 = NP == 2 ? _mm512_loadu_ps(B1) : b0;
    RS_UNROLL for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(Ap[i]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      if (NP == 2) c[i][NP - 1] = _mm512_fmadd_ps(a, b1, c[i][NP - 1]);
    }
  }
  RS_UNROLL for (int i = 0; i < MR; ++i)
    RS_UNROLL for (int j = 0; j < NP; ++j) _mm512_storeu_ps(C + i * ldc + 16 * j, c[i][j]);
}

template <bool ACC, int NP>
inline void tile_x8_rows(int mr, const float* Ap, const float* B0, const float* B1, int64_t K,
                         float* C, int64_t ldc) {
  with_rows<kPackRows>(mr, [&](auto R) { tile_x8<R, ACC, NP>(Ap, B0, B1, K, C, ldc); });
}

// Rows n..n+15 of an int4 weight dequantized straight into the k-major panel [K, 16]: per
// group, the 16 rows' codes are widened to 32-bit lanes, transposed 16x16 in registers, split
// into their nibbles and scaled with the 16 rows' scale and min as vectors (a third of the
// instructions of dequant_rows_q4 + pack_panel; at 50 input rows those were a third of the
// GEMM's time).
void dequant_panel_q4(const uint8_t* qp, const float* sp, const float* mp, int64_t n,
                      int64_t K, float* panel) {
  const int64_t G = K / kGroup;
  const __m512i stride = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(G)));
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512i r[16], t[16];
    for (int j = 0; j < 16; ++j)
      r[j] = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + (n + j) * (K / 2) + g * 16)));
    // 16x16 transpose of 32-bit lanes: 4x4 blocks inside each 128-bit lane, then the lanes.
    for (int j = 0; j < 16; j += 4) {
      const __m512i a = _mm512_unpacklo_epi32(r[j], r[j + 1]);
      const __m512i b = _mm512_unpackhi_epi32(r[j], r[j + 1]);
      const __m512i c = _mm512_unpacklo_epi32(r[j + 2], r[j + 3]);
      const __m512i d = _mm512_unpackhi_epi32(r[j + 2], r[j + 3]);
      t[j] = _mm512_unpacklo_epi64(a, c);      // column 0 of each lane, rows j..j+3
      t[j + 1] = _mm512_unpackhi_epi64(a, c);  // column 1
      t[j + 2] = _mm512_unpacklo_epi64(b, d);  // column 2
      t[j + 3] = _mm512_unpackhi_epi64(b, d);  // column 3
    }
    const __m512 sc = _mm512_i32gather_ps(stride, sp + n * G + g, 4);
    const __m512 mn = _mm512_i32gather_ps(stride, mp + n * G + g, 4);
    float* o = panel + g * kGroup * kPanel;
    for (int c = 0; c < 4; ++c) {
      const __m512i a = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x88);
      const __m512i b = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xDD);
      const __m512i e = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x88);
      const __m512i f = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xDD);
      const __m512i col[4] = {_mm512_shuffle_i32x4(a, e, 0x88), _mm512_shuffle_i32x4(b, f, 0x88),
                              _mm512_shuffle_i32x4(a, e, 0xDD), _mm512_shuffle_i32x4(b, f, 0xDD)};
      for (int l = 0; l < 4; ++l) {  // byte kk = 4 l + c: elements kk (low) and kk + 16 (high)
        const int64_t kk = 4 * l + c;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(col[l], low));
        _mm512_storeu_ps(o + kk * kPanel, _mm512_fmadd_ps(lo, sc, mn));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(col[l], 4));
        _mm512_storeu_ps(o + (kk + 16) * kPanel, _mm512_fmadd_ps(hi, sc, mn));
      }
    }
  }
}
#endif

// y = x W^T for many input rows: each thread dequantizes 16 weight rows at a time, packs them
// k-major (the panel stays in L2) and runs every 6-row tile of x over it (AVX-512: two panels
// at a time, every 8-row block of x, packed k-major once, meets them in slices of K).
// `panel_dequant(n, panel)` may fill a whole panel of 16 rows straight from the codes (true)
// instead of dequant + pack_panel.
template <typename Dequant, typename PanelDequant>
void quant_gemm_panels(const at::Tensor& x, int64_t N, const at::Tensor& out, Dequant dequant,
                       PanelDequant panel_dequant) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panels = (N + kPanel - 1) / kPanel;
#ifdef RS_AVX512
  // x in blocks of kPackRows (8) rows, each packed k-major, once for every panel.
  const int64_t blocks = (M + kPackRows - 1) / kPackRows;
  std::vector<float> xpk(blocks * K * kPackRows, 0.f);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* dst = xpk.data() + blk * K * kPackRows;
      for (int64_t m = blk * kPackRows; m < std::min(M, (blk + 1) * kPackRows); ++m)
        for (int64_t k = 0; k < K; ++k) dst[k * kPackRows + m % kPackRows] = xp[m * K + k];
    }
  });
  constexpr int64_t kGroupPanels = 2;  // panels a thread takes at a time: the 8x32 tile's two
#else
  constexpr int64_t kGroupPanels = 1;
#endif
  // out[:, n : n + nr] = x . (np panels from `panel`, kPanel * K floats apart); a short last
  // panel (nr < 16 np) through the buffer cbuf [M, 32].
  auto run_panels = [&](const float* panel, int64_t np, int64_t n, int64_t nr, float* cbuf) {
    const bool whole = nr == np * kPanel;
    float* C = whole ? op + n : cbuf;
    const int64_t ldc = whole ? N : 2 * kPanel;
#ifdef RS_AVX512
    // K in slices: a slice of the panels stays in L1 while every block of x meets it.
    const float* p1 = panel + K * kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kSliceK) {
      const int64_t kn = std::min(kSliceK, K - k0);
      for (int64_t m = 0; m < M; m += kPackRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kPackRows, M - m));
        const float* a = xpk.data() + (m / kPackRows) * K * kPackRows + k0 * kPackRows;
        const float *b0 = panel + k0 * kPanel, *b1 = p1 + k0 * kPanel;
        float* c = C + m * ldc;
        if (np == 2)
          k0 == 0 ? tile_x8_rows<false, 2>(mr, a, b0, b1, kn, c, ldc)
                  : tile_x8_rows<true, 2>(mr, a, b0, b1, kn, c, ldc);
        else
          k0 == 0 ? tile_x8_rows<false, 1>(mr, a, b0, b0, kn, c, ldc)
                  : tile_x8_rows<true, 1>(mr, a, b0, b0, kn, c, ldc);
      }
    }
#else
    for (int64_t m = 0, mr = 0; m < M; m += mr) {
      mr = next_tile_rows(M - m);
      tile_rows(static_cast<int>(mr), xp + m * K, K, panel, kPanel, K, C + m * ldc, ldc);
    }
#endif
    if (!whole)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(op + m * N + n, cbuf + m * 2 * kPanel, nr * sizeof(float));
  };
  const int64_t units = (panels + kGroupPanels - 1) / kGroupPanels;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> rows(kPanel * K), panel(kGroupPanels * kPanel * K);
    std::vector<float> cbuf(N % (kGroupPanels * kPanel) ? M * 2 * kPanel : 0);
    const float* row_ptrs[kPanel];
    for (int i = 0; i < kPanel; ++i) row_ptrs[i] = rows.data() + i * K;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = u * kGroupPanels * kPanel;
      const int64_t np = std::min(kGroupPanels, panels - u * kGroupPanels);
      for (int64_t j = 0; j < np; ++j) {
        const int64_t nj = n + j * kPanel, nr = std::min<int64_t>(kPanel, N - nj);
        float* pj = panel.data() + j * kPanel * K;
        if (nr < kPanel || !panel_dequant(nj, pj)) {
          if (nr < kPanel) std::fill(rows.begin(), rows.end(), 0.f);
          dequant(nj, nr, rows.data());
          pack_panel(row_ptrs, K, pj);
        }
      }
      run_panels(panel.data(), np, n, std::min(np * kPanel, N - n), cbuf.data());
    }
  });
}

// ---- 1-16 input rows (decode steps): the weights used straight from their codes (AVX2) ----

#ifdef RS_AVX2
// a[0:n] . b[0:n].
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum = std::fma(a[i], b[i], sum);  // explicit: the same bits wherever inlined
  return sum;
}

// The 32 weights of group g of row n as floats (codes only: no scale or min).
template <int kind>
inline void load_codes(const void* qv, int64_t n, int64_t K, int64_t g, __m256* c) {
  if (kind == 4) {
    q4_group_to_ps(static_cast<const uint8_t*>(qv) + n * (K / 2) + g * 16, c);
  } else {
    const int8_t* q = static_cast<const int8_t*>(qv) + n * K + g * kGroup;
    for (int j = 0; j < 4; ++j) c[j] = i8x8_at_ps(q + 8 * j);
  }
}

// A row's result from its 8-lane group accumulator `acc`: with int4 codes the min term
// sum_g min_g * sum(x_g) joins the accumulator 8 groups at a time before the one horizontal
// sum, its last G % 8 groups after it. gemv_codes and exact_block finish every row so.
template <int kind>
inline float finish_row(__m256 acc, const float* mins, const float* xsum, int64_t G) {
  if (kind != 4) return hsum(acc);
  int64_t g = 0;
  for (; g + 8 <= G; g += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xsum + g), acc);
  float sum = hsum(acc);
  for (; g < G; ++g) sum = std::fma(mins[g], xsum[g], sum);  // explicit, as in dot()
  return sum;
}

#ifdef RS_AVX512
// load_codes in 16 lanes: c[0] elements 0-15, c[1] elements 16-31 of group g of row n.
template <int kind>
inline void load_codes16(const void* qv, int64_t n, int64_t K, int64_t g, __m512* c) {
  if (kind == 4) {
    // Byte j holds element j (low nibble) and j + 16 (high): widen, then split in place.
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(qv) + n * (K / 2) + g * 16)));
    c[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    c[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    const int8_t* q = static_cast<const int8_t*>(qv) + n * K + g * kGroup;
    for (int j = 0; j < 2; ++j)
      c[j] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
  }
}
#endif

// The int4 min term's sum(x_g) of each group g of each of M input rows, [M, K / 32], each summed
// element by element in order: the one-row GEMV and its exact many-row twin must get the same
// bits. Empty for int8 (no min term).
template <int kind>
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  std::vector<float> sums(kind == 4 ? M * G : 0, 0.f);
  if (kind == 4)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < kGroup; ++j) sums[r * G + g] += x[r * K + g * kGroup + j];
  return sums;
}

// One input row (decode of a single sequence): the GEMM is bound by turning codes into
// floats, so each weight row is used straight from its codes in the factored form
// sum_g scale_g * (q_g . x_g) + min_g * sum(x_g), with no dequantized copy. Two weight rows
// share each load of x (int4: 1.7x on L3-resident weights). `kind` 4 or 8.
template <int kind>
void gemv_codes(const float* x, const void* qv, const float* sp, const float* mp, int64_t N,
                int64_t K, float* out) {
  const int64_t G = K / kGroup;
  const std::vector<float> xsum_buf = group_sums<kind>(x, 1, K);  // once per call
  const float* xsum = xsum_buf.data();
  constexpr int64_t rows = 2;  // two weight rows share each load of x
  const int64_t row_bytes = kind == 4 ? K / 2 : K;
  at::parallel_for(0, (N + rows - 1) / rows, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t n = rows * p0; n < std::min(N, rows * p1); n += rows) {
      const int64_t m = std::min(n + rows - 1, N - 1);  // the pair's second row (or n itself)
      // Ask for the rows a few pairs ahead. AVX2 (tuned on Zen 3): DRAM latency ~300 cycles,
      // a pair of rows ~200, 3 pairs ahead into L1. AVX-512 (tuned on Zen 4, whose core
      // outruns its memory): 8 pairs ahead into L2, where the same rows into L1 held the
      // GEMV to 60% of the read bandwidth (many L1 misses in flight, few lines each).
#ifdef RS_AVX512
      constexpr int64_t kAheadPairs = 8;
      constexpr auto kHint = _MM_HINT_T1;
#else
      constexpr int64_t kAheadPairs = 3;
      constexpr auto kHint = _MM_HINT_T0;
#endif
      const int64_t ahead = std::min(n + kAheadPairs * rows, N - 1);
      const char* next = static_cast<const char*>(qv) + ahead * row_bytes;
      for (int64_t off = 0; off < rows * row_bytes; off += 64) _mm_prefetch(next + off, kHint);
      _mm_prefetch(reinterpret_cast<const char*>(sp + ahead * G), _MM_HINT_T0);
      if (kind == 4) _mm_prefetch(reinterpret_cast<const char*>(mp + ahead * G), _MM_HINT_T0);
#ifdef RS_AVX512
      // 16 lanes: a group's 32 codes are two vectors (int4: one widening load of 16 bytes).
      __m512 a = _mm512_setzero_ps(), b = a;
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + g * kGroup;
        const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
        __m512 c[2], d[2];
        load_codes16<kind>(qv, n, K, g, c);
        if (rows == 2) load_codes16<kind>(qv, m, K, g, d);
        a = _mm512_fmadd_ps(_mm512_set1_ps(sp[n * G + g]),
                            _mm512_fmadd_ps(c[1], x1, _mm512_mul_ps(c[0], x0)), a);
        if (rows == 2)
          b = _mm512_fmadd_ps(_mm512_set1_ps(sp[m * G + g]),
                              _mm512_fmadd_ps(d[1], x1, _mm512_mul_ps(d[0], x0)), b);
      }
      const float sum_a = _mm512_reduce_add_ps(a), sum_b = _mm512_reduce_add_ps(b);
      // int4's min term: sum_g min_g * sum(x_g), one dot product per row.
      const float mins_a = kind == 4 ? dot(mp + n * G, xsum, G) : 0.f;
      const float mins_b = kind == 4 ? dot(mp + m * G, xsum, G) : 0.f;
      out[n] = sum_a + mins_a;
      if (rows == 2) out[m] = sum_b + mins_b;
#else
      __m256 a = _mm256_setzero_ps(), b = a;
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + g * kGroup;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        __m256 c[4], d[4];
        load_codes<kind>(qv, n, K, g, c);
        if (rows == 2) load_codes<kind>(qv, m, K, g, d);
        a = _mm256_fmadd_ps(_mm256_set1_ps(sp[n * G + g]), group_dot(c, x0, x1, x2, x3), a);
        if (rows == 2)
          b = _mm256_fmadd_ps(_mm256_set1_ps(sp[m * G + g]), group_dot(d, x0, x1, x2, x3), b);
      }
      out[n] = finish_row<kind>(a, mp + n * G, xsum, G);
      if (rows == 2) out[m] = finish_row<kind>(b, mp + m * G, xsum, G);
#endif
    }
  });
}

constexpr int64_t kSmallRows = 16;  // up to this many input rows: gemm_codes_small / _exact
#ifdef RS_AVX512
constexpr int64_t kCodeRows = 2;  // weight rows a block: 4 weight vectors + 2 x 8 accumulators
#else
constexpr int64_t kCodeRows = 1;  // 16 registers: 4 weight vectors + 8 accumulators + x
#endif

// out[r, n + j] = x[r] . w[n + j] for MR input rows and the NR <= kCodeRows weight rows from
// row n: each group's codes become weights in registers (scale * q + min, as dequantized)
// once, then meet every input row; nothing is written to memory but the outputs.
template <int kind, int MR, int NR>
inline void codes_block(const float* x, int64_t K, const void* qv, const float* sp,
                        const float* mp, int64_t n, float* out, int64_t N) {
  const int64_t G = K / kGroup;
#ifdef RS_AVX512
  __m512 acc[NR][MR];
  RS_UNROLL for (int j = 0; j < NR; ++j)
    RS_UNROLL for (int r = 0; r < MR; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 w[NR][2];
    RS_UNROLL for (int j = 0; j < NR; ++j) {
      load_codes16<kind>(qv, n + j, K, g, w[j]);
      const __m512 sc = _mm512_set1_ps(sp[(n + j) * G + g]);
      if (kind == 4) {
        const __m512 mn = _mm512_set1_ps(mp[(n + j) * G + g]);
        w[j][0] = _mm512_fmadd_ps(w[j][0], sc, mn);
        w[j][1] = _mm512_fmadd_ps(w[j][1], sc, mn);
      } else {
        w[j][0] = _mm512_mul_ps(w[j][0], sc);
        w[j][1] = _mm512_mul_ps(w[j][1], sc);
      }
    }
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xg = x + r * K + g * kGroup;
      const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
      RS_UNROLL for (int j = 0; j < NR; ++j)
        acc[j][r] = _mm512_fmadd_ps(w[j][1], x1, _mm512_fmadd_ps(w[j][0], x0, acc[j][r]));
    }
  }
  RS_UNROLL for (int j = 0; j < NR; ++j)
    RS_UNROLL for (int r = 0; r < MR; ++r) out[r * N + n + j] = _mm512_reduce_add_ps(acc[j][r]);
#else
  static_assert(NR == 1, "AVX2: one weight row a block");
  // A row's 4 FMAs a group chain on each other: below 5 rows, two accumulators a row (even
  // and odd vectors) keep enough FMAs in flight.
  constexpr int A = MR <= 4 ? 2 : 1;
  __m256 acc[MR][A];
  RS_UNROLL for (int r = 0; r < MR; ++r)
    RS_UNROLL for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 w[4];
    load_codes<kind>(qv, n, K, g, w);
    const __m256 sc = _mm256_set1_ps(sp[n * G + g]);
    const __m256 mn = kind == 4 ? _mm256_set1_ps(mp[n * G + g]) : _mm256_setzero_ps();
    RS_UNROLL for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(w[j], sc, mn);
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xg = x + r * K + g * kGroup;
      RS_UNROLL for (int j = 0; j < 4; ++j)
        acc[r][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), acc[r][j % A]);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    __m256 sum = acc[r][0];
    if (A == 2) sum = _mm256_add_ps(sum, acc[r][A - 1]);
    out[r * N + n] = hsum(sum);
  }
#endif
}

// f(n, nr) for every block of kCodeRows weight rows from row n (nr of them, fewer at the end),
// the blocks spread over the threads, each asking for the codes 4 rows ahead: the loop the
// few-row GEMMs share.
template <typename F>
void for_code_row_blocks(const void* qv, int64_t row_bytes, int64_t N, F&& f) {
  at::parallel_for(0, (N + kCodeRows - 1) / kCodeRows, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t n = kCodeRows * p0; n < std::min(N, kCodeRows * p1); n += kCodeRows) {
      // Past the last row the prefetch reads nothing useful, harmlessly (it never faults).
      const int64_t ahead = std::min(n + 4, N - 1);
      const char* next = static_cast<const char*>(qv) + ahead * row_bytes;
      for (int64_t off = 0; off < kCodeRows * row_bytes; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T0);
      f(n, std::min<int64_t>(kCodeRows, N - n));
    }
  });
}

template <int kind, int MR>
inline void codes_rows(const float* x, int64_t K, const void* qv, const float* sp,
                       const float* mp, int64_t n, int64_t nr, float* out, int64_t N) {
  if (kCodeRows == 2 && nr == 2)
    return codes_block<kind, MR, kCodeRows>(x, K, qv, sp, mp, n, out, N);
  codes_block<kind, MR, 1>(x, K, qv, sp, mp, n, out, N);
}

// y = x W^T for 2..16 input rows (a decode step of a few sequences): the weights are read
// from their codes once per 8 input rows, kCodeRows rows at a time across threads, with no
// dequantized copy (the panel path's unpacking and packing cost as much as the FMAs here).
template <int kind>
void gemm_codes_small(const float* x, int64_t M, const void* qv, const float* sp,
                      const float* mp, int64_t N, int64_t K, float* out) {
  for_code_row_blocks(qv, kind == 4 ? K / 2 : K, N, [&](int64_t n, int64_t nr) {
    for (int64_t m = 0; m < M; m += 8) {
      const float* xm = x + m * K;
      float* om = out + m * N;
      with_rows<8>(static_cast<int>(std::min<int64_t>(8, M - m)), [&](auto R) {
        codes_rows<kind, R>(xm, K, qv, sp, mp, n, nr, om, N);
      });
    }
  });
}

// out[r * N + n + j] = x[r] . w[n + j] for MR input rows and NR weight rows from row n, each
// computed by exactly the operations gemv_codes applies to one input row, in the same order
// (factored form, the same accumulators, reduction and min term), so an input row's result
// does not depend on the other rows of the call: a decode step of several sequences, or a
// sequence's speculative rows, gives each row what it would get alone. `xsum` holds each
// input row's per-group sums (int4's min term), G apart.
template <int kind, int MR, int NR>
inline void exact_block(const float* x, const float* xsum, int64_t K, const void* qv,
                        const float* sp, const float* mp, int64_t n, float* out, int64_t N) {
  const int64_t G = K / kGroup;
#ifdef RS_AVX512
  __m512 acc[NR][MR];
  RS_UNROLL for (int j = 0; j < NR; ++j)
    RS_UNROLL for (int r = 0; r < MR; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 c[NR][2], sc[NR];
    RS_UNROLL for (int j = 0; j < NR; ++j) {
      load_codes16<kind>(qv, n + j, K, g, c[j]);
      sc[j] = _mm512_set1_ps(sp[(n + j) * G + g]);
    }
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xg = x + r * K + g * kGroup;
      const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
      RS_UNROLL for (int j = 0; j < NR; ++j)
        acc[j][r] = _mm512_fmadd_ps(
            sc[j], _mm512_fmadd_ps(c[j][1], x1, _mm512_mul_ps(c[j][0], x0)), acc[j][r]);
    }
  }
  RS_UNROLL for (int j = 0; j < NR; ++j)
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[j][r]);
      const float mins = kind == 4 ? dot(mp + (n + j) * G, xsum + r * G, G) : 0.f;
      out[r * N + n + j] = sum + mins;
    }
#else
  static_assert(NR == 1, "AVX2: one weight row a block");
  __m256 acc[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 c[4];
    load_codes<kind>(qv, n, K, g, c);
    const __m256 sc = _mm256_set1_ps(sp[n * G + g]);
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xg = x + r * K + g * kGroup;
      acc[r] = _mm256_fmadd_ps(sc,
                               group_dot(c, _mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8),
                                         _mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24)),
                               acc[r]);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * N + n] = finish_row<kind>(acc[r], mp + n * G, xsum + r * G, G);
#endif
}

#ifdef RS_AVX512
constexpr int kExactRows = 8;  // input rows a block: 2 x 8 accumulators + 4 code vectors
#else
constexpr int kExactRows = 8;  // 16 registers: 8 accumulators + 4 code vectors + the scale
#endif

// y = x W^T for 2..16 input rows, each row exactly as gemv_codes computes it alone (see
// exact_block): the codes are read once per kExactRows input rows, kCodeRows weight rows at
// a time across threads.
template <int kind>
void gemm_codes_exact(const float* x, int64_t M, const void* qv, const float* sp,
                      const float* mp, int64_t N, int64_t K, float* out) {
  const int64_t G = K / kGroup;
  const std::vector<float> xsum = group_sums<kind>(x, M, K);  // as gemv_codes sums them
  for_code_row_blocks(qv, kind == 4 ? K / 2 : K, N, [&](int64_t n, int64_t nr) {
    for (int64_t m = 0; m < M; m += kExactRows) {
      const float* xm = x + m * K;
      const float* sm = kind == 4 ? xsum.data() + m * G : nullptr;
      float* om = out + m * N;
      with_rows<kExactRows>(static_cast<int>(std::min<int64_t>(kExactRows, M - m)), [&](auto R) {
        if (kCodeRows == 2 && nr == 2)
          exact_block<kind, R, kCodeRows>(xm, sm, K, qv, sp, mp, n, om, N);
        else
          exact_block<kind, R, 1>(xm, sm, K, qv, sp, mp, n, om, N);
      });
    }
  });
}

// out = x W^T straight from the codes for 1-16 input rows (gemv_codes; gemm_codes_small, or
// gemm_codes_exact while exact_rows() is on);
// false, with nothing done, where that path does not apply: more rows, x or out strided, or K
// not whole groups.
template <int kind>
bool gemm_from_codes(const at::Tensor& x, const void* qv, const float* sp, const float* mp,
                     int64_t N, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M > kSmallRows || !x.is_contiguous() || !out.is_contiguous() || K % kGroup != 0)
    return false;
  if (M == 1)
    gemv_codes<kind>(x.data_ptr<float>(), qv, sp, mp, N, K, out.data_ptr<float>());
  else if (exact_rows())
    gemm_codes_exact<kind>(x.data_ptr<float>(), M, qv, sp, mp, N, K, out.data_ptr<float>());
  else
    gemm_codes_small<kind>(x.data_ptr<float>(), M, qv, sp, mp, N, K, out.data_ptr<float>());
  return true;
}
#else
// Without AVX2 the few-row paths are those of many rows.
template <int kind>
bool gemm_from_codes(const at::Tensor&, const void*, const float*, const float*, int64_t,
                     const at::Tensor&) {
  return false;
}
#endif

}  // namespace

namespace {
std::atomic<bool> g_exact_rows{false};
}  // namespace

bool exact_rows() { return g_exact_rows.load(std::memory_order_relaxed); }

// Turn exact_rows() on or off (the model runner, around a step that verifies drafts).
void set_exact_rows(bool on) { g_exact_rows.store(on, std::memory_order_relaxed); }

void q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& minv, const at::Tensor& out) {
  const int64_t K = x.size(1);
  check(qs.size(1) == K / 2 && qs.is_contiguous(), "qs shape");
  check(scale.is_contiguous() && minv.is_contiguous(), "scale and min must be contiguous");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  if (gemm_from_codes<4>(x, qp, sp, mp, qs.size(0), out)) return;
  auto dequant = [&](int64_t n, int64_t nr, float* buf) {
    dequant_rows_q4(qp, sp, mp, n, nr, K, buf);
  };
  auto dequant_panel = [&]([[maybe_unused]] int64_t n, [[maybe_unused]] float* panel) {
#ifdef RS_AVX512
    if (K % kGroup == 0) {
      dequant_panel_q4(qp, sp, mp, n, K, panel);
      return true;
    }
#endif
    return false;
  };
  if (x.size(0) >= kPanelMinRows && K % 8 == 0)
    return quant_gemm_panels(x, qs.size(0), out, dequant, dequant_panel);
  quant_gemm(x, qs.size(0), out, dequant);
}

void q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& out) {
  const int64_t K = x.size(1);
  check(qs.size(1) == K && qs.is_contiguous() && scale.is_contiguous(), "qs shape");
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  if (gemm_from_codes<8>(x, qp, sp, nullptr, qs.size(0), out)) return;
  auto dequant = [&](int64_t n, int64_t nr, float* buf) {
    dequant_rows_q8(qp, sp, n, nr, K, buf);
  };
  auto dequant_panel = [&]([[maybe_unused]] int64_t n, [[maybe_unused]] float* panel) {
#ifdef RS_AVX2
    if (K % kGroup == 0) {
      dequant_panel_q8(qp, sp, n, K, panel);
      return true;
    }
#endif
    return false;
  };
  if (x.size(0) >= kPanelMinRows && K % 8 == 0)
    return quant_gemm_panels(x, qs.size(0), out, dequant, dequant_panel);
  quant_gemm(x, qs.size(0), out, dequant);
}

namespace {

// Dequantize into out [N, K] float32.
void q4_dequant(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& minv,
                const at::Tensor& out) {
  const int64_t N = qs.size(0), K = out.size(1);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    dequant_rows_q4(qp, sp, mp, n0, n1 - n0, K, op + n0 * K);
  });
}

void q8_dequant(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& out) {
  const int64_t N = qs.size(0), K = qs.size(1);
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    dequant_rows_q8(qp, sp, n0, n1 - n0, K, op + n0 * K);
  });
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("q4_gemm(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_gemm(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def("q4_dequant(Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_dequant(Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def("set_exact_rows(bool on) -> ()", &radixserve::set_exact_rows);  // no tensors: no key
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q4_gemm", &radixserve::q4_gemm);
  m.impl("q8_gemm", &radixserve::q8_gemm);
  m.impl("q4_dequant", &radixserve::q4_dequant);
  m.impl("q8_dequant", &radixserve::q8_dequant);
}

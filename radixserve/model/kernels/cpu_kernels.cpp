// CPU kernels of radixserve: weight-only quantized GEMM (one row straight from the codes; 2-16
// rows from the codes in registers, without AVX2 over 4-row dequantized blocks; many rows
// over packed 16-row panels and a 6x16 register tile; with AVX-512 an 8x32 tile over pairs of
// panels into which int4 codes are dequantized straight), paged decode and
// prefill attention that read K/V (float32, bfloat16 or float16) from the block pool in place,
// the fused elementwise steps of a decoder layer, and a decode step's whole stack of layers in
// one call.
//
// Quantized formats (both in groups of 32 consecutive weights along K, as llama.cpp's):
//   int4 ("Q4_1"): w = scale * q + min, q in [0, 15]; byte j of a group holds element j in its
//                  low nibble and element j + 16 in its high nibble. qs [N, K/2] uint8,
//                  scale/min [N, K/32] float32.
//   int8 ("Q8_0"): w = scale * q, q in [-128, 127]. qs [N, K] int8, scale [N, K/32] float32.
// Inputs and outputs are float32; accumulation is float32 (x is never quantized). Each weight
// is dequantized first (scale * q + min: exact in float32, since q has at most 8 bits and the
// scale and min come from float16), then multiplied, so the result equals
// x @ dequantized(W)^T up to summation order: no factored min term that could cancel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_AVX2 1
#endif
// AVX-512 (F, BW, VL, DQ): 16 lanes a vector for the hot loops (the quantized GEMV of 1-16
// rows, decode attention, the prefill register tile); everything else runs the AVX2 code.
#if defined(RS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define RS_AVX512 1
#endif

// Before a loop over a tile's compile-time row count: unrolled early, GCC keeps the tile's
// accumulator array in registers; left to its later unrolling, it stores every accumulator to
// the stack on every k (seen in tile_x16 and the one-panel tile_x8: 2-3x slower).
#define RS_UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kGroup = 32;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "radixserve kernel: ", what); }

// A zeroed float buffer on 64-byte (cache line) boundaries.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(int64_t n)
      : p_(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64))) {
    check(p_ != nullptr, "out of memory");
    std::memset(p_, 0, n * sizeof(float));
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  float* data() { return p_; }
  float* begin() { return p_; }

 private:
  float* p_;
};

#ifdef RS_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
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

// f(std::integral_constant<int, MR>{}) for the row count mr in 1..Max (anything else: 1), so
// a tile written for a compile-time row count runs for the rows at hand.
template <typename F, int... I>
inline void with_rows_impl(int mr, F& f, std::integer_sequence<int, I...>) {
  const bool done = ((mr == I + 1 && (f(std::integral_constant<int, I + 1>{}), true)) || ...);
  if (!done) f(std::integral_constant<int, 1>{});
}
template <int Max, typename F>
inline void with_rows(int mr, F&& f) {
  with_rows_impl(mr, f, std::make_integer_sequence<int, Max>{});
}

// ---- Register-blocked GEMM tile over a packed panel (many input rows: prefill) ----
// B is a panel of 16 weight rows packed k-major: B[k * 16 + j] = W[n + j, k].

#ifdef RS_AVX512
constexpr int kTileRows = 12;  // input rows per tile: 12 accumulators + 1 B
#else
constexpr int kTileRows = 6;   // input rows per tile: 12 accumulators + 2 B + 1 broadcast
#endif
constexpr int kPanel = 16;     // weight rows per packed panel (two 8-lane vectors)
constexpr int64_t kPanelMinRows = 8;  // from 8 input rows on, packed panels beat dot_block
constexpr int64_t kSliceK = 192;  // AVX-512 panel GEMM: K per slice (two 12 KB panel slices)

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

// Transpose 16 rows of length K (K % 8 == 0) into the k-major panel [K, 16].
inline void pack_panel(const float* const* rows, int64_t K, float* panel) {
#ifdef RS_AVX2
  for (int half = 0; half < 2; ++half) {
    const float* const* r = rows + half * 8;
    for (int64_t k = 0; k < K; k += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(r[i] + k);
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = panel + k * kPanel + half * 8;
      _mm256_storeu_ps(o + 0 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * kPanel, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * kPanel, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * kPanel, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * kPanel, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
#else
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kPanel; ++j) panel[k * kPanel + j] = rows[j][k];
#endif
}

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
        _mm512_storeu_ps(o + kk * kPanel,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(col[l], low)), sc, mn));
        _mm512_storeu_ps(o + (kk + 16) * kPanel,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(col[l], 4)), sc, mn));
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
    for (int64_t m = 0; m < M; m += kTileRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kTileRows, M - m));
      tile_rows(mr, xp + m * K, K, panel, kPanel, K, C + m * ldc, ldc);
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

#ifdef RS_AVX2
// a[0:n] . b[0:n].
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
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

// One input row (decode of a single sequence): the GEMM is bound by turning codes into
// floats, so each weight row is used straight from its codes in the factored form
// sum_g scale_g * (q_g . x_g) + min_g * sum(x_g), with no dequantized copy. int4: two weight
// rows share each load of x (1.7x on L3-resident weights). `kind` 4 or 8.
template <int kind>
void gemv_codes(const float* x, const void* qv, const float* sp, const float* mp, int64_t N,
                int64_t K, float* out) {
  const int64_t G = K / kGroup;
  std::vector<float> xsum_buf(G, 0.f);  // the min term's sum(x_g), once per call
  if (kind == 4)
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < kGroup; ++j) xsum_buf[g] += x[g * kGroup + j];
  const float* xsum = xsum_buf.data();
  constexpr int64_t rows = kind == 4 ? 2 : 1;  // int8 rows one at a time: 2 spill registers
  const int64_t row_bytes = kind == 4 ? K / 2 : K;
  at::parallel_for(0, (N + rows - 1) / rows, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t n = rows * p0; n < std::min(N, rows * p1); n += rows) {
      const int64_t m = std::min(n + rows - 1, N - 1);  // the pair's second row (or n itself)
      // DRAM latency is ~300 cycles, a pair of rows ~200: ask for the rows 3 pairs ahead.
      const int64_t ahead = std::min(n + 3 * rows, N - 1);
      const char* next = static_cast<const char*>(qv) + ahead * row_bytes;
      for (int64_t off = 0; off < rows * row_bytes; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T0);
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
#else
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + g * kGroup;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        __m256 c[4], d[4];
        load_codes<kind>(qv, n, K, g, c);
        if (rows == 2) load_codes<kind>(qv, m, K, g, d);
        const __m256 ta = _mm256_fmadd_ps(c[2], x2, _mm256_mul_ps(c[0], x0));
        const __m256 ua = _mm256_fmadd_ps(c[3], x3, _mm256_mul_ps(c[1], x1));
        const __m256 sa = _mm256_set1_ps(sp[n * G + g]);
        a0 = _mm256_fmadd_ps(sa, ta, a0);
        a1 = _mm256_fmadd_ps(sa, ua, a1);
        if (rows == 2) {
          const __m256 tb = _mm256_fmadd_ps(d[2], x2, _mm256_mul_ps(d[0], x0));
          const __m256 ub = _mm256_fmadd_ps(d[3], x3, _mm256_mul_ps(d[1], x1));
          const __m256 sb = _mm256_set1_ps(sp[m * G + g]);
          b0 = _mm256_fmadd_ps(sb, tb, b0);
          b1 = _mm256_fmadd_ps(sb, ub, b1);
        }
      }
      const float sum_a = hsum(_mm256_add_ps(a0, a1)), sum_b = hsum(_mm256_add_ps(b0, b1));
#endif
      // int4's min term: sum_g min_g * sum(x_g), one dot product per row.
      const float mins_a = kind == 4 ? dot(mp + n * G, xsum, G) : 0.f;
      const float mins_b = kind == 4 ? dot(mp + m * G, xsum, G) : 0.f;
      out[n] = sum_a + mins_a;
      if (rows == 2) out[m] = sum_b + mins_b;
    }
  });
}
#endif

#ifdef RS_AVX2
constexpr int64_t kSmallRows = 16;  // up to this many input rows: gemm_codes_small
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
  const int64_t row_bytes = kind == 4 ? K / 2 : K;
  at::parallel_for(0, (N + kCodeRows - 1) / kCodeRows, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t n = kCodeRows * p0; n < std::min(N, kCodeRows * p1); n += kCodeRows) {
      const int64_t nr = std::min<int64_t>(kCodeRows, N - n);
      const int64_t ahead = std::min(n + 4, N - 1);
      const char* next = static_cast<const char*>(qv) + ahead * row_bytes;
      for (int64_t off = 0; off < kCodeRows * row_bytes && ahead + off / row_bytes < N; off += 64)
        _mm_prefetch(next + off, _MM_HINT_T0);
      for (int64_t m = 0; m < M; m += 8) {
        const float* xm = x + m * K;
        float* om = out + m * N;
        with_rows<8>(static_cast<int>(std::min<int64_t>(8, M - m)), [&](auto R) {
          codes_rows<kind, R>(xm, K, qv, sp, mp, n, nr, om, N);
        });
      }
    }
  });
}
#endif

void q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& minv, const at::Tensor& out) {
  const int64_t K = x.size(1);
  check(qs.size(1) == K / 2 && qs.is_contiguous(), "qs shape");
  check(scale.is_contiguous() && minv.is_contiguous(), "scale and min must be contiguous");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
#ifdef RS_AVX2
  if (x.size(0) == 1 && x.is_contiguous() && out.is_contiguous() && K % kGroup == 0) {
    gemv_codes<4>(x.data_ptr<float>(), qp, sp, mp, qs.size(0), K, out.data_ptr<float>());
    return;
  }
#endif
#ifdef RS_AVX2
  if (x.size(0) <= kSmallRows && x.is_contiguous() && out.is_contiguous() && K % kGroup == 0) {
    gemm_codes_small<4>(x.data_ptr<float>(), x.size(0), qp, sp, mp, qs.size(0), K,
                        out.data_ptr<float>());
    return;
  }
#endif
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
#ifdef RS_AVX2
  if (x.size(0) == 1 && x.is_contiguous() && out.is_contiguous() && K % kGroup == 0) {
    gemv_codes<8>(x.data_ptr<float>(), qp, sp, nullptr, qs.size(0), K, out.data_ptr<float>());
    return;
  }
#endif
#ifdef RS_AVX2
  if (x.size(0) <= kSmallRows && x.is_contiguous() && out.is_contiguous() && K % kGroup == 0) {
    gemm_codes_small<8>(x.data_ptr<float>(), x.size(0), qp, sp, nullptr, qs.size(0), K,
                        out.data_ptr<float>());
    return;
  }
#endif
  auto dequant = [&](int64_t n, int64_t nr, float* buf) {
    dequant_rows_q8(qp, sp, n, nr, K, buf);
  };
  auto no_panel_dequant = [](int64_t, float*) { return false; };
  if (x.size(0) >= kPanelMinRows && K % 8 == 0)
    return quant_gemm_panels(x, qs.size(0), out, dequant, no_panel_dequant);
  quant_gemm(x, qs.size(0), out, dequant);
}

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

#ifdef RS_AVX2
// e^x for x <= 0 (softmax terms), Cephes' polynomial: within 2 ulp of expf; 0 below -87.3
// (where expf is subnormal) and for -inf. Its constants, shared by exp256 and exp512:
constexpr float kExpMin = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline __m256 exp256(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);  // -> 0
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The 8 horizontal sums of a[0..7] as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 t01 = _mm256_hadd_ps(a[0], a[1]), t23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t45 = _mm256_hadd_ps(a[4], a[5]), t67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 t0123 = _mm256_hadd_ps(t01, t23), t4567 = _mm256_hadd_ps(t45, t67);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0123, t4567, 0x20),
                       _mm256_permute2f128_ps(t0123, t4567, 0x31));
}
#endif

#ifdef RS_AVX512
// exp256 in 16 lanes, the same operations lane by lane (so the same values).
inline __m512 exp512(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);  // -> 0
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), y, _mm512_castsi512_ps(e));
}
#endif

// ---- K/V elements: pools hold float32, bfloat16 or float16 (--kv-cache-dtype); the
// attention math is float32 either way ----

inline float kv_float(float x) { return x; }
inline float kv_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float kv_float(c10::Half x) { return static_cast<float>(x); }

#ifdef RS_AVX2
inline __m256 kv_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 kv_load8(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 kv_load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// dst[0:D] = src[0:D] as float32.
template <typename T>
inline void kv_row_to_float(const T* src, int64_t D, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    int64_t d = 0;
#ifdef RS_AVX2
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, kv_load8(src + d));
#endif
    for (; d < D; ++d) dst[d] = kv_float(src[d]);
  }
}

// dst[0:D] = src[0:D] rounded to T (to nearest even, as torch's .to(dtype)).
template <typename T>
inline void kv_row_from_float(const float* src, int64_t D, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
  }
}

#ifdef RS_AVX512
inline __m512 kv_load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv_load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 kv_load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// f(T{}) with T the element type of the K/V pool `pool`.
template <typename F>
void with_kv_type(const at::Tensor& pool, F&& f) {
  switch (pool.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: check(false, "K/V pools must be float32, bfloat16 or float16");
  }
}

// Rows the cache should fetch while a pass over other rows runs: during the pass's row i,
// row rows[i] (i < n) of length D. A decode step's K and V rows come from DRAM, one head's
// rows scattered through the pool, and the hardware prefetchers do not see them coming: asked
// for one pass ahead, their latency hides behind that pass's FMAs.
template <typename T>
struct FetchAhead {
  const T* const* rows = nullptr;
  int64_t n = 0, D = 0;
  inline void operator()(int64_t i) const {
    if (i >= n) return;
    const char* p = reinterpret_cast<const char*>(rows[i]);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
      __builtin_prefetch(p + b, 0, 3);
  }
};

// scores[i] = scale * q . rows[i] for n rows of length D (fetching `ahead`'s rows meanwhile).
template <typename T>
inline void score_rows(const float* q, const T* const* rows, int64_t n, int64_t D,
                       float scale, float* scores, const FetchAhead<T>& ahead = {}) {
  int64_t i = 0;
#ifdef RS_AVX512
  if (D % 16 == 0) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) ahead(i + j);
      __m512 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm512_fmadd_ps(qv, kv_load16(rows[i + j] + d), acc[j]);
      }
      __m256 half[8];  // each row's 16 lanes folded to 8, then summed 8 rows at once
      for (int j = 0; j < 8; ++j)
        half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
      _mm256_storeu_ps(scores + i, _mm256_mul_ps(hsum8(half), sc));
    }
  }
#endif
#ifdef RS_AVX2
  if (D % 8 == 0) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) ahead(i + j);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qv, kv_load8(rows[i + j] + d), acc[j]);
      }
      _mm256_storeu_ps(scores + i, _mm256_mul_ps(hsum8(acc), sc));
    }
  }
#endif
  for (; i < n; ++i) {
    ahead(i);
    float d = 0;
    for (int64_t k = 0; k < D; ++k) d += q[k] * kv_float(rows[i][k]);
    scores[i] = d * scale;
  }
}

// In place: p[i] = exp(p[i] - mx); returns their sum.
inline float exp_shifted(float* p, int64_t n, float mx) {
  float sum = 0;
  int64_t i = 0;
#ifdef RS_AVX2
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), m));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - mx);
    sum += p[i];
  }
  return sum;
}

// max(p[0:n]) (-inf for n == 0).
inline float row_max(const float* p, int64_t n) {
  float mx = -INFINITY;
  int64_t i = 0;
#ifdef RS_AVX2
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  mx = _mm_cvtss_f32(m4);
#endif
  for (; i < n; ++i) mx = std::max(mx, p[i]);
  return mx;
}

// In place: p[i] = exp(p[i] - max); returns (max, sum).
inline std::pair<float, float> softmax_terms(float* p, int64_t n) {
  const float mx = row_max(p, n);
  return {mx, exp_shifted(p, n, mx)};
}

#ifdef RS_AVX2
// acc[d0 : d0 + 8A] += sum_i p[i] * rows[i][d0 : d0 + 8A], in A independent accumulators.
template <int A, typename T>
inline void weighted_pass(const float* p, const T* const* rows, int64_t n, int64_t d0,
                          float* acc, const FetchAhead<T>& ahead) {
  __m256 a[A];
  for (int j = 0; j < A; ++j) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    ahead(i);
    const __m256 w = _mm256_set1_ps(p[i]);
    const T* r = rows[i] + d0;
    for (int j = 0; j < A; ++j) a[j] = _mm256_fmadd_ps(w, kv_load8(r + 8 * j), a[j]);
  }
  for (int j = 0; j < A; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
}
#endif

#ifdef RS_AVX512
// acc[d0 : d0 + 64] += sum_i p[i] * rows[i][d0 : d0 + 64]: even and odd rows into separate
// accumulators (8 in all), so no row waits on the previous row's FMA latency.
template <typename T>
inline void weighted_pass64(const float* p, const T* const* rows, int64_t n, int64_t d0,
                            float* acc, const FetchAhead<T>& ahead) {
  __m512 a[4], b[4];
  for (int j = 0; j < 4; ++j) a[j] = _mm512_loadu_ps(acc + d0 + 16 * j), b[j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    ahead(i);
    ahead(i + 1);
    const __m512 w = _mm512_set1_ps(p[i]), v = _mm512_set1_ps(p[i + 1]);
    const T *r = rows[i] + d0, *s = rows[i + 1] + d0;
    for (int j = 0; j < 4; ++j) {
      a[j] = _mm512_fmadd_ps(w, kv_load16(r + 16 * j), a[j]);
      b[j] = _mm512_fmadd_ps(v, kv_load16(s + 16 * j), b[j]);
    }
  }
  if (i < n) {
    ahead(i);
    const __m512 w = _mm512_set1_ps(p[i]);
    for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(w, kv_load16(rows[i] + d0 + 16 * j), a[j]);
  }
  for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + d0 + 16 * j, _mm512_add_ps(a[j], b[j]));
}
#endif

// acc[D] += sum_i p[i] * rows[i] (fetching `ahead`'s rows meanwhile, in the first pass).
template <typename T>
inline void weighted_rows(const float* p, const T* const* rows, int64_t n, int64_t D,
                          float* acc, FetchAhead<T> ahead = {}) {
  int64_t d0 = 0;
#ifdef RS_AVX512
  for (; d0 + 64 <= D; d0 += 64, ahead = {}) weighted_pass64(p, rows, n, d0, acc, ahead);
#endif
#ifdef RS_AVX2
  // 64 columns a pass: 8 independent accumulators keep the FMA units busy (with 4, each
  // row waited on the previous row's FMA latency).
  for (; d0 + 64 <= D; d0 += 64, ahead = {}) weighted_pass<8>(p, rows, n, d0, acc, ahead);
  for (; d0 + 32 <= D; d0 += 32, ahead = {}) weighted_pass<4>(p, rows, n, d0, acc, ahead);
#endif
  for (int64_t i = 0; i < n; ++i) {
    ahead(i);
    for (int64_t d = d0; d < D; ++d) acc[d] += p[i] * kv_float(rows[i][d]);
  }
}

// Partial attention results over disjoint key ranges, each [max, sum, acc[D]] (acc not yet
// divided by sum; max -inf where the range held no visible key), the i-th at first + i * step:
// o[D] = their softmax-weighted merge (by log-sum-exp).
inline void merge_partials(const float* first, int64_t count, int64_t step, int64_t D,
                           float* o) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < count; ++i) mx = std::max(mx, first[i * step]);
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  float total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const float* p = first + i * step;
    if (p[0] == -INFINITY) continue;
    const float w = std::exp(p[0] - mx);
    total += w * p[1];
    for (int64_t d = 0; d < D; ++d) o[d] += w * p[2 + d];
  }
  const float inv = total > 0 ? 1.f / total : 0.f;
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

// Decode attention over the paged pool. q [B, H, D] (rows may be strided);
// k_pool / v_pool [NB, BS, KVH, D] (float32, bfloat16 or float16);
// block_table [B, >= max blocks] int32, rows may be strided (a view of a larger buffer);
// context_lens [B] int32 (keys 0..len-1 are attended); out [B, H, D].
// Work unit = (sequence, KV head, chunk of the context): the chunk's K rows are scored 8 at a
// time against each query head of the group (the rows stay in L1 across heads), turned into
// softmax terms, and its V rows weighted; chunks are merged by their log-sum-exp, so one long
// sequence still spreads over every thread.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& block_table,
                            const at::Tensor& context_lens, double sm_scale,
                            const at::Tensor& out) {
  check(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 q and out");
  check(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  check(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
        "int32 block table and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check(block_table.stride(1) == 1 && context_lens.stride(0) == 1 && q.stride(2) == 1 &&
            q.stride(1) == D,
        "block table rows, lengths and each q row must be contiguous");
  const int64_t q_row = q.stride(0);  // q may be the first columns of a fused qkv
  check(k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous(),
        "pools and out must be contiguous");
  const int64_t BS = k_pool.size(1), KVH = k_pool.size(2), MAXB = block_table.stride(0);
  const int64_t GQ = H / KVH;
  const float* qp = q.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(1, 64 / BS) * BS;  // whole blocks, ~64 tokens
  int64_t max_chunks = 1;
  for (int64_t b = 0; b < B; ++b)
    max_chunks = std::max<int64_t>(max_chunks, (lens[b] + chunk - 1) / chunk);
  // Partial results per (b, kvh, chunk, head in group): max, sum, acc[D].
  const int64_t units = B * KVH * max_chunks, stride = D + 2;
  std::vector<float> part(units * GQ * stride);
  const float scale = static_cast<float>(sm_scale);
  with_kv_type(k_pool, [&](auto tag) {
    using T = decltype(tag);
    const T* kp = static_cast<const T*>(k_pool.data_ptr());
    const T* vp = static_cast<const T*>(v_pool.data_ptr());
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      std::vector<float> scores(chunk);
      std::vector<const T*> krows(chunk), vrows(chunk), knext(chunk), vnext(chunk);
      // Unit u's K and V rows into k and v; returns their count.
      auto unit_rows = [&](int64_t u, const T** k, const T** v) -> int64_t {
        const int64_t h = u % KVH, c = (u / KVH) % max_chunks, b = u / (max_chunks * KVH);
        const int64_t t0 = c * chunk, t1 = std::min<int64_t>(lens[b], t0 + chunk);
        // Chunks are whole blocks: walk them block by block (no division per key).
        for (int64_t t = t0, blk = t0 / BS; t < t1; ++blk) {
          const int64_t base = static_cast<int64_t>(bt[b * MAXB + blk]) * BS;
          for (int64_t off = 0; off < BS && t < t1; ++off, ++t) {
            const int64_t row = (base + off) * KVH + h;
            k[t - t0] = kp + row * D;
            v[t - t0] = vp + row * D;
          }
        }
        return std::max<int64_t>(0, t1 - t0);
      };
      int64_t n = unit_rows(u0, krows.data(), vrows.data());
      for (int64_t u = u0; u < u1; ++u) {
        // The KV heads of one chunk are neighbours in memory, so they are neighbouring units.
        const int64_t h = u % KVH, b = u / (max_chunks * KVH);
        const int64_t n_next = u + 1 < u1 ? unit_rows(u + 1, knext.data(), vnext.data()) : 0;
        float* pu = part.data() + u * GQ * stride;
        if (n == 0)
          for (int64_t g = 0; g < GQ; ++g) pu[g * stride] = -INFINITY;
        for (int64_t g = 0; g < GQ && n > 0; ++g) {
          float* pg = pu + g * stride;
          // The first head's scores fetch this unit's V rows, the last head's weighted sum
          // the next unit's K rows (a count of 0 fetches nothing).
          const FetchAhead<T> v_ahead{vrows.data(), g == 0 ? n : 0, D};
          const FetchAhead<T> k_ahead{knext.data(), g == GQ - 1 ? n_next : 0, D};
          score_rows(qp + b * q_row + (h * GQ + g) * D, krows.data(), n, D, scale,
                     scores.data(), v_ahead);
          const auto [mx, sum] = softmax_terms(scores.data(), n);
          pg[0] = mx;
          pg[1] = sum;
          std::memset(pg + 2, 0, D * sizeof(float));
          weighted_rows(scores.data(), vrows.data(), n, D, pg + 2, k_ahead);
        }
        n = n_next;
        std::swap(krows, knext);
        std::swap(vrows, vnext);
      }
    });
  });
  // Merge the chunks of each (b, head).
  at::parallel_for(0, B * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, hq = r % H, h = hq / GQ, g = hq % GQ;
      // Unit (b, c, h) is b * max_chunks * KVH + c * KVH + h; chunks of one head are KVH apart.
      const int64_t step = KVH * GQ * stride;
      const float* first = part.data() + (b * max_chunks * KVH + h) * GQ * stride + g * stride;
      merge_partials(first, max_chunks, step, D, op + r * D);
    }
  });
}

// One online-softmax step over a row of scores s[0:n] (n % 16 == 0; masked keys are -inf):
// the running max and sum take the row in, s becomes its weights exp(s - max); returns the
// factor by which weights accumulated so far must be scaled.
inline float softmax_step(float* s, int64_t n, float& run_max, float& run_sum) {
  const float new_max = std::max(run_max, row_max(s, n));
  const float alpha = run_max == new_max ? 1.f : std::exp(run_max - new_max);
  const float sum = exp_shifted(s, n, new_max);
  run_sum = run_sum * alpha + sum;
  run_max = new_max;
  return alpha;
}

#ifdef RS_AVX512
// softmax_step in 16 lanes for a row of KT = 64 scores whose keys from `visible` on are
// masked out (0 < visible <= 64): masking, max, exp and sum in registers, one pass each.
inline float softmax_step64(float* s, int64_t visible, float& run_max, float& run_sum) {
  __m512 v[4];
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < 4; ++j) {
    const int64_t left = std::clamp<int64_t>(visible - 16 * j, 0, 16);
    const __mmask16 keep = static_cast<__mmask16>((1u << left) - 1u);
    v[j] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), keep, s + 16 * j);
    vm = _mm512_max_ps(vm, v[j]);
  }
  const float new_max = std::max(run_max, _mm512_reduce_max_ps(vm));
  const float alpha = run_max == new_max ? 1.f : std::exp(run_max - new_max);
  const __m512 m = _mm512_set1_ps(new_max);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    const __m512 e = exp512(_mm512_sub_ps(v[j], m));
    _mm512_storeu_ps(s + 16 * j, e);
    acc = _mm512_add_ps(acc, e);
  }
  run_sum = run_sum * alpha + _mm512_reduce_add_ps(acc);
  run_max = new_max;
  return alpha;
}
#endif

#ifdef RS_AVX512
// acc[i, d0 : d0 + 16] += sum_k p[i * P + k] * v[k][d0 : d0 + 16] for i < MR, k < K, with the
// V rows read in place from the pool (any K/V dtype) and P a compile-time row stride.
template <int MR, int P, typename T>
inline void tile_pv(const float* p, const T* const* v, int64_t d0, int64_t K, float* acc,
                    int64_t ldc) {
  __m512 c[MR];
  for (int i = 0; i < MR; ++i) c[i] = _mm512_loadu_ps(acc + i * ldc);
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = kv_load16(v[k] + d0);
    for (int i = 0; i < MR; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * P + k]), b, c[i]);
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(acc + i * ldc, c[i]);
}

template <int P, typename T>
inline void tile_pv_rows(int mr, const float* p, const T* const* v, int64_t d0, int64_t K,
                         float* acc, int64_t ldc) {
  with_rows<kTileRows>(mr, [&](auto R) { tile_pv<R, P>(p, v, d0, K, acc, ldc); });
}
#endif

// Causal attention of a chunk of n new tokens over a sequence's paged context (the chunk's
// own K/V already written). q [n, H, D] (rows may be strided: a view of the fused qkv),
// k_pool / v_pool [NB, BS, KVH, D], block_ids [>= ceil(context_len / BS)] int64, out [n, H * D]
// (rows may be strided). Token i of the chunk sits at position context_len - n + i and
// attends to keys 0..that position.
// Flash-attention style: a work unit is (KV head, tile of query tokens, slice of the keys);
// the tile's query rows (up to 64 new tokens, else 32 at a time, x the heads of the group)
// meet 64 keys at a time: scores and probability-weighted V rows are both products by the
// register tile (6x16; AVX-512: 12x16) over K/V rows read from the pool (K transposed into a
// panel; V copied, AVX-512: used in place), with an online softmax between, the next 64 keys'
// rows asked for meanwhile. Key slices (for short chunks over long contexts, so every thread
// has work) are merged by log-sum-exp.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_ids,
                             int64_t context_len, double sm_scale, const at::Tensor& out) {
  check(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 q and out");
  check(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  check(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(), "int64 block ids");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  check(q.stride(2) == 1 && q.stride(1) == D && out.stride(1) == 1 && out.size(1) == H * D,
        "q rows and out rows must be contiguous");
  check(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  check(D % 16 == 0, "head_dim must be a multiple of 16");
  const int64_t BS = k_pool.size(1), KVH = k_pool.size(2), GQ = H / KVH;
  check(context_len >= n && block_ids.size(0) * BS >= context_len, "context");
  const int64_t start = context_len - n;
  constexpr int64_t KT = 64;  // keys per step of a unit
  // Query tokens per tile: up to 64 new tokens are one tile, so each K/V row is read (and K
  // packed) once rather than once per 32 tokens; longer chunks take 32 at a time.
  const int64_t TQ = n <= 64 ? std::max<int64_t>(n, 1) : 32;
  const int64_t R = TQ * GQ;  // query rows of a tile: token-major, the group's heads inner
  const int64_t tiles = (n + TQ - 1) / TQ;
  const int64_t nthreads = at::get_num_threads();
  const int64_t key_tiles = (context_len + KT - 1) / KT;
  // Few (tile, head) pairs: split the keys too, into a multiple of the threads' count of
  // units (at least 4 per thread), so every thread has work and the threads finish together.
  int64_t splits = 1;
  if (tiles * KVH < 4 * nthreads) {
    splits = std::min(key_tiles, (4 * nthreads + tiles * KVH - 1) / (tiles * KVH));
    while (splits < key_tiles && (tiles * KVH * splits) % nthreads) ++splits;
  }
  const int64_t units = tiles * KVH * splits;
  const int64_t q_row = q.stride(0), o_row = out.stride(0);
  const float* qp = q.data_ptr<float>();
  const int64_t* bid = block_ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  // Per unit and row with splits: max, sum, acc[D].
  const int64_t pstride = D + 2;
  std::vector<float> part(splits > 1 ? units * R * pstride : 0);
  std::atomic<int64_t> next{0};
  with_kv_type(k_pool, [&](auto tag) {
    using T = decltype(tag);
    const T* kp = static_cast<const T*>(k_pool.data_ptr());
    const T* vp = static_cast<const T*>(v_pool.data_ptr());
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      AlignedBuffer qt(R * D), sc(R * KT), kt(D * KT), acc(R * D), zero(D);
      AlignedBuffer kf(std::is_same_v<T, float> ? 0 : 16 * D);  // 16 K rows as float32
#ifndef RS_AVX512
      AlignedBuffer vt(KT * D);  // the tile's V rows as float32 (AVX-512 reads them in place)
#endif
      std::vector<float> mx(R), sum(R);
      const float* krow[16];
#ifdef RS_AVX512
      const T* vrow[KT];  // the tile's V rows, used in place
#endif
      const char* ahead[2 * KT];  // the next step's K rows, then its V rows
      for (;;) {
        const int64_t u = next.fetch_add(1);
        if (u >= units) break;
        // Heaviest first: the last tiles of a chunk see the most keys.
        const int64_t split = u % splits, h = (u / splits) % KVH;
        const int64_t tile = tiles - 1 - u / (splits * KVH);
        const int64_t t0 = tile * TQ, nt = std::min(TQ, n - t0), rows = nt * GQ;
        const int64_t kend = start + t0 + nt;  // keys the tile's last token sees
        const int64_t tile_keys = (kend + KT - 1) / KT, per = (tile_keys + splits - 1) / splits;
        const int64_t k_begin = split * per * KT, k_end = std::min(kend, (split + 1) * per * KT);
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t g = 0; g < GQ; ++g) {
            const float* src = qp + (t0 + t) * q_row + (h * GQ + g) * D;
            float* dst = qt.data() + (t * GQ + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
          }
        std::fill(mx.begin(), mx.end(), -INFINITY);
        std::fill(sum.begin(), sum.end(), 0.f);
        std::memset(acc.data(), 0, rows * D * sizeof(float));
        for (int64_t k0 = k_begin; k0 < k_end; k0 += KT) {
          const int64_t nk = std::min(KT, k_end - k0), nk16 = (nk + 15) / 16 * 16;
          int64_t blk = k0 / BS, off = k0 % BS;
          // The pool is far bigger than the caches: the next step's K/V rows are asked for
          // (into L2) a few at a time between this step's tiles, so they arrive while it
          // computes (a burst of them would overflow the queue of outstanding misses).
          int64_t ahead_n = 0, ahead_i = 0;
          for (int64_t t = k0 + KT; t < std::min(k_end, k0 + 2 * KT); ++t, ++ahead_n) {
            const int64_t row = (bid[t / BS] * BS + t % BS) * KVH + h;
            ahead[ahead_n] = reinterpret_cast<const char*>(kp + row * D);
            ahead[KT + ahead_n] = reinterpret_cast<const char*>(vp + row * D);
          }
          auto prefetch_ahead = [&](int64_t rows_now) {
#ifdef RS_AVX2
            for (int64_t e = 0; e < rows_now && ahead_i < 2 * ahead_n; ++e, ++ahead_i) {
              const char* r = ahead[ahead_i < ahead_n ? ahead_i : KT + ahead_i - ahead_n];
              for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
                _mm_prefetch(r + b, _MM_HINT_T1);
            }
#endif
          };
          for (int64_t j = 0; j < nk16; ++j) {
            if (j < nk) {
              const int64_t row = (bid[blk] * BS + off) * KVH + h;
              if (++off == BS) off = 0, ++blk;
              if constexpr (std::is_same_v<T, float>) {
                krow[j % 16] = kp + row * D;
              } else {
                float* kdst = kf.data() + (j % 16) * D;
                kv_row_to_float(kp + row * D, D, kdst);
                krow[j % 16] = kdst;
              }
#ifdef RS_AVX512
              vrow[j] = vp + row * D;
#else
              kv_row_to_float(vp + row * D, D, vt.data() + j * D);
#endif
            } else {
              krow[j % 16] = zero.data();
#ifdef RS_AVX512
              vrow[j] = vrow[nk - 1];  // any finite row: its weight is 0
#else
              std::memset(vt.data() + j * D, 0, D * sizeof(float));
#endif
            }
            if (j % 16 == 15) pack_panel(krow, D, kt.data() + (j / 16) * D * 16);
          }
          // Scores [rows, nk16] = q . k.
          for (int64_t s16 = 0; s16 < nk16; s16 += 16)
            for (int64_t m = 0; m < rows; m += kTileRows) {
              prefetch_ahead(2);
              const int mr = static_cast<int>(std::min<int64_t>(kTileRows, rows - m));
              const float* a = qt.data() + m * D;
              float* c = sc.data() + m * KT + s16;
              if (D == 64)  // the usual head size: q's row stride a constant
                tile_rows<false, 64>(mr, a, D, kt.data() + s16 * D, 16, D, c, KT);
              else
                tile_rows(mr, a, D, kt.data() + s16 * D, 16, D, c, KT);
            }
          // Mask keys past each row's position (and the padding), then the online softmax.
          for (int64_t r = 0; r < rows; ++r) {
            float* srow = sc.data() + r * KT;
            const int64_t visible = std::min(nk, start + t0 + r / GQ + 1 - k0);
            if (visible <= 0) {  // every key of this tile is after the row's token
              std::fill(srow, srow + nk16, 0.f);
              continue;
            }
#ifdef RS_AVX512
            const float alpha = softmax_step64(srow, visible, mx[r], sum[r]);
#else
            for (int64_t j = visible; j < nk16; ++j) srow[j] = -INFINITY;
            const float alpha = softmax_step(srow, nk16, mx[r], sum[r]);
#endif
            if (alpha != 1.f) {
              float* a = acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            }
          }
          // acc [rows, D] += p [rows, nk16] . v [nk16, D].
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            for (int64_t m = 0; m < rows; m += kTileRows) {
              prefetch_ahead(2);
              const int mr = static_cast<int>(std::min<int64_t>(kTileRows, rows - m));
#ifdef RS_AVX512
              tile_pv_rows<KT>(mr, sc.data() + m * KT, vrow, d0, nk16, acc.data() + m * D + d0,
                               D);
#else
              tile_rows<true, KT>(mr, sc.data() + m * KT, KT, vt.data() + d0, D, nk16,
                                  acc.data() + m * D + d0, D);
#endif
            }
          prefetch_ahead(2 * KT);  // what the tiles left (few rows: few tiles)
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* a = acc.data() + r * D;
          if (splits == 1) {
            const int64_t t = r / GQ, g = r % GQ;
            float* o = op + (t0 + t) * o_row + (h * GQ + g) * D;
            const float inv = sum[r] > 0 ? 1.f / sum[r] : 0.f;
            for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
          } else {
            float* pr = part.data() + (u * R + r) * pstride;
            pr[0] = mx[r];
            pr[1] = sum[r];
            std::memcpy(pr + 2, a, D * sizeof(float));
          }
        }
      }
    });
  });
  if (splits == 1) return;
  // Merge the key slices of each (tile, KV head, row): units of one (tile, head) are adjacent.
  at::parallel_for(0, tiles * KVH, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t h = w % KVH, tile = tiles - 1 - w / KVH;
      const int64_t t0 = tile * TQ, nt = std::min(TQ, n - t0);
      for (int64_t r = 0; r < nt * GQ; ++r)
        merge_partials(part.data() + (w * splits * R + r) * pstride, splits, R * pstride, D,
                       op + (t0 + r / GQ) * o_row + (h * GQ + r % GQ) * D);
    }
  });
}

// ---- Fused elementwise steps of a decoder layer (float32, rows in parallel) ----

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, as transformers' LlamaRMSNorm in float32.
void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  check(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous() &&
            w.is_contiguous(),
        "rms_norm: contiguous float32");
  const int64_t T = x.size(0), D = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * D;
      float* orow = op + t * D;
      float ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) orow[i] = wp[i] * (xr[i] * r);
    }
  });
}

// In place on qkv [T, (H + 2 KVH) * Dh]: rotate the q and k heads by the tokens' cos/sin
// [T, Dh] (rotate-half layout), then write each token's k and v heads into the pools'
// slot slots[t] (pools [NB, BS, KVH, Dh], slot = block * BS + offset).
void rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   int64_t num_heads) {
  check(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && cos.is_contiguous() &&
            sin.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
        "rope_kv_write: contiguous float32 qkv");
  check(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  check(slots.scalar_type() == at::kLong, "rope_kv_write: int64 slots");
  const int64_t T = qkv.size(0), KVH = k_pool.size(2), Dh = k_pool.size(3);
  const int64_t half = Dh / 2, width = qkv.size(1);
  check(width == (num_heads + 2 * KVH) * Dh, "rope_kv_write: qkv width");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t slot_stride = slots.stride(0);
  with_kv_type(k_pool, [&](auto tag) {
    using E = decltype(tag);
    E* kp = static_cast<E*>(k_pool.data_ptr());
    E* vp = static_cast<E*>(v_pool.data_ptr());
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* row = qp + t * width;
        const float* c = cp + t * Dh;
        const float* sn = sp + t * Dh;
        for (int64_t hd = 0; hd < num_heads + KVH; ++hd) {
          float* x = row + hd * Dh;
          for (int64_t i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] - b * sn[i];
            x[i + half] = b * c[i + half] + a * sn[i + half];
          }
        }
        const int64_t s = slot[t * slot_stride];
        kv_row_from_float(row + num_heads * Dh, KVH * Dh, kp + s * KVH * Dh);
        kv_row_from_float(row + (num_heads + KVH) * Dh, KVH * Dh, vp + s * KVH * Dh);
      }
    });
  });
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] = [gate | up].
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && out.is_contiguous(),
        "silu_mul: contiguous float32");
  const int64_t T = out.size(0), I = out.size(1);
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#ifdef RS_AVX2
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= I; i += 8) {  // silu(x) = x / (1 + e^-x): e^-|x| <= 1 keeps exp256 exact
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), abs));  // e^-|x|
        // sigmoid(x) = 1 / (1 + e^-x) = x >= 0 ? 1 / (1 + e) : e / (1 + e)
        const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), x);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

// ---- A whole decode step's decoder layers in one call ----

// y = x W^T for quantized codes: int4 when `minv` has elements, int8 otherwise.
void quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor& minv, const at::Tensor& out) {
  if (minv.numel() > 0) return q4_gemm(x, qs, scale, minv, out);
  q8_gemm(x, qs, scale, out);
}

// In place: h += d (same shape, contiguous float32).
void add_into(const at::Tensor& h, const at::Tensor& d) {
  float* hp = h.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  for (int64_t i = 0, n = h.numel(); i < n; ++i) hp[i] += dp[i];
}

// Every decoder layer of a decode step (one new token per sequence), as DecoderLayer's fused
// path runs them, with no Python between the kernels. h [B, hidden] float32 (the embedded
// tokens; the last layer's output on return). weights: 14 per layer -- input norm, qkv
// (codes, scales, mins), o (3), post norm, gate_up (3), down (3); a projection's mins are
// empty for int8 codes. cos/sin [B, Dh], slots [B] int64; k_pools / v_pools
// [layers, NB, BS, KVH, Dh]; block_table / context_lens as paged_decode_attention's.
void decode_layers(const at::Tensor& h, at::TensorList weights, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& k_pools,
                   const at::Tensor& v_pools, const at::Tensor& block_table,
                   const at::Tensor& context_lens, int64_t num_heads, double eps) {
  constexpr int64_t kPerLayer = 14;
  const int64_t L = k_pools.size(0), KVH = k_pools.size(3), Dh = k_pools.size(4);
  check(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2, "h");
  check(static_cast<int64_t>(weights.size()) == L * kPerLayer, "14 weights per layer");
  check(k_pools.is_contiguous() && v_pools.is_contiguous(), "pools must be contiguous");
  const int64_t B = h.size(0), hidden = h.size(1), H = num_heads;
  const int64_t qkv_width = (H + 2 * KVH) * Dh, gu_width = weights[8].size(0);
  const auto f32 = h.options();
  const at::Tensor x = at::empty({B, hidden}, f32), delta = at::empty({B, hidden}, f32);
  const at::Tensor qkv = at::empty({B, qkv_width}, f32);
  const at::Tensor q = qkv.narrow(1, 0, H * Dh).view({B, H, Dh});
  const at::Tensor att = at::empty({B, H, Dh}, f32), att_rows = att.view({B, H * Dh});
  const at::Tensor gate_up = at::empty({B, gu_width}, f32);
  const at::Tensor act = at::empty({B, gu_width / 2}, f32);
  const double sm_scale = 1.0 / std::sqrt(static_cast<double>(Dh));
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    const at::Tensor kp = k_pools.select(0, i), vp = v_pools.select(0, i);
    rms_norm(h, w[0], eps, x);
    quant_linear(x, w[1], w[2], w[3], qkv);
    rope_kv_write(qkv, cos, sin, slots, kp, vp, H);
    paged_decode_attention(q, kp, vp, block_table, context_lens, sm_scale, att);
    quant_linear(att_rows, w[4], w[5], w[6], delta);
    add_into(h, delta);
    rms_norm(h, w[7], eps, x);
    quant_linear(x, w[8], w[9], w[10], gate_up);
    silu_mul(gate_up, act);
    quant_linear(act, w[11], w[12], w[13], delta);
    add_into(h, delta);
  }
}

}  // namespace

// Free the calling thread's OpenMP worker threads (they come back on its next parallel
// region). libgomp spins only briefly before sleeping once more threads exist than CPUs, and
// every thread that ever ran a parallel region keeps its own idle workers: a thread that
// loaded the model leaves workers behind that make each of the engine loop's parallel
// regions wait on a futex wake (a decode step at 256 tokens of context on 2 cores: 18-21 ms
// in the loop thread against 6-8 ms with the loader's workers freed).
void release_omp_threads() { omp_pause_resource_all(omp_pause_soft); }

TORCH_LIBRARY(radixserve, m) {
  m.def("q4_gemm(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_gemm(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def("q4_dequant(Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_dequant(Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
      "Tensor context_lens, float sm_scale, Tensor(a!) out) -> ()");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_ids, "
      "int context_len, float sm_scale, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def(
      "rope_kv_write(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(b!) k_pool, "
      "Tensor(c!) v_pool, int num_heads) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("release_omp_threads() -> ()", &release_omp_threads);  // no tensors: no dispatch key
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] weights, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor(b!) k_pools, Tensor(c!) v_pools, Tensor block_table, Tensor context_lens, "
      "int num_heads, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q4_gemm", &q4_gemm);
  m.impl("q8_gemm", &q8_gemm);
  m.impl("q4_dequant", &q4_dequant);
  m.impl("q8_dequant", &q8_dequant);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_kv_write", &rope_kv_write);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_layers", &decode_layers);
}

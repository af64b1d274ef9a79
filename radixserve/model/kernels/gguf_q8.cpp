// GGUF blocks as the file stores them against int8 activations (the int8-avx2 path's decode
// rows and short chunks): y = x W^T with each row of x quantized to int8 per group of 32
// (scale max|x| / 127, rounded to nearest, as llama.cpp's Q8_0 activations), every sub-block
// of 32 weights (kquants.cpp's Sub: signed codes, one or two scales, an offset) meeting them
// in integer dot products:
//   x . w_s ~= dx_s (s0 sum_{e<16} c_e q_e + s1 sum_{e>=16} c_e q_e) + off dx_s sum_e q_e.
// vpmaddubsw multiplies |c| by q carrying c's sign, and sums pairs into 16 bits without
// saturating (|c| <= 128, |q| <= 127); vpmaddwd sums those into 8 lanes of 4 weights, lanes
// 0-3 the sub-block's first 16 weights: one vector of scales covers Q6_K's two halves.
//
// Where the float32 kernels turn every code into a float (about 25 instructions per 32
// weights), this takes about 7 per input row, so a decode step of a model larger than the
// caches waits on memory, not on arithmetic, while it reads the blocks at their stored size.
// Each input row is computed by the same operations in the same order whatever else is in
// the call, so a row's result does not depend on what shares its step. Q6_K, the most bytes of
// a Q4_K_M after its Q4_K (which the VNNI paths repack), runs 64 weights a vpdpbusd where the
// CPU has AVX-512 VNNI (row_dot_q6k_vnni).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant_kinds.h"
#include "simd.h"

namespace radixserve {
namespace {

// Each row of x [M, K] as int8 codes q [M, K] and scales d [M, K / 32] (q * d ~= x), with
// sums [M, K / 32] of each group's codes (for the formats' offsets) and sums16 [M, K / 16] of
// each half group's (Q6_K's, whose scales cover 16 weights).
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* sums,
                      float* sums16) {
  const int64_t G = K / 32;
  for (int64_t g = 0; g < M * G; ++g) {
    const float* xs = x + 32 * g;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xs[j]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int half[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int v = static_cast<int>(std::nearbyint(xs[j] * inv));
      q[32 * g + j] = static_cast<int8_t>(v);
      half[j / 16] += v;
    }
    d[g] = scale;
    sums[g] = static_cast<float>(half[0] + half[1]);
    sums16[2 * g] = static_cast<float>(half[0]);
    sums16[2 * g + 1] = static_cast<float>(half[1]);
  }
}

#ifdef RS_AVX2
// out[r * ldo] = x_r . row for MR input rows (codes q rows K apart, scales and sums rows
// K / 32 apart, sums16 K / 16), each row by its own accumulators.
template <typename B, int MR>
inline void row_dot_q8(const int8_t* q, const float* d, const float* sums, const float* sums16,
                       int64_t K, const uint8_t* row, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];  // even and odd sub-blocks: two chains of FMAs, not one
  float offsets[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    offsets[r] = 0.f;
  }
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    const __m256i mag = _mm256_abs_epi8(u.codes);
    // Opaque to the optimizer: under -ffast-math it may otherwise regroup (d sc) dx
    // differently for different numbers of rows, and a row's bits would depend on them.
    float s0 = u.s0, s1 = u.s1, off = u.off, off1 = u.off1;
    asm("" : "+x"(s0), "+x"(s1), "+x"(off));
    if constexpr (kHalfOffsets<B>) asm("" : "+x"(off1));
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + 32 * s));
      const __m256i p16 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(qx, u.codes));
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
      const float dx = d[r * G + s];
      const __m256 scale = _mm256_setr_m128(_mm_set1_ps(s0 * dx), _mm_set1_ps(s1 * dx));
      acc[r][s & 1] = _mm256_fmadd_ps(dots, scale, acc[r][s & 1]);
      if constexpr (kHalfOffsets<B>) {
        const float* h = sums16 + r * 2 * G + 2 * s;
        offsets[r] = std::fma(off1 * dx, h[1], std::fma(off * dx, h[0], offsets[r]));
      } else if (B::kOffset) {
        offsets[r] = std::fma(off * dx, sums[r * G + s], offsets[r]);
      }
    }
  });
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + offsets[r];
}

// The activations a row dot reads: codes, scales and sums per 32, sums per 16; each row's
// K, K / 32 and K / 16 apart; and where the CPU has AVX-512 VNNI, the scales as the VNNI row
// dots (Q6_K, Q4_K) meet them (vnni_row_scales; else null).
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* sums;
  const float* sums16;
  int64_t K;
  const float* dxv = nullptr;
};

// Lane j of v in every lane.
inline __m256 lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

// The 8 sums of 4 products each of unsigned codes and the 32 int8 activations at q.
inline __m256i dot_u8_s8(__m256i codes, const int8_t* q) {
  const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, qx), _mm256_set1_epi16(1));
}

// A Q4_K block's 8 six-bit scales and 8 mins (k_scale_min's, all at once): bytes 0-7 and 8-15.
inline __m128i q4k_scales_mins(const uint8_t* blk) {
  uint32_t u[4];
  std::memcpy(u, blk + 4, 12);
  u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
  const uint32_t mins_lo = u[1] & 0x3F3F3F3F;
  u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
  u[2] = mins_lo;
  u[0] &= 0x3F3F3F3F;
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
}

// Q4_K's or Q5_K's code bytes for sub-blocks 2p and 2p + 1 of the block at blk (qs: its
// nibbles; qh: Q5_K's high-bit bytes, bit j of byte e the fifth bit of sub-block j's weight e):
// unsigned 4- or 5-bit codes, one a byte, in the weights' order.
template <bool kHigh>
inline void qk_codes(const uint8_t* qs, __m256i qh, int p, __m256i& lo, __m256i& hi) {
  const __m256i v = load32(qs + 32 * p);
  lo = byte_field(v, 0, 0x0F);
  hi = byte_field(v, 4, 0x0F);
  if constexpr (kHigh) {
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(byte_field(qh, 2 * p, 0x01), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(byte_field(qh, 2 * p + 1, 0x01), 4));
  }
}

// Q4_K (kHigh false) or Q5_K (kHigh true), a block at a time: the 8 sub-blocks' scales d sc_j
// and mins dmin m_j made into vectors once, times each row's 8 activation scales in one
// multiply; codes are unsigned (no sign handling), and the mins' term sum_j dmin m_j dx_j
// sum(q_j) is one FMA per block.
template <bool kHigh, int MR>
inline void row_dot_qk(const Q8Rows& a, const uint8_t* row, float* out, int64_t ldo) {
  constexpr int64_t kBytes = QKBlock<kHigh>::kBytes, kCodes = kHigh ? 48 : 16;
  const int64_t K = a.K, G = K / 32;
  // Two sums a row (even and odd sub-blocks): one chain of FMAs waited on their latency.
  __m256 acc[MR][2];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * kBytes;
    stream_ahead(blk, 3);  // as row_dot_k16's
    const __m128i packed = q4k_scales_mins(blk);
    __m256 vsc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)),
                               _mm256_set1_ps(f16_at(blk)));
    __m256 vmn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                               _mm256_set1_ps(f16_at(blk + 2)));
    asm("" : "+x"(vsc), "+x"(vmn));  // see row_dot_q8
    __m256 vs[MR];
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_loadu_ps(a.d + r * G + 8 * b);
      vs[r] = _mm256_mul_ps(vsc, dx);
      __m256 vm = _mm256_mul_ps(vmn, dx);
      asm("" : "+x"(vs[r]), "+x"(vm));
      acc[r][0] = _mm256_fnmadd_ps(vm, _mm256_loadu_ps(a.sums + r * G + 8 * b), acc[r][0]);
    }
    const __m256i qh = kHigh ? load32(blk + 16) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lo, hi;
      qk_codes<kHigh>(blk + kCodes, qh, p, lo, hi);
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const int8_t* q = a.q + r * K + 256 * b + 64 * p;
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(lo, q)), lane(vs[r], 2 * p),
                                    acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(hi, q + 32)),
                                    lane(vs[r], 2 * p + 1), acc[r][1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// IQ4_NL / IQ4_XS: the 8 groups' scales dl_j of 256 weights at blk (an IQ4_XS block: d (ls_j -
// 32); 8 IQ4_NL blocks: their d).
template <typename B>
inline __m256 iq4_scales(const uint8_t* blk) {
  if constexpr (std::is_same_v<B, IQ4XSBlock>) {
    uint16_t high;
    std::memcpy(&high, blk + 2, 2);
    const __m128i l = _mm_cvtsi32_si128(static_cast<int>(u32_at(blk + 4)));
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m256i low = _mm256_cvtepu8_epi32(
        _mm_unpacklo_epi8(_mm_and_si128(l, lo4), _mm_and_si128(_mm_srli_epi16(l, 4), lo4)));
    const __m256i top = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(top, 4)),
                                        _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(f16_at(blk)));
  } else {
    uint16_t h[8];
    for (int j = 0; j < 8; ++j) std::memcpy(&h[j], blk + IQ4NLBlock::kBytes * j, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  }
}

// IQ4_NL / IQ4_XS, 256 weights a step (an IQ4_XS block, 8 IQ4_NL blocks): each group's table
// values (signed) against the activations by vpmaddubsw on their magnitudes, the signs moved onto
// the activations (as row_dot_q8), with the step's 8 scales dl_j times each row's dx_j made once.
template <typename B, int MR>
inline void row_dot_iq4(const Q8Rows& a, const uint8_t* row, float* out, int64_t ldo) {
  constexpr bool kXS = std::is_same_v<B, IQ4XSBlock>;
  constexpr int64_t kStepBytes = kXS ? IQ4XSBlock::kBytes : 8 * IQ4NLBlock::kBytes;
  const int64_t K = a.K, G = K / 32;
  __m256 acc[MR][2];  // even and odd groups: two chains of FMAs
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * kStepBytes;
    stream_ahead(blk, 3);
    __m256 dl = iq4_scales<B>(blk);
    asm("" : "+x"(dl));  // see row_dot_q8
    __m256 vs[MR];
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      vs[r] = _mm256_mul_ps(dl, _mm256_loadu_ps(a.d + r * G + 8 * b));
      asm("" : "+x"(vs[r]));
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* nib = kXS ? blk + 8 + 16 * j : blk + IQ4NLBlock::kBytes * j + 2;
      const __m256i codes = _mm256_shuffle_epi8(table, nibbles32(nib));
      const __m256i mag = _mm256_abs_epi8(codes);
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m256i qx =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + r * K + 256 * b + 32 * j));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(qx, codes)),
                                            ones);
        acc[r][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), lane(vs[r], j), acc[r][j & 1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// The grid i-quants (IQ2_XXS ... IQ3_S), a 256-weight block a step: each sub-block's grid
// magnitudes made once for the MR rows, against the activations with the weights' signs moved
// onto them (vpmaddubsw), each half's sum times its scale s_h and the row's dx (the block's 16
// of them made once per row: scale pairs (s0_j, s1_j) times (dx_j, dx_j)).
template <typename B, int MR>
inline void row_dot_iq_grid(const Q8Rows& a, const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, G = K / 32;
  __m256 acc[MR][2];  // even and odd sub-blocks: two chains of FMAs
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * B::kBytes;
    stream_ahead(blk, 2);
    alignas(32) float sc[16];  // (s0_j, s1_j) for j = 0..7
    B::Format::block_scales(f16_at(blk), blk, sc);
    __m256 vs[MR][2];
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_loadu_ps(a.d + r * G + 8 * b);
      vs[r][0] = _mm256_mul_ps(_mm256_load_ps(sc), _mm256_permutevar8x32_ps(dx, pairs_lo));
      vs[r][1] = _mm256_mul_ps(_mm256_load_ps(sc + 8), _mm256_permutevar8x32_ps(dx, pairs_hi));
      asm("" : "+x"(vs[r][0]), "+x"(vs[r][1]));  // see row_dot_q8
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i mag = B::magnitudes(blk, j), sgn = B::sign_bytes(blk, j);
      // lanes 0-3 (the first 16 weights) take s0_j, lanes 4-7 s1_j
      const __m256i pick = _mm256_setr_epi32(2 * (j % 4), 2 * (j % 4), 2 * (j % 4), 2 * (j % 4),
                                             2 * (j % 4) + 1, 2 * (j % 4) + 1, 2 * (j % 4) + 1,
                                             2 * (j % 4) + 1);
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m256i qx =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + r * K + 256 * b + 32 * j));
        const __m256i p =
            _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(qx, sgn)), ones);
        const __m256 scale = _mm256_permutevar8x32_ps(vs[r][j / 4], pick);
        acc[r][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][j & 1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

// The formats with a scale per 16 weights (Q2_K, Q3_K, Q6_K) as row_dot_k16 reads them: a
// block's 16 scales s_g and offsets o_g (w = s_g q + o_g for unsigned codes q), 8 a vector, and
// sub-block 4h + t's 32 unsigned codes.
//   Q6_K: q 0..63, s_g = d sc_g, o_g = -32 s_g.  Q3_K: q 0..7, s_g = d (sc_g - 32), o_g = -4 s_g.
//   Q2_K: q 0..3, s_g = d sc_g, o_g = -dmin m_g.
template <typename B>
struct K16;

// s_g = d sc_g for 16 int8 sc_g, and o_g = bias s_g (Q6_K's and Q3_K's factors).
inline void k16_signed_factors(__m128i sc8, float d, float bias, __m256* sc, __m256* off) {
  const __m256 dv = _mm256_set1_ps(d), bv = _mm256_set1_ps(bias);
  sc[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)), dv);
  sc[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))), dv);
  off[0] = _mm256_mul_ps(sc[0], bv);
  off[1] = _mm256_mul_ps(sc[1], bv);
}

template <>
struct K16<Q6KBlock> {
  static void factors(const uint8_t* blk, __m256* sc, __m256* off) {
    k16_signed_factors(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)),
                       f16_at(blk + 208), -32.f, sc, off);
  }
  static __m256i codes(const uint8_t* blk, int h, int t) {
    const __m256i lo = byte_field(load32(blk + 64 * h + 32 * (t & 1)), t >= 2 ? 4 : 0, 0x0F);
    const __m256i high = byte_field(load32(blk + 128 + 32 * h), 2 * t, 0x03);
    return _mm256_or_si256(lo, _mm256_slli_epi16(high, 4));
  }
};

template <>
struct K16<Q3KBlock> {
  static void factors(const uint8_t* blk, __m256* sc, __m256* off) {
    k16_signed_factors(Q3KBlock::scales16(blk), f16_at(blk + 108), -4.f, sc, off);
  }
  static __m256i codes(const uint8_t* blk, int h, int t) {
    const __m256i low = byte_field(load32(blk + 32 + 32 * h), 2 * t, 0x03);
    return _mm256_or_si256(low, _mm256_slli_epi16(byte_field(load32(blk), 4 * h + t, 0x01), 2));
  }
};

template <>
struct K16<Q2KBlock> {
  static void factors(const uint8_t* blk, __m256* sc, __m256* off) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m128i scales = _mm_and_si128(packed, lo4);
    const __m128i mins = _mm_and_si128(_mm_srli_epi16(packed, 4), lo4);
    const __m256 d = _mm256_set1_ps(f16_at(blk + 80)), dmin = _mm256_set1_ps(-f16_at(blk + 82));
    sc[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales)), d);
    sc[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales, 8))), d);
    off[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)), dmin);
    off[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))), dmin);
  }
  static __m256i codes(const uint8_t* blk, int h, int t) {
    return byte_field(load32(blk + 16 + 32 * h), 2 * t, 0x03);
  }
};

// Q2_K, Q3_K or Q6_K, a block at a time: unsigned codes against the activations, their 16 scales
// s_g as two vectors times each row's activation scales; the offsets are o_g dx sum16(q_g), two
// FMAs per block. A sub-block's two halves take lanes 0-3 and 4-7 of its scale vector.
template <typename B, int MR>
inline void row_dot_k16(const Q8Rows& a, const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, G = K / 32;
  __m256 acc[MR][2];  // by the block's half (as row_dot_qk's two sums); the offsets too
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  // Lanes (2j, 2j, 2j, 2j, 2j + 1, ...) of a block's 8 half-group scales, j = sub-block % 4.
  const __m256i pick[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                           _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                           _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                           _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  // Each 32-weight group's dx for its two halves: lanes (0, 0, 1, 1, 2, 2, 3, 3).
  const __m256i twice = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * B::kBytes;
    // The rows lie one after another: the walk goes on into the next.
    stream_ahead(blk, static_cast<int>((B::kBytes + 63) / 64));
    __m256 sc[2], off[2];
    K16<B>::factors(blk, sc, off);
    asm("" : "+x"(sc[0]), "+x"(sc[1]), "+x"(off[0]), "+x"(off[1]));  // see row_dot_q8
    __m256 vs[MR][2];
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_loadu_ps(a.d + r * G + 8 * b);  // 8 groups of 32
      const __m256 dxh[2] = {
          _mm256_permutevar8x32_ps(dx, twice),  // halves of groups 0-3
          _mm256_permutevar8x32_ps(dx, _mm256_add_epi32(twice, _mm256_set1_epi32(4)))};
      const float* s16 = a.sums16 + r * 2 * G + 16 * b;
      RS_UNROLL for (int h = 0; h < 2; ++h) {
        vs[r][h] = _mm256_mul_ps(sc[h], dxh[h]);
        __m256 o = _mm256_mul_ps(off[h], dxh[h]);
        asm("" : "+x"(vs[r][h]), "+x"(o));
        acc[r][h] = _mm256_fmadd_ps(o, _mm256_loadu_ps(s16 + 8 * h), acc[r][h]);
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t) {
        const __m256i codes = K16<B>::codes(blk, h, t);
        RS_UNROLL for (int r = 0; r < MR; ++r) {
          const int8_t* q = a.q + r * K + 256 * b + 128 * h + 32 * t;
          const __m256 scale = _mm256_permutevar8x32_ps(vs[r][h], pick[t]);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(codes, q)), scale, acc[r][h]);
        }
      }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#ifdef RS_AVX512_VNNI
// The VNNI row dots' lane maps: lane l of vector v (weights 64v..64v+63 of a block) sums
// weights 64v + 4l..4l+3, of half-group 4v + l / 4 (by_half: Q6_K's scales) and group 2v + l / 8
// (by_group); half-group j is of group j / 2 (of_half).
struct VnniLanes {
  __m512i by_half[4], by_group[4], of_half;
  VnniLanes() {
    for (int v = 0; v < 4; ++v) {
      alignas(64) int32_t h[16], g[16];
      for (int l = 0; l < 16; ++l) h[l] = 4 * v + l / 4, g[l] = 2 * v + l / 8;
      by_half[v] = _mm512_load_si512(h);
      by_group[v] = _mm512_load_si512(g);
    }
    alignas(64) int32_t halves[16];
    for (int j = 0; j < 16; ++j) halves[j] = j / 2;
    of_half = _mm512_load_si512(halves);
  }
};

// Each row's activation scales as the VNNI row dots meet them, made once a call rather than
// once a weight row: per row and block of 256, kScaleVectors vectors, the first four the
// block's 8 group scales dx laid out as weights 64v.. of the block take them (by_group), the
// fifth dx per half-group times -32 (the codes' offset; a power of two, so the product is
// exact and the sums equal those of multiplying by -32 later).
constexpr int kScaleVectors = 5;
void vnni_row_scales(const float* d, int64_t M, int64_t K, float* dxv) {
  const VnniLanes lanes;
  const __m512 m32 = _mm512_set1_ps(-32.f);
  const int64_t G = K / 32, blocks = K / 256;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 dx = _mm512_castps256_ps512(_mm256_loadu_ps(d + r * G + 8 * b));
      float* o = dxv + (r * blocks + b) * kScaleVectors * 16;
      for (int v = 0; v < 4; ++v)
        _mm512_storeu_ps(o + 16 * v, _mm512_permutexvar_ps(lanes.by_group[v], dx));
      _mm512_storeu_ps(o + 64, _mm512_mul_ps(_mm512_permutexvar_ps(lanes.of_half, dx), m32));
    }
}

// row_dot_k16 for Q6_K on AVX-512 VNNI, 64 weights a vpdpbusd: lane l of vector v meets one
// vector of scales d sc x dx (VnniLanes) in one FMA; the block's scales are permuted once for all
// the rows, each row's dx once a call (vnni_row_scales: `dxv`, row r's K / 256 x 5 vectors). The low
// nibbles of the 64 code bytes at 64h are weights 128h..128h+63 in order, the high nibbles the
// next 64; the 32 bytes of high bits at 128 + 32h hold theirs two bits a weight, 32 weights a
// bit pair, read from both halves of one broadcast vector by shifts of 0 / 2 (4 / 6).
template <int MR>
inline void row_dot_q6k_vnni(const Q8Rows& a, const float* dxv, const VnniLanes& lanes,
                             const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, G = K / 32, blocks = K / 256;
  __m512 acc[MR][2];  // the low and high nibbles' sums (two chains of FMAs); the -32 in the first
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F), two_bits = _mm512_set1_epi8(0x03);
  // 16-bit shift counts: 0 in the low 256 bits, 2 in the high (the low nibbles' bit pairs);
  // 4 and 6 for the high nibbles'.
  const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shift_hi = _mm512_add_epi16(shift_lo, _mm512_set1_epi16(4));
  const int64_t row_stride = blocks * kScaleVectors * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * 210;
    stream_ahead(blk, 4);  // the rows lie one after another: the walk goes on into the next
    __m512 sc = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))),
        _mm512_set1_ps(f16_at(blk + 208)));  // d sc_j, j = 0..15
    asm("" : "+v"(sc));  // see row_dot_q8
    __m512 scv[4];
    RS_UNROLL for (int v = 0; v < 4; ++v) scv[v] = _mm512_permutexvar_ps(lanes.by_half[v], sc);
    const float* xv = dxv + b * kScaleVectors * 16;
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      __m512 sx = _mm512_mul_ps(sc, _mm512_loadu_ps(xv + r * row_stride + 64));
      asm("" : "+v"(sx));
      acc[r][0] = _mm512_fmadd_ps(sx, _mm512_loadu_ps(a.sums16 + r * 2 * G + 16 * b), acc[r][0]);
    }
    RS_UNROLL for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
      const __m512i lo = _mm512_or_si512(
          _mm512_and_si512(ql, nibble),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), two_bits), 4));
      const __m512i hi = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), two_bits), 4));
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const int8_t* q = a.q + r * K + 256 * b + 128 * h;
        const float* x = xv + r * row_stride;
        __m512 vlo = _mm512_mul_ps(scv[2 * h], _mm512_loadu_ps(x + 32 * h));
        __m512 vhi = _mm512_mul_ps(scv[2 * h + 1], _mm512_loadu_ps(x + 32 * h + 16));
        asm("" : "+v"(vlo), "+v"(vhi));
        const __m512i dlo =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
        const __m512i dhi =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(q + 64));
        acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), vlo, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), vhi, acc[r][1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// acc[2 r + chain] += float(codes . the 64 int8 activations at q + r * K) * scv * the scales
// at dx + r * row_stride, for MR rows: one vector of a block in row_dot_qk_vnni and
// row_dot_q3k_vnni (acc: their acc[MR][2], flat).
template <int MR>
inline void vnni_rows64(__m512i codes, __m512 scv, const int8_t* q, int64_t K, const float* dx,
                        int64_t row_stride, __m512* acc, int chain) {
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    __m512 s = _mm512_mul_ps(scv, _mm512_loadu_ps(dx + r * row_stride));
    asm("" : "+v"(s));  // see row_dot_q8
    const __m512i dot =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(q + r * K));
    acc[2 * r + chain] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[2 * r + chain]);
  }
}

// For block b of row_dot_q3k_vnni and row_dot_q2k_vnni (16 groups of 16): scv[v], the groups'
// scales sc laid out as vector v's lanes meet them (by_half), and each row's acc[r][0] plus
// off_i (times dx_i) sum16(q_i), dx_i times -32 (vnni_row_scales' fifth vector at xv) times
// `times`, a power of two (exact). Always inlined, as group_terms_vnni.
template <int MR>
[[gnu::always_inline]] inline void half_terms_vnni(__m512 sc, __m512 off, float times,
                                                   const Q8Rows& a, int64_t b, const float* xv,
                                                   int64_t row_stride, const VnniLanes& lanes,
                                                   __m512* scv, __m512 (&acc)[MR][2]) {
  const int64_t G = a.K / 32;
  RS_UNROLL for (int v = 0; v < 4; ++v) scv[v] = _mm512_permutexvar_ps(lanes.by_half[v], sc);
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    const __m512 dx =
        _mm512_mul_ps(_mm512_loadu_ps(xv + r * row_stride + 64), _mm512_set1_ps(times));
    __m512 x = _mm512_mul_ps(off, dx);
    asm("" : "+v"(x));  // see row_dot_q8
    acc[r][0] = _mm512_fmadd_ps(x, _mm512_loadu_ps(a.sums16 + r * 2 * G + 16 * b), acc[r][0]);
  }
}

// Q3_K on AVX-512 VNNI, as row_dot_q6k_vnni: codes 0..7 unsigned (w = d sc (q - 4)), lane l of
// vector v (weights 64v..64v+63, sub-blocks 2v and 2v + 1) of half-group 4v + l / 4, so the
// scales permute as Q6_K's; the -4 is the -32 vector times 1 / 8 (exact). Vector v's low bits
// are bits 2j, 2j + 2 (j = 2 (v % 2); low, high half) of the 32 bytes at 32 + 32 (v / 2), its
// third bits bits 2v, 2v + 1 of the 32 hmask bytes.
template <int MR>
inline void row_dot_q3k_vnni(const Q8Rows& a, const float* dxv, const VnniLanes& lanes,
                             const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, blocks = K / 256;
  __m512 acc[MR][2];  // even and odd vectors (two chains of FMAs); the -4 in the first
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i two_bits = _mm512_set1_epi8(0x03), one_bit = _mm512_set1_epi8(0x01);
  const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
  const int64_t row_stride = blocks * kScaleVectors * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * Q3KBlock::kBytes;
    stream_ahead(blk, 2);  // 110 bytes a block
    __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Q3KBlock::scales16(blk))),
                              _mm512_set1_ps(f16_at(blk + 108)));  // d (sc_j - 32), j = 0..15
    asm("" : "+v"(sc));  // see row_dot_q8
    __m512 scv[4];
    const float* xv = dxv + b * kScaleVectors * 16;
    half_terms_vnni<MR>(sc, sc, 0.125f, a, b, xv, row_stride, lanes, scv, acc);  // -32 / 8: -4
    const __m512i hmask =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    RS_UNROLL for (int v = 0; v < 4; ++v) {
      const __m512i qs = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * (v / 2))));
      const __m512i low_shift = _mm512_add_epi16(
          _mm512_add_epi16(half, half), _mm512_set1_epi16(static_cast<int16_t>(4 * (v % 2))));
      const __m512i high_shift =
          _mm512_add_epi16(half, _mm512_set1_epi16(static_cast<int16_t>(2 * v)));
      const __m512i low = _mm512_and_si512(_mm512_srlv_epi16(qs, low_shift), two_bits);
      const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(hmask, high_shift), one_bit);
      const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi16(high, 2));
      vnni_rows64<MR>(codes, scv[v], a.q + 256 * b + 64 * v, K, xv + 16 * v, row_stride, acc[0],
                      v & 1);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// Q2_K on AVX-512 VNNI, as row_dot_q3k_vnni: codes 0..3 unsigned, lane l of vector v (sub-blocks
// 2v and 2v + 1: bits 4 (v % 2), 2 more in the high half, of the 32 bytes at 16 + 32 (v / 2)) of
// group 4v + l / 4, so the scales d sc_i permute as Q6_K's; the mins' term, dmin m_i dx
// sum16_i for the 16 groups, is one FMA a block, -dx from the -32 vector times 1/32 (exact).
template <int MR>
inline void row_dot_q2k_vnni(const Q8Rows& a, const float* dxv, const VnniLanes& lanes,
                             const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, blocks = K / 256;
  __m512 acc[MR][2];  // even and odd vectors (two chains of FMAs); the mins in the first
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i two_bits = _mm512_set1_epi8(0x03);
  const __m512i high = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  const int64_t row_stride = blocks * kScaleVectors * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * Q2KBlock::kBytes;
    stream_ahead(blk, 2);  // 84 bytes a block
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, lo4))),
                              _mm512_set1_ps(f16_at(blk + 80)));  // d sc_i
    __m512 mn = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), lo4))),
        _mm512_set1_ps(f16_at(blk + 82)));  // dmin m_i
    asm("" : "+v"(sc), "+v"(mn));  // see row_dot_q8
    __m512 scv[4];
    const float* xv = dxv + b * kScaleVectors * 16;
    half_terms_vnni<MR>(sc, mn, 1.f / 32.f, a, b, xv, row_stride, lanes, scv, acc);  // -dx
    RS_UNROLL for (int v = 0; v < 4; ++v) {
      const __m512i qs = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (v / 2))));
      const __m512i shift =
          _mm512_add_epi16(high, _mm512_set1_epi16(static_cast<int16_t>(4 * (v % 2))));
      const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(qs, shift), two_bits);
      vnni_rows64<MR>(codes, scv[v], a.q + 256 * b + 64 * v, K, xv + 16 * v, row_stride, acc[0],
                      v & 1);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

// For 8 groups of 32 at block (or step) b of row_dot_qk_vnni and row_dot_iq4_vnni: scv[v], the
// groups' scales sc (lanes 0-7) laid out as vector v's lanes meet them (by_group), and each
// row's acc[r][0] less off_j dx_j sum(q_j) (off: Q4_K's mins, or the IQ4 table's lift). Always
// inlined: compiled as a call, it had slowed IQ4_XS's row dot by half.
template <int MR>
[[gnu::always_inline]] inline void group_terms_vnni(__m512 sc, __m256 off, const Q8Rows& a,
                                                    int64_t b, const VnniLanes& lanes,
                                                    __m512* scv, __m512 (&acc)[MR][2]) {
  const int64_t G = a.K / 32;
  RS_UNROLL for (int v = 0; v < 4; ++v) scv[v] = _mm512_permutexvar_ps(lanes.by_group[v], sc);
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    __m256 m = _mm256_mul_ps(off, _mm256_loadu_ps(a.d + r * G + 8 * b));
    asm("" : "+v"(m));  // see row_dot_q8
    acc[r][0] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(m),
                                 _mm512_zextps256_ps512(_mm256_loadu_ps(a.sums + r * G + 8 * b)),
                                 acc[r][0]);
  }
}

// row_dot_qk on AVX-512 VNNI, 64 weights a vpdpbusd: vector v is the 32 code bytes at 16 + 32v
// (Q5_K: 48 + 32v), low nibbles (group 2v) then high ones (group 2v + 1), so lane l is of group
// 2v + l / 8 and meets the scales d sc x dx laid out as Q6_K's groups are (VnniLanes::by_group,
// the first four of vnni_row_scales' vectors); the mins' term is one FMA a block in the low 8
// lanes. Q5_K's fifth bits, bit j of its 32 high-bit bytes for group j, come from one broadcast
// vector shifted by 2v (2v + 1 in the high half).
template <bool kHigh, int MR>
inline void row_dot_qk_vnni(const Q8Rows& a, const float* dxv, const VnniLanes& lanes,
                            const uint8_t* row, float* out, int64_t ldo) {
  constexpr int64_t kBytes = QKBlock<kHigh>::kBytes, kCodes = kHigh ? 48 : 16;
  const int64_t K = a.K, blocks = K / 256;
  __m512 acc[MR][2];  // even and odd vectors (two chains of FMAs); the mins in the first
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // 16-bit shift counts: 0 in the low 256 bits (low nibbles), 4 in the high.
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i one = _mm512_set1_epi8(0x01), high_shift = _mm512_inserti64x4(
      _mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // + 2v: group 2v, then 2v + 1
  const int64_t row_stride = blocks * kScaleVectors * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kBytes;
    stream_ahead(blk, 3);  // as row_dot_qk's
    const __m128i packed = q4k_scales_mins(blk);
    __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed)),
                              _mm512_set1_ps(f16_at(blk)));  // d sc_j in lanes 0-7
    __m256 mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                              _mm256_set1_ps(f16_at(blk + 2)));  // dmin m_j
    asm("" : "+v"(sc), "+v"(mn));  // see row_dot_q8
    __m512 scv[4];
    group_terms_vnni<MR>(sc, mn, a, b, lanes, scv, acc);
    const float* xv = dxv + b * kScaleVectors * 16;
    const __m512i qh = kHigh ? _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(blk + 16)))
                              : _mm512_setzero_si512();
    RS_UNROLL for (int v = 0; v < 4; ++v) {
      __m512i codes = _mm512_and_si512(
          _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(blk + kCodes + 32 * v))),
                            shift),
          nibble);
      if constexpr (kHigh) {
        const __m512i bits = _mm512_srlv_epi16(
            qh, _mm512_add_epi16(high_shift, _mm512_set1_epi16(static_cast<int16_t>(2 * v))));
        codes = _mm512_or_si512(codes, _mm512_slli_epi16(_mm512_and_si512(bits, one), 4));
      }
      vnni_rows64<MR>(codes, scv[v], a.q + 256 * b + 64 * v, K, xv + 16 * v, row_stride, acc[0],
                      v & 1);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

#ifdef RS_AVX512_VNNI
// IQ4_NL / IQ4_XS on AVX-512 VNNI, as row_dot_qk_vnni, 256 weights a step (an IQ4_XS block, 8
// IQ4_NL blocks): vector v holds sub-blocks 2v and 2v + 1, each's 16 nibble bytes made into its
// 32 weights' order (low nibbles, then high) and looked up in kIq4Values + 128 (1..241,
// unsigned: vpdpbusd's left side), so sub-block j's dot carries 128 dl_j dx_j sum(q_j) more,
// taken off by one FMA a step in the low 8 lanes (128 dl_j: exact). dl_j: d (ls_j - 32) or d.
template <typename B, int MR>
inline void row_dot_iq4_vnni(const Q8Rows& a, const float* dxv, const VnniLanes& lanes,
                             const uint8_t* row, float* out, int64_t ldo) {
  constexpr bool kXS = std::is_same_v<B, IQ4XSBlock>;
  constexpr int64_t kStepBytes = kXS ? IQ4XSBlock::kBytes : 8 * IQ4NLBlock::kBytes;
  const int64_t K = a.K, steps = K / 256;
  __m512 acc[MR][2];  // even and odd vectors (two chains of FMAs); the 128s in the first
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i table = _mm512_broadcast_i32x4(_mm_xor_si128(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values)), _mm_set1_epi8(-128)));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // 16-bit shift counts by 128-bit lane: 0, 4, 0, 4 (a sub-block's low nibbles, then high).
  const __m512i shift = _mm512_broadcast_i64x4(_mm256_setr_epi64x(0, 0, 0x0004000400040004LL,
                                                                  0x0004000400040004LL));
  const int64_t row_stride = steps * kScaleVectors * 16;
  for (int64_t b = 0; b < steps; ++b) {
    const uint8_t* blk = row + b * kStepBytes;
    stream_ahead(blk, 3);  // as row_dot_qk's
    const __m256 dl = iq4_scales<B>(blk);
    __m256 lift = _mm256_mul_ps(dl, _mm256_set1_ps(128.f));
    __m512 sc = _mm512_zextps256_ps512(dl);
    asm("" : "+v"(sc), "+v"(lift));  // see row_dot_q8
    __m512 scv[4];
    group_terms_vnni<MR>(sc, lift, a, b, lanes, scv, acc);
    const float* xv = dxv + b * kScaleVectors * 16;
    RS_UNROLL for (int v = 0; v < 4; ++v) {
      // The two sub-blocks' 16 bytes as 128-bit lanes (A, A, B, B).
      __m256i pair;
      if constexpr (kXS)
        pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * v));
      else
        pair = _mm256_loadu2_m128i(
            reinterpret_cast<const __m128i*>(blk + IQ4NLBlock::kBytes * (2 * v + 1) + 2),
            reinterpret_cast<const __m128i*>(blk + IQ4NLBlock::kBytes * 2 * v + 2));
      const __m512i twice = _mm512_castsi256_si512(pair);
      const __m512i nib =
          _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_i64x2(twice, twice, 0x50), shift),
                           nibble);
      vnni_rows64<MR>(_mm512_shuffle_epi8(table, nib), scv[v], a.q + 256 * b + 64 * v, K,
                      xv + 16 * v, row_stride, acc[0], v & 1);
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

#ifdef RS_AVX512_VNNI
// The grid i-quants on AVX-512 VNNI: row_dot_iq_grid two sub-blocks a vector. The weights'
// signs, 64 bits, negate the activations under a mask (no vpsignb in AVX-512); vpdpbusd meets
// the magnitudes with them, each lane 4 weights, so lanes 4h..4h + 3 are half h of the pair;
// the block's 16 half scales times dx make one vector a row, picked per pair by vpermps.
template <typename B, int MR>
inline void row_dot_iq_grid_vnni(const Q8Rows& a, const uint8_t* row, float* out, int64_t ldo) {
  const int64_t K = a.K, G = K / 32;
  __m512 acc[MR][2];  // even and odd pairs: two chains of FMAs
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = row + b * B::kBytes;
    stream_ahead(blk, 2);
    alignas(64) float sc[16];  // (s0_j, s1_j) for j = 0..7
    B::Format::block_scales(f16_at(blk), blk, sc);
    __m512 vs[MR];
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_permutexvar_ps(
          twice, _mm512_castps256_ps512(_mm256_loadu_ps(a.d + r * G + 8 * b)));
      vs[r] = _mm512_mul_ps(_mm512_load_ps(sc), dx);
      asm("" : "+v"(vs[r]));  // see row_dot_q8
    }
    RS_UNROLL for (int v = 0; v < 4; ++v) {
      const __m512i mag = B::template magnitudes64<(MR <= 2)>(blk, v);
      const __mmask64 neg = static_cast<uint64_t>(B::sign_mask(blk, 2 * v)) |
                            static_cast<uint64_t>(B::sign_mask(blk, 2 * v + 1)) << 32;
      // lanes 4h .. 4h + 3 take half scale 4v + h (sub-block 2v + h / 2's half h % 2)
      const __m512i pick = _mm512_setr_epi32(4 * v, 4 * v, 4 * v, 4 * v, 4 * v + 1, 4 * v + 1,
                                             4 * v + 1, 4 * v + 1, 4 * v + 2, 4 * v + 2,
                                             4 * v + 2, 4 * v + 2, 4 * v + 3, 4 * v + 3,
                                             4 * v + 3, 4 * v + 3);
      RS_UNROLL for (int r = 0; r < MR; ++r) {
        const __m512i qx = _mm512_loadu_si512(a.q + r * K + 256 * b + 64 * v);
        const __m512i signed_x = _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mag, signed_x);
        acc[r][v & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                        _mm512_permutexvar_ps(pick, vs[r]), acc[r][v & 1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#endif

// How far ahead of the row it reads a thread asks for weight rows into L2, a row at a time: 64
// KB (Q6_K rows of 2,048 weights one row: 19.6 against 14.6 GB/s for 4 rows, 1,680 bytes each,
// into L1; 16384 x 2048, 12 matrices in turn, AMX Xeon). row_dot_q6k_vnni asks for its lines as
// it goes instead (simd.h's stream_ahead): on Zen 4, one row over a 2048 x 8192 Q6_K matrix
// 0.40-0.46 ms against 0.45-0.58 a row at a time, 4096 x 14336 1.57-1.70 against 2.46-2.59. So
// do row_dot_k16 and row_dot_qk (AVX2): on Zen 3, one row over 8 matrices of 2048 x 8192 Q6_K
// 0.50-0.65 ms each against 0.88 (15.6 GB/s); 4 of 16384 x 2048 Q4_K 0.80-0.83 against 0.93.
constexpr int64_t kAheadBytes = 64 << 10;
// Input rows a Q6_K row dot takes at once: 8 in 512-bit registers, 2 in 256-bit ones. With
// each row's scales made once a call (vnni_row_scales), the LM head of 49152 x 2048 Q6_K took
// 9.1-9.7 ms for 8 rows against 12.9-13.3 at 4 a pass with the scales permuted per weight row,
// and 9.1-12.0 with 4 a pass (Xeon, AVX-512 VNNI without BF16, 3-4 processes each; 2048 x 8192:
// 2.0-2.4 ms all three). Before that: 4 rather than 2, 2.15 against 2.41 ms (Zen 4). Q4_K's
// VNNI row dot takes 8 too (8192 x 2048, 8 rows: 1.9-2.4 ms against 2.7-4.3 at 2 a pass on the
// 256-bit one); with 256-bit registers, two sums a row fill them at 2.
#ifdef RS_AVX512_VNNI
constexpr int kQ6kRows = 8, kQ4kRows = 8;
#else
constexpr int kQ6kRows = 2, kQ4kRows = 2;
#endif

// out [M, ldo] columns [0, N) = x W^T for one part of N rows of format B: weight rows spread
// over the threads, input rows a few at a time (the sub-block's codes made once for them).
template <typename B>
void gemv_part_q8(const Q8Rows& a, int64_t M, const uint8_t* blocks, int64_t N, float* out,
                  int64_t ldo) {
  const int64_t K = a.K;
  const int64_t row_bytes = K / B::kWeights * B::kBytes, G = K / 32;
  const int64_t ahead_rows = std::max<int64_t>(4, kAheadBytes / row_bytes);
#ifdef RS_AVX512_VNNI
  const bool vnni = a.dxv != nullptr;
  const VnniLanes lanes;
  const int64_t scale_stride = K / 256 * kScaleVectors * 16;
#else
  constexpr int64_t scale_stride = 0;
#endif
  constexpr bool kQK = std::is_same_v<B, QKBlock<false>> || std::is_same_v<B, QKBlock<true>>;
  constexpr bool kK16 = std::is_same_v<B, Q2KBlock> || std::is_same_v<B, Q3KBlock> ||
                        std::is_same_v<B, Q6KBlock>;  // row_dot_k16's formats
  constexpr bool kIQ4 = std::is_same_v<B, IQ4NLBlock> || std::is_same_v<B, IQ4XSBlock>;
  // The K-quants' and i-quants' row dots stream their blocks (the rest: rows ahead into L2)
  constexpr bool rows_ahead = !(kQK || kK16 || kIQ4 || kIqGridBlock<B>);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      if (rows_ahead) {
        const char* ahead =
            reinterpret_cast<const char*>(blocks + std::min(n + ahead_rows, N - 1) * row_bytes);
        for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
      }
      // Input rows a few at a time, each sub-block's codes made once for them (kQ4kRows,
      // kQ6kRows for the K-quants).
      constexpr int kRows = kQK || kIQ4 || kIqGridBlock<B> ? kQ4kRows : kK16 ? kQ6kRows : 4;
      for (int64_t m = 0; m < M; m += kRows) {
        const Q8Rows at{a.q + m * K, a.d + m * G, a.sums + m * G, a.sums16 + m * 2 * G, K,
                        a.dxv ? a.dxv + m * scale_stride : nullptr};
        float* o = out + m * ldo + n;
        with_rows<kRows>(static_cast<int>(std::min<int64_t>(kRows, M - m)), [&](auto R) {
          if constexpr (kQK) {
            constexpr bool kHigh = std::is_same_v<B, QKBlock<true>>;
#ifdef RS_AVX512_VNNI
            if (vnni) return row_dot_qk_vnni<kHigh, R>(at, at.dxv, lanes, row, o, ldo);
#endif
            row_dot_qk<kHigh, R>(at, row, o, ldo);
          }
          else if constexpr (kK16) {
#ifdef RS_AVX512_VNNI
            if (vnni) {
              if constexpr (std::is_same_v<B, Q2KBlock>)
                return row_dot_q2k_vnni<R>(at, at.dxv, lanes, row, o, ldo);
              else if constexpr (std::is_same_v<B, Q3KBlock>)
                return row_dot_q3k_vnni<R>(at, at.dxv, lanes, row, o, ldo);
              else
                return row_dot_q6k_vnni<R>(at, at.dxv, lanes, row, o, ldo);
            }
#endif
            row_dot_k16<B, R>(at, row, o, ldo);
          }
          else if constexpr (kIQ4) {
#ifdef RS_AVX512_VNNI
            if (vnni) return row_dot_iq4_vnni<B, R>(at, at.dxv, lanes, row, o, ldo);
#endif
            if (K % 256 == 0) return row_dot_iq4<B, R>(at, row, o, ldo);
            row_dot_q8<B, R>(at.q, at.d, at.sums, at.sums16, K, row, o, ldo);  // IQ4_NL rows
          }
          else if constexpr (kIqGridBlock<B>) {
#ifdef RS_AVX512_VNNI
            if (vnni) return row_dot_iq_grid_vnni<B, R>(at, row, o, ldo);
#endif
            row_dot_iq_grid<B, R>(at, row, o, ldo);
          }
          else
            row_dot_q8<B, R>(at.q, at.d, at.sums, at.sums16, K, row, o, ldo);
        });
      }
    }
  });
}
#endif

}  // namespace

void gguf_gemm_q8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& layout,
                  const at::Tensor& out) {
  check(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check(K % 32 == 0, "gguf_gemm_q8: K is not a multiple of 32");
  // The layout's kinds are GGML types + kGgufQ8 (what QuantLinear.decode_operands names).
  at::Tensor types = layout.clone();
  int64_t* tp = types.data_ptr<int64_t>();
  for (int64_t p = 0; p < types.size(0); ++p) {
    check(tp[2 * p + 1] >= kGgufQ8, "gguf_gemm_q8: a layout of GGML types + kGgufQ8");
    tp[2 * p + 1] -= kGgufQ8;
  }
  const int64_t N = check_layout(blocks, types, K);
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M &&
            out.size(1) == N,
        "out: float32 [M, rows]");
#ifdef RS_AVX2
  const int64_t G = K / 32;
  // On 64-byte lines (torch's allocator): the Q6_K row dot loads them 64 bytes at a time.
  const at::Tensor q = at::empty({M * K}, at::kChar), d = at::empty({M * G}, at::kFloat),
                   sums = at::empty({M * G}, at::kFloat), sums16 = at::empty({2 * M * G}, at::kFloat);
  quantize_rows_q8(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                   sums.data_ptr<float>(), sums16.data_ptr<float>());
  Q8Rows a{q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<float>(),
           sums16.data_ptr<float>(), K};
#ifdef RS_AVX512_VNNI
  at::Tensor dxv;
  if (cpu_has_avx512_vnni() && K % 256 == 0) {  // Q6_K blocks hold 256 weights
    dxv = at::empty({M * K / 256 * kScaleVectors * 16}, at::kFloat);
    vnni_row_scales(d.data_ptr<float>(), M, K, dxv.data_ptr<float>());
    a.dxv = dxv.data_ptr<float>();
  }
#endif
  float* op = out.data_ptr<float>();
  for_each_part(tp, types.size(0), K, blocks.data_ptr<uint8_t>(),
                [&](auto b, int64_t rows, const uint8_t* bp, int64_t first) {
                  using B = decltype(b);
                  if constexpr (kFloatBlock<B>)  // F16 / BF16: float32 activations, as stored
                    half_rows_small<B>(x.data_ptr<float>(), M, bp, rows, K, op + first, N);
                  else
                    gemv_part_q8<B>(a, M, bp, rows, op + first, N);
                });
#else
  gguf_gemm(x, blocks, types, out);  // no AVX2: the float32 kernels (matrix.py offers no path)
#endif
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_gemm_q8(Tensor x, Tensor blocks, Tensor layout, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("gguf_gemm_q8", &radixserve::gguf_gemm_q8); }

// llama.cpp's GGUF block formats computed as the file stores them: y = x W^T for float32 x and
// W in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (blocks of 32 weights) or Q2_K ... Q6_K, IQ4_XS
// (super-blocks of 256), byte for byte as in the GGUF (no repacking, no dequantize-requantize
// round trip); F16 / BF16 matrices likewise, converted as they are read.
//
// Every format is read 32 weights at a time ("a sub-block"): its codes become float32 weights
// in registers (scale * code + offset, as gguf's dequantization computes them), then meet the
// input rows. 1-16 input rows (decode steps) use the weights straight from registers (while
// exact_rows() is on, each input row by one row's arithmetic: row_dot1, row_dot_exact); more
// rows (prefill) dequantize 16 weight rows at a time into a packed panel for gemm.cpp's
// register-tiled GEMM (quant_gemm_panels: with AVX-512, its 8x32 tile).
//
// A projection may hold rows of several formats (a Q4_K_M file stores q/k in one and v in
// another, and the model fuses them): `layout` [P, 2] int64 lists its parts in row order as
// (rows, GGML type number); their blocks follow each other in one uint8 buffer.
//
// Block layouts (d, m: float16; little-endian):
//   Q4_0 (18 B): d, qs[16]          w = d (q - 8)        q: byte j low nibble = weight j,
//   Q4_1 (20 B): d, m, qs[16]       w = d q + m             high nibble = weight j + 16
//   Q5_0 (22 B): d, qh[4], qs[16]   w = d (q - 16)       q's bit 4 of weight j: bit j of qh
//   Q5_1 (24 B): d, m, qh[4], qs[16]  w = d q + m
//   Q8_0 (34 B): d, qs[32] int8     w = d q
//   Q4_K (144 B): d, dmin, scales[12], qs[128]: 8 sub-blocks j of 32 with 6-bit scale sc_j and
//        min m_j; w = (d sc_j) q - (dmin m_j); sub-block 2p / 2p + 1: low / high nibbles of
//        bytes 32p .. 32p + 31
//   Q2_K (84 B), Q3_K (110 B), IQ4_NL (18 B), IQ4_XS (136 B): below (Q2KBlock, Q3KBlock,
//        IQ4NLBlock, IQ4XSBlock)
//   Q5_K (176 B): d, dmin, scales[12], qh[32], qs[128]: as Q4_K, q's bit 4 in sub-block j is
//        bit j of qh[e] (e: the weight's index in its sub-block)
//   Q6_K (210 B): ql[128], qh[64], scales[16] int8, d: 16 groups of 16 weights with scale sc;
//        w = (d sc) (q - 32); sub-block s = 4h + t: low (t < 2) or high nibbles of
//        ql[64h + 32 (t & 1) + e], bits 2t, 2t + 1 of qh[32h + e] as q's bits 4 and 5
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant_kinds.h"
#include "simd.h"
#include "tile.h"

namespace radixserve {
namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef RS_AVX2
  return _cvtsh_ss(h);  // F16C: one instruction
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K: byte e (0..15) of sub-block j's int4 codes as quant.py holds them (code e | code
// e + 16 << 4), from the block's qs (bytes 32p .. 32p + 31: sub-block 2p's weights in the low
// nibbles, 2p + 1's in the high).
inline uint8_t q4k_code_byte(const uint8_t* qs, int64_t j, int e) {
  const uint8_t* src = qs + 32 * (j / 2);
  return (j & 1) ? static_cast<uint8_t>((src[e] >> 4) | (src[e + 16] & 0xF0))
                 : static_cast<uint8_t>((src[e] & 0x0F) | (src[e + 16] << 4));
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int64_t j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#ifdef RS_AVX2
// One sub-block of 32 weights as the vector code reads it: weight e = scale(e) * codes[e] +
// offset(e), codes as 32 signed bytes (the format's fixed offset, such as Q4_0's -8, already
// applied), scale(e) = s0 for e < 16 and s1 for the rest (they differ in Q2_K, Q3_K and Q6_K),
// offset(e) likewise off and off1 (they differ in Q2_K only: kHalfOffsets).
struct Sub {
  __m256i codes;
  float s0, s1, off, off1;
  Sub(__m256i c, float scale0, float scale1, float offset)
      : codes(c), s0(scale0), s1(scale1), off(offset), off1(offset) {}
  Sub(__m256i c, float scale0, float scale1, float offset0, float offset1)
      : codes(c), s0(scale0), s1(scale1), off(offset0), off1(offset1) {}
};

// 16 bytes of nibbles as 32 codes: byte j's low nibble is code j, its high nibble code j + 16.
inline __m256i nibbles32(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// Bit e of `bits` as byte e: `value` where set, 0 where not.
inline __m256i bits_to_bytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

// (v >> shift) & mask in every byte of 32 (shift < 8; the 16-bit shift's spill is masked off).
inline __m256i byte_field(__m256i v, int shift, char mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask));
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The 32 codes as floats, 8 a vector (elements 0-7, ..., 24-31).
inline void widen(__m256i codes, __m256* f) {
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// The sub-block's 32 weights, 8 a vector.
inline void weights(const Sub& u, __m256* w) {
  widen(u.codes, w);
  const __m256 s0 = _mm256_set1_ps(u.s0), s1 = _mm256_set1_ps(u.s1);
  const __m256 off0 = _mm256_set1_ps(u.off), off1 = _mm256_set1_ps(u.off1);
  w[0] = _mm256_fmadd_ps(w[0], s0, off0);
  w[1] = _mm256_fmadd_ps(w[1], s0, off0);
  w[2] = _mm256_fmadd_ps(w[2], s1, off1);
  w[3] = _mm256_fmadd_ps(w[3], s1, off1);
}
#endif

// Each format: kWeights per block, kBytes per block, kOffset (whether weights have a per-block
// offset beyond the codes' own, i.e. a min), and sub-block s (32 weights) of a row: `scalar`
// into w[32]; `sub` (AVX2) as its codes, scales and offset.

// Q4_0 and Q4_1: nibbles, with a fixed offset (-8) or the block's min.
template <bool kMin>
struct Q4Block {
  static constexpr int64_t kWeights = 32, kBytes = kMin ? 20 : 18;
  static constexpr bool kOffset = kMin;
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b), off = kMin ? f16_at(b + 2) : -8.f * d;
    const uint8_t* q = b + (kMin ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(q[j] & 0x0F) + off;
      w[j + 16] = d * static_cast<float>(q[j] >> 4) + off;
    }
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b);
    __m256i codes = nibbles32(b + (kMin ? 4 : 2));
    if (!kMin) codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(8));
    return {codes, d, d, kMin ? f16_at(b + 2) : 0.f};
  }
#endif
};

// Q5_0 and Q5_1: Q4's nibbles plus a fifth bit from qh.
template <bool kMin>
struct Q5Block {
  static constexpr int64_t kWeights = 32, kBytes = kMin ? 24 : 22;
  static constexpr bool kOffset = kMin;
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b), off = kMin ? f16_at(b + 2) : -16.f * d;
    const uint32_t qh = u32_at(b + (kMin ? 4 : 2));
    const uint8_t* q = b + (kMin ? 8 : 6);
    for (int j = 0; j < 16; ++j) {
      const int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo) + off;
      w[j + 16] = d * static_cast<float>(hi) + off;
    }
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b);
    __m256i codes = _mm256_or_si256(nibbles32(b + (kMin ? 8 : 6)),
                                    bits_to_bytes(u32_at(b + (kMin ? 4 : 2)), 0x10));
    if (!kMin) codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(16));
    return {codes, d, d, kMin ? f16_at(b + 2) : 0.f};
  }
#endif
};

struct Q8Block {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static constexpr bool kOffset = false;
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b);
    return {load32(b + 2), d, d, 0.f};
  }
#endif
};

// Q4_K (kHigh false) and Q5_K (kHigh true).
template <bool kHigh>
struct QKBlock {
  static constexpr int64_t kWeights = 256, kBytes = kHigh ? 176 : 144;
  static constexpr bool kOffset = true;
  // Sub-block s's block, scale and offset; its 32 code bytes and (Q5_K) high-bit bytes.
  static const uint8_t* parts(const uint8_t* row, int64_t s, float& scale, float& offset,
                              const uint8_t*& qh) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int64_t j = s % 8;
    int sc, m;
    k_scale_min(b + 4, j, sc, m);
    scale = f16_at(b) * static_cast<float>(sc);
    offset = -(f16_at(b + 2) * static_cast<float>(m));
    qh = b + 16;
    return b + (kHigh ? 48 : 16) + 32 * (j / 2);
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    float scale, offset;
    const uint8_t* qh;
    const uint8_t* q = parts(row, s, scale, offset, qh);
    const int shift = (s % 2) * 4, j = static_cast<int>(s % 8);
    for (int e = 0; e < 32; ++e) {
      int code = (q[e] >> shift) & 0x0F;
      if (kHigh) code |= ((qh[e] >> j) & 1) << 4;
      w[e] = scale * static_cast<float>(code) + offset;
    }
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    float scale, offset;
    const uint8_t* qh;
    const uint8_t* q = parts(row, s, scale, offset, qh);
    __m256i codes = byte_field(load32(q), static_cast<int>((s % 2) * 4), 0x0F);
    if (kHigh)
      codes = _mm256_or_si256(
          codes, _mm256_slli_epi16(byte_field(load32(qh), static_cast<int>(s % 8), 0x01), 4));
    return {codes, scale, scale, offset};
  }
  // f(first + j, sub-block j) for the 8 sub-blocks of the block at b.
  template <typename F>
  static void visit_block(const uint8_t* b, F& f, int64_t first) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* qs = b + (kHigh ? 48 : 16);
    const __m256i qh = kHigh ? load32(b + 16) : _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k_scale_min(b + 4, j, sc, m);
      __m256i codes = byte_field(load32(qs + 32 * (j / 2)), (j % 2) * 4, 0x0F);
      if (kHigh) codes = _mm256_or_si256(codes, _mm256_slli_epi16(byte_field(qh, j, 0x01), 4));
      const float scale = d * static_cast<float>(sc);
      f(first + j, Sub{codes, scale, scale, -(dmin * static_cast<float>(m))});
    }
  }
#endif
};

struct Q6KBlock {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static constexpr bool kOffset = false;
  // Sub-block s: its low-bit bytes, high-bit bytes, nibble and high-bit shifts, and the two
  // scales (d sc) of its halves.
  static const uint8_t* parts(const uint8_t* row, int64_t s, const uint8_t*& qh, int& nshift,
                              int& hshift, float& s0, float& s1) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int64_t h = (s % 8) / 4, t = s % 4;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * t;
    const float d = f16_at(b + 208);
    s0 = d * static_cast<float>(sc[0]);
    s1 = d * static_cast<float>(sc[1]);
    nshift = t >= 2 ? 4 : 0;
    hshift = static_cast<int>(2 * t);
    qh = b + 128 + 32 * h;
    return b + 64 * h + 32 * (t & 1);
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* qh;
    int nshift, hshift;
    float s0, s1;
    const uint8_t* ql = parts(row, s, qh, nshift, hshift, s0, s1);
    for (int e = 0; e < 32; ++e) {
      const int code = ((ql[e] >> nshift) & 0x0F) | (((qh[e] >> hshift) & 3) << 4);
      w[e] = (e < 16 ? s0 : s1) * static_cast<float>(code - 32);
    }
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* qh;
    int nshift, hshift;
    float s0, s1;
    const uint8_t* ql = parts(row, s, qh, nshift, hshift, s0, s1);
    const __m256i hi = _mm256_slli_epi16(byte_field(load32(qh), hshift, 0x03), 4);
    const __m256i codes = _mm256_or_si256(byte_field(load32(ql), nshift, 0x0F), hi);
    return {_mm256_sub_epi8(codes, _mm256_set1_epi8(32)), s0, s1, 0.f};
  }
  // f(first + s, sub-block s) for the 8 sub-blocks of the block at b.
  template <typename F>
  static void visit_block(const uint8_t* b, F& f, int64_t first) {
    const float d = f16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = load32(b + 128 + 32 * h);
      for (int t = 0; t < 4; ++t) {
        const __m256i lo = byte_field(load32(b + 64 * h + 32 * (t & 1)), t >= 2 ? 4 : 0, 0x0F);
        const __m256i hi = _mm256_slli_epi16(byte_field(qh, 2 * t, 0x03), 4);
        const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        const int8_t* s2 = sc + 8 * h + 2 * t;
        f(first + 4 * h + t, Sub{codes, d * static_cast<float>(s2[0]),
                                 d * static_cast<float>(s2[1]), 0.f});
      }
    }
  }
#endif
};

// Q2_K (84 B): scales[16], qs[64], d, dmin: 16 groups of 16 weights, group i with a 4-bit scale
// sc_i (low nibble of scales[i]) and min m_i (high nibble), 2-bit codes q; w = (d sc_i) q -
// (dmin m_i). Sub-block s = 4h + t: bits 2t, 2t + 1 of qs[32h + e]; its halves groups 2s, 2s + 1,
// so its two offsets differ (kHalfOffsets).
struct Q2KBlock {
  static constexpr int64_t kWeights = 256, kBytes = 84;
  static constexpr bool kOffset = true;
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int j8 = static_cast<int>(s % 8), h = j8 / 4, t = j8 % 4;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int e = 0; e < 32; ++e) {
      const uint8_t sc = b[2 * j8 + e / 16];
      const int code = (b[16 + 32 * h + e] >> (2 * t)) & 3;
      w[e] = d * static_cast<float>(sc & 0x0F) * static_cast<float>(code) -
             dmin * static_cast<float>(sc >> 4);
    }
  }
#ifdef RS_AVX2
  // f(first + s, sub-block s) for the 8 sub-blocks of the block at b.
  template <typename F>
  static void visit_block(const uint8_t* b, F& f, int64_t first) {
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    // The scales copied, not read in place: read in place, GCC 12 dropped every call of
    // dequant_block_rows<Q2KBlock> from its parallel loops (test_kernel_dequantization_equals_gguf
    // caught it).
    uint8_t sc[16];
    std::memcpy(sc, b, 16);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 16 + 32 * h);
      for (int t = 0; t < 4; ++t) {
        const int s = 4 * h + t;
        const int lo = sc[2 * s], hi = sc[2 * s + 1];
        f(first + s, Sub{byte_field(qs, 2 * t, 0x03), d * static_cast<float>(lo & 0x0F),
                         d * static_cast<float>(hi & 0x0F), -(dmin * static_cast<float>(lo >> 4)),
                         -(dmin * static_cast<float>(hi >> 4))});
      }
    }
  }
#endif
};

// Q3_K: 16 groups of 16 weights with 6-bit scales sc (stored + 32), 3-bit codes q - 4 (two
// low bits in qs, the third in hmask); w = d sc (q - 4). Sub-block s = 4h + j: bits 2j, 2j + 1
// of qs[32h + e] and bit s of hmask[e]; its halves' scales sc[2s], sc[2s + 1].
struct Q3KBlock {
  static constexpr int64_t kWeights = 256, kBytes = 110;
  static constexpr bool kOffset = false;
  // The 16 scales minus 32 (their 4 low bits in bytes 0-7, 2 high bits in bytes 8-11).
  static void scales(const uint8_t* b, int8_t* sc) {
    uint32_t a[4];
    std::memcpy(a, b + 96, 12);
    const uint32_t tmp = a[2], lo4 = 0x0F0F0F0F, hi2 = 0x03030303;
    a[2] = ((a[0] >> 4) & lo4) | (((tmp >> 4) & hi2) << 4);
    a[3] = ((a[1] >> 4) & lo4) | (((tmp >> 6) & hi2) << 4);
    a[0] = (a[0] & lo4) | ((tmp & hi2) << 4);
    a[1] = (a[1] & lo4) | (((tmp >> 2) & hi2) << 4);
    std::memcpy(sc, a, 16);
    for (int i = 0; i < 16; ++i) sc[i] = static_cast<int8_t>(sc[i] - 32);
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int j8 = static_cast<int>(s % 8), h = j8 / 4, j = j8 % 4;
    int8_t sc[16];
    scales(b, sc);
    const float d = f16_at(b + 108);
    for (int e = 0; e < 32; ++e) {
      const int code = ((b[32 + 32 * h + e] >> (2 * j)) & 3) + 4 * ((b[e] >> j8) & 1) - 4;
      w[e] = d * static_cast<float>(sc[2 * j8 + e / 16]) * static_cast<float>(code);
    }
  }
#ifdef RS_AVX2
  // `scales` in one vector, 16 int8 (the row dots read them so: no store and reload).
  static __m128i scales16(const uint8_t* b) {
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 96));
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(a, lo4),
                                               _mm_and_si128(_mm_srli_epi32(a, 4), lo4));
    const __m128i high = _mm_set1_epi32(static_cast<int>(u32_at(b + 104)));  // 2 bits each
    const __m128i top =
        _mm_and_si128(_mm_srlv_epi32(high, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(0x03));
    return _mm_sub_epi8(_mm_or_si128(nibbles, _mm_slli_epi32(top, 4)), _mm_set1_epi8(32));
  }
  // f(first + s, sub-block s) for the 8 sub-blocks of the block at b (its scales read once;
  // visit_subs takes this, and no per-call panel packs Q3_K, so there is no `sub`).
  template <typename F>
  static void visit_block(const uint8_t* b, F& f, int64_t first) {
    int8_t sc[16];
    scales(b, sc);
    const float d = f16_at(b + 108);
    const __m256i hmask = load32(b);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = load32(b + 32 + 32 * h);
      for (int j = 0; j < 4; ++j) {
        const int s = 4 * h + j;
        const __m256i low = byte_field(qs, 2 * j, 0x03);
        const __m256i high = _mm256_slli_epi16(byte_field(hmask, s, 0x01), 2);
        f(first + s, Sub{_mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(4)),
                         d * static_cast<float>(sc[2 * s]), d * static_cast<float>(sc[2 * s + 1]),
                         0.f});
      }
    }
  }
#endif
};

// IQ4_NL and IQ4_XS: 4-bit indices into one fixed table of 16 int8 values (kIq4Values, denser
// near 0 as a normal distribution's weights are), nibbles laid out as Q4_0's (byte e's low
// nibble is weight e, its high nibble weight e + 16); w = scale kIq4Values[q], so the table's
// values are the Sub form's signed codes and a vpshufb makes them.
//   IQ4_NL (18 B): d, qs[16]: scale d.
//   IQ4_XS (136 B): d, scales_h (uint16), scales_l[4], qs[128]: sub-block j's 6-bit scale ls_j
//     has nibble j % 2 of scales_l[j / 2] as its low bits, bits 2j, 2j + 1 of scales_h as its
//     high ones; scale d (ls_j - 32); its codes the 16 bytes at 8 + 16j.
alignas(16) inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};

// The 32 weights scale kIq4Values[q] of the 16 nibble bytes at q, into w.
inline void iq4_scalar(const uint8_t* q, float scale, float* w) {
  for (int e = 0; e < 16; ++e) {
    w[e] = scale * static_cast<float>(kIq4Values[q[e] & 0x0F]);
    w[e + 16] = scale * static_cast<float>(kIq4Values[q[e] >> 4]);
  }
}

#ifdef RS_AVX2
// The 16 nibble bytes at q as their 32 table values (signed codes).
inline __m256i iq4_codes(const uint8_t* q) {
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  return _mm256_shuffle_epi8(table, nibbles32(q));
}
#endif

struct IQ4NLBlock {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static constexpr bool kOffset = false;
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + s * kBytes;
    iq4_scalar(b + 2, f16_at(b), w);
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + s * kBytes;
    const float d = f16_at(b);
    return {iq4_codes(b + 2), d, d, 0.f};
  }
#endif
};

struct IQ4XSBlock {
  static constexpr int64_t kWeights = 256, kBytes = 136;
  static constexpr bool kOffset = false;
  // Sub-block j's ls_j - 32.
  static int scale(const uint8_t* b, int64_t j) {
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    const int low = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
    return (low | (((high >> (2 * j)) & 3) << 4)) - 32;
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int64_t j = s % 8;
    iq4_scalar(b + 8 + 16 * j, f16_at(b) * static_cast<float>(scale(b, j)), w);
  }
#ifdef RS_AVX2
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const int64_t j = s % 8;
    const float dl = f16_at(b) * static_cast<float>(scale(b, j));
    return {iq4_codes(b + 8 + 16 * j), dl, dl, 0.f};
  }
  // f(first + j, sub-block j) for the 8 sub-blocks of the block at b (d read once).
  template <typename F>
  static void visit_block(const uint8_t* b, F& f, int64_t first) {
    const float d = f16_at(b);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(scale(b, j));
      f(first + j, Sub{iq4_codes(b + 8 + 16 * j), dl, dl, 0.f});
    }
  }
#endif
};

// The i-quants of 2 and 3 bits (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): each run of 8 (IQ2)
// or 4 (IQ3) weights is an entry of a fixed grid of magnitudes, each weight has a sign, and a
// scale serves 16 or 32 weights: weight = scale * grid[index][k] * sign. The grids are the
// gguf package's (set_iq_grids, from kernels/__init__.py when the kernels load). IQ2_XXS,
// IQ2_XS and IQ3_XXS store 7 sign bits per 8 weights, the eighth their parity (kIqSigns);
// IQ2_S and IQ3_S a sign bit a weight (kStoredSigns).
// A sub-block's codes are grid * sign as signed bytes (|code| <= 62). Each format reads a
// sub-block's grid `indices`, sign bits (`signs`; AVX2: `sign_bytes`, -1 / 1 a weight) and the
// scales of its two halves of 16 weights (`scales`; AVX2: a block's 16 at once,
// `block_scales`); IqBlock makes the 32 magnitudes (`grid_bytes`; AVX2: `magnitudes`).
struct IqGrids {
  alignas(64) uint8_t iq2xxs[256 * 8], iq2xs[512 * 8], iq2s[1024 * 8], iq3xxs[256 * 4],
      iq3s[512 * 4];
  bool set = false;
};
inline IqGrids g_iq_grids;

// Byte i: the 7 sign bits i and their parity as the eighth.
inline constexpr auto kIqSigns = [] {
  std::array<uint8_t, 128> t{};
  for (int i = 0; i < 128; ++i) t[i] = static_cast<uint8_t>(i | ((__builtin_popcount(i) & 1) << 7));
  return t;
}();

#ifdef RS_AVX2
// Entry i: the 8 signs of kIqSigns[i] as bytes -1 / 1 (for _mm256_sign_epi8).
inline constexpr auto kIqSignBytes = [] {
  std::array<int64_t, 128> t{};
  for (int i = 0; i < 128; ++i) {
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k)
      v |= static_cast<uint64_t>((kIqSigns[i] >> k) & 1 ? 0xFF : 0x01) << (8 * k);
    t[i] = static_cast<int64_t>(v);
  }
  return t;
}();

// The sign bytes of 32 weights whose signs are four 7-bit fields a, b, c, d.
inline __m256i iq_sign_bytes7(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return _mm256_setr_epi64x(kIqSignBytes[a & 127], kIqSignBytes[b & 127], kIqSignBytes[c & 127],
                            kIqSignBytes[d & 127]);
}

// The same for the four 7-bit fields of the word at p (bits 0, 7, 14, 21; IQ2_XXS, IQ3_XXS).
inline __m256i iq_sign_bytes7(const uint8_t* p) {
  const uint32_t a = u32_at(p);
  return iq_sign_bytes7(a, a >> 7, a >> 14, a >> 21);
}

// The sign bytes of 32 weights whose signs are the 32 bits of `bits`.
inline __m256i iq_sign_bytes32(uint32_t bits) {
  return _mm256_or_si256(bits_to_bytes(bits, static_cast<char>(-1)), _mm256_set1_epi8(1));
}

// A block's 16 half scales in sub-block order (s0_0, s1_0, s0_1, ...) from 16 integers v
// (int32, 8 a vector) as (v + add) * mul.
inline void iq_half_scales(__m256i v0, __m256i v1, float add, float mul, float* sc) {
  const __m256 a = _mm256_set1_ps(add), m = _mm256_set1_ps(mul);
  __m256 s0 = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(v0), a), m);
  __m256 s1 = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(v1), a), m);
  asm("" : "+x"(s0), "+x"(s1));  // rounded here, whatever the caller's rows (row_dot_q8)
  _mm256_storeu_ps(sc, s0);
  _mm256_storeu_ps(sc + 8, s1);
}

// The low 8 bytes of b as their 16 nibbles, low first (byte i's at 2i and 2i + 1).
inline __m128i iq_nibble_bytes(__m128i b) {
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, lo4), _mm_and_si128(_mm_srli_epi16(b, 4), lo4));
}

// 8 bytes of nibbles at p (a nibble per 16 weights, low first) as 16 int32, 8 a vector.
inline void iq_nibbles16(const uint8_t* p, __m256i& v0, __m256i& v1) {
  const __m128i n = iq_nibble_bytes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v0 = _mm256_cvtepu8_epi32(n);
  v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(n, 8));
}

// 8 int32 values of sub-blocks 0..7 as 16, each twice (both halves' scale).
inline void iq_twice(__m256i v, __m256i& v0, __m256i& v1) {
  v0 = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  v1 = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}
#endif

// The sign bits of 32 weights from four 7-bit fields of `bits` (at 0, 7, 14, 21) or of four
// 16-bit words' top 7 bits (IQ2_XS).
inline uint32_t iq_signs4(uint32_t bits) {
  return kIqSigns[bits & 127] | kIqSigns[(bits >> 7) & 127] << 8 |
         kIqSigns[(bits >> 14) & 127] << 16 |
         static_cast<uint32_t>(kIqSigns[(bits >> 21) & 127]) << 24;
}

// IQ2_XXS, 66 bytes: d; per sub-block j two words at 2 + 8j: 4 grid indices, then 4 x 7 sign
// bits and a 4-bit scale (top): scale d (0.5 + s) / 4.
struct IQ2XXSFormat {
  static constexpr int64_t kBytes = 66, kEntry = 8;
  static constexpr bool kStoredSigns = false;
  static const uint8_t* grid() { return g_iq_grids.iq2xxs; }
  static void scales(float d, const uint8_t* b, int64_t j, float& s0, float& s1) {
    s0 = s1 = d * (0.5f + static_cast<float>(u32_at(b + 6 + 8 * j) >> 28)) * 0.25f;
  }
  static void indices(const uint8_t* b, int64_t j, int* idx) {
    for (int l = 0; l < 4; ++l) idx[l] = b[2 + 8 * j + l];
  }
  static uint32_t signs(const uint8_t* b, int64_t j) { return iq_signs4(u32_at(b + 6 + 8 * j)); }
#ifdef RS_AVX2
  // The block's 16 half scales (scales' for j = 0..7) at once.
  static void block_scales(float d, const uint8_t* b, float* sc) {
    // the second word of each sub-block's pair: lanes 1, 3, 5, 7 of the two halves' 32 bytes
    const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    const __m256i lo = _mm256_permutevar8x32_epi32(load32(b + 2), odd);
    const __m256i hi = _mm256_permutevar8x32_epi32(load32(b + 34), odd);
    __m256i v0, v1;
    iq_twice(_mm256_srli_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), 28), v0, v1);
    iq_half_scales(v0, v1, 0.5f, 0.25f * d, sc);
  }
  static __m256i sign_bytes(const uint8_t* b, int64_t j) { return iq_sign_bytes7(b + 6 + 8 * j); }
#endif
};

// IQ2_XS, 74 bytes: d; 32 16-bit words at 2 (9 bits of grid index, 7 sign bits: 8 weights
// each); 8 scale bytes at 66, a nibble per 16 weights (low first): scale d (0.5 + s) / 4.
struct IQ2XSFormat {
  static constexpr int64_t kBytes = 74, kEntry = 8;
  static constexpr bool kStoredSigns = false;
  static const uint8_t* grid() { return g_iq_grids.iq2xs; }
  static void scales(float d, const uint8_t* b, int64_t j, float& s0, float& s1) {
    s0 = d * (0.5f + static_cast<float>(b[66 + j] & 15)) * 0.25f;
    s1 = d * (0.5f + static_cast<float>(b[66 + j] >> 4)) * 0.25f;
  }
  static uint16_t word(const uint8_t* b, int64_t j, int l) {
    uint16_t v;
    std::memcpy(&v, b + 2 + 2 * (4 * j + l), 2);
    return v;
  }
  static void indices(const uint8_t* b, int64_t j, int* idx) {
    for (int l = 0; l < 4; ++l) idx[l] = word(b, j, l) & 511;
  }
  static uint32_t signs(const uint8_t* b, int64_t j) {
    uint32_t bits = 0;
    for (int l = 0; l < 4; ++l) bits |= static_cast<uint32_t>(word(b, j, l) >> 9) << (7 * l);
    return iq_signs4(bits);
  }
#ifdef RS_AVX2
  static void block_scales(float d, const uint8_t* b, float* sc) {
    __m256i v0, v1;
    iq_nibbles16(b + 66, v0, v1);
    iq_half_scales(v0, v1, 0.5f, 0.25f * d, sc);
  }
  static __m256i sign_bytes(const uint8_t* b, int64_t j) {
    return iq_sign_bytes7(word(b, j, 0) >> 9, word(b, j, 1) >> 9, word(b, j, 2) >> 9,
                          word(b, j, 3) >> 9);
  }
#endif
};

// IQ2_S, 82 bytes: d; 32 index bytes at 2 (low 8 bits), 32 sign bytes at 34 (a bit a weight),
// 8 bytes at 66 of the indices' high 2 bits (4 a byte), 8 scale bytes at 74 as IQ2_XS's.
struct IQ2SFormat {
  static constexpr int64_t kBytes = 82, kEntry = 8;
  static constexpr bool kStoredSigns = true;
  static const uint8_t* grid() { return g_iq_grids.iq2s; }
  static void scales(float d, const uint8_t* b, int64_t j, float& s0, float& s1) {
    s0 = d * (0.5f + static_cast<float>(b[74 + j] & 15)) * 0.25f;
    s1 = d * (0.5f + static_cast<float>(b[74 + j] >> 4)) * 0.25f;
  }
  static void indices(const uint8_t* b, int64_t j, int* idx) {
    for (int l = 0; l < 4; ++l) idx[l] = b[2 + 4 * j + l] | (((b[66 + j] >> (2 * l)) & 3) << 8);
  }
  static uint32_t signs(const uint8_t* b, int64_t j) { return u32_at(b + 34 + 4 * j); }
#ifdef RS_AVX512
  // The 8 indices of sub-blocks 2v and 2v + 1, one a 64-bit lane.
  static __m512i vindices64(const uint8_t* b, int64_t v) {
    const __m512i low =
        _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v)));
    const __m512i top = _mm512_srlv_epi64(_mm512_set1_epi64(b[66 + 2 * v] | b[67 + 2 * v] << 8),
                                          _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14));
    return _mm512_or_si512(low, _mm512_slli_epi64(_mm512_and_si512(top, _mm512_set1_epi64(3)), 8));
  }
#endif
#ifdef RS_AVX2
  static void block_scales(float d, const uint8_t* b, float* sc) {
    __m256i v0, v1;
    iq_nibbles16(b + 74, v0, v1);
    iq_half_scales(v0, v1, 0.5f, 0.25f * d, sc);
  }
  static __m256i sign_bytes(const uint8_t* b, int64_t j) { return iq_sign_bytes32(signs(b, j)); }
#endif
};

// IQ3_XXS, 98 bytes: d; 64 grid indices at 2 (4 weights each); a word per sub-block at 66 + 4j
// of 4 x 7 sign bits and a 4-bit scale (top): scale d (0.5 + s) / 2.
struct IQ3XXSFormat {
  static constexpr int64_t kBytes = 98, kEntry = 4;
  static constexpr bool kStoredSigns = false;
  static const uint8_t* grid() { return g_iq_grids.iq3xxs; }
  static void scales(float d, const uint8_t* b, int64_t j, float& s0, float& s1) {
    s0 = s1 = d * (0.5f + static_cast<float>(u32_at(b + 66 + 4 * j) >> 28)) * 0.5f;
  }
  static void indices(const uint8_t* b, int64_t j, int* idx) {
    for (int i = 0; i < 8; ++i) idx[i] = b[2 + 8 * j + i];
  }
  static uint32_t signs(const uint8_t* b, int64_t j) { return iq_signs4(u32_at(b + 66 + 4 * j)); }
#ifdef RS_AVX2
  static void block_scales(float d, const uint8_t* b, float* sc) {
    __m256i v0, v1;
    iq_twice(_mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 66)), 28),
             v0, v1);
    iq_half_scales(v0, v1, 0.5f, 0.5f * d, sc);
  }
  static __m256i sign_bytes(const uint8_t* b, int64_t j) { return iq_sign_bytes7(b + 66 + 4 * j); }
#endif
};

// IQ3_S, 110 bytes: d; 64 index bytes at 2 (low 8 bits; 4 weights each), 8 bytes at 66 of
// their ninth bits (8 a byte), 32 sign bytes at 74, 4 scale bytes at 106 (a nibble per
// sub-block, low first): scale d (1 + 2 s).
struct IQ3SFormat {
  static constexpr int64_t kBytes = 110, kEntry = 4;
  static constexpr bool kStoredSigns = true;
  static const uint8_t* grid() { return g_iq_grids.iq3s; }
  static void scales(float d, const uint8_t* b, int64_t j, float& s0, float& s1) {
    const int sc = (b[106 + j / 2] >> (4 * (j % 2))) & 15;
    s0 = s1 = d * static_cast<float>(1 + 2 * sc);
  }
  static void indices(const uint8_t* b, int64_t j, int* idx) {
    for (int i = 0; i < 8; ++i) idx[i] = b[2 + 8 * j + i] | (((b[66 + j] >> i) & 1) << 8);
  }
  static uint32_t signs(const uint8_t* b, int64_t j) { return u32_at(b + 74 + 4 * j); }
#ifdef RS_AVX2
  static void block_scales(float d, const uint8_t* b, float* sc) {
    // the block's last 4 bytes: a nibble per sub-block
    const __m256i sub = _mm256_cvtepu8_epi32(
        iq_nibble_bytes(_mm_cvtsi32_si128(static_cast<int>(u32_at(b + 106)))));
    __m256i v0, v1;
    iq_twice(sub, v0, v1);
    iq_half_scales(_mm256_slli_epi32(v0, 1), _mm256_slli_epi32(v1, 1), 1.f, d, sc);
  }
  static __m256i sign_bytes(const uint8_t* b, int64_t j) { return iq_sign_bytes32(signs(b, j)); }
  // The 8 indices at once (IqBlock::magnitudes then gathers their entries).
  static __m256i vindices(const uint8_t* b, int64_t j) {
    const __m256i low =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j)));
    const __m256i ninth = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(b[66 + j]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        _mm256_set1_epi32(1));
    return _mm256_or_si256(low, _mm256_slli_epi32(ninth, 8));
  }
#endif
};

template <typename F>
struct IqBlock {
  using Format = F;
  static constexpr int64_t kWeights = 256, kBytes = Format::kBytes;
  static constexpr bool kOffset = false;
  // The 32 magnitudes of sub-block j of the block at b.
  static void grid_bytes(const uint8_t* b, int64_t j, uint8_t* g) {
    int idx[8];
    Format::indices(b, j, idx);
    for (int i = 0; i < 32 / Format::kEntry; ++i)
      std::memcpy(g + Format::kEntry * i, Format::grid() + Format::kEntry * idx[i], Format::kEntry);
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    const uint8_t* b = row + (s / 8) * kBytes;
    uint8_t g[32];
    grid_bytes(b, s % 8, g);
    float s0, s1;
    Format::scales(f16_at(b), b, s % 8, s0, s1);
    const uint32_t signs = Format::signs(b, s % 8);
    for (int e = 0; e < 32; ++e)
      w[e] = (e < 16 ? s0 : s1) * ((signs >> e) & 1u ? -1.f : 1.f) * static_cast<float>(g[e]);
  }
#ifdef RS_AVX2
  // Sub-block j's 32 magnitudes (unsigned bytes): the grid entries gathered where the format
  // makes its indices in a vector (IQ3_S, whose ninth bits lie apart), else loaded one by one
  // (on Zen 5, 8192 x 2048 one row: IQ3_XXS 1.37 ms gathered against 0.75, IQ2_S's four
  // 8-byte entries 1.21 against 1.14; IQ3_S 0.88 against 1.00).
  static __m256i magnitudes(const uint8_t* b, int64_t j) {
    if constexpr (requires { Format::vindices(b, j); })  // 4-byte entries
      return _mm256_i32gather_epi32(reinterpret_cast<const int*>(Format::grid()),
                                    Format::vindices(b, j), 4);
    int idx[8];
    Format::indices(b, j, idx);
    if constexpr (Format::kEntry == 4) {
      const auto* g = reinterpret_cast<const int*>(Format::grid());
      return _mm256_setr_epi32(g[idx[0]], g[idx[1]], g[idx[2]], g[idx[3]], g[idx[4]], g[idx[5]],
                               g[idx[6]], g[idx[7]]);
    } else {
      const auto* g = reinterpret_cast<const long long*>(Format::grid());
      return _mm256_setr_epi64x(g[idx[0]], g[idx[1]], g[idx[2]], g[idx[3]]);
    }
  }
#ifdef RS_AVX512
  // Sub-blocks 2v and 2v + 1's 64 magnitudes; with `kVectorIndices`, IQ2_S's 8 indices made
  // in one vector (two 10-bit parts) and its entries read by them, else `magnitudes`' twice.
  // Vector indices take IQ2_S's row dot on Zen 5 (8192 x 2048) from 0.49 to 0.43-0.45 ms for
  // one input row, and from 0.97-0.98 to 1.10 ms for 8 (gathering the 8 entries: 0.52, 1.12).
  template <bool kVectorIndices>
  static __m512i magnitudes64(const uint8_t* b, int64_t v) {
    if constexpr (kVectorIndices && requires { Format::vindices64(b, v); }) {
      alignas(64) int64_t idx[8];
      _mm512_store_si512(idx, Format::vindices64(b, v));
      const auto* g = reinterpret_cast<const long long*>(Format::grid());
      __m128i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm_insert_epi64(_mm_cvtsi64_si128(g[idx[2 * i]]), g[idx[2 * i + 1]], 1);
      const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(q[0]), q[1], 1);
      const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(q[2]), q[3], 1);
      return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(magnitudes(b, 2 * v)),
                              magnitudes(b, 2 * v + 1), 1);
  }
#endif
  // Sub-block j's signs as bytes -1 / 1 (for _mm256_sign_epi8).
  static __m256i sign_bytes(const uint8_t* b, int64_t j) { return Format::sign_bytes(b, j); }
  // Sub-block j's sign bits (bit e: weight e negative), from the sign bytes where the format
  // keeps 7 bits and a parity (the table's lookups beat assembling the bits one by one).
  static uint32_t sign_mask(const uint8_t* b, int64_t j) {
    if constexpr (Format::kStoredSigns)
      return Format::signs(b, j);
    else
      return static_cast<uint32_t>(_mm256_movemask_epi8(Format::sign_bytes(b, j)));
  }
  static Sub sub(const uint8_t* row, int64_t s) {
    const uint8_t* b = row + (s / 8) * kBytes;
    const __m256i codes = _mm256_sign_epi8(magnitudes(b, s % 8), sign_bytes(b, s % 8));
    float s0, s1;
    Format::scales(f16_at(b), b, s % 8, s0, s1);
    return {codes, s0, s1, 0.f};
  }
#endif
};

template <typename B>
inline constexpr bool kIqGridBlock = false;
template <typename F>
inline constexpr bool kIqGridBlock<IqBlock<F>> = true;

// Copies the five grids in (uint8 [entries, 4 or 8] each, the values gguf.quants' `grid`s hold).
void set_iq_grids(const at::Tensor& iq2xxs, const at::Tensor& iq2xs, const at::Tensor& iq2s,
                  const at::Tensor& iq3xxs, const at::Tensor& iq3s) {
  IqGrids& g = g_iq_grids;
  const auto put = [](const at::Tensor& t, uint8_t* dst, int64_t n, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == n,
                "set_iq_grids: ", name, " must be ", n, " bytes");
    std::memcpy(dst, t.data_ptr<uint8_t>(), n);
  };
  put(iq2xxs, g.iq2xxs, sizeof g.iq2xxs, "iq2xxs");
  put(iq2xs, g.iq2xs, sizeof g.iq2xs, "iq2xs");
  put(iq2s, g.iq2s, sizeof g.iq2s, "iq2s");
  put(iq3xxs, g.iq3xxs, sizeof g.iq3xxs, "iq3xxs");
  put(iq3s, g.iq3s, sizeof g.iq3s, "iq3s");
  g.set = true;
}

using IQ2XXSBlock = IqBlock<IQ2XXSFormat>;
using IQ2XSBlock = IqBlock<IQ2XSFormat>;
using IQ2SBlock = IqBlock<IQ2SFormat>;
using IQ3XXSBlock = IqBlock<IQ3XXSFormat>;
using IQ3SBlock = IqBlock<IQ3SFormat>;

// F16 and BF16, GGUF's unquantized matrices (2 bytes a weight): read 32 weights at a time as
// the formats above, but with no codes or scales, so no Sub form: the float32 kernels convert
// them as they read (kFloatBlock: dequant_block_rows, half_rows_small).
template <bool kBF16>
struct HalfBlock {
  static constexpr int64_t kWeights = 32, kBytes = 64;
  static constexpr bool kOffset = false;
  static float value(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    if constexpr (kBF16) {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    } else {
      return f16_at(p);
    }
  }
  static void scalar(const uint8_t* row, int64_t s, float* w) {
    for (int e = 0; e < 32; ++e) w[e] = value(row + s * kBytes + 2 * e);
  }
#ifdef RS_AVX2
  // The 8 weights at p as float32.
  static __m256 load8(const uint8_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kBF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);
  }
#endif
#ifdef RS_AVX512
  // The 16 weights at p as float32.
  static __m512 load16(const uint8_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kBF16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
#endif
};

template <typename B>
inline constexpr bool kFloatBlock = false;
template <bool kBF16>
inline constexpr bool kFloatBlock<HalfBlock<kBF16>> = true;
// Formats whose sub-blocks' two halves have offsets of their own (Sub's off, off1): their
// offsets meet sums of the input over 16 weights, not 32.
template <typename B>
inline constexpr bool kHalfOffsets = std::is_same_v<B, Q2KBlock>;

#ifdef RS_AVX2
// f(s, sub-block s) for every sub-block of a row of K weights, in order. Formats of 256-weight
// super-blocks read each block's header (its float16 scales) once rather than per sub-block.
template <typename B, typename F>
inline void visit_subs(const uint8_t* row, int64_t K, F&& f) {
  if constexpr (requires { B::visit_block(row, f, 0); }) {
    for (int64_t b = 0; b < K / B::kWeights; ++b) B::visit_block(row + b * B::kBytes, f, 8 * b);
  } else {
    for (int64_t s = 0; s < K / 32; ++s) f(s, B::sub(row, s));
  }
}
#endif

// f(Block{}) for the block format of GGML type `kind`; false where it is none of ours.
template <typename F>
bool with_block(int64_t kind, F&& f) {
  switch (kind) {
    case kQ4_0: f(Q4Block<false>{}); return true;
    case kQ4_1: f(Q4Block<true>{}); return true;
    case kQ5_0: f(Q5Block<false>{}); return true;
    case kQ5_1: f(Q5Block<true>{}); return true;
    case kQ8_0: f(Q8Block{}); return true;
    case kQ2_K: f(Q2KBlock{}); return true;
    case kQ3_K: f(Q3KBlock{}); return true;
    case kQ4_K: f(QKBlock<false>{}); return true;
    case kQ5_K: f(QKBlock<true>{}); return true;
    case kQ6_K: f(Q6KBlock{}); return true;
    case kIQ4_NL: f(IQ4NLBlock{}); return true;
    case kIQ4_XS: f(IQ4XSBlock{}); return true;
    case kIQ2_XXS: f(IQ2XXSBlock{}); return true;
    case kIQ2_XS: f(IQ2XSBlock{}); return true;
    case kIQ2_S: f(IQ2SBlock{}); return true;
    case kIQ3_XXS: f(IQ3XXSBlock{}); return true;
    case kIQ3_S: f(IQ3SBlock{}); return true;
    case kF16: f(HalfBlock<false>{}); return true;
    case kBF16: f(HalfBlock<true>{}); return true;
    default: return false;
  }
}

// Rows [n, n + nr) of a part (rows of `row_bytes` from `blocks`) dequantized into buf [nr, K].
template <typename B>
void dequant_block_rows(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t nr,
                        int64_t K, float* buf) {
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* row = blocks + (n + r) * row_bytes;
    float* o = buf + r * K;
#ifdef RS_AVX2
    if constexpr (kFloatBlock<B>) {
      for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(o + k, B::load8(row + 2 * k));
    } else {
      visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
        __m256 w[4];
        weights(u, w);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 32 * s + 8 * j, w[j]);
      });
    }
#else
    for (int64_t s = 0; s < K / 32; ++s) B::scalar(row, s, o + 32 * s);
#endif
  }
}

#ifdef RS_AVX2
// acc[r] += 32 weights w[0..3] times x's 32 floats from xs + r * K, for MR rows: even vectors
// into acc[r][0], odd into acc[r][1] (two chains of FMAs; row_dot's and half_row_dot's order).
template <int MR>
inline void fma_rows32(const __m256* w, const float* xs, int64_t K, __m256 (&acc)[MR][2]) {
  RS_UNROLL for (int r = 0; r < MR; ++r) {
    const float* xr = xs + r * K;
    acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
    acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
  }
}

// out[r * ldo] = x[r] . row for 2 <= MR input rows (x rows K apart), the row's weights made in
// registers one sub-block at a time and used by every input row (AVX-512: 16 lanes, half the
// FMAs).
template <typename B, int MR>
inline void row_dot(const float* x, int64_t K, const uint8_t* row, float* out, int64_t ldo) {
#ifdef RS_AVX512
  __m512 acc[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    const __m512 off = _mm512_set1_ps(u.off);
    const __m512 w0 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(u.codes))),
        _mm512_set1_ps(u.s0), off);
    const __m512 w1 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(u.codes, 1))),
        _mm512_set1_ps(u.s1), kHalfOffsets<B> ? _mm512_set1_ps(u.off1) : off);
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xs = x + r * K + 32 * s;
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs + 16),
                               _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), acc[r]));
    }
  });
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
#else
  __m256 acc[MR][2];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    __m256 w[4];
    weights(u, w);
    fma_rows32<MR>(w, x + 32 * s, K, acc);
  });
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
}

// Sums of the input a format's offsets meet, per 32 weights: one (sum(x_s)), or two (halves).
template <typename B>
inline constexpr int64_t kOffsetSums = kHalfOffsets<B> ? 2 : 1;

// offsets + sub-block s's offset terms: off sum(x_s), or off sum(x's first half) + off1
// sum(its second) (xsum: the input's sums, kOffsetSums<B> per 32 weights).
template <typename B>
inline float add_offsets(const Sub& u, const float* xsum, int64_t s, float offsets) {
  if constexpr (kHalfOffsets<B>)
    return std::fma(u.off1, xsum[2 * s + 1], std::fma(u.off, xsum[2 * s], offsets));
  else
    return std::fma(u.off, xsum[s], offsets);
}

// x . row for one input row (a decode step of one sequence), bound by turning codes into
// floats: the factored form sum_s scale_s (codes_s . x_s) + off_s sum(x_s), with each
// sub-block's code products summed before its scale (`xsum`: sum(x_s), for formats with mins).
template <typename B>
inline float row_dot1(const float* x, const float* xsum, int64_t K, const uint8_t* row) {
  float offsets = 0.f;
#ifdef RS_AVX512
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(u.codes)));
    const __m512 c1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(u.codes, 1)));
    // Explicit FMAs only (no mul + add the compiler may or may not fuse): row_dot_exact
    // repeats these operations and must get the same bits.
    const __m512 t0 = _mm512_mul_ps(c0, _mm512_loadu_ps(x + 32 * s));
    const __m512 x1 = _mm512_loadu_ps(x + 32 * s + 16);
    if (u.s0 == u.s1) {  // one scale (all formats but Q6_K): one broadcast
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(u.s0), _mm512_fmadd_ps(c1, x1, t0), acc0);
    } else {
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(u.s0), t0, acc0);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(u.s1), _mm512_mul_ps(c1, x1), acc1);
    }
    if (B::kOffset) offsets = add_offsets<B>(u, xsum, s, offsets);
  });
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + offsets;
#else
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    __m256 c[4];
    widen(u.codes, c);
    const float* xs = x + 32 * s;
    const __m256 t0 = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xs + 8),
                                      _mm256_mul_ps(c[0], _mm256_loadu_ps(xs)));
    const __m256 t1 = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xs + 24),
                                      _mm256_mul_ps(c[2], _mm256_loadu_ps(xs + 16)));
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(u.s0), t0, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(u.s1), t1, acc1);
    if (B::kOffset) offsets = add_offsets<B>(u, xsum, s, offsets);
  });
  return hsum(_mm256_add_ps(acc0, acc1)) + offsets;
#endif
}

// out[r * ldo] = x[r] . row for MR input rows (x rows K apart, `xsum` rows K / 32 apart), each
// by exactly the operations row_dot1 applies to one input row, in the same order, so a row's
// result does not depend on the other rows of its call (a decode step's sequences, or one
// sequence's speculative rows); each sub-block's codes are widened once for all MR rows.
template <typename B, int MR>
inline void row_dot_exact(const float* x, const float* xsum, int64_t K, const uint8_t* row,
                          float* out, int64_t ldo) {
  float offsets[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) offsets[r] = 0.f;
#ifdef RS_AVX512
  __m512 acc0[MR], acc1[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(u.codes)));
    const __m512 c1 =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(u.codes, 1)));
    const __m512 s0 = _mm512_set1_ps(u.s0), s1 = _mm512_set1_ps(u.s1);
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xs = x + r * K + 32 * s;
      const __m512 t0 = _mm512_mul_ps(c0, _mm512_loadu_ps(xs));
      const __m512 x1 = _mm512_loadu_ps(xs + 16);
      if (u.s0 == u.s1) {
        acc0[r] = _mm512_fmadd_ps(s0, _mm512_fmadd_ps(c1, x1, t0), acc0[r]);
      } else {
        acc0[r] = _mm512_fmadd_ps(s0, t0, acc0[r]);
        acc1[r] = _mm512_fmadd_ps(s1, _mm512_mul_ps(c1, x1), acc1[r]);
      }
      if (B::kOffset) offsets[r] = add_offsets<B>(u, xsum + r * kOffsetSums<B> * (K / 32), s, offsets[r]);
    }
  });
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + offsets[r];
#else
  __m256 acc0[MR], acc1[MR];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  visit_subs<B>(row, K, [&](int64_t s, const Sub& u) {
    __m256 c[4];
    widen(u.codes, c);
    const __m256 s0 = _mm256_set1_ps(u.s0), s1 = _mm256_set1_ps(u.s1);
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const float* xs = x + r * K + 32 * s;
      const __m256 t0 = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xs + 8),
                                        _mm256_mul_ps(c[0], _mm256_loadu_ps(xs)));
      const __m256 t1 = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xs + 24),
                                        _mm256_mul_ps(c[2], _mm256_loadu_ps(xs + 16)));
      acc0[r] = _mm256_fmadd_ps(s0, t0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(s1, t1, acc1[r]);
      if (B::kOffset) offsets[r] = add_offsets<B>(u, xsum + r * kOffsetSums<B> * (K / 32), s, offsets[r]);
    }
  });
  RS_UNROLL for (int r = 0; r < MR; ++r)
    out[r * ldo] = hsum(_mm256_add_ps(acc0[r], acc1[r])) + offsets[r];
#endif
}

// out [M, N] = x [M, K] W^T for M <= 16 input rows (decode steps): weight rows spread over the
// threads; one input row by row_dot1, more by row_dot (each row's weights made once per 8 of
// them), or while exact_rows() is on by row_dot_exact (row_dot1's arithmetic per row).
template <typename B>
void gemm_block_rows_small(const float* x, int64_t M, const uint8_t* blocks, int64_t row_bytes,
                           int64_t N, int64_t K, float* out) {
  const int64_t S = K / 32 * kOffsetSums<B>, width = 32 / kOffsetSums<B>;
  const bool exact = M > 1 && exact_rows();
  // Per input row, as row_dot1 sums them (row_dot, the many-row default, needs none).
  std::vector<float> xsum(M == 1 || exact ? M * S : 0, 0.f);
  for (int64_t r = 0; r < (xsum.empty() ? 0 : M); ++r)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t j = 0; j < width; ++j) xsum[r * S + s] += x[r * K + width * s + j];
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = blocks + n * row_bytes;
      // Ask for the row 4 ahead: DRAM latency hides behind this row's FMAs.
      const char* ahead = reinterpret_cast<const char*>(blocks + std::min(n + 4, N - 1) * row_bytes);
      for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      if (M == 1) {
        out[n] = row_dot1<B>(x, xsum.data(), K, row);
        continue;
      }
      for (int64_t m = 0; m < M; m += 8) {
        with_rows<8>(static_cast<int>(std::min<int64_t>(8, M - m)), [&](auto R) {
          if (exact)
            row_dot_exact<B, R>(x + m * K, xsum.data() + m * S, K, row, out + m * N + n, N);
          else
            row_dot<B, R>(x + m * K, K, row, out + m * N + n, N);
        });
      }
    }
  });
}
#endif

#ifdef RS_AVX2
// out[r * ldo + j] = x[r] . rows[j] for MR input rows (x rows K apart) and NR rows of a 16-bit
// matrix (HalfBlock B; `rows` 2K bytes apart): each 32 weights converted once for every input
// row, each x load shared by the NR weight rows, and each (input, weight) row's sum made by the
// same operations in the same order whatever MR and NR are, so a row's result is its own.
template <typename B, int MR, int NR>
inline void half_row_dot(const float* x, int64_t K, const uint8_t* rows, float* out,
                         int64_t ldo) {
#ifdef RS_AVX512
  __m512 acc[MR][NR][2];
  RS_UNROLL for (int r = 0; r < MR; ++r) RS_UNROLL for (int j = 0; j < NR; ++j)
      acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512 w[NR][2];
    RS_UNROLL for (int j = 0; j < NR; ++j) {
      const uint8_t* at = rows + j * 2 * K + 2 * k;
      stream_ahead(at, 1, MR > 2 ? kStreamAheadRows : kStreamAhead);
      w[j][0] = B::load16(at);
      w[j][1] = B::load16(at + 32);
    }
    RS_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * K + k), x1 = _mm512_loadu_ps(x + r * K + k + 16);
      RS_UNROLL for (int j = 0; j < NR; ++j) {
        acc[r][j][0] = _mm512_fmadd_ps(w[j][0], x0, acc[r][j][0]);
        acc[r][j][1] = _mm512_fmadd_ps(w[j][1], x1, acc[r][j][1]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) RS_UNROLL for (int j = 0; j < NR; ++j)
      out[r * ldo + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][j][0], acc[r][j][1]));
#else
  static_assert(NR == 1, "AVX2: one weight row a pass (16 vector registers)");
  __m256 acc[MR][2];
  RS_UNROLL for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    stream_ahead(rows + 2 * k, 1);
    __m256 w[4];
    for (int j = 0; j < 4; ++j) w[j] = B::load8(rows + 2 * (k + 8 * j));
    fma_rows32<MR>(w, x + k, K, acc);
  }
  RS_UNROLL for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
}

// out[r * ldo + n] = x[r] . w[n] for M <= 16 input rows over N rows of a 16-bit matrix (HalfBlock
// B, rows of 2K bytes): weight rows spread over the threads, streamed from memory once for up
// to 4 input rows at a time, each input row's result its own (half_row_dot). From 3 input rows
// on, with AVX-512, two weight rows a pass share the loads of x. A 1B F16 GGUF on the Zen 5 in
// process: 8 sequences 47.4 tok/s a weight row at a time (8 input rows a pass), 89-92 two at a
// time; one sequence 21-28 a row at a time, 15-22 two at a time (5 runs each).
template <typename B>
void half_rows_small(const float* x, int64_t M, const uint8_t* w, int64_t N, int64_t K,
                     float* out, int64_t ldo) {
  constexpr int kRows = 4;
#ifdef RS_AVX512
  const int64_t pair = M > 2 ? 2 : 1;
#else
  constexpr int64_t pair = 1;
#endif
  at::parallel_for(0, (N + pair - 1) / pair, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t n = p0 * pair; n < std::min(N, p1 * pair); n += pair)
      for (int64_t m = 0; m < M; m += kRows)
        with_rows<kRows>(static_cast<int>(std::min<int64_t>(kRows, M - m)), [&](auto R) {
          const uint8_t* rows = w + n * 2 * K;
          float* o = out + m * ldo + n;
#ifdef RS_AVX512
          if (pair == 2 && n + 2 <= N) return half_row_dot<B, R, 2>(x + m * K, K, rows, o, ldo);
#endif
          half_row_dot<B, R, 1>(x + m * K, K, rows, o, ldo);
        });
  });
}
#endif

constexpr int64_t kSmallM = 16;  // up to this many input rows: weights straight from registers

// out [M, N] = x W^T for one part of `N` rows of format B (out contiguous).
template <typename B>
void gemm_part(const at::Tensor& x, const uint8_t* blocks, int64_t N, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), row_bytes = K / B::kWeights * B::kBytes;
#ifdef RS_AVX2
  if (M <= kSmallM) {
    if constexpr (kFloatBlock<B>)
      return half_rows_small<B>(x.data_ptr<float>(), M, blocks, N, K, out.data_ptr<float>(), N);
    else
      return gemm_block_rows_small<B>(x.data_ptr<float>(), M, blocks, row_bytes, N, K,
                                      out.data_ptr<float>());
  }
#endif
  auto dequant = [&](int64_t n, int64_t nr, float* buf) {
    dequant_block_rows<B>(blocks, row_bytes, n, nr, K, buf);
  };
  if (M >= kPanelMinRows) {
    auto no_panel = [](int64_t, float*) { return false; };
    return quant_gemm_panels(x, N, out, dequant, no_panel);
  }
  quant_gemm(x, N, out, dequant);
}

// Checks `layout` [P, 2] int64 (rows, GGML type) against K and the buffer's size; returns
// the total rows.
int64_t check_layout(const at::Tensor& blocks, const at::Tensor& layout, int64_t K) {
  check(layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 2 &&
            layout.is_contiguous(),
        "gguf layout: int64 [parts, 2] (rows, GGML type)");
  check(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "gguf blocks: uint8");
  const int64_t* lp = layout.data_ptr<int64_t>();
  int64_t rows = 0, bytes = 0;
  for (int64_t p = 0; p < layout.size(0); ++p) {
    int64_t per = 0;
    const bool known = with_block(lp[2 * p + 1], [&](auto b) {
      using B = decltype(b);
      TORCH_CHECK(K % B::kWeights == 0, "radixserve kernel: ", quant_kind_name(lp[2 * p + 1]),
                  " rows of ", K, " weights are not whole blocks of ", B::kWeights);
      per = K / B::kWeights * B::kBytes;
      if constexpr (kIqGridBlock<B>)
        TORCH_CHECK(g_iq_grids.set, "radixserve kernel: ", quant_kind_name(lp[2 * p + 1]),
                    " needs the i-quant grids (set_iq_grids)");
    });
    TORCH_CHECK(known, "radixserve kernel: no GGUF block kernel for GGML type ", lp[2 * p + 1]);
    rows += lp[2 * p];
    bytes += lp[2 * p] * per;
  }
  check(bytes == blocks.numel(), "gguf blocks: size does not match the layout");
  return rows;
}

// f(Block{}, rows, the part's blocks, its first row) for each part of a checked layout
// [parts, 2] (lp: its data) over rows of K weights, in order.
template <typename F>
void for_each_part(const int64_t* lp, int64_t parts, int64_t K, const uint8_t* bp, F&& f) {
  int64_t first = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t rows = lp[2 * p];
    with_block(lp[2 * p + 1], [&](auto b) {
      using B = decltype(b);
      f(b, rows, bp, first);
      bp += rows * (K / B::kWeights * B::kBytes);
    });
    first += rows;
  }
}

}  // namespace

void gguf_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& layout,
               const at::Tensor& out, bool int8_activations) {
  check(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = check_layout(blocks, layout, K);
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M &&
            out.size(1) == N,
        "out: float32 [M, rows]");
  const int64_t parts = layout.size(0);
  const int64_t* lp = layout.data_ptr<int64_t>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  int64_t col = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t rows = lp[2 * p];
    // One part writes out directly; several each compute into their own [M, rows], copied
    // into their columns (a fraction of the GEMM's cost).
    const at::Tensor dst = parts == 1 ? out : at::empty({M, rows}, out.options());
    with_block(lp[2 * p + 1], [&](auto b) {
      using B = decltype(b);
      if (!(int8_activations && (kquant_gemm_vnni(x, lp[2 * p + 1], bp, rows, dst) ||
                                 kquant_gemm_avx2(x, lp[2 * p + 1], bp, rows, dst))))
        gemm_part<B>(x, bp, rows, dst);
      bp += rows * (K / B::kWeights * B::kBytes);
    });
    if (parts > 1) {
      const float* src = dst.data_ptr<float>();
      float* o = out.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(o + m * N + col, src + m * rows, rows * sizeof(float));
    }
    col += rows;
  }
}

namespace {

// out [rows, K] = the float32 weights of every part, as gguf's dequantization gives them.
void gguf_dequant(const at::Tensor& blocks, const at::Tensor& layout, const at::Tensor& out) {
  check(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out");
  const int64_t K = out.size(1);
  check(check_layout(blocks, layout, K) == out.size(0), "out rows");
  float* op = out.data_ptr<float>();
  for_each_part(layout.data_ptr<int64_t>(), layout.size(0), K, blocks.data_ptr<uint8_t>(),
                [&](auto b, int64_t rows, const uint8_t* bp, int64_t first) {
                  using B = decltype(b);
                  const int64_t row_bytes = K / B::kWeights * B::kBytes;
                  at::parallel_for(0, rows, 64, [&](int64_t n0, int64_t n1) {
                    dequant_block_rows<B>(bp, row_bytes, n0, n1 - n0, K, op + (first + n0) * K);
                  });
                });
}

// One row of `groups` groups of 32 weights in GGML blocks of type `kind` as quant.py's codes
// (quant.repacked's values, computed as its torch reference `_as_codes` does): int4 (16 bytes
// a group, byte e = code e | code e + 16 << 4; w = s q + m) or int8 (32 codes; w = s q).
void repack_row(int64_t kind, const uint8_t* b, int64_t groups, uint8_t* q, float* s, float* m) {
  if (kind == kQ4_K) {
    for (int64_t sb = 0; sb < groups / 8; ++sb, b += 144) {
      const float d = f16_at(b), dmin = f16_at(b + 2);
      for (int64_t j = 0; j < 8; ++j) {
        int sc, mn;
        k_scale_min(b + 4, j, sc, mn);
        const int64_t g = sb * 8 + j;
        s[g] = d * static_cast<float>(sc);
        m[g] = -(dmin * static_cast<float>(mn));
        for (int e = 0; e < 16; ++e) q[g * 16 + e] = q4k_code_byte(b + 16, j, e);
      }
    }
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float d = f16_at(b);
    s[g] = d;
    if (kind == kQ4_0) {
      m[g] = -8.0f * d;
      std::memcpy(q + g * 16, b + 2, 16);
      b += 18;
    } else if (kind == kQ4_1) {
      m[g] = f16_at(b + 2);
      std::memcpy(q + g * 16, b + 4, 16);
      b += 20;
    } else if (kind == kQ8_0) {
      std::memcpy(q + g * 32, b + 2, 32);
      b += 34;
    } else {  // Q5_0: q = nibble | bit e of qh << 4, minus 16
      const uint32_t qh = u32_at(b + 2);
      for (int e = 0; e < 32; ++e) {
        const int nib = e < 16 ? (b[6 + e] & 0x0F) : (b[6 + e - 16] >> 4);
        q[g * 32 + e] = static_cast<uint8_t>(static_cast<int8_t>((nib | ((qh >> e) & 1) << 4) - 16));
      }
      b += 22;
    }
  }
}

// codes / scale (/ mins) = the rows of every part of `blocks` (GGML types Q4_0, Q4_1, Q4_K
// into int4 with mins; Q8_0, Q5_0 into int8, `mins` empty) as quant.py's codes.
void gguf_repack(const at::Tensor& blocks, const at::Tensor& layout, const at::Tensor& codes,
                 const at::Tensor& scale, const at::Tensor& mins) {
  check(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2, "scale");
  const int64_t groups = scale.size(1), K = groups * 32;
  const int64_t N = check_layout(blocks, layout, K);
  const bool int4 = mins.numel() > 0;
  check(codes.is_contiguous() && codes.element_size() == 1 && codes.numel() == N * K / (int4 ? 2 : 1),
        "codes: [rows, K / 2] uint8 (int4) or [rows, K] int8");
  check(scale.size(0) == N && (!int4 || (mins.scalar_type() == at::kFloat &&
                                         mins.is_contiguous() && mins.sizes() == scale.sizes())),
        "scale / mins: float32 [rows, K / 32]");
  const int64_t* lp = layout.data_ptr<int64_t>();
  const int64_t row_codes = int4 ? K / 2 : K;
  uint8_t* qp = static_cast<uint8_t*>(codes.data_ptr());
  float* sp = scale.data_ptr<float>();
  float* mp = int4 ? mins.data_ptr<float>() : nullptr;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  for (int64_t p = 0, first = 0; p < layout.size(0); ++p) {
    const int64_t rows = lp[2 * p], kind = lp[2 * p + 1];
    const bool to_int4 = kind == kQ4_0 || kind == kQ4_1 || kind == kQ4_K;
    TORCH_CHECK(to_int4 == int4 && (int4 || kind == kQ8_0 || kind == kQ5_0),
                "radixserve kernel: no ", int4 ? "int4" : "int8", " codes for ",
                quant_kind_name(kind));
    int64_t row_bytes = 0;
    with_block(kind, [&](auto b) {
      using B = decltype(b);
      row_bytes = K / B::kWeights * B::kBytes;
    });
    at::parallel_for(0, rows, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = first + n0; n < first + n1; ++n)
        repack_row(kind, bp + (n - first) * row_bytes, groups, qp + n * row_codes,
                   sp + n * groups, int4 ? mp + n * groups : nullptr);
    });
    bp += rows * row_bytes;
    first += rows;
  }
}

// Our code for a QuantizedWeight kind name ("int4", "q4_k", ...), -1 for none.
int64_t quant_kind_code(const std::string& name) {
  for (int64_t k : {kInt4, kInt8, kInt4Vnni, kInt8Vnni, kQ6kVnni, kQ4_0, kQ4_1, kQ5_0, kQ5_1,
                    kQ8_0, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kIQ2_XXS,
                    kIQ2_XS, kIQ2_S, kIQ3_XXS, kIQ3_S, kF16, kBF16})
    if (name == quant_kind_name(k)) return k;
  if (name == "gguf-q8") return kGgufQ8;  // added to a GGML type (quant_kinds.h)
  return -1;
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "gguf_gemm(Tensor x, Tensor blocks, Tensor layout, Tensor(a!) out, "
      "bool int8_activations=False) -> ()");
  m.def("gguf_dequant(Tensor blocks, Tensor layout, Tensor(a!) out) -> ()");
  m.def(
      "gguf_repack(Tensor blocks, Tensor layout, Tensor(a!) codes, Tensor(b!) scale, "
      "Tensor(c!) mins) -> ()");
  m.def("quant_kind_code(str name) -> int", &radixserve::quant_kind_code);  // no tensors: no key
  m.def(
      "set_iq_grids(Tensor iq2xxs, Tensor iq2xs, Tensor iq2s, Tensor iq3xxs, Tensor iq3s) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("gguf_gemm", &radixserve::gguf_gemm);
  m.impl("gguf_dequant", &radixserve::gguf_dequant);
  m.impl("gguf_repack", &radixserve::gguf_repack);
  m.impl("set_iq_grids", &radixserve::set_iq_grids);
}

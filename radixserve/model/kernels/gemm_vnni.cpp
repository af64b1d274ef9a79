// GEMMs of int4/int8 codes with int8 activations on AVX-512 VNNI (vpdpbusd: 4 byte products
// summed into each of 16 int32 lanes), for CPUs that have VNNI but no bfloat16 units: int8
// codes' prefill chunks here and their decode rows below (codes read in place); int4 codes'
// rows of both kinds on panels packed once, last.
// Each input row is quantized per group of 32 (scale = max|x| / 127, codes rounded to nearest):
//   int8 W (w = s * q):         y = sum_g sx_g * s_g * (xq_g . q_g)
//   int4 W (w = s * q + min):   y = sum_g sx_g * (s_g * (xq_g . q_g) + min_g * sum(xq_g))
// The integer dot products are exact; the group sums are float32. vpdpbusd multiplies unsigned
// by signed bytes: int4 codes (0-15) are the unsigned side; for int8 codes x goes unsigned as
// xq + 128, and 128 * sum(q_g) is taken off each group's sum.
// Layout: a panel of 16 output columns holds, per group, 8 vectors of 16 words: word (j, c) =
// column c's codes 4j..4j+3, so a broadcast word of x meets 16 columns at once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

// kernels/__init__.py adds -mavx512vnni where the CPU has AVX-512 VNNI (simd.h's
// RS_AVX512_VNNI, cpu_has_avx512_vnni).

namespace radixserve {
namespace {

#ifdef RS_AVX2
// The bytes of int4-vnni factors (scales or mins) for P panels of G groups: float32 or float16
// [P * G, 16] (float16 where the values are, as a Q4_0's or Q4_1's d and m), or Q4_K's as
// stored (uint8, k_factor's); 0 where `f` is none of these.
inline int64_t panel_factor_bytes(const at::Tensor& f, int64_t P, int64_t G) {
  if (!f.is_contiguous()) return 0;
  if (f.scalar_type() == at::kFloat && f.numel() == P * G * 16) return G * 64;
  if (f.scalar_type() == at::kHalf && f.numel() == P * G * 16) return G * 32;
  if (f.scalar_type() == at::kByte && G % 8 == 0 && f.numel() == P * G / 8 * kKFactorBytes)
    return G / 8 * kKFactorBytes;
  return 0;
}

// Checks words [P * G, 256] uint8 and scale / min factors of one format (panel_factor_bytes)
// as `op`'s panels for P panels of G groups; the factors' bytes per panel.
inline int64_t check_panels(const at::Tensor& words, const at::Tensor& pscale,
                            const at::Tensor& pminv, int64_t P, int64_t G, const char* op) {
  const int64_t factor_bytes = panel_factor_bytes(pscale, P, G);
  TORCH_CHECK(words.is_contiguous() && words.numel() == P * G * 256 && factor_bytes > 0 &&
                  pminv.scalar_type() == pscale.scalar_type() &&
                  panel_factor_bytes(pminv, P, G) == factor_bytes,
              "radixserve kernel: ", op, ": panels of q4_vnni_pack or q4k_vnni_pack for [N, K]");
  return factor_bytes;
}

// What every GEMM here takes: x [M, K] and out [M, N] as float32 rows.
void check_rows(const at::Tensor& x, const at::Tensor& out, int64_t N) {
  check(x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 rows");
  check(out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0) &&
            out.size(1) == N,
        "out must be float32 rows [M, N]");
}

// Q4_K blocks [rows, K / 256 x 144 bytes] (rows a multiple of 16) straight into int4-vnni
// panels: words as q4_vnni_pack's of gguf_repack's codes, and the factors as the file keeps
// them (kscale / kmin [rows / 16 x K / 256, 192] uint8: k_factor's), 4.75 bits a weight in all
// where float32 factors take 6. Decode rows read a fifth fewer bytes, with the same bits.
void q4k_vnni_pack_impl(const at::Tensor& blocks, int64_t K, const at::Tensor& words,
                        const at::Tensor& kscale, const at::Tensor& kmin) {
  const int64_t S = K / 256, G = K / 32, row_bytes = S * 144;
  check(K % 256 == 0 && blocks.is_contiguous() && blocks.numel() % (16 * row_bytes) == 0,
        "q4k_vnni_pack: contiguous Q4_K rows of K / 256 blocks, a multiple of 16 rows");
  const int64_t P = blocks.numel() / row_bytes / 16;
  check(words.is_contiguous() && words.numel() == P * G * 256 && kscale.is_contiguous() &&
            kscale.numel() == P * S * kKFactorBytes && kmin.is_contiguous() &&
            kmin.numel() == P * S * kKFactorBytes,
        "q4k_vnni_pack: outputs [P * G, 256] and [P * K / 256, 192] uint8");
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* wp = static_cast<uint8_t*>(words.data_ptr());
  uint8_t* sp = static_cast<uint8_t*>(kscale.data_ptr());
  uint8_t* mp = static_cast<uint8_t*>(kmin.data_ptr());
  const __m128i low = _mm_set1_epi8(0x0F), high = _mm_set1_epi8(static_cast<char>(0xF0));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t sb = 0; sb < S; ++sb) {
        float d[16], nd[16];
        uint8_t sc[8][16], mn[8][16];
        const uint8_t* row0 = bp + p * 16 * row_bytes + sb * 144;
        for (int c = 0; c < 16; ++c) {
          const uint8_t* b = row0 + c * row_bytes;
          d[c] = f16_at(b);
          nd[c] = -f16_at(b + 2);
          for (int j = 0; j < 8; ++j) {
            int s = 0, m = 0;
            k_scale_min(b + 4, j, s, m);
            sc[j][c] = static_cast<uint8_t>(s);
            mn[j][c] = static_cast<uint8_t>(m);
          }
        }
        // Sub-block j's 16 code bytes of column c (q4k_code_byte's, e = 0..15) as four words;
        // word (i, c) of the group's 64 takes bytes 4i..4i+3: a 4 x 4 word transpose per four
        // columns.
        for (int j = 0; j < 8; ++j) {
          uint32_t* dst = reinterpret_cast<uint32_t*>(wp) + (p * G + sb * 8 + j) * 64;
          for (int c0 = 0; c0 < 16; c0 += 4) {
            __m128i v[4];
            for (int k = 0; k < 4; ++k) {
              const uint8_t* src = row0 + (c0 + k) * row_bytes + 16 + 32 * (j / 2);
              const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
              const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
              v[k] = (j & 1) ? _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), low),
                                            _mm_and_si128(hi, high))
                             : _mm_or_si128(_mm_and_si128(lo, low),
                                            _mm_and_si128(_mm_slli_epi16(hi, 4), high));
            }
            const __m128i t0 = _mm_unpacklo_epi32(v[0], v[1]), t1 = _mm_unpacklo_epi32(v[2], v[3]);
            const __m128i t2 = _mm_unpackhi_epi32(v[0], v[1]), t3 = _mm_unpackhi_epi32(v[2], v[3]);
            const __m128i rows[4] = {_mm_unpacklo_epi64(t0, t1), _mm_unpackhi_epi64(t0, t1),
                                     _mm_unpacklo_epi64(t2, t3), _mm_unpackhi_epi64(t2, t3)};
            for (int i = 0; i < 4; ++i)
              _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * 16 + c0), rows[i]);
          }
        }
        uint8_t* fs = sp + (p * S + sb) * kKFactorBytes;
        uint8_t* fm = mp + (p * S + sb) * kKFactorBytes;
        std::memcpy(fs, d, 64);
        std::memcpy(fs + 64, sc, 128);
        std::memcpy(fm, nd, 64);
        std::memcpy(fm + 64, mn, 128);
      }
  });
}

// `times` each half group's sum of the int8 codes xq [M, K] ([M][2G]: 16 codes each): the term a code offset
// adds to each half's dot product (Q6_K's codes are stored + 32, so -32 for them).
std::vector<int32_t> half_group_sums(const std::vector<int8_t>& xq, int32_t times) {
  std::vector<int32_t> sums(xq.size() / 16);
  for (size_t i = 0; i < sums.size(); ++i) {
    int32_t sum = 0;
    for (int e = 0; e < 16; ++e) sum += xq[i * 16 + e];
    sums[i] = times * sum;
  }
  return sums;
}
#endif

#ifdef RS_AVX512_VNNI
// x [M, K] float32 (row stride ldx) -> xq [M, K] int8 codes (xor 0x80 with `offset`: xq + 128
// as unsigned bytes), sx [M, K/32] their scales and xs [M, K/32] = sx * sum(codes) per group.
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, bool offset,
                      int8_t* xq, float* sx, float* xs) {
  const int64_t G = K / 32;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m128i flip = _mm_set1_epi8(offset ? static_cast<char>(0x80) : 0);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* p = x + m * ldx + g * 32;
        const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* dst = xq + m * K + g * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                         _mm_xor_si128(_mm512_cvtsepi32_epi8(qa), flip));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16),
                         _mm_xor_si128(_mm512_cvtsepi32_epi8(qb), flip));
        sx[m * G + g] = scale;
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        xs[m * G + g] = scale * static_cast<float>(sum);
      }
  });
}

// quantize_rows_q8 of x's rows [M, K], into buffers of their own.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> sx, xs;
};

QuantizedRows quantize_rows(const at::Tensor& x, bool offset) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G),
                  std::vector<float>(M * G)};
  quantize_rows_q8(x.data_ptr<float>(), x.stride(0), M, K, offset, q.xq.data(), q.sx.data(),
                   q.xs.data());
  return q;
}

// Asks for bytes [p, p + bytes) into L2, a cache line at a time.
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// One panel: 16 columns' codes over every group, each group's scales, and (int8) 128 * the
// sum of its codes or (int4) its mins.
struct VnniPanel {
  std::vector<uint32_t> words;  // [G][8][16]
  std::vector<float> scale, minv;  // [G][16]
  std::vector<int32_t> offset;  // [G][16]
  explicit VnniPanel(int64_t G) : words(G * 128), scale(G * 16), minv(G * 16), offset(G * 16) {}
};

// Group g of the panel from w[], the group's words of codes with lane r holding row n + r's
// (int4: w[0..3], bytes of codes i | i + 16 << 4; int8: w[0..7]): int4 codes split into their
// nibbles, int8 codes stored with 128 * their sum.
template <bool Int4>
inline void put_group_words(const __m512i* w, int64_t g, VnniPanel& p) {
  uint32_t* dst = p.words.data() + g * 128;
  if constexpr (Int4) {  // byte i of a group: code i (low nibble), code 16 + i (high nibble)
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_si512(dst + j * 16, _mm512_and_si512(w[j], nibble));
      _mm512_storeu_si512(dst + (j + 4) * 16, _mm512_and_si512(_mm512_srli_epi16(w[j], 4), nibble));
    }
  } else {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      _mm512_storeu_si512(dst + j * 16, w[j]);
      sum = _mm512_dpbusd_epi32(sum, ones, w[j]);  // the codes' sum, as signed bytes
    }
    _mm512_storeu_si512(&p.offset[g * 16], _mm512_slli_epi32(sum, 7));
  }
}

// Fill `p` with W's rows n..n+15 (N is a multiple of 16; int8 panels are rebuilt every call,
// so this runs N x K / 4 lanes per call; int4 ones once, by q4_vnni_pack): 64 bytes of codes
// of each row at a time (4 int4 groups, 2 int8 ones) and the scales (and mins) of 16 groups,
// transposed in registers so that a vector holds one word of every row; the groups left over
// are gathered a word at a time.
// Asks for the panel `kAheadRows` rows on (where N has it) into L2 first: a panel's 16 rows are
// too short a stream each for the hardware prefetchers, and few input rows leave the packing
// bound by memory (Zen 4, the default model's 120 GEMMs of a step at 1 and 6 rows: 10.5 and
// 12.1 ms without, 6.6 and 8.4 with).
template <bool Int4>
void pack_panel(const uint8_t* qs, const float* sp, const float* mp, int64_t K, int64_t N,
                int64_t n, VnniPanel& p) {
  const int64_t G = K / 32, row_bytes = Int4 ? K / 2 : K, group_bytes = Int4 ? 16 : 32;
  constexpr int64_t kWords = Int4 ? 4 : 8, kLoadGroups = 16 / kWords, kAheadRows = 32;
  if (n + kAheadRows < N) {
    prefetch_l2(qs + (n + kAheadRows) * row_bytes, 16 * row_bytes);
    prefetch_l2(sp + (n + kAheadRows) * G, 16 * G * 4);
    if constexpr (Int4) prefetch_l2(mp + (n + kAheadRows) * G, 16 * G * 4);
  }
  const uint8_t* codes = qs + n * row_bytes;
  int64_t g = 0;
  for (; g + kLoadGroups <= G; g += kLoadGroups) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(codes + i * row_bytes + g * group_bytes);
    transpose16(r);  // r[w]: word w of the 64 bytes, of every row
    for (int64_t l = 0; l < kLoadGroups; ++l) put_group_words<Int4>(r + l * kWords, g + l, p);
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i by_row = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(row_bytes)));
  for (; g < G; ++g) {
    __m512i w[kWords];
    for (int j = 0; j < kWords; ++j)
      w[j] = _mm512_i32gather_epi32(by_row, codes + g * group_bytes + 4 * j, 1);
    put_group_words<Int4>(w, g, p);
  }
  const __m512i by_group = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(G)));
  auto put_factors = [&](const float* f, float* dst) {  // f [N, G] -> dst [G][16]
    int64_t h = 0;
    for (; h + 16 <= G; h += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(f + (n + i) * G + h);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (h + i) * 16, r[i]);
    }
    for (; h < G; ++h)
      _mm512_storeu_ps(dst + h * 16, _mm512_i32gather_ps(by_group, f + n * G + h, 4));
  };
  put_factors(sp, p.scale.data());
  if constexpr (Int4) put_factors(mp, p.minv.data());
}

constexpr int kVnniRows = 6;  // 6 rows x 2 panels: 12 int32 + 12 float32 accumulators

// A panel as vnni_tile reads it: group g's vector j of its 16 columns' code words (int4: one
// nibble a byte, j < 4 the low nibbles, j >= 4 the high ones) and the group's 16 scales,
// mins (int4) and offsets (int8). SplitPanel: pack_panel's int8 one, rebuilt every call;
// PackedPanel<F> and PackedKPanel (below): int4, packed once.
struct SplitPanel {
  const VnniPanel* p;
  void ahead(int64_t, int64_t) const {}  // built per call: in cache already
  __m512i words(int64_t g, int j) const { return _mm512_loadu_si512(&p->words[(g * 8 + j) * 16]); }
  __m512 scale(int64_t g) const { return _mm512_loadu_ps(&p->scale[g * 16]); }
  const int32_t* offset(int64_t g) const { return &p->offset[g * 16]; }
};

// out[m + r, n + 16 t] for r < R, t < NT: R rows of xq times NT panels.
template <int R, int NT, bool Int4, typename Panel>
void vnni_tile(const int8_t* xq, const float* sx, const float* xs, int64_t K,
               const Panel* panels, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  __m512 acc[R][NT];
  RS_UNROLL
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (NT == 1)  // decode rows: one pass over the panels
      panels[0].ahead(g, R > 1 ? kStreamAheadRows : kStreamAhead);
    __m512i dot[R][NT];
    RS_UNROLL
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_setzero_si512();
    RS_UNROLL
    for (int j = 0; j < 8; ++j) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = panels[t].words(g, j);
      RS_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * K + g * 32 + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(word);
        for (int t = 0; t < NT; ++t)
          dot[r][t] = Int4 ? _mm512_dpbusd_epi32(dot[r][t], w[t], xb)
                           : _mm512_dpbusd_epi32(dot[r][t], xb, w[t]);
      }
    }
    RS_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 s = panels[t].scale(g);
      for (int r = 0; r < R; ++r) {
        __m512i d = dot[r][t];
        if constexpr (!Int4) d = _mm512_sub_epi32(d, _mm512_loadu_si512(panels[t].offset(g)));
        const __m512 ss = _mm512_mul_ps(s, _mm512_set1_ps(sx[r * G + g]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), ss, acc[r][t]);
        if constexpr (Int4)
          acc[r][t] = _mm512_fmadd_ps(panels[t].minv(g),
                                      _mm512_set1_ps(xs[r * G + g]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + r * ldo + 16 * t, acc[r][t]);
}

// out[m, the 16 NT columns of panels] for every row m < M of q, kRows rows a pass.
template <int NT, int kRows, bool Int4, typename Panel>
void tile_rows(const QuantizedRows& q, int64_t M, int64_t K, const Panel* panels, float* out,
               int64_t ldo) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += kRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m));
    with_rows<kRows>(mr, [&](auto Rc) {
      vnni_tile<decltype(Rc)::value, NT, Int4>(q.xq.data() + m * K, q.sx.data() + m * G,
                                               q.xs.data() + m * G, K, panels, out + m * ldo, ldo);
    });
  }
}

// out [M, N] = x W^T from int8 codes, x quantized to int8 per group (the prefill chunks of
// int8 matrices; int4 ones run on panels packed once, below).
void q8_gemm_vnni_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / 32;
  check_rows(x, out, N);
  check(K % 32 == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  check(qs.is_contiguous() && scale.is_contiguous() && qs.size(1) == K,
        "codes and scale must be contiguous [N, K], [N, K/32]");
  check(cpu_has_avx512_vnni(), "this CPU has no AVX-512 VNNI");
  if (M == 0) return;
  const QuantizedRows q = quantize_rows(x, true);
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0), blocks = (N + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    VnniPanel p0(G), p1(G);
    const SplitPanel panels[2] = {{&p0}, {&p1}};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 32, nt = std::min<int64_t>(2, (N - n) / 16);
      pack_panel<false>(qp, sp, nullptr, K, N, n, p0);
      if (nt == 2) {
        pack_panel<false>(qp, sp, nullptr, K, N, n + 16, p1);
        tile_rows<2, kVnniRows, false>(q, M, K, panels, op + n, ldo);
      } else {
        tile_rows<1, kVnniRows, false>(q, M, K, panels, op + n, ldo);
      }
    }
  });
}

// ---- K-quant prefill chunks (Q2_K ... Q6_K, IQ4_NL, IQ4_XS as stored): panels made per call ----
// A K-quant sub-block of 32 weights is s_h (c + kBias) + off (kquants.cpp's Sub: c the codes
// as unsigned bytes; one scale per half group of 16, which differ in Q3_K and Q6_K only; kBias
// -32 for Q6_K's c 0..63, -4 for Q3_K's 0..7, -128 for the IQ4 table's values + 128, 1..241;
// Q4_K / Q5_K have an offset -dmin m, Q2_K one per half). Each call packs 16 rows at a time into
// pack_panel's int8 layout with c as the bytes (unsigned: vpdpbusd's left side), with each
// group's two scales and offset; per input row, group g and half h, the integer dot of c with
// the activations' codes takes -kBias times their sum (exact), then meets sx_g s_h:
//   y = sum_g (sum_h sx_g s_h (sum_{e in h} c_e xq_e + kBias sum_{e in h} xq_e) + off_g xs_g)
// with xs_g = sx_g sum_{e in g} xq_e. Such blocks are a Q4_K_M's Q6_K matrices and the parts of
// its mixed ones (a qkv whose v is Q6_K): the float32 kernels took a quarter of a 2k prefill of
// a 1B Q4_K_M on Zen 4 for them, a sixth of its weights.

template <typename B>
constexpr int kKQuantBias = std::is_same_v<B, Q6KBlock>     ? -32
                            : std::is_same_v<B, Q3KBlock>   ? -4
                            : std::is_same_v<B, IQ4NLBlock> ? -128
                            : std::is_same_v<B, IQ4XSBlock> ? -128
                            : kIqGridBlock<B>               ? -128
                                                            : 0;

// 16 rows' panel: the codes' words and the first halves' scales (in p), the second halves'
// scales and the offsets [G][16] (with half_offsets, Q2_K's: the first halves' offsets, off_hi
// the second's; else off_hi is empty).
struct KQuantPanel {
  VnniPanel p;
  std::vector<float> hi, off, off_hi;
  KQuantPanel(int64_t G, bool half_offsets)
      : p(G), hi(G * 16), off(G * 16), off_hi(half_offsets ? G * 16 : 0) {}
};

// Rows n..n+15 of blocks of kind B (`row_bytes` a row) into `panel`; `codes`, `lo`, `hi`,
// `off`: scratch of 16 rows.
template <typename B>
void pack_kquant_panel(const uint8_t* blocks, int64_t row_bytes, int64_t K, int64_t n,
                       std::vector<uint8_t>& codes, std::vector<float>& lo,
                       std::vector<float>& hi, std::vector<float>& off,
                       std::vector<float>& off_hi, KQuantPanel& panel) {
  const int64_t G = K / 32;
  for (int64_t c = 0; c < 16; ++c) {
    const uint8_t* row = blocks + (n + c) * row_bytes;
    visit_subs<B>(row, K, [&](int64_t g, const Sub& u) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&codes[c * K + g * 32]),
                          _mm256_sub_epi8(u.codes, _mm256_set1_epi8(kKQuantBias<B>)));
      lo[c * G + g] = u.s0;
      hi[c * G + g] = u.s1;
      off[c * G + g] = u.off;
      if constexpr (kHalfOffsets<B>) off_hi[c * G + g] = u.off1;
    });
  }
  pack_panel<false>(codes.data(), lo.data(), nullptr, K, 16, 0, panel.p);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < 16; ++c) {
      panel.hi[g * 16 + c] = hi[c * G + g];
      panel.off[g * 16 + c] = off[c * G + g];
      if constexpr (kHalfOffsets<B>) panel.off_hi[g * 16 + c] = off_hi[c * G + g];
    }
}

// out[r, 16 t..] for R rows of xq (signed codes; sx their scales, xs sx times each group's sum,
// or for Q2_K [R][2G] each half group's; bias_sums [R][2G] kBias times each half group's sum)
// and NT panels of kind B.
template <typename B, int R, int NT>
void kquant_tile(const int8_t* xq, const float* sx, const float* xs, const int32_t* bias_sums,
                 int64_t K, const KQuantPanel* const* panels, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  __m512 acc[R][NT];
  RS_UNROLL
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[2][R][NT];
    RS_UNROLL
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) dot[h][r][t] = _mm512_setzero_si512();
    RS_UNROLL
    for (int j = 0; j < 8; ++j) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = SplitPanel{&panels[t]->p}.words(g, j);
      RS_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * K + g * 32 + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(word);
        for (int t = 0; t < NT; ++t)
          dot[j / 4][r][t] = _mm512_dpbusd_epi32(dot[j / 4][r][t], w[t], xb);
      }
    }
    RS_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 s[2] = {SplitPanel{&panels[t]->p}.scale(g),
                           _mm512_loadu_ps(&panels[t]->hi[g * 16])};
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(sx[r * G + g]);
        for (int h = 0; h < 2; ++h) {
          __m512i d = dot[h][r][t];
          if constexpr (kKQuantBias<B> != 0)
            d = _mm512_add_epi32(d, _mm512_set1_epi32(bias_sums[r * 2 * G + 2 * g + h]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s[h], x), acc[r][t]);
        }
        if constexpr (kHalfOffsets<B>) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(&panels[t]->off[g * 16]),
                                      _mm512_set1_ps(xs[r * 2 * G + 2 * g]), acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(&panels[t]->off_hi[g * 16]),
                                      _mm512_set1_ps(xs[r * 2 * G + 2 * g + 1]), acc[r][t]);
        } else if constexpr (B::kOffset) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(&panels[t]->off[g * 16]),
                                      _mm512_set1_ps(xs[r * G + g]), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + r * ldo + 16 * t, acc[r][t]);
}

constexpr int kKQuantTileRows = 4;  // 4 rows x 2 panels x 2 halves: 16 int32 + 8 float32 sums

// out [M, N] (contiguous) = x W^T for N rows of blocks of kind B (N a multiple of 16).
template <typename B>
void kquant_gemm_vnni_impl(const at::Tensor& x, const uint8_t* blocks, int64_t N,
                           const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  const int64_t row_bytes = K / B::kWeights * B::kBytes;
  const QuantizedRows q = quantize_rows(x, false);
  const std::vector<int32_t> bias_sums =  // the formats with a kBias only
      kKQuantBias<B> != 0 ? half_group_sums(q.xq, kKQuantBias<B>) : std::vector<int32_t>();
  // Q2_K's offsets meet each half group's sx sum (kquant_tile's xs, [M][2G]).
  std::vector<float> xs16;
  if constexpr (kHalfOffsets<B>) {
    const std::vector<int32_t> halves = half_group_sums(q.xq, 1);
    xs16.resize(halves.size());
    for (size_t i = 0; i < halves.size(); ++i)
      xs16[i] = q.sx[i / 2] * static_cast<float>(halves[i]);
  }
  const float* xs = kHalfOffsets<B> ? xs16.data() : q.xs.data();
  const int64_t xs_row = kHalfOffsets<B> ? 2 * G : G;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    KQuantPanel p0(G, kHalfOffsets<B>), p1(G, kHalfOffsets<B>);
    std::vector<uint8_t> codes(16 * K);
    std::vector<float> lo(16 * G), hi(16 * G), off(16 * G), off_hi(kHalfOffsets<B> ? 16 * G : 0);
    const KQuantPanel* panels[2] = {&p0, &p1};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 32, nt = std::min<int64_t>(2, (N - n) / 16);
      pack_kquant_panel<B>(blocks, row_bytes, K, n, codes, lo, hi, off, off_hi, p0);
      if (nt == 2)
        pack_kquant_panel<B>(blocks, row_bytes, K, n + 16, codes, lo, hi, off, off_hi, p1);
      for (int64_t m = 0; m < M; m += kKQuantTileRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kKQuantTileRows, M - m));
        with_rows<kKQuantTileRows>(mr, [&](auto Rc) {
          constexpr int Rn = decltype(Rc)::value;
          const int8_t* xr = q.xq.data() + m * K;
          const float* sr = q.sx.data() + m * G;
          const float* xsr = xs + m * xs_row;
          const int32_t* br = bias_sums.empty() ? nullptr : bias_sums.data() + m * 2 * G;
          if (nt == 2)
            kquant_tile<B, Rn, 2>(xr, sr, xsr, br, K, panels, op + m * N + n, N);
          else
            kquant_tile<B, Rn, 1>(xr, sr, xsr, br, K, panels, op + m * N + n, N);
        });
      }
    }
  });
}

// ---- int8 decode rows: the codes read in place, a few input rows at a time ----
// The prefill GEMM's panels are rebuilt every call, which pays for many input rows; one decode
// row would spend its step transposing codes. Here each int8 weight row is read as stored, 64
// bytes (a chunk: 2 groups) into one vector, and meets up to 8 input rows arranged to match:
// the vector's lane l sums 4 code products of group l / 8 of the chunk. Per weight row n and
// input row r, in chunk order:
//   acc += float(dot - 128 * sum of its codes) * (s_g * sx_g)      (per lane)
// then y = the sum of acc's 16 lanes. A row's arithmetic does not depend on the rows beside
// it, so a decode row gives the same bits alone or verifying drafts. (int4 codes: the panels
// below, which QuantLinear packs once.)

// The input rows laid out per chunk: lo [C][64] bytes (the codes + 128) and [C][16] floats of
// each lane's sx_g (0 past the last group).
struct DecodeRows {
  int64_t chunks;
  std::vector<uint8_t> lo;
  std::vector<float> sx;
};

DecodeRows decode_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, C = (G + 1) / 2;
  const QuantizedRows q = quantize_rows(x, true);
  DecodeRows d{C, std::vector<uint8_t>(M * C * 64), std::vector<float>(M * C * 16)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t c = g / 2, j = g % 2;
      std::memcpy(&d.lo[(m * C + c) * 64 + 32 * j], q.xq.data() + m * K + g * 32, 32);
      for (int64_t l = 0; l < 8; ++l) d.sx[(m * C + c) * 16 + j * 8 + l] = q.sx[m * G + g];
    }
  return d;
}

// out[r, n] for rows r < R of `d` (from row m0 on) and weight rows n0..n1-1.
template <int R>
void decode_tile(const DecodeRows& d, int64_t m0, const int8_t* qs, const float* sp, int64_t K,
                 int64_t n0, int64_t n1, float* out, int64_t ldo) {
  const int64_t G = K / 32, C = d.chunks;
  // lane l takes group l / 8 of its chunk's scales
  const __m512i spread = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t n = n0; n < n1; ++n) {
    // Each line asked for as the walk goes (simd.h's stream_ahead), the scales 16 rows ahead:
    // the rows 16 ahead into L2 a row at a time had queued behind each other (Zen 5, one row
    // over a layer's four matrices of the 1B's shapes, 16 layers in turn: 34.5-35.1 GB/s, and
    // 26.3 for the 2048 x 8192; so: 47.0-49.4, 45.1).
    const int8_t* w = qs + n * K;
    stream_ahead(sp + n * G, (G * 4 + 63) / 64, 16 * G * 4);
    __m512 acc[R];
    RS_UNROLL
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const int64_t groups = std::min<int64_t>(2, G - c * 2);
      const __mmask64 bytes = groups == 2 ? ~0ull : (1ull << 32) - 1;
      stream_ahead(w + c * 64, 1, R > 2 ? kStreamAheadRows : kStreamAhead);
      const __m512i codes = _mm512_maskz_loadu_epi8(bytes, w + c * 64);
      const __mmask16 lanes = static_cast<__mmask16>((1u << groups) - 1);
      const __m512 s =
          _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(lanes, sp + n * G + c * 2));
      const __m512i off =  // 128 * the sum of each lane's 4 codes
          _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, codes), 7);
      RS_UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * C + c;
        const __m512i dot = _mm512_sub_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(&d.lo[at * 64]),
                                codes),
            off);
        const __m512 ss = _mm512_mul_ps(s, _mm512_loadu_ps(&d.sx[at * 16]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ss, acc[r]);
      }
    }
    RS_UNROLL
    for (int r = 0; r < R; ++r) out[r * ldo + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

constexpr int kDecodeRows = 8;  // input rows a pass over the weight rows takes

// out [M, N] = x W^T for a few input rows (decode), int8 codes.
void q8_gemv_vnni_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  check_rows(x, out, N);
  check(K % 32 == 0, "K must be a multiple of 32");
  check(qs.is_contiguous() && scale.is_contiguous() && qs.size(1) == K,
        "codes and scale must be contiguous [N, K], [N, K/32]");
  check(cpu_has_avx512_vnni(), "this CPU has no AVX-512 VNNI");
  if (M == 0) return;
  const DecodeRows d = decode_rows(x);
  const int8_t* qp = static_cast<const int8_t*>(qs.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kDecodeRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kDecodeRows, M - m));
      with_rows<kDecodeRows>(mr, [&](auto Rc) {
        constexpr int Rn = decltype(Rc)::value;
        decode_tile<Rn>(d, m, qp, sp, K, n0, n1, op + m * ldo, ldo);
      });
    }
  });
}

// ---- int4: decode rows and prefill chunks on panels packed once ----
// QuantLinear packs an int4 matrix once on this path (q4_vnni_pack) into panels of 16 columns
// whose words keep both nibbles (word (j, c) of group g: column c's code bytes 4j..4j+3, as
// stored: the low nibbles codes 4j.., the high ones 16 + 4j..), with each group's scales and
// mins transposed beside them: decode rows then read the same bytes a step as from the matrix
// as stored, in one stream, and need neither transposes nor horizontal sums; prefill chunks
// skip the packing a per-call panel costs (pack_panel's, split into nibbles). Every row runs
// vnni_tile, so a token's projections give the same bits decoded or prefilled, in any chunk.

// words [P * G, 256] uint8 (64 words; P = N / 16 panels), scale / minv [P * G, 16] float32
// from qs [N, K/2], scale / minv [N, K/32].
void q4_vnni_pack_impl(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& minv,
                       const at::Tensor& words, const at::Tensor& pscale,
                       const at::Tensor& pminv) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2, G = K / 32, P = N / 16;
  check(N % 16 == 0 && K % 32 == 0 && qs.is_contiguous() && scale.is_contiguous() &&
            minv.is_contiguous(),
        "q4_vnni_pack: contiguous int4 codes [N, K/2] with N a multiple of 16");
  check(words.is_contiguous() && words.numel() == P * G * 256 && pscale.is_contiguous() &&
            pscale.numel() == P * G * 16 && pminv.is_contiguous() && pminv.numel() == P * G * 16,
        "q4_vnni_pack: outputs [P * G, 256] uint8 and [P * G, 16] float32");
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  uint32_t* wp = static_cast<uint32_t*>(words.data_ptr());
  float* sp = pscale.data_ptr<float>();
  float* mp = pminv.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    VnniPanel panel(G);
    for (int64_t p = p0; p < p1; ++p) {
      pack_panel<true>(qp, scale.data_ptr<float>(), minv.data_ptr<float>(), K, N, p * 16, panel);
      for (int64_t g = 0; g < G; ++g) {
        const uint32_t* split = panel.words.data() + g * 128;  // 4 words of low nibbles, 4 high
        uint32_t* dst = wp + (p * G + g) * 64;
        for (int64_t i = 0; i < 64; ++i) dst[i] = split[i] | (split[64 + i] << 4);
      }
      std::memcpy(sp + p * G * 16, panel.scale.data(), G * 16 * sizeof(float));
      std::memcpy(mp + p * G * 16, panel.minv.data(), G * 16 * sizeof(float));
    }
  });
}

// q4_vnni_pack's panel p as vnni_tile reads it (int4): both nibbles of a code byte in one
// word, split as the tile asks for them; its factors float32 or float16 (F: factors16).
template <typename F>
struct PackedPanel {
  const uint32_t* w;
  const F *s, *m;
  __m512i words(int64_t g, int j) const {
    const __m512i v = _mm512_loadu_si512(w + (g * 4 + j % 4) * 16);
    return _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  }
  __m512 scale(int64_t g) const { return factors16(s + g * 16); }
  __m512 minv(int64_t g) const { return factors16(m + g * 16); }
  // Group g's reads ahead (simd.h's stream_ahead): panels lie one after another, so the walk
  // goes on into the next one; the factors stream at their pace (16 F a group against 256
  // bytes of words: a quarter for float32, an eighth for float16), a line at a time.
  void ahead(int64_t g, int64_t bytes) const {
    constexpr int64_t kGroupsALine = 64 / (16 * sizeof(F));
    stream_ahead(w + g * 64, 4, bytes);
    if (g % kGroupsALine == 0) {
      stream_ahead(s + g * 16, 1, bytes * sizeof(F) / 16);
      stream_ahead(m + g * 16, 1, bytes * sizeof(F) / 16);
    }
  }
};

// The same with a Q4_K's factors as stored (simd.h's k_factor; `p` the panel's number).
struct PackedKPanel {
  const uint32_t* w;
  const uint8_t *s, *m;
  int64_t G, p;
  __m512i words(int64_t g, int j) const {
    return PackedPanel<float>{w, nullptr, nullptr}.words(g, j);
  }
  __m512 scale(int64_t g) const { return k_factor(s, G, p, g); }
  __m512 minv(int64_t g) const { return k_factor(m, G, p, g); }
  // As PackedPanel's; the factors, 192 bytes a super-block of 8 groups (2,048 bytes of
  // words), at its first group.
  void ahead(int64_t g, int64_t bytes) const {
    stream_ahead(w + g * 64, 4, bytes);
    if (g % 8 == 0) {
      const int64_t at = (p * (G / 8) + g / 8) * kKFactorBytes;
      stream_ahead(s + at, 3, bytes * 3 / 32);
      stream_ahead(m + at, 3, bytes * 3 / 32);
    }
  }
};

// out [M, N] = x W^T on int4-vnni panels (q4_vnni_pack's, or q4k_vnni_pack's).
// The operands as q4_gemm_vnni checked them, M > 0; `factor_bytes` a panel's (check_panels).
void q4_gemm_vnni_impl(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                       const at::Tensor& pminv, const at::Tensor& out, int64_t factor_bytes) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, N = out.size(1), P = N / 16;
  const QuantizedRows q = quantize_rows(x, false);
  const uint32_t* wp = static_cast<const uint32_t*>(words.data_ptr());
  const uint8_t* sp = static_cast<const uint8_t*>(pscale.data_ptr());
  const uint8_t* mp = static_cast<const uint8_t*>(pminv.data_ptr());
  const bool k_factors = pscale.scalar_type() == at::kByte,
             half_factors = pscale.scalar_type() == at::kHalf;
  float* op = out.data_ptr<float>();
  // Decode rows (up to 8) take one panel at a time, 8 rows a pass; prefill chunks two, 6 rows
  // a pass, as the prefill GEMM's tile, which halves the passes over their int8 rows (a 2k
  // chunk's are larger than L2). Each output lane's arithmetic is the same either way.
  const int64_t span = M > kDecodeRows ? 2 : 1, units = (P + span - 1) / span;
  const int64_t ldo = out.stride(0), panel_bytes = G * 64 * 4, ahead = 2;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p = u * span, nt = std::min(span, P - p);
      if (span == 2 && u + ahead < u1) {  // the unit after next into L2, and its factors
        const int64_t next = (u + ahead) * span, n_next = std::min(span, P - next);
        prefetch_l2(wp + next * G * 64, n_next * panel_bytes);
        prefetch_l2(sp + next * factor_bytes, n_next * factor_bytes);
        prefetch_l2(mp + next * factor_bytes, n_next * factor_bytes);
      }
      auto run = [&](const auto* panels) {
        if (nt == 2)
          tile_rows<2, kVnniRows, true>(q, M, K, panels, op + p * 16, ldo);
        else
          tile_rows<1, kDecodeRows, true>(q, M, K, panels, op + p * 16, ldo);
      };
      const int64_t last = p + nt - 1;
      auto plain = [&](const auto* fs, const auto* fm) {  // factors [P * G, 16]: float32, float16
        using F = std::remove_cv_t<std::remove_pointer_t<decltype(fs)>>;
        const PackedPanel<F> panels[2] = {
            {wp + p * G * 64, fs + p * G * 16, fm + p * G * 16},
            {wp + last * G * 64, fs + last * G * 16, fm + last * G * 16}};
        run(panels);
      };
      if (k_factors) {
        const PackedKPanel panels[2] = {{wp + p * G * 64, sp, mp, G, p},
                                        {wp + last * G * 64, sp, mp, G, last}};
        run(panels);
      } else if (half_factors) {
        plain(reinterpret_cast<const uint16_t*>(sp), reinterpret_cast<const uint16_t*>(mp));
      } else {
        plain(reinterpret_cast<const float*>(sp), reinterpret_cast<const float*>(mp));
      }
    }
  });
}
#endif  // RS_AVX512_VNNI

bool vnni_available() {
#ifdef RS_AVX512_VNNI
  return cpu_has_avx512_vnni();
#else
  return false;
#endif
}

void q8_gemm_vnni([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& qs,
                  [[maybe_unused]] const at::Tensor& scale,
                  [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX512_VNNI
  q8_gemm_vnni_impl(x, qs, scale, out);
#else
  check(false, "this build has no AVX-512 VNNI code");
#endif
}

void q4k_vnni_pack([[maybe_unused]] const at::Tensor& blocks, [[maybe_unused]] int64_t K,
                   [[maybe_unused]] const at::Tensor& words,
                   [[maybe_unused]] const at::Tensor& kscale,
                   [[maybe_unused]] const at::Tensor& kmin) {
#ifdef RS_AVX2
  q4k_vnni_pack_impl(blocks, K, words, kscale, kmin);
#else
  check(false, "this build has no AVX2 code");
#endif
}

void q4_vnni_pack([[maybe_unused]] const at::Tensor& qs, [[maybe_unused]] const at::Tensor& scale,
                  [[maybe_unused]] const at::Tensor& minv, [[maybe_unused]] const at::Tensor& words,
                  [[maybe_unused]] const at::Tensor& pscale,
                  [[maybe_unused]] const at::Tensor& pminv) {
#ifdef RS_AVX512_VNNI
  q4_vnni_pack_impl(qs, scale, minv, words, pscale, pminv);
#else
  check(false, "this build has no AVX-512 VNNI code");
#endif
}

}  // namespace

void q4_gemm_vnni([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& words,
                  [[maybe_unused]] const at::Tensor& pscale,
                  [[maybe_unused]] const at::Tensor& pminv,
                  [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX2
  const int64_t K = x.size(1), N = out.size(1);
  check_rows(x, out, N);
  check(K % 32 == 0 && N % 16 == 0, "q4_gemm_vnni: K must be a multiple of 32 and N of 16");
  [[maybe_unused]] const int64_t factor_bytes =
      check_panels(words, pscale, pminv, N / 16, K / 32, "q4_gemm_vnni");
  if (x.size(0) == 0) return;
#ifdef RS_AVX512_VNNI
  if (cpu_has_avx512_vnni()) return q4_gemm_vnni_impl(x, words, pscale, pminv, out, factor_bytes);
#endif
  q4_gemm_panels_avx2(x, words, pscale, pminv, out);  // without VNNI: gemm_panels_avx2.cpp
#else
  check(false, "this build has no AVX2 code");
#endif
}

bool kquant_gemm_vnni([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] int64_t kind,
                      [[maybe_unused]] const uint8_t* blocks, [[maybe_unused]] int64_t N,
                      [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX512_VNNI
  if (!cpu_has_avx512_vnni() || N % 16 != 0 || x.size(1) % 256 != 0) return false;
  if (kind == kQ4_K) return kquant_gemm_vnni_impl<QKBlock<false>>(x, blocks, N, out), true;
  if (kind == kQ5_K) return kquant_gemm_vnni_impl<QKBlock<true>>(x, blocks, N, out), true;
  if (kind == kQ6_K) return kquant_gemm_vnni_impl<Q6KBlock>(x, blocks, N, out), true;
  if (kind == kQ2_K) return kquant_gemm_vnni_impl<Q2KBlock>(x, blocks, N, out), true;
  if (kind == kQ3_K) return kquant_gemm_vnni_impl<Q3KBlock>(x, blocks, N, out), true;
  if (kind == kIQ4_NL) return kquant_gemm_vnni_impl<IQ4NLBlock>(x, blocks, N, out), true;
  if (kind == kIQ4_XS) return kquant_gemm_vnni_impl<IQ4XSBlock>(x, blocks, N, out), true;
  if (kind == kIQ2_XXS) return kquant_gemm_vnni_impl<IQ2XXSBlock>(x, blocks, N, out), true;
  if (kind == kIQ2_XS) return kquant_gemm_vnni_impl<IQ2XSBlock>(x, blocks, N, out), true;
  if (kind == kIQ2_S) return kquant_gemm_vnni_impl<IQ2SBlock>(x, blocks, N, out), true;
  if (kind == kIQ3_XXS) return kquant_gemm_vnni_impl<IQ3XXSBlock>(x, blocks, N, out), true;
  if (kind == kIQ3_S) return kquant_gemm_vnni_impl<IQ3SBlock>(x, blocks, N, out), true;
#endif
  return false;
}

void q8_gemv_vnni([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& qs,
                  [[maybe_unused]] const at::Tensor& scale,
                  [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX512_VNNI
  q8_gemv_vnni_impl(x, qs, scale, out);
#else
  check(false, "this build has no AVX-512 VNNI code");
#endif
}

namespace {

// The activations' quantization the VNNI GEMMs use (for tests): xq [M, K] int8, sx [M, K/32].
void q8_quantize_rows([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& xq,
                      [[maybe_unused]] const at::Tensor& sx) {
#ifdef RS_AVX512_VNNI
  const int64_t M = x.size(0), K = x.size(1);
  check(x.scalar_type() == at::kFloat && x.stride(1) == 1 && K % 32 == 0, "x: float32 rows");
  check(xq.scalar_type() == at::kChar && xq.is_contiguous() && sx.is_contiguous() &&
            sx.scalar_type() == at::kFloat,
        "xq int8 [M, K], sx float32 [M, K/32]");
  std::vector<float> xs(M * (K / 32));
  quantize_rows_q8(x.data_ptr<float>(), x.stride(0), M, K, false, xq.data_ptr<int8_t>(),
                   sx.data_ptr<float>(), xs.data());
#else
  check(false, "this build has no AVX-512 VNNI code");
#endif
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("q8_gemm_vnni(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def("q8_quantize_rows(Tensor x, Tensor(a!) xq, Tensor(b!) sx) -> ()");
  m.def("q8_gemv_vnni(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def(
      "q4_vnni_pack(Tensor qs, Tensor scale, Tensor minv, Tensor(a!) words, Tensor(b!) pscale, "
      "Tensor(c!) pminv) -> ()");
  m.def(
      "q4k_vnni_pack(Tensor blocks, int K, Tensor(a!) words, Tensor(b!) kscale, "
      "Tensor(c!) kmin) -> ()");
  m.def("q4_gemm_vnni(Tensor x, Tensor words, Tensor pscale, Tensor pminv, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q8_gemm_vnni", &radixserve::q8_gemm_vnni);
  m.impl("q8_quantize_rows", &radixserve::q8_quantize_rows);
  m.impl("q8_gemv_vnni", &radixserve::q8_gemv_vnni);
  m.impl("q4_vnni_pack", &radixserve::q4_vnni_pack);
  m.impl("q4_gemm_vnni", &radixserve::q4_gemm_vnni);
  m.impl("q4k_vnni_pack", &radixserve::q4k_vnni_pack);
}

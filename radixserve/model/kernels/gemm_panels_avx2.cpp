// int4-vnni panels (gemm_vnni.cpp's q4k_vnni_pack / q4_vnni_pack) on AVX2 CPUs without
// AVX-512 VNNI (int8-avx2: AMD Zen 2/3, older Intel): every row of such a matrix, decode or
// prefill, meets the panels with int8 activations through vpmaddubsw, as vnni_tile does through
// vpdpbusd, with the same arithmetic per output lane:
//   y = sum_g sx_g * (s_g * (xq_g . q_g)) + min_g * (sx_g * sum(xq_g))
// so a row's result is the same bits whatever shares its call, and the same as on a VNNI CPU.
//
// A panel's word (j, c) of group g holds column c's code bytes 4j..4j+3, the low nibbles codes
// 4j.., the high ones 16 + 4j..; 8 columns a vector. vpmaddubsw multiplies 4 nibbles by a
// broadcast word of x and sums pairs into 16 bits; a group's 8 such pair sums per lane are
// added in 16 bits (|sum| <= 8 x 2 x 15 x 127 = 30,480, no overflow) and widened once per
// group, where gguf_q8.cpp's row dot widens and converts each sub-block of a row. Read as Q4_K
// blocks, a row of a 1B model's matrices took about 90 instructions per 256 weights on Zen 3;
// on the panels, about half that.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace radixserve {
namespace {

#ifdef RS_AVX2
// Rows of x a pass over a panel. A prefill chunk of 512 rows over 16384 x 2048 on Zen 3, whole
// panels a pass: 4 rows 137 ms, 3 rows 145, 2 rows 147 (the float32 kernels on the Q4_K blocks:
// 198). In half panels on the Zen 5 (an AVX2 build): 4 rows 66-71 ms, 5 rows 66, 6 rows 63.
constexpr int kPanelRowsAvx2 = 4;

// x [M, K] float32 (row stride ldx) -> xq [M, K] int8 codes, sx [M, K/32] their scales and
// xs [M, K/32] = sx * sum(codes), per group of 32 as gemm_vnni.cpp's quantize_rows_q8 (scale
// max|x| / 127, rounded to nearest even): the same codes and factors.
void quantize_rows_avx2(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq, float* sx,
                        float* xs) {
  const int64_t G = K / 32;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* p = x + m * ldx + g * 32;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(p + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        a = _mm_max_ps(a, _mm_movehl_ps(a, a));
        a = _mm_max_ss(a, _mm_movehdup_ps(a));
        const float mx = _mm_cvtss_f32(a);
        const float scale = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        __m256i q[4];
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
          sum = _mm256_add_epi32(sum, q[i]);
        }
        // int32 -> int8 (|q| <= 127): packs interleave 128-bit lanes, the permute puts them back.
        const __m256i w16a = _mm256_packs_epi32(q[0], q[1]), w16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + g * 32), b8);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        sx[m * G + g] = scale;
        xs[m * G + g] = scale * static_cast<float>(_mm_cvtsi128_si32(s));
      }
  });
}

// Group g's factors of panel p for columns 8t..8t+7: float32 or float16 [P * G, 16] as
// q4_vnni_pack writes them and to_panels may narrow them (F: simd.h's factors8), or a Q4_K's
// as stored (simd.h's k_factor: d * sc, rounded the same).
template <typename F>
struct PlainFactors {
  const F* f;
  __m256 get(int64_t p, int64_t g, int64_t G, int t) const {
    return factors8(f + (p * G + g) * 16 + 8 * t);
  }
  // A line at a time, at the factors' pace (16 F a group against 256 bytes of words).
  void ahead(int64_t p, int64_t g, int64_t G) const {
    if (g % (64 / (16 * sizeof(F))) == 0)
      stream_ahead(f + (p * G + g) * 16, 1, kStreamAhead * sizeof(F) / 16);
  }
};
struct KFactors {
  const uint8_t* f;
  __m256 get(int64_t p, int64_t g, int64_t G, int t) const {
    const uint8_t* at = f + (p * (G / 8) + g / 8) * kKFactorBytes;
    const __m128i q =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 64 + (g % 8) * 16 + 8 * t));
    __m256 out = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8 * t),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
    asm("" : "+x"(out));  // rounded here, as k_factor's
    return out;
  }
  void ahead(int64_t p, int64_t g, int64_t G) const {
    if (g % 8 == 0)
      stream_ahead(f + (p * (G / 8) + g / 8) * kKFactorBytes, 3, kStreamAhead * 3 / 32);
  }
};

// out[r * ldo + c] for r < R, c in 8 t0..8 (t0 + H) - 1: R rows of (xq, sx, xs) against H halves
// of panel p from half t0 (words w, its groups' factors `scale` and `minv`). Half a panel a pass
// (H = 1) lets R rows' 16-bit sums and float accumulators fit in AVX2's 16 vector registers
// with the codes they meet: the whole panel at 4 rows needed about 26, and GCC spilled a third
// of the loop's vector operations to the stack (Zen 5, an AVX2 build: 512 rows over 16384 x
// 2048 66 ms in halves against 100, 8 decode rows 1.25 against 1.45); `panel_passes` chooses.
template <int R, int H, typename Factors>
void panel_rows_avx2(const int8_t* xq, const float* sx, const float* xs, int64_t K,
                     const uint32_t* w, int64_t p, int t0, const Factors& scale,
                     const Factors& minv, bool stream, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][H];
  RS_UNROLL for (int r = 0; r < R; ++r) RS_UNROLL for (int h = 0; h < H; ++h)
      acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint32_t* wg = w + g * 64 + 8 * t0;
    if (stream) {  // decode rows' first pass over the panels, which lie one after another
      stream_ahead(wg, 4);
      scale.ahead(p, g, G);
      minv.ahead(p, g, G);
    }
    __m256i sum[R][H];
    RS_UNROLL for (int r = 0; r < R; ++r) RS_UNROLL for (int h = 0; h < H; ++h)
        sum[r][h] = _mm256_setzero_si256();
    RS_UNROLL for (int j = 0; j < 4; ++j) {
      __m256i lo[H], hi[H];
      RS_UNROLL for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 16 * j + 8 * h));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      RS_UNROLL for (int r = 0; r < R; ++r) {
        int32_t wl, wh;
        std::memcpy(&wl, xq + r * K + g * 32 + 4 * j, 4);
        std::memcpy(&wh, xq + r * K + g * 32 + 16 + 4 * j, 4);
        const __m256i xl = _mm256_set1_epi32(wl), xh = _mm256_set1_epi32(wh);
        RS_UNROLL for (int h = 0; h < H; ++h) {
          const __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                              _mm256_maddubs_epi16(hi[h], xh));
          sum[r][h] = _mm256_add_epi16(sum[r][h], pr);
          asm("" : "+x"(sum[r][h]));  // summed here: GCC would hold all the products at once
        }
      }
    }
    RS_UNROLL for (int h = 0; h < H; ++h) {
      const __m256 s = scale.get(p, g, G, t0 + h), m = minv.get(p, g, G, t0 + h);
      RS_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(sx[r * G + g]), sumx = _mm256_set1_ps(xs[r * G + g]);
        const __m256 dot =
            _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][h], _mm256_set1_epi16(1)));
        acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, dx), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, sumx, acc[r][h]);
      }
    }
  }
  RS_UNROLL for (int r = 0; r < R; ++r) RS_UNROLL for (int h = 0; h < H; ++h)
      _mm256_storeu_ps(out + r * ldo + 8 * (t0 + h), acc[r][h]);
}

// The passes of R rows (x's rows from m on, of M in the call) over one panel, as
// `pass(H, t0, stream)`: a call of one or two rows (decode) takes the whole panel in one pass
// (H = 2), so it computes while it streams the weights in; otherwise half a panel a pass (H = 1,
// t0 = 0 then 1), so that R rows' sums fit AVX2's 16 vector registers, the first pass of
// `decode` rows streaming the weights. Q4_K's panels here, Q6_K's in gemm_q6k_vnni.cpp.
template <int R, typename Pass>
void panel_passes(int64_t M, int64_t m, bool decode, Pass&& pass) {
  if constexpr (R <= 2)
    if (M <= 2) return pass(std::integral_constant<int, 2>{}, 0, true);
  for (int t = 0; t < 2; ++t)
    pass(std::integral_constant<int, 1>{}, t, decode && m == 0 && t == 0);
}

// out [M, N] = x W^T on int4-vnni panels (words [P * G, 256], factors of any kind above).
template <typename Factors>
void panels_gemm_avx2(const at::Tensor& x, const uint32_t* words, const Factors& scale,
                      const Factors& minv, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, N = out.size(1), P = N / 16;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * G), xs(M * G);
  quantize_rows_avx2(x.data_ptr<float>(), x.stride(0), M, K, xq.data(), sx.data(), xs.data());
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const bool decode = M <= 8;  // one pass over the panels: stream them in
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint32_t* w = words + p * G * 64;
      for (int64_t m = 0; m < M;) {
        const int64_t rows = std::min<int64_t>(kPanelRowsAvx2, M - m);
        with_rows<kPanelRowsAvx2>(static_cast<int>(rows), [&](auto R) {
          panel_passes<decltype(R)::value>(M, m, decode, [&](auto H, int t0, bool stream) {
            panel_rows_avx2<decltype(R)::value, decltype(H)::value>(
                xq.data() + m * K, sx.data() + m * G, xs.data() + m * G, K, w, p, t0, scale,
                minv, stream, op + m * ldo + p * 16, ldo);
          });
        });
        m += rows;
      }
    }
  });
}

// q4_gemm_vnni's AVX2 form, on the operands as it checked them (M > 0).
void q4_gemm_panels_avx2(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                         const at::Tensor& pminv, const at::Tensor& out) {
  const auto* wp = static_cast<const uint32_t*>(words.data_ptr());
  if (pscale.scalar_type() == at::kByte)
    panels_gemm_avx2(x, wp, KFactors{pscale.data_ptr<uint8_t>()},
                     KFactors{pminv.data_ptr<uint8_t>()}, out);
  else if (pscale.scalar_type() == at::kHalf)
    panels_gemm_avx2(x, wp, PlainFactors<uint16_t>{static_cast<const uint16_t*>(pscale.data_ptr())},
                     PlainFactors<uint16_t>{static_cast<const uint16_t*>(pminv.data_ptr())}, out);
  else
    panels_gemm_avx2(x, wp, PlainFactors<float>{pscale.data_ptr<float>()},
                     PlainFactors<float>{pminv.data_ptr<float>()}, out);
}
#endif  // RS_AVX2

}  // namespace
}  // namespace radixserve

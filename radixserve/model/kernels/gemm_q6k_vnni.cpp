// A GGUF's Q6_K matrices on int8-vnni and int8-avx2, packed once into panels of 16 columns
// (q6k_vnni_pack, in place of the blocks) on which every row runs, decode or prefill
// (q6k_gemm_vnni: vpdpbusd with AVX-512 VNNI, vpmaddubsw without): as gemm_vnni.cpp's and
// gemm_panels_avx2.cpp's int4-vnni panels do for Q4_K. The blocks as stored (gguf_q8.cpp's row dot)
// spend a float multiply and add per 64 weights and input row on their scales; a panel's
// 16 columns share them, 8 times fewer.
// Each weight is w = d * sc * (q - 32): q a 6-bit code, sc an int8 scale per 16 weights, d a
// float16 per 256. With x quantized per group of 32 (gemm_vnni.cpp's quantize_rows),
//   y = sum over groups g and halves h of  sx_g * d * sc_{g,h} * (xq_{g,h} . q_{g,h} - 32 sum(xq_{g,h}))
// The integer dot products are exact; the sums over groups are float32, in group order, the
// same whatever the number of rows, so a row gives the same bits in a decode step or a chunk.
// Layout per panel p and group g (words [P * G, 384] uint8): 4 vectors of 16 words, word (j, c)
// = column c's codes 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles), then 2 vectors
// of their top 2 bits: vector k's byte (c, b) holds at bits 2i..2i+1 those of code 16k + 4i + b.
// Per panel and super-block of 8 groups (factors [P * K / 256, 320] uint8): the 16 columns'
// float32 d, then [16][16] int8 sc (sub-block of 16 weights, column). 0.83 bytes a weight in
// all, where the blocks take 0.82.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace radixserve {
namespace {

constexpr int64_t kQ6kGroupBytes = 384, kQ6kFactorBytes = 320, kQ6kBlockBytes = 210;

#ifdef RS_AVX2
// Q6_K blocks [rows, K / 256 x 210 bytes] (rows a multiple of 16) into q6k panels.
void q6k_vnni_pack_impl(const at::Tensor& blocks, int64_t K, const at::Tensor& words,
                        const at::Tensor& factors) {
  const int64_t S = K / 256, G = K / 32, row_bytes = S * kQ6kBlockBytes;
  check(K % 256 == 0 && blocks.is_contiguous() && blocks.numel() % (16 * row_bytes) == 0,
        "q6k_vnni_pack: contiguous Q6_K rows of K / 256 blocks, a multiple of 16 rows");
  const int64_t P = blocks.numel() / row_bytes / 16;
  check(words.is_contiguous() && words.numel() == P * G * kQ6kGroupBytes &&
            factors.is_contiguous() && factors.numel() == P * S * kQ6kFactorBytes,
        "q6k_vnni_pack: outputs [P * K / 32, 384] and [P * K / 256, 320] uint8");
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* wp = static_cast<uint8_t*>(words.data_ptr());
  uint8_t* fp = static_cast<uint8_t*>(factors.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t code[16][256];
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t sb = 0; sb < S; ++sb) {
        uint8_t* f = fp + (p * S + sb) * kQ6kFactorBytes;
        for (int c = 0; c < 16; ++c) {
          const uint8_t* row = bp + (p * 16 + c) * row_bytes;
          const uint8_t* b = row + sb * kQ6kBlockBytes;
          const float d = f16_at(b + 208);
          std::memcpy(f + 4 * c, &d, 4);
          for (int s = 0; s < 16; ++s) f[64 + s * 16 + c] = b[192 + s];
          for (int gi = 0; gi < 8; ++gi)  // kquants.cpp's codes of the group, less 32: + 32
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(code[c] + 32 * gi),
                _mm256_add_epi8(Q6KBlock::sub(row, sb * 8 + gi).codes, _mm256_set1_epi8(32)));
        }
        for (int gi = 0; gi < 8; ++gi) {
          uint8_t* dst = wp + (p * G + sb * 8 + gi) * kQ6kGroupBytes;
          for (int c = 0; c < 16; ++c) {
            const uint8_t* q = code[c] + 32 * gi;
            for (int j = 0; j < 4; ++j)
              for (int b = 0; b < 4; ++b)
                dst[j * 64 + c * 4 + b] =
                    static_cast<uint8_t>((q[4 * j + b] & 0x0F) | ((q[16 + 4 * j + b] & 0x0F) << 4));
            for (int k = 0; k < 2; ++k)
              for (int b = 0; b < 4; ++b) {
                int top = 0;
                for (int i = 0; i < 4; ++i) top |= (q[16 * k + 4 * i + b] >> 4) << (2 * i);
                dst[256 + k * 64 + c * 4 + b] = static_cast<uint8_t>(top);
              }
          }
        }
      }
  });
}

// Panel p as q6k_tile (AVX-512 VNNI) and q6k_rows_avx2 read it.
struct Q6kPanel {
  const uint8_t* w;  // the panel's first group
  const uint8_t* f;  // the panel's first super-block's factors
  // Top 2 bits of word j (bits 2i..2i+1 of its top-plane bytes, i = j % 4) moved to bits 4..5
  // (the caller masks them): vector shifts of 16-bit lanes, whose bits crossing a byte fall
  // outside 0x30.
  template <typename V, typename Shl, typename Shr>
  static V top_bits(V t, int j, Shl shl, Shr shr) {
    const int i = j % 4;
    return i == 0 ? shl(t, 4) : i == 1 ? shl(t, 2) : i == 2 ? t : shr(t, 2);
  }
  // Group g's word vector j (0..7; j < 4: codes of the first half), columns
  // 8t..8t+7 as 32 bytes of 6-bit codes (AVX2).
  __m256i codes8(int64_t g, int j, int t) const {
    const uint8_t* at = w + g * kQ6kGroupBytes;
    const __m256i v = load32(at + (j % 4) * 64 + 32 * t);
    const __m256i lo = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    const __m256i top = top_bits(
        load32(at + 256 + (j / 4) * 64 + 32 * t), j,
        [](__m256i a, int n) { return _mm256_slli_epi16(a, n); },
        [](__m256i a, int n) { return _mm256_srli_epi16(a, n); });
    return _mm256_or_si256(lo, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
  }
  // Group g's scales d * sc of half h for columns 8t..8t+7 (AVX2), rounded as scale()'s.
  __m256 scale8(int64_t g, int h, int t) const {
    const uint8_t* at = f + (g / 8) * kQ6kFactorBytes;
    const __m128i sc8 = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(at + 64 + (2 * (g % 8) + h) * 16 + 8 * t));
    __m256 r = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8 * t),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    asm("" : "+x"(r));  // rounded here, as k_factor's
    return r;
  }
#ifdef RS_AVX512_VNNI
  // Group g's word vector j (0..7; j < 4: codes of the first half): the 6-bit codes.
  __m512i codes(int64_t g, int j) const {
    const uint8_t* at = w + g * kQ6kGroupBytes;
    const __m512i v = _mm512_loadu_si512(at + (j % 4) * 64);
    const __m512i lo = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
    const __m512i top = top_bits(
        _mm512_loadu_si512(at + 256 + (j / 4) * 64), j,
        [](__m512i a, int n) { return _mm512_slli_epi16(a, n); },
        [](__m512i a, int n) { return _mm512_srli_epi16(a, n); });
    return _mm512_ternarylogic_epi32(lo, top, _mm512_set1_epi8(0x30), 0xF8);  // lo | (top & 0x30)
  }
  // Group g's 16 columns' scales d * sc of half h.
  __m512 scale(int64_t g, int h) const {
    const uint8_t* at = f + (g / 8) * kQ6kFactorBytes;
    const __m512i sc = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 64 + (2 * (g % 8) + h) * 16)));
    __m512 r = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(at)),
                             _mm512_cvtepi32_ps(sc));
    asm("" : "+v"(r));  // rounded here, as k_factor's
    return r;
  }
#endif
  // Decode rows walk the panels once: group g's reads, `bytes` ahead (simd.h's stream_ahead;
  // the factors at their pace, a ninth of the words').
  void ahead(int64_t g, int64_t bytes) const {
    stream_ahead(w + g * kQ6kGroupBytes, 6, bytes);
    if (g % 8 == 0) stream_ahead(f + (g / 8) * kQ6kFactorBytes, 5, bytes * 5 / 48);
  }
};

// A Q6kPanel's codes unpacked into bytes (`c` [G][8][64]) for long chunks, whose many rows
// would each pay the 2-bit plane's unpacking again; the same codes and scales, so the same bits.
struct Q6kBytes {
  const uint8_t* c;
  Q6kPanel panel;
  __m256i codes8(int64_t g, int j, int t) const { return load32(c + (g * 8 + j) * 64 + 32 * t); }
  __m256 scale8(int64_t g, int h, int t) const { return panel.scale8(g, h, t); }
#ifdef RS_AVX512_VNNI
  __m512i codes(int64_t g, int j) const { return _mm512_loadu_si512(c + (g * 8 + j) * 64); }
  __m512 scale(int64_t g, int h) const { return panel.scale(g, h); }
#endif
  void ahead(int64_t, int64_t) const {}  // unpacked per call: in cache already
  static void unpack(const Q6kPanel& p, int64_t G, uint8_t* c) {
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < 8; ++j)
        for (int t = 0; t < 2; ++t)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + (g * 8 + j) * 64 + 32 * t),
                              p.codes8(g, j, t));
  }
};
#endif  // RS_AVX2

#ifdef RS_AVX512_VNNI
// out[r, 16 t..] for R rows of xq (signed codes, sx their scales, bias [R][2G]: -32 times each
// half group's sum) and NT panels.
template <int R, int NT, typename Panel>
void q6k_tile(const int8_t* xq, const float* sx, const int32_t* bias, int64_t K,
              const Panel* panels, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  __m512 acc[R][NT];
  RS_UNROLL
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (NT == 1) panels[0].ahead(g, R > 1 ? kStreamAheadRows : kStreamAhead);
    __m512i dot[2][R][NT];
    RS_UNROLL
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < NT; ++t) dot[h][r][t] = _mm512_setzero_si512();
    RS_UNROLL
    for (int j = 0; j < 8; ++j) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = panels[t].codes(g, j);
      RS_UNROLL
      for (int r = 0; r < R; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * K + g * 32 + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(word);
        for (int t = 0; t < NT; ++t) dot[j / 4][r][t] = _mm512_dpbusd_epi32(dot[j / 4][r][t], w[t], xb);
      }
    }
    RS_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m512 s[2] = {panels[t].scale(g, 0), panels[t].scale(g, 1)};
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(sx[r * G + g]);
        for (int h = 0; h < 2; ++h) {
          const __m512i d = _mm512_add_epi32(dot[h][r][t], _mm512_set1_epi32(bias[r * 2 * G + 2 * g + h]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s[h], x), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + r * ldo + 16 * t, acc[r][t]);
}

constexpr int kQ6kDecodeRows = 8;  // rows a pass over one panel (decode: up to 8 rows)
constexpr int kQ6kChunkRows = 4;   // rows a pass over two panels (chunks: 16 + 8 accumulators)
// Chunks from this many rows unpack each pair of panels into bytes first (Q6kBytes). Zen 5, 3072
// x 8192 at 512 rows: 23.1 ms on the panels, 20.9 unpacked first (the blocks' per-call panels,
// kquant_gemm_vnni: 21.4-21.6); at 64 rows the panels take 3.0 ms against those 4.0.
constexpr int64_t kQ6kUnpackRows = 128;

// out [M, N] = x W^T on q6k panels; operands checked by q6k_gemm_vnni.
void q6k_gemm_vnni_impl(const at::Tensor& x, const at::Tensor& words, const at::Tensor& factors,
                        const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = K / 256, N = out.size(1), P = N / 16;
  const QuantizedRows q = quantize_rows(x, false);
  const std::vector<int32_t> bias = half_group_sums(q.xq, -32);
  const uint8_t* wp = static_cast<const uint8_t*>(words.data_ptr());
  const uint8_t* fp = static_cast<const uint8_t*>(factors.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0), span = M > kQ6kDecodeRows ? 2 : 1;
  const int64_t units = (P + span - 1) / span, panel_bytes = G * kQ6kGroupBytes;
  const bool unpack = M >= kQ6kUnpackRows;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint8_t> bytes(unpack ? 2 * G * 8 * 64 : 0);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p = u * span, nt = std::min(span, P - p), last = p + nt - 1;
      if (span == 2 && u + 2 < u1) {  // chunks: the unit after next into L2
        const int64_t next = (u + 2) * span, n_next = std::min(span, P - next);
        prefetch_l2(wp + next * panel_bytes, n_next * panel_bytes);
        prefetch_l2(fp + next * S * kQ6kFactorBytes, n_next * S * kQ6kFactorBytes);
      }
      const Q6kPanel panels[2] = {{wp + p * panel_bytes, fp + p * S * kQ6kFactorBytes},
                                  {wp + last * panel_bytes, fp + last * S * kQ6kFactorBytes}};
      auto run = [&](const auto* tiles) {
        const int rows = nt == 2 ? kQ6kChunkRows : kQ6kDecodeRows;
        for (int64_t m = 0; m < M; m += rows) {
          const int mr = static_cast<int>(std::min<int64_t>(rows, M - m));
          const int8_t* xr = q.xq.data() + m * K;
          const float* sr = q.sx.data() + m * G;
          const int32_t* br = bias.data() + m * 2 * G;
          float* o = op + m * ldo + p * 16;
          if (nt == 2)
            with_rows<kQ6kChunkRows>(mr, [&](auto Rc) {
              q6k_tile<decltype(Rc)::value, 2>(xr, sr, br, K, tiles, o, ldo);
            });
          else
            with_rows<kQ6kDecodeRows>(mr, [&](auto Rc) {
              q6k_tile<decltype(Rc)::value, 1>(xr, sr, br, K, tiles, o, ldo);
            });
        }
      };
      if (unpack) {
        for (int64_t t = 0; t < nt; ++t) Q6kBytes::unpack(panels[t], G, bytes.data() + t * G * 512);
        const Q6kBytes tiles[2] = {{bytes.data(), panels[0]},
                                   {bytes.data() + (nt - 1) * G * 512, panels[1]}};
        run(tiles);
      } else {
        run(panels);
      }
    }
  });
}
#endif  // RS_AVX512_VNNI

#ifdef RS_AVX2
// out[r * ldo + c], c in 8 t0..8 (t0 + H) - 1, for R rows of xq (sx their scales, bias as
// q6k_tile's) against H halves of one panel from half t0, on AVX2 without VNNI (int8-avx2)
// through vpmaddubsw: per column and row, two words' pair sums added in 16 bits (|sum| <= 2 x 2
// x 63 x 127 = 32,004) and widened by vpmaddwd; each half group's dot then scaled as q6k_tile
// scales it, in its order, so a row gets the bits it gets on AVX-512 VNNI. Half a panel a pass
// (H = 1) fits AVX2's 16 vector registers (gemm_panels_avx2.cpp's panel_passes chooses): the
// whole panel at 4 rows spilled about a quarter of the loop's vector operations to the stack.
template <int R, int H, typename Panel>
void q6k_rows_avx2(const int8_t* xq, const float* sx, const int32_t* bias, int64_t K,
                   const Panel& panel, int t0, bool stream, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][H];
  RS_UNROLL for (int r = 0; r < R; ++r) RS_UNROLL for (int h = 0; h < H; ++h)
      acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (stream) panel.ahead(g, R > 1 ? kStreamAheadRows : kStreamAhead);
    RS_UNROLL for (int half = 0; half < 2; ++half) {  // of the group: q6k_tile's scale each
      RS_UNROLL for (int h = 0; h < H; ++h) {
        const int t = t0 + h;
        __m256i dot[R];
        RS_UNROLL for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
        RS_UNROLL for (int j = 4 * half; j < 4 * half + 4; j += 2) {
          const __m256i w0 = panel.codes8(g, j, t), w1 = panel.codes8(g, j + 1, t);
          RS_UNROLL for (int r = 0; r < R; ++r) {
            int32_t a, b;
            std::memcpy(&a, xq + r * K + g * 32 + 4 * j, 4);
            std::memcpy(&b, xq + r * K + g * 32 + 4 * j + 4, 4);
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(a)),
                                 _mm256_maddubs_epi16(w1, _mm256_set1_epi32(b)));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
            asm("" : "+x"(dot[r]));  // summed here: GCC would hold all the products at once
          }
        }
        const __m256 s = panel.scale8(g, half, t);
        RS_UNROLL for (int r = 0; r < R; ++r) {
          const __m256i d =
              _mm256_add_epi32(dot[r], _mm256_set1_epi32(bias[r * 2 * G + 2 * g + half]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                      _mm256_mul_ps(s, _mm256_set1_ps(sx[r * G + g])), acc[r][h]);
        }
      }
    }
  }
  RS_UNROLL for (int r = 0; r < R; ++r) RS_UNROLL for (int h = 0; h < H; ++h)
      _mm256_storeu_ps(out + r * ldo + 8 * (t0 + h), acc[r][h]);
}

// q6k_gemm_vnni's AVX2 form: passes of 4 rows over each panel (gemm_panels_avx2.cpp's).
void q6k_gemm_avx2_impl(const at::Tensor& x, const at::Tensor& words, const at::Tensor& factors,
                        const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = K / 256, P = out.size(1) / 16;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * G), xs(M * G);
  quantize_rows_avx2(x.data_ptr<float>(), x.stride(0), M, K, xq.data(), sx.data(), xs.data());
  const std::vector<int32_t> bias = half_group_sums(xq, -32);
  const uint8_t* wp = static_cast<const uint8_t*>(words.data_ptr());
  const uint8_t* fp = static_cast<const uint8_t*>(factors.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  // Decode rows (up to 8) stream the panels in; more rows meet each panel in several passes,
  // over its codes unpacked first. Zen 5 (an AVX2 build), 2048 x 8192: 16 rows 1.64 ms
  // unpacked against 1.75, 128 rows 12.5 against 13.5, 512 rows 51.3 against 54.2 (the blocks
  // on the float32 kernels: 3.7, 17.8, 69.9).
  const bool decode = M <= 8, unpack = !decode;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> bytes(unpack ? G * 8 * 64 : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const Q6kPanel panel{wp + p * G * kQ6kGroupBytes, fp + p * S * kQ6kFactorBytes};
      auto run = [&](const auto& tile) {
        for (int64_t m = 0; m < M; m += kPanelRowsAvx2)
          with_rows<kPanelRowsAvx2>(
              static_cast<int>(std::min<int64_t>(kPanelRowsAvx2, M - m)), [&](auto R) {
                panel_passes<decltype(R)::value>(M, m, decode, [&](auto H, int t0, bool stream) {
                  q6k_rows_avx2<decltype(R)::value, decltype(H)::value>(
                      xq.data() + m * K, sx.data() + m * G, bias.data() + m * 2 * G, K, tile, t0,
                      stream, op + m * ldo + p * 16, ldo);
                });
              });
      };
      if (unpack) {
        Q6kBytes::unpack(panel, G, bytes.data());
        run(Q6kBytes{bytes.data(), panel});
      } else {
        run(panel);
      }
    }
  });
}

// kquant_gemm_avx2's work (ops.h). Packing costs a fraction of the GEMM it serves: on the Zen 5
// (an AVX2 build), the 1B Q4_K_M's mixed qkv (2560 rows of Q4_K, 512 of Q6_K, K 2048) packed in
// 0.35-0.6 ms, then 512 rows took 13.8 ms in all against 26.6 on the float32 kernels, 16 rows
// 0.79 against 2.59.
void kquant_gemm_avx2_impl(const at::Tensor& x, int64_t kind, const uint8_t* blocks, int64_t N,
                           const at::Tensor& out) {
  const int64_t K = x.size(1), P = N / 16, G = K / 32, S = K / 256;
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  if (kind == kQ4_K) {
    const at::Tensor b = at::from_blob(const_cast<uint8_t*>(blocks), {N * S * 144}, bytes);
    const at::Tensor words = at::empty({P * G, 256}, bytes);
    const at::Tensor scale = at::empty({P * S, kKFactorBytes}, bytes);
    const at::Tensor minv = at::empty({P * S, kKFactorBytes}, bytes);
    q4k_vnni_pack_impl(b, K, words, scale, minv);
    q4_gemm_panels_avx2(x, words, scale, minv, out);
  } else {
    const at::Tensor b =
        at::from_blob(const_cast<uint8_t*>(blocks), {N * S * kQ6kBlockBytes}, bytes);
    const at::Tensor words = at::empty({P * G, kQ6kGroupBytes}, bytes);
    const at::Tensor factors = at::empty({P * S, kQ6kFactorBytes}, bytes);
    q6k_vnni_pack_impl(b, K, words, factors);
    q6k_gemm_avx2_impl(x, words, factors, out);
  }
}
#endif  // RS_AVX2

void q6k_vnni_pack([[maybe_unused]] const at::Tensor& blocks, [[maybe_unused]] int64_t K,
                   [[maybe_unused]] const at::Tensor& words,
                   [[maybe_unused]] const at::Tensor& factors) {
#ifdef RS_AVX2
  q6k_vnni_pack_impl(blocks, K, words, factors);
#else
  check(false, "this build has no AVX2 code");
#endif
}

}  // namespace

bool kquant_gemm_avx2([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] int64_t kind,
                      [[maybe_unused]] const uint8_t* blocks, [[maybe_unused]] int64_t N,
                      [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX2
  if ((kind != kQ4_K && kind != kQ6_K) || N % 16 != 0 || x.size(1) % 256 != 0) return false;
  kquant_gemm_avx2_impl(x, kind, blocks, N, out);
  return true;
#else
  return false;
#endif
}

void q6k_gemm_vnni([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] const at::Tensor& words,
                   [[maybe_unused]] const at::Tensor& factors,
                   [[maybe_unused]] const at::Tensor& out) {
#ifdef RS_AVX2
  const int64_t K = x.size(1), N = out.size(1);
  check_rows(x, out, N);
  check(K % 256 == 0 && N % 16 == 0, "q6k_gemm_vnni: K must be a multiple of 256 and N of 16");
  check(words.is_contiguous() && words.numel() == N / 16 * (K / 32) * kQ6kGroupBytes &&
            factors.is_contiguous() && factors.numel() == N / 16 * (K / 256) * kQ6kFactorBytes,
        "q6k_gemm_vnni: panels of q6k_vnni_pack for [N, K]");
  if (x.size(0) == 0) return;
#ifdef RS_AVX512_VNNI
  if (cpu_has_avx512_vnni()) return q6k_gemm_vnni_impl(x, words, factors, out);
#endif
  q6k_gemm_avx2_impl(x, words, factors, out);  // without VNNI: vpmaddubsw
#else
  check(false, "this build has no AVX2 code");
#endif
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("q6k_vnni_pack(Tensor blocks, int K, Tensor(a!) words, Tensor(b!) factors) -> ()");
  m.def("q6k_gemm_vnni(Tensor x, Tensor words, Tensor factors, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q6k_vnni_pack", &radixserve::q6k_vnni_pack);
  m.impl("q6k_gemm_vnni", &radixserve::q6k_gemm_vnni);
}

// Weight-only quantized GEMM on the CPU's bfloat16 matrix units, for prefill chunks: y = x W^T
// with x float32 [M, K] rounded to bfloat16 once, W in int4 or int8 codes (gemm.cpp's formats,
// or int4 in gemm_vnni.cpp's panels, whose decode rows run there on int8 activations)
// dequantized into bfloat16 panels 32 columns at a time (never whole: no second copy of the
// weights), float32 sums, float32 out.
//   AMX (unit 2): a 32x32 block of y is four 16x16 float32 tiles; each 32 k, two 16x32 tiles
//                 of x and two 16-pair tiles of the panel meet in four tile products.
//   AVX-512 BF16 (unit 1): the same panels, a 12x32 register tile of vdpbf16ps (each a pair
//                 of k products into 16 float32 lanes).
// Each weight is dequantized exactly as in gemm.cpp (scale * q + min in float32) and then
// rounded to bfloat16, so the result is x_bf16 @ bf16(dequantized W)^T summed in float32.
// The *_silu ops take gate_up's [gate; up] and write silu(gate) * up (a SwiGLU MLP's
// activation): half the output, and no second pass over it.
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

// q4_tile from int4-vnni panels (gemm_vnni.cpp's q4_vnni_pack: 16 columns a panel, group g's
// 64 words [4][16] with word (j, c) = column c's code bytes 4j..4j+3, low nibbles codes 4j..,
// high ones 16 + 4j..; the group's 16 scales s and mins m beside them, as float32 or as a
// Q4_K's factors): the tile of the 64 words at w. Lane c of code k's vector is already column
// c's, so pairs of k rows need no transpose; each weight is the same fmadd and rounding as
// q4_tile's, so the tile has the same bits.
inline void q4v_tile(const uint32_t* w, __m512 s, __m512 m, uint32_t* dst) {
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  __m512i v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(w + j * 16);
  auto weight = [&](int k) {  // code k of the group, every column
    const int shift = 8 * (k % 4) + (k < 16 ? 0 : 4);
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v[(k % 16) / 4], shift), nibble);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, m);
  };
  for (int q = 0; q < 16; ++q)
    _mm512_store_si512(dst + q * 16, bf16_pairs(weight(2 * q), weight(2 * q + 1)));
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

// A grow-only buffer of n 32-bit words kept by the calling thread (64-byte aligned): x in
// bfloat16 is megabytes, and allocating it afresh every call would fault its pages in.
inline uint32_t* thread_words(int64_t n) {
  thread_local std::vector<uint32_t> buf;
  if (static_cast<int64_t>(buf.size()) < n + 16) buf.resize(n + 16);
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~63ull);
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

// silu(gate) * up for 16 lanes (silu_mul's formula: e^-|x| <= 1 keeps exp512 exact).
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));  // e^-|x|
  const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __mmask16 neg = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sig = _mm512_mask_mul_ps(r, neg, e, r);  // x < 0: e / (1 + e)
  return _mm512_mul_ps(_mm512_mul_ps(gate, sig), up);
}

// What a block of sums [rows, 16 nt] (row stride 32 floats, at src) becomes in out at row m0:
// the columns n.. as they are, or (Gated) silu(columns 0-15) * columns 16-31 into the 16
// columns n.. (gate_up's gate and up rows side by side in one panel).
template <bool Gated>
struct Emit {
  float* out;
  int64_t ldo;
  inline void operator()(const float* src, int64_t rows, int64_t nt, int64_t m0,
                         int64_t n) const {
    float* o = out + m0 * ldo + n;
    for (int64_t i = 0; i < rows; ++i, src += 32, o += ldo) {
      if constexpr (Gated) {
        _mm512_storeu_ps(o, silu_times(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16)));
      } else {
        for (int64_t t = 0; t < nt; ++t)
          _mm512_storeu_ps(o + 16 * t, _mm512_loadu_ps(src + 16 * t));
      }
    }
  }
};

#ifdef RS_AMX
// One panel (nt = 1 or 2 tiles wide) times every 32-row block of xb [Mp, K] on the tiles:
// tmm0-3 the 2x2 accumulators, tmm4-5 x, tmm6-7 the panel. Whole blocks of plain sums go
// straight into out; the rest (the last rows, every gated block) through two scratch blocks
// [32, 32], each emitted after the next block's products are under way: vector loads right
// after tile stores to the same lines would wait for the stores to reach the cache.
template <int NT, bool Gated>
void panel_amx(const uint32_t* xb, int64_t M, int64_t Mp, int64_t K, const uint32_t* panel,
               const Emit<Gated>& emit, int64_t n, float* scratch) {
  const int64_t G = K / 32, lda = K * 2;
  int64_t pending = -1;  // the block waiting in scratch
  auto finish = [&](int64_t m) {
    emit(scratch + ((m / 32) & 1) * 1024, std::min<int64_t>(32, M - m), NT, m, n);
  };
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
    const bool direct = !Gated && m + 32 <= M;
    if (direct) {
      float* o = emit.out + m * emit.ldo + n;
      const int64_t ld = emit.ldo * 4;
      _tile_stored(0, o, ld);
      _tile_stored(2, o + 16 * emit.ldo, ld);
      if (NT == 2) {
        _tile_stored(1, o + 16, ld);
        _tile_stored(3, o + 16 * emit.ldo + 16, ld);
      }
    } else {
      float* buf = scratch + ((m / 32) & 1) * 1024;
      _tile_stored(0, buf, 128);
      _tile_stored(2, buf + 16 * 32, 128);
      if (NT == 2) {
        _tile_stored(1, buf + 16, 128);
        _tile_stored(3, buf + 16 * 32 + 16, 128);
      }
    }
    if (pending >= 0) finish(pending);
    pending = direct ? -1 : m;
  }
  if (pending >= 0) finish(pending);
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

// One panel times every row of xb on AVX-512 BF16 (plain sums straight into out, gated ones
// through a scratch block).
template <int NT, bool Gated>
void panel_avx512(const uint32_t* xb, int64_t M, int64_t K, const uint32_t* panel,
                  const Emit<Gated>& emit, int64_t n, float* scratch) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; m += kDpRows) {
    const int mr = static_cast<int>(std::min<int64_t>(kDpRows, M - m));
    float* C = Gated ? scratch : emit.out + m * emit.ldo + n;
    const int64_t ldc = Gated ? 32 : emit.ldo;
    with_rows<kDpRows>(
        mr, [&](auto R) { tile_dp<R, NT>(xb + m * (K / 2), K / 2, panel, G, C, ldc); });
    if (Gated) emit(scratch, mr, NT, m, n);
  }
}

// y = x W^T on `unit` into out, W's panels filled by tile(row, g, dst): plain, out [M, N]
// (N = W's rows); Gated, W = [gate; up] (N rows each of I = N / 2) and out [M, I] =
// silu(x gate^T) * (x up^T).
template <bool Gated, typename Tile>
void gemm_bf16(const at::Tensor& x, int64_t N, const at::Tensor& out, int64_t unit, Tile tile) {
  const int64_t M = x.size(0), K = x.size(1), width = Gated ? N / 2 : N;
  check(x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 rows");
  check(out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == M &&
            out.size(1) == width,
        "out must be float32 rows [M, N] ([M, N/2] for silu(gate) * up)");
  check(K % 32 == 0 && width % 16 == 0, "K must be a multiple of 32 and N of 16 (gated: 32)");
  const bool amx = unit == static_cast<int64_t>(MatrixUnit::kAmx);
#ifdef RS_AMX
  check(!amx || amx_ready(), "AMX is unavailable: Linux refused the tile permission");
#else
  check(!amx, "this build has no AMX code");
#endif
  check(amx || unit == static_cast<int64_t>(MatrixUnit::kAvx512Bf16), "unknown matrix unit");
  if (M == 0) return;
  const int64_t Mp = amx ? (M + 31) / 32 * 32 : M;
  uint32_t* xb = thread_words(Mp * K / 2);
  rows_to_bf16(x.data_ptr<float>(), x.stride(0), M, Mp, K, xb);
  const Emit<Gated> emit{out.data_ptr<float>(), out.stride(0)};
  // A block: 32 output columns (two tiles) or, gated, 16 (a gate tile and its up tile).
  const int64_t G = K / 32, cols = Gated ? 16 : kBlockCols, blocks = (width + cols - 1) / cols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    WordBuffer panel(G * 2 * kTileWords);
    alignas(64) float scratch[2 * 32 * 32];
#ifdef RS_AMX
    if (amx) amx_begin();
#endif
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * cols, nt = Gated ? 2 : std::min<int64_t>(2, (width - n) / 16);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t row = Gated ? n + t * width : n + 16 * t;  // gated: gate, then up
          tile(row, g, panel.data() + (2 * g + t) * kTileWords);
        }
#ifdef RS_AMX
      if (amx) {
        nt == 2 ? panel_amx<2, Gated>(xb, M, Mp, K, panel.data(), emit, n, scratch)
                : panel_amx<1, Gated>(xb, M, Mp, K, panel.data(), emit, n, scratch);
        continue;
      }
#endif
      nt == 2 ? panel_avx512<2, Gated>(xb, M, K, panel.data(), emit, n, scratch)
              : panel_avx512<1, Gated>(xb, M, K, panel.data(), emit, n, scratch);
    }
#ifdef RS_AMX
    if (amx) amx_end();
#endif
  });
}
#endif  // RS_AVX512_BF16

// The matrix units this build and CPU run, by the names kernels/matrix.py uses: "avx512-bf16",
// "amx-bf16" (asking Linux for AMX's tile state once; refused: not listed), "int8-vnni" and
// "int8-avx2".
std::vector<std::string> matrix_units() {
  std::vector<std::string> units;
#ifdef RS_AVX512_BF16
  if (cpu_has_avx512_bf16()) units.push_back("avx512-bf16");
#ifdef RS_AMX
  if (amx_ready() && cpu_has_avx512_bf16()) units.push_back("amx-bf16");
#endif
#endif
  if (vnni_available()) units.push_back("int8-vnni");  // gemm_vnni.cpp
#ifdef RS_AVX2
  units.push_back("int8-avx2");  // gguf_q8.cpp
#endif
  return units;
}

// out = x W^T for int4 codes on a matrix unit (see the top of this file); with `silu`, W is
// gate_up [2I, K] and out [M, I] = silu(x gate^T) * (x up^T).
void q4_gemm_bf16_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& minv, const at::Tensor& out, int64_t unit, bool silu) {
#ifdef RS_AVX512_BF16
  const int64_t N = qs.size(0), K = x.size(1);
  check(qs.size(1) == K / 2 && qs.is_contiguous() && scale.is_contiguous() &&
            minv.is_contiguous(),
        "int4 codes, scale and min must be contiguous [N, K/2], [N, K/32]");
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  auto tile = [&](int64_t n, int64_t g, uint32_t* dst) { q4_tile(qp, sp, mp, N, K, n, g, dst); };
  silu ? gemm_bf16<true>(x, N, out, unit, tile) : gemm_bf16<false>(x, N, out, unit, tile);
#else
  check(false, "this build has no bfloat16 matrix code (no AVX-512 BF16)");
#endif
}

// q4_gemm_bf16_impl on int4-vnni panels (words [P * G, 256] uint8, factors as
// gemm_vnni.cpp's check_panels takes them; N = out's columns, or twice them with
// `silu`): the same bits as on the codes the panels were packed from.
void q4v_gemm_bf16_impl(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                        const at::Tensor& pminv, const at::Tensor& out, int64_t unit, bool silu) {
#ifdef RS_AVX512_BF16
  const int64_t K = x.size(1), G = K / 32, N = out.size(1) * (silu ? 2 : 1), P = N / 16;
  check(K % 32 == 0 && N % 16 == 0, "q4v_gemm_bf16: K must be a multiple of 32 and N of 16");
  check_panels(words, pscale, pminv, P, G, "q4v_gemm_bf16");
  const uint32_t* wp = static_cast<const uint32_t*>(words.data_ptr());
  auto run = [&](auto tile) {
    silu ? gemm_bf16<true>(x, N, out, unit, tile) : gemm_bf16<false>(x, N, out, unit, tile);
  };
  if (pscale.scalar_type() == at::kByte) {  // a Q4_K's factors as stored
    const auto* sp = static_cast<const uint8_t*>(pscale.data_ptr());
    const auto* mp = static_cast<const uint8_t*>(pminv.data_ptr());
    run([&](int64_t n, int64_t g, uint32_t* dst) {
      const int64_t p = n / 16;
      q4v_tile(wp + (p * G + g) * 64, k_factor(sp, G, p, g), k_factor(mp, G, p, g), dst);
    });
    return;
  }
  auto plain = [&](const auto* sp, const auto* mp) {  // factors [P * G, 16]: float32, float16
    run([&](int64_t n, int64_t g, uint32_t* dst) {
      const int64_t at = (n / 16) * G + g;
      q4v_tile(wp + at * 64, factors16(sp + at * 16), factors16(mp + at * 16), dst);
    });
  };
  if (pscale.scalar_type() == at::kHalf)
    plain(static_cast<const uint16_t*>(pscale.data_ptr()),
          static_cast<const uint16_t*>(pminv.data_ptr()));
  else
    plain(pscale.data_ptr<float>(), pminv.data_ptr<float>());
#else
  check(false, "this build has no bfloat16 matrix code (no AVX-512 BF16)");
#endif
}

void q8_gemm_bf16_impl(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& out, int64_t unit, bool silu) {
#ifdef RS_AVX512_BF16
  const int64_t N = qs.size(0), K = x.size(1);
  check(qs.size(1) == K && qs.is_contiguous() && scale.is_contiguous(),
        "int8 codes and scale must be contiguous [N, K], [N, K/32]");
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto tile = [&](int64_t n, int64_t g, uint32_t* dst) { q8_tile(qp, sp, N, K, n, g, dst); };
  silu ? gemm_bf16<true>(x, N, out, unit, tile) : gemm_bf16<false>(x, N, out, unit, tile);
#else
  check(false, "this build has no bfloat16 matrix code (no AVX-512 BF16)");
#endif
}

void q4_gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor& minv, const at::Tensor& out, int64_t unit) {
  q4_gemm_bf16_impl(x, qs, scale, minv, out, unit, false);
}
void q4v_gemm_bf16(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                   const at::Tensor& pminv, const at::Tensor& out, int64_t unit) {
  q4v_gemm_bf16_impl(x, words, pscale, pminv, out, unit, false);
}
void q4v_gemm_bf16_silu(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                        const at::Tensor& pminv, const at::Tensor& out, int64_t unit) {
  q4v_gemm_bf16_impl(x, words, pscale, pminv, out, unit, true);
}
void q8_gemm_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor& out, int64_t unit) {
  q8_gemm_bf16_impl(x, qs, scale, out, unit, false);
}
void q4_gemm_bf16_silu(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& minv, const at::Tensor& out, int64_t unit) {
  q4_gemm_bf16_impl(x, qs, scale, minv, out, unit, true);
}
void q8_gemm_bf16_silu(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                       const at::Tensor& out, int64_t unit) {
  q8_gemm_bf16_impl(x, qs, scale, out, unit, true);
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("matrix_units() -> str[]", &radixserve::matrix_units);  // no tensors: no key
  m.def(
      "q4_gemm_bf16(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out, int unit) "
      "-> ()");
  m.def("q8_gemm_bf16(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out, int unit) -> ()");
  m.def(
      "q4v_gemm_bf16(Tensor x, Tensor words, Tensor pscale, Tensor pminv, Tensor(a!) out, "
      "int unit) -> ()");
  m.def(
      "q4v_gemm_bf16_silu(Tensor x, Tensor words, Tensor pscale, Tensor pminv, Tensor(a!) out, "
      "int unit) -> ()");
  m.def(
      "q4_gemm_bf16_silu(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out, "
      "int unit) -> ()");
  m.def(
      "q8_gemm_bf16_silu(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out, int unit) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q4_gemm_bf16", &radixserve::q4_gemm_bf16);
  m.impl("q8_gemm_bf16", &radixserve::q8_gemm_bf16);
  m.impl("q4v_gemm_bf16", &radixserve::q4v_gemm_bf16);
  m.impl("q4v_gemm_bf16_silu", &radixserve::q4v_gemm_bf16_silu);
  m.impl("q4_gemm_bf16_silu", &radixserve::q4_gemm_bf16_silu);
  m.impl("q8_gemm_bf16_silu", &radixserve::q8_gemm_bf16_silu);
}

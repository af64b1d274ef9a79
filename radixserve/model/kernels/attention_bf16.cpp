// Prefill attention in bfloat16 (on AMX tiles, or AVX-512 BF16's vdpbf16ps where there is no
// AMX): a chunk of new tokens, causal over its cached prefix, with QK^T and PV as bfloat16
// products summed in float32 and the softmax in float32.
//
// Transposed, so the softmax needs no horizontal reductions: for 16 query tokens of one head,
//   S^T [keys, 16] = K [keys, D] . (scale Q)^T   A: 16 keys x 32 dims of K, B: Q^T's pairs
//   O^T [D, 16]   += V^T [D, keys] . P^T          A: 16 dims x 32 keys of V^T, B: P^T's pairs
// A query is a lane of every vector: its running max, sum and rescaling are lane-wise. Without
// AMX each row of A is a vector of accumulators: one of its pairs broadcast times B's vector of
// that pair per vdpbf16ps (the same products and sums, in another order).
// The context's K and V^T are first rounded to bfloat16 per KV head (once per call, every
// layer: the pool stays in its own dtype), then every (head, 16-token tile) runs 128 keys a
// step with an online softmax, heaviest tiles first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "kv.h"
#include "simd.h"

namespace radixserve {
namespace {

#ifdef RS_AVX512_BF16
constexpr int64_t kStepKeys = 128;  // keys per step of a unit (its scores: 8 KB)

// A grow-only bfloat16 buffer kept by the calling thread: the context's copy is megabytes,
// and allocating it afresh every layer would fault its pages in every time.
inline uint16_t* context_buffer(int64_t n) {
  thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n + 64);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~63ull);
}

// Keys [k0, k0 + 16) of KV head h (rows past `ctx` zero) rounded to bfloat16: K rows into kc
// [ctx_pad, D], V transposed into vt [D, ctx_pad].
template <typename T>
void context_block(const T* kp, const T* vp, const int64_t* bid, int64_t BS, int64_t KVH,
                   int64_t D, int64_t h, int64_t k0, int64_t ctx, int64_t ctx_pad, uint16_t* kc,
                   uint16_t* vt) {
  const T* krow[16];
  const T* vrow[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t t = k0 + j;
    if (t < ctx) {
      const int64_t row = (bid[t / BS] * BS + t % BS) * KVH + h;
      krow[j] = kp + row * D, vrow[j] = vp + row * D;
    } else {
      krow[j] = vrow[j] = nullptr;
    }
  }
  for (int j = 0; j < 16; ++j) {
    uint16_t* dst = kc + (k0 + j) * D;
    if (krow[j] == nullptr) {
      std::memset(dst, 0, D * 2);
      continue;
    }
    for (int64_t d = 0; d < D; d += 32)
      _mm512_storeu_si512(dst + d, bf16_x32(kv_load16(krow[j] + d), kv_load16(krow[j] + d + 16)));
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = vrow[j] == nullptr ? _mm512_setzero_ps() : kv_load16(vrow[j] + d);
    transpose16(r);  // r[i]: dimension d + i of the 16 keys
    for (int i = 0; i < 16; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (d + i) * ctx_pad + k0),
                          bf16_x16(r[i]));
  }
}

// Masked keys' scores, and the running max before any key: finite, so that differences of
// them stay finite (-inf - -inf would be NaN); 2^(kMasked - anything seen) is 0.
constexpr float kMasked = -1e30f;

// 2^x for x <= 0 (the softmax in log2 units: scores carry log2 e in their scale): 2^round(x)
// times a degree-4 polynomial of the rest on [-0.5, 0.5] (within 4e-6 relative, far inside
// the bfloat16 rounding the probabilities get). Very negative x (masked keys) gives
// scalef(1, round(x)) = 0, with no clamp.
inline __m512 exp2_softmax(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.3333558146e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

#ifdef RS_AMX
// Scores S^T [16 NK keys, 16 lanes] of the NK (2 or 4) key tiles from kc's row 0 (row stride
// D) against Q^T's pairs qt: one accumulator tile per key tile (tmm0..), so NK chains run
// side by side; K tiles rotate through tmm4-6, Q^T in tmm7.
template <int NK>
inline void score_tiles(const uint16_t* kc, int64_t D, const uint32_t* qt, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NK == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t lda = D * 2;
  for (int64_t dc = 0; dc < D / 32; ++dc) {
    const uint16_t* k = kc + 32 * dc;
    _tile_loadd(7, qt + dc * 256, 64);
    _tile_loadd(4, k, lda);
    _tile_dpbf16ps(0, 4, 7);
    _tile_loadd(5, k + 16 * D, lda);
    _tile_dpbf16ps(1, 5, 7);
    if constexpr (NK == 4) {
      _tile_loadd(6, k + 32 * D, lda);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(4, k + 48 * D, lda);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 256, 64);
  if constexpr (NK == 4) {
    _tile_stored(2, s + 512, 64);
    _tile_stored(3, s + 768, 64);
  }
}

// pv [D, 16] = V^T [D, nk32 keys from vt] . P^T (pt: pairs of keys): 4 dimension tiles at a
// time (D % 64 == 0), each its own accumulator; V^T tiles rotate through tmm4-6, P^T in tmm7.
inline void value_tiles(const uint16_t* vt, int64_t ctx_pad, int64_t D, int64_t nk32,
                        const uint32_t* pt, float* pv) {
  const int64_t lda = ctx_pad * 2;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* v = vt + d0 * ctx_pad;
    for (int64_t kk = 0; kk < nk32; kk += 32) {
      _tile_loadd(7, pt + (kk / 2) * 16, 64);
      _tile_loadd(4, v + kk, lda);
      _tile_dpbf16ps(0, 4, 7);
      _tile_loadd(5, v + 16 * ctx_pad + kk, lda);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, v + 32 * ctx_pad + kk, lda);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(4, v + 48 * ctx_pad + kk, lda);
      _tile_dpbf16ps(3, 4, 7);
    }
    float* o = pv + d0 * 16;
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
    _tile_stored(2, o + 512, 64);
    _tile_stored(3, o + 768, 64);
  }
}

// The products of a unit on AMX tiles (each thread loads the tile configuration first).
struct OnTiles {
  static void begin() { amx_begin(); }
  static void end() { amx_end(); }
  static void scores(const uint16_t* kc, int64_t D, const uint32_t* qt, int64_t nk32,
                     float* s) {
    for (int64_t kt = 0; kt < nk32; kt += 64) {
      if (nk32 - kt >= 64)
        score_tiles<4>(kc + kt * D, D, qt, s + kt * 16);
      else
        score_tiles<2>(kc + kt * D, D, qt, s + kt * 16);
    }
  }
  static void values(const uint16_t* vt, int64_t ctx_pad, int64_t D, int64_t nk32,
                     const uint32_t* pt, float* pv) {
    value_tiles(vt, ctx_pad, D, nk32, pt, pv);
  }
};
#endif  // RS_AMX

// The same products with vdpbf16ps: 16 rows of A at a time, each its own vector of 16
// accumulators (one per query lane), a pair of the row broadcast against B's vector of it.
struct OnVectors {
  static void begin() {}
  static void end() {}
  // S^T [nk32 keys, 16] = K rows kc[0:nk32] (row stride D) . Q^T's pairs qt.
  static void scores(const uint16_t* kc, int64_t D, const uint32_t* qt, int64_t nk32,
                     float* s) {
    const int64_t P = D / 2;  // pairs per K row; Q^T's vector of pair p is qt + 16 p
    for (int64_t r0 = 0; r0 < nk32; r0 += 16) {
      const uint32_t* k = reinterpret_cast<const uint32_t*>(kc + r0 * D);
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t p = 0; p < P; ++p) {
        const __m512bh b = as_bh(_mm512_load_si512(qt + 16 * p));
        for (int i = 0; i < 16; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(_mm512_set1_epi32(k[i * P + p])), b);
      }
      for (int i = 0; i < 16; ++i) _mm512_store_ps(s + (r0 + i) * 16, acc[i]);
    }
  }
  // pv [D, 16] = V^T [D, nk32 keys from vt] . P^T (pt: P^T's vector of key pair j at 16 j).
  static void values(const uint16_t* vt, int64_t ctx_pad, int64_t D, int64_t nk32,
                     const uint32_t* pt, float* pv) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < nk32 / 2; ++j) {
        const __m512bh b = as_bh(_mm512_load_si512(pt + 16 * j));
        for (int i = 0; i < 16; ++i) {
          const uint32_t* v = reinterpret_cast<const uint32_t*>(vt + (d0 + i) * ctx_pad);
          acc[i] = _mm512_dpbf16_ps(acc[i], as_bh(_mm512_set1_epi32(v[j])), b);
        }
      }
      for (int i = 0; i < 16; ++i) _mm512_store_ps(pv + (d0 + i) * 16, acc[i]);
    }
  }
};

// One unit: query tokens t0..t0+nt-1 (nt <= 16) of head hq over keys 0..their positions
// (with a window, only the last `window` keys up to each one's position).
struct Unit {
  const float* q;  // the tile's first query row of head hq
  int64_t q_row;   // q's row stride
  float* o;        // the tile's first output row of head hq
  int64_t o_row;
  int64_t nt, first_pos;  // tokens, and the first one's position (token i: first_pos + i)
  int64_t window;         // 0: none
};

// The first step (of kStepKeys keys) that a token at `first_pos` or later reads.
inline int64_t first_step(int64_t first_pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / kStepKeys : 0;
}

// A thread's buffers for its units: two of each so that what the tiles store is read by
// vector code (and the reverse) one phase later, never right after (a store -> load hand-off
// between the tile unit and the vector unit stalls until the stores have reached the cache).
struct UnitBuffers {
  explicit UnitBuffers(int64_t D)
      : qt(D / 32 * 256), pt(2 * kStepKeys / 2 * 16), s(2 * kStepKeys * 16), pv(2 * D * 16),
        acc(D * 16) {}
  WordBuffer qt, pt;
  AlignedBuffer s, pv, acc;
  __m512 alpha[2];
};

// The unit, software-pipelined over its steps of 128 keys: in iteration i the tiles compute
// step i+1's scores and step i-1's P.V, the vector unit adds step i-2's P.V into the running
// sums and runs step i's softmax (Products: OnTiles or OnVectors).
template <class Products>
void attend_unit(const Unit& u, int64_t D, float scale, const uint16_t* kc, const uint16_t* vt,
                 int64_t ctx_pad, UnitBuffers& b) {
  // Q^T's pairs, scaled (with log2 e: the softmax is in base 2): per 32 dimensions, query i's
  // 16 pairs transposed into lane i.
  const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t dc = 0; dc < D / 32; ++dc) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
      const float* qi = u.q + std::min<int64_t>(i, u.nt - 1) * u.q_row + 32 * dc;
      r[i] = bf16_x32(_mm512_mul_ps(_mm512_loadu_ps(qi), sc),
                      _mm512_mul_ps(_mm512_loadu_ps(qi + 16), sc));
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(b.qt.data() + dc * 256 + p * 16, r[p]);
  }
  // Lane i's position (lanes past nt repeat the last token: finite, and never written out).
  const __m512i pos = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(u.first_pos)),
      _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32(static_cast<int>(u.nt - 1))));
  const int64_t kend = u.first_pos + u.nt;  // keys the last token sees
  const int64_t steps = (kend + kStepKeys - 1) / kStepKeys, j0 = first_step(u.first_pos, u.window);
  // Keys at or before lane i's position - window are outside its window.
  const __m512i pos_w = _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int>(u.window)));
  auto keys32 = [&](int64_t j) {  // step j's keys, rounded up to whole 32-key tiles
    return (std::min(kStepKeys, kend - j * kStepKeys) + 31) / 32 * 32;
  };
  auto scores = [&](int64_t j) {
    float* s = b.s.data() + (j & 1) * kStepKeys * 16;
    Products::scores(kc + j * kStepKeys * D, D, b.qt.data(), keys32(j), s);
  };
  __m512 run_max = _mm512_set1_ps(kMasked), run_sum = _mm512_setzero_ps();
  auto softmax = [&](int64_t j) {
    float* s = b.s.data() + (j & 1) * kStepKeys * 16;
    uint32_t* pt = b.pt.data() + (j & 1) * kStepKeys / 2 * 16;
    const int64_t k0 = j * kStepKeys, nk32 = keys32(j);
    const bool early = u.window > 0 && k0 <= kend - 1 - u.window;  // before some lane's window
    if (k0 + nk32 - 1 > u.first_pos || early)  // keys after some lane's token: masked out
      for (int64_t r = 0; r < nk32; ++r) {
        const __m512i k = _mm512_set1_epi32(static_cast<int>(k0 + r));
        __mmask16 out = _mm512_cmpgt_epi32_mask(k, pos);
        if (early) out |= _mm512_cmple_epi32_mask(k, pos_w);
        _mm512_mask_storeu_ps(s + r * 16, out, _mm512_set1_ps(kMasked));
      }
    __m512 m0 = run_max, m1 = run_max;
    for (int64_t r = 0; r < nk32; r += 2) {
      m0 = _mm512_max_ps(m0, _mm512_load_ps(s + r * 16));
      m1 = _mm512_max_ps(m1, _mm512_load_ps(s + (r + 1) * 16));
    }
    // Finite: every lane sees key 0 in step 0 (kMasked where a window has not begun: its
    // probabilities of 1 are then scaled by alpha = 0 at its first key, which it has).
    const __m512 mx = _mm512_max_ps(m0, m1);
    b.alpha[j & 1] = exp2_softmax(_mm512_sub_ps(run_max, mx));
    run_max = mx;
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
    for (int64_t r = 0; r < nk32; r += 2) {
      const __m512 p0 = exp2_softmax(_mm512_sub_ps(_mm512_load_ps(s + r * 16), mx));
      const __m512 p1 = exp2_softmax(_mm512_sub_ps(_mm512_load_ps(s + (r + 1) * 16), mx));
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
      _mm512_store_si512(pt + (r / 2) * 16, bf16_pairs(p0, p1));
    }
    run_sum = _mm512_fmadd_ps(run_sum, b.alpha[j & 1], _mm512_add_ps(sum0, sum1));
  };
  auto values = [&](int64_t j) {
    Products::values(vt + j * kStepKeys, ctx_pad, D, keys32(j),
                     b.pt.data() + (j & 1) * kStepKeys / 2 * 16, b.pv.data() + (j & 1) * D * 16);
  };
  float* acc = b.acc.data();
  auto combine = [&](int64_t j) {  // acc = acc * alpha_j + step j's P.V
    const float* pv = b.pv.data() + (j & 1) * D * 16;
    const __m512 alpha = b.alpha[j & 1];
    for (int64_t d = 0; d < D; ++d)
      _mm512_store_ps(acc + d * 16, _mm512_fmadd_ps(_mm512_load_ps(acc + d * 16), alpha,
                                                    _mm512_load_ps(pv + d * 16)));
  };
  std::memset(acc, 0, D * 16 * sizeof(float));
  scores(j0);
  for (int64_t i = j0; i <= steps + 1; ++i) {
    if (i + 1 < steps) scores(i + 1);
    if (i >= j0 + 1 && i <= steps) values(i - 1);
    if (i >= j0 + 2) combine(i - 2);
    if (i < steps) softmax(i);
  }
  // O = (O^T)^T / sum, 16 dimensions at a time.
  alignas(64) float inv[16];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), run_sum));
  for (int64_t d = 0; d < D; d += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(acc + (d + i) * 16);
    transpose16(r);  // r[i]: query i's dimensions d..d+15
    for (int64_t i = 0; i < u.nt; ++i)
      _mm512_storeu_ps(u.o + i * u.o_row + d, _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i])));
  }
}
#endif  // RS_AVX512_BF16

// paged_prefill_attention (attention.cpp) in bfloat16 on `unit` (MatrixUnit: AVX-512 BF16 or
// AMX): the same arguments (a sliding `window` too) and result up to bfloat16 rounding of q
// (scaled), K, V and the probabilities. head_dim a multiple of 64.
void paged_prefill_attention_bf16([[maybe_unused]] const at::Tensor& q,
                                  [[maybe_unused]] const at::Tensor& k_pool,
                                  [[maybe_unused]] const at::Tensor& v_pool,
                                  [[maybe_unused]] const at::Tensor& block_ids,
                                  [[maybe_unused]] int64_t context_len,
                                  [[maybe_unused]] double sm_scale,
                                  [[maybe_unused]] const at::Tensor& out,
                                  [[maybe_unused]] int64_t unit,
                                  [[maybe_unused]] int64_t window) {
#ifdef RS_AVX512_BF16
  const bool amx = unit == static_cast<int64_t>(MatrixUnit::kAmx);
  check(amx || unit == static_cast<int64_t>(MatrixUnit::kAvx512Bf16), "unknown unit");
  check(cpu_has_avx512_bf16(), "this CPU has no AVX-512 BF16");
#ifdef RS_AMX
  check(!amx || amx_ready(), "AMX is unavailable: Linux refused the tile permission");
#else
  check(!amx, "this build has no AMX code");
#endif
  check(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 q and out");
  check(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  check(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(), "int64 block ids");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  check(q.stride(2) == 1 && q.stride(1) == D && out.stride(1) == 1 && out.size(1) == H * D,
        "q rows and out rows must be contiguous");
  check(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  check(D % 64 == 0, "head_dim must be a multiple of 64");
  const int64_t BS = k_pool.size(1), KVH = k_pool.size(2), GQ = H / KVH;
  check(context_len >= n && block_ids.size(0) * BS >= context_len, "context");
  if (n == 0) return;
  // V^T's row stride (ctx_pad keys) an odd number of cache lines: 16 rows of a tile 4 KB apart
  // would all fall into one set of the L1 cache (12 ways).
  const int64_t start = context_len - n;
  int64_t ctx_pad = (context_len + 31) / 32 * 32;
  if ((ctx_pad / 32) % 2 == 0) ctx_pad += 32;
  uint16_t* kc = context_buffer(2 * KVH * ctx_pad * D);
  uint16_t* vt = kc + KVH * ctx_pad * D;
  const int64_t* bid = block_ids.data_ptr<int64_t>();
  with_kv_type(k_pool, [&](auto tag) {
    using T = decltype(tag);
    const T* kp = static_cast<const T*>(k_pool.data_ptr());
    const T* vp = static_cast<const T*>(v_pool.data_ptr());
    // Only the keys some step reads: with a window, from the first token's first step.
    const int64_t first = first_step(start, window) * kStepKeys / 16, blocks = ctx_pad / 16;
    at::parallel_for(0, KVH * (blocks - first), 8, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t h = w / (blocks - first);
        context_block(kp, vp, bid, BS, KVH, D, h, (first + w % (blocks - first)) * 16,
                      context_len, ctx_pad, kc + h * ctx_pad * D, vt + h * ctx_pad * D);
      }
    });
  });
  const int64_t tiles = (n + 15) / 16, units = tiles * H, nthreads = at::get_num_threads();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  std::atomic<int64_t> next{0};
  auto run = [&](auto products) {
    using Products = decltype(products);
    at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
      UnitBuffers buffers(D);
      Products::begin();
      for (;;) {
        const int64_t w = next.fetch_add(1);
        if (w >= units) break;
        // One KV head's units at a time (its K and V^T stay in the caches), heaviest first.
        const int64_t h = w / (tiles * GQ), r = w % (tiles * GQ);
        const int64_t tile = tiles - 1 - r / GQ, hq = h * GQ + r % GQ;
        const int64_t t0 = tile * 16;
        const Unit u{qp + t0 * q.stride(0) + hq * D, q.stride(0),
                     op + t0 * out.stride(0) + hq * D, out.stride(0),
                     std::min<int64_t>(16, n - t0), start + t0, window};
        attend_unit<Products>(u, D, scale, kc + h * ctx_pad * D, vt + h * ctx_pad * D,
                              ctx_pad, buffers);
      }
      Products::end();
    });
  };
#ifdef RS_AMX
  if (amx) return run(OnTiles{});
#endif
  run(OnVectors{});
#else
  check(false, "this build has no AVX-512 BF16 code");
#endif
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "paged_prefill_attention_bf16(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_ids, "
      "int context_len, float sm_scale, Tensor(a!) out, int unit, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("paged_prefill_attention_bf16", &radixserve::paged_prefill_attention_bf16);
}

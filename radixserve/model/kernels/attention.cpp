// Paged attention on the CPU: decode rows (one query token per sequence) and prefill chunks
// (many query tokens over a cached prefix), reading K/V (float32, bfloat16 or float16) from the
// pool's blocks in place; float32 math, softmax by log-sum-exp merges or online.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kv.h"
#include "ops.h"
#include "simd.h"
#include "tile.h"

namespace radixserve {
namespace {

#ifdef RS_AVX2
// The 8 horizontal sums of a[0..7] as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 t01 = _mm256_hadd_ps(a[0], a[1]), t23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t45 = _mm256_hadd_ps(a[4], a[5]), t67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 t0123 = _mm256_hadd_ps(t01, t23), t4567 = _mm256_hadd_ps(t45, t67);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0123, t4567, 0x20),
                       _mm256_permute2f128_ps(t0123, t4567, 0x31));
}
#endif

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

}  // namespace

// Decode attention over the paged pool. q [B, H, D] (rows may be strided);
// k_pool / v_pool [NB, BS, KVH, D] (float32, bfloat16 or float16);
// block_table [B, >= max blocks] int32, rows may be strided (a view of a larger buffer);
// context_lens [B] int32 (keys 0..len-1 are attended; with window > 0, only the last
// `window` of them: keys len-window..len-1); out [B, H, D].
// Work unit = (sequence, KV head, chunk of the attended keys): the chunk's K rows are scored 8
// at a time against each query head of the group (the rows stay in L1 across heads), turned
// into softmax terms, and its V rows weighted; chunks are merged by their log-sum-exp, so one
// long sequence still spreads over every thread. Chunks are whole blocks counted from the
// block holding the window's first key, so a window costs only its own chunks.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& block_table,
                            const at::Tensor& context_lens, double sm_scale,
                            const at::Tensor& out, int64_t window) {
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
  // Sequence b's first attended key, and the first key of its first chunk (a block's first).
  auto first_key = [&](int64_t b) -> int64_t {
    return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
  };
  auto chunk_base = [&](int64_t b) -> int64_t { return first_key(b) / BS * BS; };
  int64_t max_chunks = 1;
  for (int64_t b = 0; b < B; ++b)
    max_chunks = std::max<int64_t>(max_chunks, (lens[b] - chunk_base(b) + chunk - 1) / chunk);
  // Partial results per (chunk, b, kvh, head in group): max, sum, acc[D]. A chunk's units are
  // neighbours: rows of one sequence (a step verifying drafts) share its K and V rows, which
  // then come from L2 for all but the first.
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
        const int64_t h = u % KVH, b = (u / KVH) % B, c = u / (B * KVH);
        const int64_t c0 = chunk_base(b) + c * chunk, t1 = std::min<int64_t>(lens[b], c0 + chunk);
        const int64_t t0 = std::max(c0, first_key(b));
        // Walk the keys block by block (no division per key).
        for (int64_t t = t0, blk = t0 / BS, off = t0 % BS; t < t1; ++blk, off = 0) {
          const int64_t base = static_cast<int64_t>(bt[b * MAXB + blk]) * BS;
          for (; off < BS && t < t1; ++off, ++t) {
            const int64_t row = (base + off) * KVH + h;
            k[t - t0] = kp + row * D;
            v[t - t0] = vp + row * D;
          }
        }
        return std::max<int64_t>(0, t1 - t0);
      };
      int64_t n = unit_rows(u0, krows.data(), vrows.data());
      for (int64_t u = u0; u < u1; ++u) {
        // The KV heads of one chunk are neighbours in memory, and neighbouring units.
        const int64_t h = u % KVH, b = (u / KVH) % B;
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
      // Unit (c, b, h) is (c * B + b) * KVH + h; chunks of one head are B * KVH apart.
      const int64_t step = B * KVH * GQ * stride;
      const float* first = part.data() + (b * KVH + h) * GQ * stride + g * stride;
      merge_partials(first, max_chunks, step, D, op + r * D);
    }
  });
}

namespace {

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

// ---- Prefill: the ISA-specific parts of a step of kKeyTile keys ----

constexpr int64_t kKeyTile = 64;  // keys per step of a prefill unit

// The online softmax of a row of scores s[0:n] (n % 16 == 0, n <= kKeyTile) whose keys from
// `visible` on are masked out (0 < visible <= n); returns softmax_step's factor.
inline float softmax_visible(float* s, int64_t visible, int64_t n, float& run_max,
                             float& run_sum) {
#ifdef RS_AVX512
  return softmax_step64(s, visible, run_max, run_sum);  // masks and sums in registers
#else
  for (int64_t j = visible; j < n; ++j) s[j] = -INFINITY;
  return softmax_step(s, n, run_max, run_sum);
#endif
}

// Causal attention of a chunk of n new tokens over a sequence's paged context (the chunk's
// own K/V already written). q [n, H, D] (rows may be strided: a view of the fused qkv),
// k_pool / v_pool [NB, BS, KVH, D], block_ids [>= ceil(context_len / BS)] int64, out [n, H * D]
// (rows may be strided). Token i of the chunk sits at position context_len - n + i and
// attends to keys 0..that position (with window > 0: the `window` keys ending there).
// Flash-attention style: a work unit is (KV head, tile of query tokens, slice of the keys);
// the tile's query rows (up to 64 new tokens, else 32 at a time, x the heads of the group)
// meet 64 keys at a time: scores and probability-weighted V rows are both products by the
// register tile (6x16; AVX-512: 12x16) over K/V rows read from the pool (K transposed into a
// panel; V copied, AVX-512: used in place), with an online softmax between, the next 64 keys'
// rows asked for meanwhile. A short chunk is cut into smaller query tiles, so every thread
// has work; its keys are never split, so each row's result has the same bits whatever chunk
// it comes in (a cache hit's rows equal recomputing them: an int8 path's activations would
// turn a split's last-bit difference into a different code).
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_ids,
                             int64_t context_len, double sm_scale, const at::Tensor& out,
                             int64_t window) {
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
  constexpr int64_t KT = kKeyTile;
  // Query tokens per tile: up to 64 new tokens are one tile, so each K/V row is read (and K
  // packed) once rather than once per 32 tokens; longer chunks take 32 at a time. Fewer
  // (tile, head) units than threads, or a count that leaves a thread idle at the end: the
  // fewest smaller tiles that share evenly (each tile packs its keys anew).
  const int64_t nthreads = at::get_num_threads();
  int64_t TQ = n <= 64 ? std::max<int64_t>(n, 1) : 32;
  if (n <= 64) {
    int64_t want = 1;
    while (want < n && (want * KVH < nthreads || (want * KVH) % nthreads)) ++want;
    TQ = (n + want - 1) / want;
  }
  const int64_t R = TQ * GQ;  // query rows of a tile: token-major, the group's heads inner
  const int64_t tiles = (n + TQ - 1) / TQ;
  const int64_t units = tiles * KVH;
  const int64_t q_row = q.stride(0), o_row = out.stride(0);
  const float* qp = q.data_ptr<float>();
  const int64_t* bid = block_ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
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
        const int64_t h = u % KVH, tile = tiles - 1 - u / KVH;
        const int64_t t0 = tile * TQ, nt = std::min(TQ, n - t0), rows = nt * GQ;
        const int64_t kend = start + t0 + nt;  // keys the tile's last token sees
        // The first key the tile's first token sees, rounded down to a step of KT keys.
        const int64_t kbase = window > 0 ? std::max<int64_t>(0, start + t0 - window + 1) / KT * KT : 0;
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t g = 0; g < GQ; ++g) {
            const float* src = qp + (t0 + t) * q_row + (h * GQ + g) * D;
            float* dst = qt.data() + (t * GQ + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
          }
        std::fill(mx.begin(), mx.end(), -INFINITY);
        std::fill(sum.begin(), sum.end(), 0.f);
        std::memset(acc.data(), 0, rows * D * sizeof(float));
        for (int64_t k0 = kbase; k0 < kend; k0 += KT) {
          const int64_t nk = std::min(KT, kend - k0), nk16 = (nk + 15) / 16 * 16;
          int64_t blk = k0 / BS, off = k0 % BS;
          // The pool is far bigger than the caches: the next step's K/V rows are asked for
          // (into L2) a few at a time between this step's tiles, so they arrive while it
          // computes (a burst of them would overflow the queue of outstanding misses).
          int64_t ahead_n = 0, ahead_i = 0;
          for (int64_t t = k0 + KT; t < std::min(kend, k0 + 2 * KT); ++t, ++ahead_n) {
            const int64_t row = (bid[t / BS] * BS + t % BS) * KVH + h;
            ahead[ahead_n] = reinterpret_cast<const char*>(kp + row * D);
            ahead[KT + ahead_n] = reinterpret_cast<const char*>(vp + row * D);
          }
          auto prefetch_ahead = [&](int64_t rows_now) {
            for (int64_t e = 0; e < rows_now && ahead_i < 2 * ahead_n; ++e, ++ahead_i) {
              const char* r = ahead[ahead_i < ahead_n ? ahead_i : KT + ahead_i - ahead_n];
              for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
                __builtin_prefetch(r + b, 0, 2);  // x86: prefetcht1, into L2
            }
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
            for (int64_t m = 0, step = 0; m < rows; m += step) {
              prefetch_ahead(2);
              const int mr = next_tile_rows(rows - m);
              step = mr;
              const float* a = qt.data() + m * D;
              float* c = sc.data() + m * KT + s16;
              if (D == 64)  // the usual head size: q's row stride a constant
                tile_rows<false, 64>(mr, a, D, kt.data() + s16 * D, 16, D, c, KT);
              else
                tile_rows(mr, a, D, kt.data() + s16 * D, 16, D, c, KT);
            }
          // Mask keys past each row's position (and the padding) and, with a window, keys
          // before it; then the online softmax.
          for (int64_t r = 0; r < rows; ++r) {
            float* srow = sc.data() + r * KT;
            const int64_t pos = start + t0 + r / GQ;
            const int64_t visible = std::min(nk, pos + 1 - k0);
            const int64_t hidden = window > 0 ? std::max<int64_t>(0, pos - window + 1 - k0) : 0;
            if (visible <= 0 || hidden >= visible) {  // no key of this tile is in the row's view
              std::fill(srow, srow + nk16, 0.f);
              continue;
            }
            std::fill(srow, srow + hidden, -INFINITY);
            const float alpha = softmax_visible(srow, visible, nk16, mx[r], sum[r]);
            if (alpha != 1.f) {
              float* a = acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            }
          }
          // acc [rows, D] += p [rows, nk16] . v [nk16, D].
          for (int64_t d0 = 0; d0 < D; d0 += 16)
            for (int64_t m = 0, step = 0; m < rows; m += step) {
              prefetch_ahead(2);
              const int mr = next_tile_rows(rows - m);
              step = mr;
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
          const int64_t t = r / GQ, g = r % GQ;
          float* o = op + (t0 + t) * o_row + (h * GQ + g) * D;
          const float inv = sum[r] > 0 ? 1.f / sum[r] : 0.f;
          for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
        }
      }
    });
  });
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
      "Tensor context_lens, float sm_scale, Tensor(a!) out, int window=0) -> ()");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_ids, "
      "int context_len, float sm_scale, Tensor(a!) out, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("paged_decode_attention", &radixserve::paged_decode_attention);
  m.impl("paged_prefill_attention", &radixserve::paged_prefill_attention);
}

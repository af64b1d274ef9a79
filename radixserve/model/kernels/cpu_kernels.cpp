// CPU kernels of radixserve: weight-only quantized GEMM for few-row inputs (decode steps) and
// paged decode attention that reads K/V from the block pool in place.
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
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RS_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 16;

void check(bool ok, const char* what) { TORCH_CHECK(ok, "radixserve kernel: ", what); }

#ifdef RS_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
#endif

// Unpack one group of 32 weights (without scale/min) into w[32].
inline void unpack_q4(const uint8_t* q, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<float>(q[j] & 0x0F);
    w[j + 16] = static_cast<float>(q[j] >> 4);
  }
}

void q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& minv, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / kGroup;
  check(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  check(K % kGroup == 0 && qs.size(1) == K / 2, "qs shape");
  check(M <= kMaxRows, "at most 16 rows");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qrow = qp + n * (K / 2);
      const float* srow = sp + n * G;
      const float* mrow = mp + n * G;
#ifdef RS_AVX2
      __m256 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      const __m128i low = _mm_set1_epi8(0x0F);
      for (int64_t g = 0; g < G; ++g) {
        __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * 16));
        __m128i lo = _mm_and_si128(bytes, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        const __m256 s = _mm256_set1_ps(srow[g]), mn = _mm256_set1_ps(mrow[g]);
        const __m256 w0 = _mm256_fmadd_ps(s, u8x8_to_ps(lo), mn);
        const __m256 w1 = _mm256_fmadd_ps(s, u8x8_to_ps(_mm_srli_si128(lo, 8)), mn);
        const __m256 w2 = _mm256_fmadd_ps(s, u8x8_to_ps(hi), mn);
        const __m256 w3 = _mm256_fmadd_ps(s, u8x8_to_ps(_mm_srli_si128(hi, 8)), mn);
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = xp + m * K + g * kGroup;
          __m256 a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), acc[m]);
          a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), a);
          a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), a);
          acc[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), a);
        }
      }
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = hsum(acc[m]);
#else
      float w[kGroup];
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        unpack_q4(qrow + g * 16, w);
        for (int j = 0; j < kGroup; ++j) w[j] = srow[g] * w[j] + mrow[g];
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = xp + m * K + g * kGroup;
          float d = 0;
          for (int j = 0; j < kGroup; ++j) d += w[j] * xg[j];
          op[m * N + n] += d;
        }
      }
#endif
    }
  });
}

void q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), G = K / kGroup;
  check(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  check(K % kGroup == 0 && qs.size(1) == K, "qs shape");
  check(M <= kMaxRows, "at most 16 rows");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* qrow = qp + n * K;
      const float* srow = sp + n * G;
#ifdef RS_AVX2
      __m256 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* q = qrow + g * kGroup;
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
        const __m256 s = _mm256_set1_ps(srow[g]);
        const __m256 w0 = _mm256_mul_ps(s, i8x8_to_ps(a));
        const __m256 w1 = _mm256_mul_ps(s, i8x8_to_ps(_mm_srli_si128(a, 8)));
        const __m256 w2 = _mm256_mul_ps(s, i8x8_to_ps(b));
        const __m256 w3 = _mm256_mul_ps(s, i8x8_to_ps(_mm_srli_si128(b, 8)));
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = xp + m * K + g * kGroup;
          __m256 t = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), acc[m]);
          t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
          t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
          acc[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
        }
      }
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = hsum(acc[m]);
#else
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float total = 0;
        for (int64_t k = 0; k < K; ++k) total += (srow[k / kGroup] * qrow[k]) * xr[k];
        op[m * N + n] = total;
      }
#endif
    }
  });
}

// Dequantize into out [N, K] float32 (for many-row inputs, which then use a dense GEMM).
void q4_dequant(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& minv,
                const at::Tensor& out) {
  const int64_t N = qs.size(0), K = out.size(1), G = K / kGroup;
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float w[kGroup];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        unpack_q4(qp + n * (K / 2) + g * 16, w);
        float* o = op + n * K + g * kGroup;
        for (int j = 0; j < kGroup; ++j) o[j] = sp[n * G + g] * w[j] + mp[n * G + g];
      }
  });
}

void q8_dequant(const at::Tensor& qs, const at::Tensor& scale, const at::Tensor& out) {
  const int64_t N = qs.size(0), K = qs.size(1), G = K / kGroup;
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) op[n * K + k] = sp[n * G + k / kGroup] * qp[n * K + k];
  });
}

inline float dot(const float* a, const float* b, int64_t d) {
#ifdef RS_AVX2
  if (d % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
  }
#endif
  float s = 0;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += a * x[i];
}

// Decode attention over the paged pool. q [B, H, D]; k_pool / v_pool [NB, BS, KVH, D];
// block_table [B, >= max blocks] int32, rows may be strided (a view of a larger buffer);
// context_lens [B] int32 (keys 0..len-1 are attended);
// out [B, H, D]. The context is split into chunks so one long sequence still uses every
// thread; per-chunk results are merged with their log-sum-exp.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& block_table,
                            const at::Tensor& context_lens, double sm_scale,
                            const at::Tensor& out) {
  check(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat, "float32 only");
  check(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
        "int32 block table and lengths");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check(block_table.stride(1) == 1 && context_lens.stride(0) == 1 && q.is_contiguous(),
        "block table rows, lengths and q must be contiguous");
  const int64_t BS = k_pool.size(1), KVH = k_pool.size(2), MAXB = block_table.stride(0);
  const int64_t GQ = H / KVH;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t chunk_blocks = 16;  // 256 tokens at block size 16
  const int64_t chunk = chunk_blocks * BS;
  int64_t max_chunks = 1;
  for (int64_t b = 0; b < B; ++b)
    max_chunks = std::max<int64_t>(max_chunks, (lens[b] + chunk - 1) / chunk);
  // Partial results per (b, kvh, chunk, head in group): max, sum, acc[D].
  const int64_t units = B * KVH * max_chunks;
  std::vector<float> part(units * GQ * (D + 2), 0.f);
  const float scale = static_cast<float>(sm_scale);
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scores(GQ * chunk);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c = u % max_chunks, h = (u / max_chunks) % KVH, b = u / (max_chunks * KVH);
      const int64_t len = lens[b], t0 = c * chunk, t1 = std::min(len, t0 + chunk);
      float* pu = part.data() + u * GQ * (D + 2);
      if (t0 >= t1) {
        for (int64_t g = 0; g < GQ; ++g) pu[g * (D + 2)] = -INFINITY;
        continue;
      }
      const int64_t n = t1 - t0;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t blk = bt[b * MAXB + t / BS];
        const float* krow = kp + ((blk * BS + t % BS) * KVH + h) * D;
        for (int64_t g = 0; g < GQ; ++g)
          scores[g * chunk + (t - t0)] = dot(qp + (b * H + h * GQ + g) * D, krow, D) * scale;
      }
      for (int64_t g = 0; g < GQ; ++g) {
        float* s = scores.data() + g * chunk;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        float sum = 0;
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - mx);
          sum += s[i];
        }
        float* pg = pu + g * (D + 2);
        pg[0] = mx;
        pg[1] = sum;
      }
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t blk = bt[b * MAXB + t / BS];
        const float* vrow = vp + ((blk * BS + t % BS) * KVH + h) * D;
        for (int64_t g = 0; g < GQ; ++g) axpy(scores[g * chunk + (t - t0)], vrow, pu + g * (D + 2) + 2, D);
      }
    }
  });
  // Merge the chunks of each (b, head).
  at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, hq = r % H, h = hq / GQ, g = hq % GQ;
      float mx = -INFINITY;
      for (int64_t c = 0; c < max_chunks; ++c)
        mx = std::max(mx, part[((b * KVH + h) * max_chunks + c) * GQ * (D + 2) + g * (D + 2)]);
      float* o = op + r * D;
      for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
      float total = 0;
      for (int64_t c = 0; c < max_chunks; ++c) {
        const float* pg = part.data() + ((b * KVH + h) * max_chunks + c) * GQ * (D + 2) + g * (D + 2);
        if (pg[0] == -INFINITY) continue;
        const float w = std::exp(pg[0] - mx);
        total += w * pg[1];
        axpy(w, pg + 2, o, D);
      }
      const float inv = total > 0 ? 1.f / total : 0.f;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  });
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("q4_gemm(Tensor x, Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_gemm(Tensor x, Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def("q4_dequant(Tensor qs, Tensor scale, Tensor minv, Tensor(a!) out) -> ()");
  m.def("q8_dequant(Tensor qs, Tensor scale, Tensor(a!) out) -> ()");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
      "Tensor context_lens, float sm_scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("q4_gemm", &q4_gemm);
  m.impl("q8_gemm", &q8_gemm);
  m.impl("q4_dequant", &q4_dequant);
  m.impl("q8_dequant", &q8_dequant);
  m.impl("paged_decode_attention", &paged_decode_attention);
}

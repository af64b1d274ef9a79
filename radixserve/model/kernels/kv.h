// K/V elements: pools hold float32, bfloat16 or float16 (--kv-cache-dtype); the attention math
// is float32 either way. Attention reads rows through these, rope_kv_write writes them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace radixserve {
namespace {

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

}  // namespace
}  // namespace radixserve

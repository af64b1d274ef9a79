// What every kernel file shares: the instruction sets this build uses (RS_AVX2, RS_AVX512), the
// argument check, cache-line aligned buffers, the dispatch of a tile's row count to a
// compile-time constant, and the small vector helpers several files inline (a horizontal sum,
// e^x in 8 and 16 lanes).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

// kernels/__init__.py picks the flags for this CPU (and $RADIXSERVE_CPU_ISA may cap them): AVX2
// + FMA + F16C for the vector code, with AVX-512 (F, BW, VL, DQ) on top for the hot loops.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_AVX2 1
#endif
// AVX-512 (F, BW, VL, DQ): 16 lanes a vector for the hot loops (the quantized GEMV of 1-16
// rows, decode attention, the prefill register tile); everything else runs the AVX2 code.
#if defined(RS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define RS_AVX512 1
#endif
// AVX-512 VNNI (vpdpbusd: 4 byte products into each int32 lane), where the CPU has it.
#if defined(RS_AVX512) && defined(__AVX512VNNI__)
#define RS_AVX512_VNNI 1
#include <cpuid.h>
#endif

// Before a loop over a tile's compile-time row count: unrolled early, GCC keeps the tile's
// accumulator array in registers; left to its later unrolling, it stores every accumulator to
// the stack on every k (seen in tile_x16 and the one-panel tile_x8: 2-3x slower).
#define RS_UNROLL _Pragma("GCC unroll 16")

namespace radixserve {
// The headers' helpers have internal linkage, as when the kernels were one file, so that GCC
// inlines and specializes them as it did (cpu_kernels.cpp includes every file once).
namespace {

void check(bool ok, const char* what) { TORCH_CHECK(ok, "radixserve kernel: ", what); }

#ifdef RS_AVX512_VNNI
// Whether the CPU runs AVX-512 VNNI (CPUID leaf 7, ECX bit 11): a build directory may be
// shared between machines.
// Asked once per process: CPUID traps to the hypervisor in a VM, and the ops check per call.
inline bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 11));
  }();
  return has;
}
#endif

// A zeroed float buffer on 64-byte (cache line) boundaries.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(int64_t n)
      : p_(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64))) {
    check(p_ != nullptr, "out of memory");
    std::memset(p_, 0, n * sizeof(float));
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  float* data() { return p_; }
  float* begin() { return p_; }

 private:
  float* p_;
};

// f(std::integral_constant<int, MR>{}) for the row count mr in 1..Max (anything else: 1), so
// a tile written for a compile-time row count runs for the rows at hand.
template <typename F, int... I>
inline void with_rows_impl(int mr, F& f, std::integer_sequence<int, I...>) {
  const bool done = ((mr == I + 1 && (f(std::integral_constant<int, I + 1>{}), true)) || ...);
  if (!done) f(std::integral_constant<int, 1>{});
}
template <int Max, typename F>
inline void with_rows(int mr, F&& f) {
  with_rows_impl(mr, f, std::make_integer_sequence<int, Max>{});
}

#ifdef RS_AVX2
// How far ahead of its reads a one-pass stream (a decode row's walk over a matrix) asks for
// lines into L1, a few at each step: 2 KB. Asked all at once per row or panel, 16-64 KB ahead
// into L2, the requests queue behind each other (Zen 4, one row over Q4_K panels of 16384 x
// 2048: 22-28 GB/s; spread over the walk: 32-35, what the machine reads).
constexpr int64_t kStreamAhead = 2048;
// The same for a walk that meets several input rows (2-8 decode rows over panels), which takes
// longer per line, so its lines are asked for further on: on the Zen 5, 8 rows over the 1B's
// 49152 x 2048 Q6_K panels took 1.6-1.8 ms at 8 KB against 2.6 at 2 KB (one row: 1.6 at 2 KB,
// 1.8 at 8 KB), and 8 sequences of the 1B Q4_K_M decoded 3.2-3.5 s against 3.5-3.7 for 1,024
// tokens with the Q4_K panels' walk at 8 KB (4 and 16 KB: the same as 8).
constexpr int64_t kStreamAheadRows = 4 * kStreamAhead;
// Asks for `lines` cache lines from `ahead` bytes past `at` into L1 (a stream read at a
// fraction of the pace: that fraction of kStreamAhead).
inline void stream_ahead(const void* at, int lines, int64_t ahead = kStreamAhead) {
  const char* c = static_cast<const char*>(at) + ahead;
  // As asm: GCC 12 drops _mm_prefetch from the register-blocked tiles that call this (none
  // was left in gemm_vnni.cpp's vnni_tile<8, 1>; Zen 5, a 49152 x 2048 Q6_K panel walk at 8
  // rows: 4.5 ms with the intrinsic, 1.8 with this).
  for (int i = 0; i < lines; ++i) asm volatile("prefetcht0 %0" : : "m"(c[64 * i]));
}

// int4-vnni panels may keep a Q4_K's factors as the file does (gemm_vnni.cpp's q4k_vnni_pack):
// per panel of 16 columns and super-block of 8 groups, 192 bytes: the columns' 16 float32 d
// (or -dmin), then [8][16] uint8 sc (or m). Group g's 16 scales (or mins) of panel p are then
// d * sc in float32, the product the repacking into float32 factors rounds (bit for bit).
constexpr int64_t kKFactorBytes = 192;

// 8 int4-vnni factors as float32, from the float32 or float16 [P * G, 16] the panels keep
// (float16 where it holds them exactly: a Q4_0's or Q4_1's d and m).
inline __m256 factors8(const float* f) { return _mm256_loadu_ps(f); }
inline __m256 factors8(const uint16_t* f) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f)));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// e^x for x <= 0 (softmax terms), Cephes' polynomial: within 2 ulp of expf; 0 below -87.3
// (where expf is subnormal) and for -inf. Its constants, shared by exp256 and exp512:
constexpr float kExpMin = -87.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline __m256 exp256(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);  // -> 0
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

#ifdef RS_AVX512
// exp256 in 16 lanes, the same operations lane by lane (so the same values).
inline __m512 exp512(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);  // -> 0
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), y, _mm512_castsi512_ps(e));
}

// r[16] x 16 lanes of 32 bits, transposed in place: lane j of r[i] <- lane i of r[j].
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + c]: column c of each 128-bit lane, rows i..i+3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // then the 128-bit lanes
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);
    const __m512i e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}
inline void transpose16(__m512* r) { transpose16(reinterpret_cast<__m512i*>(r)); }

// factors8's 16 at a time.
inline __m512 factors16(const float* f) { return _mm512_loadu_ps(f); }
inline __m512 factors16(const uint16_t* f) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f)));
}

// Group g's 16 scales (or mins) of int4-vnni panel p with a Q4_K's factors as stored
// (kKFactorBytes, above).
inline __m512 k_factor(const uint8_t* f, int64_t G, int64_t p, int64_t g) {
  const uint8_t* at = f + (p * (G / 8) + g / 8) * kKFactorBytes;
  const __m512i q = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 64 + (g % 8) * 16)));
  __m512 r = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(at)),
                           _mm512_cvtepi32_ps(q));
  asm("" : "+v"(r));  // rounded here: -ffast-math may not fold it into what multiplies it
  return r;
}
#endif

}  // namespace
}  // namespace radixserve

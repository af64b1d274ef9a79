// What the bfloat16 paths share (gemm_bf16.cpp, attention_bf16.cpp): which matrix units this
// build and CPU have (AMX tiles, AVX-512 BF16's vdpbf16ps), the tile permission AMX needs from
// the kernel, float32 rounded to bfloat16, and the pair-interleaved ("VNNI") layout both units
// multiply from:
//   B [K/2, N] of 32-bit words, word (p, j) = (bf16 B[2p, j], bf16 B[2p + 1, j]) (low half
//   first), i.e. two consecutive k of one column side by side. A 16-row tile of it (16 pairs =
//   32 k x 16 columns) is 1 KB, 64 bytes a row: one AMX B tile, or 16 vectors for vdpbf16ps.
// Sums are float32 on both units; only the inputs are rounded to bfloat16.
#pragma once

#include <cstdint>

#include "simd.h"

// kernels/__init__.py adds -mavx512bf16 (and -mamx-tile -mamx-bf16) where the CPU has them.
#if defined(RS_AVX512) && defined(__AVX512BF16__)
#define RS_AVX512_BF16 1
#endif
#if defined(RS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RS_AMX 1
#endif

#ifdef RS_AVX512_BF16
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixserve {
namespace {

// Which unit a bfloat16 op runs on (the ops' `unit` argument; kernels/matrix.py names them).
enum class MatrixUnit : int64_t { kAvx512Bf16 = 1, kAmx = 2 };

#ifdef RS_AVX512_BF16
// Whether the CPU runs AVX-512 BF16 (CPUID leaf 7, subleaf 1, EAX bit 5): the build's flags
// come from /proc/cpuinfo, but a build directory may be shared between machines.
// Asked once per process: CPUID traps to the hypervisor in a VM, and the ops check per call.
inline bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  }();
  return has;
}

#ifdef RS_AMX
// Linux hands out AMX's 8 KB of tile state only to processes that ask (arch_prctl); without
// the permission the first tile instruction faults. A sandbox may refuse: then false.
inline bool amx_permitted() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16.
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
    return false;
  constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kGetPerm, &mask) != 0) return false;
  return (mask >> kXtileData) & 1;
}

// amx_permitted(), asked once per process (the permission is the process's, for every thread).
inline bool amx_ready() {
  static const bool ok = amx_permitted();
  return ok;
}

// Every tile 16 rows x 64 bytes (16 float32 / 32 bfloat16 a row): palette 1. Tile state is
// per thread: each thread that runs tiles loads this first and releases the state after.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline void amx_begin() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
}
inline void amx_end() { _tile_release(); }
#endif

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
inline __m512i as_words(__m512bh v) { return reinterpret_cast<__m512i&>(v); }

// 32 float32 at p as 32 bfloat16 in order (rounded to nearest even): 16 words of pairs.
inline __m512i bf16_x32(const float* p) {
  return as_words(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
}
inline __m512i bf16_x32(__m512 lo, __m512 hi) { return as_words(_mm512_cvtne2ps_pbh(hi, lo)); }

// 16 float32 as 16 bfloat16.
inline __m256i bf16_x16(__m512 v) {
  __m256bh b = _mm512_cvtneps_pbh(v);
  return reinterpret_cast<__m256i&>(b);
}

// Lane i of the result: bf16(even[i]) | bf16(odd[i]) << 16 (one row of a pair-interleaved
// panel from two consecutive k rows).
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                       8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, as_words(_mm512_cvtne2ps_pbh(odd, even)));
}

// A 64-byte aligned buffer of n 32-bit words (bfloat16 pairs), uninitialised.
class WordBuffer {
 public:
  explicit WordBuffer(int64_t n)
      : p_(static_cast<uint32_t*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64))) {
    check(p_ != nullptr, "out of memory");
  }
  ~WordBuffer() { std::free(p_); }
  WordBuffer(const WordBuffer&) = delete;
  WordBuffer& operator=(const WordBuffer&) = delete;
  uint32_t* data() { return p_; }

 private:
  uint32_t* p_;
};
#endif  // RS_AVX512_BF16

}  // namespace
}  // namespace radixserve

// radixserve's CPU kernels, registered as torch.ops.radixserve.<name>. kernels/__init__.py
// builds this file, the kernels' one translation unit, from the files by concern:
//   simd.h         the instruction sets a build uses (RS_AVX2, RS_AVX512) and the helpers
//                  every file shares (argument checks, horizontal sums, e^x in 8 and 16 lanes)
//   kv.h           K/V pool elements (float32, bfloat16, float16) read and written as float32
//   tile.h         the register-blocked GEMM tile over packed panels (GEMM and prefill)
//   ops.h          the ops one file calls in another
//   quant_kinds.h  the numbers of the kinds of quantized codes
//   gemm.cpp       weight-only quantized GEMM / GEMV (int4, int8) and dequantization
//   kquants.cpp    GEMM / GEMV over GGUF's blocks as stored (Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ4),
//                  reusing gemm.cpp's panel GEMM for many rows
//   gguf_q8.cpp    the same blocks against int8 activations (AVX2; int8-avx2's decode rows)
//   attention.cpp  paged decode and prefill attention over the K/V block pool
//   layers.cpp     a decoder layer's fused elementwise steps, and decode_layers: every layer
//                  of a decode step in one call
//   bf16.h         the bfloat16 matrix units (AMX tiles, AVX-512 BF16): detection, AMX's tile
//                  permission, the pair-interleaved panel layout, rounding to bfloat16
//   gemm_bf16.cpp  prefill GEMMs of quantized weights on those units
//   attention_bf16.cpp  prefill attention on AMX tiles
//   gemm_panels_avx2.cpp  int4-vnni panels on AVX2 without VNNI (vpmaddubsw; int8-avx2's Q4_K)
//   gemm_vnni.cpp  prefill GEMMs with int8 activations on AVX-512 VNNI
//   gemm_q6k_vnni.cpp  Q6_K packed once into panels, every row on them (int8-vnni, int8-avx2)
// and, as a second unit of the same extension, the table of the weights decode_layers takes:
//   layer_weights.h    their order (an enum)
//   layer_weights.cpp  their names and kinds, and decode_layer_weight_names() for Python
// Each file registers its own ops (TORCH_LIBRARY_FRAGMENT).
//
// One translation unit, as when this was one file: GCC's inlining budget is per unit
// (--param inline-unit-growth), and compiled apart the files lost some inlining into the hot
// loops (the int4 GEMV's per-thread loop left its OpenMP region, with other register choices).
// Compiled together, and with the headers' helpers of internal linkage as before, the kernels'
// loops compile to the one-file build's machine code.
#include "gemm.cpp"
#include "kquants.cpp"
#include "gguf_q8.cpp"
#include "attention.cpp"
#include "layers.cpp"
// The bfloat16 paths last: the files above compile to the machine code they did without them.
#include "gemm_panels_avx2.cpp"
#include "gemm_vnni.cpp"
#include "gemm_bf16.cpp"
#include "attention_bf16.cpp"
#include "gemm_q6k_vnni.cpp"

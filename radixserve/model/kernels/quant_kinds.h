// The kinds of quantized codes the kernels compute with, one number each. decode_layers reads a
// projection's parts as a layout [P, 2] of (rows, kind) (layer_weights.h); Python asks for a
// kind's number by name (torch.ops.radixserve.quant_kind_code, kquants.cpp).
//   llama.cpp's GGUF blocks, byte for byte as the file holds them (kquants.cpp), numbered as
//   GGML numbers them (so the numbers a GGUF file names are these: gguf.GGMLQuantizationType);
//   int4, int8: radixserve's groups of 32 with float32 scales (and mins), gemm.cpp; int4-vnni,
//   int8-vnni: the same codes for int8-vnni's decode rows (gemm_vnni.cpp: int4 packed into
//   q4_vnni_pack's panels, int8 as they are, with int8 activations).
#pragma once

#include <cstdint>

namespace radixserve {

enum QuantKind : int64_t {
  kF16 = 1,  // unquantized 16-bit matrices, computed as stored too (kquants.cpp's HalfBlock)
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kBF16 = 30,
  kInt4 = 100,
  kInt8 = 101,
  kInt4Vnni = 102,  // int4 codes packed into int8-vnni's decode panels (gemm_vnni.cpp)
  kInt8Vnni = 103,  // int8 codes, to meet int8 activations (gemm_vnni.cpp's q8_gemv_vnni)
  kQ6kVnni = 104,  // Q6_K blocks packed into int8-vnni's panels (gemm_q6k_vnni.cpp)
  // Added to a GGML type: its blocks as stored, met by int8 activations (gguf_q8.cpp; the
  // int8-avx2 path's decode rows).
  kGgufQ8 = 1000,
};

inline const char* quant_kind_name(int64_t kind) {
  switch (kind) {
    case kF16: return "f16";
    case kBF16: return "bf16";
    case kQ4_0: return "q4_0";
    case kQ4_1: return "q4_1";
    case kQ5_0: return "q5_0";
    case kQ5_1: return "q5_1";
    case kQ8_0: return "q8_0";
    case kQ2_K: return "q2_k";
    case kQ3_K: return "q3_k";
    case kQ4_K: return "q4_k";
    case kQ5_K: return "q5_k";
    case kQ6_K: return "q6_k";
    case kIQ4_NL: return "iq4_nl";
    case kIQ4_XS: return "iq4_xs";
    case kIQ2_XXS: return "iq2_xxs";
    case kIQ2_XS: return "iq2_xs";
    case kIQ2_S: return "iq2_s";
    case kIQ3_XXS: return "iq3_xxs";
    case kIQ3_S: return "iq3_s";
    case kInt4: return "int4";
    case kInt8: return "int8";
    case kInt4Vnni: return "int4-vnni";
    case kInt8Vnni: return "int8-vnni";
    case kQ6kVnni: return "q6k-vnni";
    default: return "?";
  }
}

}  // namespace radixserve

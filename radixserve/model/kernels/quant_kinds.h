// The kinds of quantized codes the kernels compute with, one number each: decode_layers reads a
// projection's kind from its weight list (layer_weights.h), and Python maps QuantizedWeight.kind
// to these numbers by name (torch.ops.radixserve.quant_kind_names(), from layer_weights.cpp).
//   int4, int8  groups of 32 with float32 scales (and mins): our repacking of Q4_1 / Q8_0
//   q4_0 ... q6_k  llama.cpp's GGUF blocks, byte for byte as the file holds them (kquants.cpp)
#pragma once

#include <cstdint>

namespace radixserve {

enum QuantKind : int64_t {
  kInt4,
  kInt8,
  kQ4_0,
  kQ5_0,
  kQ5_1,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kQuantKinds,  // their count
};

inline const char* quant_kind_name(int64_t kind) {
  static const char* const names[kQuantKinds] = {"int4", "int8", "q4_0", "q5_0",
                                                "q5_1", "q4_k", "q5_k", "q6_k"};
  return kind >= 0 && kind < kQuantKinds ? names[kind] : "?";
}

}  // namespace radixserve

// The weights of one decoder layer as decode_layers (layers.cpp) takes them, a flat list of
// kLayerWeights tensors per layer in this enum's order: the one place that order is written.
// Python builds each layer's list by name (torch.ops.radixserve.decode_layer_weight_names(),
// from layer_weights.cpp), so a weight renamed on either side fails there, by name. A part an
// architecture lacks (a bias, the q/k norms, Gemma 3's output norms) is an empty tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace radixserve {

enum LayerWeight : int64_t {
  kInputNorm,
  kQkvCodes, kQkvScales, kQkvMins, kQkvKind,  // the fused q/k/v projection
  kQkvBias,                                   // its bias (Qwen2), or empty
  kQNorm, kKNorm,                             // RMSNorm of each q and k head, or empty
  kOCodes, kOScales, kOMins, kOKind,          // attention's output projection
  kAttnOutNorm,                               // RMSNorm of attention's output, or empty
  kPostNorm,                                  // RMSNorm before the MLP
  kGateUpCodes, kGateUpScales, kGateUpMins, kGateUpKind,  // the MLP's fused gate/up
  kDownCodes, kDownScales, kDownMins, kDownKind,          // its down projection
  kMlpOutNorm,                                // RMSNorm of the MLP's output, or empty
  kLayerWeights,  // their count
};

#pragma GCC visibility push(hidden)

// Layer `layer`'s weights w[0 : kLayerWeights] are of the kinds the table gives them (a norm:
// [hidden] float32, or empty where optional; a projection's codes: uint8 or int8, 2-D (GGUF
// blocks: 1-D); scales and mins: 2-D float32 (uint8: int4-vnni's Q4_K factors) or empty;
// kind: the layout int64 [parts, 2] of (rows, kind) (quant_kinds.h)), or an error names the
// first that is not.
void check_layer_weights(const at::Tensor* w, int64_t layer);

#pragma GCC visibility pop

}  // namespace radixserve

// The weights of one decoder layer as decode_layers (layers.cpp) takes them, a flat list of
// kLayerWeights tensors per layer in this enum's order: the one place that order is written.
// Python builds each layer's list by name (torch.ops.radixserve.decode_layer_weight_names(),
// from layer_weights.cpp), so a weight renamed on either side fails there, by name.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace radixserve {

enum LayerWeight : int64_t {
  kInputNorm,
  kQkvCodes, kQkvScales, kQkvMins,  // the fused q/k/v projection
  kOCodes, kOScales, kOMins,        // attention's output projection
  kPostNorm,
  kGateUpCodes, kGateUpScales, kGateUpMins,  // the MLP's fused gate/up projection
  kDownCodes, kDownScales, kDownMins,        // its down projection
  kLayerWeights,  // their count
};

#pragma GCC visibility push(hidden)

// Layer `layer`'s weights w[0 : kLayerWeights] are of the kinds the table gives them (a norm:
// [hidden] float32; a projection's codes: 2-D uint8 or int8, scales: 2-D float32, mins: 2-D
// float32 or empty), or an error names the first that is not.
void check_layer_weights(const at::Tensor* w, int64_t layer);

#pragma GCC visibility pop

}  // namespace radixserve

// The names and kinds of a decoder layer's weights (layer_weights.h), and the op that lists the
// names for Python. Compiled as its own translation unit, apart from the kernels: code added to
// theirs shifts GCC's per-unit inlining budget, and with it their machine code.
#include "layer_weights.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

namespace radixserve {
namespace {

enum class WeightKind { kNorm, kOptionalNorm, kCodes, kScales, kMins, kKind };

struct WeightSlot {
  const char* name;  // as DecoderModel.decode_layer_weights names it (radixserve/model/decoder.py)
  WeightKind kind;
};

WeightSlot layer_weight(int64_t w) {
  using K = WeightKind;
  switch (static_cast<LayerWeight>(w)) {
    case kInputNorm: return {"input_norm", K::kNorm};
    case kQkvCodes: return {"qkv.qs", K::kCodes};
    case kQkvScales: return {"qkv.scale", K::kScales};
    case kQkvMins: return {"qkv.minv", K::kMins};
    case kQkvKind: return {"qkv.kind", K::kKind};
    case kQkvBias: return {"qkv.bias", K::kOptionalNorm};
    case kQNorm: return {"q_norm", K::kOptionalNorm};
    case kKNorm: return {"k_norm", K::kOptionalNorm};
    case kOCodes: return {"o.qs", K::kCodes};
    case kOScales: return {"o.scale", K::kScales};
    case kOMins: return {"o.minv", K::kMins};
    case kOKind: return {"o.kind", K::kKind};
    case kAttnOutNorm: return {"attn_out_norm", K::kOptionalNorm};
    case kPostNorm: return {"post_norm", K::kNorm};
    case kGateUpCodes: return {"gate_up.qs", K::kCodes};
    case kGateUpScales: return {"gate_up.scale", K::kScales};
    case kGateUpMins: return {"gate_up.minv", K::kMins};
    case kGateUpKind: return {"gate_up.kind", K::kKind};
    case kDownCodes: return {"down.qs", K::kCodes};
    case kDownScales: return {"down.scale", K::kScales};
    case kDownMins: return {"down.minv", K::kMins};
    case kDownKind: return {"down.kind", K::kKind};
    case kMlpOutNorm: return {"mlp_out_norm", K::kOptionalNorm};
    case kLayerWeights: break;
  }
  TORCH_CHECK(false, "radixserve kernel: no layer weight ", w);
}

bool is_kind(const at::Tensor& t, WeightKind kind) {
  const bool f32 = t.scalar_type() == at::kFloat;
  switch (kind) {
    case WeightKind::kNorm: return f32 && t.dim() == 1;
    case WeightKind::kOptionalNorm: return t.numel() == 0 || (f32 && t.dim() == 1);
    case WeightKind::kCodes:  // int4 / int8: [out, in/2 | in]; GGUF blocks: one run of bytes
      return (t.scalar_type() == at::kByte || t.scalar_type() == at::kChar) &&
             (t.dim() == 2 || t.dim() == 1);
    case WeightKind::kScales:
    case WeightKind::kMins:  // uint8: int4-vnni panels' Q4_K factors as stored (simd.h);
                             // float16: their Q4_0 / Q4_1 factors (gemm_vnni.cpp)
      return t.numel() == 0 || ((f32 || t.scalar_type() == at::kByte ||
                                 t.scalar_type() == at::kHalf) &&
                                t.dim() == 2);
    case WeightKind::kKind:  // the layout [parts, 2]: (rows, kind) per part
      return t.scalar_type() == at::kLong && t.dim() == 2 && t.size(1) == 2 && t.size(0) > 0;
  }
  return false;
}

std::vector<std::string> decode_layer_weight_names() {
  std::vector<std::string> names;
  for (int64_t w = 0; w < kLayerWeights; ++w) names.emplace_back(layer_weight(w).name);
  return names;
}

}  // namespace

void check_layer_weights(const at::Tensor* w, int64_t layer) {
  for (int64_t i = 0; i < kLayerWeights; ++i) {
    const WeightSlot slot = layer_weight(i);
    TORCH_CHECK(is_kind(w[i], slot.kind), "radixserve kernel: decode_layers: layer ", layer,
                "'s weight ", i, " (", slot.name, ") is a ", w[i].scalar_type(),
                " tensor of shape ", w[i].sizes(), "; see decode_layer_weight_names()");
  }
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  // No tensors, so no dispatch key: defined with its kernel.
  m.def("decode_layer_weight_names() -> str[]", &radixserve::decode_layer_weight_names);
}

// A decoder layer's fused elementwise steps (RMSNorm, q/k norms + RoPE + K/V write, the gate's
// activation times up) and decode_layers: every decoder layer of a decode step in one call, with
// no Python between the kernels. The architectures' differences (radixserve/model/config.py)
// arrive as data: optional weights are empty tensors, per-layer windows and RoPE tables are
// tensors, the activation a number.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "kv.h"
#include "layer_weights.h"
#include "ops.h"
#include "quant_kinds.h"
#include "simd.h"

namespace radixserve {
namespace {

// ---- Fused elementwise steps of a decoder layer (float32, rows in parallel) ----

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, as transformers' LlamaRMSNorm in float32.
void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  check(x.scalar_type() == at::kFloat && x.is_contiguous() && out.is_contiguous() &&
            w.is_contiguous(),
        "rms_norm: contiguous float32");
  const int64_t T = x.size(0), D = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * D;
      float* orow = op + t * D;
      float ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; ++i) orow[i] = wp[i] * (xr[i] * r);
    }
  });
}

// x[0:D] = x / sqrt(mean(x^2) + eps) * w, in place (one head's q or k).
inline void rms_norm_head(float* x, const float* w, int64_t D, float eps) {
  float ss = 0;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) x[i] = w[i] * (x[i] * r);
}

// In place on qkv [T, (H + 2 KVH) * Dh]: RMSNorm each q head by q_norm and each k head by
// k_norm [Dh] (where they are not empty: Qwen3, Gemma 3), rotate the q and k heads by the
// tokens' cos/sin [T, Dh] (rotate-half layout), then write each token's k and v heads into
// the pools' slot slots[t] (pools [NB, BS, KVH, Dh], slot = block * BS + offset).
void rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   int64_t num_heads, const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double eps) {
  check(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && cos.is_contiguous() &&
            sin.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
        "rope_kv_write: contiguous float32 qkv");
  check(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of one dtype");
  check(slots.scalar_type() == at::kLong, "rope_kv_write: int64 slots");
  const int64_t T = qkv.size(0), KVH = k_pool.size(2), Dh = k_pool.size(3);
  const int64_t half = Dh / 2, width = qkv.size(1);
  check(width == (num_heads + 2 * KVH) * Dh, "rope_kv_write: qkv width");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t slot_stride = slots.stride(0);
  const bool norms = q_norm.has_value() && q_norm->numel() > 0;
  if (norms)
    check(k_norm.has_value() && q_norm->numel() == Dh && k_norm->numel() == Dh &&
              q_norm->is_contiguous() && k_norm->is_contiguous() &&
              q_norm->scalar_type() == at::kFloat && k_norm->scalar_type() == at::kFloat,
          "rope_kv_write: q and k norms of head_dim float32");
  const float* qn = norms ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = norms ? k_norm->data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  with_kv_type(k_pool, [&](auto tag) {
    using E = decltype(tag);
    E* kp = static_cast<E*>(k_pool.data_ptr());
    E* vp = static_cast<E*>(v_pool.data_ptr());
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* row = qp + t * width;
        const float* c = cp + t * Dh;
        const float* sn = sp + t * Dh;
        for (int64_t hd = 0; hd < num_heads + KVH; ++hd) {
          float* x = row + hd * Dh;
          if (norms) rms_norm_head(x, hd < num_heads ? qn : kn, Dh, feps);
          for (int64_t i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = a * c[i] - b * sn[i];
            x[i + half] = b * c[i + half] + a * sn[i + half];
          }
        }
        const int64_t s = slot[t * slot_stride];
        kv_row_from_float(row + num_heads * Dh, KVH * Dh, kp + s * KVH * Dh);
        kv_row_from_float(row + (num_heads + KVH) * Dh, KVH * Dh, vp + s * KVH * Dh);
      }
    });
  });
}

#ifdef RS_AVX2
// silu(x) = x / (1 + e^-x): e^-|x| <= 1 keeps exp256 exact.
inline __m256 silu8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), abs));  // e^-|x|
  // sigmoid(x) = 1 / (1 + e^-x) = x >= 0 ? 1 / (1 + e) : e / (1 + e)
  const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_mul_ps(x, _mm256_blendv_ps(r, _mm256_mul_ps(e, r), x));
}

// GELU, tanh approximation (transformers' gelu_pytorch_tanh): 0.5 x (1 + tanh(u)) with
// u = sqrt(2/pi) (x + 0.044715 x^3), computed as x * sigmoid(2u) (the same function, without
// the cancellation of 1 + tanh(u) for negative u), the sigmoid as silu8's.
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));  // 2u
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), y);
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), abs));  // e^-|2u|
  const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_mul_ps(x, _mm256_blendv_ps(r, _mm256_mul_ps(e, r), y));
}
#endif

inline float silu1(float g) { return g / (1.f + std::exp(-g)); }
inline float gelu_tanh1(float g) {
  const float y = 2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.f + std::exp(-y));
}

// The MLP's gate activations, by ModelConfig.hidden_act (decoder.py's ACT_CODES).
enum GateAct : int64_t { kSilu = 0, kGeluTanh = 1 };

// out [T, I] = act(gate) * up for gate_up [T, 2I] = [gate | up]; act: a GateAct.
void gate_act_mul(const at::Tensor& gate_up, const at::Tensor& out, int64_t act) {
  check(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && out.is_contiguous(),
        "gate_act_mul: contiguous float32");
  check(act == kSilu || act == kGeluTanh, "gate_act_mul: unknown activation");
  const int64_t T = out.size(0), I = out.size(1);
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#ifdef RS_AVX2
      for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 a = act == kSilu ? silu8(x) : gelu_tanh8(x);
        _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = (act == kSilu ? silu1(g[i]) : gelu_tanh1(g[i])) * u[i];
    }
  });
}

// out [T, I] = silu(gate) * up (gate_act_mul with SiLU).
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  gate_act_mul(gate_up, out, kSilu);
}

// ---- A whole decode step's decoder layers in one call ----

// y = x W^T for quantized codes as `layout` [parts, 2] of (rows, kind) describes them
// (quant_kinds.h): one part of int4 or int8 codes, the same for int8-vnni's decode rows (int4
// as q4_vnni_pack's codes, scales and mins; int8 as they are), or GGUF blocks of one or
// several kinds (against int8 activations where the kinds are offset by kGgufQ8).
void quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor& minv, const at::Tensor& layout, const at::Tensor& out) {
  const int64_t k = layout.data_ptr<int64_t>()[1];
  if (k == kInt4) return q4_gemm(x, qs, scale, minv, out);
  if (k == kInt8) return q8_gemm(x, qs, scale, out);
  if (k == kInt4Vnni) return q4_gemm_vnni(x, qs, scale, minv, out);
  if (k == kInt8Vnni) return q8_gemv_vnni(x, qs, scale, out);
  if (k == kQ6kVnni) return q6k_gemm_vnni(x, qs, scale, out);
  if (k >= kGgufQ8) return gguf_gemm_q8(x, qs, layout, out);
  gguf_gemm(x, qs, layout, out);
}

// The rows (out features) of a projection whose layout is `layout` [parts, 2].
int64_t layout_rows(const at::Tensor& layout) {
  const int64_t* lp = layout.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t p = 0; p < layout.size(0); ++p) rows += lp[2 * p];
  return rows;
}

// In place: h += d (same shape, contiguous float32).
void add_into(const at::Tensor& h, const at::Tensor& d) {
  float* hp = h.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  for (int64_t i = 0, n = h.numel(); i < n; ++i) hp[i] += dp[i];
}

// In place: each row of x [B, N] += bias [N].
void add_bias(const at::Tensor& x, const at::Tensor& bias) {
  float* xp = x.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const int64_t B = x.size(0), N = x.size(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) xp[b * N + i] += bp[i];
}

// Every decoder layer of a decode step (one new token per sequence), as DecoderLayer's fused
// path runs them, with no Python between the kernels. h [B, hidden] float32 (the embedded
// tokens; the last layer's output on return). weights: kLayerWeights per layer, in
// LayerWeight's order (layer_weights.h). cos/sin [R, B, Dh]: R RoPE tables (full-attention
// layers' and sliding layers' own), layer_ropes [L] int64 picks each layer's; layer_windows
// [L] int64: each layer's sliding window (0: none). slots [B] int64; k_pools / v_pools
// [Lf, NB, BS, KVH, Dh]; block_table / context_lens as paged_decode_attention's. A model
// whose sliding-window layers keep their K/V in a smaller pool passes it as k_window /
// v_window [Lw, NS, BS, KVH, Dh], with window_slots / window_table (slots and block_table in
// that pool's slots); layer_pools [L] int64 says where each layer's K/V is: p < Lf is
// k_pools[p], else k_window[p - Lf]. act: the gate's activation (gate_act_mul's).
void decode_layers(const at::Tensor& h, at::TensorList weights, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& k_pools,
                   const at::Tensor& v_pools, const at::Tensor& block_table,
                   const at::Tensor& context_lens, const at::Tensor& layer_windows,
                   const at::Tensor& layer_ropes, int64_t num_heads, double eps,
                   double sm_scale, int64_t act, const at::Tensor& k_window,
                   const at::Tensor& v_window, const at::Tensor& window_slots,
                   const at::Tensor& window_table, const at::Tensor& layer_pools) {
  const int64_t L = layer_pools.numel(), Lf = k_pools.size(0);
  const int64_t KVH = k_pools.size(3), Dh = k_pools.size(4);
  check(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2, "h");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kLayerWeights,
              "radixserve kernel: decode_layers takes ", kLayerWeights, " weights per layer (",
              L, " layers), got ", weights.size(), "; see decode_layer_weight_names()");
  check(k_pools.is_contiguous() && v_pools.is_contiguous(), "pools must be contiguous");
  check(k_window.is_contiguous() && v_window.is_contiguous(), "pools must be contiguous");
  check(cos.dim() == 3 && cos.is_contiguous() && sin.is_contiguous(), "cos/sin [R, B, Dh]");
  check(layer_windows.scalar_type() == at::kLong && layer_windows.numel() == L &&
            layer_ropes.scalar_type() == at::kLong && layer_ropes.numel() == L &&
            layer_pools.scalar_type() == at::kLong,
        "layer_windows, layer_ropes and layer_pools: one int64 per layer");
  for (int64_t i = 0; i < L; ++i) check_layer_weights(weights.data() + i * kLayerWeights, i);
  const int64_t* windows = layer_windows.data_ptr<int64_t>();
  const int64_t* ropes = layer_ropes.data_ptr<int64_t>();
  const int64_t* pools = layer_pools.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) check(ropes[i] >= 0 && ropes[i] < cos.size(0), "rope table");
  for (int64_t i = 0; i < L; ++i)
    check(pools[i] >= 0 && pools[i] < Lf + k_window.size(0), "layer_pools: a pool's layer");
  const int64_t B = h.size(0), hidden = h.size(1), H = num_heads;
  const int64_t qkv_width = (H + 2 * KVH) * Dh, gu_width = layout_rows(weights[kGateUpKind]);
  const auto f32 = h.options();
  const at::Tensor x = at::empty({B, hidden}, f32), delta = at::empty({B, hidden}, f32);
  const at::Tensor qkv = at::empty({B, qkv_width}, f32);
  const at::Tensor q = qkv.narrow(1, 0, H * Dh).view({B, H, Dh});
  const at::Tensor att = at::empty({B, H, Dh}, f32), att_rows = att.view({B, H * Dh});
  const at::Tensor gate_up = at::empty({B, gu_width}, f32);
  const at::Tensor act_out = at::empty({B, gu_width / 2}, f32);
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + i * kLayerWeights;
    const bool full = pools[i] < Lf;
    const at::Tensor kp = full ? k_pools.select(0, pools[i]) : k_window.select(0, pools[i] - Lf);
    const at::Tensor vp = full ? v_pools.select(0, pools[i]) : v_window.select(0, pools[i] - Lf);
    rms_norm(h, w[kInputNorm], eps, x);
    quant_linear(x, w[kQkvCodes], w[kQkvScales], w[kQkvMins], w[kQkvKind], qkv);
    if (w[kQkvBias].numel() > 0) add_bias(qkv, w[kQkvBias]);
    rope_kv_write(qkv, cos.select(0, ropes[i]), sin.select(0, ropes[i]),
                  full ? slots : window_slots, kp, vp, H, w[kQNorm], w[kKNorm], eps);
    paged_decode_attention(q, kp, vp, full ? block_table : window_table, context_lens, sm_scale,
                           att, windows[i]);
    quant_linear(att_rows, w[kOCodes], w[kOScales], w[kOMins], w[kOKind], delta);
    if (w[kAttnOutNorm].numel() > 0) rms_norm(delta, w[kAttnOutNorm], eps, delta);
    add_into(h, delta);
    rms_norm(h, w[kPostNorm], eps, x);
    quant_linear(x, w[kGateUpCodes], w[kGateUpScales], w[kGateUpMins], w[kGateUpKind],
                 gate_up);
    gate_act_mul(gate_up, act_out, act);
    quant_linear(act_out, w[kDownCodes], w[kDownScales], w[kDownMins], w[kDownKind], delta);
    if (w[kMlpOutNorm].numel() > 0) rms_norm(delta, w[kMlpOutNorm], eps, delta);
    add_into(h, delta);
  }
}

// Free the calling thread's OpenMP worker threads (they come back on its next parallel
// region). libgomp spins only briefly before sleeping once more threads exist than CPUs, and
// every thread that ever ran a parallel region keeps its own idle workers: a thread that
// loaded the model leaves workers behind that make each of the engine loop's parallel
// regions wait on a futex wake (a decode step at 256 tokens of context on 2 cores: 18-21 ms
// in the loop thread against 6-8 ms with the loader's workers freed).
void release_omp_threads() { omp_pause_resource_all(omp_pause_soft); }

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def(
      "rope_kv_write(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor slots, Tensor(b!) k_pool, "
      "Tensor(c!) v_pool, int num_heads, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float eps=1e-6) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("gate_act_mul(Tensor gate_up, Tensor(a!) out, int act) -> ()");
  m.def("release_omp_threads() -> ()", &radixserve::release_omp_threads);  // no tensors: no key
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] weights, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor(b!) k_pools, Tensor(c!) v_pools, Tensor block_table, Tensor context_lens, "
      "Tensor layer_windows, Tensor layer_ropes, int num_heads, float eps, float sm_scale, "
      "int act, Tensor(d!) k_window, Tensor(e!) v_window, Tensor window_slots, "
      "Tensor window_table, Tensor layer_pools) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("rms_norm", &radixserve::rms_norm);
  m.impl("rope_kv_write", &radixserve::rope_kv_write);
  m.impl("silu_mul", &radixserve::silu_mul);
  m.impl("gate_act_mul", &radixserve::gate_act_mul);
  m.impl("decode_layers", &radixserve::decode_layers);
}

// The ops one kernel file calls in another: decode_layers (layers.cpp) runs the quantized GEMM
// (gemm.cpp) and decode attention (attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace radixserve {

// Hidden: bound inside this extension, so calls between the files are direct (no PLT), as
// within one file.
#pragma GCC visibility push(hidden)

// out = x qs^T for int4 codes: x [M, K] float32, qs [N, K/2] uint8, scale/minv [N, K/32].
void q4_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& minv, const at::Tensor& out);

// out = x qs^T for int8 codes: x [M, K] float32, qs [N, K] int8, scale [N, K/32].
void q8_gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
             const at::Tensor& out);

// out = x W^T for GGUF blocks: x [M, K] float32, blocks uint8 (every part's rows in turn),
// layout [parts, 2] int64 of (rows, GGML type) (see kquants.cpp). With `int8_activations`, K-quant
// parts take int8 activations: where the CPU has AVX-512 VNNI (kquant_gemm_vnni), else on AVX2
// (Q4_K and Q6_K: kquant_gemm_avx2).
void gguf_gemm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& layout,
               const at::Tensor& out, bool int8_activations = false);

// out [M, N] (contiguous) = x W^T for N rows of Q4_K, Q5_K or Q6_K blocks (`kind`, a GGML
// type), x quantized to int8 per group of 32 (gemm_vnni.cpp); false, having done nothing, for
// another kind, without AVX-512 VNNI or where N is not a multiple of 16.
bool kquant_gemm_vnni(const at::Tensor& x, int64_t kind, const uint8_t* blocks, int64_t N,
                      const at::Tensor& out);

// The same on AVX2 without VNNI (int8-avx2), for Q4_K or Q6_K blocks: the N rows packed into
// int4-vnni / q6k-vnni panels for this call, then every row on them (gemm_q6k_vnni.cpp); false,
// having done nothing, for another kind, without AVX2, or where N is not a multiple of 16.
bool kquant_gemm_avx2(const at::Tensor& x, int64_t kind, const uint8_t* blocks, int64_t N,
                      const at::Tensor& out);

// The same with x quantized to int8 per group of 32, each row's arithmetic its own; the
// layout's kinds are GGML types + kGgufQ8 (see gguf_q8.cpp).
void gguf_gemm_q8(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& layout,
                  const at::Tensor& out);

// int8-vnni's GEMMs of decode rows (gemm_vnni.cpp): out = x W^T with x quantized to int8 per
// group of 32, each row's arithmetic its own (the same whatever the number of rows); on CPUs
// with AVX-512 VNNI. int4 codes as q4_vnni_pack packs them ([P * G, 256] uint8 words,
// [P * G, 16] scales and mins, P = N / 16 panels of 16 columns), prefill rows too; int8 codes
// as q8_gemm takes them.
void q4_gemm_vnni(const at::Tensor& x, const at::Tensor& words, const at::Tensor& pscale,
                  const at::Tensor& pminv, const at::Tensor& out);
void q8_gemv_vnni(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scale,
                  const at::Tensor& out);
// The same over Q6_K blocks packed into panels (gemm_q6k_vnni.cpp's q6k_vnni_pack: words
// [N / 16 * K / 32, 384], factors [N / 16 * K / 256, 320] uint8), every row.
void q6k_gemm_vnni(const at::Tensor& x, const at::Tensor& words, const at::Tensor& factors,
                   const at::Tensor& out);

// One query row per sequence over its context (its last `window` tokens, where window > 0)
// in the paged pool (see attention.cpp).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                            const at::Tensor& v_pool, const at::Tensor& block_table,
                            const at::Tensor& context_lens, double sm_scale,
                            const at::Tensor& out, int64_t window);

// Whether the 2-16-row GEMMs compute each row exactly as the one-row GEMV does (set per step
// by the model runner for steps that verify speculative drafts; see gemm.cpp).
bool exact_rows();

#pragma GCC visibility pop

}  // namespace radixserve

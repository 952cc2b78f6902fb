// dabba's CPU ops, as C++ functions: registered as torch.ops.dabba_cpu.* by the file that defines
// each, and called directly by the native decode loop (decode_cpu.cpp), which strings them
// together without a trip through Python between them.
#pragma once

#include <ATen/ATen.h>

namespace dabba {

// elementwise_cpu.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);

// paged_attention_cpu.cpp
void write_kv_cache(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping);
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale);

// gemv_cpu.cpp
constexpr int64_t kGemvMaxRows = 4;  // activation rows handled in one pass over the weight
bool gemv_available();
void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// int8_gemv_cpu.cpp: up to kGemvMaxRows rows of x against int8 codes with a scale per output channel
bool int8_gemv_available();
void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias);

}  // namespace dabba

// dabba's CPU ops, as C++ functions: registered as torch.ops.dabba_cpu.* by the file that defines
// each, and called directly by the native layer loop (decode_cpu.cpp), which strings them
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
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale);

// gemv_cpu.cpp
// Activation rows the GEMV kernels take in one pass over the weight. Beyond them the products, not
// the bytes, set the pace, and the GEMM (bf16) or _weight_int8pack_mm (INT8) is as fast.
// Measured over SmolLM's 30 layers, bf16 GEMV / F.linear: 1.6-2.0x faster at 1-8 rows; the GEMM
// overtakes the GEMV from 10 rows (6.6 against 8.1 ms at 10). INT8 GEMV / _weight_int8pack_mm:
// 1.2-1.4x at 1-6 rows, 0.8-0.95x at 8-12.
constexpr int kGemvMaxRows = 8;
constexpr int kInt8GemvMaxRows = 6;
// From this many rows an INT8 linear dequantizes its codes to x's dtype and runs oneDNN's GEMM:
// _weight_int8pack_mm is 1.6x slower at 128 rows and 2.1x at 512, and level at 32-64.
constexpr int kInt8DequantMinRows = 96;
bool gemv_available();
void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// gemm_cpu.cpp: any number of rows (K even); dense_linear takes it up to kGemmMaxRows. Prefill
// steps measured in the engine, SmolLM, against F.linear: 22 against 30-38 ms at 64 rows, 41-44
// against 46-57 at 128, level at 256, 5-12% slower from 512.
constexpr int kGemmMaxRows = 256;
bool gemm_available();
void bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// x W^T + b on the CPU, the one place that picks the kernel: the GEMV up to kGemvMaxRows bf16 rows,
// the GEMM up to kGemmMaxRows, F.linear beyond and where neither applies (other dtypes, odd K,
// strided operands).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// SwiGLU of a merged [gate; up] projection: silu(x G^T) * (x U^T). Where dense_linear takes the GEMM
// the GEMM applies it as it stores (the [M, 2d] projection is never written); else dense_linear
// then silu_and_mul. Bit-identical either way.
void bf16_gemm_silu_and_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias);
at::Tensor dense_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias);

// int8_gemv_cpu.cpp: up to kInt8GemvMaxRows rows of x against int8 codes with a scale per output channel
bool int8_gemv_available();
void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias);

}  // namespace dabba

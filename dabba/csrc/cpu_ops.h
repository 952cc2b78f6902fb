// dabba's CPU ops, as C++ functions: registered as torch.ops.dabba_cpu.* by the file that defines
// each, and called directly by the native layer loop (decode_cpu.cpp), which strings them
// together without a trip through Python between them.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include <cstdint>

namespace dabba {

// How one linear layer of the native layer loop computes x W^T + b (decode_cpu.cpp): its
// LinearMethod's form on the CPU. Python reads these numbers from kernel_constants() (below) by
// name ("dense", "int8", "int4", "gguf", "w8a8", "w8a8_asymmetric"), so they are written only here.
enum class LinearKind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kGguf = 3, kW8A8 = 4, kW8A8Asymmetric = 5 };

// kernel_constants.cpp: the row-count thresholds below and the LinearKind values by name,
// registered as torch.ops.dabba_cpu.kernel_constants() for dabba/native.py.
c10::Dict<std::string, int64_t> kernel_constants();

// elementwise_cpu.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
// Gemma's: x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, rounded once
void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void gemma_fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x);
// One row's act(gate) * up over d values, the same code the two ops above run: a GEMM's fused
// epilogue (w8a8_cpu.cpp) calls it so that the fused layer equals the layer then the op bit for bit.
void silu_and_mul_row(float* out, const float* gate, const float* up, int64_t d);
void silu_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t d);
void gelu_tanh_and_mul_row(float* out, const float* gate, const float* up, int64_t d);
void gelu_tanh_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t d);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);

// paged_attention_cpu.cpp. An 8-bit KV cache: int8 or float8_e4m3fn codes in key_cache and
// value_cache, and their float32 scales [num_kv_heads, num_blocks, block_size] (none for a
// full-precision cache); write_kv_cache quantizes with KVQuant's q_max.
void write_kv_cache(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scales = c10::nullopt,
                    const c10::optional<at::Tensor>& value_scales = c10::nullopt, double q_max = 0.0);
// With bf16 q and cache, a request's attention runs on AMX tiles (paged_attention_cpu.cpp's
// attention_on_amx; where the CPU and OS have them and head_dim is a multiple of 32) from
// kAmxAttentionMinRows query rows (its query tokens x query heads per kv head) and
// kAmxAttentionMinKeys keys, decodes included; paged_attention's amx false keeps the AVX512-BF16
// passes, the reference. Measured on the 2-core Xeon with AMX, one thread (CPU time), steps of 2-16 requests
// of q tokens after c tokens of context through paged_attention with amx true and false: the
// speed-up with one query head per kv head (head_dim 64) is 0.82-0.98x at 1-2 rows (decodes over
// 64-2048 keys), 1.2x at 4 rows, 1.6x at 8; with SmolLM's 3 a kv head 1.09-1.2x at a decode's 3
// rows, 1.5-2.9x at 6-48 rows over 512 keys; with 16 (head_dim 128) 1.8-2.2x at a decode's 16.
// Prompts alone: 16 tokens (16 keys) 0.89-1.04x, 32 tokens 1.15-1.4x, 128 tokens 1.8x. A 2048-token
// prompt: see the header of paged_attention_cpu.cpp.
constexpr int kAmxAttentionMinRows = 3;
constexpr int kAmxAttentionMinKeys = 32;
// sliding_window <= 0: none; softcap <= 0: none (else scores -> softcap * tanh(scores / softcap))
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, double softcap,
                            const c10::optional<at::Tensor>& key_scales = c10::nullopt,
                            const c10::optional<at::Tensor>& value_scales = c10::nullopt);
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, int64_t sliding_window, double softcap,
                     const c10::optional<at::Tensor>& key_scales = c10::nullopt,
                     const c10::optional<at::Tensor>& value_scales = c10::nullopt, bool amx = true,
                     const c10::optional<at::Tensor>& key_ends = c10::nullopt);

// The bf16 linear kernels' common checks: out [M, N] bf16 with contiguous rows, and an optional
// bias [bias_size] bf16. Returns the bias's bits, or null (gemm_cpu.cpp).
const uint16_t* check_bf16_output(const at::Tensor& out, int64_t M, int64_t N, const c10::optional<at::Tensor>& bias,
                                  int64_t bias_size);

// gemv_cpu.cpp
// Activation rows the GEMV kernels take in one pass over the weight. Beyond them the products, not
// the bytes, set the pace, and the GEMM (bf16) or _weight_int8pack_mm (INT8) is as fast.
// Measured over SmolLM's 30 layers, bf16 GEMV / F.linear: 1.6-2.0x faster at 1-8 rows; the GEMM
// overtakes the GEMV from 10 rows (6.6 against 8.1 ms at 10). INT8 GEMV / _weight_int8pack_mm:
// 1.2-1.4x at 1-6 rows, 0.8-0.95x at 8-12.
constexpr int kGemvMaxRows = 8;
constexpr int kInt8GemvMaxRows = 6;
// On the AVX512-BF16 tiles (no AMX) a bf16 linear takes the GEMV while its rows of x fit in
// kGemvMaxXBytes, up to kGemvMaxRows (gemv_max_rows in gemm_cpu.cpp). The GEMV reads every row
// of x again for each weight row, from L1 while they fit beside the weight's lines; past about a
// third of a 48 KiB L1 they do not, and the GEMV slows by up to 2.3x (Llama-3.2-1B's q/k/v at 8
// rows: 7.3 ms against the GEMM's 3.3), where the GEMM reads the weight at 37-45 GB/s from 1-2
// rows on. SmolLM's, Qwen2.5-0.5B's, Qwen2.5-1.5B's and Llama-3.2-1B's linears, one cold pass of
// 128 MB each at 1-8 rows, a layer's four summed: within 1.04-1.11x of the faster kernel for each
// linear at every row count, where 8 rows for every K was up to 2.3x (2-core AMD EPYC, Zen 5,
// 48 KiB L1; 12-32 KiB budgets stay within 1.13x).
constexpr int64_t kGemvMaxXBytes = 16 * 1024;
// Rows of x up to which a bf16 linear with K inputs takes the GEMV rather than the GEMM.
int64_t gemv_max_rows(int64_t K);
// From this many rows an INT8 linear takes int8_gemm (codes widened to bf16 per call: 10.9 ms over
// SmolLM's 30 layers at 8-16 rows, where that widening sets the pace; _weight_int8pack_mm 7.5 at
// 8, 10.3 at 12, 13.1 at 14; at 64 rows 21.7 against 45.7).
constexpr int kInt8GemmMinRows = 13;
// Past the GEMM's rows a float32 or long INT8 prefill dequantizes its codes to x's dtype and runs
// dense_linear: _weight_int8pack_mm is 1.6x slower at 128 rows and 2.1x at 512.
constexpr int kInt8DequantMinRows = 96;
bool gemv_available();
void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// gemm_cpu.cpp: any number of rows (K even); dense_linear takes it up to kGemmMaxRows. Prefill
// steps measured in the engine, SmolLM, against F.linear: 22 against 30-38 ms at 64 rows, 41-44
// against 46-57 at 128, level at 256, 5-12% slower from 512.
constexpr int kGemmMaxRows = 256;
// The GEMM packs x 16 rows to a vector (and AMX tiles hold 16 rows): 17 rows cost what 32 do.
// Adaptive drafts fill the blocks a step already pays for (core/spec_budget.py).
constexpr int kGemmRowBlock = 16;
// gemm_amx_cpu.cpp: where the CPU has AMX-BF16, the OS grants the process its tile state and K is
// a multiple of 32, the GEMM (bf16 and INT8 codes) runs on AMX tiles instead, 3-5x the
// AVX512-BF16 tiles' rate at 16-256 rows. Its tile loads (16 weight rows at once) also stream the
// weight faster than the GEMV at any row count, so bf16 takes the GEMM from 1 row (4 layers of
// Qwen2.5-1.5B, 374 MB: 17.2 ms at 1 row against the GEMV's 22.9, 86% of the 25.4 GB/s that
// benchmarks.membw measured, against 64%; 16.5-17.5 ms at 2-12 rows, the GEMV 27.6-43.5). INT8
// keeps its GEMV to kInt8GemvMaxRows (12.4-18.8 ms at 1-6 rows, the widening GEMM 22-23) and takes
// the GEMM from kAmxInt8GemmMinRows (23.8 ms at 7 rows, _weight_int8pack_mm 40.3). 2-core Xeon
// with AMX; python -m benchmarks.kernels --hidden 1536 --intermediate 8960 --num-heads 12
// --num-kv-heads 2 --head-dim 128 --layers 4 (bf16_native_ms against bf16_gemv_ms).
bool amx_usable(int64_t K);
// Whether a GGUF, INT4 or INT8 linear's rows past its GEMV take the integer GEMM (code_gemm.h: x's
// 8-bit codes against the weight's, AVX512-VNNI): where this build has it and the CPU no AMX tiles
// (those multiply the weight as bf16 on AMX-BF16 tiles). gemm_cpu.cpp.
bool integer_gemm_usable(int64_t K);
constexpr int kAmxGemvMaxRows = 0;
constexpr int kAmxInt8GemmMinRows = 7;
// w8a8_cpu.cpp: INT8 weights times activations rounded to 8-bit codes per row. The weight packed in
// blocks of kW8A8Columns channels, K padded to a multiple of kW8A8Depth (dabba/quantization/w8a8.py
// packs it); at most kW8A8MaxInputs inputs, so that the int32 sums cannot overflow (255 * 128 * K).
constexpr int64_t kW8A8Columns = 16;
constexpr int64_t kW8A8Depth = 64;
constexpr int64_t kW8A8MaxInputs = 32768;
// From this many rows the sums run on AMX-INT8 tiles where the CPU has them (VNNI below): where
// their times cross on the 1B-1.5B MLP shapes (benchmarks/int8_peak.py measure_gemm at each path).
constexpr int kAmxW8A8MinRows = 12;
// The kernel w8a8_linear takes for M rows of K inputs here: "amx", "vnni", "avx2" or "scalar".
std::string w8a8_path(int64_t M, int64_t K);
// x [M, K] times the packed codes, x rounded per row (or by input_scale / input_zero, or by each
// whole row's x_range where x is a row-parallel slice); act "silu" / "gelu_tanh": a merged
// [gate; up] layer, act(gate) * up stored. path "": w8a8_path chooses.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, bool asymmetric, const std::string& path,
                       const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& input_zero,
                       const c10::optional<at::Tensor>& x_range, const std::string& act);
bool gemm_available();
// amx: take the AMX tiles where the CPU has them (gemm_amx_cpu.cpp); false keeps the AVX512-BF16
// ones, the reference.
void bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               bool amx = true);
// x W^T + b on the CPU, the one place that picks the kernel: the GEMV up to gemv_max_rows(K) bf16
// rows (kAmxGemvMaxRows where the GEMM has AMX tiles), the GEMM up to kGemmMaxRows, F.linear beyond and
// where neither applies (other dtypes, odd K, strided operands). The avx2 build runs the GEMV to
// kAvx2GemmMinRows - 1 rows, kGemvMaxRows rows a pass, and its own GEMM (gemm_avx2_cpu.cpp) from
// there, at any row count.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// A gated MLP's merged [gate; up] projection and activation: silu(x G^T) * (x U^T) (SwiGLU) or
// gelu_tanh(x G^T) * (x U^T) (GeGLU). Where dense_linear takes the GEMM (and on AMX tiles at any
// row count: a 4096-row prefill of Qwen2.5-1.5B's MLP, 168 ms against F.linear + silu_and_mul's
// 221) the GEMM applies it as it stores (the [M, 2d] projection is never written); else
// dense_linear then the elementwise kernel. Bit-identical either way below kGemmMaxRows.
void bf16_gemm_silu_and_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, bool amx = true);
void bf16_gemm_gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, bool amx = true);
at::Tensor dense_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias);
at::Tensor dense_linear_gelu_tanh_and_mul(const at::Tensor& x, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias);
// INT8 codes [N, K] with a bf16 scale per row: (x Q^T) * s (+ b), each 16 code rows widened to
// bf16 once per call and multiplied by the same tiles.
void int8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias, bool amx = true);
// int8_code_gemm_cpu.cpp: (x Q^T) * s (+ b) for bf16 x through the integer GEMM (code_gemm.h), x
// rounded to 8-bit codes per 32 values; takes where K is whole blocks of 32 and integer_gemm_usable.
bool int8_integer_gemm_takes(const at::Tensor& x, const at::Tensor& codes);
at::Tensor int8_integer_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias);
// (x Q^T) * s + b on the CPU, the one place that picks the INT8 kernel: the INT8 GEMV up to
// kInt8GemvMaxRows rows; past it, bf16 rows without AMX tiles take the integer GEMM
// (int8_integer_gemm); elsewhere int8_gemm from kInt8GemmMinRows (kAmxInt8GemmMinRows on AMX
// tiles) to kGemmMaxRows (bf16 x), codes dequantized + dense_linear from kInt8DequantMinRows, else
// _weight_int8pack_mm. A build without the GEMM (avx2) runs the INT8 GEMV at any count of bf16
// rows, kInt8GemvMaxRows a pass.
// Batch invariance: within each kernel's range of row counts a row's output does not depend on
// the other rows (bit for bit; on the avx2 build bf16 rows take one kernel at every count);
// crossing a threshold (a step with more or fewer requests) moves it by at most both kernels'
// roundings: the GEMV's int16 activations, the integer GEMM's 8-bit ones, float32 sums, and past
// kGemmMaxRows the weight rounded to bf16 once dequantized. Measured on random layers (K 576-8960)
// before the integer GEMM: 2% of outputs move by one bf16 ulp between the GEMV and the GEMM, 41% by
// one or a few into the dequantized path, all within
// 2e-3 (GEMV, GEMM) and 3.3e-3 (dequantized) of the largest output from exact products;
// tests/layers/test_int8_batch_invariance.py holds the bound. Greedy output can then change with
// the batch only where two candidates' logits lie that close.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias);

// gemm_avx2_cpu.cpp: the avx2 variant's bf16 GEMM, float32 FMAs on operands widened once per call;
// dense_linear takes it from kAvx2GemmMinRows rows. SmolLM2-135M's 30 layers of random bf16
// weights, avx2_bf16_gemm against bf16_gemv 8 rows a pass in one process (2-core Xeon, the avx2
// variant): 38 against 34 ms at 16 rows, 55 against 67 at 32, 87 against 132 at 64, 574 against
// 1003 at 512 (189 GFLOP/s); 4 layers of Qwen2.5-1.5B: level at 16, 57 against 73 at 20, 152
// against 202 at 64. The INT8 GEMV (int16 x int8 pairs by pmaddwd: twice the products an
// instruction) keeps every row count: codes widened to float32 through this GEMM were 0.9x its
// passes on Qwen2.5-1.5B's shapes at 128-512 rows.
constexpr int kAvx2GemmMinRows = 17;
bool avx2_gemm_available();
void avx2_bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// int8_gemv_cpu.cpp: up to kInt8GemvMaxRows rows of x against int8 codes with a scale per output channel
bool int8_gemv_available();
void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias);

// int4_linear_cpu.cpp: x W^T (+ b) for W in PyTorch's packed int4 CPU layout (scales_and_zeros
// [groups, N, 2], tinygemm's (q - 8) * scale + zero), the one place that picks the INT4 kernel:
// dabba's GEMV up to kInt4GemvMaxRows rows (AVX-512, N a multiple of 64, PyTorch packing 64-row
// blocks, groups of a multiple of 32: integer dot products on x rounded to 8-bit codes per 32, as the
// GGUF GEMV; or AVX2, N a multiple of 32, PyTorch packing 32-row blocks, as at its AVX2 capability);
// beyond, bf16 x on AMX tiles, the GEMM over each 64-row block dequantized to bf16 once
// per call (gemm_amx_cpu.cpp); without AMX tiles (integer_gemm_usable), x's 8-bit codes through
// the integer GEMM (code_gemm.h) as GGUF's; else _weight_int4pack_mm_for_cpu. native false forces
// the latter (the tests' reference). Qwen2.5-1.5B's 28 layers against tinygemm: the GEMV 95.5 ms at
// 8 rows (131.8); the AMX GEMM 127.5 at 9 (200.1), 105.5 at 16, 120.4 at 32 (489.9), 482 at 256
// (3835): it pays about 100 ms to dequantize whatever the rows, so the GEMV keeps up to 8.
constexpr int kInt4GemvMaxRows = 8;
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& scale_zero,
                       const c10::optional<at::Tensor>& bias, bool native = true);

// gguf_linear_cpu.cpp: x W^T + b for W in GGUF's blocks, in segments of output rows of one type
// each (blob: their bytes; segments [S, 3] int64: type, rows, byte offset), the one place that
// picks the GGUF kernel: the GEMV (x rounded to 8-bit blocks, integer dot products) up to
// gguf_gemv_max_rows(K) rows, kGgufGemvPassRows a pass; beyond, a GEMM: in integers on the same
// codes where integer_gemm_usable(K) (AVX512-VNNI, no AMX tiles), elsewhere each segment dequantized
// to x's dtype kGgufDequantChunkValues values at a time and multiplied by dense_linear. Where that
// GEMM has AMX tiles or integer products, the GEMV takes decode's kGgufGemvMaxRows (the integer
// GEMM outruns it from a dozen rows); elsewhere this build's kGgufGemvMaxRowsNoAmx: with AVX2
// alone its integer products outrun the build's bf16 GEMM at every row count measured, the
// generic build's scalar GEMV only at decode's (benchmarks/gguf_kernels.py, README).
constexpr int kGgufGemvPassRows = 4;
constexpr int kGgufGemvMaxRows = 8;
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
constexpr int kGgufGemvMaxRowsNoAmx = 512;
#else
constexpr int kGgufGemvMaxRowsNoAmx = kGgufGemvMaxRows;
#endif
constexpr int64_t kGgufDequantChunkValues = 1 << 20;
int64_t gguf_gemv_max_rows(int64_t K);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blob, const at::Tensor& segments,
                       const c10::optional<at::Tensor>& bias);
// GGUF rows [rows, row_bytes] uint8 of one type -> [rows, K] in dtype (bfloat16 or float32)
at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type, int64_t K, c10::ScalarType dtype);

}  // namespace dabba

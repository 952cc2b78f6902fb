// The GGUF GEMM in integers (gguf_gemm_cpu.cpp): prefills' and batches' rows against GGUF blocks,
// x's 8-bit codes (as the GEMV rounds them, gguf_dot.h: quantize_rows) times the weights' codes
// through code_gemm.h. For CPUs with AVX512-VNNI and no AMX tiles (those take the weights
// dequantized to bf16 through AMX-BF16: gguf_linear_cpu.cpp chooses).
#pragma once

#include "code_gemm.h"
#include "gguf_blocks.h"
#include "gguf_dot.h"

#include <cstdint>
#include <vector>

namespace dabba::gguf {

// One segment of a linear's weight: rows of one quantized type at data, row_bytes apart, whose
// outputs are y's columns from `column`.
struct GemmSegment {
  Type type;
  int64_t rows;
  const uint8_t* data;
  int64_t row_bytes, column;
};

// y[:, column:column + rows] = x W^T (+ bias) for x's M rows, rounded into `passes` of
// kGgufGemvPassRows rows each (quantize_rows with legacy and/or k_quants, as the segment's type
// needs); y rows ldy apart in x's dtype T (float or c10::BFloat16).
template <typename T>
void integer_gemm(const std::vector<A8Rows>& passes, int64_t M, int64_t K, const GemmSegment& seg, const T* bias,
                  T* y, int64_t ldy);

}  // namespace dabba::gguf

// The kernels' row-count thresholds and linear kinds as Python sees them (dabba/native.py's
// KernelConstants): defined once in cpu_ops.h, exported from the build that uses them.
#include <ATen/core/Dict.h>
#include <torch/library.h>

#include <string>

#include "cpu_ops.h"
#include "gguf_blocks.h"

namespace dabba {

c10::Dict<std::string, int64_t> kernel_constants() {
  c10::Dict<std::string, int64_t> constants;
  constants.insert("gemv_max_rows", kGemvMaxRows);
  constants.insert("gemm_max_rows", kGemmMaxRows);
  constants.insert("gemm_row_block", kGemmRowBlock);
  constants.insert("int8_gemv_max_rows", kInt8GemvMaxRows);
  constants.insert("int4_gemv_max_rows", kInt4GemvMaxRows);
  constants.insert("int8_gemm_min_rows", kInt8GemmMinRows);
  constants.insert("int8_dequant_min_rows", kInt8DequantMinRows);
  constants.insert("amx_gemv_max_rows", kAmxGemvMaxRows);
  constants.insert("amx_int8_gemm_min_rows", kAmxInt8GemmMinRows);
  constants.insert("avx2_gemm_min_rows", kAvx2GemmMinRows);
  constants.insert("linear_kind.dense", static_cast<int64_t>(LinearKind::kDense));
  constants.insert("linear_kind.int8", static_cast<int64_t>(LinearKind::kInt8));
  constants.insert("linear_kind.int4", static_cast<int64_t>(LinearKind::kInt4));
  constants.insert("linear_kind.gguf", static_cast<int64_t>(LinearKind::kGguf));
  constants.insert("linear_kind.w8a8", static_cast<int64_t>(LinearKind::kW8A8));
  constants.insert("linear_kind.w8a8_asymmetric", static_cast<int64_t>(LinearKind::kW8A8Asymmetric));
  constants.insert("w8a8_columns", kW8A8Columns);
  constants.insert("w8a8_depth", kW8A8Depth);
  constants.insert("w8a8_max_inputs", kW8A8MaxInputs);
  constants.insert("amx_w8a8_min_rows", kAmxW8A8MinRows);
  for (const gguf::TypeInfo& t : gguf::kTypes) constants.insert(std::string("gguf_type.") + t.name, t.type);
  return constants;
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("kernel_constants() -> Dict(str, int)", &dabba::kernel_constants);  // no tensor: a catch-all
}

// The parts of a decoder layer the native layer loop (decode_cpu.cpp) strings together: a linear
// layer in any of its LinearMethod's forms, and a mixture-of-experts MLP (moe_cpu.cpp). Each
// computes exactly what its Python module does on the CPU (dabba/layers/linear.py,
// dabba/layers/moe.py), with the same kernels in the same order.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "cpu_ops.h"

namespace dabba {

// A gated MLP's activation, by the name dabba.layers.activation.ACTIVATIONS gives it.
enum class Activation { kSilu, kGeluTanh };

inline Activation activation_named(const std::string& name) {
  if (name == "silu") return Activation::kSilu;
  TORCH_CHECK(name == "gelu_tanh", "unknown MLP activation '", name, "'");
  return Activation::kGeluTanh;
}

// How one linear layer computes x W^T + b, as its Python LinearMethod does on the CPU.
struct NativeLinear {
  LinearKind kind = LinearKind::kDense;
  at::Tensor weight;  // dense [N, K]; int8 codes [N, K]; int4 codes in PyTorch's packed CPU layout; gguf blocks;
                      // w8a8 codes packed as w8a8_linear reads them
  at::Tensor scales;  // int8, w8a8: [N]; int4: scales_and_zeros; gguf: segments; dense: unused
  int64_t group_size = 0;  // int4
  at::Tensor sums;  // w8a8: each channel's codes summed (int32 [N]), the zero point's correction
  c10::optional<at::Tensor> bias;

  // kind: a LinearKind value (Python's native.KernelConstants.linear_kinds); empty scales, sums or bias: none.
  static NativeLinear make(int64_t kind, at::Tensor weight, at::Tensor scales, int64_t group_size, at::Tensor sums,
                           const at::Tensor& bias) {
    TORCH_CHECK(kind >= static_cast<int64_t>(LinearKind::kDense) &&
                    kind <= static_cast<int64_t>(LinearKind::kW8A8Asymmetric),
                "unknown linear kind ", kind);
    const auto k = static_cast<LinearKind>(kind);
    TORCH_CHECK((k == LinearKind::kW8A8 || k == LinearKind::kW8A8Asymmetric) == (sums.numel() > 0),
                "a W8A8 linear, and only one, comes with its codes' sums");
    return NativeLinear{k, std::move(weight), std::move(scales), group_size, std::move(sums),
                        bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt};
  }

  bool w8a8() const { return kind == LinearKind::kW8A8 || kind == LinearKind::kW8A8Asymmetric; }

  // W8A8 with dynamic per-row rounding, as W8A8Method.apply (act ""), or apply_act_and_mul (act named)
  at::Tensor w8a8_apply(const at::Tensor& x, const c10::optional<at::Tensor>& b, const std::string& act) const {
    return w8a8_linear(x, weight, sums, scales, b, kind == LinearKind::kW8A8Asymmetric, "", c10::nullopt,
                       c10::nullopt, c10::nullopt, act);
  }

  // act(gate) * up of a merged gate_up projection's output (SwiGLU or GeGLU): fused into the GEMM
  // where dense, and into W8A8's epilogue where each half is whole blocks of its channels, as
  // LinearMethod.apply_act_and_mul(..., activation) does.
  at::Tensor act_and_mul(const at::Tensor& x, Activation activation) const {
    const bool silu = activation == Activation::kSilu;
    if (kind == LinearKind::kDense)
      return silu ? dense_linear_silu_and_mul(x, weight, bias) : dense_linear_gelu_tanh_and_mul(x, weight, bias);
    if (w8a8() && sums.numel() % (2 * kW8A8Columns) == 0)  // as W8A8Method.apply_act_and_mul
      return w8a8_apply(x, bias, silu ? "silu" : "gelu_tanh");
    const at::Tensor gate_up = (*this)(x);
    at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    if (silu)
      dabba::silu_and_mul(act, gate_up);
    else
      dabba::gelu_tanh_and_mul(act, gate_up);
    return act;
  }

  // with_bias false: the partial sums of a row-parallel shard, whose bias is added after the
  // all-reduce (as Linear.forward does under tensor parallelism).
  at::Tensor operator()(const at::Tensor& x, bool with_bias = true) const {
    const c10::optional<at::Tensor> b = with_bias ? bias : c10::nullopt;
    if (kind == LinearKind::kDense) return dense_linear(x, weight, b);  // as dabba.native.linear
    if (kind == LinearKind::kInt8) return int8_linear(x, weight, scales, b);  // as dabba.native.int8_linear
    if (kind == LinearKind::kGguf) return gguf_linear(x, weight, scales, b);  // as dabba.quantization.gguf
    if (w8a8()) return w8a8_apply(x, b, "");  // as dabba.quantization.w8a8.W8A8Method.apply
    return int4_linear(x, weight, group_size, scales, b);  // as dabba.quantization.kernels.int4_matmul_cpu
  }

};

// A mixture-of-experts MLP as dabba.layers.moe.FusedMoE computes it: the router's logits, softmax
// in float32, top-k (torch.topk's ties), renormalised and rounded as the family does; then each
// chosen expert's gated MLP over the tokens that chose it, scaled by their routing weights and
// added into their rows in ascending expert order. Experts no token chose are never touched.
struct NativeMoE {
  NativeLinear router;  // [num_experts, hidden], unquantized
  std::vector<NativeLinear> gate_up, down;  // per expert
  int64_t top_k = 0;
  bool renormalize = false;
  bool weights_in_model_dtype = false;
  Activation activation = Activation::kSilu;  // the model's, as each Expert's act_and_mul

  at::Tensor operator()(const at::Tensor& x) const;  // moe_cpu.cpp
};

}  // namespace dabba

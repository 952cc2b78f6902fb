// A step's layer loop for Llama-family models on the CPU, without Python between ops.
//
// A decode step of a small model is about ten small ops per layer; in eager PyTorch each costs
// more Python time than the bytes it moves (2 ms of a 10 ms step for SmolLM-135M, 3 ms of a
// 50 ms 128-token prefill). This loop runs exactly what LlamaDecoderLayer.forward runs on the CPU,
// in the same order and with the same kernels, so its hidden states are bit-identical to the
// Python path's (tested), which stays the reference. It serves decode steps and steps with
// prompt chunks alike: only the attention kernel differs.
//
// Per layer: [fused add +] RMSNorm, qkv projection, rotary in place (each head's first rotary_dim
// dims), KV write, paged attention, o projection, fused add + RMSNorm, gate_up projection with
// SiLU-and-mul, down projection; then the final fused add + RMSNorm. Built once per model
// (dabba/models/native_layer_loop.py); the model runner chooses between it and the Python layers
// (dabba/worker/model_runner.py).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "cpu_ops.h"

namespace dabba {

// How one linear layer computes x W^T + b, as its Python LinearMethod does on the CPU.
struct NativeLinear {
  LinearKind kind;
  at::Tensor weight;  // dense [N, K]; int8 codes [N, K]; int4 codes in PyTorch's packed CPU layout
  at::Tensor scales;  // int8: [N]; int4: scales_and_zeros; dense: unused
  int64_t group_size;  // int4
  c10::optional<at::Tensor> bias;

  // SwiGLU of a merged gate_up projection's output: fused into the GEMM where dense, as
  // LinearMethod.apply_act_and_mul(..., "silu") does.
  at::Tensor silu_and_mul(const at::Tensor& x) const {
    if (kind == LinearKind::kDense) return dense_linear_silu_and_mul(x, weight, bias);
    const at::Tensor gate_up = (*this)(x);
    at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    dabba::silu_and_mul(act, gate_up);
    return act;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (kind == LinearKind::kDense) return dense_linear(x, weight, bias);  // as dabba.native.linear
    if (kind == LinearKind::kInt8) return int8_linear(x, weight, scales, bias);  // as dabba.native.int8_linear
    return int4_linear(x, weight, group_size, scales, bias);  // as dabba.quantization.kernels.int4_matmul_cpu
  }
};

struct NativeLayer {
  at::Tensor input_norm, post_norm;
  NativeLinear qkv, o, gate_up, down;
  int64_t sliding_window;  // the layer's attention window in keys; 0: none
};

class NativeDecoder : public torch::CustomClassHolder {
 public:
  // kv_q_max: KVQuant.q_max for an 8-bit KV cache, 0 for a full-precision one.
  NativeDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                at::Tensor final_norm, double kv_q_max)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        kv_q_max_(kv_q_max), final_norm_(std::move(final_norm)) {}

  // One decoder layer; its four linears (qkv, o, gate_up, down) as LinearKind values, weights,
  // scales (empty where unused), group sizes and biases (empty where none); its attention's
  // sliding window (0: none; per layer, as models interleave sliding and global layers).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<int64_t> kinds,
                 std::vector<at::Tensor> weights, std::vector<at::Tensor> scales, std::vector<int64_t> group_sizes,
                 std::vector<at::Tensor> biases, int64_t sliding_window) {
    TORCH_CHECK(sliding_window >= 0, "add_layer: sliding_window must be >= 0 (0: none)");
    TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && scales.size() == 4 && group_sizes.size() == 4 &&
                    biases.size() == 4,
                "add_layer: four linears (qkv, o, gate_up, down)");
    NativeLinear linears[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(kinds[i] >= static_cast<int64_t>(LinearKind::kDense) &&
                      kinds[i] <= static_cast<int64_t>(LinearKind::kInt4),
                  "unknown linear kind ", kinds[i]);
      linears[i] = NativeLinear{static_cast<LinearKind>(kinds[i]), weights[i], scales[i], group_sizes[i],
                                biases[i].numel() ? c10::optional<at::Tensor>(biases[i]) : c10::nullopt};
    }
    layers_.push_back(NativeLayer{std::move(input_norm), std::move(post_norm), linears[0], linears[1], linears[2],
                                  linears[3], sliding_window});
  }

  // x: the step's embedded tokens [num_tokens, hidden]; cos/sin [num_tokens, rotary_dim]; per layer
  // the CPU backend's cache [2, kv_heads, blocks, block_size, head_dim] (keys stored transposed
  // per block): values, or 8-bit codes (int8 or float8_e4m3fn) whose scales [2, kv_heads, blocks,
  // block_size] are kv_scales' (empty for a full-precision cache). Per KV-cache group
  // (dabba/core/kv_cache_groups.py) its block table and slot mapping; layer_groups: each layer's
  // group (empty: one group). query_start_loc: each request's tokens, as the CPU backend's
  // paged_attention takes them; none when every request decodes one token. Returns the final
  // norm's output.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> kv_caches,
                     std::vector<at::Tensor> kv_scales, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> slot_mappings, std::vector<int64_t> layer_groups, const at::Tensor& seq_lens,
                     const c10::optional<at::Tensor>& query_start_loc) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(kv_scales.empty() == (kv_q_max_ == 0.0) && (kv_scales.empty() || kv_scales.size() == layers_.size()),
                "an 8-bit KV cache (kv_q_max > 0) has scales per layer, a full-precision one none");
    TORCH_CHECK(block_tables.size() == slot_mappings.size() && !block_tables.empty(),
                "one block table and slot mapping per KV-cache group");
    TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers_.size(), "one group per layer");
    for (const int64_t g : layer_groups)
      TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(block_tables.size()), "layer group ", g, " out of range");
    const int64_t n = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const NativeLayer& layer = layers_[i];
      if (i == 0) {
        residual = x;
        x = at::empty_like(residual);
        rms_norm(x, residual, layer.input_norm, eps_);
      } else {
        fused_add_rms_norm(x, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.qkv(x);
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
      // the first cos.size(1) dims of each head (all of it, or a partial rotary_dim), as apply_rotary
      rotary_embedding(q.narrow(2, 0, cos.size(1)), k.narrow(2, 0, cos.size(1)), cos, sin);
      const size_t group = layer_groups.empty() ? 0 : static_cast<size_t>(layer_groups[i]);
      const at::Tensor& block_table = block_tables[group];
      const at::Tensor& cache = kv_caches[i];
      const at::Tensor value_cache = cache[1];
      const at::Tensor key_cache = cache[0].view({value_cache.size(0), value_cache.size(1), value_cache.size(3),
                                                 value_cache.size(2)});
      c10::optional<at::Tensor> key_scales, value_scales;
      if (!kv_scales.empty()) {
        key_scales = kv_scales[i][0];
        value_scales = kv_scales[i][1];
      }
      write_kv_cache(key_cache, value_cache, k, v, slot_mappings[group], key_scales, value_scales, kv_q_max_);
      const at::Tensor attn = at::empty({n, num_heads_, head_dim_}, x.options());
      if (query_start_loc.has_value())
        paged_attention(attn, q.contiguous(), key_cache, value_cache, block_table, *query_start_loc, seq_lens, scale_,
                        layer.sliding_window, /*softcap=*/0.0, key_scales, value_scales);
      else
        paged_decode_attention(attn, q.contiguous(), key_cache, value_cache, block_table, seq_lens, scale_,
                               layer.sliding_window, /*softcap=*/0.0, key_scales, value_scales);
      x = layer.o(attn.view({n, q_size}));
      fused_add_rms_norm(x, residual, layer.post_norm, eps_);
      x = layer.down(layer.gate_up.silu_and_mul(x));
    }
    fused_add_rms_norm(x, residual, final_norm_, eps_);
    return x;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, kv_q_max_;
  at::Tensor final_norm_;
  std::vector<NativeLayer> layers_;
};

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.class_<dabba::NativeDecoder>("NativeDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, double>())
      .def("add_layer", &dabba::NativeDecoder::add_layer)
      .def("forward", &dabba::NativeDecoder::forward);
}

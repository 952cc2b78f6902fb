// A step's layer loop for Llama-family models on the CPU, without Python between ops.
//
// A decode step of a small model is about ten small ops per layer; in eager PyTorch each costs
// more Python time than the bytes it moves (2 ms of a 10 ms step for SmolLM-135M, 3 ms of a
// 50 ms 128-token prefill). This loop runs exactly what LlamaDecoderLayer.forward runs on the CPU,
// in the same order and with the same kernels, so its hidden states are bit-identical to the
// Python path's (tested), which stays the reference. It serves decode steps and steps with
// prompt chunks alike: only the attention kernel differs.
//
// Per layer: [fused add +] RMSNorm, qkv projection, [q/k RMSNorms (Qwen3 and Gemma 3 per head,
// OLMoE over all heads),] rotary in place (each head's first rotary_dim dims, from the layer's
// RoPE table), KV write, paged attention (with the layer's window and the model's soft cap),
// o projection, fused add + RMSNorm, then the MLP: gate_up projection with SiLU- or GELU-and-mul
// and down projection, or a mixture of experts (moe_cpu.cpp); then the final fused add + RMSNorm.
// Gemma's layers norm the attention's and the MLP's outputs before each residual add (four norms a
// layer: the attention output's norm stands alone, the pre-feed-forward one takes the fused add)
// and scale by (1 + w) (the gemma_* norms). Built once per model (dabba/models/native_layer_loop.py);
// the model runner chooses between it and the Python layers (dabba/worker/model_runner.py).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <vector>

#include "native_layers.h"
#include "shm_group.h"

namespace dabba {

struct NativeLayer {
  at::Tensor input_norm, post_norm;
  at::Tensor pre_ffw_norm, post_ffw_norm;  // Gemma's norms around the MLP; undefined: Llama's layout
  at::Tensor q_norm, k_norm;  // RMSNorm weights for q and k before RoPE; undefined: none
  bool qk_norm_whole;  // q_norm/k_norm span all heads at once (OLMoE), else each head (Qwen3)
  NativeLinear qkv, o, gate_up, down;  // gate_up/down: a dense MLP's, unused where moe is set
  c10::optional<NativeMoE> moe;
  int64_t sliding_window;  // the layer's attention window in keys; 0: none
  int64_t rope_table;  // which of forward's cos/sin tables the layer rotates by
};

// An RMSNorm's two kernels, by the name of the plain one (RMSNorm.native_norm in Python).
struct NormKernels {
  void (*norm)(at::Tensor, const at::Tensor&, const at::Tensor&, double);
  void (*fused_add)(at::Tensor, at::Tensor, const at::Tensor&, double);

  static NormKernels named(const std::string& name) {
    if (name == "rms_norm") return {rms_norm, fused_add_rms_norm};
    TORCH_CHECK(name == "gemma_rms_norm", "unknown RMSNorm kernel '", name, "'");
    return {gemma_rms_norm, gemma_fused_add_rms_norm};
  }
};

class NativeDecoder : public torch::CustomClassHolder {
 public:
  // kv_q_max: KVQuant.q_max for an 8-bit KV cache, 0 for a full-precision one. norm: the norms'
  // kernel ("rms_norm" or "gemma_rms_norm", as RMSNorm.native_norm names it); activation: the gated
  // MLPs' ("silu" or "gelu_tanh"); softcap: the attention scores' soft cap (0: none).
  NativeDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                at::Tensor final_norm, double kv_q_max, const std::string& norm, const std::string& activation,
                double softcap)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        kv_q_max_(kv_q_max), softcap_(softcap), final_norm_(std::move(final_norm)), norm_(NormKernels::named(norm)),
        activation_(activation_named(activation)) {
    TORCH_CHECK(softcap >= 0.0, "NativeDecoder: softcap must be >= 0 (0: none)");
  }

  // One decoder layer: its norms (q_norm/k_norm empty: none; whole: over all heads at once;
  // pre_ffw_norm/post_ffw_norm: Gemma's, empty for Llama's layout, where post_norm is the MLP's
  // input norm), its linears as LinearKind values, weights, scales (empty where unused), group
  // sizes, W8A8's codes' sums and biases (empty where none): four (qkv, o, gate_up, down), or two
  // (qkv, o) for a layer whose MLP add_moe gives next; its attention's sliding window (0: none; per
  // layer, as models interleave sliding and global layers) and the index of its RoPE table in
  // forward's cos/sin.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor pre_ffw_norm, at::Tensor post_ffw_norm,
                 at::Tensor q_norm, at::Tensor k_norm, bool qk_norm_whole, std::vector<int64_t> kinds,
                 std::vector<at::Tensor> weights, std::vector<at::Tensor> scales, std::vector<int64_t> group_sizes,
                 std::vector<at::Tensor> sums, std::vector<at::Tensor> biases, int64_t sliding_window,
                 int64_t rope_table) {
    TORCH_CHECK(sliding_window >= 0, "add_layer: sliding_window must be >= 0 (0: none)");
    TORCH_CHECK(rope_table >= 0, "add_layer: rope_table must be >= 0");
    const size_t count = kinds.size();
    TORCH_CHECK((count == 4 || count == 2) && weights.size() == count && scales.size() == count &&
                    group_sizes.size() == count && sums.size() == count && biases.size() == count,
                "add_layer: four linears (qkv, o, gate_up, down), or two (qkv, o) before add_moe");
    TORCH_CHECK(q_norm.numel() == 0 && k_norm.numel() == 0 || q_norm.numel() > 0 && k_norm.numel() > 0,
                "add_layer: q and k norms come together");
    TORCH_CHECK((pre_ffw_norm.numel() > 0) == (post_ffw_norm.numel() > 0),
                "add_layer: the norms before and after the MLP come together");
    std::vector<NativeLinear> linears(4);
    for (size_t i = 0; i < count; ++i)
      linears[i] = NativeLinear::make(kinds[i], weights[i], scales[i], group_sizes[i], sums[i], biases[i]);
    check_row_parallel(linears[1]);
    check_row_parallel(linears[3]);
    const auto defined = [](const at::Tensor& t) { return t.numel() ? t : at::Tensor(); };
    layers_.push_back(NativeLayer{std::move(input_norm), std::move(post_norm), defined(pre_ffw_norm),
                                  defined(post_ffw_norm), defined(q_norm), defined(k_norm), qk_norm_whole,
                                  linears[0], linears[1], linears[2], linears[3], c10::nullopt, sliding_window,
                                  rope_table});
    mlp_pending_ = count == 2;
  }

  // The mixture-of-experts MLP of the layer add_layer just took with two linears: its router's
  // weight (unquantized, no bias), each expert's gate_up and down linears in turn (kinds, weights,
  // scales, group sizes, sums as add_layer's; no biases), and the routing of
  // dabba.models.config.MoEConfig.
  void add_moe(at::Tensor router_weight, std::vector<int64_t> kinds, std::vector<at::Tensor> weights,
               std::vector<at::Tensor> scales, std::vector<int64_t> group_sizes, std::vector<at::Tensor> sums,
               int64_t top_k, bool renormalize, bool weights_in_model_dtype) {
    TORCH_CHECK(mlp_pending_, "add_moe follows an add_layer with two linears");
    const size_t count = kinds.size();
    TORCH_CHECK(count >= 2 && count % 2 == 0 && weights.size() == count && scales.size() == count &&
                    group_sizes.size() == count && sums.size() == count,
                "add_moe: each expert's gate_up and down linears in turn");
    const int64_t num_experts = static_cast<int64_t>(count / 2);
    TORCH_CHECK(router_weight.dim() == 2 && router_weight.size(0) == num_experts,
                "add_moe: the router has one row per expert");
    TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "add_moe: top_k must lie in [1, num_experts]");
    const at::Tensor no_bias;  // undefined: numel() 0, so none
    NativeMoE moe{NativeLinear::make(static_cast<int64_t>(LinearKind::kDense), std::move(router_weight),
                                     at::Tensor(), 0, at::Tensor(), no_bias),
                  {}, {}, top_k, renormalize, weights_in_model_dtype, activation_};
    for (size_t i = 0; i < count; i += 2) {
      moe.gate_up.push_back(NativeLinear::make(kinds[i], weights[i], scales[i], group_sizes[i], sums[i], no_bias));
      moe.down.push_back(NativeLinear::make(kinds[i + 1], weights[i + 1], scales[i + 1], group_sizes[i + 1],
                                            sums[i + 1], no_bias));
      check_row_parallel(moe.down.back());
    }
    layers_.back().moe = std::move(moe);
    mlp_pending_ = false;
  }

  // A tensor-parallel rank's loop: its layers hold this rank's shards (heads, MLP channels,
  // experts' channels), and the loop sums the row-parallel outputs (o, down, a mixture of experts)
  // over the ranks, and gathers the heads that a whole-width q/k norm (OLMoE) needs, through the
  // shared-memory segment of dabba/distributed/shm_communicator.py (its layout and timing values).
  void set_group(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, int64_t flag_stride,
                 int64_t spin_before_yield, double timeout_s) {
    group_ = std::make_shared<ShmGroup>(path, rank, size, slot_bytes, flag_stride, spin_before_yield, timeout_s);
  }

  // x: the step's embedded tokens [num_tokens, hidden]; cos/sin: RoPE tables [num_tokens,
  // rotary_dim], one per kind a layer's rope_table names (Gemma 3's sliding layers have their own
  // base); per layer
  // the CPU backend's cache [2, kv_heads, blocks, block_size, head_dim] (keys stored transposed
  // per block): values, or 8-bit codes (int8 or float8_e4m3fn) whose scales [2, kv_heads, blocks,
  // block_size] are kv_scales' (empty for a full-precision cache). Per KV-cache group
  // (dabba/core/kv_cache_groups.py) its block table and slot mapping; layer_groups: each layer's
  // group (empty: one group). query_start_loc: each request's tokens, as the CPU backend's
  // paged_attention takes them; none when every request decodes one token; key_ends: where a
  // query token's keys end when not at itself (paged_attention's). Returns the final norm's output.
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> kv_caches,
                     std::vector<at::Tensor> kv_scales, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> slot_mappings, std::vector<int64_t> layer_groups, const at::Tensor& seq_lens,
                     const c10::optional<at::Tensor>& query_start_loc,
                     const c10::optional<at::Tensor>& key_ends) const {
    TORCH_CHECK(!mlp_pending_, "the last layer has no MLP: add_moe gives it");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(kv_scales.empty() == (kv_q_max_ == 0.0) && (kv_scales.empty() || kv_scales.size() == layers_.size()),
                "an 8-bit KV cache (kv_q_max > 0) has scales per layer, a full-precision one none");
    TORCH_CHECK(block_tables.size() == slot_mappings.size() && !block_tables.empty(),
                "one block table and slot mapping per KV-cache group");
    TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers_.size(), "one group per layer");
    TORCH_CHECK(cos.size() == sin.size(), "as many cos tables as sin tables");
    for (const NativeLayer& layer : layers_)
      TORCH_CHECK(layer.rope_table < static_cast<int64_t>(cos.size()), "no RoPE table ", layer.rope_table);
    for (const int64_t g : layer_groups)
      TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(block_tables.size()), "layer group ", g, " out of range");
    const int64_t n = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const NativeLayer& layer = layers_[i];
      if (i == 0) {
        residual = x;
        x = at::empty_like(residual);
        norm_.norm(x, residual, layer.input_norm, eps_);
      } else {
        norm_.fused_add(x, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.qkv(x);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads_, head_dim_});
      if (layer.q_norm.defined()) {  // as Qwen3Attention / OlmoeAttention.norm_qk, through RMSNorm's native path
        q = layer.qk_norm_whole ? norm_whole(q, layer.q_norm) : norm_rows(q, layer.q_norm, head_dim_);
        k = layer.qk_norm_whole ? norm_whole(k, layer.k_norm) : norm_rows(k, layer.k_norm, head_dim_);
      }
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
      // the first rotary_dim dims of each head (all of it, or a partial rotary_dim), as apply_rotary
      const at::Tensor& layer_cos = cos[layer.rope_table];
      const int64_t rotary_dim = layer_cos.size(1);
      rotary_embedding(q.narrow(2, 0, rotary_dim), k.narrow(2, 0, rotary_dim), layer_cos, sin[layer.rope_table]);
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
                        layer.sliding_window, softcap_, key_scales, value_scales, true, key_ends);
      else
        paged_decode_attention(attn, q.contiguous(), key_cache, value_cache, block_table, seq_lens, scale_,
                               layer.sliding_window, softcap_, key_scales, value_scales);
      x = row_parallel(layer.o, attn.view({n, q_size}));
      if (layer.pre_ffw_norm.defined()) {  // Gemma: norm(attention) + residual -> norm -> MLP -> norm
        x = norm_rows(x, layer.post_norm, x.size(1));
        norm_.fused_add(x, residual, layer.pre_ffw_norm, eps_);
        x = norm_rows(mlp(layer, x), layer.post_ffw_norm, x.size(1));
      } else {
        norm_.fused_add(x, residual, layer.post_norm, eps_);
        x = mlp(layer, x);
      }
    }
    norm_.fused_add(x, residual, final_norm_, eps_);
    return x;
  }

 private:
  // RMSNorm over rows of ``width`` values of t (a head each, all of a token's heads, or a hidden
  // state), into a new tensor of t's shape: what RMSNorm.forward does without a residual (with a
  // q or k view of the qkv projection, or Gemma's attention and MLP outputs).
  at::Tensor norm_rows(const at::Tensor& t, const at::Tensor& weight, int64_t width) const {
    const at::Tensor rows = t.reshape({-1, width}).contiguous();
    at::Tensor out = at::empty_like(rows);
    norm_.norm(out, rows, weight, eps_);
    return out.view(t.sizes());
  }

  // A whole-width q or k norm over every rank's heads of a token: this rank's [n, heads, head_dim]
  // gathered, normed, and its own heads taken back (OlmoeAttention._norm).
  at::Tensor norm_whole(const at::Tensor& t, const at::Tensor& weight) const {
    if (!group_) return norm_rows(t, weight, t.size(1) * t.size(2));
    const int64_t width = t.size(1) * t.size(2);
    const at::Tensor all = group_->all_gather(t.reshape({t.size(0), width}));
    return norm_rows(all, weight, all.size(1)).narrow(1, group_->rank() * width, width).reshape(t.sizes());
  }

  // A W8A8 shard of a row-parallel linear rounds x by the whole row's range (W8A8Method's
  // whole_row_range gathers it from every rank), which the loop does not: such a model runs in Python.
  void check_row_parallel(const NativeLinear& linear) const {
    TORCH_CHECK(!group_ || !linear.w8a8(), "a row-parallel W8A8 shard has no native form");
  }

  // A row-parallel linear (o, down): this rank's partial sums, summed over the ranks, then the bias.
  at::Tensor row_parallel(const NativeLinear& linear, const at::Tensor& x) const {
    if (!group_) return linear(x);
    const at::Tensor y = group_->all_reduce(linear(x, /*with_bias=*/false));
    return linear.bias.has_value() ? y + *linear.bias : y;
  }

  at::Tensor mlp(const NativeLayer& layer, const at::Tensor& x) const {
    if (layer.moe.has_value()) return group_ ? group_->all_reduce((*layer.moe)(x)) : (*layer.moe)(x);
    return row_parallel(layer.down, layer.gate_up.act_and_mul(x, activation_));
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_, kv_q_max_, softcap_;
  at::Tensor final_norm_;
  NormKernels norm_;
  Activation activation_;
  std::vector<NativeLayer> layers_;
  bool mlp_pending_ = false;  // the last layer awaits add_moe
  std::shared_ptr<ShmGroup> group_;  // a tensor-parallel rank's group (set_group); none: the whole model
};

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.class_<dabba::NativeDecoder>("NativeDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, double, std::string, std::string,
                       double>())
      .def("add_layer", &dabba::NativeDecoder::add_layer)
      .def("add_moe", &dabba::NativeDecoder::add_moe)
      .def("set_group", &dabba::NativeDecoder::set_group)
      .def("forward", &dabba::NativeDecoder::forward);
}

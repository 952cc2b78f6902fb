// A mixture-of-experts MLP in the native layer loop (native_layers.h: NativeMoE), op for op as
// dabba.layers.moe.FusedMoE.forward computes it in Python, which stays the reference: the same
// routing ops, the same (token, slot) grouping, each expert's two linears on the same kernels,
// and the weighted rows added in the same order, so the two are bit-identical (tested).
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "native_layers.h"

namespace dabba {

namespace {

// Each expert's (token, slot) pairs, as flat indices token * top_k + slot in ascending order: what
// Python's stable argsort of the flattened expert ids yields, expert by expert.
std::vector<std::vector<int64_t>> group_by_expert(const at::Tensor& chosen, int64_t num_experts) {
  std::vector<std::vector<int64_t>> pairs(num_experts);
  const at::Tensor flat = chosen.contiguous();
  const int64_t* ids = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_experts, "expert id ", ids[i], " out of range");
    pairs[ids[i]].push_back(i);
  }
  return pairs;
}

}  // namespace

at::Tensor NativeMoE::operator()(const at::Tensor& x) const {
  const at::Tensor logits = router(x);
  // route(): float32 softmax, torch.topk, renormalised, rounded as the family does
  auto [weights, chosen] = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (weights_in_model_dtype) weights = weights.to(logits.scalar_type());
  const at::Tensor flat_weights = weights.flatten();
  const std::vector<std::vector<int64_t>> pairs = group_by_expert(chosen, static_cast<int64_t>(gate_up.size()));
  at::Tensor out = at::zeros_like(x);
  const auto index_options = at::TensorOptions().dtype(at::kLong);
  for (size_t e = 0; e < pairs.size(); ++e) {
    const int64_t count = static_cast<int64_t>(pairs[e].size());
    if (count == 0) continue;
    const at::Tensor expert_pairs = at::from_blob(const_cast<int64_t*>(pairs[e].data()), {count}, index_options);
    const at::Tensor tokens = at::floor_divide(expert_pairs, top_k);
    const at::Tensor y = down[e](gate_up[e].silu_and_mul(x.index_select(0, tokens))) *
                         flat_weights.index_select(0, expert_pairs).unsqueeze(1);
    out.index_add_(0, tokens, y.to(out.scalar_type()));
  }
  return out;
}

}  // namespace dabba

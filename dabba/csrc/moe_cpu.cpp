// A mixture-of-experts MLP in the native layer loop (native_layers.h: NativeMoE), op for op as
// dabba.layers.moe.FusedMoE.forward computes it in Python, which stays the reference: the same
// routing ops, the same (token, slot) grouping, each expert's two linears on the same kernels,
// and the weighted rows added in the same order, so the two are bit-identical (tested).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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

// Whether a layer's chosen experts run side by side, one expert per thread at a time (each
// expert's kernels then run on one thread), rather than one after another with each kernel
// spread over the threads. Side by side costs one parallel region per layer instead of three per
// expert: at batch-1 decode an expert's GEMVs are too small (a few MB) to repay splitting them.
// Only where there is an expert for each thread, and where every kernel an expert calls is one
// whose rows' results do not depend on how its work is split over threads, so that both ways
// give the Python layers' bits: dabba's own bf16 GEMV and GEMMs (up to kGemmMaxRows rows, where
// the build has them), INT8's and INT4's kernels; not oneDNN's or MKL's GEMMs, which F.linear
// runs for float32 and for longer bf16 prompts, and which do not promise it.
bool experts_in_parallel(const at::Tensor& x, int64_t num_active, int64_t max_rows) {
  const int64_t threads = at::get_num_threads();
  return threads > 1 && num_active >= threads && x.scalar_type() == at::kBFloat16 && max_rows <= kGemmMaxRows &&
         (gemm_available() || avx2_gemm_available()) && !at::in_parallel_region();
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

  // The chosen experts in ascending order, each with its tokens (rows of x) and routing weights.
  std::vector<int64_t> active;
  std::vector<at::Tensor> tokens, expert_weights;
  const auto index_options = at::TensorOptions().dtype(at::kLong);
  for (size_t e = 0; e < pairs.size(); ++e) {
    const int64_t count = static_cast<int64_t>(pairs[e].size());
    if (count == 0) continue;
    const at::Tensor expert_pairs = at::from_blob(const_cast<int64_t*>(pairs[e].data()), {count}, index_options);
    active.push_back(static_cast<int64_t>(e));
    tokens.push_back(at::floor_divide(expert_pairs, top_k));
    expert_weights.push_back(flat_weights.index_select(0, expert_pairs).unsqueeze(1));
  }
  const int64_t num_active = static_cast<int64_t>(active.size());
  std::vector<at::Tensor> y(num_active);
  const auto run_expert = [&](int64_t a) {
    const int64_t e = active[a];
    y[a] = (down[e](gate_up[e].silu_and_mul(x.index_select(0, tokens[a]))) * expert_weights[a]).to(x.scalar_type());
  };
  int64_t max_rows = 0;
  for (const at::Tensor& t : tokens) max_rows = std::max(max_rows, t.numel());
  if (experts_in_parallel(x, num_active, max_rows)) {
    // Heaviest first, each thread taking the next expert as it finishes one; the kernels an expert
    // calls see they are inside a parallel region and run on the calling thread.
    std::vector<int64_t> order(num_active);
    for (int64_t a = 0; a < num_active; ++a) order[a] = a;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return tokens[a].numel() > tokens[b].numel(); });
    std::atomic<int64_t> next{0};
    const int64_t threads = at::get_num_threads();
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < num_active; i = next++) run_expert(order[i]);
    });
  } else {
    for (int64_t a = 0; a < num_active; ++a) run_expert(a);
  }
  // each token's weighted expert outputs added in ascending expert order, as Python adds them
  at::Tensor out = at::zeros_like(x);
  for (int64_t a = 0; a < num_active; ++a) out.index_add_(0, tokens[a], y[a]);
  return out;
}

}  // namespace dabba

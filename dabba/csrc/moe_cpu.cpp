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

// One chosen expert: its tokens (rows of x, ascending) and each one's routing weight.
struct ExpertRows {
  int64_t expert;
  std::vector<int64_t> tokens;
  std::vector<float> weights;  // the routing weights' values (bf16 or float32, exact in float)
  at::ScalarType weights_dtype;  // the dtype Python multiplies by
};

// out[token] += (y[row] * weight).to(out's dtype) for each of an expert's rows, as Python's
// ``out.index_add_(0, tokens, (y * w).to(out.dtype))``. bf16 (the served dtype) runs as a plain
// loop: the product in float32 rounded to bf16 (exact for bf16 x bf16; float32 weights then bf16
// for Mixtral, as PyTorch's promotion does), the sum in float32 rounded; the rounding between them
// keeps the compiler from fusing them into an FMA. Other dtypes take ATen's ops, whose float32
// multiply and add are never contracted.
void add_weighted_rows(at::Tensor& out, const at::Tensor& y, const ExpertRows& g) {
  const int64_t hidden = out.size(1);
  if (out.scalar_type() != at::kBFloat16 || y.scalar_type() != at::kBFloat16 || !y.is_contiguous()) {
    const at::Tensor index = at::from_blob(const_cast<int64_t*>(g.tokens.data()),
                                           {static_cast<int64_t>(g.tokens.size())}, at::kLong);
    const at::Tensor w = at::from_blob(const_cast<float*>(g.weights.data()),
                                       {static_cast<int64_t>(g.weights.size()), 1}, at::kFloat);
    out.index_add_(0, index, (y * w.to(g.weights_dtype)).to(out.scalar_type()));
    return;
  }
  for (size_t r = 0; r < g.tokens.size(); ++r) {
    const float w = g.weights[r];
    const c10::BFloat16* src = y.data_ptr<c10::BFloat16>() + r * hidden;
    c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + g.tokens[r] * hidden;
    for (int64_t h = 0; h < hidden; ++h) {
      const c10::BFloat16 weighted(static_cast<float>(src[h]) * w);
      dst[h] = c10::BFloat16(static_cast<float>(dst[h]) + static_cast<float>(weighted));
    }
  }
}

}  // namespace

at::Tensor NativeMoE::operator()(const at::Tensor& x) const {
  const at::Tensor logits = router(x);
  // route(): float32 softmax, torch.topk, renormalised, rounded as the family does
  auto [weights, chosen] = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1);
  if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (weights_in_model_dtype) weights = weights.to(logits.scalar_type());
  const std::vector<std::vector<int64_t>> pairs = group_by_expert(chosen, static_cast<int64_t>(gate_up.size()));
  const at::Tensor flat_weights = weights.flatten().to(at::kFloat);  // exact: bf16 or float32 values

  // The chosen experts in ascending order, each with its tokens (rows of x) and routing weights.
  std::vector<ExpertRows> groups;
  for (size_t e = 0; e < pairs.size(); ++e) {
    if (pairs[e].empty()) continue;
    ExpertRows g{static_cast<int64_t>(e), {}, {}, weights.scalar_type()};
    for (const int64_t pair : pairs[e]) {
      g.tokens.push_back(pair / top_k);
      g.weights.push_back(flat_weights.data_ptr<float>()[pair]);
    }
    groups.push_back(std::move(g));
  }
  const int64_t num_active = static_cast<int64_t>(groups.size()), n = x.size(0);
  std::vector<at::Tensor> y(num_active);
  const auto run_expert = [&](int64_t a) {
    ExpertRows& g = groups[a];
    const int64_t count = static_cast<int64_t>(g.tokens.size());
    // Python's x[tokens]: the same values, so every token's row, in order, is x itself
    const at::Tensor rows = count == n ? x : x.index_select(0, at::from_blob(g.tokens.data(), {count}, at::kLong));
    y[a] = down[g.expert](gate_up[g.expert].act_and_mul(rows, activation));
  };
  int64_t max_rows = 0;
  for (const ExpertRows& g : groups) max_rows = std::max(max_rows, static_cast<int64_t>(g.tokens.size()));
  if (experts_in_parallel(x, num_active, max_rows)) {
    // Heaviest first, each thread taking the next expert as it finishes one; the kernels an expert
    // calls see they are inside a parallel region and run on the calling thread.
    std::vector<int64_t> order(num_active);
    for (int64_t a = 0; a < num_active; ++a) order[a] = a;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return groups[a].tokens.size() > groups[b].tokens.size(); });
    std::atomic<int64_t> next{0};
    const int64_t threads = at::get_num_threads();
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < num_active; i = next++) run_expert(order[i]);
    });
  } else {
    for (int64_t a = 0; a < num_active; ++a) run_expert(a);
  }
  at::Tensor out = at::zeros_like(x);
  for (int64_t a = 0; a < num_active; ++a) add_weighted_rows(out, y[a], groups[a]);
  return out;
}

}  // namespace dabba

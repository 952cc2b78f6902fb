// Sampling-side kernels for the CPU. apply_token_bitmask: structured outputs' grammar mask on the
// logits rows of the constrained requests, in place. Bit t of 32-bit word t / 32 of a mask row
// allows token t; a forbidden token's logit becomes -inf. One pass over the row, written so the
// compiler vectorises the 32 tokens of a word as blends: xgrammar's CPU kernel took 6.2 ms and
// masked_fill with a bool mask 3.1 ms for 32 x 49152 logits on a 2-core Xeon, the step's whole
// budget for structured outputs at batch 32 (worker/sampler.py keeps PyTorch's form as the reference).
//
// argmax_rows: greedy sampling's token per row, read from the logits as the LM head wrote them
// (bf16 or float32), in one pass: no float32 copy of [rows, vocab] first (at 32 x 152k that copy
// wrote 19 MB and the max read it again). Ties go to the first index and a NaN row to its first
// NaN, as torch.max(dim=-1) does, the reference it is held equal to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace dabba {

namespace {

inline void mask_row(float* logits, const int32_t* words, int64_t vocab) {
  constexpr float kForbidden = -std::numeric_limits<float>::infinity();
  const int64_t full_words = vocab / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;  // everything allowed: the common case in free text
    float* x = logits + w * 32;
    for (int b = 0; b < 32; ++b) x[b] = (bits >> b) & 1u ? x[b] : kForbidden;
  }
  for (int64_t t = full_words * 32; t < vocab; ++t)
    if (!((static_cast<uint32_t>(words[t / 32]) >> (t % 32)) & 1u)) logits[t] = kForbidden;
}

// Each lane keeps its first maximum (strict >) and where it was; the lanes' best is the largest
// value at the smallest index. NaNs never win a comparison: a row that has one is scanned again.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t vocab) {
  const int64_t full = vocab / kLanes * kLanes;
  int64_t best_index = -1;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (full > 0) {
    vfloat top = load16_as_float(x);
    vint where = lane_indices();
    vint index = where;
    vint unordered = top != top;
    for (int64_t i = kLanes; i < full; i += kLanes) {
      index += kLanes;
      const vfloat v = load16_as_float(x + i);
      const vint better = v > top;
      top = select(better, v, top);
      where = select(better, index, where);
      unordered |= v != v;
    }
    for (int64_t l = 0; l < kLanes; ++l) {
      nan |= unordered[l] != 0;
      if (best_index < 0 || top[l] > best || (top[l] == best && where[l] < best_index)) {
        best = top[l];
        best_index = where[l];
      }
    }
  }
  for (int64_t i = full; i < vocab; ++i) {
    const float v = static_cast<float>(x[i]);
    nan |= std::isnan(v);
    if (best_index < 0 || v > best) {
      best = v;
      best_index = i;
    }
  }
  if (nan)
    for (int64_t i = 0; i < vocab; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  return best_index;
}

}  // namespace

// logits [N, vocab] bf16 or float32, rows contiguous -> [N] int64: each row's first maximum.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [N, vocab > 0] with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t vocab = logits.size(1), ld = logits.stride(0);
  AT_DISPATCH_SWITCH(logits.scalar_type(), "argmax_rows",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       const float* x = logits.data_ptr<float>();
                       at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
                         for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(x + r * ld, vocab);
                       });
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       const at::BFloat16* x = logits.data_ptr<at::BFloat16>();
                       at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
                         for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(x + r * ld, vocab);
                       });
                     }));
  return out;
}

// logits [N, vocab] float32 (rows contiguous), bitmask [n, ceil(vocab / 32)] int32, rows [n] int64:
// mask row i applies to logits row rows[i].
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be [N, vocab] float32, rows contiguous");
  const int64_t vocab = logits.size(1), num_words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(1) >= num_words,
              "bitmask must be a contiguous [n, >= ", num_words, "] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "rows must be [", bitmask.size(0), "] int64, one per mask row");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "rows[", i, "] = ", row[i], " is outside the logits");
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t ld = logits.stride(0), ldw = bitmask.size(1);
  at::parallel_for(0, rows.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mask_row(base + row[i] * ld, words + i * ldw, vocab);
  });
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.impl("apply_token_bitmask", c10::DispatchKey::CPU, TORCH_FN(dabba::apply_token_bitmask));
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(dabba::argmax_rows));
}

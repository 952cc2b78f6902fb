// LoRA adapters' products added to a linear layer's output, one call for a whole step (Punica's
// SGMV shrink and expand, on the CPU): for each row r of the flat batch with an adapter in slot s,
//   t = round(x[r] A[s]^T)          A [slots, ranks, in]   (shrink: ranks dot products)
//   y[r] = round(y[r] + round(t Bt[s]))   Bt [slots, ranks, out]   (expand: out lanes per rank)
// rounded as layers/lora.py's PyTorch reference rounds (its matmuls' outputs and index_add_ in the
// tensors' dtype); only the order of the float32 sums differs. Plain loops that GCC vectorises,
// so every instruction-set variant has it; rows run in parallel (each reads its adapter's A and Bt,
// which stay in L2 for a step's rows of one adapter).
#include "cpu_ops.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dabba {

namespace {

template <typename T>
float round_to(float f) {
  return to_float(from_float<T>(f));
}

// sum_i a[i] b[i] in 16 float32 lanes (GCC keeps a single accumulator scalar without -ffast-math)
template <typename T>
DABBA_WIDE_LOOPS float dot(const T* a, const T* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) lanes[k] += to_float(a[i + k]) * to_float(b[i + k]);
  float sum = 0.f;
  for (int k = 0; k < 16; ++k) sum += lanes[k];
  for (; i < n; ++i) sum += to_float(a[i]) * to_float(b[i]);
  return sum;
}

template <typename T>
DABBA_WIDE_LOOPS void axpy(float* acc, float c, const T* row, int64_t n) {
  for (int64_t o = 0; o < n; ++o) acc[o] += c * to_float(row[o]);
}

template <typename T>
DABBA_WIDE_LOOPS void add_rounded(T* y, const float* delta, int64_t n) {
  for (int64_t o = 0; o < n; ++o) y[o] = from_float<T>(to_float(y[o]) + round_to<T>(delta[o]));
}

template <typename T>
void lora_rows(T* y, int64_t ldy, const T* x, int64_t ldx, const T* a, const T* bt, int64_t ranks, int64_t in,
               int64_t out, const int64_t* rows, const int64_t* slot_of_row, int64_t n) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(ranks), acc(out);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = rows[k], s = slot_of_row[k];
      const T* as = a + s * ranks * in;
      const T* bs = bt + s * ranks * out;
      for (int64_t j = 0; j < ranks; ++j) t[j] = round_to<T>(dot(x + r * ldx, as + j * in, in));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < ranks; ++j)
        if (t[j] != 0.f) axpy(acc.data(), t[j], bs + j * out, out);  // a shard's unused ranks are zeros
      add_rounded(y + r * ldy, acc.data(), out);
    }
  });
}

}  // namespace

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& rows,
              const at::Tensor& slots) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.stride(1) == 1 && x.stride(1) == 1 && y.size(0) == x.size(0),
              "x [T, in] and y [T, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) &&
                  a.size(1) == bt.size(1) && a.size(2) == x.size(1) && bt.size(2) == y.size(1),
              "a [slots, ranks, in] and bt [slots, ranks, out], contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add takes float32 or bf16, one dtype throughout");
  TORCH_CHECK(rows.dim() == 1 && slots.dim() == 1 && rows.size(0) == slots.size(0) && rows.is_contiguous() &&
                  slots.is_contiguous() && rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "rows and slots: [n] int64 each");
  const int64_t n = rows.size(0), num_slots = a.size(0), num_rows = x.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(rp[k] >= 0 && rp[k] < num_rows && sp[k] >= 0 && sp[k] < num_slots, "row or slot out of range");
  if (x.scalar_type() == at::kFloat)
    lora_rows(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), a.data_ptr<float>(),
              bt.data_ptr<float>(), a.size(1), a.size(2), bt.size(2), rp, sp, n);
  else
    lora_rows(y.data_ptr<c10::BFloat16>(), y.stride(0), x.data_ptr<c10::BFloat16>(), x.stride(0),
              a.data_ptr<c10::BFloat16>(), bt.data_ptr<c10::BFloat16>(), a.size(1), a.size(2), bt.size(2), rp, sp, n);
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor rows, Tensor slots) -> ()");
  m.impl("lora_add", c10::DispatchKey::CPU, TORCH_FN(dabba::lora_add));
}

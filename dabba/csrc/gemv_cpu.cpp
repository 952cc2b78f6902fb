// bf16 x bf16 -> bf16 products for a few rows of activations (decode): y[M, N] = x[M, K] W[N, K]^T.
//
// For a few rows a linear layer is a matrix-vector product: every weight byte is read once and
// used M times, so the time is the weight's bytes over memory bandwidth. oneDNN's GEMM reaches
// about half of it here (17-27 GB/s at M = 1 on SmolLM's shapes, against this kernel's 43-48).
// This kernel streams the weight rows in order, multiplies 32 bf16 pairs per instruction with
// AVX-512 BF16's vdpbf16ps (products exact in float32, float32 accumulation), and splits the rows
// across threads.
// Each output is rounded to bf16 once, at the end, as a GEMM with float32 accumulation does.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
// gemv_available() tells Python, which otherwise keeps F.linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_BF16_GEMV 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMV

// Weight row n against M activation rows: M float32 sums; K in steps of 32 with a masked tail.
template <int M>
inline void gemv_row(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K,
                     float (&out)[M]) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m)  // each x vector is used once, straight from L1
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), wv);
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k), wv);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Each thread walks its rows in order: one sequential stream, which the hardware prefetcher
// follows best. (Interleaving 4-8 rows, so that each x vector is loaded once for several, read
// 35-40 GB/s against this order's 43-48 on SmolLM's shapes at M = 1-5.)
template <int M>
void gemv_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t ldy,
               int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float acc[M];
      gemv_row<M>(x, ldx, w + n * K, K, acc);
      const float b = bias ? bf16_bits_to_float(bias[n]) : 0.f;  // added before the one rounding, as addmm
      for (int m = 0; m < M; ++m) y[m * ldy + n] = float_to_bf16_bits(acc[m] + b);
    }
  });
}

#endif  // DABBA_HAVE_BF16_GEMV

bool gemv_available() {
#ifdef DABBA_HAVE_BF16_GEMV
  return true;
#else
  return false;
#endif
}

void bf16_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(gemv_available(), "bf16_gemv: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "bf16_gemv takes 1 to ", kGemvMaxRows, " rows of x");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] bf16 tensor");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const uint16_t* bp = check_bf16_output(out, M, N, bias, N);
#ifdef DABBA_HAVE_BF16_GEMV
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  with_count<kGemvMaxRows>(M, [&](auto m) {
    gemv_rows<decltype(m)::value>(xp, x.stride(0), wp, bp, yp, out.stride(0), N, K);
  });
#endif
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("gemv_available() -> bool", &dabba::gemv_available);  // no tensor to dispatch on: a catch-all
  m.def("bf16_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("bf16_gemv", c10::DispatchKey::CPU, TORCH_FN(dabba::bf16_gemv));
}

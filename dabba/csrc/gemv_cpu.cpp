// bf16 x bf16 -> bf16 products for a few rows of activations (decode): y[M, N] = x[M, K] W[N, K]^T.
//
// For a few rows a linear layer is a matrix-vector product: every weight byte is read once and
// used M times, so the time is the weight's bytes over memory bandwidth. oneDNN's GEMM reaches
// about half of it here (17-27 GB/s at M = 1 on SmolLM's shapes, against this kernel's 43-48).
// This kernel streams the weight rows in order, multiplies 32 bf16 pairs per instruction with
// AVX-512 BF16's vdpbf16ps (products exact in float32, float32 accumulation), and splits the rows
// across threads.
// Each output is rounded to bf16 once, at the end, as a GEMM with float32 accumulation does.
// The weight is asked for kGemvPrefetchBytes ahead, as in the INT8 and AVX2 GEMVs: Llama-3.2-1B's
// 16 layers of linears (1.95 GB, cold), 2-core AMD EPYC (Zen 5, no AMX), three side-by-side
// pairs of processes: 42.9-46.6 -> 46.6-48.7 GB/s at 1 row, 35.9-36.7 -> 41.7-43.1 at 4.
// (On that VM a process now and then reads at 65-69 GB/s instead, in either build: pair runs.)
//
// On AVX2 + FMA (the avx2 variant, x86-64-v3) the same rows, threads and rounding: each 16 bf16 of
// w and x widen exactly to 2 x 8 float32 (a shift left by 16, a mask) and FMAs sum them in float32,
// with the weight asked for 3 KB ahead. 4 layers of Qwen2.5-1.5B (374 MB), 2-core Xeon, PyTorch held
// to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), against F.linear: 15.7 ms at one row
// (23.9 GB/s; benchmarks.membw reads 23.6) against 25.6, 17.9 against 35.6 at 2 rows, 20.4 against
// 53.2 at 4, 27.4 against 88.0 at 8, where the FMAs set the pace (the avx512 variant's GEMV:
// 16.9, 20.8, 25.4 and 33.3 ms). In that build dense_linear (gemm_cpu.cpp) runs this kernel 8 rows
// a pass up to kAvx2GemmMinRows - 1 rows (55 ms at 16 rows against F.linear's 161) and the avx2
// GEMM (gemm_avx2_cpu.cpp) from there (python -m benchmarks.kernels --layers 4 with that shape).
//
// Built where the compiler targets AVX512-BF16 or AVX2 + FMA (the avx512 and avx2 variants,
// dabba/kernel_variants.py); gemv_available() tells Python, which otherwise keeps F.linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_gemv.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_BF16_GEMV 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DABBA_HAVE_BF16_GEMV 1
#define DABBA_BF16_GEMV_AVX2 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMV

#ifndef DABBA_BF16_GEMV_AVX2

// Weight row n against M activation rows: M float32 sums; K in steps of 32 with a masked tail.
template <int M>
inline void gemv_row(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K,
                     float (&out)[M]) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kGemvPrefetchBytes, _MM_HINT_T0);
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

#else  // AVX2 + FMA

// 16 bf16 as two vectors of 8 float32, exactly: each 32-bit lane holds an (even, odd) pair, the even
// element in its low half. Shifting left 16 gives the even ones, masking the low half the odd ones:
// no shuffle, and x and w split alike, so the products pair up.
inline void bf16x16_to_float(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Weight row n against M activation rows: M float32 sums; K in steps of 32 (a cache line of the
// weight), then 16, then a tail copied into zeros. An FMA's result is ready 4 cycles later: at few
// rows each row keeps several accumulators, so that the FMAs of one step do not wait on each other.
template <int M>
inline void gemv_row(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K,
                     float (&out)[M]) {
  constexpr int A = M == 1 ? 4 : M <= 3 ? 2 : 1;  // accumulators a row
  __m256 acc[M][A];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kGemvPrefetchBytes, _MM_HINT_T0);
    __m256 wv[4];
    bf16x16_to_float(w + k, wv[0], wv[1]);
    bf16x16_to_float(w + k + 16, wv[2], wv[3]);
    for (int m = 0; m < M; ++m) {
      __m256 xv[4];
      bf16x16_to_float(x + m * ldx + k, xv[0], xv[1]);
      bf16x16_to_float(x + m * ldx + k + 16, xv[2], xv[3]);
      for (int j = 0; j < 4; ++j) acc[m][j % A] = _mm256_fmadd_ps(xv[j], wv[j], acc[m][j % A]);
    }
  }
  for (; k < K; k += 16) {
    alignas(32) uint16_t wt[16] = {}, xt[16] = {};  // AVX2 masks no 16-bit loads
    const int64_t left = std::min<int64_t>(16, K - k);
    const uint16_t* wp = w + k;
    if (left < 16) wp = static_cast<const uint16_t*>(std::memcpy(wt, w + k, left * sizeof(uint16_t)));
    __m256 w0, w1;
    bf16x16_to_float(wp, w0, w1);
    for (int m = 0; m < M; ++m) {
      const uint16_t* xp = x + m * ldx + k;
      if (left < 16) xp = static_cast<const uint16_t*>(std::memcpy(xt, xp, left * sizeof(uint16_t)));
      __m256 x0, x1;
      bf16x16_to_float(xp, x0, x1);
      acc[m][0] = _mm256_fmadd_ps(x0, w0, acc[m][0]);
      acc[m][A - 1] = _mm256_fmadd_ps(x1, w1, acc[m][A - 1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    __m256 sum = acc[m][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[m][a]);
    out[m] = reduce_add8(sum);
  }
}

#endif  // DABBA_BF16_GEMV_AVX2

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
  TORCH_CHECK(gemv_available(), "bf16_gemv: built without AVX512-BF16 or AVX2");
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

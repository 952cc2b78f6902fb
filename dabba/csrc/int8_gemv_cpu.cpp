// INT8-weight products for a few rows of activations (decode): y[M, N] = (x[M, K] Q[N, K]^T) * s[N],
// where Q holds int8 codes and s one scale per output channel (quantization/rtn.py's INT8).
//
// For a few rows the time is the codes' bytes over memory bandwidth, but PyTorch's
// _weight_int8pack_mm widens each code to float32 and multiplies there, and so reads the codes at
// about 25 GB/s here (SmolLM's shapes, cold, M = 1) against this kernel's 36. This kernel instead
// quantizes each activation row to int16 with one scale (max|x| / 32767: an error of at most
// max|x| / 65534 per element, below bf16's own rounding of x), and multiplies 32 code pairs per
// instruction with AVX-512 VNNI's vpdpwssd into exact int32 sums. The codes stay in the plain
// [N, K] layout that _weight_int8pack_mm reads for longer batches, so they are stored once.
// Sums are moved to float32 every 4096 input channels, before an int32 lane could overflow.
//
// On AVX2 (the avx2 variant) the same int16 x_q, rows and rounding: pmaddwd multiplies 16 code
// pairs and adds each pair into 8 int32 lanes, paddd accumulates, the sums vpdpwssd gives exactly;
// with half the lanes each sums twice the products, so they move to float32 every 2048 channels.
// The codes are asked for 3 KB ahead. 4 layers of Qwen2.5-1.5B (187 MB of codes), 2-core Xeon,
// PyTorch held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), against
// _weight_int8pack_mm: 7.1 ms at one row (26 GB/s) against 15.2, 7.6 against 17.9 at 2 rows, 10.7
// against 22.4 at 4, 12.4 against 35.1 at 6 (the avx512 variant's VNNI GEMV: 8.7, 10.6, 13.6
// and 15.2 ms). With no GEMM in that build int8_linear (gemm_cpu.cpp) runs it at any count of
// bf16 rows, 6 a pass: 34.6 ms at 16 rows against 71.7, 115 at 64 against 219.
//
// Built where the compiler targets AVX-512 VNNI or AVX2 (the avx512 and avx2 variants,
// dabba/kernel_variants.py); int8_gemv_available() tells Python, which otherwise keeps
// _weight_int8pack_mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_gemv.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_INT8_GEMV 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define DABBA_HAVE_INT8_GEMV 1
#define DABBA_INT8_GEMV_AVX2 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_INT8_GEMV

#ifndef DABBA_INT8_GEMV_AVX2

constexpr int64_t kExactChunk = 4096;  // |code| <= 128, |x_q| <= 32767: K / 16 products per lane stay below 2^31

// Weight row n against M int16 activation rows (zero-padded to a multiple of 32): M float32
// sums of code * x_q.
template <int M>
inline void int8_row(const int16_t* __restrict xq, int64_t ldx, const int8_t* __restrict w, int64_t K,
                     float (&out)[M]) {
  __m512 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t k1 = std::min(K, k0 + kExactChunk);
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {  // a cache line of codes, widened to int16 in two halves
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      const __m512i w64 = _mm512_loadu_si512(w + k);
      const __m512i wlo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(w64));
      const __m512i whi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(w64, 1));
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_dpwssd_epi32(acc[m], wlo, _mm512_loadu_si512(xq + m * ldx + k));
        acc[m] = _mm512_dpwssd_epi32(acc[m], whi, _mm512_loadu_si512(xq + m * ldx + k + 32));
      }
    }
    for (; k < k1; k += 32) {  // the tail: masked code loads; x_q is zero past K
      const int64_t left = std::min<int64_t>(32, k1 - k);
      const __mmask32 mask = static_cast<__mmask32>((1ull << left) - 1);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpwssd_epi32(acc[m], wv, _mm512_loadu_si512(xq + m * ldx + k));
    }
    for (int m = 0; m < M; ++m) total[m] = _mm512_add_ps(total[m], _mm512_cvtepi32_ps(acc[m]));
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(total[m]);
}

// Weight rows n and n + 1 at once, each as int8_row computes it (the same exact int32 sums, so
// the same results): every 32 x_q values loaded serve both rows. With one row, each 64 codes cost
// 2 M loads of x_q, which come from L2 once M rows of 2K bytes outgrow L1. int8_rows takes it
// past kInt8PairXBytes of x_q. 8 layers of Llama-3.2-1B's down projection (K = 8192), 2-core
// Zen 5, read GB/s at 3-6 rows: 33.9, 20.2, 22.0, 17.3 one row at a time, 34.1, 28.0, 23.9, 20.8
// in pairs; Qwen2.5-1.5B's (K = 8960): 25.3, 18.5, 14.8, 12.2 against 31.8, 27.1, 24.9, 20.7.
// Below that pairs lost (gate_up, K = 2048, at 2-4 rows: 48.5, 46.8, 45.3 against 36.4-36.9).
// Whole layers, `benchmarks.kernels --hidden 2048 --intermediate 8192 --num-heads 32
// --num-kv-heads 8 --layers 8 --linear-rows 1,2,3,4,5,6`, INT8 ms at 3, 4 and 5 rows, two runs
// each, alternating with the one-row kernel: 14.7 / 14.6, 15.1 / 23.2, 17.0 / 20.6 before;
// 13.0 / 12.2, 13.4 / 21.5, 15.4 / 16.6 after.
constexpr int64_t kInt8PairXBytes = 40 * 1024;
template <int M>
inline void int8_row2(const int16_t* __restrict xq, int64_t ldx, const int8_t* __restrict w, int64_t K,
                      float (&out0)[M], float (&out1)[M]) {
  const int8_t* __restrict w1 = w + K;
  __m512 total0[M], total1[M];
  for (int m = 0; m < M; ++m) total0[m] = total1[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t k1 = std::min(K, k0 + kExactChunk);
    __m512i acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      const __m512i a64 = _mm512_loadu_si512(w + k), b64 = _mm512_loadu_si512(w1 + k);
      const __m512i alo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(a64));
      const __m512i ahi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(a64, 1));
      const __m512i blo = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(b64));
      const __m512i bhi = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(b64, 1));
      for (int m = 0; m < M; ++m) {
        const __m512i xlo = _mm512_loadu_si512(xq + m * ldx + k), xhi = _mm512_loadu_si512(xq + m * ldx + k + 32);
        acc0[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc0[m], alo, xlo), ahi, xhi);
        acc1[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc1[m], blo, xlo), bhi, xhi);
      }
    }
    for (; k < k1; k += 32) {
      const int64_t left = std::min<int64_t>(32, k1 - k);
      const __mmask32 mask = static_cast<__mmask32>((1ull << left) - 1);
      const __m512i av = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k));
      const __m512i bv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w1 + k));
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(xq + m * ldx + k);
        acc0[m] = _mm512_dpwssd_epi32(acc0[m], av, xv);
        acc1[m] = _mm512_dpwssd_epi32(acc1[m], bv, xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      total0[m] = _mm512_add_ps(total0[m], _mm512_cvtepi32_ps(acc0[m]));
      total1[m] = _mm512_add_ps(total1[m], _mm512_cvtepi32_ps(acc1[m]));
    }
  }
  for (int m = 0; m < M; ++m) {
    out0[m] = _mm512_reduce_add_ps(total0[m]);
    out1[m] = _mm512_reduce_add_ps(total1[m]);
  }
}

#else  // AVX2

// pmaddwd + paddd: the exact int32 sums vpdpwssd gives, on 8 lanes, so each lane sums K / 8
// products: 512 of 128 * 32767 would just fit below 2^31; half that keeps AVX-512's margin.
constexpr int64_t kExactChunk = 2048;
// Codes asked for kGemvPrefetchBytes ahead (avx2_gemv.h), once a cache line.

inline __m256i load_codes16(const int8_t* p) {  // 16 codes widened to int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 32 codes (two int16 halves) against x_q[m][0:32] for each of the M rows, into int32 lanes.
template <int M>
inline void madd_step(__m256i (&acc)[M], __m256i wlo, __m256i whi, const int16_t* xq, int64_t ldx) {
  for (int m = 0; m < M; ++m) {
    const auto* xm = reinterpret_cast<const __m256i*>(xq + m * ldx);
    const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(wlo, _mm256_loadu_si256(xm)),
                                         _mm256_madd_epi16(whi, _mm256_loadu_si256(xm + 1)));
    acc[m] = _mm256_add_epi32(acc[m], sum);
  }
}

// As the AVX-512 row above, 32 codes a step (x_q zero-padded to a multiple of 32).
template <int M>
inline void int8_row(const int16_t* __restrict xq, int64_t ldx, const int8_t* __restrict w, int64_t K,
                     float (&out)[M]) {
  __m256 total[M];
  for (int m = 0; m < M; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t k1 = std::min(K, k0 + kExactChunk);
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      if ((k & 32) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kGemvPrefetchBytes, _MM_HINT_T0);
      const __m256i wlo = load_codes16(w + k), whi = load_codes16(w + k + 16);
      madd_step<M>(acc, wlo, whi, xq + k, ldx);
    }
    if (k < k1) {  // the tail: codes copied into zeros (AVX2 masks no byte loads); x_q is zero past K
      alignas(32) int8_t tail[32] = {};
      std::memcpy(tail, w + k, k1 - k);
      const __m256i wlo = load_codes16(tail), whi = load_codes16(tail + 16);
      madd_step<M>(acc, wlo, whi, xq + k, ldx);
    }
    for (int m = 0; m < M; ++m) total[m] = _mm256_add_ps(total[m], _mm256_cvtepi32_ps(acc[m]));
  }
  for (int m = 0; m < M; ++m) out[m] = reduce_add8(total[m]);
}

#endif  // DABBA_INT8_GEMV_AVX2

// Row m of x as int16 codes with one scale: returns the scale (1 for an all-zero row).
template <typename T>
float quantize_row_int16(const T* x, int64_t K, int16_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  const float scale = amax > 0.f ? amax / 32767.f : 1.f;
  const float inv = 1.f / scale;
  for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(to_float(x[k]) * inv));
  return scale;
}

// Each thread walks its rows in order: one sequential stream, as the bf16 GEMV (gemv_cpu.cpp).
template <int M, typename T>
void int8_rows(const int16_t* xq, int64_t ldx, const float* x_scale, const int8_t* w, const T* scales, const T* bias,
               T* y, int64_t ldy, int64_t N, int64_t K) {
  const auto store = [&](int64_t n, const float (&acc)[M]) {
    for (int m = 0; m < M; ++m) {
      const float v = acc[m] * x_scale[m] * to_float(scales[n]);
      // _weight_int8pack_mm rounds the product to the activations' dtype, then a bias adds to it
      y[m * ldy + n] = bias ? from_float<T>(to_float(from_float<T>(v)) + to_float(bias[n])) : from_float<T>(v);
    }
  };
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
#ifndef DABBA_INT8_GEMV_AVX2
    if (M * ldx * static_cast<int64_t>(sizeof(int16_t)) > kInt8PairXBytes) {
      for (; n + 2 <= end; n += 2) {
        float acc0[M], acc1[M];
        int8_row2<M>(xq, ldx, w + n * K, K, acc0, acc1);
        store(n, acc0);
        store(n + 1, acc1);
      }
    }
#endif
    for (; n < end; ++n) {
      float acc[M];
      int8_row<M>(xq, ldx, w + n * K, K, acc);
      store(n, acc);
    }
  });
}

template <typename T>
void int8_gemv_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const int64_t ldq = (K + 31) / 32 * 32;
  std::vector<int16_t> xq(M * ldq, 0);
  float x_scale[kInt8GemvMaxRows];
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m) x_scale[m] = quantize_row_int16(xp + m * x.stride(0), K, xq.data() + m * ldq);
  const auto* wp = weight.data_ptr<int8_t>();
  const T* sp = scales.data_ptr<T>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* yp = out.data_ptr<T>();
  with_count<kInt8GemvMaxRows>(M, [&](auto m) {
    int8_rows<decltype(m)::value, T>(xq.data(), ldq, x_scale, wp, sp, bp, yp, out.stride(0), N, K);
  });
}

#endif  // DABBA_HAVE_INT8_GEMV

bool int8_gemv_available() {
#ifdef DABBA_HAVE_INT8_GEMV
  return true;
#else
  return false;
#endif
}

void int8_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(int8_gemv_available(), "int8_gemv: built without AVX-512 VNNI or AVX2");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "x must be [M, K] bf16 or float32, rows contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kInt8GemvMaxRows, "int8_gemv takes 1 to ", kInt8GemvMaxRows,
              " rows of x");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kChar &&
                  weight.size(1) == x.size(1),
              "weight must be contiguous [N, K] int8 codes");
  const int64_t M = x.size(0), N = weight.size(0);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() && scales.scalar_type() == dtype,
              "scales must be [N] in x's dtype");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 &&
                  out.scalar_type() == dtype,
              "out must be [M, N] in x's dtype, rows contiguous");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "bias must be [N] in x's dtype");
#ifdef DABBA_HAVE_INT8_GEMV
  if (dtype == at::kBFloat16) int8_gemv_typed<c10::BFloat16>(out, x, weight, scales, bias);
  else int8_gemv_typed<float>(out, x, weight, scales, bias);
#endif
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("int8_gemv_available() -> bool", &dabba::int8_gemv_available);
  m.def("int8_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> ()");
  m.impl("int8_gemv", c10::DispatchKey::CPU, TORCH_FN(dabba::int8_gemv));
}

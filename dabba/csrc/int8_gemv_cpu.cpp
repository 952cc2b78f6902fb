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
// Built only where the compiler targets AVX-512 VNNI (-march=native on such a CPU);
// int8_gemv_available() tells Python, which otherwise keeps _weight_int8pack_mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_INT8_GEMV 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_INT8_GEMV

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

template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_bits_to_float(v.x);
  else return static_cast<float>(v);
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return c10::BFloat16(float_to_bf16_bits(f), c10::BFloat16::from_bits());
  else return static_cast<T>(f);
}

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
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float acc[M];
      int8_row<M>(xq, ldx, w + n * K, K, acc);
      for (int m = 0; m < M; ++m) {
        const float v = acc[m] * x_scale[m] * to_float(scales[n]);
        // _weight_int8pack_mm rounds the product to the activations' dtype, then a bias adds to it
        y[m * ldy + n] = bias ? from_float<T>(to_float(from_float<T>(v)) + to_float(bias[n])) : from_float<T>(v);
      }
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
  TORCH_CHECK(int8_gemv_available(), "int8_gemv: built without AVX-512 VNNI");
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

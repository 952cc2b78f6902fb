// Scalar helpers shared by dabba's CPU kernels, written so that GCC vectorises loops that call
// them (compile with -O3 -fno-trapping-math; see dabba/native.py).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace dabba {

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// An element of a kernel's float32 or bfloat16 operand, to float32 and back (round to nearest even).
template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_bits_to_float(v.x);
  else return static_cast<float>(v);
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return c10::BFloat16(float_to_bf16_bits(f), c10::BFloat16::from_bits());
  else return static_cast<T>(f);
}

// Loops GCC vectorises, on 512-bit vectors where the build has them (the avx512 variant's tuning
// picks 256): elementwise epilogues such as SwiGLU's exp and bf16 roundings then issue half the
// instructions. Each element's operations are the same at either width, so are its bits. Never
// inlined: GCC would compile the loop at its caller's width. Mark whole row loops, not helpers.
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
#define DABBA_WIDE_LOOPS __attribute__((target("prefer-vector-width=512"), noinline))
#else
#define DABBA_WIDE_LOOPS
#endif

// exp(x) for x <= 0: 2^n * e^r with |r| <= ln2/2 and a degree-6 Taylor polynomial (relative
// error ~2e-7, below float32's rounding of a softmax sum). libm's expf does not vectorise here.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // a select (vectorised with -fno-trapping-math); fmaxf is not
  const int32_t n = static_cast<int32_t>(x * 1.44269504f - 0.5f);
  const float r = x - static_cast<float>(n) * 0.693147181f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float silu(float g) {
  const float e = exp_nonpositive(-__builtin_fabsf(g));  // exp(-|g|) never overflows
  return (g >= 0.f ? g : g * e) / (1.f + e);
}

// SwiGLU of bf16 gate and up, rounded as F.silu(gate) * up rounds: silu's result, then the product.
inline uint16_t silu_mul_bf16_bits(float gate, float up) {
  return float_to_bf16_bits(bf16_bits_to_float(float_to_bf16_bits(silu(gate))) * up);
}

// gelu(x, approximate="tanh") = 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), in PyTorch's
// op order (its CPU kernel's), with tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|), from the
// vectorisable exp (libm's tanhf does not vectorise: 13 ns an element, against 1). Equal to
// PyTorch's within float32 rounding; where tanh(y) nears -1 (x below about -3) both results are
// mostly cancellation, and below 1e-3 a bf16 result may differ from PyTorch's in the last bit.
inline float gelu_tanh(float x) {
  const float y = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  const float e = exp_nonpositive(-2.f * __builtin_fabsf(y));
  const float t = (1.f - e) / (1.f + e);  // tanh(|y|)
  return 0.5f * x * (1.f + (y >= 0.f ? t : -t));
}

// GeGLU of bf16 gate and up, rounded as transformers' act_fn(gate) * up rounds.
inline uint16_t gelu_mul_bf16_bits(float gate, float up) {
  return float_to_bf16_bits(bf16_bits_to_float(float_to_bf16_bits(gelu_tanh(gate))) * up);
}

// f(std::integral_constant<int, n>{}) for a runtime 1 <= n <= Max: kernels that keep n rows or
// chunks in registers take n as a template parameter. False (f not called) when n is out of range.
template <int Max, typename F>
inline bool with_count(int64_t n, F&& f) {
  if constexpr (Max >= 1) {
    if (n == Max) {
      f(std::integral_constant<int, Max>{});
      return true;
    }
    return with_count<Max - 1>(n, std::forward<F>(f));
  }
  return false;
}

}  // namespace dabba

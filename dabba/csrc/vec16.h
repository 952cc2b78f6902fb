// 16 float32 lanes as GCC vector types, and loads that widen bf16 (a 16-bit shift) or any other
// scalar to them: shared by the attention and sampling kernels, portable to any x86 the compiler
// targets (AVX-512 makes a lane group one register).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace dabba {

constexpr int64_t kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vbits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// 16 consecutive elements widened to float32.
template <typename scalar_t>
inline vfloat load16_as_float(const scalar_t* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

template <>
inline vfloat load16_as_float<float>(const float* p) {
  return load16(p);
}

template <>
inline vfloat load16_as_float<at::BFloat16>(const at::BFloat16* p) {
  vbits16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  vbits32 wide = __builtin_convertvector(bits, vbits32) << 16;
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

}  // namespace dabba

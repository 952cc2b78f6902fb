// A kernel's float32 or bfloat16 operand, 8 or 16 values at a time, as float32 lanes (a bfloat16's
// bits are a float32's top half): what the GEMVs' and the W8A8 GEMM's activation rounding read.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>

namespace dabba {

inline __m256 load_ps8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load_ps8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load_ps16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_ps16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace dabba

#endif

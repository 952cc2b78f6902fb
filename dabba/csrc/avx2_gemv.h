// What the AVX2 GEMVs (the avx2 variant's bf16 and INT8 decode kernels: gemv_cpu.cpp,
// int8_gemv_cpu.cpp) share; the AVX-512 INT8 GEMV takes the prefetch distance too.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace dabba {

// How far ahead of the k it multiplies a thread asks for the weight's bytes (rows are contiguous,
// so near a row's end it asks for the next row's). Without it each row waited on memory: the bf16
// GEMV 17 against 22 GB/s at one row of x, 5 against 14.5 at 8; INT8's 16 against 23-29 at one
// row, 7.5 against 13-14.5 at 6 (4 layers of Qwen2.5-1.5B); 2-6 KB ahead did as well. The AVX-512
// INT8 GEMV asks as far ahead: Qwen2.5-1.5B's 28 layers of codes (1.3 GB, cold) 60.5 against 71.8 ms
// at one row (21.7 GB/s), 88.3 against 112.5 at 6 (int8_linear over every layer, 2-core Xeon).
constexpr int64_t kGemvPrefetchBytes = 3072;

// The sum of 8 float32 lanes.
inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace dabba

#endif

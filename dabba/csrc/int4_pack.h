// PyTorch's packed int4 CPU layout (_convert_weight_to_int4pack_for_cpu on AVX-512) as dabba's INT4
// kernels read it: the GEMV (int4_linear_cpu.cpp) and the AMX GEMM (gemm_amx_cpu.cpp). Per block of
// kInt4BlockRows output rows, for each k, 32 bytes: byte i holds row i's code in its low nibble and
// row 32 + i's in its high nibble. tinygemm dequantizes (q - 8) * scale + zero, with bf16 (scale,
// zero) pairs [groups, N, 2].
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace dabba {

constexpr int kInt4BlockRows = 64;

// 16 rows' bf16 (scale, zero) pairs -> scale and offset = zero - 8 scale, so that w = q * scale + offset.
inline void int4_scale_offset(const uint32_t* pairs, __m512& scale, __m512& offset) {
  const __m512i sz = _mm512_loadu_si512(pairs);
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
  const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);
}

}  // namespace dabba

#endif

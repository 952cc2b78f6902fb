// What dabba's two bf16 GEMM microkernels share: the activations packed once per call into pairs
// of K for 16 rows at a time (the layout both vdpbf16ps's broadcast operand and an AMX B tile
// read), and the rounding of float32 sums to bf16 outputs (bias, INT8 scale, SwiGLU), so that the
// AVX512-BF16 tiles (gemm_cpu.cpp) and the AMX tiles (gemm_amx_cpu.cpp) round alike.
#pragma once

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_BF16_GEMM 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DABBA_HAVE_AMX 1  // the AMX kernels (gemm_amx_cpu.cpp, paged_attention_cpu.cpp) are built
#endif
#endif

namespace dabba {

// What a GEMM stores: its rounded sums, or for a gated MLP's merged [gate; up] weight
// act(gate) * up, rounded as silu_and_mul / gelu_tanh_and_mul (elementwise_cpu.cpp) round.
enum class Epilogue { kPlain, kSilu, kGeluTanh };

#ifdef DABBA_HAVE_BF16_GEMM

// r[i] = 16 pairs of row i -> r[c] = pair c of rows 0..15 (a 16 x 16 transpose of 32-bit lanes).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: rows i, i+1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // s[g + c], lane L: rows g..g+3 of pair 4L + c
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of s[c], s[4 + c], s[8 + c], s[12 + c] into pair 4L + c
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// xp[v][j][i] = pair j of row 16v + i; rows past M are zeros. 16 pairs of 16 rows at a time, in
// registers, on the calling thread: opening a parallel region for it cost more than the packing
// (a whole 64 x 576 call against 16 weight rows: 13.6 us with the scalar packing split across
// threads, 5.8 us now).
inline void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t pairs = K / 2, vectors = (M + 15) / 16;
  for (int64_t v = 0; v < vectors; ++v) {
    uint32_t* dst = xp + v * pairs * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, M - v * 16));
    const uint32_t* src[16];
    for (int i = 0; i < rows; ++i) src[i] = reinterpret_cast<const uint32_t*>(x + (v * 16 + i) * ldx);
    int64_t j = 0;
    for (; j + 16 <= pairs; j += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_si512(src[i] + j) : _mm512_setzero_si512();
      transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + (j + c) * 16, r[c]);
    }
    for (; j < pairs; ++j)
      for (int i = 0; i < 16; ++i) dst[j * 16 + i] = i < rows ? src[i][j] : 0;
  }
}

// A column's float32 sums plus its bias, rounded to bf16 once (round to nearest even). With INT8
// codes, times the column's scale, rounded, then plus the bias, as _weight_int8pack_mm + bias.
inline __m256i round_column(__m512 sums, const uint16_t* scale, const uint16_t* bias) {
  if (scale) {
    sums = _mm512_mul_ps(sums, _mm512_set1_ps(bf16_bits_to_float(*scale)));
    if (!bias) return (__m256i)_mm512_cvtneps_pbh(sums);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sums);
    sums = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
  }
  if (bias) sums = _mm512_add_ps(sums, _mm512_set1_ps(bf16_bits_to_float(*bias)));
  return (__m256i)_mm512_cvtneps_pbh(sums);
}

// A gated epilogue of two bf16 columns, lane by lane, exactly as the elementwise kernels compute it.
template <Epilogue E>
inline __m256i gated_column(__m256i gate, __m256i up) {
  static_assert(E != Epilogue::kPlain, "a gated epilogue");
  alignas(32) uint16_t g[16], u[16], out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(g), gate);
  _mm256_store_si256(reinterpret_cast<__m256i*>(u), up);
  for (int i = 0; i < 16; ++i)
    out[i] = E == Epilogue::kSilu ? silu_mul_bf16_bits(bf16_bits_to_float(g[i]), bf16_bits_to_float(u[i]))
                                  : gelu_mul_bf16_bits(bf16_bits_to_float(g[i]), bf16_bits_to_float(u[i]));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(out));
}

// int8 codes -> bf16, exactly (|q| <= 128 needs 8 significant bits; bf16 has 8).
inline void widen_codes(const int8_t* q, int64_t K, uint16_t* dst) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
    _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
  }
  for (; k < K; ++k) dst[k] = float_to_bf16_bits(static_cast<float>(q[k]));
}

#ifdef DABBA_HAVE_AMX
// LDTILECFG's 64-byte operand: palette 1, then each tile's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
#endif

// The AMX microkernel (gemm_amx_cpu.cpp), over packed x as above, where amx_usable(K) (cpu_ops.h).
// Columns go by kAmxColumns (threads split N in multiples of it; a partial last step is padded).
constexpr int64_t kAmxColumns = 32;
// Plain: y[:, n_begin:n_end] = x W^T (+ b). Gated: W is [gate; up] with up_rows gate rows, and
// y[:, n] = act(gate_n) * up_n for n in [n_begin, n_end) < up_rows.
void amx_gemm_rows(Epilogue epilogue, const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t up_rows,
                   const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end);
// INT8 codes [N, K] with a bf16 scale per row, widened to bf16 kAmxColumns rows at a time.
void amx_int8_gemm_rows(const uint32_t* xp, int64_t M, int64_t K, const int8_t* q, const uint16_t* scales,
                        const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end);
// INT4 codes in PyTorch's packed int4 CPU layout (64-row blocks: per k, 32 bytes, byte i = row i's
// code | row 32 + i's << 4) with tinygemm's bf16 (scale, zero) pairs [groups, N, 2]: y[:, 64 b:64 b + 64]
// = x W^T (+ b) for blocks b in [block_begin, block_end). x [M, K] bf16 rows as they lie (the A
// operand); each block is dequantized to bf16 K-pairs for 16 rows (the B operand) once per call.
void amx_int4_gemm_blocks(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, const uint32_t* scale_zero,
                          int64_t group_size, const uint16_t* bias, uint16_t* y, int64_t N, int64_t block_begin,
                          int64_t block_end);

#endif  // DABBA_HAVE_BF16_GEMM

}  // namespace dabba

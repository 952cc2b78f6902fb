// The GGUF GEMV's parts (gguf_linear_cpu.cpp strings them together): rows of x rounded to 8-bit
// codes, and one weight row of each type against them.
//
// Each row of x is rounded to 8-bit codes with a float32 scale d = max|x| / 127 per block of 32 values for
// the legacy types (Q4_0 ... Q8_0, llama.cpp's q8_0) and per super-block of 256 for the K types
// (llama.cpp's q8_K), and weights meet codes in integer dot products, exact in int32:
// - legacy: a block's 32 weights in one vpdpbusd (AVX512-VNNI; vpmaddubsw + vpmaddwd on AVX2) of
//   unsigned codes against the signed activation codes, scaled by a float fma per block: |w| by
//   the codes with w's sign (Q8_0, Q4_0, Q5_0), or u where w = a u + min (Q4_1, Q5_1; the min
//   meets the activation block's sum).
// - K: vpmaddubsw pairs then vpmaddwd by each sub-block's integer scale, summed over the whole
//   super-block in int32 and scaled once; the mins (Q4_K/Q5_K) and Q6_K's offset of 32 meet the
//   codes' sums per sub-block.
// F32/F16/BF16 segments dot float x with their values. Without AVX2 (the generic variant) each
// block is dequantized and dotted with the same codes in float32.
#pragma once

#include <ATen/ATen.h>

#include "avx2_gemv.h"
#include "cpu_math.h"
#include "gguf_blocks.h"
#include "x_loads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DABBA_GGUF_SIMD 1
#endif

namespace dabba::gguf {

constexpr int64_t kA8Block = 32;  // legacy types' activation values per scale
constexpr int64_t kSuperBlock = 256;  // K types' activation values per scale (a super-block)

// Rows of x rounded to 8-bit codes, as the segments' types need them: per block of 32 with its own
// float16 scale for the legacy types (q, d, s), per super-block of 256 for the K types (qk, dk, and the
// codes' sums per 16 and per 32 for their offsets). xf keeps x in float32 for float segments.
struct A8Rows {
  int64_t M = 0, K = 0;
  int64_t blocks = 0;  // of 32: K / 32 rounded up
  std::vector<int8_t> q;  // [M, blocks * 32]
  std::vector<float> d, s;  // [M, blocks]: each block's scale, and scale * sum of its codes
  std::vector<int8_t> qk;  // [M, K]
  std::vector<float> dk;  // [M, K / 256]
  std::vector<int16_t> sum16, sum32;  // [M, K / 16], [M, K / 32]: sums of qk's codes
  std::vector<float> xf;  // [M, K]
  // The run layouts (gguf_blocks.h): codes of each run of 512 values ordered as the layout's bytes
  // meet them, [M, runs, 8, 16 groups, 4]: 64 bytes give 4 codes of each group of 32. Q4_0x16's
  // from q, with -8 * each block's codes' sum (the weights' offset of 8, folded into the integer
  // sums), [M, q_runs_count, 16], a partial last run (tail_groups blocks) padded with zeros to 16;
  // Q4_Kx2's from qk, with each sub-block's codes' sum and its super-block's scale, [M, runs, 16] each.
  int64_t runs = 0;  // whole runs a row: K / 512
  int64_t tail_groups = 0, q_runs_count = 0;  // Q4_0x16's blocks past the whole runs; runs with them
  std::vector<int8_t> q_runs, qk_runs;
  std::vector<int32_t> offset8;
  std::vector<float> sum_runs, dk_runs;
  // Q6_Kx1: qk's codes of each super-block as its layout meets them, [M, K / 256, 4, 16 sub-blocks,
  // 4], and -32 * each sub-block of 16's codes' sum (the codes' offset of 32), [M, K / 16]
  std::vector<int8_t> qk_q6;
  std::vector<int32_t> offset32;
};

// [M, K] codes -> the run layouts' order (A8Rows::q_runs), rows ld apart; a last run of tail_groups
// groups left at zero past them (out zeroed by the caller).
inline void order_runs(const int8_t* q, int64_t M, int64_t ld, int64_t runs, int8_t* out, int64_t tail_groups = 0) {
  const int64_t count = runs + (tail_groups > 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < count; ++r)
      for (int64_t j = 0; j < (r < runs ? 16 : tail_groups); ++j)
        for (int t = 0; t < 8; ++t)
          std::memcpy(out + ((m * count + r) * 8 + t) * 64 + 4 * j, q + m * ld + r * kRunValues + 32 * j + 4 * t, 4);
}

// x[0:n] -> 8-bit codes, returning their scale d (x ~ code * d), rounded code for code as llama.cpp's
// x86 kernels round activations (half to even): the legacy types' blocks as quantize_row_q8_0,
// codes x * (127 / max|x|) and d = max|x| / 127; the K types' super-blocks as quantize_row_q8_K,
// codes x * (-127 / x_m), x_m the first value of the largest magnitude, and d = 1 / (-127 / x_m).
// (1 / d in place of 127 / max|x| moves a code where x sits at a half, as GGUF's quantized
// embeddings put it often.)
// (With AVX2, 32 values a step: the same products, rounded half to even as nearbyint rounds, for
// the GEMV's every call.)
// sum: where given, the codes' sum.
inline float round_block(const float* x, int64_t n, int8_t* q, bool k_quants, int* sum = nullptr) {
  float amax = 0.f, xm = 0.f;
#ifdef DABBA_GGUF_SIMD
  if (n % 32 == 0) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) amax = std::max(amax, v);
    if (amax == 0.f) {
      std::fill(q, q + n, int8_t{0});
      if (sum) *sum = 0;
      return 0.f;
    }
    if (k_quants)
      for (int64_t k = 0; k < n; ++k)  // the first value of the largest magnitude
        if (std::fabs(x[k]) == amax) {
          xm = x[k];
          break;
        }
    const float scale = k_quants ? -127.f / xm : 127.f / amax;
    const __m256 vscale = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    const auto codes = [&](int64_t k) {  // vcvtps2dq rounds half to even, as nearbyint
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), vscale);
      return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    };
    __m256i total = _mm256_setzero_si256();
    for (int64_t k = 0; k < n; k += 32) {  // 4 x 8 int32 -> 32 int8, in order
      const __m256i c0 = codes(k), c1 = codes(k + 8), c2 = codes(k + 16), c3 = codes(k + 24);
      const __m256i all = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3)),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), all);
      if (sum) total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)));
    }
    if (sum) {
      const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      const __m128i t2 = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
      *sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32(t2, 1)));
    }
    return k_quants ? 1.f / scale : amax / 127.f;
  }
#endif
  for (int64_t k = 0; k < n; ++k)
    if (std::fabs(x[k]) > amax) {
      amax = std::fabs(x[k]);
      xm = x[k];
    }
  if (amax == 0.f) {
    std::fill(q, q + n, int8_t{0});
    if (sum) *sum = 0;
    return 0.f;
  }
  const float scale = k_quants ? -127.f / xm : 127.f / amax;
  int total = 0;
  for (int64_t k = 0; k < n; ++k) {
    q[k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[k] * scale))));
    total += q[k];
  }
  if (sum) *sum = total;
  return k_quants ? 1.f / scale : amax / 127.f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// v[j]'s 16 lanes folded by op into lane j of one register: a tree of shuffles that halves the
// registers at each level, 15 ops for 16 reductions (one at a time, each is 4 dependent shuffles).
template <typename Op>
inline __m512 fold16(__m512 (&v)[16], Op op) {
  __m512 h[8], g[4], t[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 of v[2i], 8-15 of v[2i+1]
    h[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarter k: v[4i + k]
    g[i] = op(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88), _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: v[8i + k] twice, v[8i + 4 + k] twice
    t[i] = op(_mm512_shuffle_ps(g[2 * i], g[2 * i + 1], 0x44), _mm512_shuffle_ps(g[2 * i], g[2 * i + 1], 0xEE));
  const __m512 r = op(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
  // quarter k lane i holds v[k + 4i]: to lane k + 4i
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// int32 lanes held in float registers (fold16's), added
inline __m512 add_i32(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

// 16 legacy blocks (512 values) as round_block rounds each, their maxima, scales and codes' sums
// 16 lanes at a time: d (float16, as float) and sums [16]; codes into q. Straight from x's dtype:
// no float32 copy of x to write (a GEMV's every write misses: the weights' stream evicts it).
template <typename T>
inline void round_legacy_16(const T* x, int8_t* q, float* d, int* sums) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 v[16];
  for (int j = 0; j < 16; ++j)
    v[j] = _mm512_max_ps(_mm512_and_ps(load_ps16(x + 32 * j), abs_mask),
                         _mm512_and_ps(load_ps16(x + 32 * j + 16), abs_mask));
  const __m512 amax = fold16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_div_ps(amax, _mm512_set1_ps(127.f)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  alignas(64) float scale[16];  // 127 / max|x|; 0 for a block of zeros (its codes 0)
  _mm512_store_ps(scale, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.f), amax));
  for (int j = 0; j < 16; ++j) {  // vcvtps2dq rounds half to even, as nearbyint
    const __m512 s = _mm512_set1_ps(scale[j]);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(load_ps16(x + 32 * j), s));
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(load_ps16(x + 32 * j + 16), s));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * j + 16), _mm512_cvtsepi32_epi8(c1));
    v[j] = _mm512_castsi512_ps(_mm512_add_epi32(c0, c1));
  }
  const __m512 total = fold16(v, add_i32);
  _mm512_storeu_si512(sums, _mm512_castps_si512(total));
}

// A K types' super-block (256 values) as round_block rounds it, returning its d; its 16
// sub-blocks' codes' sums into sum16, folded 16 lanes at a time.
template <typename T>
inline float round_super_block(const T* x, int8_t* q, int16_t* sum16) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 vmax = _mm512_setzero_ps();
  for (int j = 0; j < 16; ++j) vmax = _mm512_max_ps(vmax, _mm512_and_ps(load_ps16(x + 16 * j), abs_mask));
  const float amax = _mm512_reduce_max_ps(vmax);
  if (amax == 0.f) {
    std::memset(q, 0, kSuperBlock);
    std::memset(sum16, 0, 16 * sizeof(int16_t));
    return 0.f;
  }
  float xm = amax;  // the first value of the largest magnitude
  for (int j = 0; j < 16; ++j) {
    const __mmask16 at = _mm512_cmp_ps_mask(_mm512_and_ps(load_ps16(x + 16 * j), abs_mask),
                                            _mm512_set1_ps(amax), _CMP_EQ_OQ);
    if (at) {
      xm = to_float(x[16 * j + __builtin_ctz(at)]);
      break;
    }
  }
  const float scale = -127.f / xm;
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 v[16];
  for (int j = 0; j < 16; ++j) {  // vcvtps2dq rounds half to even, as nearbyint
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load_ps16(x + 16 * j), vscale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm512_cvtsepi32_epi8(c));
    v[j] = _mm512_castsi512_ps(c);
  }
  const __m512 total = fold16(v, add_i32);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sum16), _mm512_cvtepi32_epi16(_mm512_castps_si512(total)));
  return 1.f / scale;
}
#endif

// n values of x in float32
template <typename T>
inline void to_float_row(const T* x, int64_t n, float* out) {
  int64_t k = 0;
#ifdef DABBA_GGUF_SIMD
  for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, load_ps8(x + k));
#endif
  for (; k < n; ++k) out[k] = to_float(x[k]);
}

// The forms of x a linear's segment types read (A8Rows' fields).
struct A8Needs {
  bool legacy = false;  // q, d, s
  bool k_quants = false;  // qk, dk, sum16, sum32
  bool legacy_runs = false;  // q_runs, offset8 (legacy too)
  bool k_runs = false;  // qk_runs, sum_runs, dk_runs (k_quants too)
  bool q6_runs = false;  // qk_q6, offset32 (k_quants too)
  bool floats = false;  // xf
};

// x's M rows of K values, ldx apart, into ``a``, whose vectors keep their memory from call to call
// (a GEMV's caller holds one per thread: a decode step makes a hundred calls, each a dozen
// allocations otherwise); the vectors ``needs`` does not ask for keep whatever they held. (Raw
// pointers, not a tensor: a view of x made for each call costs more than the rounding.)
template <typename T>
void quantize_rows(const T* xp, int64_t M, int64_t K, int64_t ldx, const A8Needs& needs, A8Rows& a) {
  const bool legacy = needs.legacy, k_quants = needs.k_quants, legacy_runs = needs.legacy_runs;
  const bool k_runs = needs.k_runs, q6_runs = needs.q6_runs;
  a.M = M;
  a.K = K;
  a.blocks = (a.K + kA8Block - 1) / kA8Block;
  a.tail_groups = a.q_runs_count = 0;
  if (needs.floats) {
    a.xf.resize(a.M * a.K);
    for (int64_t m = 0; m < a.M; ++m) to_float_row(xp + m * ldx, a.K, a.xf.data() + m * a.K);
  }
  a.runs = a.K / kRunValues;
  if (legacy_runs) {
    a.tail_groups = a.K % kRunValues / kA8Block;
    a.q_runs_count = a.runs + (a.tail_groups > 0);
    a.offset8.assign(a.M * a.q_runs_count * 16, 0);
  }
  if (legacy) {
    a.q.assign(a.M * a.blocks * kA8Block, 0);
    a.d.assign(a.M * a.blocks, 0.f);
    a.s.assign(a.M * a.blocks, 0.f);
    for (int64_t m = 0; m < a.M; ++m) {
      int64_t b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (; b + 16 <= a.K / kA8Block; b += 16) {
        float* d = a.d.data() + m * a.blocks + b;
        int sums[16];
        round_legacy_16(xp + m * ldx + b * kA8Block, a.q.data() + m * a.blocks * kA8Block + b * kA8Block, d, sums);
        for (int j = 0; j < 16; ++j) {  // as below
          a.s[m * a.blocks + b + j] = d[j] * static_cast<float>(sums[j]);
          if (legacy_runs) a.offset8[m * a.q_runs_count * 16 + b + j] = -8 * sums[j];
        }
      }
#endif
      for (; b < a.blocks; ++b) {
        const int64_t k0 = b * kA8Block, n = std::min(kA8Block, a.K - k0);
        int8_t* q = a.q.data() + m * a.blocks * kA8Block + k0;
        int sum = 0;
        float xb[kA8Block];
        to_float_row(xp + m * ldx + k0, n, xb);
        const float d = round_block(xb, n, q, false, &sum);
        // d held as float16, as llama.cpp's Q8_0/Q8_1 activation blocks hold it (the codes come from d
        // itself); s from it exactly, as the GEMM's rounded x sums (llama.cpp's Q8_1 rounds d * sum to
        // float16: a 2^-11 difference in Q4_1/Q5_1's min term, kept out so that both paths agree)
        a.d[m * a.blocks + b] = static_cast<float>(c10::Half(d));
        a.s[m * a.blocks + b] = a.d[m * a.blocks + b] * static_cast<float>(sum);
        if (legacy_runs) a.offset8[m * a.q_runs_count * 16 + b] = -8 * sum;
      }
    }
  }
  if (legacy_runs) {  // legacy too; offset8 filled as the blocks were rounded
    a.q_runs.assign(a.M * a.q_runs_count * kRunValues, 0);
    order_runs(a.q.data(), a.M, a.blocks * kA8Block, a.runs, a.q_runs.data(), a.tail_groups);
  }
  if (k_quants) {  // K % 256 == 0 (check_segments)
    const int64_t supers = a.K / kSuperBlock;
    a.qk.resize(a.M * a.K);
    a.dk.resize(a.M * supers);
    a.sum16.resize(a.M * a.K / 16);
    a.sum32.resize(a.M * a.K / 32);
    for (int64_t m = 0; m < a.M; ++m) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (int64_t sb = 0; sb < supers; ++sb)
        a.dk[m * supers + sb] = round_super_block(xp + m * ldx + sb * kSuperBlock, a.qk.data() + m * a.K + sb * kSuperBlock,
                                                  a.sum16.data() + m * a.K / 16 + sb * 16);
#else
      for (int64_t sb = 0; sb < supers; ++sb) {
        float xb[kSuperBlock];
        to_float_row(xp + m * ldx + sb * kSuperBlock, kSuperBlock, xb);
        a.dk[m * supers + sb] = round_block(xb, kSuperBlock, a.qk.data() + m * a.K + sb * kSuperBlock, true);
      }
      for (int64_t i = 0; i < a.K / 16; ++i) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += a.qk[m * a.K + 16 * i + k];
        a.sum16[m * a.K / 16 + i] = static_cast<int16_t>(sum);
      }
#endif
      for (int64_t i = 0; i < a.K / 32; ++i)
        a.sum32[m * a.K / 32 + i] =
            static_cast<int16_t>(a.sum16[m * a.K / 16 + 2 * i] + a.sum16[m * a.K / 16 + 2 * i + 1]);
    }
  }
  if (q6_runs) {  // k_quants too
    a.qk_q6.resize(a.M * a.K);
    a.offset32.resize(a.M * a.K / 16);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t g = 0; g < a.K / 16; ++g) {  // sub-block g of 16: super-block g / 16, j = g % 16
        const int8_t* q = a.qk.data() + m * a.K + 16 * g;
        int8_t* dst = a.qk_q6.data() + m * a.K + (g / 16) * kSuperBlock + 4 * (g % 16);
        for (int t = 0; t < 4; ++t) std::memcpy(dst + 64 * t, q + 4 * t, 4);
        a.offset32[m * a.K / 16 + g] = -32 * a.sum16[m * a.K / 16 + g];
      }
  }
  if (k_runs) {  // k_quants too
    a.qk_runs.resize(a.M * a.runs * kRunValues);
    order_runs(a.qk.data(), a.M, a.K, a.runs, a.qk_runs.data());
    a.sum_runs.resize(a.M * a.runs * 16);
    a.dk_runs.resize(a.M * a.runs * 16);
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t j = 0; j < a.runs * 16; ++j) {
        a.sum_runs[m * a.runs * 16 + j] = static_cast<float>(a.sum32[m * a.K / 32 + j]);
        a.dk_runs[m * a.runs * 16 + j] = a.dk[m * (a.K / kSuperBlock) + j / 8];
      }
  }
}

inline bool is_float(Type t) { return t == gguf::kF32 || t == gguf::kF16 || t == gguf::kBF16; }
inline bool is_k_quant(Type t) {
  return t == gguf::kQ4_K || t == gguf::kQ5_K || t == gguf::kQ6_K || t == gguf::kQ4_Kx2 || t == gguf::kQ5_Kx2 ||
         t == gguf::kQ6_Kx1;
}

// Float segments (F32/F16/BF16): their values against x, 256 values a step.
template <int M>
void dot_float_row(Type type, const uint8_t* row, const A8Rows& a, float (&out)[M]) {
  const gguf::TypeInfo* info = gguf::type_info(type);
  float w[256];
  for (int m = 0; m < M; ++m) out[m] = 0.f;
  for (int64_t k0 = 0; k0 < a.K; k0 += 256) {
    const int64_t n = std::min<int64_t>(256, a.K - k0);
    for (int64_t i = 0; i < n; ++i) gguf::dequantize_block(type, row + (k0 + i) * info->block_bytes, w + i);
    for (int m = 0; m < M; ++m) {
      const float* xf = a.xf.data() + m * a.K + k0;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum += xf[i] * w[i];
      out[m] += sum;
    }
  }
}

// Without SIMD: each block dequantized and dotted with its codes in float32, times their scale.
template <int M>
void dot_blocks_scalar(Type type, const uint8_t* row, const A8Rows& a, float (&out)[M]) {
  const bool k = is_k_quant(type);
  const int64_t span = k ? kSuperBlock : kA8Block;  // values per activation scale
  std::vector<float> w(a.K);
  gguf::dequantize_row(type, row, a.K, w.data());
  for (int m = 0; m < M; ++m) out[m] = 0.f;
  for (int64_t k0 = 0; k0 < a.K; k0 += span) {
    for (int m = 0; m < M; ++m) {
      const int8_t* q = k ? a.qk.data() + m * a.K + k0 : a.q.data() + m * a.blocks * kA8Block + k0;
      float sum = 0.f;
      for (int64_t i = 0; i < span; ++i) sum += static_cast<float>(q[i]) * w[k0 + i];
      out[m] += sum * (k ? a.dk[m * (a.K / kSuperBlock) + k0 / kSuperBlock] : a.d[m * a.blocks + k0 / kA8Block]);
    }
  }
}

#ifdef DABBA_GGUF_SIMD

// The weights' line kGgufPrefetchBytes ahead of p, asked into L2 (T1), and the line
// kGgufL1PrefetchBytes ahead, by then in L2, into L1 (T0). One row of x computes faster than memory
// delivers, yet each core waited on it: asked early into L2, the blocks arrive while the row
// computes, and asked again shortly before use, the loads stop waiting on L2 (benchmarks/
// gguf_kernels.py; README's GGUF section has the figures).
constexpr int64_t kGgufPrefetchBytes = 6144, kGgufL1PrefetchBytes = 2048;

inline void prefetch_weights(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kGgufPrefetchBytes, _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(p) + kGgufL1PrefetchBytes, _MM_HINT_T0);
}

// sum over each 4 bytes of u (unsigned) times s (signed), into int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else  // vpmaddubsw saturates pairs at int16: callers keep u * |s| * 2 below 32768
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i nibbles_lo_hi(const uint8_t* qs) {  // 16 bytes -> 32: low nibbles, then high ones
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline __m256i bits_to_bytes(const uint8_t* p, uint8_t value) {  // 32 bits -> 32 bytes of value or 0
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(static_cast<char>(value)));
#else
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(static_cast<char>(value)));
#endif
}

inline int32_t hsum_i32x4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}

// A legacy block's 32 codes: signed w (Q8_0; Q4_0 and Q5_0 less their 8 or 16), or u of
// w = a * u + min (Q4_1, Q5_1; the min in c).
template <Type kType>
inline __m256i legacy_codes(const uint8_t* blk, float& c) {
  if constexpr (kType == gguf::kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  if constexpr (kType == gguf::kQ4_0) return _mm256_sub_epi8(nibbles_lo_hi(blk + 2), _mm256_set1_epi8(8));
  if constexpr (kType == gguf::kQ5_0)
    return _mm256_sub_epi8(_mm256_or_si256(nibbles_lo_hi(blk + 6), bits_to_bytes(blk + 2, 0x10)), _mm256_set1_epi8(16));
  c = gguf::f16(blk + 2);
  if constexpr (kType == gguf::kQ4_1) return nibbles_lo_hi(blk + 4);
  return _mm256_or_si256(nibbles_lo_hi(blk + 8), bits_to_bytes(blk + 4, 0x10));  // Q5_1
}

// Legacy blocks of 32 against per-32 codes: a float fma per block. Signed codes multiply |w| by
// the activation codes with w's sign; Q4_1 and Q5_1 (w = a * u + min) add min * s, s the
// activation block's scale times its codes' sum. With AVX-512, Q8_0 takes two blocks a step in 512
// bits (their 64 activation codes lie side by side): half the dot products' instructions. The
// nibble types do not gain from it (assembling their codes for 512 bits costs the shuffles it
// saves, measured slower), so they take eight blocks' scales at once and a block's codes a step.
template <Type kType, int M>
void dot_legacy_row(const uint8_t* row, const A8Rows& a, float (&out)[M], int64_t first_block = 0) {
  constexpr int64_t bytes = kType == gguf::kQ8_0 ? 34 : kType == gguf::kQ4_0 ? 18 : kType == gguf::kQ4_1 ? 20
                          : kType == gguf::kQ5_0 ? 22 : 24;
  constexpr bool with_min = kType == gguf::kQ4_1 || kType == gguf::kQ5_1;
  __m256 acc[M];
  float off[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    off[m] = 0.f;
  }
  const int64_t ldq = a.blocks * kA8Block;
  int64_t b = first_block;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  __m512 acc2[M];
  for (int m = 0; m < M; ++m) acc2[m] = _mm512_setzero_ps();
  for (; kType == gguf::kQ8_0 && b + 2 <= a.blocks; b += 2) {
    const uint8_t* b0 = row + b * bytes;
    prefetch_weights(b0);
    float c0 = 0.f, c1 = 0.f;
    const float d0 = gguf::f16(b0), d1 = gguf::f16(b0 + bytes);
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(legacy_codes<kType>(b0, c0)),
                                         legacy_codes<kType>(b0 + bytes, c1), 1);
    const __m512i magnitude = with_min ? u : _mm512_abs_epi8(u);
    const __mmask64 negative = _mm512_movepi8_mask(u);
    for (int m = 0; m < M; ++m) {
      __m512i x = _mm512_loadu_si512(a.q.data() + m * ldq + b * kA8Block);
      if constexpr (!with_min) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
      const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, x));
      const float* dx = a.d.data() + m * a.blocks + b;
      const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0 * dx[0]), _mm256_set1_ps(d1 * dx[1]), 1);
      acc2[m] = _mm512_fmadd_ps(p, scale, acc2[m]);
      if constexpr (with_min) off[m] += c0 * a.s[m * a.blocks + b] + c1 * a.s[m * a.blocks + b + 1];
    }
  }
  for (int m = 0; m < M; ++m)
    acc[m] = _mm256_add_ps(_mm512_castps512_ps256(acc2[m]), _mm512_extractf32x8_ps(acc2[m], 1));
#endif
  // Eight blocks a step: their float16 scales gathered into one vector and multiplied by the eight
  // activation scales at once, each block's product then broadcast from memory (a load, where one
  // block at a time cost a conversion, a multiply and a shuffle each).
  for (; kType != gguf::kQ8_0 && b + 8 <= a.blocks; b += 8) {
    const uint8_t* g = row + b * bytes;
    const auto half = [&](int j, int at) {
      uint16_t h;
      std::memcpy(&h, g + j * bytes + at, 2);
      return static_cast<short>(h);
    };
    const __m256 d8 = _mm256_cvtph_ps(_mm_setr_epi16(half(0, 0), half(1, 0), half(2, 0), half(3, 0), half(4, 0),
                                                     half(5, 0), half(6, 0), half(7, 0)));
    alignas(32) float scale[M][8];
    for (int m = 0; m < M; ++m) {
      _mm256_store_ps(scale[m], _mm256_mul_ps(d8, _mm256_loadu_ps(a.d.data() + m * a.blocks + b)));
      if constexpr (with_min) {
        const __m256 c8 = _mm256_cvtph_ps(_mm_setr_epi16(half(0, 2), half(1, 2), half(2, 2), half(3, 2), half(4, 2),
                                                         half(5, 2), half(6, 2), half(7, 2)));
        off[m] += reduce_add8(_mm256_mul_ps(c8, _mm256_loadu_ps(a.s.data() + m * a.blocks + b)));
      }
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* blk = g + j * bytes;
      prefetch_weights(blk);
      float unused;
      const __m256i u = legacy_codes<kType>(blk, unused);
      const __m256i magnitude = with_min ? u : _mm256_abs_epi8(u);
      for (int m = 0; m < M; ++m) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + m * ldq + (b + j) * kA8Block));
        if constexpr (!with_min) x = _mm256_sign_epi8(x, u);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(magnitude, x));
        acc[m] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scale[m][j]), acc[m]);
      }
    }
  }
  for (; b < a.blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    prefetch_weights(blk);
    const float d = gguf::f16(blk);
    float c = 0.f;
    const __m256i u = legacy_codes<kType>(blk, c);
    const __m256i magnitude = with_min ? u : _mm256_abs_epi8(u);
    for (int m = 0; m < M; ++m) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + m * ldq + b * kA8Block));
      if constexpr (!with_min) x = _mm256_sign_epi8(x, u);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(magnitude, x));
      acc[m] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * a.d[m * a.blocks + b]), acc[m]);
      if constexpr (with_min) off[m] += c * a.s[m * a.blocks + b];
    }
  }
  for (int m = 0; m < M; ++m) out[m] = reduce_add8(acc[m]) + off[m];
}

// K super-blocks against per-256 codes, as llama.cpp's AVX2 kernels: vpmaddubsw pairs each code
// with its weight into int16, vpmaddwd scales the pairs by the sub-block's integer scale into
// int32, and the super-block's sum is exact; one float fma per super-block then scales it. Mins
// (Q4_K, Q5_K) and Q6_K's offset of 32 meet the codes' sums per 32 and per 16.
template <Type kType, int M>
void dot_k_row(const uint8_t* row, const A8Rows& a, float (&out)[M], int64_t first_super = 0) {
  constexpr bool q6 = kType == gguf::kQ6_K, five = kType == gguf::kQ5_K;
  constexpr int64_t bytes = q6 ? 210 : five ? 176 : 144;
  const int64_t supers = a.K / kSuperBlock;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t sb = first_super; sb < supers; ++sb) {
    const uint8_t* b = row + sb * bytes;
    for (int64_t line = 0; line < bytes; line += 64) prefetch_weights(b + line);
    __m256i acc_i[M];
    for (int m = 0; m < M; ++m) acc_i[m] = _mm256_setzero_si256();
    int32_t offset[M];  // subtracted from the super-block's integer sum, in units of its scale
    float d, dmin = 0.f;
    if constexpr (q6) {
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      d = gguf::f16(b + 208);
      for (int j = 0; j < 8; ++j) {
        const int half = j / 4, part = j % 4;
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (part & 1)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
        const __m256i lo = _mm256_and_si256(part < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), _mm256_set1_epi8(3));
        const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));  // 0..63
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
        for (int m = 0; m < M; ++m) {
          const int8_t* q = a.qk.data() + m * a.K + sb * kSuperBlock + 32 * j;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          acc_i[m] = _mm256_add_epi32(acc_i[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale));
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      for (int m = 0; m < M; ++m) {  // 32 * sum over sub-blocks of scale * codes' sum
        const int16_t* sum16 = a.sum16.data() + m * a.K / 16 + sb * 16;
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum16));
        const __m256i prod = _mm256_madd_epi16(sc16, sums);
        offset[m] = 32 * hsum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(prod), _mm256_extracti128_si256(prod, 1)));
      }
    } else {
      d = gguf::f16(b);
      dmin = gguf::f16(b + 2);
      uint32_t utmp[4];  // 8 six-bit scales, then 8 mins, as bytes (llama.cpp's unpacking)
      std::memcpy(utmp, b + 4, 12);
      utmp[3] = ((utmp[2] >> 4) & 0x0f0f0f0f) | (((utmp[1] >> 6) & 0x03030303) << 4);
      const uint32_t uaux = utmp[1] & 0x3f3f3f3f;
      utmp[1] = (utmp[2] & 0x0f0f0f0f) | (((utmp[0] >> 6) & 0x03030303) << 4);
      utmp[2] = uaux;
      utmp[0] &= 0x3f3f3f3f;
      const auto* scales = reinterpret_cast<const uint8_t*>(utmp);
      const uint8_t* qs = b + (five ? 48 : 16);
      const __m256i qh = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
        __m256i u = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, low4);
        if constexpr (five)
          u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
        const __m256i scale = _mm256_set1_epi16(scales[j]);
        for (int m = 0; m < M; ++m) {
          const int8_t* q = a.qk.data() + m * a.K + sb * kSuperBlock + 32 * j;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          acc_i[m] = _mm256_add_epi32(acc_i[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale));
        }
      }
      // from registers: a load of 8 bytes across the two 4-byte stores above would wait on them
      const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(utmp[3]), static_cast<int>(utmp[2])));
      for (int m = 0; m < M; ++m)  // sum over sub-blocks of min * codes' sum: times dmin, not d
        offset[m] = hsum_i32x4(_mm_madd_epi16(
            mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32.data() + m * a.K / 32 + sb * 8))));
    }
    for (int m = 0; m < M; ++m) {
      const float dx = a.dk[m * supers + sb];
      __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(acc_i[m]), _mm256_set1_ps(d * dx));
      const float correction = -((q6 ? d : dmin) * dx) * static_cast<float>(offset[m]);
      sum = _mm256_add_ps(sum, _mm256_setr_ps(correction, 0, 0, 0, 0, 0, 0, 0));
      acc[m] = _mm256_add_ps(acc[m], sum);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = reduce_add8(acc[m]);
}

// The run layouts (gguf_blocks.h) against codes in the same order (A8Rows::q_runs, qk_runs): per run
// of 16 groups of 32, each 64-byte load of weights gives 4 values of every group, so a vpdpbusd's
// 16 lanes are the 16 groups and 8 of them sum each group's 32 products exactly in int32, unsigned
// nibbles against signed codes; then one conversion and one fma a run by the groups' scales. Without
// AVX-512, the same in two halves of 8 groups (one super-block of Q4_Kx2). A row's Q4_K blocks past
// its last run take the file type's kernel; Q4_0x16's and Q5_0x16's form a last run of fewer groups.
//
// Q4_0x16: each block's sum starts from -8 * its codes' sum (the weights' offset of 8); Q5_0x16's
// from -16 times it, its codes' fifth bits or'd in as Q5_Kx2's; Q8_0x16's from -128 times it, its
// bytes (codes plus 128) taken as they lie (without VNNI, back to signed codes: vpmaddubsw's pairs
// of 255 * 127 would saturate).
// Q4_Kx2: sum_j d sc_j S_j - dmin m_j X_j over sub-blocks j, X_j the codes' sum, times the
// super-block's activation scale.
template <Type kType, int M>
void dot_runs_row(const uint8_t* row, const A8Rows& a, float (&out)[M]) {
  constexpr bool five = kType == gguf::kQ5_Kx2 || kType == gguf::kQ5_0x16;
  constexpr bool k = kType == gguf::kQ4_Kx2 || kType == gguf::kQ5_Kx2;
  constexpr bool eight = kType == gguf::kQ8_0x16;
  constexpr int64_t legacy_block_bytes = eight ? 34 : five ? 22 : 18;  // a legacy layout's bytes a group
  constexpr int64_t run_bytes = gguf::run_bytes(kType);
  float tail[M] = {};
  if (k && a.runs * kRunValues < a.K) dot_k_row<five ? gguf::kQ5_K : gguf::kQ4_K, M>(row, a, tail, a.runs * 2);
  const std::vector<int8_t>& codes = k ? a.qk_runs : a.q_runs;
  const int64_t nruns = k ? a.runs : a.q_runs_count;  // the codes' runs a row
  // A run r of g groups (16; fewer in a legacy layout's partial last run, whose weights load
  // masked: the lanes past g read zeros, as do its codes and offsets, padded).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const auto run_dot = [&](int64_t r, auto partial_tag) {
    constexpr bool partial = decltype(partial_tag)::value;
    const int g = partial ? static_cast<int>(a.tail_groups) : 16;
    const __mmask64 bytes = partial ? (__mmask64{1} << (4 * g)) - 1 : ~__mmask64{0};
    const __mmask16 lanes = static_cast<__mmask16>((1u << g) - 1);
    const uint8_t* run = row + r * run_bytes;
    const uint8_t* nibbles = run + (k ? 32 : 2 * g);
    for (int64_t line = 0; line < (k ? run_bytes : legacy_block_bytes * g); line += 64) prefetch_weights(run + line);
    __m512i u[8];
    if constexpr (eight) {  // the codes plus 128, 4 of each group a load
      for (int t = 0; t < 8; ++t)
        u[t] = partial ? _mm512_maskz_loadu_epi8(bytes, nibbles + 4 * g * t) : _mm512_loadu_si512(nibbles + 64 * t);
    } else {
      for (int l = 0; l < 4; ++l) {
        const __m512i v = partial ? _mm512_maskz_loadu_epi8(bytes, nibbles + 4 * g * l) : _mm512_loadu_si512(nibbles + 64 * l);
        u[2 * l] = _mm512_and_si512(v, low4);
        u[2 * l + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    if constexpr (five) {  // nibble h of chunk l takes bit 2 l + h of the fifth bits' byte, moved to bit 4
      const uint8_t* fifth = nibbles + 16 * g;
      const __m512i bits = partial ? _mm512_maskz_loadu_epi8(bytes, fifth) : _mm512_loadu_si512(fifth);
      const __m512i bit4 = _mm512_set1_epi8(0x10);
      const auto to_bit4 = [&](int from) {
        return _mm512_and_si512(from < 4 ? _mm512_slli_epi16(bits, 4 - from) : _mm512_srli_epi16(bits, from - 4), bit4);
      };
      for (int i = 0; i < 8; ++i) u[i] = _mm512_or_si512(u[i], to_bit4(i));
    }
    __m512 scale, min_scale;  // per group: its weights' scale (Q4_Kx2: d sc_j) and min (dmin m_j)
    if constexpr (k) {
      const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(run))));
      const __m512i first8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512 d = _mm512_permutexvar_ps(first8, dd);
      const __m512 dmin = _mm512_permutexvar_ps(_mm512_add_epi32(first8, _mm512_set1_epi32(2)), dd);
      const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 8)));
      uint32_t high[2];
      std::memcpy(high, run + 24, 8);
      const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i three = _mm512_set1_epi32(3), fifteen = _mm512_set1_epi32(15);
      const __m512i sc = _mm512_or_si512(
          _mm512_and_si512(low, fifteen),
          _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(high[0])), shifts),
                                             three), 4));
      const __m512i mn = _mm512_or_si512(
          _mm512_srli_epi32(low, 4),
          _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(high[1])), shifts),
                                             three), 4));
      scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      min_scale = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
    } else {
      scale = _mm512_cvtph_ps(partial ? _mm256_maskz_loadu_epi16(lanes, run)
                                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run)));
    }
    for (int m = 0; m < M; ++m) {
      const int8_t* x = codes.data() + (m * nruns + r) * kRunValues;
      const int64_t at = (m * nruns + r) * 16;
      __m512i s0 = k ? _mm512_setzero_si512() : _mm512_loadu_si512(a.offset8.data() + at);
      if constexpr (five && !k) s0 = _mm512_slli_epi32(s0, 1);  // -16 * the codes' sum
      if constexpr (eight) s0 = _mm512_slli_epi32(s0, 4);  // -128 * the codes' sum
      __m512i s1 = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[t], _mm512_loadu_si512(x + 64 * t));
        s1 = _mm512_dpbusd_epi32(s1, u[t + 1], _mm512_loadu_si512(x + 64 * (t + 1)));
      }
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      if constexpr (k) {
        const __m512 dx = _mm512_loadu_ps(a.dk_runs.data() + at);
        const __m512 mins = _mm512_mul_ps(min_scale, _mm512_loadu_ps(a.sum_runs.data() + at));
        acc[m] = _mm512_fmadd_ps(_mm512_fmsub_ps(sums, scale, mins), dx, acc[m]);
      } else {
        const float* d = a.d.data() + m * a.blocks + r * 16;
        const __m512 dx = partial ? _mm512_maskz_loadu_ps(lanes, d) : _mm512_loadu_ps(d);
        acc[m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(scale, dx), acc[m]);
      }
    }
  };
  for (int64_t r = 0; r < a.runs; ++r) run_dot(r, std::false_type{});
  if (!k && a.tail_groups) run_dot(a.runs, std::true_type{});
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]) + tail[m];
#else
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const auto run_dot = [&](int64_t r, auto partial_tag) {
    constexpr bool partial = decltype(partial_tag)::value;
    const int g = partial ? static_cast<int>(a.tail_groups) : 16;
    const uint8_t* run = row + r * run_bytes;
    const uint8_t* nibbles = run + (k ? 32 : 2 * g);
    for (int64_t line = 0; line < (k ? run_bytes : legacy_block_bytes * g); line += 64) prefetch_weights(run + line);
    for (int h = 0; h < 2 && 8 * h < g; ++h) {  // groups 8 h .. 8 h + 7: bytes 32 h .. 32 h + 31 of each 4 g
      const int count = std::min(8, g - 8 * h);
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256i u[8];
      for (int l = 0; l < (eight ? 8 : 4); ++l) {
        const uint8_t* at = nibbles + 4 * g * l + 32 * h;
        const __m256i v = partial ? _mm256_maskload_epi32(reinterpret_cast<const int*>(at), lanes)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        if constexpr (eight) {
          u[l] = _mm256_xor_si256(v, _mm256_set1_epi8(-128));  // the signed codes
        } else {
          u[2 * l] = _mm256_and_si256(v, low4);
          u[2 * l + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
      if constexpr (five) {  // as the AVX-512 form, this half's 32 bytes of fifth bits
        const uint8_t* at = nibbles + 16 * g + 32 * h;
        const __m256i bits = partial ? _mm256_maskload_epi32(reinterpret_cast<const int*>(at), lanes)
                                     : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const auto to_bit4 = [&](int from) {
          return _mm256_and_si256(from < 4 ? _mm256_slli_epi16(bits, 4 - from) : _mm256_srli_epi16(bits, from - 4), bit4);
        };
        for (int i = 0; i < 8; ++i) u[i] = _mm256_or_si256(u[i], to_bit4(i));
      }
      __m256 scale, min_scale;
      if constexpr (k) {
        const __m256 d = _mm256_set1_ps(gguf::f16(run + 2 * h)), dmin = _mm256_set1_ps(gguf::f16(run + 4 + 2 * h));
        const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + 8 + 8 * h)));
        uint32_t high[2];
        std::memcpy(high, run + 24, 8);
        const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const auto top = [&](uint32_t bits) {  // this half's 8 two-bit fields, << 4
          const __m256i fields = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits >> (16 * h))), shifts);
          return _mm256_slli_epi32(_mm256_and_si256(fields, _mm256_set1_epi32(3)), 4);
        };
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)), top(high[0]));
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(low, 4), top(high[1]));
        scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        min_scale = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
      } else if constexpr (partial) {
        uint16_t halves[8] = {};
        std::memcpy(halves, run + 16 * h, 2 * count);
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
      } else {
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16 * h)));
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = codes.data() + (m * nruns + r) * kRunValues + 32 * h;
        const int64_t at = (m * nruns + r) * 16 + 8 * h;
        __m256i s = k || eight ? _mm256_setzero_si256()
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.offset8.data() + at));
        if constexpr (five && !k) s = _mm256_slli_epi32(s, 1);  // -16 * the codes' sum
        for (int t = 0; t < 8; ++t) {
          const __m256i xt = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * t));
          if constexpr (eight)  // |w| <= 128 against x with w's sign: pairs below 2 * 128 * 127
            s = _mm256_add_epi32(s, dot_u8s8(_mm256_abs_epi8(u[t]), _mm256_sign_epi8(xt, u[t])));
          else  // u <= 31: vpmaddubsw's pairs stay far from saturating
            s = _mm256_add_epi32(s, dot_u8s8(u[t], xt));
        }
        const __m256 sums = _mm256_cvtepi32_ps(s);
        if constexpr (k) {
          const __m256 dx = _mm256_loadu_ps(a.dk_runs.data() + at);
          const __m256 mins = _mm256_mul_ps(min_scale, _mm256_loadu_ps(a.sum_runs.data() + at));
          acc[m] = _mm256_fmadd_ps(_mm256_fmsub_ps(sums, scale, mins), dx, acc[m]);
        } else {
          const float* d = a.d.data() + m * a.blocks + r * 16 + 8 * h;
          const __m256 dx = partial ? _mm256_maskload_ps(d, lanes) : _mm256_loadu_ps(d);
          acc[m] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, dx), acc[m]);
        }
      }
    }
  };
  for (int64_t r = 0; r < a.runs; ++r) run_dot(r, std::false_type{});
  if (!k && a.tail_groups) run_dot(a.runs, std::true_type{});
  for (int m = 0; m < M; ++m) out[m] = reduce_add8(acc[m]) + tail[m];
#endif
}

// Q6_Kx1 (gguf_blocks.h) against A8Rows::qk_q6: per super-block, 4 vpdpbusd of the 6-bit codes
// (low nibbles or'd with their top bits, moved into place by one shift) against 4 codes of each of
// the 16 sub-blocks, from -32 * their codes' sums, exact in int32; then one conversion and one fma
// by the sub-blocks' d * scale times the activations' scale. Without AVX-512, two halves of 8.
template <int M>
void dot_q6_kx1_row(const uint8_t* row, const A8Rows& a, float (&out)[M]) {
  const int64_t supers = a.K / kSuperBlock;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* run = row + sb * 210;
    for (int64_t line = 0; line < 210; line += 64) prefetch_weights(run + line);
    const __m512i lo0 = _mm512_loadu_si512(run), lo1 = _mm512_loadu_si512(run + 64);
    const __m512i hi = _mm512_loadu_si512(run + 128);
    const __m512i u[4] = {
        _mm512_or_si512(_mm512_and_si512(lo0, low4), _mm512_and_si512(_mm512_slli_epi16(hi, 4), top2)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), low4), _mm512_and_si512(_mm512_slli_epi16(hi, 2), top2)),
        _mm512_or_si512(_mm512_and_si512(lo1, low4), _mm512_and_si512(hi, top2)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), low4), _mm512_and_si512(_mm512_srli_epi16(hi, 2), top2))};
    const __m512 scale = _mm512_mul_ps(
        _mm512_set1_ps(gguf::f16(run + 208)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 192)))));
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a.qk_q6.data() + m * a.K + sb * kSuperBlock;
      __m512i s0 = _mm512_loadu_si512(a.offset32.data() + m * a.K / 16 + sb * 16), s1 = _mm512_setzero_si512();
      s0 = _mm512_dpbusd_epi32(s0, u[0], _mm512_loadu_si512(x));
      s1 = _mm512_dpbusd_epi32(s1, u[1], _mm512_loadu_si512(x + 64));
      s0 = _mm512_dpbusd_epi32(s0, u[2], _mm512_loadu_si512(x + 128));
      s1 = _mm512_dpbusd_epi32(s1, u[3], _mm512_loadu_si512(x + 192));
      const __m512 dx = _mm512_set1_ps(a.dk[m * supers + sb]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(scale, dx), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
#else
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* run = row + sb * 210;
    for (int64_t line = 0; line < 210; line += 64) prefetch_weights(run + line);
    const float d = gguf::f16(run + 208);
    for (int h = 0; h < 2; ++h) {  // sub-blocks 8 h .. 8 h + 7: bytes 32 h .. 32 h + 31 of each 64
      const auto load = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + at + 32 * h)); };
      const __m256i lo0 = load(0), lo1 = load(64), hi = load(128);
      const __m256i u[4] = {
          _mm256_or_si256(_mm256_and_si256(lo0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top2)),
          _mm256_or_si256(_mm256_and_si256(lo1, low4), _mm256_and_si256(hi, top2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2))};
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + 192 + 8 * h)))));
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.qk_q6.data() + m * a.K + sb * kSuperBlock + 32 * h;
        __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.offset32.data() + m * a.K / 16 + sb * 16 + 8 * h));
        for (int t = 0; t < 4; ++t)  // u <= 63: vpmaddubsw's pairs stay below 2 * 63 * 127
          s = _mm256_add_epi32(s, dot_u8s8(u[t], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64 * t))));
        const __m256 dx = _mm256_set1_ps(a.dk[m * supers + sb]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, dx), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = reduce_add8(acc[m]);
#endif
}

#endif  // DABBA_GGUF_SIMD

// One weight row of `type` against the M rows of x.
template <int M>
void dot_any_row(Type type, const uint8_t* row, const A8Rows& a, float (&out)[M]) {
  if (is_float(type)) return dot_float_row<M>(type, row, a, out);
#ifdef DABBA_GGUF_SIMD
  switch (type) {
    case gguf::kQ4_K: return dot_k_row<gguf::kQ4_K, M>(row, a, out);
    case gguf::kQ5_K: return dot_k_row<gguf::kQ5_K, M>(row, a, out);
    case gguf::kQ6_K: return dot_k_row<gguf::kQ6_K, M>(row, a, out);
    case gguf::kQ8_0: return dot_legacy_row<gguf::kQ8_0, M>(row, a, out);
    case gguf::kQ4_0: return dot_legacy_row<gguf::kQ4_0, M>(row, a, out);
    case gguf::kQ4_0x16: return dot_runs_row<gguf::kQ4_0x16, M>(row, a, out);
    case gguf::kQ5_0x16: return dot_runs_row<gguf::kQ5_0x16, M>(row, a, out);
    case gguf::kQ8_0x16: return dot_runs_row<gguf::kQ8_0x16, M>(row, a, out);
    case gguf::kQ4_Kx2: return dot_runs_row<gguf::kQ4_Kx2, M>(row, a, out);
    case gguf::kQ5_Kx2: return dot_runs_row<gguf::kQ5_Kx2, M>(row, a, out);
    case gguf::kQ6_Kx1: return dot_q6_kx1_row<M>(row, a, out);
    case gguf::kQ4_1: return dot_legacy_row<gguf::kQ4_1, M>(row, a, out);
    case gguf::kQ5_0: return dot_legacy_row<gguf::kQ5_0, M>(row, a, out);
    default: return dot_legacy_row<gguf::kQ5_1, M>(row, a, out);
  }
#else
  dot_blocks_scalar<M>(type, row, a, out);
#endif
}

}  // namespace dabba::gguf

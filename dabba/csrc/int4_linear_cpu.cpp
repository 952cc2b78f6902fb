// INT4 linear on the CPU: a GEMV for decode's few rows that reads PyTorch's packed int4 CPU layout
// (int4_pack.h; every 4-bit method in dabba repacks into it: dabba/quantization/kernels.py); past
// kInt4GemvMaxRows the AMX GEMM (gemm_amx_cpu.cpp), the integer GEMM (code_gemm.h, as GGUF's
// prefills take it) or _weight_int4pack_mm_for_cpu ("tinygemm"). int4_linear below is where that is
// chosen, for the Python layers and the native layer loop alike.
//
// AVX-512 (with VNNI, as every CPU of the avx512 variant): integer dot products, as the GGUF GEMV.
// Each row of x is rounded to 8-bit codes per block of 32 exactly as the GGUF GEMV rounds it for the
// legacy types (gguf_dot.h: llama.cpp's q8_0, a float16 scale a block), and the weights' codes meet
// them in vpdpbusd, exact in int32. PyTorch's layout gives each k's 64 rows in 32 bytes; a vpermt2d
// of four k's 128 bytes and a byte shuffle within 128-bit lanes gather 16 rows' 4 codes into a dword
// each (low nibbles: rows i, high nibbles: rows 32 + i, left in place as 16 q with their scale over
// 16), so a vpdpbusd's 16 lanes are 16 rows against x's 4 codes broadcast. Per block of 32 k the sums
// are converted and scaled by the rows' scale times the block's activation scale; per group of
// group_size k, tinygemm's dequantization (q - 8) * scale + zero is met by the offset times the
// rounded x's sum: sum_k w x = scale * sum_k q x + (zero - 8 scale) * sum_k x. The float kernel it
// replaced widened every code to float32 for an FMA: four times the instructions a byte, and
// compute-bound below the memory's rate. Rows of x past 4 take another pass. The integer GEMM
// multiplies the same codes of x, the AMX GEMM keeps x unrounded.
//
// On AVX2 + FMA (the avx2 variant) float sums in 8 lanes, over the 32-row blocks PyTorch packs where
// it runs at AVX2 (as on a CPU without AVX-512): each k's 16 bytes widen to 2 x 8 byte values b =
// low + 16 high and, shifted, to the high nibbles, 4 FMAs a row of x; at the end of a group the low
// nibbles' sums are the byte sums less 16 times the high sums. PyTorch held to AVX2
// (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2), Qwen2.5-1.5B's 28 layers, 2-core Xeon: 48.5 ms
// at one row (14.3 GB/s) against its AVX2 tinygemm's 61.6, 76.6 against 109 at 4.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "code_gemm.h"
#include "cpu_math.h"
#include "cpu_ops.h"
#include "gguf_dot.h"
#include "int4_pack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_INT4_GEMV 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DABBA_HAVE_INT4_GEMV 1
#define DABBA_INT4_GEMV_AVX2 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_INT4_GEMV

namespace {

// PyTorch's packed layout by the CPU capability it runs at: blocks of 64 rows (AVX-512), each k's
// 32 bytes holding rows i and 32 + i, or of 32 (AVX2 and others), each k's 16 bytes rows i and
// 16 + i (ATEN_CPU_CAPABILITY changes it). Checked once: the block rows, or 0 for neither.
int64_t pytorch_block_rows() {
  static const int64_t rows = [] {
    at::Tensor codes = (at::arange(64 * 4, at::kInt).view({64, 4}) * 7) % 16;
    const at::Tensor packed = at::_convert_weight_to_int4pack_for_cpu(codes, 1).contiguous();
    if (packed.numel() != 64 * 4 / 2) return int64_t{0};
    const uint8_t* b = packed.data_ptr<uint8_t>();
    const int32_t* c = codes.data_ptr<int32_t>();
    for (const int64_t block : {int64_t{64}, int64_t{32}}) {
      const int64_t half = block / 2;
      bool same = true;
      for (int64_t n = 0; n < 64 && same; n += block)
        for (int64_t k = 0; k < 4 && same; ++k)
          for (int64_t i = 0; i < half && same; ++i)
            same = b[n * 4 / 2 + k * half + i] == (c[(n + i) * 4 + k] | (c[(n + half + i) * 4 + k] << 4));
      if (same) return block;
    }
    return int64_t{0};
  }();
  return rows;
}

constexpr int64_t kRowsPerPass = 4;  // rows of x per pass over the weight

#ifndef DABBA_INT4_GEMV_AVX2

// Dword slot 4 j + c of a half's gather (vpermt2d over [k, k + 1 | k + 2, k + 3] as A and B): the
// 4 bytes of rows 4 j .. 4 j + 3 at k + c (row 16 h + 4 j.. of the 64-row block, half h); a byte
// shuffle within each 128-bit lane then gives each row's 4 codes a dword.
inline __m512i int4_quad_index(int half) {
  alignas(64) int32_t idx[16];
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < 4; ++c) idx[4 * j + c] = 8 * c + 4 * half + j;
  return _mm512_load_si512(idx);
}

// Rows [block * 64, block * 64 + 64) of y for M (<= kRowsPerPass) rows of x as 8-bit codes (a:
// gguf::quantize_rows' legacy blocks; xsum [M, groups]: each group's rounded x summed). scale_zero:
// [groups, N, 2] as float32 pairs (f32) or bf16 pairs.
template <int M, bool kF32Scales>
void block_rows(const uint8_t* packed, int64_t K, int64_t N, int64_t group_size, const void* scale_zero,
                const gguf::A8Rows& a, const float* xsum, int64_t block, float* out) {
  const uint8_t* w = packed + block * K * 32;
  const int64_t groups = K / group_size, row0 = block * kInt4BlockRows, blocks_per_group = group_size / 32;
  const __m512i index[2] = {int4_quad_index(0), int4_quad_index(1)};
  const __m512i rows_4x4 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  // y[h][m], y[2 + h][m]: rows 16 h.. (low nibbles of half h) and 32 + 16 h.. (its high nibbles)
  __m512 y[4][M];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < M; ++m) y[r][m] = _mm512_setzero_ps();
  const int64_t pair_bytes = kF32Scales ? 8 : 4;
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups)  // the next group's pairs lie N rows on: no stream the hardware would follow
      for (int64_t line = 0; line < kInt4BlockRows * pair_bytes; line += 64)
        _mm_prefetch(static_cast<const char*>(scale_zero) + ((g + 1) * N + row0) * pair_bytes + line, _MM_HINT_T0);
    __m512 scale[4], offset[4];
    for (int r = 0; r < 4; ++r) {
      const int64_t row = row0 + 16 * (r % 2) + 32 * (r / 2);
      if constexpr (kF32Scales) {
        const float* p = static_cast<const float*>(scale_zero) + (g * N + row) * 2;
        const __m512i idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
        scale[r] = _mm512_permutex2var_ps(lo, idx, hi);
        const __m512 zero = _mm512_permutex2var_ps(lo, _mm512_add_epi32(idx, _mm512_set1_epi32(1)), hi);
        offset[r] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale[r], zero);
      } else {
        int4_scale_offset(static_cast<const uint32_t*>(scale_zero) + (g * N + row), scale[r], offset[r]);
      }
      if (r >= 2) scale[r] = _mm512_mul_ps(scale[r], _mm512_set1_ps(1.f / 16));  // high nibbles: 16 q
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      // One pass over the block's 32 k where the sums fit the registers beside y (M <= 2), each half
      // a pass over the L1-held bytes beyond.
      constexpr int kHalvesAPass = M <= 2 ? 2 : 1;
      for (int h0 = 0; h0 < 2; h0 += kHalvesAPass) {
        __m512i acc[2 * kHalvesAPass][M];  // [j][m], [kHalvesAPass + j][m]: half h0 + j's low and high nibbles
        for (int r = 0; r < 2 * kHalvesAPass; ++r)
          for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_si512();
        for (int64_t k = 32 * b; k < 32 * b + 32; k += 4) {
          const uint8_t* p = w + k * 32;
          if (h0 == 0) {
            gguf::prefetch_weights(p);
            gguf::prefetch_weights(p + 64);
          }
          const __m512i lo128 = _mm512_loadu_si512(p), hi128 = _mm512_loadu_si512(p + 64);
          for (int h = h0; h < h0 + kHalvesAPass; ++h) {
            const __m512i v = _mm512_shuffle_epi8(_mm512_permutex2var_epi32(lo128, index[h], hi128), rows_4x4);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(v, high4);
            for (int m = 0; m < M; ++m) {
              int32_t codes;
              std::memcpy(&codes, a.q.data() + m * a.blocks * 32 + k, 4);
              const __m512i xv = _mm512_set1_epi32(codes);
              acc[h - h0][m] = _mm512_dpbusd_epi32(acc[h - h0][m], lo, xv);
              acc[kHalvesAPass + h - h0][m] = _mm512_dpbusd_epi32(acc[kHalvesAPass + h - h0][m], hi, xv);
            }
          }
        }
        for (int h = h0; h < h0 + kHalvesAPass; ++h)
          for (int m = 0; m < M; ++m) {
            const __m512 dx = _mm512_set1_ps(a.d[m * a.blocks + b]);
            const __m512 lo = _mm512_cvtepi32_ps(acc[h - h0][m]), hi = _mm512_cvtepi32_ps(acc[kHalvesAPass + h - h0][m]);
            y[h][m] = _mm512_fmadd_ps(lo, _mm512_mul_ps(scale[h], dx), y[h][m]);
            y[2 + h][m] = _mm512_fmadd_ps(hi, _mm512_mul_ps(scale[2 + h], dx), y[2 + h][m]);
          }
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_set1_ps(xsum[m * groups + g]);
      for (int r = 0; r < 4; ++r) y[r][m] = _mm512_fmadd_ps(offset[r], s, y[r][m]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + m * N + row0 + 16 * (r % 2) + 32 * (r / 2), y[r][m]);
}

template <int M>
void gemv_rows(const uint8_t* packed, int64_t K, int64_t N, int64_t group_size, const at::Tensor& scale_zero,
               const gguf::A8Rows& a, const float* xsum, float* out) {
  const bool f32 = scale_zero.scalar_type() == at::kFloat;
  const void* sz = scale_zero.data_ptr();
  at::parallel_for(0, N / kInt4BlockRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (f32) block_rows<M, true>(packed, K, N, group_size, sz, a, xsum, b, out);
      else block_rows<M, false>(packed, K, N, group_size, sz, a, xsum, b, out);
    }
  });
}

// The blocks the kernel above reads, where PyTorch packs them (else 0: tinygemm).
int64_t gemv_block_rows() { return pytorch_block_rows() == kInt4BlockRows ? kInt4BlockRows : 0; }

#else  // AVX2 + FMA

// How far ahead of the k it multiplies a thread asks for its block's bytes (the AVX-512 kernel asks
// as the GGUF GEMV does: gguf::prefetch_weights).
constexpr int64_t kPrefetchBytes = 2048;

// As the AVX-512 kernel, in 8 float32 lanes, over the 32-row blocks PyTorch packs at its AVX2
// capability: each k's 16 bytes widen to 2 x 8 byte values and, shifted, to the high nibbles (rows
// 16-31), 4 FMAs a row of x. y is summed in memory, once a group, to leave the 16 registers to the
// sums (4 rows of x a pass, as AVX-512, though some spill: 2 or 3 rows a pass took 10-20% longer at
// 4 and 8 rows). Where PyTorch packs 64-row blocks it runs its AVX-512 tinygemm, which this kernel
// does not beat (4.8 against 5.0 ms at one row, 12.1 against 8.5 at 4): that layout stays with it.
constexpr int64_t kBlockRows = 32;

// 8 rows' (scale, zero) pairs -> scale and offset = zero - 8 scale.
template <bool kF32Scales>
inline void scale_offset8(const void* scale_zero, int64_t at, __m256& scale, __m256& offset) {
  __m256 zero;
  if constexpr (kF32Scales) {
    const float* p = static_cast<const float*>(scale_zero) + at * 2;
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);  // s0 z0 .. s3 z3, s4 z4 .. s7 z7
    const auto in_order = [](__m256 v) {  // 0 1 4 5 | 2 3 6 7 -> 0 .. 7
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), _MM_SHUFFLE(3, 1, 2, 0)));
    };
    scale = in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    zero = in_order(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  } else {  // bf16 pairs: a 32-bit lane a row, the scale in its low half
    const auto* p = static_cast<const uint32_t*>(scale_zero) + at;
    const __m256i sz = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
    zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, zero);
}

// y[:, block * 32 : block * 32 + 32] += for M (<= kRowsPerPass) rows of x.
template <int M, bool kF32Scales>
void block_rows(const uint8_t* packed, int64_t K, int64_t N, int64_t group_size, const void* scale_zero,
                const float* x, const float* xsum, int64_t block, float* out) {
  const uint8_t* w = packed + block * K * 16;
  const int64_t groups = K / group_size, row0 = block * kBlockRows;
  for (int64_t g = 0; g < groups; ++g) {
    // [0], [1]: sums of byte * x for bytes 0-7 and 8-15 (byte = low + 16 high nibble); [2], [3]:
    // sums of high nibble * x, rows 16-31
    __m256 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm256_setzero_ps();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * 16 + kPrefetchBytes), _MM_HINT_T0);
      const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 16)));
      const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 16 + 8)));
      const __m256 b0 = _mm256_cvtepi32_ps(e0), b1 = _mm256_cvtepi32_ps(e1);
      const __m256 h0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4));
      const __m256 h1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4));
      for (int m = 0; m < M; ++m) {
        const __m256 xk = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(b0, xk, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(b1, xk, acc[m][1]);
        acc[m][2] = _mm256_fmadd_ps(h0, xk, acc[m][2]);
        acc[m][3] = _mm256_fmadd_ps(h1, xk, acc[m][3]);
      }
    }
    const __m256 sixteen = _mm256_set1_ps(16.f);
    for (int m = 0; m < M; ++m) {
      acc[m][0] = _mm256_fnmadd_ps(sixteen, acc[m][2], acc[m][0]);
      acc[m][1] = _mm256_fnmadd_ps(sixteen, acc[m][3], acc[m][1]);
    }
    for (int r = 0; r < 4; ++r) {
      const int64_t row = row0 + 8 * r;
      __m256 scale, offset;
      scale_offset8<kF32Scales>(scale_zero, g * N + row, scale, offset);
      for (int m = 0; m < M; ++m) {
        float* y = out + m * N + row;
        __m256 v = _mm256_fmadd_ps(scale, acc[m][r], _mm256_loadu_ps(y));
        v = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[m * groups + g]), v);
        _mm256_storeu_ps(y, v);
      }
    }
  }
}

template <int M>
void gemv_rows(const uint8_t* packed, int64_t K, int64_t N, int64_t group_size, const at::Tensor& scale_zero,
               const float* x, const float* xsum, float* out) {
  const bool f32 = scale_zero.scalar_type() == at::kFloat;
  const void* sz = scale_zero.data_ptr();
  std::fill(out, out + M * N, 0.f);
  at::parallel_for(0, N / kBlockRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (f32) block_rows<M, true>(packed, K, N, group_size, sz, x, xsum, b, out);
      else block_rows<M, false>(packed, K, N, group_size, sz, x, xsum, b, out);
    }
  });
}

int64_t gemv_block_rows() { return pytorch_block_rows() == kBlockRows ? kBlockRows : 0; }

#endif  // DABBA_INT4_GEMV_AVX2

// x [M, K] with contiguous rows, packed [N, K / 2] bytes in blocks the GEMV reads (PyTorch packed
// them so), scale_zero [K / group_size, N, 2]: what both kernels below take.
bool packed_operands(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& scale_zero) {
  const int64_t block = gemv_block_rows();
  return x.dim() == 2 && x.size(0) >= 1 && x.stride(1) == 1 && packed.dim() == 2 && packed.scalar_type() == at::kByte &&
         packed.is_contiguous() && block > 0 && packed.size(0) % block == 0 && packed.size(1) * 2 == x.size(1) &&
         group_size > 0 && x.size(1) % group_size == 0 && scale_zero.dim() == 3 && scale_zero.is_contiguous() &&
         scale_zero.size(0) == x.size(1) / group_size && scale_zero.size(1) == packed.size(0) &&
         scale_zero.size(2) == 2;
}

// y [M, N] in x's dtype = x W^T for up to kInt4GemvMaxRows rows, bf16 or float32 x and scales,
// kRowsPerPass rows of x a pass over the weight (past 4 the accumulators fill the registers).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& scale_zero) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), groups = K / group_size;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
    const int64_t rows = std::min<int64_t>(M - m0, kRowsPerPass);
    float* ym = y.data_ptr<float>() + m0 * N;
    std::vector<float> xsum(rows * groups, 0.f);  // per group, the sum of x as the kernel multiplies it
#ifndef DABBA_INT4_GEMV_AVX2
    thread_local gguf::A8Rows a;  // as the GGUF GEMV's: its memory kept from call to call
    gguf::A8Needs needs;
    needs.legacy = true;
    if (x.scalar_type() == at::kFloat)
      gguf::quantize_rows(x.data_ptr<float>() + m0 * x.stride(0), rows, K, x.stride(0), needs, a);
    else
      gguf::quantize_rows(x.data_ptr<c10::BFloat16>() + m0 * x.stride(0), rows, K, x.stride(0), needs, a);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t b = 0; b < a.blocks; ++b) xsum[m * groups + b * gguf::kA8Block / group_size] += a.s[m * a.blocks + b];
    with_count<kRowsPerPass>(rows, [&](auto count) {
      gemv_rows<decltype(count)::value>(w, K, N, group_size, scale_zero, a, xsum.data(), ym);
    });
#else
    const at::Tensor xf = x.narrow(0, m0, rows).to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group_size] += xp[m * K + k];
    with_count<kRowsPerPass>(rows, [&](auto count) {
      gemv_rows<decltype(count)::value>(w, K, N, group_size, scale_zero, xp, xsum.data(), ym);
    });
#endif
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The AVX-512 GEMV rounds x in blocks of 32 that must not straddle groups (tinygemm takes other
// group sizes).
bool gemv_takes(const at::Tensor& x, int64_t group_size, const at::Tensor& scale_zero) {
  const auto float_or_bf16 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat;
  };
#ifndef DABBA_INT4_GEMV_AVX2
  if (group_size % gguf::kA8Block) return false;
#endif
  return x.size(0) <= kInt4GemvMaxRows && float_or_bf16(x) && float_or_bf16(scale_zero);
}

#ifdef DABBA_HAVE_BF16_GEMM

// More rows than the GEMV takes, bf16, on AMX tiles: the GEMM of gemm_amx_cpu.cpp with each 64-row
// block dequantized to bf16 once per call (amx_int4_gemm_blocks).
bool amx_takes(const at::Tensor& x, int64_t group_size, const at::Tensor& scale_zero,
               const c10::optional<at::Tensor>& bias) {
  return x.size(0) > kInt4GemvMaxRows && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
         scale_zero.scalar_type() == at::kBFloat16 && group_size % 32 == 0 &&
         (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous())) &&
         amx_usable(x.size(1));
}

at::Tensor int4_amx_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& scale_zero,
                         const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* sz = reinterpret_cast<const uint32_t*>(scale_zero.data_ptr());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, N / kInt4BlockRows, 1, [&](int64_t begin, int64_t end) {
    amx_int4_gemm_blocks(xp, M, K, packed.data_ptr<uint8_t>(), sz, group_size, bp, yp, N, begin, end);
  });
  return y;
}

#endif  // DABBA_HAVE_BF16_GEMM

#ifdef DABBA_HAVE_CODE_GEMM

// More rows than the GEMV takes, bf16, without AMX tiles (Zen 4 and 5): the integer GEMM of
// code_gemm.h, x rounded as the GEMV rounds it (its groups must hold whole blocks of 32). float32
// x, asked for where precision matters more than time, keeps tinygemm's unrounded products.
bool integer_gemm_takes(const at::Tensor& x, int64_t group_size, const at::Tensor& scale_zero) {
  return x.size(0) > kInt4GemvMaxRows && x.scalar_type() == at::kBFloat16 &&
         scale_zero.scalar_type() == at::kBFloat16 && group_size % gguf::kA8Block == 0 &&
         integer_gemm_usable(x.size(1));
}

// Channels first .. first + 32 of W into a panel: a 64-row block's low nibbles (its rows 0-31) or
// its high ones (32-63), 4 k at a time through the GEMV's gather (a dword permute and a byte
// shuffle give 16 rows' 4 codes a dword, the panel's line); per group, the rows' scale and
// offset o = 8 scale - zero (tinygemm's (q - 8) scale + zero = scale q - o) for its sub-blocks.
void int4_panel(const uint8_t* packed, int64_t K, int64_t N, int64_t group_size, const uint32_t* scale_zero,
                int64_t first, code_gemm::Panel& p) {
  const uint8_t* w = packed + first / kInt4BlockRows * K * 32;
  const bool high = first % kInt4BlockRows != 0;
  const __m512i index[2] = {int4_quad_index(0), int4_quad_index(1)};
  const __m512i rows_4x4 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  uint8_t* codes = p.codes.data();
  for (int64_t k = 0; k < K; k += 4) {
    const __m512i lo128 = _mm512_loadu_si512(w + k * 32), hi128 = _mm512_loadu_si512(w + k * 32 + 64);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_shuffle_epi8(_mm512_permutex2var_epi32(lo128, index[h], hi128), rows_4x4);
      _mm512_storeu_si512(codes + k * code_gemm::kPanel + 64 * h,
                          _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, low4));
    }
  }
  const int64_t blocks_per_group = group_size / gguf::kA8Block;
  for (int64_t g = 0; g < K / group_size; ++g)
    for (int h = 0; h < 2; ++h) {
      const __m512i sz = _mm512_loadu_si512(scale_zero + g * N + first + 16 * h);  // bf16 (scale, zero) pairs
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      const __m512 offset = _mm512_fmsub_ps(_mm512_set1_ps(8.f), scale, zero);
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        _mm512_storeu_ps(p.s.data() + b * code_gemm::kPanel + 16 * h, scale);
        _mm512_storeu_ps(p.o.data() + b * code_gemm::kPanel + 16 * h, offset);
      }
    }
}

// y = x W^T (+ b) for bf16 x, its rows rounded to the GEMV's codes once, W a panel at a time.
at::Tensor int4_integer_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size,
                             const at::Tensor& scale_zero, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  gguf::A8Needs needs;
  needs.legacy = true;
  using T = c10::BFloat16;
  const std::vector<gguf::A8Rows>& passes = code_gemm::quantize_passes<T>(x, needs);
  at::Tensor y = at::empty({M, N}, x.options());
  const bool fused_bias = bias.has_value() && bias->scalar_type() == x.scalar_type() && bias->is_contiguous();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint32_t*>(scale_zero.data_ptr());
  const code_gemm::CodeForm form{gguf::kA8Block, 0, true, false};
  code_gemm::code_gemm<T>(passes, M, K, form, N, 0, [&](int64_t first, code_gemm::Panel& p) {
    int4_panel(w, K, N, group_size, sz, first, p);
  }, fused_bias ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), N);
  return fused_bias || !bias.has_value() ? y : y + *bias;
}

#endif  // DABBA_HAVE_CODE_GEMM

}  // namespace

#endif  // DABBA_HAVE_INT4_GEMV

// The one place an INT4 linear picks its kernel: the GEMV above for up to kInt4GemvMaxRows rows;
// beyond, the AMX GEMM on blocks dequantized to bf16 where the CPU has AMX and x is bf16; without
// AMX tiles, the integer GEMM on x's 8-bit codes (AVX512-VNNI); else (and where PyTorch packed
// another layout) PyTorch's tinygemm. ``native`` false forces tinygemm (the tests hold the others
// equal to it within rounding).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& scale_zero,
                       const c10::optional<at::Tensor>& bias, bool native) {
  at::Tensor y;
#ifdef DABBA_HAVE_INT4_GEMV
  if (native && packed_operands(x, packed, group_size, scale_zero)) {
#ifdef DABBA_HAVE_BF16_GEMM
    if (amx_takes(x, group_size, scale_zero, bias)) return int4_amx_gemm(x, packed, group_size, scale_zero, bias);
#endif
#ifdef DABBA_HAVE_CODE_GEMM
    if (integer_gemm_takes(x, group_size, scale_zero)) return int4_integer_gemm(x, packed, group_size, scale_zero, bias);
#endif
    if (gemv_takes(x, group_size, scale_zero)) y = int4_gemv(x, packed, group_size, scale_zero);
  }
#endif
  if (!y.defined()) y = at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, Tensor? bias, bool native=True) -> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::int4_linear));
}

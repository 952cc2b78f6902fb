// The integer GEMM on 8-bit codes that the quantized weight formats share: GGUF's blocks
// (gguf_gemm_cpu.cpp), PyTorch's packed INT4 (int4_linear_cpu.cpp) and INT8's codes
// (int8_code_gemm_cpu.cpp) each decode kPanel output
// channels at a time into a panel of unsigned 8-bit codes, 16 channels' 4 consecutive codes in each
// 64-byte line (vpdpbusd's unsigned operand as it lies, W8A8's order), with each sub-block's scale
// s and offset o per channel (value = s * code - o; a format without one keeps its codes' bias b
// instead, value = s * (code - b)). Every pass of x's codes (gguf_dot.h: quantize_rows) then meets
// the panel while it sits in L2: 4 of x's codes broadcast against each line; a sub-block's int32
// sums start at -b * the sum of x's codes over it (the bias, folded exactly), and are scaled into
// float32 by x's scale and s (less o * x's sum where the format has offsets). The panel is made per
// call, so the weight's own bytes stay its only copy: its cost is decoding a row against a pass's
// dot products for every row of x. For CPUs with AVX512-VNNI and no AMX tiles.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"
#include "cpu_ops.h"
#include "gguf_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dabba::code_gemm {

// x's rows rounded as `needs` asks, kGgufGemvPassRows to a pass, the passes in parallel. Read by
// this call's threads, rewritten by the next call's (a reference: in a lambda, the name of a
// thread_local would be each thread's own).
template <typename T>
const std::vector<gguf::A8Rows>& quantize_passes(const at::Tensor& x, const gguf::A8Needs& needs) {
  const int64_t M = x.size(0), num_passes = (M + kGgufGemvPassRows - 1) / kGgufGemvPassRows;
  thread_local std::vector<gguf::A8Rows> kept;
  std::vector<gguf::A8Rows>& passes = kept;
  if (static_cast<int64_t>(passes.size()) < num_passes) passes.resize(num_passes);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, num_passes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r = p * kGgufGemvPassRows;
      gguf::quantize_rows<T>(xp + r * x.stride(0), std::min<int64_t>(kGgufGemvPassRows, M - r), x.size(1),
                             x.stride(0), needs, passes[p]);
    }
  });
  return passes;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DABBA_HAVE_CODE_GEMM 1

constexpr int kPanel = 32;  // output channels a panel holds: two vpdpbusd lines of 16

// kPanel channels' codes, [K / 4][kPanel][4], and their sub-blocks' s and o, [K / S][kPanel];
// channels past the weight's rows hold zeros.
struct Panel {
  std::vector<uint8_t> codes;
  std::vector<float> s, o;
};

// What a format's codes are against x's: the sub-block S its scales cover (32, or 16), the bias b
// its codes carry, whether it has offsets o, and which of x's roundings it meets (gguf_dot.h:
// k_quants' per 256, else legacy per 32).
struct CodeForm {
  int sub_block = 32;
  int bias = 0;
  bool offsets = false;
  bool k_quants = false;
};

// x's side of a sub-block, per row: its scale, its scale times its codes' sum (an offset's
// factor; for k_quants, whose scale is the super-block's, the sum alone: tile applies the scale
// once a super-block), and where the sums start (-bias * the codes' sum), [M][B]
struct XSide {
  std::vector<float> dx, xo;
  std::vector<int32_t> init;
};

inline void make_x_side(const std::vector<gguf::A8Rows>& passes, int64_t M, int64_t K, const CodeForm& form,
                        XSide& x) {
  const int S = form.sub_block, bias = form.bias;
  const bool k = form.k_quants;
  const int64_t B = K / S;
  x.dx.resize(M * B);
  x.xo.resize(M * B);
  x.init.resize(M * B);
  at::parallel_for(0, static_cast<int64_t>((M + kGgufGemvPassRows - 1) / kGgufGemvPassRows), 1,
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const gguf::A8Rows& a = passes[p];
      for (int64_t r = 0; r < a.M; ++r) {
        const int64_t m = p * kGgufGemvPassRows + r;
        const int8_t* q = k ? a.qk.data() + r * K : a.q.data() + r * a.blocks * gguf::kA8Block;
        for (int64_t b = 0; b < B; ++b) {
          int sum = 0;
          for (int i = 0; i < S; ++i) sum += q[b * S + i];
          const float d = k ? a.dk[r * (K / gguf::kSuperBlock) + b * S / gguf::kSuperBlock] : a.d[r * a.blocks + b];
          x.dx[m * B + b] = d;
          x.xo[m * B + b] = k ? static_cast<float>(sum) : d * static_cast<float>(sum);
          x.init[m * B + b] = -bias * sum;
        }
      }
    }
  });
}

// R rows of x against a panel's two lines of 16 channels, over every sub-block: acc[r][line]. With
// kKQuants (x rounded per super-block of 256) a super-block's scaled sums gather in part and meet
// x's scale once, at its end: a multiply a sub-block fewer.
template <int R, int S, bool kOffsets, bool kKQuants>
inline void tile(const Panel& p, int64_t B, const int8_t* xq, int64_t ldq, const float* dx, const float* xo,
                 const int32_t* init, int64_t ldb, __m512 (&acc)[R][2]) {
  constexpr int kSubBlocks = gguf::kSuperBlock / S;  // a super-block's
  __m512 part[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = part[r][0] = part[r][1] = _mm512_setzero_ps();
  const uint8_t* wc = p.codes.data();
  for (int64_t b = 0; b < B; ++b) {
    __m512i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_set1_epi32(init[r * ldb + b]);
    const uint8_t* wb = wc + b * (S / 4) * kPanel * 4;
    const int8_t* xb = xq + b * S;
    for (int q = 0; q < S / 4; ++q) {
      const __m512i w0 = _mm512_loadu_si512(wb + q * kPanel * 4), w1 = _mm512_loadu_si512(wb + q * kPanel * 4 + 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xb + r * ldq + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(quad);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, a);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, a);
      }
    }
    // a sub-block's sums into acc, or into part where x's scale waits for the super-block's end
    __m512 (&into)[R][2] = kKQuants ? part : acc;
    const __m512 s0 = _mm512_loadu_ps(p.s.data() + b * kPanel), s1 = _mm512_loadu_ps(p.s.data() + b * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      __m512 v0 = _mm512_cvtepi32_ps(sums[r][0]), v1 = _mm512_cvtepi32_ps(sums[r][1]);
      if constexpr (!kKQuants) {
        const __m512 d = _mm512_set1_ps(dx[r * ldb + b]);
        v0 = _mm512_mul_ps(v0, d);
        v1 = _mm512_mul_ps(v1, d);
      }
      into[r][0] = _mm512_fmadd_ps(v0, s0, into[r][0]);
      into[r][1] = _mm512_fmadd_ps(v1, s1, into[r][1]);
    }
    if constexpr (kOffsets) {
      const __m512 o0 = _mm512_loadu_ps(p.o.data() + b * kPanel), o1 = _mm512_loadu_ps(p.o.data() + b * kPanel + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_set1_ps(xo[r * ldb + b]);
        into[r][0] = _mm512_fnmadd_ps(o0, v, into[r][0]);
        into[r][1] = _mm512_fnmadd_ps(o1, v, into[r][1]);
      }
    }
    if (kKQuants && (b + 1) % kSubBlocks == 0) {
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(dx[r * ldb + b]);
        acc[r][0] = _mm512_fmadd_ps(part[r][0], d, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(part[r][1], d, acc[r][1]);
        part[r][0] = part[r][1] = _mm512_setzero_ps();
      }
    }
  }
}

// 16 float32 -> bfloat16 bits, rounded to nearest even as from_float (finite values)
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

// 16 sums into y[col .. col + 16) (the first `count`), rounded to T before a bias adds to it, as the
// references' F.linear then + bias
inline void store16(__m512 v, const float* bias, float* y, __mmask16 mask) {
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, v);
}
inline void store16(__m512 v, const c10::BFloat16* bias, c10::BFloat16* y, __mmask16 mask) {
  __m256i h = to_bf16(v);
  if (bias) {
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    h = to_bf16(_mm512_add_ps(rounded, b));
  }
  _mm256_mask_storeu_epi16(y, mask, h);
}

// Panels of `rows` channels in parallel, y's columns from `column`: fill(first, panel) decodes
// channels first .. first + kPanel (codes sized [K / 4][kPanel][4], s and o [K / S][kPanel]).
template <int S, bool kOffsets, bool kKQuants, typename T, typename Fill>
void panels(const std::vector<gguf::A8Rows>& passes, int64_t M, int64_t K, int64_t rows,
            int64_t column, const XSide& x, const Fill& fill, const T* bias, T* y, int64_t ldy) {
  const int64_t B = K / S, count = (rows + kPanel - 1) / kPanel;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    thread_local Panel p;  // each thread's own, kept from call to call
    p.codes.resize(K / 4 * kPanel * 4);
    p.s.resize(B * kPanel);
    p.o.resize(B * kPanel);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t channels = std::min<int64_t>(kPanel, rows - i * kPanel), col = column + i * kPanel;
      if (channels < kPanel) {  // channels past the rows: zeros
        std::fill(p.codes.begin(), p.codes.end(), 0);
        std::fill(p.s.begin(), p.s.end(), 0.f);
        std::fill(p.o.begin(), p.o.end(), 0.f);
      }
      fill(i * kPanel, p);
      const __mmask16 m0 = static_cast<__mmask16>(channels >= 16 ? 0xFFFF : (1u << channels) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(channels >= 32 ? 0xFFFF : channels <= 16 ? 0 : (1u << (channels - 16)) - 1);
      for (size_t pass = 0; pass * kGgufGemvPassRows < static_cast<size_t>(M); ++pass) {
        const gguf::A8Rows& a = passes[pass];
        const int64_t m = pass * kGgufGemvPassRows;
        const int8_t* xq = kKQuants ? a.qk.data() : a.q.data();
        const int64_t ldq = kKQuants ? K : a.blocks * gguf::kA8Block;
        with_count<kGgufGemvPassRows>(a.M, [&](auto count_rows) {
          constexpr int R = decltype(count_rows)::value;
          __m512 acc[R][2];
          tile<R, S, kOffsets, kKQuants>(p, B, xq, ldq, x.dx.data() + m * B, x.xo.data() + m * B, x.init.data() + m * B, B, acc);
          for (int r = 0; r < R; ++r) {
            T* yr = y + (m + r) * ldy + col;
            const T* b = bias ? bias + col : nullptr;
            store16(acc[r][0], b, yr, m0);
            if (m1) store16(acc[r][1], b ? b + 16 : nullptr, yr + 16, m1);
          }
        });
      }
    }
  });
}

// y[:, column:column + rows] = x W^T (+ bias) for x's M rows, rounded into `passes` (the rounding
// `form` meets), W's channels decoded a panel at a time by fill; y rows ldy apart in x's dtype T
// (float or c10::BFloat16).
template <typename T, typename Fill>
void code_gemm(const std::vector<gguf::A8Rows>& passes, int64_t M, int64_t K, const CodeForm& form, int64_t rows,
               int64_t column, const Fill& fill, const T* bias, T* y, int64_t ldy) {
  XSide x;
  make_x_side(passes, M, K, form, x);
  if (form.sub_block == 16 && !form.offsets && form.k_quants)  // Q6_K
    panels<16, false, true, T>(passes, M, K, rows, column, x, fill, bias, y, ldy);
  else if (form.sub_block == 32 && form.offsets && form.k_quants)  // Q4_K, Q5_K
    panels<32, true, true, T>(passes, M, K, rows, column, x, fill, bias, y, ldy);
  else if (form.sub_block == 32 && form.offsets && !form.k_quants)  // Q4_1, Q5_1, INT4
    panels<32, true, false, T>(passes, M, K, rows, column, x, fill, bias, y, ldy);
  else if (form.sub_block == 32 && !form.offsets && !form.k_quants)  // Q4_0, Q5_0, Q8_0, INT8
    panels<32, false, false, T>(passes, M, K, rows, column, x, fill, bias, y, ldy);
  else
    TORCH_CHECK(false, "code_gemm: sub-blocks of ", form.sub_block, (form.offsets ? " with" : " without"),
                " offsets and x's scale per ", (form.k_quants ? "256" : "32"), " are not built");
}

#endif

}  // namespace dabba::code_gemm

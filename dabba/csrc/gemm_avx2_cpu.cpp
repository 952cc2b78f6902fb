// The avx2 variant's GEMM (x86-64-v3: AVX2 + FMA, no bf16 dot products): y[M, N] = x[M, K] W[N, K]^T
// (+ b) for bf16 x and weights, from kAvx2GemmMinRows rows (dense_linear in gemm_cpu.cpp chooses).
//
// Why not the GEMV in passes of 8 rows (what the variant ran before): it widens every x vector
// again for every weight row and re-reads the whole weight each pass, and its shifts and masks
// share the ports with the FMAs: about 110 GFLOP/s on two cores at any row count. Here both
// operands are widened to float32 once: x a chunk of rows at a time (kXChunkBytes, which stays in
// L2), in groups of kTileRows rows stored k-major; the weight a panel of 16 rows at a time, per
// chunk, also k-major (8 x 8 blocks transposed as 16-bit lanes, then widened). A tile of 5 x rows
// by the panel's 16 columns keeps 10 accumulators over all of K: each k loads the panel's two
// vectors and broadcasts 5 x values into 10 FMAs, and the sums land as rows of y, with no
// horizontal adds. (6 rows, 12 accumulators, made GCC spill two of them to the stack: half the
// rate.) 150-190 GFLOP/s from 64 rows; the widening costs about what reading the weight does.
//
// Numerics: float32 sums of exact products, in k's order; the bias is added before the one
// rounding to bf16, as addmm does. A row's output does not depend on the other rows.
//
// Built only in the avx2 variant: the avx512 one has its AVX512-BF16 and AMX tiles (gemm_cpu.cpp,
// gemm_amx_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#include <immintrin.h>
#define DABBA_HAVE_AVX2_GEMM 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_AVX2_GEMM

namespace {

constexpr int kTileRows = 5;                 // x rows a tile: 5 x 2 accumulators of 8 lanes
constexpr int kPanel = 16;                   // weight rows (output columns) a panel: two vectors
constexpr int64_t kXChunkBytes = 1 << 20;    // widened x rows per chunk: they stay in L2

// A row of K bf16 -> float32, exactly.
void widen_row(const uint16_t* src, int64_t K, float* dst) {
  for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits_to_float(src[k]);
}

// 8 bf16 lanes widened to float32 exactly.
inline __m256 widen8(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

// r[i] = row i's 8 lanes -> r[j] = lane j of the 8 rows.
inline void transpose8x8_epi16(__m128i (&r)[8]) {
  __m128i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    u[4 * h + 0] = _mm_unpacklo_epi32(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 1] = _mm_unpackhi_epi32(t[4 * h + 0], t[4 * h + 2]);
    u[4 * h + 2] = _mm_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[2 * j] = _mm_unpacklo_epi64(u[j], u[4 + j]);
    r[2 * j + 1] = _mm_unpackhi_epi64(u[j], u[4 + j]);
  }
}

// Weight rows 0 .. rows (<= kPanel) -> float32 [K][kPanel]: for each k, the panel's 16 values side
// by side (rows past the weight's end are zeros and never stored). 8 x 8 blocks transposed as
// 16-bit lanes, then widened: a third of the time of widening and scattering each element.
void pack_panel(const uint16_t* w, int64_t K, int64_t rows, float* panel) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int half = 0; half < 2; ++half) {
      __m128i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t n = half * 8 + i;
        r[i] = n < rows ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k)) : _mm_setzero_si128();
      }
      transpose8x8_epi16(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(panel + (k + j) * kPanel + half * 8, widen8(r[j]));
    }
  for (; k < K; ++k)
    for (int64_t n = 0; n < kPanel; ++n) {
      panel[k * kPanel + n] = n < rows ? bf16_bits_to_float(w[n * K + k]) : 0.f;
    }
}

// kTileRows rows of x, packed k-major (xg[k][r]), against a packed panel:
// out[r][0..16) = sum_k xg[k][r] panel[k][0..16), summed in k's order.
inline void tile(const float* xg, int64_t K, const float* panel, float* out /* [kTileRows][kPanel] */) {
  __m256 acc[kTileRows][2];
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int r = 0; r < kTileRows; ++r) {
      const __m256 a = _mm256_broadcast_ss(xg + k * kTileRows + r);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
}

// y = x W^T (+ bias), rounded to bf16 once.
void gemm(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias,
          uint16_t* y, int64_t ldy) {
  const int64_t chunk = std::max<int64_t>(kTileRows, kXChunkBytes / (K * 4) / kTileRows * kTileRows);
  // a chunk's rows widened in groups of kTileRows, each k-major: xg[group][k][r] (missing rows zero)
  std::vector<float> xg((std::min(chunk, M) + kTileRows - 1) / kTileRows * kTileRows * K);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0), groups = (rows + kTileRows - 1) / kTileRows;
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t g = begin; g < end; ++g) {
        float* dst = xg.data() + g * kTileRows * K;
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t m = g * kTileRows + r;
          if (m < rows) widen_row(x + (m0 + m) * ldx, K, row.data());
          else std::fill(row.begin(), row.end(), 0.f);
          for (int64_t k = 0; k < K; ++k) dst[k * kTileRows + r] = row[k];
        }
      }
    });
    at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> panel;
      panel.resize(K * kPanel);
      alignas(32) float sums[kTileRows * kPanel];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
        pack_panel(w + n0 * K, K, cols, panel.data());
        float add[kPanel] = {};  // the bias, added before the one rounding, as addmm
        for (int64_t j = 0; bias && j < cols; ++j) add[j] = bf16_bits_to_float(bias[n0 + j]);
        for (int64_t g = 0; g < groups; ++g) {
          tile(xg.data() + g * kTileRows * K, K, panel.data(), sums);
          for (int64_t i = 0; i < std::min<int64_t>(kTileRows, rows - g * kTileRows); ++i) {
            uint16_t* dst = y + (m0 + g * kTileRows + i) * ldy + n0;
            for (int64_t j = 0; j < cols; ++j) dst[j] = float_to_bf16_bits(sums[i * kPanel + j] + add[j]);
          }
        }
      }
    });
  }
}

}  // namespace

#endif  // DABBA_HAVE_AVX2_GEMM

bool avx2_gemm_available() {
#ifdef DABBA_HAVE_AVX2_GEMM
  return true;
#else
  return false;
#endif
}

void avx2_bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx2_gemm_available(), "avx2_bf16_gemm: only the avx2 variant has it");
#ifdef DABBA_HAVE_AVX2_GEMM
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] bf16 tensor");
  const uint16_t* bp = check_bf16_output(out, x.size(0), weight.size(0), bias, weight.size(0));
  if (x.size(0) == 0 || weight.size(0) == 0) return;
  gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), x.size(0), x.size(1),
       reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.size(0), bp,
       reinterpret_cast<uint16_t*>(out.data_ptr()), out.stride(0));
#endif
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("avx2_gemm_available() -> bool", &dabba::avx2_gemm_available);  // no tensor: a catch-all
  m.def("avx2_bf16_gemm(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("avx2_bf16_gemm", c10::DispatchKey::CPU, TORCH_FN(dabba::avx2_bf16_gemm));
}

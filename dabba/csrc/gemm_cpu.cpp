// bf16 x bf16 -> bf16 GEMM for batched decode and prefill: y[M, N] = x[M, K] W[N, K]^T (+ b).
//
// PyTorch's F.linear calls oneDNN without prepacked weights, so every call reorders the weight
// first. On SmolLM's shapes that reaches 250-460 GFLOP/s at the 16-64 rows of batched decode and
// ~780 at prefill's thousands; this kernel 620-930 across the range (python -m benchmarks.kernels).
// At 64 rows the 30 layers' products plus the LM head take 19 ms here, 38 ms through F.linear.
//
// How: vdpbf16ps multiplies 16 lanes of bf16 pairs and adds both products into float32 lanes.
// The activations are packed once per call so that a vector holds one pair of K positions for 16
// rows: xp[v][j][16] = (x[16v + i, 2j], x[16v + i, 2j + 1]). The weight is read in place, row-major
// as loaded: each pair W[n, 2j:2j+2] is broadcast to all 16 lanes. A tile of NR weight rows by MV
// vectors of rows keeps NR * MV float32 accumulators in registers across all of K, so every
// weight pair loaded serves MV * 16 rows and every activation vector NR weight rows, and the
// weight needs no second copy. The next tile's weight rows are prefetched while this one runs:
// without it the kernel waits on memory (480 against 900 GFLOP/s at 64 rows).
// Each output is rounded to bf16 once, after the bias is added, as oneDNN's GEMM does.
//
// Built only where the compiler targets AVX512-BF16, like the GEMV (gemv_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DABBA_HAVE_BF16_GEMM 1
#endif

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMM

namespace {

constexpr int64_t kTileRows = 16;      // weight rows per work item: a multiple of every NR below
constexpr int64_t kBlockRows = 192;    // weight rows that stay in L2 while all row chunks of x pass

// xp[v][j][i] = pair j of row 16v + i; rows past M are zeros.
void pack_rows(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t pairs = K / 2, vectors = (M + 15) / 16;
  at::parallel_for(0, vectors, 1, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      uint32_t* dst = xp + v * pairs * 16;
      for (int i = 0; i < 16; ++i) {
        const int64_t m = v * 16 + i;
        if (m >= M) {
          for (int64_t j = 0; j < pairs; ++j) dst[j * 16 + i] = 0;
          continue;
        }
        const auto* src = reinterpret_cast<const uint32_t*>(x + m * ldx);
        for (int64_t j = 0; j < pairs; ++j) dst[j * 16 + i] = src[j];
      }
    }
  });
}

// Four columns' float32 sums for 16 rows -> bf16, written row by row (4 adjacent outputs each).
inline void store_quad(const __m512 (&sums)[4], const uint16_t* bias, int valid_cols, uint16_t* y, int64_t ldy,
                       int64_t rows) {
  __m256i h[4];
  for (int c = 0; c < 4; ++c) {
    const __m512 s = bias && c < valid_cols ? _mm512_add_ps(sums[c], _mm512_set1_ps(bf16_bits_to_float(bias[c])))
                                            : sums[c];
    h[c] = (__m256i)_mm512_cvtneps_pbh(s);  // round to nearest even, as float_to_bf16_bits
  }
  // Interleave to (c0, c1, c2, c3) per row: unpack works within 128-bit lanes, hence the order.
  const __m256i lo01 = _mm256_unpacklo_epi16(h[0], h[1]), hi01 = _mm256_unpackhi_epi16(h[0], h[1]);
  const __m256i lo23 = _mm256_unpacklo_epi16(h[2], h[3]), hi23 = _mm256_unpackhi_epi16(h[2], h[3]);
  alignas(32) uint64_t quads[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(quads + 0), _mm256_unpacklo_epi32(lo01, lo23));
  _mm256_store_si256(reinterpret_cast<__m256i*>(quads + 4), _mm256_unpackhi_epi32(lo01, lo23));
  _mm256_store_si256(reinterpret_cast<__m256i*>(quads + 8), _mm256_unpacklo_epi32(hi01, hi23));
  _mm256_store_si256(reinterpret_cast<__m256i*>(quads + 12), _mm256_unpackhi_epi32(hi01, hi23));
  static constexpr int kRowOf[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
  const size_t bytes = 2 * static_cast<size_t>(std::min(valid_cols, 4));
  for (int q = 0; q < 16; ++q)
    if (kRowOf[q] < rows) std::memcpy(y + kRowOf[q] * ldy, &quads[q], bytes);
}

// NR weight rows (valid of them real; the rest repeat the last and are not stored) against
// MV * 16 packed rows of x (rows of them real), over all of K.
template <int MV, int NR>
void gemm_tile(const uint32_t* xp, int64_t pairs, const uint16_t* w, int64_t K, int valid, const uint16_t* bias,
               uint16_t* y, int64_t ldy, int64_t rows) {
  __m512 acc[NR][MV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_setzero_ps();
  const uint32_t* wr[NR];
  for (int n = 0; n < NR; ++n) wr[n] = reinterpret_cast<const uint32_t*>(w + std::min(n, valid - 1) * K);
  const char* next = reinterpret_cast<const char*>(w + NR * K);  // the next tile's rows, to prefetch
  for (int64_t j = 0; j < pairs; ++j) {
    if ((j & 15) == 0)  // one 64-byte line per row per 16 pairs
      for (int n = 0; n < NR; ++n) _mm_prefetch(next + n * K * 2 + j * 4, _MM_HINT_T0);
    __m512bh xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xp + (v * pairs + j) * 16);
    for (int n = 0; n < NR; ++n) {
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(wr[n][j]));
      for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_dpbf16_ps(acc[n][v], wv, xv[v]);
    }
  }
  for (int v = 0; v < MV; ++v) {
    const int64_t v_rows = std::min<int64_t>(16, rows - v * 16);
    if (v_rows <= 0) break;
    for (int c = 0; c < NR && c < valid; c += 4) {
      const __m512 quad[4] = {acc[c][v], acc[c + 1][v], acc[c + 2][v], acc[c + 3][v]};
      store_quad(quad, bias ? bias + c : nullptr, valid - c, y + v * 16 * ldy + c, ldy, v_rows);
    }
  }
}

// Weight rows [n_begin, n_end) against all of x, in chunks of 32 rows of x (8 weight rows a tile,
// 16 accumulators); an odd count of 16-row vectors ends with 48 (8 weight rows, 24 accumulators)
// or, for 16 rows alone, 16 weight rows a tile.
void gemm_rows(const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* y,
               int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t pairs = K / 2, vectors = (M + 15) / 16;
  for (int64_t block = n_begin; block < n_end; block += kBlockRows) {
    const int64_t block_end = std::min(n_end, block + kBlockRows);
    for (int64_t v = 0; v < vectors;) {
      const int64_t left = vectors - v;
      const int chunk = left == 3 ? 3 : left == 1 ? 1 : 2;
      const uint32_t* xv = xp + v * pairs * 16;
      const int64_t rows = M - v * 16;
      auto run = [&](auto tile, int64_t nr) {
        for (int64_t n = block; n < block_end; n += nr)
          tile(xv, pairs, w + n * K, K, static_cast<int>(std::min<int64_t>(nr, N - n)), bias ? bias + n : nullptr,
               y + v * 16 * ldy + n, ldy, rows);
      };
      if (chunk == 2) run(gemm_tile<2, 8>, 8);
      else if (chunk == 3) run(gemm_tile<3, 8>, 8);
      else run(gemm_tile<1, 16>, 16);
      v += chunk;
    }
  }
}

}  // namespace

#endif  // DABBA_HAVE_BF16_GEMM

bool gemm_available() {
#ifdef DABBA_HAVE_BF16_GEMM
  return true;
#else
  return false;
#endif
}

void bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(gemm_available(), "bf16_gemm: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] bf16 tensor");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_gemm needs an even K (pairs of K per lane), got ", K);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16,
              "out must be [M, N] bf16, rows contiguous");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16,
                "bias must be [N] bf16");
    bp = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (M == 0 || N == 0) return;
#ifdef DABBA_HAVE_BF16_GEMM
  at::Tensor packed = at::empty({(M + 15) / 16 * 16 * K / 2}, x.options().dtype(at::kInt));
  auto* xp = reinterpret_cast<uint32_t*>(packed.data_ptr());
  pack_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, xp);
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ldy = out.stride(0), tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    gemm_rows(xp, M, K, wp, bp, yp, ldy, N, begin * kTileRows, std::min(N, end * kTileRows));
  });
#endif
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool bf16 = x.dim() == 2 && x.size(0) > 0 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                    weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                    (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()));
  if (bf16 && x.size(0) <= kGemvMaxRows && gemv_available()) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    bf16_gemv(y, x, weight, bias);
    return y;
  }
  if (bf16 && weight.size(1) % 2 == 0 && gemm_available()) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    bf16_gemm(y, x, weight, bias);
    return y;
  }
  return at::linear(x, weight, bias);
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::dense_linear));
  m.def("gemm_available() -> bool", &dabba::gemm_available);
  m.def("bf16_gemm(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("bf16_gemm", c10::DispatchKey::CPU, TORCH_FN(dabba::bf16_gemm));
}

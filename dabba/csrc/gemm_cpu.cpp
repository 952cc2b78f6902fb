// bf16 x bf16 -> bf16 GEMM for batched decode and prefill: y[M, N] = x[M, K] W[N, K]^T (+ b).
// These are the AVX512-BF16 tiles, the reference; on CPUs with AMX the GEMM takes AMX tiles
// instead (gemm_amx_cpu.cpp; take_amx below is where that is decided).
//
// PyTorch's F.linear calls oneDNN without prepacked weights, so every call reorders the weight
// first. On SmolLM's shapes that reaches 250-460 GFLOP/s at the 16-64 rows of batched decode;
// this kernel 600-900 (python -m benchmarks.kernels). At 64 rows the 30 layers' products plus the
// LM head take 19 ms here, 38 ms through F.linear. Past kGemmMaxRows oneDNN's blocking for large
// matrices wins inside the engine (a 4096-token prefill step: 1.24 s against 1.33), so
// dense_linear hands those to F.linear.
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
// For an MLP's merged gate_up projection the same tiles take gate rows and the matching up rows
// together and store silu(gate) * up or gelu_tanh(gate) * up (rounded as silu_and_mul and
// gelu_tanh_and_mul round), so the [M, 2d] projection is never written and read back: 35 ms of a
// 4096-token prefill step of SmolLM.
//
// INT8 codes (quantization/rtn.py) take the same tiles: each 16 code rows are widened to bf16 once
// per call (exactly: |q| <= 128 needs 8 significant bits) and the row's scale multiplies the
// float32 sums. At 8-16 rows the widening sets the pace (10.9 ms over SmolLM's layers); at 64 rows
// 21.7 ms against _weight_int8pack_mm's 45.7.
//
// Built only where the compiler targets AVX512-BF16, like the GEMV (gemv_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_tiles.h"
#include "code_gemm.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMM

namespace {

constexpr int64_t kTileRows = 16;      // weight rows per work item: a multiple of every NR below
constexpr int64_t kBlockRows = 192;    // weight rows that stay in L2 while all row chunks of x pass

// Four columns of 16 rows, as bf16 vectors (one per column) -> row by row, 4 adjacent outputs each.
inline void store_quad(const __m256i (&cols)[4], int valid_cols, uint16_t* y, int64_t ldy, int64_t rows) {
  // Interleave to (c0, c1, c2, c3) per row: unpack works within 128-bit lanes, hence the order.
  const __m256i lo01 = _mm256_unpacklo_epi16(cols[0], cols[1]), hi01 = _mm256_unpackhi_epi16(cols[0], cols[1]);
  const __m256i lo23 = _mm256_unpacklo_epi16(cols[2], cols[3]), hi23 = _mm256_unpackhi_epi16(cols[2], cols[3]);
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

// NR weight rows against MV * 16 packed rows of x (rows of them real), over all of K. Plain: the
// tile's rows are output columns n..n+NR-1 (valid of them real; the rest repeat the last and are
// not stored). Gated (E): its first NR/2 rows are gate rows n.., the rest the matching up rows,
// which sit up_rows further on in a merged gate_up weight; out = act(gate) * up, NR/2 columns.
template <int MV, int NR, Epilogue E, bool kNextToL2 = false>
void gemm_tile(const uint32_t* xp, int64_t pairs, const uint16_t* w, int64_t up_rows, int64_t K, int valid,
               const uint16_t* scale, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t rows) {
  constexpr bool kGated = E != Epilogue::kPlain;
  constexpr int kCols = kGated ? NR / 2 : NR;
  __m512 acc[NR][MV];
  for (int n = 0; n < NR; ++n)
    for (int v = 0; v < MV; ++v) acc[n][v] = _mm512_setzero_ps();
  const uint32_t* wr[NR];
  for (int n = 0; n < NR; ++n) {
    const int64_t row = n < kCols ? std::min(n, valid - 1) : up_rows + std::min(n - kCols, valid - 1);
    wr[n] = reinterpret_cast<const uint32_t*>(w + row * K);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    if ((j & 15) == 0)  // the next tile's rows (kCols on): one 64-byte line per row per 16 pairs
      for (int n = 0; n < NR; ++n) {
        const char* line = reinterpret_cast<const char*>(wr[n] + j + kCols * K / 2);
        if constexpr (kNextToL2) _mm_prefetch(line, _MM_HINT_T1);
        else _mm_prefetch(line, _MM_HINT_T0);
      }
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
    for (int c = 0; c < kCols && c < valid; c += 4) {
      __m256i cols[4];
      for (int i = 0; i < 4; ++i) {
        cols[i] = round_column(acc[c + i][v], scale ? scale + c + i : nullptr, bias ? bias + c + i : nullptr);
        if constexpr (kGated)
          cols[i] = gated_column<E>(cols[i], round_column(acc[kCols + c + i][v], nullptr,
                                                          bias ? bias + up_rows + c + i : nullptr));
      }
      store_quad(cols, valid - c, y + v * 16 * ldy + c, ldy, v_rows);
    }
  }
}

// Whether a tile's weight rows, K apart, put their current 64-byte lines in too few sets of the
// L1 cache. A tile reads its NR rows in step, one line of each at a time, and asks for the next
// tile's. Where a row is a multiple of 2 KiB long (K of 1024, 2048, 4096: Llama-3.2-1B's and
// Llama-3-8B's widths) all those lines fall in one or two of the cache's 64 sets, more lines than
// a set holds (8 to 12 ways on current x86 cores), so each is evicted before its 16 pairs are
// used and read again from L2. There the tiles take 8 weight rows for one 16-row vector of x, as
// they do for more, and ask for the next tile's rows into L2 only: 8 lines in a set. Each
// output's sum stays the same: the same pairs in the same order.
// One pass over 256 MB of weights, N = 2048, x of 4 / 16 rows, 2-core AMD EPYC (Zen 5,
// AVX512-BF16, no AMX): K = 2048 28.8 -> 38.7 / 27.3 -> 36.6 GB/s, 4096 29.8 -> 40.2 / 29.3 ->
// 38.6, 8192 28.9 -> 37.1 / 29.0 -> 37.6, where K = 2080 or 4128 read 42-45. From 32 rows the
// products set the pace either way.
inline bool lines_collide(int64_t K) { return K % 1024 == 0; }

// 16-row vectors of x a tile takes next: 2, but 3 or 1 for the last of an odd count.
inline int chunk_vectors(int64_t left) { return left == 3 ? 3 : left == 1 ? 1 : 2; }

// Output columns [n_begin, n_end) against all of x, in chunks of 32 rows of x (8 weight rows a
// tile, 16 accumulators); an odd count of 16-row vectors ends with 48 (8 weight rows, 24
// accumulators) or, for 16 rows alone, 16 weight rows a tile.
template <Epilogue E>
void gemm_rows(const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t up_rows, const uint16_t* bias,
               uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t pairs = K / 2, vectors = (M + 15) / 16;
  for (int64_t block = n_begin; block < n_end; block += kBlockRows) {
    const int64_t block_end = std::min(n_end, block + kBlockRows);
    for (int64_t v = 0; v < vectors;) {
      const int chunk = chunk_vectors(vectors - v);
      const uint32_t* xv = xp + v * pairs * 16;
      const int64_t rows = M - v * 16;
      auto run = [&](auto tile, int64_t cols) {
        for (int64_t n = block; n < block_end; n += cols)
          tile(xv, pairs, w + n * K, up_rows, K, static_cast<int>(std::min<int64_t>(cols, N - n)), nullptr,
               bias ? bias + n : nullptr, y + v * 16 * ldy + n, ldy, rows);
      };
      constexpr int kPerCol = E == Epilogue::kPlain ? 1 : 2;  // weight rows per output column
      if (lines_collide(K)) {
        if (chunk == 2) run(gemm_tile<2, 8, E, true>, 8 / kPerCol);
        else if (chunk == 3) run(gemm_tile<3, 8, E, true>, 8 / kPerCol);
        else run(gemm_tile<1, 8, E, true>, 8 / kPerCol);
      } else if (chunk == 2) run(gemm_tile<2, 8, E>, 8 / kPerCol);
      else if (chunk == 3) run(gemm_tile<3, 8, E>, 8 / kPerCol);
      else run(gemm_tile<1, 16, E>, 16 / kPerCol);
      v += chunk;
    }
  }
}

// INT8 codes: y = (x Q^T) * s (+ b). Each 16 code rows are widened to bf16 once, into a buffer
// that the bf16 tiles then read for every row chunk of x; the scale multiplies the float32 sums.
void int8_gemm_rows(const uint32_t* xp, int64_t M, int64_t K, const int8_t* q, const uint16_t* scales,
                    const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t pairs = K / 2, vectors = (M + 15) / 16;
  std::vector<uint16_t> rows_bf16(16 * K);
  const uint16_t* w = rows_bf16.data();
  for (int64_t n = n_begin; n < n_end; n += 16) {
    const int valid = static_cast<int>(std::min<int64_t>(16, N - n));
    for (int r = 0; r < valid; ++r) widen_codes(q + (n + r) * K, K, rows_bf16.data() + r * K);
    const uint16_t* s = scales + n;
    const uint16_t* b = bias ? bias + n : nullptr;
    for (int64_t v = 0; v < vectors;) {
      const int chunk = chunk_vectors(vectors - v);
      const uint32_t* xv = xp + v * pairs * 16;
      uint16_t* yv = y + v * 16 * ldy + n;
      const int64_t rows = M - v * 16;
      auto halves = [&](auto tile) {  // 8 code rows a tile
        tile(xv, pairs, w, 0, K, std::min(valid, 8), s, b, yv, ldy, rows);
        if (valid > 8) tile(xv, pairs, w + 8 * K, 0, K, valid - 8, s + 8, b ? b + 8 : nullptr, yv + 8, ldy, rows);
      };
      if (lines_collide(K)) {
        if (chunk == 1) halves(gemm_tile<1, 8, Epilogue::kPlain, true>);
        else if (chunk == 2) halves(gemm_tile<2, 8, Epilogue::kPlain, true>);
        else halves(gemm_tile<3, 8, Epilogue::kPlain, true>);
      } else if (chunk == 1) gemm_tile<1, 16, Epilogue::kPlain>(xv, pairs, w, 0, K, valid, s, b, yv, ldy, rows);
      else if (chunk == 2) halves(gemm_tile<2, 8, Epilogue::kPlain>);
      else halves(gemm_tile<3, 8, Epilogue::kPlain>);
      v += chunk;
    }
  }
}

// x packed once, output columns split across threads in tiles of `tile` columns.
template <typename Rows>
void gemm_columns(const at::Tensor& x, at::Tensor& out, int64_t tile, Rows&& rows) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  at::Tensor packed = at::empty({(M + 15) / 16 * 16 * K / 2}, x.options().dtype(at::kInt));
  auto* xp = reinterpret_cast<uint32_t*>(packed.data_ptr());
  pack_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, xp);
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t tiles = (N + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    rows(xp, yp, begin * tile, std::min(N, end * tile));
  });
}

// The one place the GEMM picks its tiles: AMX where the CPU has it and K fits its tiles
// (gemm_amx_cpu.cpp), else the AVX512-BF16 ones above, which stay the reference (`amx` false
// forces them, for the tests that hold the two equal).
inline bool take_amx(int64_t K, bool amx) { return amx && amx_usable(K); }

template <Epilogue E>
void gemm(const at::Tensor& x, const at::Tensor& weight, int64_t up_rows, const uint16_t* bias, at::Tensor& out,
          bool amx) {
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), ldy = out.stride(0);
  if (take_amx(K, amx)) {
    gemm_columns(x, out, kAmxColumns, [&](const uint32_t* xp, uint16_t* yp, int64_t begin, int64_t end) {
      amx_gemm_rows(E, xp, M, K, wp, up_rows, bias, yp, ldy, N, begin, end);
    });
    return;
  }
  gemm_columns(x, out, kTileRows, [&](const uint32_t* xp, uint16_t* yp, int64_t begin, int64_t end) {
    gemm_rows<E>(xp, M, K, wp, up_rows, bias, yp, ldy, N, begin, end);
  });
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

const uint16_t* check_bf16_output(const at::Tensor& out, int64_t M, int64_t N, const c10::optional<at::Tensor>& bias,
                                  int64_t bias_size) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16,
              "out must be [M, ", N, "] bf16, rows contiguous");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == bias_size && bias->is_contiguous() &&
                  bias->scalar_type() == at::kBFloat16,
              "bias must be [", bias_size, "] bf16");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr());
}

namespace {

// x [M, K] bf16 (K even, rows contiguous), a weight or codes [N, K] of `dtype`, contiguous.
void check_gemm_input(const char* op, const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype) {
  TORCH_CHECK(gemm_available(), op, ": built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16, rows contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == dtype && weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] ", dtype, " tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, op, " needs an even K (pairs of K per lane), got ", x.size(1));
}

}  // namespace

void bf16_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               bool amx) {
  check_gemm_input("bf16_gemm", x, weight, at::kBFloat16);
  const uint16_t* bp = check_bf16_output(out, x.size(0), weight.size(0), bias, weight.size(0));
#ifdef DABBA_HAVE_BF16_GEMM
  if (x.size(0) > 0 && weight.size(0) > 0) gemm<Epilogue::kPlain>(x, weight, 0, bp, out, amx);
#endif
}

namespace {

template <Epilogue E>
void bf16_gemm_gated(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     bool amx) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "weight must be [2 * d, K]: gate rows, then up rows");
  check_gemm_input("bf16_gemm", x, weight, at::kBFloat16);
  const uint16_t* bp = check_bf16_output(out, x.size(0), weight.size(0) / 2, bias, weight.size(0));
#ifdef DABBA_HAVE_BF16_GEMM
  if (x.size(0) > 0 && weight.size(0) > 0) gemm<E>(x, weight, weight.size(0) / 2, bp, out, amx);
#endif
}

}  // namespace

void bf16_gemm_silu_and_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, bool amx) {
  bf16_gemm_gated<Epilogue::kSilu>(out, x, weight, bias, amx);
}

void bf16_gemm_gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, bool amx) {
  bf16_gemm_gated<Epilogue::kGeluTanh>(out, x, weight, bias, amx);
}

void int8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
               const c10::optional<at::Tensor>& bias, bool amx) {
  check_gemm_input("int8_gemm", x, codes, at::kChar);
  const int64_t M = x.size(0), N = codes.size(0), K = x.size(1);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() && scales.scalar_type() == at::kBFloat16,
              "scales must be [N] bf16");
  const uint16_t* bp = check_bf16_output(out, M, N, bias, N);
#ifdef DABBA_HAVE_BF16_GEMM
  if (M == 0 || N == 0) return;
  const auto* qp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const int64_t ldy = out.stride(0);
  if (take_amx(K, amx)) {
    gemm_columns(x, out, kAmxColumns, [&](const uint32_t* xp, uint16_t* yp, int64_t begin, int64_t end) {
      amx_int8_gemm_rows(xp, M, K, qp, sp, bp, yp, ldy, N, begin, end);
    });
    return;
  }
  gemm_columns(x, out, kTileRows, [&](const uint32_t* xp, uint16_t* yp, int64_t begin, int64_t end) {
    int8_gemm_rows(xp, M, K, qp, sp, bp, yp, ldy, N, begin, end);
  });
#endif
}

int64_t gemv_max_rows(int64_t K) {
  if (amx_usable(K)) return kAmxGemvMaxRows;
  return std::clamp<int64_t>(kGemvMaxXBytes / (2 * std::max<int64_t>(K, 1)), 1, kGemvMaxRows);
}

bool integer_gemm_usable(int64_t K) {
#ifdef DABBA_HAVE_CODE_GEMM
  return !amx_usable(K);
#else
  return false;
#endif
}

namespace {

// Rows from which an INT8 linear with K inputs takes the GEMM rather than _weight_int8pack_mm:
// fewer where the GEMM has AMX tiles.
int64_t int8_gemm_min_rows(int64_t K) { return amx_usable(K) ? kAmxInt8GemmMinRows : kInt8GemmMinRows; }

// y [M, N] in x's dtype, filled by a GEMV `step` rows of x at a time.
template <typename Gemv>
at::Tensor gemv_passes(const at::Tensor& x, int64_t N, int64_t step, Gemv&& gemv) {
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t r = 0; r < x.size(0); r += step) {
    const int64_t rows = std::min(step, x.size(0) - r);
    gemv(y.narrow(0, r, rows), x.narrow(0, r, rows));
  }
  return y;
}

}  // namespace

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool bf16 = x.dim() == 2 && x.size(0) > 0 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                    weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                    (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()));
  // The avx2 build (no AVX512-BF16 GEMM) takes its own GEMM from kAvx2GemmMinRows rows and the GEMV
  // below, kGemvMaxRows rows a pass: F.linear has no bf16 instructions to use there. oneDNN held to
  // AVX2, 4 layers of Qwen2.5-1.5B: 99 ms at 9 rows against the passes' 44, 160 against 57 at 16,
  // 596 against 193 (the GEMM 152) at 64.
  if (bf16 && x.size(0) >= kAvx2GemmMinRows && avx2_gemm_available()) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    avx2_bf16_gemm(y, x, weight, bias);
    return y;
  }
  if (bf16 && gemv_available() && (x.size(0) <= gemv_max_rows(x.size(1)) || !gemm_available()))
    return gemv_passes(x, weight.size(0), kGemvMaxRows,
                       [&](at::Tensor y, const at::Tensor& rows) { bf16_gemv(y, rows, weight, bias); });
  if (bf16 && x.size(0) <= kGemmMaxRows && weight.size(1) % 2 == 0 && gemm_available()) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    bf16_gemm(y, x, weight, bias);
    return y;
  }
  return at::linear(x, weight, bias);
}

namespace {

// The gated MLP's merged projection and activation: fused into the GEMM where it runs (on AMX tiles
// the fused GEMM passes F.linear + the elementwise kernel at any row count, never writing the
// [M, 2d] projection out; the AVX512 tiles only up to kGemmMaxRows), else dense_linear + the kernel.
template <Epilogue E>
at::Tensor dense_linear_gated(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool gemm_rows = x.dim() == 2 && x.size(0) > gemv_max_rows(x.size(1)) &&
                         (x.size(0) <= kGemmMaxRows || amx_usable(x.size(1)));
  if (gemm_rows && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous() &&
      weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0 && weight.size(0) % 2 == 0 &&
      (!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous())) && gemm_available()) {
    at::Tensor y = at::empty({x.size(0), weight.size(0) / 2}, x.options());
    bf16_gemm_gated<E>(y, x, weight, bias, true);
    return y;
  }
  const at::Tensor gate_up = dense_linear(x, weight, bias);
  at::Tensor y = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if constexpr (E == Epilogue::kSilu) silu_and_mul(y, gate_up);
  else gelu_tanh_and_mul(y, gate_up);
  return y;
}

}  // namespace

at::Tensor dense_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias) {
  return dense_linear_gated<Epilogue::kSilu>(x, weight, bias);
}

at::Tensor dense_linear_gelu_tanh_and_mul(const at::Tensor& x, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias) {
  return dense_linear_gated<Epilogue::kGeluTanh>(x, weight, bias);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  const bool operands = x.dim() == 2 && x.size(0) > 0 && x.stride(1) == 1 &&
                        (dtype == at::kBFloat16 || dtype == at::kFloat) && codes.is_contiguous() &&
                        scales.scalar_type() == dtype && scales.is_contiguous() &&
                        (!bias.has_value() || (bias->scalar_type() == dtype && bias->is_contiguous()));
  // Without the GEMM, bf16 rows take the INT8 GEMV at any count, kInt8GemvMaxRows at a time, as
  // dense_linear the bf16 GEMV: against _weight_int8pack_mm held to AVX2, 22 ms at 9 rows against
  // 63, 33 against 72 at 16, 115 against 219 at 64 (4 layers of Qwen2.5-1.5B); one layer, 222
  // against 402 at 512 rows (dequantized codes through the bf16 passes: 375 and more). float32
  // rows keep _weight_int8pack_mm, then F.linear's float32 GEMM on dequantized codes.
  if (operands && int8_gemv_available() &&
      (x.size(0) <= kInt8GemvMaxRows || (dtype == at::kBFloat16 && !gemm_available())))
    return gemv_passes(x, codes.size(0), kInt8GemvMaxRows,
                       [&](at::Tensor y, const at::Tensor& rows) { int8_gemv(y, rows, codes, scales, bias); });
  if (operands && int8_integer_gemm_takes(x, codes)) return int8_integer_gemm(x, codes, scales, bias);
  // PyTorch's _weight_int8pack_mm (2.13, CPU) crashes when K is not a multiple of 32: never hand it one.
  const bool pack_mm_safe = x.size(-1) % 32 == 0;
  if (operands && dtype == at::kBFloat16 && (x.size(0) >= int8_gemm_min_rows(x.size(1)) || !pack_mm_safe) &&
      x.size(0) <= kGemmMaxRows && x.size(1) % 2 == 0 && gemm_available()) {
    at::Tensor y = at::empty({x.size(0), codes.size(0)}, x.options());
    int8_gemm(y, x, codes, scales, bias);
    return y;
  }
  if (x.size(0) >= kInt8DequantMinRows || !pack_mm_safe)  // a long prefill: dense_linear wins even after dequantizing
    return dense_linear(x, codes.to(dtype) * scales.unsqueeze(1), bias);
  const at::Tensor y = at::_weight_int8pack_mm(x, codes, scales);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::dense_linear));
  m.def("dense_linear_silu_and_mul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_linear_silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::dense_linear_silu_and_mul));
  m.def("dense_linear_gelu_tanh_and_mul(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("dense_linear_gelu_tanh_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::dense_linear_gelu_tanh_and_mul));
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::int8_linear));
  m.def("int8_gemm(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? bias, bool amx=True) -> ()");
  m.impl("int8_gemm", c10::DispatchKey::CPU, TORCH_FN(dabba::int8_gemm));
  m.def("gemm_available() -> bool", &dabba::gemm_available);
  m.def("amx_usable(int K) -> bool", &dabba::amx_usable);  // no tensor: a catch-all
  m.def("integer_gemm_usable(int K) -> bool", &dabba::integer_gemm_usable);
  m.def("gemv_max_rows(int K) -> int", &dabba::gemv_max_rows);
  m.def("bf16_gemm(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool amx=True) -> ()");
  m.impl("bf16_gemm", c10::DispatchKey::CPU, TORCH_FN(dabba::bf16_gemm));
  m.def("bf16_gemm_silu_and_mul(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool amx=True) -> ()");
  m.impl("bf16_gemm_silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::bf16_gemm_silu_and_mul));
  m.def("bf16_gemm_gelu_tanh_and_mul(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool amx=True) -> ()");
  m.impl("bf16_gemm_gelu_tanh_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::bf16_gemm_gelu_tanh_and_mul));
}

// x W^T + b for W held in GGUF's blocks (gguf_blocks.h), never expanded for decode: the memory,
// and the bytes a decode step reads, are the file's.
//
// A linear's weight is one or more segments of output rows, each of one GGUF type (a merged qkv
// whose v rows a Q4_K_M file keeps in Q6_K), in one byte buffer: `segments` [S, 3] int64 holds
// each segment's (type, rows, byte offset), in output order.
//
// Up to gguf_gemv_max_rows(K) rows (decode's few, and in the avx2 build batches of more) take the
// GEMV: x rounded to 8-bit codes, integer dot products with the blocks as they lie (gguf_dot.h), x's
// rows in passes of kGgufGemvPassRows that each thread's weight rows meet while they sit in L2.
//
// Beyond the GEMV's rows (prefills, batches) x is rounded to the same 8-bit codes, as llama.cpp's
// CPU backend rounds every batch. With AVX512-VNNI and no AMX tiles, the integer GEMM
// (gguf_gemm_cpu.cpp) multiplies them by the blocks' codes as the GEMV does; elsewhere they are
// given back as q * d, and each segment is dequantized to x's dtype some rows at a time and
// multiplied by dense_linear (AMX tiles where the CPU has them).
//
// The PyTorch reference (dabba/quantization/gguf.py: linear_reference, dequantize then F.linear
// beyond the GEMV where the GEMM is not in integers) is what tests hold this to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"
#include "gguf_blocks.h"
#include "gguf_dot.h"
#include "gguf_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dabba {
namespace {

using gguf::A8Rows;
using gguf::dot_any_row;
using gguf::is_float;
using gguf::is_k_quant;
using gguf::Type;

constexpr int64_t kGgufGemvGrainBytes = 64 * 1024;  // the least a thread takes of a GEMV's weight
// the weight rows a thread holds in L2 while every pass of x meets them (passes beyond the first)
constexpr int64_t kGgufGemvBlockBytes = 128 * 1024;

struct Segment {
  Type type;
  int64_t rows, offset, row_bytes, column;  // column: its first output
};

std::vector<Segment> check_segments(const at::Tensor& blob, const at::Tensor& segments, int64_t K) {
  TORCH_CHECK(blob.dim() == 1 && blob.is_contiguous() && blob.scalar_type() == at::kByte,
              "gguf_linear: the weight must be a contiguous 1-D uint8 buffer of GGUF blocks");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.size(0) >= 1 &&
                  segments.scalar_type() == at::kLong && segments.is_contiguous(),
              "gguf_linear: segments must be [S, 3] int64 (type, rows, byte offset)");
  std::vector<Segment> out;
  const int64_t* s = segments.data_ptr<int64_t>();
  int64_t column = 0;
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const gguf::TypeInfo* info = gguf::type_info(s[3 * i]);
    TORCH_CHECK(info != nullptr, "gguf_linear: GGUF type ", s[3 * i], " is not one the kernels take");
    TORCH_CHECK(K % info->block_values == 0, "gguf_linear: ", K, " inputs do not fill whole ", info->name, " blocks");
    const int64_t rows = s[3 * i + 1], offset = s[3 * i + 2], row_bytes = K / info->block_values * info->block_bytes;
    TORCH_CHECK(rows >= 1 && offset >= 0 && offset + rows * row_bytes <= blob.numel(),
                "gguf_linear: segment ", i, " lies outside the weight's bytes");
    TORCH_CHECK(out.empty() || offset >= out.back().offset + out.back().rows * out.back().row_bytes,
                "gguf_linear: segment ", i, " overlaps or precedes the one before it (the GEMV splits their bytes)");
    out.push_back(Segment{info->type, rows, offset, row_bytes, column});
    column += rows;
  }
  return out;
}

// out[m, col] for M rows' sums, rounded to x's dtype before a bias adds to it, as the reference's
// F.linear then + bias
template <int M, typename T>
inline void store_sums(const float (&acc)[M], const T* bias, int64_t col, T* y, int64_t ldy) {
  for (int m = 0; m < M; ++m) {
    const float v = bias ? to_float(from_float<T>(acc[m])) + to_float(bias[col]) : acc[m];
    y[m * ldy + col] = from_float<T>(v);
  }
}

gguf::A8Needs needs_of(const std::vector<Segment>& segments) {
  gguf::A8Needs needs;
  for (const Segment& seg : segments) {
    needs.k_quants |= is_k_quant(seg.type);
    needs.legacy |= !is_k_quant(seg.type) && !is_float(seg.type);
    needs.legacy_runs |= seg.type == gguf::kQ4_0x16 || seg.type == gguf::kQ5_0x16 || seg.type == gguf::kQ8_0x16;
    needs.k_runs |= seg.type == gguf::kQ4_Kx2 || seg.type == gguf::kQ5_Kx2;
    needs.q6_runs |= seg.type == gguf::kQ6_Kx1;
    needs.floats |= is_float(seg.type);
  }
  return needs;
}

// x [M, K] W^T through the GEMV's row kernels, x's rows in passes of kGgufGemvPassRows (each
// rounded once, into passes[p]). One parallel region for every segment, its range the blob's
// bytes: each thread takes the rows that start in its part, so threads read equal bytes whatever
// the mix of types (a region per segment cost a barrier each, and split a small Q6_K v among
// threads unevenly). A thread meets its rows kGgufGemvBlockBytes at a time with every pass, so
// that the weights come from memory once and from L2 for the passes after the first.
template <typename T>
void gemv_passes(const std::vector<A8Rows>& passes, int64_t M, const uint8_t* blob,
                 const std::vector<Segment>& segments, const T* bias, T* y, int64_t ldy) {
  const int64_t begin_byte = segments.front().offset;
  const int64_t end_byte = segments.back().offset + segments.back().rows * segments.back().row_bytes;
  const int64_t num_passes = (M + kGgufGemvPassRows - 1) / kGgufGemvPassRows;
  at::parallel_for(begin_byte, end_byte, kGgufGemvGrainBytes, [&](int64_t begin, int64_t end) {
    for (const Segment& seg : segments) {
      const int64_t seg_end = seg.offset + seg.rows * seg.row_bytes;
      if (seg_end <= begin || seg.offset >= end) continue;
      const int64_t first = std::max<int64_t>(0, (begin - seg.offset + seg.row_bytes - 1) / seg.row_bytes);
      const int64_t last = std::min(seg.rows, (end - seg.offset + seg.row_bytes - 1) / seg.row_bytes);
      const int64_t block = num_passes == 1 ? last - first : std::max<int64_t>(1, kGgufGemvBlockBytes / seg.row_bytes);
      for (int64_t n0 = first; n0 < last; n0 += block) {
        const int64_t n1 = std::min(last, n0 + block);
        for (int64_t p = 0; p < num_passes; ++p) {
          const int64_t r = p * kGgufGemvPassRows;
          with_count<kGgufGemvPassRows>(std::min<int64_t>(kGgufGemvPassRows, M - r), [&](auto count) {
            constexpr int R = decltype(count)::value;
            for (int64_t n = n0; n < n1; ++n) {
              float acc[R];
              dot_any_row<R>(seg.type, blob + seg.offset + n * seg.row_bytes, passes[p], acc);
              store_sums<R, T>(acc, bias, seg.column + n, y + r * ldy, ldy);
            }
          });
        }
      }
    }
  });
}

template <typename T>
void gemv(at::Tensor& out, const at::Tensor& x, const uint8_t* blob, const std::vector<Segment>& segments,
          const c10::optional<at::Tensor>& bias) {
  const std::vector<A8Rows>& passes = code_gemm::quantize_passes<T>(x, needs_of(segments));
  gemv_passes<T>(passes, x.size(0), blob, segments, bias.has_value() ? bias->data_ptr<T>() : nullptr,
                 out.data_ptr<T>(), out.stride(0));
}

// GGUF rows -> [rows, K] in dtype, rows in parallel
void dequantize_rows(at::Tensor& out, const uint8_t* raw, Type type, int64_t rows, int64_t K, int64_t row_bytes) {
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      gguf::dequantize_row(type, raw + n * row_bytes, K, row.data());
      if (bf16) {
        auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>() + n * K);
        for (int64_t k = 0; k < K; ++k) dst[k] = float_to_bf16_bits(row[k]);
      } else {
        std::memcpy(out.data_ptr<float>() + n * K, row.data(), K * sizeof(float));
      }
    }
  });
}

// out[:, seg's columns] = x W^T (+ bias) for one segment, its rows dequantized to x's dtype
// kGgufDequantChunkValues values at a time, each chunk through dense_linear
void dequantized_gemm(at::Tensor& out, const at::Tensor& x, const uint8_t* raw, const Segment& seg,
                      const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(1), chunk = std::max<int64_t>(16, kGgufDequantChunkValues / K);
  for (int64_t r = 0; r < seg.rows; r += chunk) {
    const int64_t rows = std::min(chunk, seg.rows - r);
    at::Tensor w = at::empty({rows, K}, x.options());
    dequantize_rows(w, raw + seg.offset + r * seg.row_bytes, seg.type, rows, K, seg.row_bytes);
    const c10::optional<at::Tensor> b =
        bias.has_value() ? c10::optional<at::Tensor>(bias->narrow(0, seg.column + r, rows)) : c10::nullopt;
    out.narrow(1, seg.column + r, rows).copy_(dense_linear(x, w, b));
  }
}

// A prefill or a batch on a CPU with AVX512-VNNI and no AMX tiles: each quantized segment through
// the integer GEMM (gguf_gemm.h), x rounded to the GEMV's codes once; a float segment through
// dense_linear on x as it is.
template <typename T>
void integer_gemm(at::Tensor& out, const at::Tensor& x, const uint8_t* blob, const std::vector<Segment>& segments,
                  const c10::optional<at::Tensor>& bias) {
  gguf::A8Needs needs;
  for (const Segment& seg : segments) {
    needs.k_quants |= is_k_quant(seg.type);
    needs.legacy |= !is_k_quant(seg.type) && !is_float(seg.type);
  }
  const std::vector<A8Rows>& passes = code_gemm::quantize_passes<T>(x, needs);
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  for (const Segment& seg : segments) {
    if (is_float(seg.type)) {
      dequantized_gemm(out, x, blob, seg, bias);
      continue;
    }
    const gguf::GemmSegment s{seg.type, seg.rows, blob + seg.offset, seg.row_bytes, seg.column};
    gguf::integer_gemm<T>(passes, x.size(0), x.size(1), s, b, out.data_ptr<T>(), out.stride(0));
  }
}

// x[0:n] as its codes give it back (code * d): gguf::round_block's codes and scale (the same
// products, rounded half to even), the scale held as float16 where ``half``, 8 lanes a step.
inline void round_run(const float* x, int64_t n, bool k_quants, float* out) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef DABBA_GGUF_SIMD
  __m256 vmax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0.f) {
    std::fill(out, out + n, 0.f);
    return;
  }
  float xm = amax;  // the first value of the largest magnitude, with its sign
  for (int64_t k = 0; k < n; ++k)
    if (std::fabs(x[k]) == amax) {
      xm = x[k];
      break;
    }
  const float scale = k_quants ? -127.f / xm : 127.f / amax;
  const float back = k_quants ? 1.f / scale : static_cast<float>(c10::Half(amax / 127.f));
  i = 0;
#ifdef DABBA_GGUF_SIMD
  const __m256 vscale = _mm256_set1_ps(scale), vback = _mm256_set1_ps(back);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; i + 8 <= n; i += 8) {
    __m256 q = _mm256_mul_ps(_mm256_loadu_ps(x + i), vscale);
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(q, vback));
  }
#endif
  for (; i < n; ++i) out[i] = std::max(-127.f, std::min(127.f, std::nearbyint(x[i] * scale))) * back;
}

// n rounded values into x's dtype: bfloat16 rounded to nearest even as from_float, 8 at a time
// (finite values, codes times their scale: no NaN to keep)
inline void store_rounded(const float* in, int64_t n, float* out) { std::memcpy(out, in, n * sizeof(float)); }
inline void store_rounded(const float* in, int64_t n, c10::BFloat16* out) {
  int64_t i = 0;
#ifdef DABBA_GGUF_SIMD
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(in + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
  }
#endif
  for (; i < n; ++i) out[i] = from_float<c10::BFloat16>(in[i]);
}

// x [M, K] as its 8-bit codes give it back, in x's dtype: q * d per block of 32 values with d held as
// float16 (the legacy types' activations, llama.cpp's Q8_0), or of 256 with a float32 d (the K
// types', Q8_K), rounded as quantize_rows rounds them for the GEMV. A block at a time through
// float32 on the stack, x read once and the result written once (a prefill's x is a step's tokens
// times the layer's width: float32 copies of it were the GEMM's largest scratch).
template <typename T>
at::Tensor rounded_activations(const at::Tensor& x, bool k_quants) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const int64_t block = k_quants ? gguf::kSuperBlock : gguf::kA8Block;
  at::Tensor out = at::empty({M, K}, x.options());
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    float xf[gguf::kSuperBlock], rounded[gguf::kSuperBlock];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t k0 = 0; k0 < K; k0 += block) {
        const int64_t n = std::min(block, K - k0);
        gguf::to_float_row(xp + m * ldx + k0, n, xf);
        round_run(xf, n, k_quants, rounded);
        store_rounded(rounded, n, op + m * K + k0);
      }
  });
  return out;
}

}  // namespace

at::Tensor gguf_dequantize(const at::Tensor& raw, int64_t type, int64_t K, c10::ScalarType dtype) {
  const gguf::TypeInfo* info = gguf::type_info(type);
  TORCH_CHECK(info != nullptr, "gguf_dequantize: GGUF type ", type, " is not one the kernels take");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gguf_dequantize: to bfloat16 or float32");
  TORCH_CHECK(K > 0 && K % info->block_values == 0, "gguf_dequantize: ", K, " values do not fill whole ", info->name,
              " blocks");
  const int64_t row_bytes = K / info->block_values * info->block_bytes;
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.size(1) == row_bytes,
              "gguf_dequantize: raw must be contiguous [rows, ", row_bytes, "] uint8");
  at::Tensor out = at::empty({raw.size(0), K}, raw.options().dtype(dtype));
  dequantize_rows(out, raw.data_ptr<uint8_t>(), info->type, raw.size(0), K, row_bytes);
  return out;
}

int64_t gguf_gemv_max_rows(int64_t K) { return amx_usable(K) ? kGgufGemvMaxRows : kGgufGemvMaxRowsNoAmx; }

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blob, const at::Tensor& segments,
                       const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.stride(1) == 1 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "gguf_linear: x must be [M, K] bfloat16 or float32, rows contiguous");
  const int64_t K = x.size(1);
  const std::vector<Segment> segs = check_segments(blob, segments, K);
  const int64_t N = segs.back().column + segs.back().rows;
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() && bias->scalar_type() == dtype,
                "gguf_linear: bias must be [N] in x's dtype");
  const uint8_t* raw = blob.data_ptr<uint8_t>();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) <= gguf_gemv_max_rows(K)) {
    if (dtype == at::kBFloat16) gemv<c10::BFloat16>(out, x, raw, segs, bias);
    else gemv<float>(out, x, raw, segs, bias);
    return out;
  }
  // a prefill or a batch: x rounded to the codes the GEMV multiplies (so that a row's result does not
  // depend on how many rows share the step)
  const at::Tensor xc = x.contiguous();
  if (integer_gemm_usable(K)) {
    if (dtype == at::kBFloat16) integer_gemm<c10::BFloat16>(out, xc, raw, segs, bias);
    else integer_gemm<float>(out, xc, raw, segs, bias);
    return out;
  }
  at::Tensor x_legacy, x_k;  // x as its per-32 and per-256 codes give it back, where a segment needs it
  for (const Segment& seg : segs) {
    const bool k = is_k_quant(seg.type);
    at::Tensor& rounded = k ? x_k : x_legacy;
    if (!is_float(seg.type) && !rounded.defined())
      rounded = dtype == at::kBFloat16 ? rounded_activations<c10::BFloat16>(xc, k) : rounded_activations<float>(xc, k);
    dequantized_gemm(out, is_float(seg.type) ? xc : rounded, raw, seg, bias);
  }
  return out;
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("gguf_dequantize(Tensor raw, int type, int K, ScalarType dtype) -> Tensor");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, TORCH_FN(dabba::gguf_dequantize));
  m.def("gguf_linear(Tensor x, Tensor blob, Tensor segments, Tensor? bias) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::gguf_linear));
  m.def("gguf_gemv_max_rows(int K) -> int", &dabba::gguf_gemv_max_rows);  // no tensor: a catch-all
}

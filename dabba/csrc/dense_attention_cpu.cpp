// Dense attention without a mask or a cache, for encoders: every query attends to every key of
// its own sequence (an image's patches in a vision tower, a window of them). Vision towers run
// thousands of keys at head dims of 72 or 80, where PyTorch's CPU flash attention leaves most of
// the bf16 dot-product peak unused (benchmarks/kernels.py: encoder_attention); these tiles keep
// both products on vdpbf16ps.
//
//   q    [batch, heads, queries, d]  bf16, any strides with d contiguous (SDPA's layout)
//   k, v [batch, heads, keys, d]
//   out  [batch, queries, heads, d]  bf16, d contiguous (what the output projection reads)
//
// Flash attention's order: for a block of queries, keys a block at a time, scores S = q k^T in
// float32, an online softmax (running max and sum per query, earlier sums rescaled), then
// O += P V with P rounded to bf16 as PyTorch's flash kernel rounds it. K is packed per (batch,
// head) into pairs of d for 16 keys (a vector of keys' partial dot products per broadcast pair of
// q), V into pairs of keys for each of d's lanes (a vector of output lanes per broadcast pair of
// P); padding is zeros, and padded keys' scores are masked out of the softmax.
#include "cpu_ops.h"

#include "bf16_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMM

namespace {

constexpr int64_t kQueryBlock = 48;  // queries a work item takes (whole score and value tiles)
constexpr int64_t kKeyBlock = 256;   // keys per softmax step
constexpr int kRows = 6;             // queries a scores tile holds in registers
constexpr int64_t kMaxHeadDim = 256;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One (batch, head)'s K as [keys / 16][pairs][16] and V as [keys / 2][dv] 32-bit pairs.
struct Packed {
  std::vector<uint32_t> k, v;
};

void pack_keys_values(const uint16_t* kp, int64_t k_row, const uint16_t* vp, int64_t v_row, int64_t keys, int64_t d,
                      int64_t padded_keys, int64_t pairs, int64_t dv, Packed& out) {
  out.k.assign(padded_keys * pairs, 0);
  out.v.assign(padded_keys / 2 * dv, 0);
  auto* k16 = reinterpret_cast<uint16_t*>(out.k.data());
  for (int64_t key = 0; key < keys; ++key) {
    const uint16_t* row = kp + key * k_row;
    uint16_t* block = k16 + (key / 16) * pairs * 32 + (key % 16) * 2;
    for (int64_t j = 0; j < d; ++j) block[(j / 2) * 32 + (j % 2)] = row[j];
  }
  auto* v16 = reinterpret_cast<uint16_t*>(out.v.data());
  for (int64_t key = 0; key < keys; ++key) {
    const uint16_t* row = vp + key * v_row;
    uint16_t* pair = v16 + (key / 2) * dv * 2 + (key % 2);
    for (int64_t j = 0; j < d; ++j) pair[j * 2] = row[j];
  }
}

// Scores of kRows queries (q: their pairs, a row every `pairs`) against NC * 16 keys.
template <int NC>
inline void score_tile(const uint32_t* q, int64_t pairs, const uint32_t* k, float* s, int64_t lds) {
  __m512 acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + (c * pairs + j) * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * pairs + j]));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(s + r * lds + c * 16, acc[r][c]);
}

// o[R rows][NV * 16] += P (pairs of keys, a row every ldp) V (a key pair's dv lanes every dv).
template <int R, int NV>
inline void value_tile(const uint32_t* p, int64_t ldp, int64_t key_pairs, const uint32_t* v, int64_t dv, float* o,
                       int64_t ldo) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * ldo + c * 16);
  for (int64_t j = 0; j < key_pairs; ++j) {
    __m512bh vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + j * dv + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * ldp + j]));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * ldo + c * 16, acc[r][c]);
}

// exp(x) for x <= 0 in 16 lanes: 2^n e^r, n = round(x / ln2), |r| <= ln2 / 2, e^r by its
// degree-5 Taylor polynomial (relative error below 3e-6, far under the bf16 rounding the
// probabilities take), 2^n applied by scalef.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 120.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 lanes_left(int64_t left) {
  return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
}

// One query's online softmax step over `keys` scores: the probabilities to bf16 into p (zero up
// to the next pair), the running max and sum updated; returns the factor the query's earlier
// output sums take.
float softmax_step(const float* s, int64_t keys, float scale, float& max, float& sum, uint16_t* p) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest;
  for (int64_t i = 0; i < keys; i += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(lowest, lanes_left(keys - i), s + i));
  const float new_max = std::max(max, _mm512_reduce_max_ps(top) * scale);
  const float rescale = max == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(max - new_max);
  const __m512 scale16 = _mm512_set1_ps(scale), max16 = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < keys; i += 16) {
    const __mmask16 m = lanes_left(keys - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + i), scale16, max16)));
    total = _mm512_add_ps(total, e);
    _mm256_mask_storeu_epi16(p + i, m, (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (keys % 2) p[keys] = 0;
  max = new_max;
  sum = sum * rescale + _mm512_reduce_add_ps(total);
  return rescale;
}

template <int NV>
void attend_block(const uint32_t* q, int64_t rows, int64_t pairs, const Packed& kv, int64_t keys, int64_t dv,
                  float scale, float* o, float* s, uint16_t* p) {
  // q: kQueryBlock rows of pairs (rows past `rows` zero); o: [kQueryBlock][dv] float32 sums
  static_assert(kQueryBlock % kRows == 0 && kQueryBlock % 4 == 0, "whole tiles in a block");
  constexpr int kValueRows = NV <= 6 ? 4 : NV <= 12 ? 2 : 1;
  float max[kQueryBlock], sum[kQueryBlock];
  std::fill(max, max + kQueryBlock, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + kQueryBlock, 0.f);
  std::fill(o, o + kQueryBlock * dv, 0.f);
  const int64_t tiles = round_up(rows, kRows);
  for (int64_t k0 = 0; k0 < keys; k0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, keys - k0), n16 = round_up(n, 16), n2 = round_up(n, 2);
    const uint32_t* kb = kv.k.data() + k0 * pairs;  // k0 is a multiple of 16
    for (int64_t r = 0; r < tiles; r += kRows)
      for (int64_t c = 0; c < n16; c += 64) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (n16 - c) / 16));
        with_count<4>(nc, [&](auto NC) {
          score_tile<NC>(q + r * pairs, pairs, kb + c * pairs, s + r * kKeyBlock + c, kKeyBlock);
        });
      }
    for (int64_t r = 0; r < rows; ++r) {
      const float rescale = softmax_step(s + r * kKeyBlock, n, scale, max[r], sum[r], p + r * kKeyBlock);
      if (rescale != 1.f)
        for (int64_t j = 0; j < dv; ++j) o[r * dv + j] *= rescale;
    }
    for (int64_t r = rows; r < kQueryBlock; ++r) std::fill(p + r * kKeyBlock, p + r * kKeyBlock + n2, 0);
    const auto* pp = reinterpret_cast<const uint32_t*>(p);
    const uint32_t* vb = kv.v.data() + k0 / 2 * dv;
    for (int64_t r = 0; r < rows; r += kValueRows)
      value_tile<kValueRows, NV>(pp + r * kKeyBlock / 2, kKeyBlock / 2, n2 / 2, vb, dv, o + r * dv, dv);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / sum[r];
    for (int64_t j = 0; j < dv; ++j) o[r * dv + j] *= inv;
  }
}

}  // namespace

#endif  // DABBA_HAVE_BF16_GEMM

bool dense_attention_available() {
#ifdef DABBA_HAVE_BF16_GEMM
  return true;
#else
  return false;
#endif
}

void dense_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(dense_attention_available(), "dense_attention: built without AVX512-BF16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [batch, heads, tokens, head_dim]");
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), d = q.size(3), keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(1) == heads && v.size(1) == heads &&
                  v.size(2) == keys && k.size(3) == d && v.size(3) == d,
              "q, k, v shapes disagree");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "dense_attention takes bf16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(d >= 1 && d <= 256, "head_dim must be 1..256, got ", d);
  TORCH_CHECK(keys >= 1, "no keys");
  TORCH_CHECK(out.dim() == 4 && out.size(0) == batch && out.size(1) == queries && out.size(2) == heads &&
                  out.size(3) == d && out.stride(3) == 1,
              "out must be [batch, queries, heads, head_dim], head_dim contiguous");
#ifdef DABBA_HAVE_BF16_GEMM
  if (batch == 0 || heads == 0 || queries == 0) return;
  const int64_t pairs = round_up(d, 2) / 2, dv = round_up(d, 16), padded_keys = round_up(keys, 16);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<Packed> packed(batch * heads);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      pack_keys_values(kp + b * k.stride(0) + h * k.stride(1), k.stride(2), vp + b * v.stride(0) + h * v.stride(1),
                       v.stride(2), keys, d, padded_keys, pairs, dv, packed[bh]);
    }
  });
  const int64_t blocks = (queries + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> qbuf(kQueryBlock * pairs);
    std::vector<float> obuf(kQueryBlock * dv), sbuf(kQueryBlock * kKeyBlock);
    std::vector<uint16_t> pbuf(kQueryBlock * kKeyBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / blocks, q0 = item % blocks * kQueryBlock, b = bh / heads, h = bh % heads;
      const int64_t rows = std::min(kQueryBlock, queries - q0);
      std::fill(qbuf.begin(), qbuf.end(), 0u);
      auto* q16 = reinterpret_cast<uint16_t*>(qbuf.data());
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(q16 + r * pairs * 2, qp + b * q.stride(0) + h * q.stride(1) + (q0 + r) * q.stride(2), d * 2);
      with_count<kMaxHeadDim / 16>(dv / 16, [&](auto NV) {
        attend_block<NV>(qbuf.data(), rows, pairs, packed[bh], keys, dv, static_cast<float>(scale), obuf.data(),
                         sbuf.data(), pbuf.data());
      });
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* dst = op + b * out.stride(0) + (q0 + r) * out.stride(1) + h * out.stride(2);
        for (int64_t j = 0; j < d; ++j) dst[j] = float_to_bf16_bits(obuf[r * dv + j]);
      }
    }
  });
#endif
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("dense_attention_available() -> bool", &dabba::dense_attention_available);
  m.def("dense_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
  m.impl("dense_attention", c10::DispatchKey::CPU, TORCH_FN(dabba::dense_attention));
}

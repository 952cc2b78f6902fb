// Attention over the paged KV cache on the CPU, for decodes (paged_decode_attention) and for a
// step's prompt chunks and decodes together (paged_attention), reading K and V straight from
// their blocks (the reference backend gathers blocks into a padded copy, then reads it twice).
//
// Layout (the CPU backend's own, see dabba/attention/cpu.py); for decodes:
//   q            [num_seqs, num_heads, head_dim]
//   key_cache    [num_kv_heads, num_blocks, head_dim, block_size]   keys transposed within a block
//   value_cache  [num_kv_heads, num_blocks, block_size, head_dim]
//   block_table  [num_seqs, max_blocks] int64
//   seq_lens     [num_seqs] int64: context length, including the token being decoded
//   out          [num_seqs, num_heads, head_dim]
// Query head h uses kv head h / (num_heads / num_kv_heads) (grouped-query attention).
// paged_attention takes q/out per token [num_tokens, ...] and query_start_loc [num_seqs + 1].
// sliding_window W > 0: a query at position p attends only keys at positions p - W + 1 .. p (W keys,
// its own included; transformers' sliding_window_overlay: kv_idx > q_idx - W); the blocks wholly
// before that are never read. 0 or negative: no window.
// softcap c > 0 (Gemma 2): each score (q . k * scale) becomes c * tanh(score / c) before the mask and
// softmax, as transformers' eager attention does; 0 or negative: none.
//
// An 8-bit cache (dabba/attention/kv_quant.py) has the same layout, its elements int8 or
// float8_e4m3fn codes (the tensors' dtype says which), plus a float32 scale per token and kv head:
//   key_scales, value_scales  [num_kv_heads, num_blocks, block_size]   a block's 16 scales: 64 bytes
// x ~ code * scale. The kernels read the codes in place, widened to float32 16 at a time: a key's
// scale multiplies its score (q . codes), a value's is folded into its probability, so the value
// pass sums p * scale * codes. write_kv_cache quantizes as KVQuant.quantize does, bit for bit.
//
// With keys transposed, the scores of one query against a block's 16 keys are 16 lanes of one
// vector, accumulated over head_dim with broadcast FMAs: no horizontal sums. Values keep rows
// contiguous, so out += p * v_t runs along head_dim. Everything accumulates in float32.
// The vector path needs block_size == 16 and head_dim % 16 == 0; other shapes take scalar loops.
//
// AMX: with bf16 q and cache, where the CPU and OS have AMX tiles and head_dim is a multiple of 32,
// a request's tiles (up to 32 query rows: 32 / G tokens) run both passes on them (amx_block_scores,
// amx_weighted_values): S = Q K^T and O = P V by TDPBF16PS, from the same bf16 operands as the
// AVX512-BF16 passes (q, keys, probabilities rounded to bf16) into float32 sums, with the same
// softmax_rows between. Only the order of the float32 additions differs, so the outputs agree
// with those passes to float32 summation (tests/attention/test_attention_amx.py), not bit for
// bit. attention_on_amx picks the path, per request (thresholds in cpu_ops.h); the op's amx=false
// keeps the AVX512-BF16 passes, the reference and the path everywhere else.
// Measured on the 2-core Xeon with AMX (2.6 GHz, 2 MiB L2 a core) while other jobs loaded it,
// SmolLM2-135M's shape (9 query heads, 3 kv heads, head_dim 64), one prompt, one layer, AMX against
// the AVX512-BF16 passes: python -m benchmarks.kernels --layers 4 --repeats 3 --linear-rows 4096
// --prefill-rows 32 --decode-seqs 4 --decode-context 64 --prompt-lens 512,2048 (attention.prompt,
// both threads, wall time): 2048 tokens 10.0 ms against 28.7 (485 against 168 GFLOP/s of QK^T and
// PV; at load average 5, 31 against 97), 512 tokens 0.92 against 2.0. One thread, CPU time: 2048
// tokens 17-20 ms against 57; head_dim 128 33 against 113; 14 query heads on 2 kv heads
// (Qwen2.5-0.5B) 27 against 89. What is left: softmax_rows is about 40% of the AMX path's time
// (its exp), interleaving key blocks into pairs for the B tiles (once per tile, not per row) 18%.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "bf16_tiles.h"
#include "cpu_math.h"
#include "cpu_ops.h"
#include "vec16.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dabba {

#if defined(__AVX512F__)
// int8 codes: sign-extended and converted (vpmovsxbd + vcvtdq2ps; GCC 12 scalarises the same
// written as __builtin_convertvector).
template <>
inline vfloat load16_as_float<int8_t>(const int8_t* p) {
  const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// float8_e4m3fn codes (s eeee mmm, exponent bias 7) through float16 (s eeeee mmmmmmmmmm, bias 15):
// the byte sign-extended to 16 bits and shifted left by 7 puts s at bit 15, eeee at bits 13..10 and
// mmm at the top of the mantissa, with a copy of s at bit 14, which is cleared. That float16 is the
// code's value times 2^-8, subnormals included (vcvtph2ps converts them exactly); times 2^8 is
// the value. No NaN: KVQuant.quantize never writes one for finite inputs.
template <>
inline vfloat load16_as_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(-16385));
  const __m512 wide = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
#endif

// Pull a whole block into cache ahead of use: blocks sit at scattered addresses, which the
// hardware prefetcher cannot guess.
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

constexpr int kMaxTileRows = 16;  // query rows attended together: group_attention's largest group
constexpr int kAmxTileRows = 32;  // on AMX tiles: two A tiles' rows (amx_block_scores)

struct Shape {
  int64_t num_heads, head_dim, num_kv_heads, num_blocks, block_size, group, max_blocks;
};

// One layer's cache as the kernels read it: elements of cache_t, the model's dtype or 8-bit codes
// (int8_t, c10::Float8_e4m3fn) with a float32 scale per token, [num_kv_heads, num_blocks,
// block_size]; k_scales and v_scales null for a full-precision cache.
template <typename cache_t>
struct PagedKV {
  const cache_t* k;
  const cache_t* v;
  const float* k_scales;
  const float* v_scales;
};

// Block `block` of kv head kvh in a [num_kv_heads, num_blocks, block_size] scales tensor.
inline const float* block_scales(const Shape& sh, const float* scales, int64_t kvh, int64_t block) {
  return scales + (kvh * sh.num_blocks + block) * sh.block_size;
}

// scores[g * padded_len + t] = q_g . k_t for t < seq_len (q already scaled), times k_t's scale
// where the keys are 8-bit codes (k_scales non-null).
template <typename cache_t>
void block_scores(const Shape& sh, const float* qf, const cache_t* k_ptr, const float* k_scales,
                  const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len, float* scores) {
  const int64_t num_seq_blocks = (seq_len + sh.block_size - 1) / sh.block_size;
  const bool vector_path = sh.block_size == kLanes;
  const int64_t block_elems = sh.head_dim * sh.block_size;
  for (int64_t j = 0; j < num_seq_blocks; ++j) {
    const cache_t* kb = k_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems;
    const float* ks = k_scales ? block_scales(sh, k_scales, kvh, blocks[j]) : nullptr;
    if (j + 1 < num_seq_blocks)
      prefetch_block(k_ptr + (kvh * sh.num_blocks + blocks[j + 1]) * block_elems, block_elems * sizeof(cache_t));
    for (int64_t g = 0; g < sh.group; ++g) {
      const float* qg = qf + g * sh.head_dim;
      float* dst = scores + g * padded_len + j * sh.block_size;
      if (vector_path) {
        vfloat acc = {};
        for (int64_t d = 0; d < sh.head_dim; ++d) acc += qg[d] * load16_as_float(kb + d * kLanes);
        store16(dst, ks ? acc * load16(ks) : acc);
      } else {
        for (int64_t t = 0; t < sh.block_size; ++t) dst[t] = 0.f;
        for (int64_t d = 0; d < sh.head_dim; ++d)
          for (int64_t t = 0; t < sh.block_size; ++t) dst[t] += qg[d] * static_cast<float>(kb[d * sh.block_size + t]);
        if (ks)
          for (int64_t t = 0; t < sh.block_size; ++t) dst[t] *= ks[t];
      }
    }
  }
}

// out_g = sum_t p[g, t] * v_t, one query head at a time, NC 16-float chunks of head_dim kept in
// registers (NC = head_dim / 16, a template parameter so the accumulators are not spilled).
template <typename scalar_t, int NC>
void weighted_values(const Shape& sh, const float* probs, const scalar_t* v_ptr, const int64_t* blocks,
                     int64_t kvh, int64_t seq_len, int64_t padded_len, float* out) {
  for (int64_t g = 0; g < sh.group; ++g) {
    const float* pg = probs + g * padded_len;
    vfloat acc[NC] = {};
    const int64_t block_elems = sh.block_size * sh.head_dim;
    for (int64_t t = 0; t < seq_len; ++t) {
      const int64_t block = blocks[t / sh.block_size];
      const scalar_t* v_row = v_ptr + ((kvh * sh.num_blocks + block) * sh.block_size + t % sh.block_size) * sh.head_dim;
      if (t % sh.block_size == 0 && t + sh.block_size < seq_len)
        prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[t / sh.block_size + 1]) * block_elems,
                       block_elems * sizeof(scalar_t));
      const float p = pg[t];
      for (int c = 0; c < NC; ++c) acc[c] += p * load16_as_float(v_row + c * kLanes);
    }
    for (int c = 0; c < NC; ++c) store16(out + g * sh.head_dim + c * kLanes, acc[c]);
  }
}

// The same two passes with the G query heads of a kv head together (G a template parameter, so
// the accumulators stay in registers): each key and value is loaded and widened once for the
// whole group instead of once per head. Additions happen in the same order as above, so the
// results are identical. Needs block_size == 16 and head_dim % 16 == 0.
template <typename cache_t, int G>
void group_block_scores(const Shape& sh, const float* qf, const PagedKV<cache_t>& kv, const int64_t* blocks,
                        int64_t kvh, int64_t seq_len, int64_t padded_len, float* scores) {
  constexpr bool codes = sizeof(cache_t) == 1;
  const int64_t num_seq_blocks = (seq_len + kLanes - 1) / kLanes;
  const int64_t block_elems = sh.head_dim * kLanes;
  for (int64_t j = 0; j < num_seq_blocks; ++j) {
    const cache_t* kb = kv.k + (kvh * sh.num_blocks + blocks[j]) * block_elems;
    if constexpr (codes) {  // as the bf16 pass below: keys two blocks ahead, this block's values, and their scales
      if (j + 2 < num_seq_blocks) {
        prefetch_block(kv.k + (kvh * sh.num_blocks + blocks[j + 2]) * block_elems, block_elems);
        __builtin_prefetch(block_scales(sh, kv.k_scales, kvh, blocks[j + 2]));
      }
      prefetch_block(kv.v + (kvh * sh.num_blocks + blocks[j]) * block_elems, block_elems);
      __builtin_prefetch(block_scales(sh, kv.v_scales, kvh, blocks[j]));
    } else if (j + 1 < num_seq_blocks) {
      prefetch_block(kv.k + (kvh * sh.num_blocks + blocks[j + 1]) * block_elems, block_elems * sizeof(cache_t));
    }
    vfloat acc[G] = {};
    for (int64_t d = 0; d < sh.head_dim; ++d) {
      const vfloat k = load16_as_float(kb + d * kLanes);
      for (int g = 0; g < G; ++g) acc[g] += qf[g * sh.head_dim + d] * k;
    }
    if (kv.k_scales) {
      const vfloat ks = load16(block_scales(sh, kv.k_scales, kvh, blocks[j]));
      for (int g = 0; g < G; ++g) acc[g] *= ks;
    }
    for (int g = 0; g < G; ++g) store16(scores + g * padded_len + j * kLanes, acc[g]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// vpermw indices taking two 16-element bf16 rows a | b to the pairs (a0, b0), (a1, b1), ...
alignas(64) constexpr uint16_t kPairInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// bf16 keys: q . k by vdpbf16ps, two dimensions per instruction with products exact in float32,
// instead of widening every key to float32 first: half the instructions of the pass. A block's
// rows d and d + 1 (16 keys each, adjacent in the transposed layout) load as one vector and are
// interleaved into (d, d+1) pairs per key; the scale is applied to the float32 sums.
// The pass is bound by memory latency, not bandwidth (blocks are 2 KB apiece, scattered): it
// prefetches the keys two blocks ahead and the values of the block it reads, for the value pass
// that follows. Decode attention, SmolLM's shape, 64 sequences x 300 positions: 21.5 -> 16.3 ms
// per step (20.5 -> 27 GB/s of KV).
template <int G>
void group_block_scores_bf16(const Shape& sh, const uint16_t* q, float scale, const uint16_t* k_ptr,
                             const uint16_t* v_ptr, const int64_t* blocks, int64_t kvh, int64_t seq_len,
                             int64_t padded_len, float* scores) {
  const __m512i pairs = _mm512_load_si512(kPairInterleave);
  const int64_t num_seq_blocks = (seq_len + kLanes - 1) / kLanes;
  const int64_t block_elems = sh.head_dim * kLanes;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < num_seq_blocks; ++j) {
    const uint16_t* kb = k_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems;
    if (j + 2 < num_seq_blocks)
      prefetch_block(k_ptr + (kvh * sh.num_blocks + blocks[j + 2]) * block_elems, block_elems * sizeof(uint16_t));
    prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems, block_elems * sizeof(uint16_t));
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < sh.head_dim; d += 2) {
      const __m512bh k = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(kb + d * kLanes));
      for (int g = 0; g < G; ++g) {
        int32_t q_pair;
        std::memcpy(&q_pair, q + g * sh.head_dim + d, sizeof(q_pair));
        acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(q_pair), k);
      }
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * padded_len + j * kLanes, _mm512_mul_ps(acc[g], vscale));
  }
}

// vpermt2w indices taking two 32-element bf16 rows a, b to the pairs (a_i, b_i): i < 16, then i >= 16.
alignas(64) constexpr uint16_t kPairLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// bf16 values: out_g = sum_t p[g, t] v_t by vdpbf16ps, two keys' values per instruction, with the
// probabilities rounded to bf16 (as flash attention's P @ V does) and float32 sums. Rows t and
// t + 1 are interleaved into (v_t[i], v_t+1[i]) pairs; a pair never straddles a block (16 is
// even), and an odd last key pairs with itself at probability 0. With few rows (G <= 8) a pass
// covers 32 dimensions: one 64-byte load per row and two vpermt2w for both halves; more rows
// keep their accumulators for 16 dimensions at a time.
template <int G>
void group_weighted_values_bf16(const Shape& sh, const float* probs, const uint16_t* v_ptr, const int64_t* blocks,
                                int64_t kvh, int64_t seq_len, int64_t padded_len, float* out) {
  const int64_t num_pairs = (seq_len + 1) / 2, row = 2 * num_pairs;
  // The probabilities as bf16, row g at g * row: (p[t], p[t + 1]) is one 32-bit word. Converted
  // 16 at a time (vcvtneps2bf16 rounds to nearest even, as float_to_bf16_bits).
  thread_local std::vector<uint16_t> p16;
  p16.resize(G * row);
  for (int g = 0; g < G; ++g) {
    const float* pg = probs + g * padded_len;
    uint16_t* dst = p16.data() + g * row;
    int64_t t = 0;
    for (; t + 16 <= seq_len; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pg + t)));
    for (; t < row; ++t) dst[t] = t < seq_len ? float_to_bf16_bits(pg[t]) : 0;
  }
  typedef int32_t __attribute__((may_alias)) word_t;
  const word_t* const pw = reinterpret_cast<const word_t*>(p16.data());  // row g's pairs at g * num_pairs
#define p_pair(g, i) ((__m512bh)_mm512_set1_epi32(pw[(g) * num_pairs + (i)]))
  const int64_t block_elems = kLanes * sh.head_dim;
  int64_t c = 0;  // the first dimension not yet done
  if constexpr (G <= 8) {
    const __m512i lo_idx = _mm512_load_si512(kPairLo), hi_idx = _mm512_load_si512(kPairHi);
    for (; c + 2 * kLanes <= sh.head_dim; c += 2 * kLanes) {
      __m512 lo[G], hi[G];
      for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
      for (int64_t j = 0; j * kLanes < seq_len; ++j) {  // block by block: the addresses step by rows
        const uint16_t* block = v_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems + c;
        if (c == 0 && (j + 1) * kLanes < seq_len)  // (from L2, where the scores pass brought it, into L1)
          prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[j + 1]) * block_elems, block_elems * sizeof(uint16_t));
        const int64_t rows = std::min<int64_t>(kLanes, seq_len - j * kLanes);
        for (int64_t r = 0; r < rows; r += 2) {
          const int64_t i = (j * kLanes + r) / 2;
          const __m512i a = _mm512_loadu_si512(block + r * sh.head_dim);
          const __m512i b = _mm512_loadu_si512(block + (r + 1 < rows ? r + 1 : r) * sh.head_dim);
          const __m512bh vlo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
          const __m512bh vhi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
          for (int g = 0; g < G; ++g) {
            const __m512bh p = p_pair(g, i);
            lo[g] = _mm512_dpbf16_ps(lo[g], p, vlo);
            hi[g] = _mm512_dpbf16_ps(hi[g], p, vhi);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(out + g * sh.head_dim + c, lo[g]);
        _mm512_storeu_ps(out + g * sh.head_dim + c + kLanes, hi[g]);
      }
    }
  }
  const __m512i pairs = _mm512_load_si512(kPairInterleave);
  for (; c < sh.head_dim; c += kLanes) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < num_pairs; ++i) {
      const int64_t t = 2 * i, t1 = t + 1 < seq_len ? t + 1 : t;
      const uint16_t* block = v_ptr + (kvh * sh.num_blocks + blocks[t / kLanes]) * block_elems;
      if (c == 0 && t % kLanes == 0 && t + kLanes < seq_len)
        prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[t / kLanes + 1]) * block_elems,
                       block_elems * sizeof(uint16_t));
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (t % kLanes) * sh.head_dim + c));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (t1 % kLanes) * sh.head_dim + c));
      const __m512bh v = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], p_pair(g, i), v);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + g * sh.head_dim + c, acc[g]);
  }
#undef p_pair
}
#endif

// Dimensions c .. c + 16 * NC of out_g = sum_t p[g, t] v_t for the G rows, in G x NC accumulators.
template <typename cache_t, int G, int NC>
void group_weighted_values_chunks(const Shape& sh, const float* probs, const cache_t* v_ptr, const int64_t* blocks,
                                  int64_t kvh, int64_t seq_len, int64_t padded_len, int64_t c, float* out) {
  const int64_t block_elems = kLanes * sh.head_dim;
  vfloat acc[G][NC] = {};
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t block = blocks[t / kLanes];
    const cache_t* v_row = v_ptr + ((kvh * sh.num_blocks + block) * kLanes + t % kLanes) * sh.head_dim + c;
    if (c == 0 && t % kLanes == 0 && t + kLanes < seq_len)
      prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[t / kLanes + 1]) * block_elems,
                     block_elems * sizeof(cache_t));
    vfloat v[NC];
    for (int i = 0; i < NC; ++i) v[i] = load16_as_float(v_row + i * kLanes);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NC; ++i) acc[g][i] += probs[g * padded_len + t] * v[i];
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NC; ++i) store16(out + g * sh.head_dim + c + i * kLanes, acc[g][i]);
}

// Over head_dim 16 dimensions at a time (the rows stay in L1/L2), or 32 with few rows (G <= 8),
// whose accumulators alone would be too few independent FMA chains to keep both FMA ports busy
// (8-bit values at G = 6: about a fifth less time in this pass). Each output is the same sum in
// the same order either way.
template <typename cache_t, int G>
void group_weighted_values(const Shape& sh, const float* probs, const cache_t* v_ptr, const int64_t* blocks,
                           int64_t kvh, int64_t seq_len, int64_t padded_len, float* out) {
  int64_t c = 0;
  if constexpr (G <= 8)
    for (; c + 2 * kLanes <= sh.head_dim; c += 2 * kLanes)
      group_weighted_values_chunks<cache_t, G, 2>(sh, probs, v_ptr, blocks, kvh, seq_len, padded_len, c, out);
  for (; c < sh.head_dim; c += kLanes)
    group_weighted_values_chunks<cache_t, G, 1>(sh, probs, v_ptr, blocks, kvh, seq_len, padded_len, c, out);
}

// The softmax in 16 float32 lanes a vector, where GCC would otherwise prefer 8 (-march=native on
// AVX-512 parts): its exp is most of a long prompt's softmax, and the softmax a third of the
// attention on AMX tiles. The same elementwise steps, so the same results.
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=512")

// In place: s[0..n) <- softmax(s[0..n)). The max and the sum run in 16 lanes: a float reduction
// written as one scalar loop is not vectorised without -ffast-math, and neither is any loop it
// shares (the exp, the costliest part, is a map loop of its own here).
inline void softmax_inplace(float* s, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  float max_score = s[0];
  if (full) {
    vfloat vmax = load16(s);
    for (int64_t t = kLanes; t < full; t += kLanes) {
      const vfloat x = load16(s + t);
      vmax = vmax > x ? vmax : x;
    }
    for (int64_t i = 0; i < kLanes; ++i) max_score = std::max(max_score, vmax[i]);
  }
  for (int64_t t = full; t < n; ++t) max_score = std::max(max_score, s[t]);
#pragma GCC ivdep
  for (int64_t t = 0; t < n; ++t) s[t] = exp_nonpositive(s[t] - max_score);
  vfloat vsum = {};
  for (int64_t t = 0; t < full; t += kLanes) vsum += load16(s + t);
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += vsum[i];
  for (int64_t t = full; t < n; ++t) sum += s[t];
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// In place: s[0..n) <- cap * tanh(s[0..n) / cap), the soft cap (libm's tanh: exact to float32's
// rounding, where a cheaper form loses absolute accuracy near 0).
inline void softcap_inplace(float* s, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// Each row's softmax over its own range [row_starts[r], row_lens[r]) (row_starts null: from 0),
// its scores soft-capped first where softcap > 0; the positions outside it (later tokens of a
// prefill tile, keys that slid out of a row's window) get probability 0, so the value pass can
// run every row over the tile's whole range.
inline void softmax_rows(float* scores, int64_t rows, int64_t padded_len, int64_t seq_len, const int64_t* row_lens,
                         const int64_t* row_starts, float softcap) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * padded_len;
    const int64_t start = row_starts == nullptr ? 0 : row_starts[r];
    if (softcap > 0.f) softcap_inplace(s + start, row_lens[r] - start, softcap);
    softmax_inplace(s + start, row_lens[r] - start);
    std::fill(s, s + start, 0.f);
    std::fill(s + row_lens[r], s + seq_len, 0.f);
  }
}
#pragma GCC pop_options

// probs[r, t] *= v_t's scale for rows r < rows and positions t < seq_len: an 8-bit value's scale
// folded into its probability, so the value pass sums p * scale * codes as it sums p * v.
inline void fold_value_scales(const Shape& sh, const float* v_scales, const int64_t* blocks, int64_t kvh,
                              int64_t seq_len, int64_t padded_len, int64_t rows, float* probs) {
  for (int64_t j = 0; j * sh.block_size < seq_len; ++j) {
    const float* vs = block_scales(sh, v_scales, kvh, blocks[j]);
    const int64_t n = std::min(sh.block_size, seq_len - j * sh.block_size);
    for (int64_t r = 0; r < rows; ++r) {
      float* p = probs + r * padded_len + j * sh.block_size;
      for (int64_t t = 0; t < n; ++t) p[t] *= vs[t];
    }
  }
}

#ifdef DABBA_HAVE_AMX
// The same two passes on AMX tiles, for a tile of `rows` query rows (1 .. kAmxTileRows) with bf16
// q and cache and head_dim a multiple of 32. The rows are a top half (up to 16) and a bottom half
// (the rest), each its own A tile, so that each key and value interleaved for the B tiles serves
// up to 32 rows: tiles 0, 1 accumulate the top rows' float32 sums for two sets of 16 columns,
// 2, 3 the bottom rows' (C); 4 and 5 hold 32 bf16 of each top and bottom row, of q or of the
// probabilities (A); 6 and 7 16 bf16 pairs of 16 columns (B): in the scores pass the pairs
// (d, d + 1) of 16 keys, exactly the vectors group_block_scores_bf16 multiplies; in the value pass
// the pairs of keys (t, t + 1) of 16 dimensions, as group_weighted_values_bf16 interleaves them.
// A and C tiles have the tile's own numbers of rows (a configuration per count), so q, the scores
// and out are read and written in place, with no padding rows.

const TileConfig* attention_tile_config(int64_t rows) {
  static const auto configs = [] {
    std::array<TileConfig, kAmxTileRows + 1> c{};
    for (int r = 1; r <= kAmxTileRows; ++r) {
      const int top = std::min(r, 16), bottom = r - top;
      c[r].palette_id = 1;
      for (int t : {0, 1, 4}) {
        c[r].colsb[t] = 64;
        c[r].rows[t] = top;
      }
      for (int t : {2, 3, 5}) {  // unconfigured (and unused) for 16 rows or fewer
        c[r].colsb[t] = bottom ? 64 : 0;
        c[r].rows[t] = bottom;
      }
      for (int t : {6, 7}) {
        c[r].colsb[t] = 64;
        c[r].rows[t] = 16;
      }
    }
    return c;
  }();
  return &configs[rows];
}

// Loads the configuration for a tile's passes and releases the tile state after, so that other
// code on the thread (oneDNN's AMX kernels, the GEMM) finds the tiles as it expects them.
struct AttentionTiles {
  explicit AttentionTiles(int64_t rows) { _tile_loadconfig(attention_tile_config(rows)); }
  ~AttentionTiles() { _tile_release(); }
};

// scores[r * padded_len + t] = (q_r . k_t) * scale for r < rows over every key of the blocks that
// cover seq_len (past seq_len: whatever the block holds, as the AVX512 pass; softmax_rows never
// reads it). Each key block is interleaved into pairs once per tile (head_dim / 2 vpermw) into a
// small buffer the B tiles load; two blocks a step. A step's blocks are staged a step ahead: a
// tile load of data just stored waits for the stores to complete (loading them at once cost a
// third of the whole path's time). A power-of-two scale (head_dim 64 or 256) multiplies q instead
// of the sums, exactly (a bf16 times 2^k is a bf16, down to 2^-126, below which both kernels'
// dot products take inputs as zeros anyway), saving the sums a load and a store; other scales
// multiply the sums a step after their tile stores, while they are in L1.
void amx_block_scores(const Shape& sh, int64_t rows, const uint16_t* q, float scale, const uint16_t* k_ptr,
                      const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len, float* scores) {
  int exponent;
  const bool scale_q = std::frexp(scale, &exponent) == 0.5f;
  thread_local std::vector<uint16_t> q_scaled;
  if (scale_q) {
    q_scaled.resize(rows * sh.head_dim);
    for (int64_t i = 0; i < rows * sh.head_dim; ++i) q_scaled[i] = float_to_bf16_bits(bf16_bits_to_float(q[i]) * scale);
    q = q_scaled.data();
  }
  const __m512i pairs = _mm512_load_si512(kPairInterleave);
  const bool tall = rows > kLanes;
  const int64_t num_seq_blocks = (seq_len + kLanes - 1) / kLanes, block_elems = sh.head_dim * kLanes;
  const int64_t half = block_elems / 2, chunk = 32 * kLanes / 2;  // a B tile: 32 dimensions of 16 keys as pairs
  const int64_t ldq = sh.head_dim * sizeof(uint16_t), lds = padded_len * sizeof(float);
  const uint16_t* q_bottom = q + kLanes * sh.head_dim;
  float* scores_bottom = scores + kLanes * padded_len;
  thread_local std::vector<uint32_t> staged_buffer;  // [step parity][block of the step][head_dim / 2][16 keys]
  staged_buffer.resize(4 * half);
  uint32_t* const staged = staged_buffer.data();
  auto stage = [&](int64_t j) {
    for (int64_t b = j; b < j + 2 && b < num_seq_blocks; ++b) {
      if (b + 2 < num_seq_blocks)
        prefetch_block(k_ptr + (kvh * sh.num_blocks + blocks[b + 2]) * block_elems, block_elems * sizeof(uint16_t));
      const uint16_t* kb = k_ptr + (kvh * sh.num_blocks + blocks[b]) * block_elems;
      uint32_t* dst = staged + (b % 4) * half;
      for (int64_t d = 0; d < sh.head_dim; d += 2)
        _mm512_storeu_si512(dst + d / 2 * kLanes, _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(kb + d * kLanes)));
    }
  };
  // The sums times scale, a step's 32 columns (not waiting on the tile stores of the step after).
  const __m512 vscale = _mm512_set1_ps(scale);
  auto scale_step = [vscale, rows, scores, padded_len, end = num_seq_blocks * kLanes](int64_t j) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = j * kLanes; t < std::min(j * kLanes + 2 * kLanes, end); t += kLanes)
        _mm512_storeu_ps(scores + r * padded_len + t, _mm512_mul_ps(_mm512_loadu_ps(scores + r * padded_len + t), vscale));
  };
  stage(0);
  for (int64_t j = 0; j < num_seq_blocks; j += 2) {
    const bool two = j + 1 < num_seq_blocks;
    if (j + 2 < num_seq_blocks) stage(j + 2);
    const uint32_t* const b0 = staged + (j % 4) * half;
    const uint32_t* const b1 = b0 + half;
    _tile_zero(0);
    _tile_zero(1);
    if (tall) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t c = 0; c < sh.head_dim / 32; ++c) {
      _tile_loadd(4, q + c * 32, ldq);
      _tile_loadd(6, b0 + c * chunk, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(7, b1 + c * chunk, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (tall) {
        _tile_loadd(5, q_bottom + c * 32, ldq);
        _tile_dpbf16ps(2, 5, 6);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, scores + j * kLanes, lds);
    if (two) _tile_stored(1, scores + (j + 1) * kLanes, lds);
    if (tall) {
      _tile_stored(2, scores_bottom + j * kLanes, lds);
      if (two) _tile_stored(3, scores_bottom + (j + 1) * kLanes, lds);
    }
    if (j >= 2 && !scale_q) scale_step(j - 2);
  }
  if (!scale_q) scale_step((num_seq_blocks - 1) / 2 * 2);
}

// out[r * head_dim + d] = sum_{t < seq_len} p[r, t] v_t[d], the probabilities rounded to bf16 as
// group_weighted_values_bf16 rounds them, 32 keys (two blocks) a step and 32 dimensions (two
// accumulators per half) a pass over the keys. Keys t, t + 1 are interleaved for the pass's 32
// dimensions (2 B tiles), staged a step ahead as in amx_block_scores; keys past seq_len get zero
// values and probabilities (the cache there may hold anything, NaN included).
void amx_weighted_values(const Shape& sh, int64_t rows, const float* probs, const uint16_t* v_ptr,
                         const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len, float* out) {
  const bool tall = rows > kLanes;
  const int64_t keys = (seq_len + 31) / 32 * 32;
  const int64_t row = keys / 32 % 2 ? keys : keys + 32;  // an odd number of 64-byte lines (see attend_tile)
  thread_local std::vector<uint16_t> p16_buffer;
  p16_buffer.resize(rows * row);
  uint16_t* const p16 = p16_buffer.data();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < keys; t += kLanes) {
      const int64_t n = std::clamp<int64_t>(seq_len - t, 0, kLanes);
      const __m512 p = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), probs + r * padded_len + t);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + r * row + t), (__m256i)_mm512_cvtneps_pbh(p));
    }
  const uint16_t* p16_bottom = p16 + kLanes * row;
  const __m512i lo_idx = _mm512_load_si512(kPairLo), hi_idx = _mm512_load_si512(kPairHi);
  const int64_t block_elems = kLanes * sh.head_dim, ldp = row * sizeof(uint16_t), ldo = sh.head_dim * sizeof(float);
  alignas(64) uint32_t staged[2][2][kLanes * kLanes];  // [step parity][16 dimensions][16 key pairs][2 keys]
  auto value_row = [&](int64_t t) {
    return v_ptr + ((kvh * sh.num_blocks + blocks[t / kLanes]) * kLanes + t % kLanes) * sh.head_dim;
  };
  for (int64_t c = 0; c < sh.head_dim; c += 32) {
    auto stage = [&](int64_t k0) {
      if (c == 0)  // (from L2, where the scores pass brought the keys' blocks; the values follow)
        for (int64_t j = k0 / kLanes + 2; j < k0 / kLanes + 4 && j * kLanes < seq_len; ++j)
          prefetch_block(v_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems, block_elems * sizeof(uint16_t));
      uint32_t(&dst)[2][kLanes * kLanes] = staged[k0 / 32 % 2];
      for (int i = 0; i < kLanes; ++i) {
        const int64_t t = k0 + 2 * i;
        const __m512i a = t < seq_len ? _mm512_loadu_si512(value_row(t) + c) : _mm512_setzero_si512();
        const __m512i b = t + 1 < seq_len ? _mm512_loadu_si512(value_row(t + 1) + c) : _mm512_setzero_si512();
        _mm512_store_si512(dst[0] + i * kLanes, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_store_si512(dst[1] + i * kLanes, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    };
    _tile_zero(0);
    _tile_zero(1);
    if (tall) {
      _tile_zero(2);
      _tile_zero(3);
    }
    stage(0);
    for (int64_t k0 = 0; k0 < seq_len; k0 += 32) {
      if (k0 + 32 < seq_len) stage(k0 + 32);
      const uint32_t(&now)[2][kLanes * kLanes] = staged[k0 / 32 % 2];
      _tile_loadd(4, p16 + k0, ldp);
      _tile_loadd(6, now[0], 64);
      _tile_loadd(7, now[1], 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (tall) {
        _tile_loadd(5, p16_bottom + k0, ldp);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, out + c, ldo);
    _tile_stored(1, out + c + kLanes, ldo);
    if (tall) {
      _tile_stored(2, out + kLanes * sh.head_dim + c, ldo);
      _tile_stored(3, out + kLanes * sh.head_dim + c + kLanes, ldo);
    }
  }
}
#endif

// The one place that picks the kernel of a request's bf16 attention passes (bf16 q and cache; the
// 8-bit caches and other dtypes have passes of their own): AMX tiles where the build, the CPU and
// the OS have them (amx_usable, which also wants head_dim a multiple of 32), with 16-key blocks,
// from kAmxAttentionMinRows query rows (its tokens x the query heads per kv head) and
// kAmxAttentionMinKeys keys (cpu_ops.h: where they pay, measured); else the AVX512-BF16 passes,
// the reference. amx false (the paged_attention op's argument) keeps the reference everywhere.
template <typename scalar_t, typename cache_t>
bool attention_on_amx(bool amx, const Shape& sh, int64_t query_len, int64_t seq_len) {
#ifdef DABBA_HAVE_AMX
  return std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16> && amx &&
         sh.block_size == kLanes && sh.group <= kAmxTileRows && query_len * sh.group >= kAmxAttentionMinRows &&
         seq_len >= kAmxAttentionMinKeys && amx_usable(sh.head_dim);
#else
  return false;
#endif
}

// Both passes for sh.group query rows that share a kv head (the G heads of one token, or of
// several tokens of one prompt); false if the shape needs the per-row loops.
// q: the rows as stored (contiguous), qf: the same scaled, in float32; row r attends positions
// [row_starts[r], row_lens[r]) (row_starts null: from 0), all within seq_len; softcap > 0 caps
// the scores; amx: the bf16 passes on AMX tiles (the caller asked attention_on_amx; up to
// kAmxTileRows rows, else kMaxTileRows).
template <typename scalar_t, typename cache_t>
bool group_attention(const Shape& sh, const scalar_t* q, float scale, const float* qf, const PagedKV<cache_t>& kv,
                     const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len,
                     const int64_t* row_lens, const int64_t* row_starts, float softcap, bool amx, float* scores,
                     float* out) {
  if (sh.block_size != kLanes || sh.head_dim % kLanes) return false;
#ifdef DABBA_HAVE_AMX
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>) {
    if (amx) {
      const AttentionTiles tiles(sh.group);
      amx_block_scores(sh, sh.group, reinterpret_cast<const uint16_t*>(q), scale,
                       reinterpret_cast<const uint16_t*>(kv.k), blocks, kvh, seq_len, padded_len, scores);
      softmax_rows(scores, sh.group, padded_len, seq_len, row_lens, row_starts, softcap);
      amx_weighted_values(sh, sh.group, scores, reinterpret_cast<const uint16_t*>(kv.v), blocks, kvh, seq_len,
                          padded_len, out);
      return true;
    }
  }
#endif
  auto run = [&](auto group) {
    constexpr int G = decltype(group)::value;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    constexpr bool bf16_pairs = std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>;
#else
    constexpr bool bf16_pairs = false;
#endif
    if constexpr (bf16_pairs) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      group_block_scores_bf16<G>(sh, reinterpret_cast<const uint16_t*>(q), scale,
                                 reinterpret_cast<const uint16_t*>(kv.k), reinterpret_cast<const uint16_t*>(kv.v),
                                 blocks, kvh, seq_len, padded_len, scores);
      softmax_rows(scores, G, padded_len, seq_len, row_lens, row_starts, softcap);
      group_weighted_values_bf16<G>(sh, scores, reinterpret_cast<const uint16_t*>(kv.v), blocks, kvh, seq_len,
                                    padded_len, out);
#endif
    } else {
      group_block_scores<cache_t, G>(sh, qf, kv, blocks, kvh, seq_len, padded_len, scores);
      softmax_rows(scores, G, padded_len, seq_len, row_lens, row_starts, softcap);
      if (kv.v_scales) fold_value_scales(sh, kv.v_scales, blocks, kvh, seq_len, padded_len, G, scores);
      group_weighted_values<cache_t, G>(sh, scores, kv.v, blocks, kvh, seq_len, padded_len, out);
    }
  };
  return with_count<kMaxTileRows>(sh.group, run);
}

template <typename scalar_t>
void weighted_values_scalar(const Shape& sh, const float* probs, const scalar_t* v_ptr, const int64_t* blocks,
                            int64_t kvh, int64_t seq_len, int64_t padded_len, float* out) {
  std::fill(out, out + sh.group * sh.head_dim, 0.f);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t block = blocks[t / sh.block_size];
    const scalar_t* v_row = v_ptr + ((kvh * sh.num_blocks + block) * sh.block_size + t % sh.block_size) * sh.head_dim;
    for (int64_t g = 0; g < sh.group; ++g) {
      const float p = probs[g * padded_len + t];
      for (int64_t d = 0; d < sh.head_dim; ++d) out[g * sh.head_dim + d] += p * static_cast<float>(v_row[d]);
    }
  }
}

template <typename scalar_t>
struct TileBuffers {
  std::vector<scalar_t> q;
  std::vector<float> qf, acc, scores;
  std::vector<int64_t> row_lens, row_starts;
};

// The block holding the first key a query at `pos` sees: with a sliding window of W keys (W > 0)
// it sees positions pos - W + 1 .. pos (the query's own key counts), else 0 .. pos.
inline int64_t first_visible_block(int64_t pos, int64_t window, int64_t block_size) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) / block_size : 0;
}

// Query tokens tok0 .. tok0 + nt - 1 of one sequence (positions pos0 .. pos0 + nt - 1, its block
// table `blocks`) against kv head kvh. Each token's G query heads are a row each; all nt * G rows
// share every key and value load. Row (t, g) attends positions [0, pos0 + t]: causal; with a
// sliding window (window > 0) only [pos0 + t - window + 1, pos0 + t]; softcap > 0 caps the scores;
// amx: on AMX tiles (attention_on_amx said so for the tile's request). Then the blocks before the
// tile's first visible key are skipped whole: the passes run over positions skip .. pos0 + nt - 1
// (skip a multiple of block_size), and each row masks the keys before its own window.
//
//   | skipped blocks | boundary block | ... | tile's keys |
//   0               skip        pos0 - window + 1   pos0 + nt
template <typename scalar_t, typename cache_t>
void attend_tile(const Shape& sh, const scalar_t* q_ptr, scalar_t* out_ptr, const PagedKV<cache_t>& kv,
                 const int64_t* blocks, int64_t tok0, int64_t nt, int64_t pos0, int64_t kvh, float fscale,
                 int64_t window, float softcap, bool amx, TileBuffers<scalar_t>& b) {
  Shape tile = sh;
  tile.group = nt * sh.group;
  const int64_t rows = tile.group, d_head = sh.head_dim;
  const int64_t first_block = first_visible_block(pos0, window, sh.block_size);
  const int64_t skip = first_block * sh.block_size;
  blocks += first_block;
  const int64_t seq_len = pos0 + nt - skip;
  // The scores' row stride: whole blocks, and with 16-key blocks an odd number of 64-byte lines:
  // rows a power of two of lines apart (2048 keys: 8 KiB) share the same few L1 sets, and the
  // passes that read a column of rows at a time (tile stores and loads) evicted each other's rows.
  int64_t padded_len = (seq_len + sh.block_size - 1) / sh.block_size * sh.block_size;
  if (padded_len * sizeof(float) % 128 == 0) padded_len += sh.block_size;
  b.q.resize(rows * d_head);
  b.qf.resize(rows * d_head);
  b.acc.resize(rows * d_head);
  b.scores.resize(rows * padded_len);
  b.row_lens.resize(rows);
  b.row_starts.resize(rows);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < sh.group; ++g) {
      const int64_t r = t * sh.group + g;
      const scalar_t* src = q_ptr + ((tok0 + t) * sh.num_heads + kvh * sh.group + g) * d_head;
      std::memcpy(b.q.data() + r * d_head, src, d_head * sizeof(scalar_t));
      for (int64_t d = 0; d < d_head; ++d) b.qf[r * d_head + d] = static_cast<float>(src[d]) * fscale;
      b.row_lens[r] = pos0 + t + 1 - skip;
      b.row_starts[r] = window > 0 ? std::max<int64_t>(0, pos0 + t - window + 1) - skip : 0;
    }
  const int64_t* row_starts = window > 0 ? b.row_starts.data() : nullptr;
  float* scores = b.scores.data();
  float* acc = b.acc.data();
  if (!group_attention(tile, b.q.data(), fscale, b.qf.data(), kv, blocks, kvh, seq_len, padded_len,
                       b.row_lens.data(), row_starts, softcap, amx, scores, acc)) {
    block_scores(tile, b.qf.data(), kv.k, kv.k_scales, blocks, kvh, seq_len, padded_len, scores);
    softmax_rows(scores, rows, padded_len, seq_len, b.row_lens.data(), row_starts, softcap);
    if (kv.v_scales) fold_value_scales(tile, kv.v_scales, blocks, kvh, seq_len, padded_len, rows, scores);
    if (d_head % kLanes || d_head / kLanes > 8) {
      weighted_values_scalar(tile, scores, kv.v, blocks, kvh, seq_len, padded_len, acc);
    } else {
      with_count<8>(d_head / kLanes, [&](auto chunks) {
        weighted_values<cache_t, decltype(chunks)::value>(tile, scores, kv.v, blocks, kvh, seq_len, padded_len, acc);
      });
    }
  }
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < sh.group; ++g) {
      scalar_t* dst = out_ptr + ((tok0 + t) * sh.num_heads + kvh * sh.group + g) * d_head;
      const float* src = acc + (t * sh.group + g) * d_head;
      for (int64_t d = 0; d < d_head; ++d) dst[d] = static_cast<scalar_t>(src[d]);
    }
}

// The next work item's first two key blocks, while this one computes: the scores pass prefetches
// two blocks ahead of itself, but not across items.
template <typename cache_t>
inline void prefetch_first_blocks(const Shape& sh, const cache_t* k_ptr, const int64_t* blocks, int64_t seq_len,
                                  int64_t kvh) {
  const int64_t block_elems = sh.head_dim * sh.block_size;
  for (int64_t j = 0; j < 2 && j * sh.block_size < seq_len; ++j)
    prefetch_block(k_ptr + (kvh * sh.num_blocks + blocks[j]) * block_elems, block_elems * sizeof(cache_t));
}

Shape make_shape(const at::Tensor& q, const at::Tensor& value_cache, const at::Tensor& block_table) {
  return Shape{q.size(1), q.size(2), value_cache.size(0), value_cache.size(1), value_cache.size(2),
               q.size(1) / value_cache.size(0), block_table.size(1)};
}

template <typename scalar_t, typename cache_t>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const Shape& sh, const PagedKV<cache_t>& kv,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap) {
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  // One work item = one sequence x one kv head (the query heads of its group together).
  at::parallel_for(0, q.size(0) * sh.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    TileBuffers<scalar_t> buffers;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / sh.num_kv_heads, kvh = item % sh.num_kv_heads;
      if (item + 1 < end) {
        const int64_t next = (item + 1) / sh.num_kv_heads;
        const int64_t first = first_visible_block(len_ptr[next] - 1, window, sh.block_size);
        prefetch_first_blocks(sh, kv.k, bt_ptr + next * sh.max_blocks + first, len_ptr[next] - first * sh.block_size,
                              (item + 1) % sh.num_kv_heads);
      }
      attend_tile(sh, q_ptr, out_ptr, kv, bt_ptr + s * sh.max_blocks, s, 1, len_ptr[s] - 1, kvh,
                  static_cast<float>(scale), window, static_cast<float>(softcap),
                  attention_on_amx<scalar_t, cache_t>(true, sh, 1, len_ptr[s]), buffers);
    }
  });
}

// A step's attention, prefill chunks and decodes together. Request r's query tokens are
// query_start_loc[r] .. query_start_loc[r + 1]; they are the last tokens of its seq_lens[r], and
// this step's keys and values are in the cache already (write_kv_cache). A prompt's tokens are
// attended in tiles of T = 16 / G consecutive tokens (G query heads per kv head; 32 / G where
// attention_on_amx puts the request on AMX tiles), so each key and value is loaded once per tile
// rather than once per token. The tiles are dealt to the threads from both ends of the list: a
// prompt's later tiles attend more positions.
template <typename scalar_t, typename cache_t>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const Shape& sh, const PagedKV<cache_t>& kv,
                            const at::Tensor& block_table, const at::Tensor& query_start_loc,
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap, bool amx) {
  const int64_t* bt_ptr = block_table.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  struct Tile {
    int64_t req, tok0, nt, pos0;
    bool amx;
  };
  std::vector<Tile> tiles;
  for (int64_t r = 0; r + 1 < query_start_loc.size(0); ++r) {
    const int64_t query_len = qsl[r + 1] - qsl[r], context_len = len_ptr[r] - query_len;
    TORCH_CHECK(query_len >= 0 && context_len >= 0, "request ", r, ": query longer than its sequence");
    const bool on_amx = attention_on_amx<scalar_t, cache_t>(amx, sh, query_len, len_ptr[r]);
    const int64_t tile_tokens = std::max<int64_t>(1, (on_amx ? kAmxTileRows : kMaxTileRows) / sh.group);
    for (int64_t i = 0; i < query_len; i += tile_tokens)
      tiles.push_back({r, qsl[r] + i, std::min(tile_tokens, query_len - i), context_len + i, on_amx});
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_tiles * sh.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    TileBuffers<scalar_t> buffers;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / sh.num_kv_heads, kvh = item % sh.num_kv_heads;
      const Tile& tile = tiles[i % 2 ? num_tiles - 1 - i / 2 : i / 2];  // 0, n-1, 1, n-2, ...
      attend_tile(sh, q_ptr, out_ptr, kv, bt_ptr + tile.req * sh.max_blocks, tile.tok0, tile.nt, tile.pos0, kvh,
                  static_cast<float>(scale), window, static_cast<float>(softcap), tile.amx, buffers);
    }
  });
}

namespace {
bool is_code_dtype(at::ScalarType dtype) { return dtype == at::kChar || dtype == at::kFloat8_e4m3fn; }

// A full-precision cache has q's dtype and no scales; an 8-bit one int8 or float8_e4m3fn codes
// (both caches alike) and a contiguous float32 scale tensor each for K and V, shaped like the
// value cache without head_dim. x: q or k, in the model's dtype.
void check_cache_kind(const at::Tensor& x, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key_cache and value_cache dtypes differ");
  if (!is_code_dtype(key_cache.scalar_type())) {
    TORCH_CHECK(x.scalar_type() == key_cache.scalar_type(), "dtype mismatch");
    TORCH_CHECK(!key_scales.has_value() && !value_scales.has_value(),
                "scales go with an 8-bit cache (int8 or float8_e4m3fn codes)");
    return;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "an 8-bit cache serves float32, bfloat16 or float16 models");
  TORCH_CHECK(key_scales.has_value() && value_scales.has_value(), "an 8-bit cache needs key_scales and value_scales");
  for (const at::Tensor* scales : {&*key_scales, &*value_scales})
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                    scales->sizes() == value_cache.sizes().slice(0, 3),
                "scales must be contiguous float32 [num_kv_heads, num_blocks, block_size]");
}

void check_attention_operands(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_table,
                              const c10::optional<at::Tensor>& key_scales,
                              const c10::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(key_cache.size(0) == value_cache.size(0) && key_cache.size(1) == value_cache.size(1) &&
              key_cache.size(2) == value_cache.size(3) && key_cache.size(3) == value_cache.size(2),
              "key_cache must be value_cache with each block transposed");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "operands must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(q.size(1) % key_cache.size(0) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) == value_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous(),
              "block_table must be contiguous int64 [num_seqs, max_blocks]");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "dtype mismatch");
  check_cache_kind(q, key_cache, value_cache, key_scales, value_scales);
}

// f(PagedKV<cache_t>) for the cache's element type: scalar_t (q's), or 8-bit codes with their
// scales (operands checked).
template <typename scalar_t, typename F>
void with_paged_kv(const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales, F&& f) {
  auto codes = [&](auto code) {
    using code_t = decltype(code);
    f(PagedKV<code_t>{static_cast<const code_t*>(key_cache.const_data_ptr()),
                      static_cast<const code_t*>(value_cache.const_data_ptr()), key_scales->const_data_ptr<float>(),
                      value_scales->const_data_ptr<float>()});
  };
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (key_cache.scalar_type() == at::kChar) return codes(int8_t{});
    if (key_cache.scalar_type() == at::kFloat8_e4m3fn) return codes(c10::Float8_e4m3fn{});
  }
  f(PagedKV<scalar_t>{key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(), nullptr, nullptr});
}
}  // namespace

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t sliding_window, double softcap,
                            const c10::optional<at::Tensor>& key_scales,
                            const c10::optional<at::Tensor>& value_scales) {
  check_attention_operands(out, q, key_cache, value_cache, block_table, key_scales, value_scales);
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0) &&
                  block_table.size(0) >= q.size(0),
              "seq_lens must be contiguous int64 [num_seqs], a block table row per sequence");
  const Shape sh = make_shape(q, value_cache, block_table);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    with_paged_kv<scalar_t>(key_cache, value_cache, key_scales, value_scales, [&](const auto& kv) {
      decode_attention_impl<scalar_t>(out, q, sh, kv, block_table, seq_lens, scale,
                                      std::max<int64_t>(sliding_window, 0), std::max(softcap, 0.0));
    });
  });
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& key_scales,
                     const c10::optional<at::Tensor>& value_scales, bool amx) {
  check_attention_operands(out, q, key_cache, value_cache, block_table, key_scales, value_scales);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1 && block_table.size(0) >= seq_lens.numel(),
              "query_start_loc [num_seqs + 1] and seq_lens [num_seqs] must be contiguous int64, a block table row "
              "per sequence");
  TORCH_CHECK(query_start_loc.data_ptr<int64_t>()[seq_lens.numel()] == q.size(0),
              "query_start_loc must end at q's number of tokens");
  const Shape sh = make_shape(q, value_cache, block_table);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    with_paged_kv<scalar_t>(key_cache, value_cache, key_scales, value_scales, [&](const auto& kv) {
      prefill_attention_impl<scalar_t>(out, q, sh, kv, block_table, query_start_loc, seq_lens, scale,
                                       std::max<int64_t>(sliding_window, 0), std::max(softcap, 0.0), amx);
    });
  });
}

// This step's keys and values [num_tokens, num_kv_heads, head_dim] into their slots: values as
// rows, keys transposed within the block. One call per layer instead of a chain of indexing ops.
template <typename scalar_t>
void write_kv_impl(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_blocks = value_cache.size(1), block_size = value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* kc = key_cache.data_ptr<scalar_t>();
  scalar_t* vc = value_cache.data_ptr<scalar_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const scalar_t* ksrc = kp + t * k.stride(0) + h * k.stride(1);
      const scalar_t* vsrc = vp + t * v.stride(0) + h * v.stride(1);
      scalar_t* kdst = kc + ((h * num_blocks + block) * head_dim) * block_size + offset;
      for (int64_t d = 0; d < head_dim; ++d) kdst[d * block_size] = ksrc[d];
      std::memcpy(vc + ((h * num_blocks + block) * block_size + offset) * head_dim, vsrc, head_dim * sizeof(scalar_t));
    }
  }
}

// float -> float8_e4m3fn bits exactly as c10::Float8_e4m3fn(float) converts (to nearest even;
// saturating at 448 past the largest finite value, NaN to NaN), with selects instead of its
// branches, so that a loop over a row vectorises.
inline uint8_t float_to_e4m3fn_bits(float f) {
  constexpr uint32_t kOverflow = UINT32_C(1087) << 20;  // 480.0f: the first value past 448's rounding range
  constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // adding it leaves a subnormal's code in the low bits
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  float magnitude, magic, shifted;
  std::memcpy(&magnitude, &bits, sizeof(magnitude));
  std::memcpy(&magic, &kDenormMagic, sizeof(magic));
  shifted = magnitude + magic;
  uint32_t denorm;
  std::memcpy(&denorm, &shifted, sizeof(denorm));
  denorm -= kDenormMagic;
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t large = bits > UINT32_C(0x7f800000) ? 0x7fu : 0x7eu;
  const uint32_t code = bits >= kOverflow ? large : bits < (UINT32_C(121) << 23) ? denorm : normal;
  return static_cast<uint8_t>(code | sign);
}

// max |x[i]| over n floats, in 16 lanes (a scalar max reduction is not vectorised).
inline float max_abs(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  vfloat vmax = {};
  for (int64_t i = 0; i < full; i += kLanes) {
    const vfloat v = load16(x + i);
    const vfloat a = v < 0 ? -v : v;
    vmax = vmax > a ? vmax : a;
  }
  float m = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) m = std::max(m, vmax[i]);
  for (int64_t i = full; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// x[0..n) -> codes[0..n) and the scale they share, as KVQuant.quantize computes them:
// scale = max(max|x| / q_max, 1e-12) and y = x / scale (true divisions, as torch's), then int8:
// y rounded half to even (torch.round) and clamped to +-q_max; fp8: y to float8_e4m3fn. xf: n
// floats of scratch.
template <typename scalar_t, typename code_t>
float quantize_row(const scalar_t* x, int64_t n, float q_max, float* xf, code_t* codes) {
  for (int64_t i = 0; i < n; ++i) xf[i] = static_cast<float>(x[i]);
  const float scale = std::max(max_abs(xf, n) / q_max, 1e-12f);
  if constexpr (std::is_same_v<code_t, int8_t>) {
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(xf[i] / scale), -q_max, q_max));
  } else {
    uint8_t* bits = reinterpret_cast<uint8_t*>(codes);
    for (int64_t i = 0; i < n; ++i) bits[i] = float_to_e4m3fn_bits(xf[i] / scale);
  }
  return scale;
}

// write_kv_impl for an 8-bit cache: each token's head vector quantized on its own (one scale per
// token and kv head), codes where write_kv_impl puts values, scales at [kv head, block, offset].
template <typename scalar_t, typename code_t>
void write_kv_codes_impl(at::Tensor& key_cache, at::Tensor& value_cache, at::Tensor& key_scales,
                         at::Tensor& value_scales, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& slot_mapping, float q_max) {
  const int64_t num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_blocks = value_cache.size(1), block_size = value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  code_t* kc = static_cast<code_t*>(key_cache.data_ptr());
  code_t* vc = static_cast<code_t*>(value_cache.data_ptr());
  float* ks = key_scales.data_ptr<float>();
  float* vs = value_scales.data_ptr<float>();
  // A prompt's thousands of rows in parallel; a decode step's few in one thread.
  at::parallel_for(0, k.size(0) * num_kv_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(head_dim);
    std::vector<code_t> codes(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      const int64_t row = (h * num_blocks + block) * block_size + offset;  // the token's scale, its value row
      ks[row] = quantize_row(kp + t * k.stride(0) + h * k.stride(1), head_dim, q_max, xf.data(), codes.data());
      code_t* kdst = kc + ((h * num_blocks + block) * head_dim) * block_size + offset;
      for (int64_t d = 0; d < head_dim; ++d) kdst[d * block_size] = codes[d];
      vs[row] = quantize_row(vp + t * v.stride(0) + h * v.stride(1), head_dim, q_max, xf.data(), vc + row * head_dim);
    }
  });
}

void write_kv_cache(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scales,
                    const c10::optional<at::Tensor>& value_scales, double q_max) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [num_tokens, num_kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous");
  TORCH_CHECK(value_cache.size(0) == k.size(1) && value_cache.size(3) == k.size(2) &&
              key_cache.size(0) == k.size(1) && key_cache.size(1) == value_cache.size(1) &&
              key_cache.size(2) == k.size(2) && key_cache.size(3) == value_cache.size(2),
              "key_cache must be [kv_heads, blocks, head_dim, block_size], value_cache [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping must be [num_tokens] int64");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "dtype mismatch");
  check_cache_kind(k, key_cache, value_cache, key_scales, value_scales);
  const int64_t num_slots = value_cache.size(1) * value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  if (!is_code_dtype(key_cache.scalar_type())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
      write_kv_impl<scalar_t>(key_cache, value_cache, k, v, slot_mapping);
    });
    return;
  }
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q_max > 0 && q_max <= (int8 ? 127.0 : 448.0),
              "q_max must be in (0, ", int8 ? "127" : "448", "] for ", key_cache.scalar_type(), " codes");
  at::Tensor key_scale_t = *key_scales, value_scale_t = *value_scales;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {  // (check_cache_kind refused double)
      if (int8)
        write_kv_codes_impl<scalar_t, int8_t>(key_cache, value_cache, key_scale_t, value_scale_t, k, v, slot_mapping,
                                              static_cast<float>(q_max));
      else
        write_kv_codes_impl<scalar_t, c10::Float8_e4m3fn>(key_cache, value_cache, key_scale_t, value_scale_t, k, v,
                                                          slot_mapping, static_cast<float>(q_max));
    }
  });
}

}  // namespace dabba

// An 8-bit cache passes its codes as key_cache/value_cache (int8, or uint8 storage viewed as
// float8_e4m3fn) with key_scales/value_scales; write_kv_cache also takes KVQuant.q_max.
TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, Tensor slot_mapping, "
        "Tensor(c!)? key_scales=None, Tensor(d!)? value_scales=None, float q_max=0.) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(dabba::write_kv_cache));
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int sliding_window=0, float softcap=0., "
        "Tensor? key_scales=None, Tensor? value_scales=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(dabba::paged_decode_attention));
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int sliding_window=0, float softcap=0., "
        "Tensor? key_scales=None, Tensor? value_scales=None, bool amx=True) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(dabba::paged_attention));
}

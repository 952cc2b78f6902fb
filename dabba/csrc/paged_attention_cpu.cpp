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
#include "paged_attention.h"
#include "vec16.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
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
#elif defined(__AVX2__) && defined(__F16C__)
// The same conversions in two 8-lane halves (the avx2 variant).
inline vfloat from_halves(__m256 lo, __m256 hi) {
  static_assert(vfloat::kParts == 2, "AVX without AVX-512: two 32-byte parts");
  vfloat out;
  std::memcpy(&out.part[0], &lo, sizeof(lo));
  std::memcpy(&out.part[1], &hi, sizeof(hi));
  return out;
}

template <>
inline vfloat load16_as_float<int8_t>(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return from_halves(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                     _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
}

template <>
inline vfloat load16_as_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16(-16385));
  const __m256 x256 = _mm256_set1_ps(256.f);
  return from_halves(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), x256),
                     _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)), x256));
}
#endif

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
#if defined(__x86_64__)  // an x86 option: other targets (aarch64) keep their own vector width
#pragma GCC target("prefer-vector-width=512")
#endif

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
      vmax = select(vmax > x, vmax, x);
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
// share every key and value load. Row (t, g) attends positions [0, pos0 + t]: causal, or with
// key_ends [0, key_ends[tok0 + t]) (an image token of Gemma 3 sees its whole image); with a
// sliding window (window > 0) only from pos0 + t - window + 1 on; softcap > 0 caps the scores;
// amx: on AMX tiles (attention_on_amx said so for the tile's request). Then the blocks before the
// tile's first visible key are skipped whole: the passes run over positions skip .. pos0 + nt - 1
// (skip a multiple of block_size), and each row masks the keys before its own window.
//
//   | skipped blocks | boundary block | ... | tile's keys |
//   0               skip        pos0 - window + 1   pos0 + nt
template <typename scalar_t, typename cache_t>
void attend_tile(const Shape& sh, const scalar_t* q_ptr, scalar_t* out_ptr, const PagedKV<cache_t>& kv,
                 const int64_t* blocks, int64_t tok0, int64_t nt, int64_t pos0, const int64_t* key_ends, int64_t kvh,
                 float fscale, int64_t window, float softcap, bool amx, TileBuffers<scalar_t>& b) {
  Shape tile = sh;
  tile.group = nt * sh.group;
  const int64_t rows = tile.group, d_head = sh.head_dim;
  const int64_t first_block = first_visible_block(pos0, window, sh.block_size);
  const int64_t skip = first_block * sh.block_size;
  blocks += first_block;
  int64_t tile_end = pos0 + nt;  // past the last key any row sees
  if (key_ends)
    for (int64_t t = 0; t < nt; ++t) tile_end = std::max(tile_end, key_ends[tok0 + t]);
  const int64_t seq_len = tile_end - skip;
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
      b.row_lens[r] = (key_ends ? key_ends[tok0 + t] : pos0 + t + 1) - skip;
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
      attend_tile(sh, q_ptr, out_ptr, kv, bt_ptr + s * sh.max_blocks, s, 1, len_ptr[s] - 1, nullptr, kvh,
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
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap, bool amx,
                            const int64_t* key_ends) {
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
    for (int64_t i = 0; key_ends && i < query_len; ++i)
      TORCH_CHECK(key_ends[qsl[r] + i] > context_len + i && key_ends[qsl[r] + i] <= len_ptr[r], "request ", r,
                  ": key_ends must lie past each query's position and within its sequence");
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
      attend_tile(sh, q_ptr, out_ptr, kv, bt_ptr + tile.req * sh.max_blocks, tile.tok0, tile.nt, tile.pos0, key_ends, kvh,
                  static_cast<float>(scale), window, static_cast<float>(softcap), tile.amx, buffers);
    }
  });
}

namespace {
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
                     const c10::optional<at::Tensor>& value_scales, bool amx, const c10::optional<at::Tensor>& key_ends) {
  check_attention_operands(out, q, key_cache, value_cache, block_table, key_scales, value_scales);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1 && block_table.size(0) >= seq_lens.numel(),
              "query_start_loc [num_seqs + 1] and seq_lens [num_seqs] must be contiguous int64, a block table row "
              "per sequence");
  TORCH_CHECK(query_start_loc.data_ptr<int64_t>()[seq_lens.numel()] == q.size(0),
              "query_start_loc must end at q's number of tokens");
  TORCH_CHECK(!key_ends.has_value() || (key_ends->scalar_type() == at::kLong && key_ends->is_contiguous() &&
                                        key_ends->numel() == q.size(0)),
              "key_ends must be contiguous int64 [num_tokens]");
  const int64_t* ends = key_ends.has_value() ? key_ends->data_ptr<int64_t>() : nullptr;
  const Shape sh = make_shape(q, value_cache, block_table);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    with_paged_kv<scalar_t>(key_cache, value_cache, key_scales, value_scales, [&](const auto& kv) {
      prefill_attention_impl<scalar_t>(out, q, sh, kv, block_table, query_start_loc, seq_lens, scale,
                                       std::max<int64_t>(sliding_window, 0), std::max(softcap, 0.0), amx,
                                       ends);
    });
  });
}

}  // namespace dabba

// An 8-bit cache passes its codes as key_cache/value_cache (int8, or uint8 storage viewed as
// float8_e4m3fn) with key_scales/value_scales.
TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int sliding_window=0, float softcap=0., "
        "Tensor? key_scales=None, Tensor? value_scales=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(dabba::paged_decode_attention));
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int sliding_window=0, float softcap=0., "
        "Tensor? key_scales=None, Tensor? value_scales=None, bool amx=True, Tensor? key_ends=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(dabba::paged_attention));
}

// The attention passes on AMX tiles (Intel Sapphire Rapids and later), for paged_attention_cpu.cpp,
// which chooses them per request (attention_on_amx) and keeps the AVX512-BF16 passes as the reference.
#include "cpu_math.h"
#include "paged_attention.h"
#include "vec16.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace dabba {

#ifdef DABBA_HAVE_AMX
// The scores and value passes of paged_attention_cpu.cpp on AMX tiles, for a tile of `rows` query rows (1 .. kAmxTileRows) with bf16
// q and cache and head_dim a multiple of 32. The rows are a top half (up to 16) and a bottom half
// (the rest), each its own A tile, so that each key and value interleaved for the B tiles serves
// up to 32 rows: tiles 0, 1 accumulate the top rows' float32 sums for two sets of 16 columns,
// 2, 3 the bottom rows' (C); 4 and 5 hold 32 bf16 of each top and bottom row, of q or of the
// probabilities (A); 6 and 7 16 bf16 pairs of 16 columns (B): in the scores pass the pairs
// (d, d + 1) of 16 keys, exactly the vectors group_block_scores_bf16 multiplies; in the value pass
// the pairs of keys (t, t + 1) of 16 dimensions, as group_weighted_values_bf16 interleaves them.
// A and C tiles have the tile's own numbers of rows (a configuration per count), so q, the scores
// and out are read and written in place, with no padding rows.

namespace {

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

}  // namespace

// Loads the configuration for a tile's passes and releases the tile state after, so that other
// code on the thread (oneDNN's AMX kernels, the GEMM) finds the tiles as it expects them.
AttentionTiles::AttentionTiles(int64_t rows) { _tile_loadconfig(attention_tile_config(rows)); }
AttentionTiles::~AttentionTiles() { _tile_release(); }

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
#endif  // DABBA_HAVE_AMX

}  // namespace dabba

// What the attention passes share across files: the cache's shape as the kernels read it, the
// bf16 pair-interleaving indices, the cache-kind checks (paged_attention_cpu.cpp, kv_cache_write_cpu.cpp),
// and the AMX passes (paged_attention_amx_cpu.cpp). The layout is described in paged_attention_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include "bf16_tiles.h"

#include <cstdint>

namespace dabba {

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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// vpermw indices taking two 16-element bf16 rows a | b to the pairs (a0, b0), (a1, b1), ...
alignas(64) inline constexpr uint16_t kPairInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
// vpermt2w indices taking two 32-element bf16 rows a, b to the pairs (a_i, b_i): i < 16, then i >= 16.
alignas(64) inline constexpr uint16_t kPairLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
#endif

inline bool is_code_dtype(at::ScalarType dtype) { return dtype == at::kChar || dtype == at::kFloat8_e4m3fn; }

// A full-precision cache has q's dtype and no scales; an 8-bit one int8 or float8_e4m3fn codes
// (both caches alike) and a contiguous float32 scale tensor each for K and V, shaped like the
// value cache without head_dim. x: q or k, in the model's dtype.
inline void check_cache_kind(const at::Tensor& x, const at::Tensor& key_cache, const at::Tensor& value_cache,
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

#ifdef DABBA_HAVE_AMX
// paged_attention_amx_cpu.cpp: the scores and value passes on AMX tiles, for `rows` (1 .. kAmxTileRows)
// query rows with bf16 q and cache and head_dim a multiple of 32.
struct AttentionTiles {  // the tile configuration for `rows`, loaded for a tile's passes, released after
  explicit AttentionTiles(int64_t rows);
  ~AttentionTiles();
};
void amx_block_scores(const Shape& sh, int64_t rows, const uint16_t* q, float scale, const uint16_t* k_ptr,
                      const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len, float* scores);
void amx_weighted_values(const Shape& sh, int64_t rows, const float* probs, const uint16_t* v_ptr,
                         const int64_t* blocks, int64_t kvh, int64_t seq_len, int64_t padded_len, float* out);
#endif

}  // namespace dabba

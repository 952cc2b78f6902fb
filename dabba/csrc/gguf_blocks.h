// GGUF's (ggml's) quantized blocks as they lie in the file, and their dequantization to float32:
// the native form of dabba/quantization/gguf_blocks.py, which is the reference (equal to gguf-py's
// gguf.quants.dequantize) and which tests hold these to, bit for bit.
//
// Type ids are ggml's own (the file format's GGMLQuantizationType); Python reads the ones the
// kernels take from kernel_constants() ("gguf_type.Q4_K", ...), so they are listed only here.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace dabba::gguf {

enum Type : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
  // dabba's own layouts of a file type's blocks, made at load (quantization/gguf_repack.py), with
  // ids past ggml's: a row's runs of 512 values (16 groups of 32), each group's values 8 l + r
  // (low nibble) and 8 l + 4 + r (high) in byte 64 l + 4 j + r of the run's 256 bytes of nibbles,
  // so that one 64-byte load gives 4 values of each of the 16 groups; a row's blocks past its last
  // run stay the file's. A row keeps the file type's bytes; only whole rows dequantize.
  // Q4_0x16: 16 Q4_0 blocks a run, their 16 float16 scales first (32 bytes). A row's g < 16 blocks
  // past its last whole run form a last run laid out alike: g scales, then byte 4 g l + 4 j + r.
  // Q5_0x16: as Q4_0x16 (the 5-bit codes' low 4 bits as its nibbles), then their fifth bits as
  // Q5_Kx2's (4 g bytes).
  // Q8_0x16: 16 Q8_0 blocks a run, their 16 float16 scales first, then their codes plus 128 as
  // unsigned bytes, byte 64 t + 4 j + r holding block j's value 4 t + r (vpdpbusd's unsigned
  // operand as it lies); a partial last run alike, byte 4 g t + 4 j + r.
  // Q4_Kx2: two Q4_K super-blocks (16 sub-blocks) a run: d, d, dmin, dmin (float16); per sub-block
  // the low 4 bits of its scale and of its min in one byte (16 bytes); the scales' top 2 bits, 2 a
  // sub-block in a little-endian uint32, then the mins' (8 bytes).
  // Q5_Kx2: as Q4_Kx2 (the 5-bit codes' low 4 bits as its nibbles), then their fifth bits (64 bytes:
  // bit 2 l + h of byte 4 j + r is that of the value in nibble h of byte 64 l + 4 j + r).
  // Q6_Kx1: a Q6_K super-block (16 sub-blocks of 16) a run of 256 values, its 6-bit codes' low 4 bits
  // (128 bytes: byte 64 L + 4 j + r holds sub-block j's values 8 L + r and 8 L + 4 + r), their top
  // 2 bits (64 bytes: bits 2 t of byte 4 j + r for value 4 t + r), then its 16 int8 scales and d.
  kQ4_0x16 = 1002, kQ5_0x16 = 1006, kQ8_0x16 = 1008, kQ4_Kx2 = 1012, kQ5_Kx2 = 1013, kQ6_Kx1 = 1014,
};
constexpr int64_t kRunValues = 512, kRunBytes = 288;  // Q4_0x16's and Q4_Kx2's runs: values and bytes
constexpr int64_t kQ5RunBytes = 352;  // Q5_0x16's and Q5_Kx2's: the fifth bits after the same 288
constexpr int64_t kQ8RunBytes = 544;  // Q8_0x16's: 16 scales and 512 codes
inline constexpr int64_t run_bytes(Type type) {
  return type == kQ8_0x16 ? kQ8RunBytes : type == kQ5_Kx2 || type == kQ5_0x16 ? kQ5RunBytes : kRunBytes;
}
constexpr int64_t kQ4_0x16Blocks = 16;

struct TypeInfo {
  const char* name;
  Type type;
  int64_t block_values, block_bytes;
};

constexpr TypeInfo kTypes[] = {
    {"F32", kF32, 1, 4},        {"F16", kF16, 1, 2},        {"BF16", kBF16, 1, 2},
    {"Q8_0", kQ8_0, 32, 34},    {"Q4_0", kQ4_0, 32, 18},    {"Q4_1", kQ4_1, 32, 20},
    {"Q5_0", kQ5_0, 32, 22},    {"Q5_1", kQ5_1, 32, 24},    {"Q4_K", kQ4_K, 256, 144},
    {"Q5_K", kQ5_K, 256, 176},  {"Q6_K", kQ6_K, 256, 210},  {"Q4_0x16", kQ4_0x16, 32, 18},
    {"Q5_0x16", kQ5_0x16, 32, 22},  {"Q8_0x16", kQ8_0x16, 32, 34},  {"Q4_Kx2", kQ4_Kx2, 256, 144},  {"Q5_Kx2", kQ5_Kx2, 256, 176},  {"Q6_Kx1", kQ6_Kx1, 256, 210},
};

// The type's entry, or null for one the kernels do not take.
inline const TypeInfo* type_info(int64_t type) {
  for (const TypeInfo& t : kTypes)
    if (t.type == type) return &t;
  return nullptr;
}

inline float f16(const uint8_t* p) {  // a little-endian float16 at any alignment
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K/Q5_K: sub-block j's 6-bit scale and min, from the super-block's 12 bytes of them.
inline void k_scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of `type` at b -> its block_values floats, each computed as the reference does (one
// rounding per operation, in its order: a product's rounding before a sum's). Not for the
// row-level layouts (dequantize_row).
inline void dequantize_block(Type type, const uint8_t* b, float* y) {
  switch (type) {
    case kQ4_0x16:
    case kQ5_0x16:
    case kQ8_0x16:
    case kQ4_Kx2:
    case kQ5_Kx2:
    case kQ6_Kx1: return;
    case kF32: std::memcpy(y, b, 4); return;
    case kF16: y[0] = f16(b); return;
    case kBF16: {
      const uint32_t u = static_cast<uint32_t>(b[0] | (b[1] << 8)) << 16;
      std::memcpy(y, &u, 4);
      return;
    }
    case kQ8_0: {
      const float d = f16(b);
      for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
      return;
    }
    case kQ4_0: {
      const float d = f16(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((b[2 + i] & 0xF) - 8);
        y[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
      }
      return;
    }
    case kQ4_1: {
      const float d = f16(b), m = f16(b + 2);
      for (int i = 0; i < 16; ++i) {
        const float lo = d * static_cast<float>(b[4 + i] & 0xF), hi = d * static_cast<float>(b[4 + i] >> 4);
        y[i] = lo + m;
        y[i + 16] = hi + m;
      }
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool with_min = type == kQ5_1;
      const float d = f16(b), m = with_min ? f16(b + 2) : 0.f;
      const uint8_t* qh_bytes = b + (with_min ? 4 : 2);
      const uint8_t* qs = qh_bytes + 4;
      uint32_t qh;
      std::memcpy(&qh, qh_bytes, 4);
      for (int i = 0; i < 16; ++i) {
        const int lo = (qs[i] & 0xF) | (((qh >> i) & 1) << 4), hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        if (with_min) {
          const float a = d * static_cast<float>(lo), c = d * static_cast<float>(hi);
          y[i] = a + m;
          y[i + 16] = c + m;
        } else {
          y[i] = d * static_cast<float>(lo - 16);
          y[i + 16] = d * static_cast<float>(hi - 16);
        }
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = type == kQ5_K;
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {  // sub-block j: low nibbles of qs[32 (j/2) ...] for even j, high for odd
        int sc, mn;
        k_scale_min(j, scales, sc, mn);
        const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
        const uint8_t* q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0xF);
          if (five) v |= ((qh[l] >> j) & 1) << 4;
          const float p = dj * static_cast<float>(v);
          y[32 * j + l] = p - mj;
        }
      }
      return;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = (d * static_cast<float>(sc[is])) * static_cast<float>(q1);
          y[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
          y[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
          y[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
  }
}

// A Q4_Kx2 run's sub-block j (0..15): its 6-bit scale and min.
inline void run_scale_min(const uint8_t* run, int j, int& sc, int& m) {
  uint32_t high_sc, high_m;
  std::memcpy(&high_sc, run + 24, 4);
  std::memcpy(&high_m, run + 28, 4);
  sc = (run[8 + j] & 0xF) | static_cast<int>(((high_sc >> (2 * j)) & 3) << 4);
  m = (run[8 + j] >> 4) | static_cast<int>(((high_m >> (2 * j)) & 3) << 4);
}

// A row of K values of `type` -> K floats, computed as dequantize_block computes each block.
inline void dequantize_row(Type type, const uint8_t* row, int64_t K, float* y) {
  int64_t k = 0;
  if (type == kQ6_Kx1) {  // as dequantize_block's Q6_K: (d * scale) * (code - 32)
    for (; k < K; k += 256) {
      const uint8_t* run = row + k / 256 * 210;
      const float d = f16(run + 208);
#if defined(__AVX2__)
      alignas(32) uint8_t codes[256];  // byte 64 t + 4 j + r: sub-block j's value 4 t + r
      for (int h = 0; h < 2; ++h) {
        const auto load = [&](int at) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + at + 32 * h)); };
        const __m256i lo0 = load(0), lo1 = load(64), hi = load(128);
        const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(lo0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top2)),
            _mm256_or_si256(_mm256_and_si256(lo1, low4), _mm256_and_si256(hi, top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2))};
        for (int t = 0; t < 4; ++t) _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 64 * t + 32 * h), u[t]);
      }
      for (int j = 0; j < 16; ++j) {
        uint32_t words[4];
        for (int t = 0; t < 4; ++t) std::memcpy(words + t, codes + 64 * t + 4 * j, 4);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
        const __m256 dj = _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(run[192 + j])));
        for (int i = 0; i < 2; ++i) {
          const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(i ? _mm_srli_si128(bytes, 8) : bytes), _mm256_set1_epi32(32));
          _mm256_storeu_ps(y + k + 16 * j + 8 * i, _mm256_mul_ps(dj, _mm256_cvtepi32_ps(q)));
        }
      }
      continue;
#endif
      for (int j = 0; j < 16; ++j) {
        const float dj = d * static_cast<float>(static_cast<int8_t>(run[192 + j]));
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 4; ++r) {
            const uint8_t low = run[64 * (t / 2) + 4 * j + r];
            const int code = ((t % 2 ? low >> 4 : low & 0xF) | (((run[128 + 4 * j + r] >> (2 * t)) & 3) << 4)) - 32;
            y[k + 16 * j + 4 * t + r] = dj * static_cast<float>(code);
          }
      }
    }
    return;
  }
  if (type == kQ8_0x16) {  // as dequantize_block's Q8_0: code * d; whole runs, then a last run of g
    for (; k < K; k += kRunValues) {
      const uint8_t* run = row + k / kRunValues * kQ8RunBytes;
      const int g = static_cast<int>(std::min<int64_t>(16, (K - k) / 32));
      const uint8_t* codes = run + 2 * g;
      for (int j = 0; j < g; ++j) {
        const float d = f16(run + 2 * j);
#if defined(__AVX2__)
        for (int i = 0; i < 4; ++i) {  // values 8 i .. 8 i + 7: bytes 4 g t + 4 j of t = 2 i, 2 i + 1
          uint32_t words[2];
          std::memcpy(words, codes + 4 * g * (2 * i) + 4 * j, 4);
          std::memcpy(words + 1, codes + 4 * g * (2 * i + 1) + 4 * j, 4);
          const __m128i u = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(words)), _mm_set1_epi8(-128));
          _mm256_storeu_ps(y + k + 32 * j + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u)), _mm256_set1_ps(d)));
        }
        continue;
#endif
        for (int t = 0; t < 8; ++t)
          for (int r = 0; r < 4; ++r)
            y[k + 32 * j + 4 * t + r] = static_cast<float>(static_cast<int8_t>(codes[4 * g * t + 4 * j + r] ^ 0x80)) * d;
      }
    }
    return;
  }
  if (type == kQ4_0x16 || type == kQ5_0x16 || type == kQ4_Kx2 || type == kQ5_Kx2) {
    // whole runs of 16 groups; the legacy layouts' blocks past them, a last run of g
    const bool legacy = type == kQ4_0x16 || type == kQ5_0x16, five = type == kQ5_0x16 || type == kQ5_Kx2;
    const int bias = type == kQ4_0x16 ? 8 : 16;  // the legacy codes' offset
    for (; k < K && (k + kRunValues <= K || legacy); k += kRunValues) {
      const uint8_t* run = row + k / kRunValues * run_bytes(type);
      const int g = static_cast<int>(std::min<int64_t>(16, (K - k) / 32));
      const uint8_t* nibbles = run + (legacy ? 2 * g : 32);
      const uint8_t* fifth = nibbles + 16 * g;  // the 5-bit layouts' fifth bits
      float scale[16], offset[16];  // value = scale * code - offset (legacy: scale * (code - bias))
      for (int j = 0; j < g; ++j) {
        if (legacy) {
          scale[j] = f16(run + 2 * j);
          offset[j] = 0.f;
        } else {  // as dequantize_block's Q4_K
          int sc, mn;
          run_scale_min(run, j, sc, mn);
          scale[j] = f16(run + 2 * (j / 8)) * static_cast<float>(sc);
          offset[j] = f16(run + 4 + 2 * (j / 8)) * static_cast<float>(mn);
        }
      }
#if defined(__AVX2__)
      for (int j = 0; j < g; ++j) {  // group j's 16 bytes, 4 from each 4 g, as 32 values in order
        uint32_t words[4];
        for (int l = 0; l < 4; ++l) std::memcpy(words + l, nibbles + 4 * g * l + 4 * j, 4);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
        const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        __m128i codes[2] = {_mm_unpacklo_epi32(lo, hi), _mm_unpackhi_epi32(lo, hi)};  // values 8 l + 4 h + r
        if (five) {  // value v's fifth bit: bit v / 4 of byte v % 4 (32-bit lane i = v / 4 shifted by i)
          uint32_t bits;
          std::memcpy(&bits, fifth + 4 * j, 4);
          const __m256i f = _mm256_slli_epi32(
              _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                               _mm256_set1_epi8(1)), 4);
          codes[0] = _mm_or_si128(codes[0], _mm256_castsi256_si128(f));
          codes[1] = _mm_or_si128(codes[1], _mm256_extracti128_si256(f, 1));
        }
        const __m256 sj = _mm256_set1_ps(scale[j]), oj = _mm256_set1_ps(offset[j]);
        for (int i = 0; i < 4; ++i) {
          __m256i q = _mm256_cvtepu8_epi32(i % 2 ? _mm_srli_si128(codes[i / 2], 8) : codes[i / 2]);
          if (legacy) q = _mm256_sub_epi32(q, _mm256_set1_epi32(bias));
          const __m256 p = _mm256_mul_ps(sj, _mm256_cvtepi32_ps(q));
          _mm256_storeu_ps(y + k + 32 * j + 8 * i, legacy ? p : _mm256_sub_ps(p, oj));
        }
      }
      continue;
#endif
      for (int j = 0; j < g; ++j)  // group j's values 8 l .. 8 l + 7 from bytes 4 g l + 4 j .. + 3
        for (int l = 0; l < 4; ++l)
          for (int r = 0; r < 4; ++r) {
            const uint8_t byte = nibbles[4 * g * l + 4 * j + r];
            float* out = y + k + 32 * j + 8 * l + r;
            const int f = five ? fifth[4 * j + r] >> (2 * l) : 0;
            const int lo = (byte & 0xF) | (f & 1) << 4, hi = (byte >> 4) | (f & 2) << 3;
            if (legacy) {
              out[0] = scale[j] * static_cast<float>(lo - bias);
              out[4] = scale[j] * static_cast<float>(hi - bias);
            } else {
              out[0] = scale[j] * static_cast<float>(lo) - offset[j];
              out[4] = scale[j] * static_cast<float>(hi) - offset[j];
            }
          }
    }
    if (legacy) return;
    type = five ? kQ5_K : kQ4_K;  // the blocks past the last run
  }
  const TypeInfo* info = type_info(type);
  for (int64_t b = k / info->block_values; b < K / info->block_values; ++b)
    dequantize_block(type, row + b * info->block_bytes, y + b * info->block_values);
}

}  // namespace dabba::gguf

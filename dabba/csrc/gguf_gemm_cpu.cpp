// The GGUF GEMM in integers (gguf_gemm.h): GGUF's blocks decoded into the panels of 8-bit codes
// that code_gemm.h multiplies, 16 rows at a time in registers where a run layout (gguf_blocks.h)
// holds them, row by row elsewhere.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "bf16_tiles.h"
#include "code_gemm.h"
#include "cpu_ops.h"
#include "gguf_gemm.h"

#include <algorithm>
#include <cstring>

namespace dabba::gguf {

#ifdef DABBA_HAVE_CODE_GEMM
namespace {

using code_gemm::kPanel;
using code_gemm::Panel;

inline int sub_block(Type t) { return t == kQ6_K || t == kQ6_Kx1 ? 16 : 32; }
inline bool has_min(Type t) { return t == kQ4_1 || t == kQ5_1 || t == kQ4_K || t == kQ5_K || t == kQ4_Kx2 || t == kQ5_Kx2; }
inline int code_bias(Type t) {
  switch (t) {
    case kQ4_0: case kQ4_0x16: return 8;
    case kQ5_0: case kQ5_0x16: return 16;
    case kQ8_0: case kQ8_0x16: return 128;
    case kQ6_K: case kQ6_Kx1: return 32;
    default: return 0;
  }
}

// A row of K values of `type` -> its unsigned codes in order, and per sub-block (sub_block(type)
// values) its scale s and offset o: value = s * code - o, or s * (code - code_bias) where no min.
void decode_row(Type type, const uint8_t* row, int64_t K, uint8_t* codes, float* s, float* o) {
  switch (type) {
    case kQ8_0:
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + 34 * b;
        s[b] = f16(blk);
        for (int i = 0; i < 32; ++i) codes[32 * b + i] = blk[2 + i] ^ 0x80;
      }
      return;
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {  // d, [m], [the fifth bits, 32 in a word], 16 bytes of nibbles
      const bool min = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
      const int64_t bytes = type_info(type)->block_bytes;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + bytes * b;
        s[b] = f16(blk);
        o[b] = min ? -f16(blk + 2) : 0.f;
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, blk + (min ? 4 : 2), 4);
        const uint8_t* qs = blk + bytes - 16;
        for (int i = 0; i < 16; ++i) {
          codes[32 * b + i] = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
          codes[32 * b + 16 + i] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
      }
      return;
    }
    case kQ4_K:
    case kQ5_K:
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const bool five = type == kQ5_K;
        const uint8_t* blk = row + (five ? 176 : 144) * sb;
        const float d = f16(blk), dmin = f16(blk + 2);
        const uint8_t* qh = blk + 16;
        const uint8_t* qs = blk + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          k_scale_min(j, blk + 4, sc, mn);
          s[8 * sb + j] = d * static_cast<float>(sc);
          o[8 * sb + j] = dmin * static_cast<float>(mn);
          const uint8_t* q = qs + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            int v = (j & 1) ? (q[l] >> 4) : (q[l] & 0xF);
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            codes[256 * sb + 32 * j + l] = static_cast<uint8_t>(v);
          }
        }
      }
      return;
    case kQ6_K:
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* ql = row + 210 * sb;
        const uint8_t* qh = ql + 128;
        const auto* sc = reinterpret_cast<const int8_t*>(ql + 192);
        const float d = f16(ql + 208);
        for (int j = 0; j < 16; ++j) s[16 * sb + j] = d * static_cast<float>(sc[j]);
        uint8_t* c = codes + 256 * sb;
        for (int half = 0; half < 2; ++half, c += 128, ql += 64, qh += 32)
          for (int l = 0; l < 32; ++l) {
            c[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            c[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            c[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            c[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          }
      }
      return;
    case kQ6_Kx1:
      for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* run = row + 210 * sb;
        const float d = f16(run + 208);
        for (int j = 0; j < 16; ++j) {
          s[16 * sb + j] = d * static_cast<float>(static_cast<int8_t>(run[192 + j]));
          for (int t = 0; t < 4; ++t)
            for (int r = 0; r < 4; ++r) {
              const uint8_t low = run[64 * (t / 2) + 4 * j + r];
              codes[256 * sb + 16 * j + 4 * t + r] =
                  (t % 2 ? low >> 4 : low & 0xF) | (((run[128 + 4 * j + r] >> (2 * t)) & 3) << 4);
            }
        }
      }
      return;
    case kQ8_0x16:
      for (int64_t k = 0; k < K; k += kRunValues) {
        const uint8_t* run = row + k / kRunValues * kQ8RunBytes;
        const int g = static_cast<int>(std::min<int64_t>(16, (K - k) / 32));
        for (int j = 0; j < g; ++j) {
          s[k / 32 + j] = f16(run + 2 * j);
          for (int t = 0; t < 8; ++t) std::memcpy(codes + k + 32 * j + 4 * t, run + 2 * g + 4 * g * t + 4 * j, 4);
        }
      }
      return;
    case kQ4_0x16:
    case kQ5_0x16:
    case kQ4_Kx2:
    case kQ5_Kx2: {
      const bool legacy = type == kQ4_0x16 || type == kQ5_0x16, five = type == kQ5_0x16 || type == kQ5_Kx2;
      int64_t k = 0;
      for (; k < K && (k + kRunValues <= K || legacy); k += kRunValues) {
        const uint8_t* run = row + k / kRunValues * run_bytes(type);
        const int g = static_cast<int>(std::min<int64_t>(16, (K - k) / 32));
        const uint8_t* nibbles = run + (legacy ? 2 * g : 32);
        const uint8_t* fifth = nibbles + 16 * g;
        for (int j = 0; j < g; ++j) {
          if (legacy) {
            s[k / 32 + j] = f16(run + 2 * j);
          } else {
            int sc, mn;
            run_scale_min(run, j, sc, mn);
            s[k / 32 + j] = f16(run + 2 * (j / 8)) * static_cast<float>(sc);
            o[k / 32 + j] = f16(run + 4 + 2 * (j / 8)) * static_cast<float>(mn);
          }
          for (int l = 0; l < 4; ++l)
            for (int r = 0; r < 4; ++r) {
              const uint8_t byte = nibbles[4 * g * l + 4 * j + r];
              const int f = five ? fifth[4 * j + r] >> (2 * l) : 0;
              codes[k + 32 * j + 8 * l + r] = static_cast<uint8_t>((byte & 0xF) | (f & 1) << 4);
              codes[k + 32 * j + 8 * l + 4 + r] = static_cast<uint8_t>((byte >> 4) | (f & 2) << 3);
            }
        }
      }
      if (k < K)  // a K type's super-block past the last run: the file's
        decode_row(five ? kQ5_K : kQ4_K, row + k / kRunValues * run_bytes(type), K - k, codes + k, s + k / 32, o + k / 32);
      return;
    }
    default: TORCH_CHECK(false, "gguf integer GEMM: type ", static_cast<int64_t>(type), " has no codes");
  }
}

// A row's codes, s and o as decode_row gives them, before place_rows spreads them over the panel:
// each thread's own, kept from call to call.
struct RowScratch {
  std::vector<uint8_t> codes;
  std::vector<float> s, o;
};
thread_local RowScratch row_scratch;

// Channels c0 .. c1 of the panel, row by row: values [k0, K) of each (rows[c]: the bytes of value k0
// on), from decode_row.
void place_rows(const GemmSegment& seg, int64_t K, int64_t k0, const uint8_t* (&rows)[kPanel], int c0, int c1,
                Panel& p) {
  const int S = sub_block(seg.type);
  const int64_t n = K - k0, b0 = k0 / S;
  RowScratch& row = row_scratch;
  row.codes.resize(n);
  row.s.resize(n / S);
  row.o.assign(n / S, 0.f);
  for (int c = c0; c < c1; ++c) {
    decode_row(seg.type, rows[c], n, row.codes.data(), row.s.data(), row.o.data());
    uint32_t* dst = reinterpret_cast<uint32_t*>(p.codes.data()) + k0 / 4 * kPanel + c;
    for (int64_t q = 0; q < n / 4; ++q) std::memcpy(dst + q * kPanel, row.codes.data() + 4 * q, 4);
    for (int64_t b = 0; b < n / S; ++b) {
      p.s[(b0 + b) * kPanel + c] = row.s[b];
      p.o[(b0 + b) * kPanel + c] = row.o[b];
    }
  }
}

// The run layouts' whole runs of 16 rows (one line of the panel) in registers: each run's vector v
// of a row holds, in lane j, the 4 codes of quad Qv j + v of the run (Qv: 8 for runs of 512 values,
// 4 for Q6_Kx1's 256), and one 16 x 16 transpose of the 16 rows' vectors gives the lines of those
// quads; the 16 sub-blocks' scales (and mins) alike. Codes as decode_row gives them, bit for bit.
// Runs u0 .. u1 of g groups each: 16, or a legacy layout's last run of fewer (its bytes laid out
// alike, 4 g apart: loads masked to g lanes).
template <Type kType>
void place_runs(const uint8_t* (&rows)[kPanel], int line, int64_t u0, int64_t u1, int g, Panel& p) {
  constexpr bool q6 = kType == kQ6_Kx1, q8 = kType == kQ8_0x16;
  constexpr bool five = kType == kQ5_0x16 || kType == kQ5_Kx2, k = kType == kQ4_Kx2 || kType == kQ5_Kx2;
  constexpr int values = q6 ? 256 : 512, vectors = values / 64, qv = vectors;
  constexpr int64_t bytes = q6 ? 210 : run_bytes(kType);
  const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1), three = _mm512_set1_epi8(3);
  uint32_t* codes = reinterpret_cast<uint32_t*>(p.codes.data());
  const __mmask16 lanes = static_cast<__mmask16>(g == 16 ? 0xFFFF : (1u << g) - 1);
  const auto load = [&](const uint8_t* at) { return _mm512_maskz_loadu_epi32(lanes, at); };
  for (int64_t u = u0; u < u1; ++u) {
    for (int v = 0; v < vectors; ++v) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const uint8_t* run = rows[16 * line + c] + u * bytes;
        if constexpr (q8) {
          r[c] = load(run + 2 * g + 4 * g * v);
        } else if constexpr (q6) {  // v = t: nibble t % 2 of bytes 64 (t / 2) .., top bits 2 t of 128 ..
          const __m512i lo = _mm512_loadu_si512(run + 64 * (v / 2)), top = _mm512_loadu_si512(run + 128);
          const __m512i nib = _mm512_and_si512(v % 2 ? _mm512_srli_epi16(lo, 4) : lo, low4);
          r[c] = _mm512_or_si512(nib, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(top, _mm_cvtsi32_si128(2 * v)), three), 4));
        } else {  // v = 2 l + h: nibble h of bytes 64 l ..; the fifth bit 2 l + h of bytes 256 ..
          const __m512i nibbles = load(run + 2 * g + 4 * g * (v / 2));
          r[c] = _mm512_and_si512(v % 2 ? _mm512_srli_epi16(nibbles, 4) : nibbles, low4);
          if constexpr (five) {
            const __m512i f = load(run + 2 * g + 16 * g);
            r[c] = _mm512_or_si512(r[c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(f, _mm_cvtsi32_si128(v)), one), 4));
          }
        }
      }
      transpose16(r);
      for (int j = 0; j < g; ++j)
        _mm512_storeu_si512(codes + (u * values / 4 + qv * j + v) * kPanel + 16 * line, r[j]);
    }
    __m512i s[16], o[16];
    for (int c = 0; c < 16; ++c) {
      const uint8_t* run = rows[16 * line + c] + u * bytes;
      if constexpr (q6) {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 192))));
        s[c] = _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(f16(run + 208)), sc));
      } else if constexpr (k) {  // as run_scale_min: low 4 bits in bytes 8 .., top 2 in the words at 24 and 28
        uint32_t high_sc, high_m;
        std::memcpy(&high_sc, run + 24, 4);
        std::memcpy(&high_m, run + 28, 4);
        const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 8)));
        const __m512i three32 = _mm512_set1_epi32(3), low32 = _mm512_set1_epi32(0xF);
        const __m512i sc = _mm512_or_si512(_mm512_and_si512(b, low32), _mm512_slli_epi32(
            _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(high_sc)), shifts), three32), 4));
        const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(b, 4), _mm512_slli_epi32(
            _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(high_m)), shifts), three32), 4));
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(f16(run)), _mm256_set1_ps(f16(run + 2)), 1);
        const __m512 dmin = _mm512_insertf32x8(_mm512_set1_ps(f16(run + 4)), _mm256_set1_ps(f16(run + 6)), 1);
        s[c] = _mm512_castps_si512(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        o[c] = _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
      } else {  // 16 float16 scales first
        s[c] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, run)));
      }
    }
    transpose16(s);
    if constexpr (k) transpose16(o);
    for (int j = 0; j < g; ++j) {
      _mm512_storeu_si512(p.s.data() + (u * 16 + j) * kPanel + 16 * line, s[j]);
      if constexpr (k) _mm512_storeu_si512(p.o.data() + (u * 16 + j) * kPanel + 16 * line, o[j]);
    }
  }
}

// Channels first .. first + kPanel of the segment (those it has) into p.
void make_panel(const GemmSegment& seg, int64_t K, int64_t first, Panel& p) {
  const int64_t count = std::min<int64_t>(kPanel, seg.rows - first);
  const uint8_t* rows[kPanel];
  for (int64_t c = 0; c < count; ++c) rows[c] = seg.data + (first + c) * seg.row_bytes;
  const Type t = seg.type;
  const int64_t values = t == kQ6_Kx1 ? 256 : kRunValues, bytes = t == kQ6_Kx1 ? 210 : run_bytes(t);
  const bool layout = t == kQ4_0x16 || t == kQ5_0x16 || t == kQ8_0x16 || t == kQ4_Kx2 || t == kQ5_Kx2 || t == kQ6_Kx1;
  const int64_t runs = layout ? K / values : 0;
  const bool legacy = t == kQ4_0x16 || t == kQ5_0x16 || t == kQ8_0x16;
  const int tail = legacy ? static_cast<int>(K % kRunValues / 32) : 0;  // a legacy last run's groups
  int lines = 0;  // of 16 whole rows, from runs in registers
  for (; (runs > 0 || tail > 0) && 16 * (lines + 1) <= count; ++lines) {
    const auto place = [&](int64_t u0, int64_t u1, int g) {
      switch (t) {
        case kQ4_0x16: return place_runs<kQ4_0x16>(rows, lines, u0, u1, g, p);
        case kQ5_0x16: return place_runs<kQ5_0x16>(rows, lines, u0, u1, g, p);
        case kQ8_0x16: return place_runs<kQ8_0x16>(rows, lines, u0, u1, g, p);
        case kQ4_Kx2: return place_runs<kQ4_Kx2>(rows, lines, u0, u1, g, p);
        case kQ5_Kx2: return place_runs<kQ5_Kx2>(rows, lines, u0, u1, g, p);
        default: return place_runs<kQ6_Kx1>(rows, lines, u0, u1, g, p);
      }
    };
    place(0, runs, 16);
    if (tail > 0) place(runs, runs + 1, tail);
  }
  if (runs * values < K && tail == 0 && lines > 0) {  // a K row's super-block past its runs: the file's
    const uint8_t* rest[kPanel];
    for (int c = 0; c < 16 * lines; ++c) rest[c] = rows[c] + runs * bytes;
    place_rows(seg, K, runs * values, rest, 0, 16 * lines, p);
  }
  place_rows(seg, K, 0, rows, 16 * lines, static_cast<int>(count), p);  // the rest, row by row
}

}  // namespace

template <typename T>
void integer_gemm(const std::vector<A8Rows>& passes, int64_t M, int64_t K, const GemmSegment& seg, const T* bias,
                  T* y, int64_t ldy) {
  const code_gemm::CodeForm form{sub_block(seg.type), code_bias(seg.type), has_min(seg.type), is_k_quant(seg.type)};
  code_gemm::code_gemm<T>(passes, M, K, form, seg.rows, seg.column,
                          [&](int64_t first, Panel& p) { make_panel(seg, K, first, p); }, bias, y, ldy);
}

#else  // no AVX512-VNNI: gguf_linear_cpu.cpp never calls it (integer_gemm_usable)

template <typename T>
void integer_gemm(const std::vector<A8Rows>&, int64_t, int64_t, const GemmSegment&, const T*, T*, int64_t) {
  TORCH_CHECK(false, "gguf integer GEMM: not in this build");
}

#endif

template void integer_gemm<float>(const std::vector<A8Rows>&, int64_t, int64_t, const GemmSegment&, const float*,
                                  float*, int64_t);
template void integer_gemm<c10::BFloat16>(const std::vector<A8Rows>&, int64_t, int64_t, const GemmSegment&,
                                          const c10::BFloat16*, c10::BFloat16*, int64_t);

}  // namespace dabba::gguf

// The GGUF GEMM in integers (gguf_gemm.h). Each thread takes kPanel output channels at a time:
// their rows are decoded into a panel of unsigned 8-bit codes, 16 channels' 4 consecutive codes in
// each 64-byte line (vpdpbusd's unsigned operand as it lies, W8A8's order), with each sub-block's
// scale s and offset o per channel (value = s * code - o; a type without a min keeps its codes'
// bias b instead, value = s * (code - b)). Every x pass then meets the panel while it sits in L2:
// 4 of x's codes broadcast against each line; a sub-block's int32 sums start at -b * the sum of x's
// codes over it (the bias, folded exactly), and are scaled into float32 by x's scale and s (less
// o * x's sum, where the type has a min). The panel is made per call (the file's bytes stay the
// only copy of the weights): its cost is a row's decoding against a pass's dot products for
// every row of x.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "cpu_math.h"
#include "cpu_ops.h"
#include "bf16_tiles.h"
#include "gguf_gemm.h"

#include <algorithm>
#include <cstring>

namespace dabba::gguf {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
namespace {

constexpr int kPanel = 32;  // output channels a panel holds: two vpdpbusd lines of 16

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

// kPanel channels' codes, [K / 4][kPanel][4], and their sub-blocks' s and o, [B][kPanel]; channels
// past the segment's rows hold zeros.
struct Panel {
  std::vector<uint8_t> codes, row_codes;
  std::vector<float> s, o, row_s, row_o;
};

// Channels c0 .. c1 of the panel, row by row: values [k0, K) of each (rows[c]: the bytes of value k0
// on), from decode_row.
void place_rows(const GemmSegment& seg, int64_t K, int64_t k0, const uint8_t* (&rows)[kPanel], int c0, int c1,
                Panel& p) {
  const int S = sub_block(seg.type);
  const int64_t n = K - k0, b0 = k0 / S;
  p.row_codes.resize(n);
  p.row_s.resize(n / S);
  p.row_o.assign(n / S, 0.f);
  for (int c = c0; c < c1; ++c) {
    decode_row(seg.type, rows[c], n, p.row_codes.data(), p.row_s.data(), p.row_o.data());
    uint32_t* dst = reinterpret_cast<uint32_t*>(p.codes.data()) + k0 / 4 * kPanel + c;
    for (int64_t q = 0; q < n / 4; ++q) std::memcpy(dst + q * kPanel, p.row_codes.data() + 4 * q, 4);
    for (int64_t b = 0; b < n / S; ++b) {
      p.s[(b0 + b) * kPanel + c] = p.row_s[b];
      p.o[(b0 + b) * kPanel + c] = p.row_o[b];
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

void make_panel(const GemmSegment& seg, int64_t K, int64_t first, Panel& p) {
  const int S = sub_block(seg.type);
  const int64_t B = K / S, count = std::min<int64_t>(kPanel, seg.rows - first);
  p.codes.resize(K / 4 * kPanel * 4);
  p.s.resize(B * kPanel);
  p.o.resize(B * kPanel);
  if (count < kPanel) {  // channels past the rows: zeros
    std::fill(p.codes.begin(), p.codes.end(), 0);
    std::fill(p.s.begin(), p.s.end(), 0.f);
    std::fill(p.o.begin(), p.o.end(), 0.f);
  }
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

// x's side of a sub-block, per row: its scale, its scale times its codes' sum (a min's factor), and
// where the sums start (-bias * the codes' sum), [M][B]
struct XSide {
  std::vector<float> dx, xo;
  std::vector<int32_t> init;
};

void make_x_side(const std::vector<A8Rows>& passes, int64_t M, int64_t K, Type type, XSide& x) {
  const int S = sub_block(type), bias = code_bias(type);
  const bool k = is_k_quant(type);
  const int64_t B = K / S;
  x.dx.resize(M * B);
  x.xo.resize(M * B);
  x.init.resize(M * B);
  at::parallel_for(0, static_cast<int64_t>((M + kGgufGemvPassRows - 1) / kGgufGemvPassRows), 1,
                   [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const A8Rows& a = passes[p];
      for (int64_t r = 0; r < a.M; ++r) {
        const int64_t m = p * kGgufGemvPassRows + r;
        const int8_t* q = k ? a.qk.data() + r * K : a.q.data() + r * a.blocks * kA8Block;
        for (int64_t b = 0; b < B; ++b) {
          int sum = 0;
          for (int i = 0; i < S; ++i) sum += q[b * S + i];
          const float d = k ? a.dk[r * (K / kSuperBlock) + b * S / kSuperBlock] : a.d[r * a.blocks + b];
          x.dx[m * B + b] = d;
          x.xo[m * B + b] = d * static_cast<float>(sum);
          x.init[m * B + b] = -bias * sum;
        }
      }
    }
  });
}

// R rows of x against a panel's two lines of 16 channels, over every sub-block: acc[r][line]
template <int R, int S, bool kMin>
inline void tile(const Panel& p, int64_t B, const int8_t* xq, int64_t ldq, const float* dx, const float* xo,
                 const int32_t* init, int64_t ldb, __m512 (&acc)[R][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint8_t* wc = p.codes.data();
  for (int64_t b = 0; b < B; ++b) {
    __m512i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_set1_epi32(init[r * ldb + b]);
    const uint8_t* wb = wc + b * (S / 4) * kPanel * 4;
    const int8_t* xb = xq + b * S;
    for (int q = 0; q < S / 4; ++q) {
      const __m512i w0 = _mm512_loadu_si512(wb + q * kPanel * 4), w1 = _mm512_loadu_si512(wb + q * kPanel * 4 + 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xb + r * ldq + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(quad);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, a);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, a);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(p.s.data() + b * kPanel), s1 = _mm512_loadu_ps(p.s.data() + b * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dx[r * ldb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][0]), d), s0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums[r][1]), d), s1, acc[r][1]);
    }
    if constexpr (kMin) {
      const __m512 o0 = _mm512_loadu_ps(p.o.data() + b * kPanel), o1 = _mm512_loadu_ps(p.o.data() + b * kPanel + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_set1_ps(xo[r * ldb + b]);
        acc[r][0] = _mm512_fnmadd_ps(o0, v, acc[r][0]);
        acc[r][1] = _mm512_fnmadd_ps(o1, v, acc[r][1]);
      }
    }
  }
}

// 16 float32 -> bfloat16 bits, rounded to nearest even as from_float (finite values)
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

// 16 sums into y[col .. col + 16) (the first `count`), rounded to T before a bias adds to it, as the
// reference's F.linear then + bias
inline void store16(__m512 v, const float* bias, float* y, __mmask16 mask) {
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, v);
}
inline void store16(__m512 v, const c10::BFloat16* bias, c10::BFloat16* y, __mmask16 mask) {
  __m256i h = to_bf16(v);
  if (bias) {
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
    h = to_bf16(_mm512_add_ps(rounded, b));
  }
  _mm256_mask_storeu_epi16(y, mask, h);
}

template <int S, bool kMin, typename T>
void panels(const std::vector<A8Rows>& passes, int64_t M, int64_t K, const GemmSegment& seg, const XSide& x,
            const T* bias, T* y, int64_t ldy) {
  const int64_t B = K / S, count = (seg.rows + kPanel - 1) / kPanel;
  const bool k = is_k_quant(seg.type);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    thread_local Panel p;  // each thread's own, kept from call to call
    for (int64_t i = begin; i < end; ++i) {
      make_panel(seg, K, i * kPanel, p);
      const int64_t col = seg.column + i * kPanel, channels = std::min<int64_t>(kPanel, seg.rows - i * kPanel);
      const __mmask16 m0 = static_cast<__mmask16>(channels >= 16 ? 0xFFFF : (1u << channels) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(channels >= 32 ? 0xFFFF : channels <= 16 ? 0 : (1u << (channels - 16)) - 1);
      for (size_t pass = 0; pass * kGgufGemvPassRows < static_cast<size_t>(M); ++pass) {
        const A8Rows& a = passes[pass];
        const int64_t m = pass * kGgufGemvPassRows;
        const int8_t* xq = k ? a.qk.data() : a.q.data();
        const int64_t ldq = k ? K : a.blocks * kA8Block;
        with_count<kGgufGemvPassRows>(a.M, [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          __m512 acc[R][2];
          tile<R, S, kMin>(p, B, xq, ldq, x.dx.data() + m * B, x.xo.data() + m * B, x.init.data() + m * B, B, acc);
          for (int r = 0; r < R; ++r) {
            T* yr = y + (m + r) * ldy + col;
            const T* b = bias ? bias + col : nullptr;
            store16(acc[r][0], b, yr, m0);
            if (m1) store16(acc[r][1], b ? b + 16 : nullptr, yr + 16, m1);
          }
        });
      }
    }
  });
}

}  // namespace

template <typename T>
void integer_gemm(const std::vector<A8Rows>& passes, int64_t M, int64_t K, const GemmSegment& seg, const T* bias,
                  T* y, int64_t ldy) {
  XSide x;
  make_x_side(passes, M, K, seg.type, x);
  const bool min = has_min(seg.type);
  if (sub_block(seg.type) == 16) panels<16, false, T>(passes, M, K, seg, x, bias, y, ldy);
  else if (min) panels<32, true, T>(passes, M, K, seg, x, bias, y, ldy);
  else panels<32, false, T>(passes, M, K, seg, x, bias, y, ldy);
}

#else  // no AVX512-VNNI: gguf_linear_cpu.cpp never calls it (kIntegerGemm)

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

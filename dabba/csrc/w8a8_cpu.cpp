// W8A8: x W^T + b with INT8 weights (symmetric, a float32 scale per output channel) and x rounded
// to 8-bit codes per row at run time, multiplied in integers and summed exactly in int32.
//
// x's row m becomes unsigned codes u (0..255) with a scale s_m and a zero point z_m: symmetric,
// q = round(x * 127 / max|x|) in -127..127 and u = q + 128 (z = 128); asymmetric, over
// [min(x, 0), max(x, 0)], u = round(x * 255 / range) + round(-min * 255 / range) (z that); or a
// checkpoint's static scale for every row (StaticScale). A tensor-parallel rank's slice of a row is
// rounded by the whole row's range (x_range), so every rank's codes are those of one rank. Then
//   y[m, n] = float(sum_k u[m, k] w[n, k] - z_m * wsum[n]) * (s_m * sw[n])   (+ b[n], after y is
// rounded to x's dtype), wsum[n] = sum_k w[n, k]: unsigned times signed bytes is what vpdpbusd and
// AMX's TDPBUSD multiply, and the zero point's correction is one product per output.
//
// The weight is packed once at load (dabba/quantization/w8a8.py: pack_weight): blocks of
// kW8A8Columns output channels, each [Kp / 4][16][4] bytes (4 consecutive k of 16 channels in 64
// bytes), K padded with zero codes to Kp, a multiple of kW8A8Depth. 64 bytes are a vpdpbusd's
// weight operand for 16 channels, and 16 of them (64 k) an AMX B tile as it lies.
//
// Kernels (the same int32 sums, so the same outputs bit for bit; chosen in w8a8_path):
// AMX-INT8 tiles (32 x 32 outputs a step) from kAmxW8A8MinRows rows where the CPU and the OS have
// them; AVX512-VNNI (6 rows x 64 channels of vpdpbusd); AVX2 (codes widened to int16, vpmaddwd);
// scalar elsewhere. Sums carry in an int32 block between ranges of K (cache blocking), exactly.
// The activation rounding is the packing: one pass over x writes the codes the kernels read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

// The epilogue's product and the bias's addition are two roundings in the reference: GCC would
// otherwise contract them into one fma in the float32 outputs.
#pragma GCC optimize("fp-contract=off")

#include "bf16_tiles.h"
#include "cpu_math.h"
#include "cpu_ops.h"
#include "x_loads.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(DABBA_HAVE_AMX) && defined(__AMX_INT8__)
#include <cpuid.h>
#define DABBA_W8A8_AMX 1
#endif

namespace dabba {
namespace {

constexpr int64_t kMc = 128;  // rows of codes, ...
constexpr int64_t kKc = 1024;  // ... their range of K, ...
constexpr int64_t kNcBlocks = 16;  // ... and the blocks of 16 channels whose sums one int32 block holds

// Scratch on 64-byte boundaries: an AMX tile's 64-byte rows that straddle two cache lines load at
// half the rate or worse (malloc aligns to 16), and so do the zmm loads of the other paths.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
AlignedBuffer<T> aligned_buffer(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  T* p = static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
  TORCH_CHECK(p != nullptr, "w8a8_linear: out of memory for ", bytes, " bytes of scratch");
  return AlignedBuffer<T>(p);
}

// f(T{}) for x's dtype: bf16 or float32 (checked by the caller)
template <typename F>
void with_x_type(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kBFloat16) f(c10::BFloat16{});
  else f(float{});
}

struct Codes {
  AlignedBuffer<uint8_t> u;  // laid out as below; AMX's rows padded to a multiple of 32 with code 0
  std::vector<float> scale;  // [M]
  std::vector<int32_t> zero;  // [M]
  int64_t M = 0, Kp = 0, rows = 0;  // rows: M, padded where tiled (the other paths read M rows)
  // AMX: in tiles, [rows / 16][Kp / 64][16][64], so each tile load reads 1 KiB in a row (16 rows Kp
  // apart would meet in the same L1 sets when Kp is a multiple of 4096). Else [rows][Kp].
  bool tiled = false;

  uint8_t* row(int64_t m) { return tiled ? u.get() + m / 16 * (Kp / 64) * 1024 + m % 16 * 64 : u.get() + m * Kp; }
  int64_t chunk_stride() const { return tiled ? 1024 : 64; }  // between a row's runs of 64 codes
};

#if defined(__AVX2__)
// 8 codes in 0..255 held as floats -> 8 bytes at u
inline void store8_codes(__m256 v, uint8_t* u) {
  const __m256i i32 = _mm256_cvtps_epi32(v);  // exact: whole numbers
  const __m256i bytes = _mm256_shuffle_epi8(i32, _mm256_set1_epi32(0x0c080400));  // each lane's 4 low bytes
  const uint64_t lo = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 0)),
                 hi = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
  const uint64_t both = lo | hi << 32;
  std::memcpy(u, &both, 8);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DABBA_W8A8_ROUND16 1  // the rounding 16 values a step (the same operations as 8 at a time)
#endif

// A checkpoint's static activation scale s and int8 zero point zp (compressed-tensors' own):
// q = clamp(round(x * (1 / s)) + zp, -128, 127), u = q + 128, the sums' zero point zp + 128.
struct StaticScale {
  float scale;
  int32_t zero;
};

// min(x, 0) and max(x, 0) over a row
template <typename T>
void row_range(const T* x, int64_t K, float& lo, float& hi) {
  lo = 0.f, hi = 0.f;
  int64_t k = 0;
#ifdef DABBA_W8A8_ROUND16
  __m512 wlo = _mm512_setzero_ps(), whi = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 v = load_ps16(x + k);
    wlo = _mm512_min_ps(wlo, v);
    whi = _mm512_max_ps(whi, v);
  }
  lo = _mm512_reduce_min_ps(wlo);
  hi = _mm512_reduce_max_ps(whi);
#endif
#if defined(__AVX2__)
  __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  for (; k + 8 <= K; k += 8) {
    const __m256 v = load_ps8(x + k);
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  alignas(32) float l8[8], h8[8];
  _mm256_store_ps(l8, vlo);
  _mm256_store_ps(h8, vhi);
  for (int i = 0; i < 8; ++i) {
    lo = std::min(lo, l8[i]);
    hi = std::max(hi, h8[i]);
  }
#endif
  for (; k < K; ++k) {
    const float v = to_float(x[k]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
}

// Row m of x -> codes, as dabba/quantization/w8a8.py: quantize_activations rounds them. Its
// range: the row's (min(x, 0), max(x, 0)) where given (a tensor-parallel shard of the row: the
// whole row's, gathered from every rank), else found here.
template <typename T>
void round_row(const T* x, int64_t K, bool asymmetric, const StaticScale* fixed, const float* range, uint8_t* u,
               int64_t chunk_stride, float& scale, int32_t& zero) {
  float inv, low, high, offset;  // u = clamp(round(x * inv), low, high) + offset
  if (fixed) {
    scale = fixed->scale;
    inv = 1.f / fixed->scale;
    zero = fixed->zero + 128;
    low = static_cast<float>(-128 - fixed->zero), high = static_cast<float>(127 - fixed->zero);
    offset = static_cast<float>(zero);
  } else {
    float lo, hi;
    if (range) lo = range[0], hi = range[1];
    else row_range(x, K, lo, hi);
    if (!asymmetric) {
      const float amax = std::max(hi, -lo);
      zero = 128;
      scale = amax / 127.f;
      inv = amax > 0.f ? 127.f / amax : 0.f;
      low = -127.f, high = 127.f, offset = 128.f;
    } else {
      const float span = hi - lo;
      scale = span / 255.f;
      inv = span > 0.f ? 255.f / span : 0.f;
      zero = static_cast<int32_t>(std::clamp(std::nearbyint(-lo * inv), 0.f, 255.f));
      offset = static_cast<float>(zero), low = -offset, high = 255.f - offset;
    }
  }
  int64_t k = 0;
#ifdef DABBA_W8A8_ROUND16
  const __m512 winv = _mm512_set1_ps(inv), wlow = _mm512_set1_ps(low), whigh = _mm512_set1_ps(high),
               woff = _mm512_set1_ps(offset);
  for (; k + 16 <= K; k += 16) {  // 16 divides a run of 64
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(load_ps16(x + k), winv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, wlow), whigh);
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_add_ps(q, woff)));  // exact: 0..255
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + k / 64 * chunk_stride + k % 64), bytes);
  }
#endif
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), vlow = _mm256_set1_ps(low), vhigh = _mm256_set1_ps(high),
               voff = _mm256_set1_ps(offset);
  for (; k + 8 <= K; k += 8) {
    __m256 q = _mm256_round_ps(_mm256_mul_ps(load_ps8(x + k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, vlow), vhigh);
    store8_codes(_mm256_add_ps(q, voff), u + k / 64 * chunk_stride + k % 64);
  }
#endif
  for (; k < K; ++k)
    u[k / 64 * chunk_stride + k % 64] =
        static_cast<uint8_t>(std::clamp(std::nearbyint(to_float(x[k]) * inv), low, high) + offset);
}

Codes round_activations(const at::Tensor& x, int64_t Kp, bool asymmetric, const StaticScale* fixed, const float* ranges,
                        bool tiled) {
  Codes c;
  c.M = x.size(0);
  c.Kp = Kp;
  c.tiled = tiled;
  const int64_t K = x.size(1), rows = tiled ? (c.M + 31) / 32 * 32 : c.M;
  c.rows = rows;
  c.u = aligned_buffer<uint8_t>(rows * Kp);
  c.scale.resize(c.M);
  c.zero.resize(c.M);
  // code 0 in the padding (K..Kp of each row, and AMX's rows past M), written beside the codes
  // rather than by a pass over the whole buffer first
  const int64_t stride = c.chunk_stride(), chunks = Kp / 64;
  with_x_type(x, [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        uint8_t* u = c.row(m);
        if (m >= c.M) {
          for (int64_t j = 0; j < chunks; ++j) std::memset(u + j * stride, 0, 64);
          continue;
        }
        if (K % 64) std::memset(u + K / 64 * stride + K % 64, 0, 64 - K % 64);
        round_row(xp + m * x.stride(0), K, asymmetric, fixed, ranges ? ranges + 2 * m : nullptr, u, stride,
                  c.scale[m], c.zero[m]);
      }
    });
  });
  return c;
}

// One thread's int32 sums for rows [m0, m0 + rows) and channel blocks [b0, b0 + blocks) over k-quads
// [q0, q1): c[r][16 * j + i] for row m0 + r, channel 16 (b0 + j) + i; ldc in int32. first: start
// from 0, else add to c.
struct Tile {
  const uint8_t* u;  // row m0's codes at k = 4 q0
  int64_t ldu;
  const int8_t* w;  // block b0 at k-quad q0
  int64_t block_bytes;  // Kp * 16
  int64_t quads;
  int32_t* c;
  int64_t ldc;
  bool first;
};

void scalar_tile(const Tile& t, int64_t rows, int64_t blocks) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < blocks; ++j)
      for (int i = 0; i < 16; ++i) {
        int32_t sum = t.first ? 0 : t.c[r * t.ldc + 16 * j + i];
        const int8_t* w = t.w + j * t.block_bytes + 4 * i;
        for (int64_t q = 0; q < t.quads; ++q)
          for (int b = 0; b < 4; ++b) sum += int32_t{t.u[r * t.ldu + 4 * q + b]} * int32_t{w[64 * q + b]};
        t.c[r * t.ldc + 16 * j + i] = sum;
      }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// MR rows x NR blocks (16 channels each) of vpdpbusd: per 4 k, NR 64-byte weight loads and MR
// broadcasts of 4 codes feed MR x NR accumulators. Its own function, with the loops over them
// unrolled whole, so that every accumulator and pointer stays in a register (inlined into its
// caller, or left to GCC's unrolling, the loop has kept accumulators or counters on the stack).
template <int MR, int NR>
__attribute__((noinline)) void vnni_tile(const Tile& t) {
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      acc[r][j] = t.first ? _mm512_setzero_si512() : _mm512_loadu_si512(t.c + r * t.ldc + 16 * j);
  for (int64_t q = 0; q < t.quads; ++q) {
    __m512i w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(t.w + j * t.block_bytes + 64 * q);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, t.u + r * t.ldu + 4 * q, 4);
      const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, w[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) _mm512_storeu_si512(t.c + r * t.ldc + 16 * j, acc[r][j]);
}

// 6 rows x 4 blocks: 24 accumulators, 4 weights and a broadcast in 29 of the 32 zmm registers, so a
// weight load serves 6 vpdpbusd, not 4 (4 x 4's broadcasts held Zen 4 well below its VNNI peak)
constexpr int kVnniRows = 6, kVnniBlocks = 4;

void vnni_block(const Tile& t, int64_t rows, int64_t blocks) {
  for (int64_t r = 0; r < rows; r += kVnniRows)
    for (int64_t j = 0; j < blocks; j += kVnniBlocks) {
      Tile s = t;
      s.u += r * t.ldu;
      s.w += j * t.block_bytes;
      s.c += r * t.ldc + 16 * j;
      with_count<kVnniRows>(std::min<int64_t>(kVnniRows, rows - r), [&](auto mr) {
        with_count<kVnniBlocks>(std::min<int64_t>(kVnniBlocks, blocks - j),
                                [&](auto nr) { vnni_tile<decltype(mr)::value, decltype(nr)::value>(s); });
      });
    }
}
#endif

#if defined(__AVX2__)
// AVX2: 4 k of 4 channels as 16 int16 (vpmovsxbw), the 4 codes as int16 repeated, vpmaddwd: pairs of k
// summed in int32 (no saturation: |u w| <= 255 * 128), each channel's two pair lanes added at the end.
template <int MR>
void avx2_tile(const Tile& t, int64_t blocks) {
  for (int64_t j = 0; j < blocks; ++j) {
    __m256i acc[MR][4];  // [row][4 channels each]: lanes (channel, pair)
    for (int r = 0; r < MR; ++r)
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_setzero_si256();
    const int8_t* w = t.w + j * t.block_bytes;
    for (int64_t q = 0; q < t.quads; ++q) {
      __m256i w16[4];
      for (int g = 0; g < 4; ++g)
        w16[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64 * q + 16 * g)));
      for (int r = 0; r < MR; ++r) {
        const uint8_t* u = t.u + r * t.ldu + 4 * q;
        const __m256i a = _mm256_set1_epi64x(static_cast<int64_t>(u[0]) | static_cast<int64_t>(u[1]) << 16 |
                                             static_cast<int64_t>(u[2]) << 32 | static_cast<int64_t>(u[3]) << 48);
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(w16[g], a));
      }
    }
    for (int r = 0; r < MR; ++r) {
      alignas(32) int32_t lanes[4][8];
      for (int g = 0; g < 4; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[g]), acc[r][g]);
      int32_t* c = t.c + r * t.ldc + 16 * j;
      for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 4; ++i) {
          const int32_t sum = lanes[g][2 * i] + lanes[g][2 * i + 1];
          c[4 * g + i] = t.first ? sum : c[4 * g + i] + sum;
        }
    }
  }
}

void avx2_block(const Tile& t, int64_t rows, int64_t blocks) {
  for (int64_t r = 0; r < rows; r += 2) {
    Tile s = t;
    s.u += r * t.ldu;
    s.c += r * t.ldc;
    if (rows - r >= 2) avx2_tile<2>(s, blocks);
    else avx2_tile<1>(s, blocks);
  }
}
#endif

#ifdef DABBA_W8A8_AMX
// AMX-TILE, AMX-INT8 (CPUID.7.0:EDX bits 24, 25) and the tile state granted (amx_usable asks).
bool amx_int8_available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return amx_usable(64) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1);
  }();
  return ok;
}

// Tiles 0-3: 2 x 2 int32 sums (16 x 16 each); 4, 5: 16 rows of codes (64 k); 6, 7: 64 k of 16 channels.
struct alignas(64) W8A8TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

constexpr int64_t kAmxMc = 256;  // rows whose sums one int32 block holds, ...
constexpr int64_t kAmxKc = 512;  // ... the range of K a pass adds to them (32 rows of codes: 16 KiB, in L1), ...
constexpr int64_t kAmxNcBlocks = 16;  // ... and their channel blocks (a panel of weight: 128 KiB, in L2)
static_assert(kAmxNcBlocks <= kNcBlocks, "gated_epilogue holds half a panel of kNcBlocks");

// Which channel blocks a step of AMX tiles multiplies, and where their sums go: plain, blocks
// b, b + 1 of the panel in order; gated (a merged [gate; up] weight, up_blocks the gate's count),
// gate block b and its up block b + up_blocks, their sums in the first and second half of the panel's
// columns, so that one thread holds both for its epilogue.
struct Steps {
  int64_t up_blocks = 0;  // 0: plain

  int64_t panel(int64_t blocks_per_panel) const { return up_blocks ? blocks_per_panel / 2 : blocks_per_panel; }
  int64_t count(int64_t nb) const { return up_blocks ? nb : (nb + 1) / 2; }  // steps over nb (gate) blocks
  // step s of a panel of nb blocks starting at b0: {first block, second block, its column, second's, two}
  void at(int64_t s, int64_t b0, int64_t nb, int64_t& blk0, int64_t& blk1, int64_t& col0, int64_t& col1,
          bool& two) const {
    if (up_blocks) {
      blk0 = b0 + s, blk1 = blk0 + up_blocks, col0 = 16 * s, col1 = 16 * (nb + s), two = true;
    } else {
      blk0 = b0 + 2 * s, blk1 = blk0 + 1, col0 = 32 * s, col1 = col0 + 16, two = 2 * s + 1 < nb;
      if (!two) blk1 = blk0;  // the last block alone: its sums twice, the second kept nowhere
    }
  }
};

// The int32 sums of channel blocks [b_begin, b_end) (gated: gate blocks, and their up blocks) for
// every row of the tiled codes (rows a multiple of 32), a block of kAmxMc rows x kAmxNcBlocks blocks at
// a time, each handed to done(m0, rows, b0, blocks, sums, ldc). A step: 2 tiles of codes (32 rows, from
// L1: the same 32 rows go through every step of the panel before the next) against 2 weight tiles (32
// channels, streamed from L2 without displacing the codes: TILELOADDT1) into 2 x 2 accumulator tiles.
template <typename Done>
void amx_gemm(const Codes& a, const int8_t* w, int64_t block_bytes, int64_t b_begin, int64_t b_end, Steps steps,
              Done&& done) {
  static const W8A8TileConfig config;
  _tile_loadconfig(&config);
  const int64_t k_tiles = a.Kp / 64, rows_padded = a.rows;
  const int64_t ldc = kAmxNcBlocks * kW8A8Columns, ldc_bytes = ldc * 4, per_panel = steps.panel(kAmxNcBlocks);
  const AlignedBuffer<int32_t> c = aligned_buffer<int32_t>(kAmxMc * ldc);
  for (int64_t b0 = b_begin; b0 < b_end; b0 += per_panel) {
    const int64_t nb = std::min(per_panel, b_end - b0), count = steps.count(nb);
    for (int64_t m0 = 0; m0 < rows_padded; m0 += kAmxMc) {
      const int64_t mc = std::min(kAmxMc, rows_padded - m0);
      for (int64_t k0 = 0; k0 < k_tiles; k0 += kAmxKc / 64) {
        const int64_t kt = std::min(kAmxKc / 64, k_tiles - k0);
        for (int64_t r = 0; r < mc; r += 32) {
          const uint8_t* a0 = a.u.get() + ((m0 + r) / 16 * k_tiles + k0) * 1024;
          const uint8_t* a1 = a0 + k_tiles * 1024;
          for (int64_t s = 0; s < count; ++s) {
            int64_t blk0, blk1, col0, col1;
            bool two;
            steps.at(s, b0, nb, blk0, blk1, col0, col1, two);
            int32_t* c0 = c.get() + r * ldc + col0;
            int32_t* c1 = c.get() + r * ldc + col1;
            if (k0 == 0) {
              _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            } else {
              _tile_loadd(0, c0, ldc_bytes);
              _tile_loadd(2, c0 + 16 * ldc, ldc_bytes);
              if (two) {
                _tile_loadd(1, c1, ldc_bytes);
                _tile_loadd(3, c1 + 16 * ldc, ldc_bytes);
              }
            }
            const int8_t* w0 = w + blk0 * block_bytes + k0 * 1024;
            const int8_t* w1 = w + blk1 * block_bytes + k0 * 1024;
            for (int64_t q = 0; q < kt; ++q) {
              _tile_loadd(4, a0 + q * 1024, 64);
              _tile_stream_loadd(6, w0 + q * 1024, 64);
              _tile_dpbusd(0, 4, 6);
              _tile_stream_loadd(7, w1 + q * 1024, 64);
              _tile_dpbusd(1, 4, 7);
              _tile_loadd(5, a1 + q * 1024, 64);
              _tile_dpbusd(2, 5, 6);
              _tile_dpbusd(3, 5, 7);
            }
            _tile_stored(0, c0, ldc_bytes);
            _tile_stored(2, c0 + 16 * ldc, ldc_bytes);
            if (two) {
              _tile_stored(1, c1, ldc_bytes);
              _tile_stored(3, c1 + 16 * ldc, ldc_bytes);
            }
          }
        }
      }
      done(m0, mc, b0, nb, c.get(), ldc);
    }
  }
  _tile_release();
}
#endif

enum class Path { kAmx, kVnni, kAvx2, kScalar };

Path parse_path(const std::string& name) {
  if (name == "amx") return Path::kAmx;
  if (name == "vnni") return Path::kVnni;
  if (name == "avx2") return Path::kAvx2;
  TORCH_CHECK(name == "scalar", "w8a8_linear: unknown path '", name, "'");
  return Path::kScalar;
}

bool path_built(Path p) {
  switch (p) {
#ifdef DABBA_W8A8_AMX
    case Path::kAmx: return amx_int8_available();
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case Path::kVnni: return true;
#endif
#if defined(__AVX2__)
    case Path::kAvx2: return true;
#endif
    case Path::kScalar: return true;
    default: return false;
  }
}

void run_block(Path p, const Tile& t, int64_t rows, int64_t blocks) {
  switch (p) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case Path::kVnni: return vnni_block(t, rows, blocks);
#endif
#if defined(__AVX2__)
    case Path::kAvx2: return avx2_block(t, rows, blocks);
#endif
    default: return scalar_tile(t, rows, blocks);
  }
}

// A gated MLP's outputs, channels [n0, n1) of the gate (at most kNcBlocks / 2 blocks): act(gate) * up
// from the gate's sums (c) and the up's (c + up_col), each first rounded as the plain layer's output,
// then by the code silu_and_mul / gelu_tanh_and_mul run (elementwise_cpu.cpp): the fused layer equals
// the layer then the activation, bit for bit.
template <typename T>
DABBA_WIDE_LOOPS
void gated_epilogue(const Codes& a, const int32_t* c, int64_t ldc, int64_t up_col, int64_t m0, int64_t rows,
                    int64_t n0, int64_t n1, int64_t up_offset, const int32_t* wsum, const float* sw, const T* bias,
                    bool silu, T* y, int64_t ldy) {
  constexpr int64_t kMost = kNcBlocks / 2 * kW8A8Columns;
  alignas(64) T halves[2][kMost];  // the gate's outputs, the up's
  const int64_t width = n1 - n0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float s = a.scale[m];
    const int32_t z = a.zero[m];
    for (int half = 0; half < 2; ++half) {  // as epilogue's loops (vectorised), into halves[half]
      const int64_t n = n0 + half * up_offset;
      const int32_t* cr = c + r * ldc + half * up_col;
      const int32_t* ws = wsum + n;
      const float* swn = sw + n;
      T* out = halves[half];
      if (bias) {
        const T* b = bias + n;
        for (int64_t j = 0; j < width; ++j)
          out[j] = from_float<T>(to_float(from_float<T>(static_cast<float>(cr[j] - z * ws[j]) * (s * swn[j]))) +
                                 to_float(b[j]));
      } else {
        for (int64_t j = 0; j < width; ++j) out[j] = from_float<T>(static_cast<float>(cr[j] - z * ws[j]) * (s * swn[j]));
      }
    }
    if (silu) silu_and_mul_row(y + m * ldy + n0, halves[0], halves[1], width);
    else gelu_tanh_and_mul_row(y + m * ldy + n0, halves[0], halves[1], width);
  }
}

// y rows [m0, m0 + rows) x channels [n0, n1) from their int32 sums c (row stride ldc); loops GCC
// vectorises (cpu_math.h's conversions).
template <typename T>
DABBA_WIDE_LOOPS
void epilogue(const Codes& a, const int32_t* c, int64_t ldc, int64_t m0, int64_t rows, int64_t n0, int64_t n1,
              const int32_t* wsum, const float* sw, const T* bias, T* y, int64_t ldy) {
  const int64_t width = n1 - n0;
  wsum += n0;
  sw += n0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float s = a.scale[m];
    const int32_t z = a.zero[m];
    const int32_t* cr = c + r * ldc;
    T* yr = y + m * ldy + n0;
    if (bias) {
      const T* b = bias + n0;
      for (int64_t j = 0; j < width; ++j)
        yr[j] = from_float<T>(to_float(from_float<T>(static_cast<float>(cr[j] - z * wsum[j]) * (s * sw[j]))) +
                              to_float(b[j]));
    } else {
      for (int64_t j = 0; j < width; ++j) yr[j] = from_float<T>(static_cast<float>(cr[j] - z * wsum[j]) * (s * sw[j]));
    }
  }
}

}  // namespace

std::string w8a8_path(int64_t M, int64_t K) {
#ifdef DABBA_W8A8_AMX
  if (M >= kAmxW8A8MinRows && amx_int8_available()) return "amx";
#endif
  (void)M;
  (void)K;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

bool w8a8_path_available(const std::string& path) { return path_built(parse_path(path)); }

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, bool asymmetric, const std::string& path,
                       const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& input_zero,
                       const c10::optional<at::Tensor>& x_range, const std::string& act) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "w8a8_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "w8a8_linear: x must be bf16 or float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kW8A8Columns &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "w8a8_linear: the weight must be packed int8 [N / 16, Kp / 4, 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), Kp = packed.size(1) * 4, blocks = packed.size(0);
  const int64_t N = wsum.size(0);
  TORCH_CHECK(Kp % kW8A8Depth == 0 && Kp >= K && Kp - K < kW8A8Depth, "w8a8_linear: the packed weight holds ", Kp,
              " inputs, x has ", K);
  TORCH_CHECK(N <= blocks * kW8A8Columns && N > (blocks - 1) * kW8A8Columns, "w8a8_linear: ", N, " channels in ",
              blocks, " blocks of 16");
  TORCH_CHECK(K <= kW8A8MaxInputs, "w8a8_linear: ", K, " inputs could overflow the int32 sums (at most ",
              kW8A8MaxInputs, ")");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.numel() == N,
              "w8a8_linear: wsum must be int32 [N], scales float32 [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "w8a8_linear: bias must be [N] in x's dtype");
  TORCH_CHECK(input_scale.has_value() || !input_zero.has_value(), "w8a8_linear: input_zero without input_scale");
  StaticScale fixed{};
  if (input_scale.has_value()) {
    TORCH_CHECK(input_scale->scalar_type() == at::kFloat && input_scale->numel() == 1,
                "w8a8_linear: input_scale must be one float32");
    fixed.scale = input_scale->item<float>();
    TORCH_CHECK(std::isfinite(fixed.scale) && fixed.scale > 0.f, "w8a8_linear: input_scale must be positive, got ",
                fixed.scale);
    if (input_zero.has_value()) {
      TORCH_CHECK(input_zero->scalar_type() == at::kInt && input_zero->numel() == 1,
                  "w8a8_linear: input_zero must be one int32");
      fixed.zero = input_zero->item<int32_t>();
      TORCH_CHECK(fixed.zero >= -128 && fixed.zero <= 127, "w8a8_linear: input_zero must be in -128..127, got ",
                  fixed.zero);
    }
  }
  if (x_range.has_value())
    TORCH_CHECK(!input_scale.has_value() && x_range->scalar_type() == at::kFloat && x_range->dim() == 2 &&
                    x_range->size(0) == M && x_range->size(1) == 2 && x_range->is_contiguous(),
                "w8a8_linear: x_range must be float32 [M, 2] (and no input_scale)");
  TORCH_CHECK(act.empty() || act == "silu" || act == "gelu_tanh", "w8a8_linear: act must be '', 'silu' or "
              "'gelu_tanh', got '", act, "'");
  // gated: a merged [gate; up] layer, act(gate) * up stored; each half whole blocks of 16 channels
  const bool gated = !act.empty();
  TORCH_CHECK(!gated || N % (2 * kW8A8Columns) == 0, "w8a8_linear: a gated layer's halves must be whole blocks of ",
              kW8A8Columns, " channels, got ", N, " channels");
  const int64_t up_blocks = gated ? N / (2 * kW8A8Columns) : 0;
  const Path p = parse_path(path.empty() ? w8a8_path(M, K) : path);
  TORCH_CHECK(path_built(p), "w8a8_linear: path '", path, "' is not in this build or on this CPU");
  at::Tensor y = at::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const Codes a = round_activations(x, Kp, asymmetric, input_scale.has_value() ? &fixed : nullptr,
                                    x_range.has_value() ? x_range->data_ptr<float>() : nullptr, p == Path::kAmx);
  const int8_t* w = packed.data_ptr<int8_t>();
  const int64_t block_bytes = Kp * kW8A8Columns;
  const int32_t* ws = wsum.data_ptr<int32_t>();
  const float* sw = scales.data_ptr<float>();
  // y for rows [m0, m0 + rows) and channel blocks [b0, b0 + nb) (gated: gate blocks, their up
  // blocks' sums 16 nb columns on) from their sums c (ldc: its row stride)
  auto store = [&](int64_t m0, int64_t rows, int64_t b0, int64_t nb, const int32_t* c, int64_t ldc) {
    const int64_t n0 = b0 * kW8A8Columns, n1 = std::min(N, (b0 + nb) * kW8A8Columns);
    const int64_t valid = std::min(rows, M - m0);
    if (valid <= 0) return;
    with_x_type(x, [&](auto zero) {
      using T = decltype(zero);
      const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
      T* yp = y.data_ptr<T>();
      if (!gated) return epilogue<T>(a, c, ldc, m0, valid, n0, n1, ws, sw, bp, yp, N);
      const int64_t half = N / 2;
      gated_epilogue<T>(a, c, ldc, nb * kW8A8Columns, m0, valid, n0, n1, half, ws, sw, bp, act == "silu", yp, half);
    });
  };
  // threads split the channel blocks (in pairs, AMX's step; gated, the gate's blocks, each with its up
  // block); each keeps an int32 block of sums
  const int64_t units = gated ? up_blocks : (blocks + 1) / 2, per_unit = gated ? 1 : 2;
  at::parallel_for(0, units, 1, [&](int64_t unit_begin, int64_t unit_end) {
    const int64_t b_begin = per_unit * unit_begin, b_end = std::min(gated ? up_blocks : blocks, per_unit * unit_end);
#ifdef DABBA_W8A8_AMX
    if (p == Path::kAmx) return amx_gemm(a, w, block_bytes, b_begin, b_end, Steps{up_blocks}, store);
#endif
    const int64_t mc = std::min(kMc, M), ldc = kNcBlocks * kW8A8Columns, per_panel = gated ? kNcBlocks / 2 : kNcBlocks;
    const AlignedBuffer<int32_t> c = aligned_buffer<int32_t>(mc * ldc);
    for (int64_t b0 = b_begin; b0 < b_end; b0 += per_panel) {
      const int64_t nb = std::min(per_panel, b_end - b0);
      for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t rows = std::min(mc, M - m0);
        for (int64_t k0 = 0; k0 < Kp; k0 += kKc) {
          const int64_t kc = std::min(kKc, Kp - k0);
          for (int64_t part = 0; part < (gated ? 2 : 1); ++part) {  // gated: the gate's blocks, then the up's
            const int64_t first = b0 + part * up_blocks;
            const Tile t{a.u.get() + m0 * Kp + k0, Kp, w + first * block_bytes + k0 * kW8A8Columns, block_bytes,
                         kc / 4, c.get() + part * nb * kW8A8Columns, ldc, k0 == 0};
            run_block(p, t, rows, nb);
          }
        }
        store(m0, rows, b0, nb, c.get(), ldc);
      }
    }
  });
  return y;
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor wsum, Tensor scales, Tensor? bias, bool asymmetric=False, "
        "str path='', Tensor? input_scale=None, Tensor? input_zero=None, Tensor? x_range=None, str act='') -> Tensor");
  m.impl("w8a8_linear", c10::DispatchKey::CPU, TORCH_FN(dabba::w8a8_linear));
  m.def("w8a8_path(int rows, int K) -> str", &dabba::w8a8_path);
  m.def("w8a8_path_available(str path) -> bool", &dabba::w8a8_path_available);
}

// bf16 GEMM on AMX tiles, for CPUs that have them (Intel Sapphire Rapids and later): the same
// products as gemm_cpu.cpp's AVX512-BF16 tiles, which stay the reference and the path everywhere
// else. One TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float32 sums:
// 16x the work of a vdpbf16ps. On a 2-core Xeon with AMX (2.6 GHz, 2 MiB L2 a core), Qwen2.5-1.5B's
// shapes: the AVX512-BF16 tiles top out near 190 GFLOP/s at 16-256 rows; F.linear (oneDNN's AMX
// kernels, reordering the weight every call) 550-850 at 32 rows and 1700-2100 at 256; these tiles
// 800-1100 and 1600-2500 (python -m benchmarks.kernels --hidden 1536 --intermediate 8960
// --num-heads 12 --num-kv-heads 2 --head-dim 128). Past 256 rows oneDNN's blocking wins on the
// narrower projections (1536 x 2048 at 4096 rows: 2300 against 1900), so only the fused gated MLP
// takes these tiles there (dense_linear_gated in gemm_cpu.cpp). Their tile loads, 16 weight rows
// at once, also read a cold weight faster than the GEMV does at one row: all 28 layers and the LM
// head (3.1 GB) in 121-128 ms, 24-26 GB/s, against the GEMV's 138-145 ms.
//
// How: the weight is the A operand, read in place (16 rows of it, 64 bytes of each, per tile
// load), so it needs no second copy and the GEMV keeps reading it row-major; x, packed once per call
// as pairs of K for 16 rows (bf16_tiles.h), is the B operand as it lies. A step takes 2 A tiles (32
// weight rows; for a gated MLP 16 gate rows and the matching 16 up rows) against 1 or 2 B tiles (16 or
// 32 rows of x): 4 accumulator tiles, 2 A, 2 B, all 8 tile registers. The sums come out as
// [weight row][x row]; the epilogue rounds each weight row's 16 sums as the AVX512 tiles do
// (round_column, gated_column), then transposes 16 x 16 to store rows of y.
//
// INT4 (amx_int4_gemm_blocks) turns the roles around: PyTorch's packed int4 layout holds 64 rows'
// codes per k, so each block dequantizes straight into B tiles (K-pairs for 16 weight rows), x is
// the A operand as it lies, and the sums come out [x row][weight row], stored without a transpose.
//
// Each output element depends on its weight row and its x row only, so a row's result does not
// change with how many other rows share the call (and the fused SwiGLU / GeGLU equals the
// projection + silu_and_mul / gelu_tanh_and_mul bit for bit). The tiles' summation order differs
// from vdpbf16ps's, so the two kernels agree to float32 rounding, not bit for bit.
#include "bf16_tiles.h"
#include "cpu_ops.h"
#include "int4_pack.h"

#include <ATen/ATen.h>

#include <cstring>
#include <vector>

#ifdef DABBA_HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dabba {

#ifdef DABBA_HAVE_BF16_GEMM

#ifdef DABBA_HAVE_AMX

namespace {

// Every tile 16 rows of 64 bytes: 16 x 32 bf16 (A), 16 pairs x 16 rows of x (B), 16 x 16 float32 (C).
const TileConfig* tile_config() {
  static const TileConfig config = [] {
    TileConfig c{};
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  return &config;
}

// CPUID says AMX-TILE and AMX-BF16, and Linux grants the process the tile data state (it is off
// until asked for: the first tile instruction without it is a SIGILL).
bool request_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// 16 bf16 columns (one per weight row, lanes = x rows) -> rows of y: cols output columns from
// y[0][0], rows rows of x.
inline void store_columns(const __m256i (&cols)[16], int cols_valid, uint16_t* y, int64_t ldy, int64_t rows) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_cvtepu16_epi32(cols[n]);
  transpose16(r);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols_valid) - 1);
  for (int m = 0; m < 16 && m < rows; ++m) _mm256_mask_storeu_epi16(y + m * ldy, mask, _mm512_cvtepi32_epi16(r[m]));
}

// One finished step's sums (amx_tile's layout) -> y. Plain: tile t holds columns 16t.. of the
// step; gated: tile 0 the gate rows, tile 1 the up rows of the same 16 columns. The work comes in
// units, one column's rounding (and activation) or one 16 x 16 transpose and store, which the next
// step's K loop takes a few at a time (advance), so that the vector units round, activate and
// transpose while the AMX unit multiplies; finish() does what is left. (Done after its own step,
// the epilogue cost a gated GEMM a fifth to a third of its time.)
class StepStore {
 public:
  void set(const float* c, int mv, Epilogue epilogue, int cols, const uint16_t* scale, const uint16_t* bias,
           const uint16_t* up_bias, uint16_t* y, int64_t ldy, int64_t rows) {
    c_ = c;
    mv_ = mv;
    epilogue_ = epilogue;
    cols_ = cols;
    scale_ = scale;
    bias_ = bias;
    up_bias_ = up_bias;
    y_ = y;
    ldy_ = ldy;
    rows_ = rows;
    tiles_ = epilogue == Epilogue::kPlain && cols > 16 ? 2 : 1;
    left_ = mv * tiles_ * 17;
    v_ = t_ = k_ = 0;
  }
  int left() const { return left_; }
  void advance(int units) {
    for (; units > 0 && left_ > 0; --units, --left_) {
      unit();
      if (++k_ == 17) {
        k_ = 0;
        if (++t_ == tiles_) {
          t_ = 0;
          ++v_;
        }
      }
    }
  }
  void finish() { advance(left_); }

 private:
  void unit() {
    const int64_t v_rows = std::min<int64_t>(16, rows_ - v_ * 16);
    if (epilogue_ != Epilogue::kPlain) {
      if (k_ == 16) return store_columns(cols_out_, cols_, y_ + v_ * 16 * ldy_, ldy_, v_rows);
      if (k_ >= cols_) {
        cols_out_[k_] = _mm256_setzero_si256();
        return;
      }
      const __m256i gate = round_column(_mm512_loadu_ps(c_ + v_ * 256 + k_ * 16), nullptr, bias_ ? bias_ + k_ : nullptr);
      const __m256i up = round_column(_mm512_loadu_ps(c_ + (mv_ + v_) * 256 + k_ * 16), nullptr,
                                      up_bias_ ? up_bias_ + k_ : nullptr);
      cols_out_[k_] = epilogue_ == Epilogue::kSilu ? gated_column<Epilogue::kSilu>(gate, up)
                                                   : gated_column<Epilogue::kGeluTanh>(gate, up);
      return;
    }
    const int valid = std::min(16, cols_ - 16 * t_), first = 16 * t_;
    if (k_ == 16) return store_columns(cols_out_, valid, y_ + v_ * 16 * ldy_ + first, ldy_, v_rows);
    cols_out_[k_] = k_ < valid ? round_column(_mm512_loadu_ps(c_ + (t_ * mv_ + v_) * 256 + k_ * 16),
                                              scale_ ? scale_ + first + k_ : nullptr, bias_ ? bias_ + first + k_ : nullptr)
                               : _mm256_setzero_si256();
  }

  __m256i cols_out_[16];
  const float* c_ = nullptr;
  const uint16_t *scale_ = nullptr, *bias_ = nullptr, *up_bias_ = nullptr;
  uint16_t* y_ = nullptr;
  int64_t ldy_ = 0, rows_ = 0;
  Epilogue epilogue_ = Epilogue::kPlain;
  int mv_ = 0, cols_ = 0, tiles_ = 1, left_ = 0, v_ = 0, t_ = 0, k_ = 0;
};

// Tiles 0-3 accumulate (t0v0, t1v0, t0v1, t1v1), 4-5 hold A (weight rows a0, a1), 6-7 B (x
// vectors 0, 1), over pairs [j0, j1) of K. The sums start from c_in (a previous range's, exactly
// as stored: the order of additions is that of one pass over all of K) or from zero, and go to
// c_out as [t][v][16 weight rows][16 x rows] float32. Meanwhile the previous step's epilogue
// (pending) advances a few units per 32 of K, and is done before c_out is written: c_out may be
// the buffer it reads.
template <int MV>
void amx_tile(const uint32_t* xv, int64_t pairs, const uint16_t* a0, const uint16_t* a1, int64_t lda_bytes,
              int64_t j0, int64_t j1, const float* c_in, float* c_out, StepStore& pending) {
  if (c_in) {
    _tile_loadd(0, c_in, 64);
    _tile_loadd(1, c_in + MV * 256, 64);
    if constexpr (MV == 2) {
      _tile_loadd(2, c_in + 256, 64);
      _tile_loadd(3, c_in + 3 * 256, 64);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (MV == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const uint32_t* x1 = xv + pairs * 16;
  const int64_t iterations = (j1 - j0) / 16;
  const int per_iteration = static_cast<int>((pending.left() + iterations - 1) / iterations);
  for (int64_t j = j0; j < j1; j += 16) {  // 16 pairs = 32 of K per step
    pending.advance(per_iteration);
    _tile_loadd(4, a0 + 2 * j, lda_bytes);
    _tile_loadd(6, xv + j * 16, 64);
    _tile_loadd(5, a1 + 2 * j, lda_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (MV == 2) {
      _tile_loadd(7, x1 + j * 16, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  pending.finish();
  _tile_stored(0, c_out, 64);
  _tile_stored(1, c_out + MV * 256, 64);
  if constexpr (MV == 2) {
    _tile_stored(2, c_out + 256, 64);
    _tile_stored(3, c_out + 3 * 256, 64);
  }
}

// All row chunks of x (2 vectors at a time, the last alone if odd) against one step's A rows; each
// chunk's sums are stored (pending) while the next chunk's are computed.
void run_step(const uint32_t* xp, int64_t M, int64_t pairs, const uint16_t* a0, const uint16_t* a1, int64_t lda_bytes,
              int cols, const uint16_t* scale, const uint16_t* bias, uint16_t* y, int64_t ldy, float* c,
              StepStore& pending) {
  const int64_t vectors = (M + 15) / 16;
  for (int64_t v = 0; v < vectors;) {
    const uint32_t* xv = xp + v * pairs * 16;
    const int mv = vectors - v >= 2 ? 2 : 1;
    if (mv == 2) amx_tile<2>(xv, pairs, a0, a1, lda_bytes, 0, pairs, nullptr, c, pending);
    else amx_tile<1>(xv, pairs, a0, a1, lda_bytes, 0, pairs, nullptr, c, pending);
    pending.set(c, mv, Epilogue::kPlain, cols, scale, bias, nullptr, y + v * 16 * ldy, ldy, M - v * 16);
    v += mv;
  }
}

// Rows [first, first + count) of a [*, K] bf16 matrix as a 16-row tile source: in place when all
// 16 exist, else copied into pad with zero rows after (the A tile always loads 16 rows).
const uint16_t* tile_rows(const uint16_t* w, int64_t K, int64_t first, int64_t count, std::vector<uint16_t>& pad) {
  if (count >= 16) return w + first * K;
  pad.assign(16 * K, 0);
  if (count > 0) std::memcpy(pad.data(), w + first * K, count * K * sizeof(uint16_t));
  return pad.data();
}

// Each thread loads the tile configuration before its tiles and releases the state after, so
// that other code on the thread (oneDNN's AMX kernels) finds the tiles as it expects them.
struct TileScope {
  TileScope() { _tile_loadconfig(tile_config()); }
  ~TileScope() { _tile_release(); }
};

// Cache blocking, in the spirit of a BLIS/oneDNN GEMM: K in ranges of at most kDepth (all of it up
// to 2 kDepth), so that a block of weight rows (about 512 KiB of their range of K) and a chunk of
// 16-row vectors of x (about 512 KiB, at least the 2 a step takes) both stay in L2 while the other
// passes; sums carry from one range of K to the next through memory, exactly. Without the chunks
// a long prefill streamed all of x from L3 for every 32 weight rows; without the ranges of K, a
// down projection (K = 8960) held only 32 weight rows a block and did the same.
constexpr int64_t kDepth = 1024;
int64_t depth(int64_t K) { return K <= 2 * kDepth ? K : kDepth; }
int64_t block_rows(int64_t depth) {
  return std::max<int64_t>(kAmxColumns, (int64_t{1} << 19) / (2 * depth) / kAmxColumns * kAmxColumns);
}
int64_t chunk_vectors(int64_t depth) { return std::max<int64_t>(2, (int64_t{1} << 19) / (32 * depth) / 2 * 2); }

}  // namespace

bool amx_usable(int64_t K) {
  static const bool granted = request_amx();
  return granted && K % 32 == 0 && K > 0;
}

void amx_gemm_rows(Epilogue epilogue, const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t up_rows,
                   const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end) {
  TileScope tiles;
  alignas(64) float c[4 * 256];
  StepStore pending;  // the last step's epilogue, done during the next step
  std::vector<uint16_t> pad0, pad1;
  const bool gated = epilogue != Epilogue::kPlain;
  const int64_t pairs = K / 2, lda = 2 * K, step = gated ? 16 : 32, d = depth(K);
  const int64_t block = block_rows(d) / (gated ? 2 : 1), chunk = chunk_vectors(d), vectors = (M + 15) / 16;
  // sums between ranges of K: one step's tiles per (step of the block, pair of vectors of the chunk)
  std::vector<float> carried(d < K ? (block / step) * (chunk / 2) * 4 * 256 : 0);
  for (int64_t b = n_begin; b < n_end; b += block) {
    const int64_t b_end = std::min(n_end, b + block);
    for (int64_t v0 = 0; v0 < vectors; v0 += chunk) {
      const int64_t v_end = std::min(vectors, v0 + chunk);
      for (int64_t j0 = 0; j0 < pairs; j0 += d / 2) {
        const int64_t j1 = std::min(pairs, j0 + d / 2);
        const bool first = j0 == 0, last = j1 == pairs;
        float* slot = carried.data();
        for (int64_t n = b; n < b_end; n += step) {
          const int cols = static_cast<int>(std::min<int64_t>(step, n_end - n));
          const uint16_t* a0 = tile_rows(w, K, n, cols, pad0);
          const uint16_t* a1 = gated ? tile_rows(w, K, up_rows + n, cols, pad1) : tile_rows(w, K, n + 16, cols - 16, pad1);
          for (int64_t v = v0; v < v_end; v += 2, slot += 4 * 256) {
            const uint32_t* xv = xp + v * pairs * 16;
            float* out = last ? c : slot;
            const float* in = first ? nullptr : slot;
            const int64_t rows = M - v * 16;
            uint16_t* yv = y + v * 16 * ldy + n;
            const uint16_t* bn = bias ? bias + n : nullptr;
            const uint16_t* up_bias = gated && bias ? bias + up_rows + n : nullptr;
            const int mv = v_end - v >= 2 ? 2 : 1;
            if (mv == 2) amx_tile<2>(xv, pairs, a0, a1, lda, j0, j1, in, out, pending);
            else amx_tile<1>(xv, pairs, a0, a1, lda, j0, j1, in, out, pending);
            if (last) pending.set(c, mv, epilogue, cols, nullptr, bn, up_bias, yv, ldy, rows);
          }
        }
      }
    }
  }
  pending.finish();
}

void amx_int8_gemm_rows(const uint32_t* xp, int64_t M, int64_t K, const int8_t* q, const uint16_t* scales,
                        const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t N, int64_t n_begin, int64_t n_end) {
  TileScope tiles;
  alignas(64) float c[4 * 256];
  StepStore pending;  // the last step's epilogue, done during the next step
  std::vector<uint16_t> rows_bf16(kAmxColumns * K);
  for (int64_t n = n_begin; n < n_end; n += kAmxColumns) {
    const int cols = static_cast<int>(std::min<int64_t>(kAmxColumns, n_end - n));
    for (int r = 0; r < kAmxColumns; ++r) {
      if (r < cols) widen_codes(q + (n + r) * K, K, rows_bf16.data() + r * K);
      else std::memset(rows_bf16.data() + r * K, 0, K * sizeof(uint16_t));
    }
    run_step(xp, M, K / 2, rows_bf16.data(), rows_bf16.data() + 16 * K, 2 * K, cols, scales + n,
             bias ? bias + n : nullptr, y + n, ldy, c, pending);
  }
  pending.finish();
}

namespace {

// Block b's codes for k in [k0, k0 + 32) -> 4 B tiles (rows 0-15, 16-31, 32-47, 48-63 of the block),
// each 16 K-pairs x 16 rows x 2 bf16: (q - 8) * scale + zero in float32, rounded to bf16 once.
// The 32 k lie in one group (group sizes are multiples of 32).
void dequantize_chunk(const uint8_t* block, int64_t k0, const uint32_t* scale_zero_row0, uint16_t* tiles) {
  const __m512i pair_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
  for (int r = 0; r < 4; ++r) {  // rows 16r.. of the block: bytes (r % 2) * 16.., nibble r / 2
    __m512 scale, offset;
    int4_scale_offset(scale_zero_row0 + 16 * r, scale, offset);
    uint16_t* tile = tiles + r * 512;
    for (int p = 0; p < 16; ++p) {
      __m512 w[2];
      for (int j = 0; j < 2; ++j) {
        const uint8_t* bytes = block + (k0 + 2 * p + j) * 32 + (r % 2) * 16;
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
        q = r < 2 ? _mm512_and_si512(q, _mm512_set1_epi32(15)) : _mm512_srli_epi32(q, 4);
        w[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, offset);
      }
      const __m512 lo = _mm512_permutex2var_ps(w[0], pair_lo, w[1]);  // rows 0-7: (k, k + 1) pairs
      const __m512 hi = _mm512_permutex2var_ps(w[0], pair_hi, w[1]);  // rows 8-15
      _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// C [16 x rows][16 weight rows] float32 (+ bias) -> bf16 y rows.
void store_rows(const float* c, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t rows) {
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16))
                        : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + 16 * m), b)));
}

}  // namespace

void amx_int4_gemm_blocks(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, const uint32_t* scale_zero,
                          int64_t group_size, const uint16_t* bias, uint16_t* y, int64_t N, int64_t block_begin,
                          int64_t block_end) {
  TileScope tiles;
  const int64_t chunks = K / 32, vectors = (M + 15) / 16;
  std::vector<uint16_t> b_tiles(chunks * 4 * 512);  // [chunk][row group][16 pairs][16 rows][2]
  std::vector<uint16_t> x_pad;  // the last 16 x rows, zero-padded, when M is not a multiple of 16
  if (M % 16) {
    x_pad.assign(16 * K, 0);
    std::memcpy(x_pad.data(), x + (vectors - 1) * 16 * K, (M % 16) * K * sizeof(uint16_t));
  }
  alignas(64) float c[4 * 256];
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint8_t* block = packed + b * K * 32;
    for (int64_t ch = 0; ch < chunks; ++ch)
      dequantize_chunk(block, ch * 32, scale_zero + (ch * 32 / group_size) * N + b * kInt4BlockRows, b_tiles.data() + ch * 2048);
    for (int64_t v = 0; v < vectors; v += 2) {
      const int mv = vectors - v >= 2 ? 2 : 1;
      const uint16_t* a0 = (v + 1 == vectors && M % 16) ? x_pad.data() : x + v * 16 * K;
      const uint16_t* a1 = (v + 2 == vectors && M % 16) ? x_pad.data() : x + (v + 1) * 16 * K;
      for (int g = 0; g < 4; g += 2) {  // row groups (g, g + 1) of the block
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const uint16_t* bt = b_tiles.data() + ch * 2048 + g * 512;
          _tile_loadd(4, a0 + ch * 32, 2 * K);
          _tile_loadd(6, bt, 64);
          _tile_loadd(7, bt + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (mv == 2) {
            _tile_loadd(5, a1 + ch * 32, 2 * K);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        if (mv == 2) {
          _tile_stored(2, c + 512, 64);
          _tile_stored(3, c + 768, 64);
        }
        for (int t = 0; t < 2 * mv; ++t) {  // tile t: x rows 16 (v + t / 2).., weight rows of group g + t % 2
          const int64_t xv = v + t / 2, n = b * 64 + (g + t % 2) * 16;
          store_rows(c + 256 * t, bias ? bias + n : nullptr, y + xv * 16 * N + n, N, std::min<int64_t>(16, M - xv * 16));
        }
      }
    }
  }
}

#else  // compiled without AMX: never usable, so the entry points below are never reached

bool amx_usable(int64_t) { return false; }

void amx_gemm_rows(Epilogue, const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*,
                   int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "built without AMX");
}

void amx_int8_gemm_rows(const uint32_t*, int64_t, int64_t, const int8_t*, const uint16_t*, const uint16_t*, uint16_t*,
                        int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "built without AMX");
}

void amx_int4_gemm_blocks(const uint16_t*, int64_t, int64_t, const uint8_t*, const uint32_t*, int64_t, const uint16_t*,
                          uint16_t*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "built without AMX");
}

#endif  // DABBA_HAVE_AMX

#else  // without AVX512-BF16 (the avx2 and generic variants) no AMX kernel is built either

bool amx_usable(int64_t) { return false; }

#endif  // DABBA_HAVE_BF16_GEMM

}  // namespace dabba

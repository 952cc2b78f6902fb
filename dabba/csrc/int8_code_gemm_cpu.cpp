// INT8 weights (quantization/rtn.py's: int8 codes [N, K], a scale per output channel) through the
// integer GEMM that GGUF's and INT4's prefills take (code_gemm.h): x rounded to 8-bit codes per 32
// values as the GGUF GEMV rounds it, each thread's 32 channels gathered into a panel of codes made
// unsigned (+ 128, the bias folded into the int32 sums), their scale for every block of 32. For
// bf16 rows past the INT8 GEMV on CPUs with AVX512-VNNI and no AMX tiles; int8_linear
// (gemm_cpu.cpp) chooses.
#include <ATen/ATen.h>

#include "bf16_tiles.h"
#include "code_gemm.h"
#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dabba {

#ifdef DABBA_HAVE_CODE_GEMM

namespace {

// Channels first .. first + kPanel of the codes into p: per line of 16 rows, each 64 bytes (16
// quads of k) of the 16 rows, flipped to unsigned, through a 16 x 16 transpose of dwords into 16
// of the panel's lines; the rows' scale for every block.
void int8_panel(const int8_t* codes, int64_t N, int64_t K, const c10::BFloat16* scales, int64_t first,
                code_gemm::Panel& p) {
  constexpr int kPanel = code_gemm::kPanel;
  const int64_t count = std::min<int64_t>(kPanel, N - first);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int line = 0; line * 16 < count; ++line) {
    const int64_t rows = std::min<int64_t>(16, count - 16 * line);
    const int8_t* base = codes + (first + 16 * line) * K;
    for (int64_t k = 0; k < K; k += 64) {
      const int quads = static_cast<int>(std::min<int64_t>(16, (K - k) / 4));
      const __mmask16 lanes = static_cast<__mmask16>(quads == 16 ? 0xFFFF : (1u << quads) - 1);
      __m512i r[16];
      for (int c = 0; c < 16; ++c)
        r[c] = c < rows ? _mm512_xor_si512(_mm512_maskz_loadu_epi32(lanes, base + c * K + k), flip)
                        : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < quads; ++j)
        _mm512_storeu_si512(p.codes.data() + (k / 4 + j) * kPanel * 4 + 64 * line, r[j]);
    }
    const __mmask16 valid = static_cast<__mmask16>(rows == 16 ? 0xFFFF : (1u << rows) - 1);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, scales + first + 16 * line)), 16));
    for (int64_t b = 0; b < K / gguf::kA8Block; ++b) _mm512_storeu_ps(p.s.data() + b * kPanel + 16 * line, s);
  }
}

}  // namespace

bool int8_integer_gemm_takes(const at::Tensor& x, const at::Tensor& codes) {
  return x.scalar_type() == at::kBFloat16 && x.size(1) % gguf::kA8Block == 0 && codes.is_contiguous() &&
         integer_gemm_usable(x.size(1));
}

at::Tensor int8_integer_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias) {
  using T = c10::BFloat16;
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  gguf::A8Needs needs;
  needs.legacy = true;
  const std::vector<gguf::A8Rows>& passes = code_gemm::quantize_passes<T>(x, needs);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* q = codes.data_ptr<int8_t>();
  const T* s = scales.data_ptr<T>();
  const code_gemm::CodeForm form{gguf::kA8Block, 128, false, false};
  code_gemm::code_gemm<T>(passes, M, K, form, N, 0, [&](int64_t first, code_gemm::Panel& p) {
    int8_panel(q, N, K, s, first, p);
  }, bias.has_value() ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), N);
  return y;
}

#else

bool int8_integer_gemm_takes(const at::Tensor&, const at::Tensor&) { return false; }

at::Tensor int8_integer_gemm(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "int8_integer_gemm: not in this build");
}

#endif

}  // namespace dabba

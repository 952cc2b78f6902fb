// Fused element-wise kernels for the CPU: RMSNorm (optionally with the residual add before it),
// SiLU-and-mul and GELU(tanh)-and-mul, and rotary embedding. Each is one pass over memory where PyTorch's op chain
// makes four to six, and each rounds to the model dtype exactly where transformers' op chain
// does, so bf16 results match the reference bit for bit, not just to within a tolerance.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dabba {

// float <-> storage type. bf16 conversions are written on the bits so loops vectorise.
template <typename scalar_t>
struct Cvt {
  static inline float load(scalar_t x) { return static_cast<float>(x); }
  static inline scalar_t store(float x) { return static_cast<scalar_t>(x); }
};

template <>
struct Cvt<at::BFloat16> {
  static inline float load(at::BFloat16 x) { return bf16_bits_to_float(x.x); }
  static inline at::BFloat16 store(float f) { return at::BFloat16(float_to_bf16_bits(f), at::BFloat16::from_bits()); }
};

// Round a float to the storage type and back: the rounding the reference applies between ops.
template <typename scalar_t>
inline float round_to(float x) {
  return Cvt<scalar_t>::load(Cvt<scalar_t>::store(x));
}

// One row: out = weight * round(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm.
// The sum of squares runs in 16 lanes: GCC leaves a single float accumulator scalar (without
// -ffast-math it may not reorder the additions), which made this 30 us per 128 x 576 bf16 rows.
// kUnitOffset: Gemma's form, x * inv * (1 + w) in float32 and rounded once; else Llama's,
// round(x * inv) then times w.
template <typename scalar_t, bool kUnitOffset = false>
inline void rms_norm_row(scalar_t* out, const scalar_t* x, const scalar_t* weight, int64_t n, float eps) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = Cvt<scalar_t>::load(x[i + l]);
      lanes[l] += v * v;
    }
  float sum_sq = 0.f;
  for (; i < n; ++i) {
    const float v = Cvt<scalar_t>::load(x[i]);
    sum_sq += v * v;
  }
  for (int64_t l = 0; l < kLanes; ++l) sum_sq += lanes[l];
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  if constexpr (kUnitOffset) {
    for (int64_t i = 0; i < n; ++i)
      out[i] = Cvt<scalar_t>::store(Cvt<scalar_t>::load(x[i]) * inv * (1.f + Cvt<scalar_t>::load(weight[i])));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float normed = round_to<scalar_t>(Cvt<scalar_t>::load(x[i]) * inv);
    out[i] = Cvt<scalar_t>::store(Cvt<scalar_t>::load(weight[i]) * normed);
  }
}

// y <- round(x + y)
template <typename scalar_t>
inline void add_row(scalar_t* __restrict y, const scalar_t* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = Cvt<scalar_t>::store(Cvt<scalar_t>::load(x[i]) + Cvt<scalar_t>::load(y[i]));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] of x's dtype");
}

namespace {

template <bool kUnitOffset>
void rms_norm_rows(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == x.scalar_type(), "bad out");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<scalar_t, kUnitOffset>(op + r * n, xp + r * n, wp, n, static_cast<float>(eps));
    });
  });
}

// residual <- round(x + residual); x <- rms_norm(residual). The add rounds to the model dtype
// first, as `hidden = residual + hidden` does in the reference.
template <bool kUnitOffset>
void fused_add_rms_norm_rows(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * n;
        scalar_t* rr = rp + r * n;
        add_row(rr, xr, n);
        rms_norm_row<scalar_t, kUnitOffset>(xr, rr, wp, n, static_cast<float>(eps));
      }
    });
  });
}

}  // namespace

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  rms_norm_rows<false>(out, x, weight, eps);
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  fused_add_rms_norm_rows<false>(x, residual, weight, eps);
}

void gemma_rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  rms_norm_rows<true>(out, x, weight, eps);
}

void gemma_fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  fused_add_rms_norm_rows<true>(x, residual, weight, eps);
}

namespace {

// out = round(act(gate)) * up, with x = [gate | up] along the last dimension: the rounding of
// transformers' act_fn(gate_proj(x)) * up_proj(x). (For bf16 this is silu_mul_bf16_bits /
// gelu_mul_bf16_bits, which the GEMM's fused epilogue applies: the two agree bit for bit.)
template <float (*Act)(float), typename scalar_t>
DABBA_WIDE_LOOPS
void act_and_mul_row(scalar_t* __restrict out, const scalar_t* __restrict gate, const scalar_t* __restrict up,
                     int64_t d) {
  for (int64_t i = 0; i < d; ++i)
    out[i] = Cvt<scalar_t>::store(round_to<scalar_t>(Act(Cvt<scalar_t>::load(gate[i]))) * Cvt<scalar_t>::load(up[i]));
}

template <float (*Act)(float)>
void act_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be contiguous [rows, 2 * d]");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == d && out.is_contiguous() &&
              out.scalar_type() == x.scalar_type(), "bad out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "act_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * d;
        act_and_mul_row<Act>(op + r * d, gate, gate + d, d);
      }
    });
  });
}

}  // namespace

// SwiGLU
void silu_and_mul(at::Tensor out, const at::Tensor& x) { act_and_mul<silu>(out, x); }

// GeGLU (Gemma's gelu_pytorch_tanh)
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) { act_and_mul<gelu_tanh>(out, x); }

void silu_and_mul_row(float* out, const float* gate, const float* up, int64_t d) {
  act_and_mul_row<silu>(out, gate, up, d);
}
void silu_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t d) {
  act_and_mul_row<silu>(out, gate, up, d);
}
void gelu_tanh_and_mul_row(float* out, const float* gate, const float* up, int64_t d) {
  act_and_mul_row<gelu_tanh>(out, gate, up, d);
}
void gelu_tanh_and_mul_row(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up, int64_t d) {
  act_and_mul_row<gelu_tanh>(out, gate, up, d);
}

// In place on q [tokens, heads, d] and k [tokens, kv_heads, d] (rows may be strided views of a
// fused qkv output): x <- round(x * cos) + round(rotate_half(x) * sin), cos/sin [tokens, d] of
// angle_t. With angles in x's dtype each product rounds to it, as the model-dtype reference;
// with float32 angles the rotation runs in float32 and rounds once (transformers' vision towers).
template <typename scalar_t, typename angle_t>
void rotate_rows(at::Tensor& x, const angle_t* cos, const angle_t* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    float buf[1024];
    for (int64_t t = begin; t < end; ++t) {
      const angle_t* c = cos + t * d;
      const angle_t* s = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = xp + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < d; ++i) buf[i] = Cvt<scalar_t>::load(row[i]);
        for (int64_t i = 0; i < d; ++i) {
          const float rotated = i < half ? -buf[i + half] : buf[i - half];
          const float a = round_to<angle_t>(buf[i] * Cvt<angle_t>::load(c[i]));
          const float b = round_to<angle_t>(rotated * Cvt<angle_t>::load(s[i]));
          row[i] = Cvt<scalar_t>::store(a + b);
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "bad q/k shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q/k rows must be contiguous along head_dim");
  TORCH_CHECK(q.size(2) % 2 == 0 && q.size(2) <= 1024, "head_dim must be even and at most 1024");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == q.size(0) && cos.size(-1) == q.size(2),
              "cos/sin must be contiguous [tokens, head_dim]");
  const bool float_angles = cos.scalar_type() == at::kFloat;
  TORCH_CHECK((cos.scalar_type() == q.scalar_type() || float_angles) && sin.scalar_type() == cos.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "dtype mismatch: cos/sin in q's dtype or float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    if (float_angles) {
      rotate_rows<scalar_t, float>(q, cos.data_ptr<float>(), sin.data_ptr<float>());
      rotate_rows<scalar_t, float>(k, cos.data_ptr<float>(), sin.data_ptr<float>());
    } else {
      rotate_rows<scalar_t, scalar_t>(q, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
      rotate_rows<scalar_t, scalar_t>(k, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
    }
  });
}

}  // namespace dabba

TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("gemma_rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("gemma_fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(dabba::rms_norm));
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(dabba::fused_add_rms_norm));
  m.impl("gemma_rms_norm", c10::DispatchKey::CPU, TORCH_FN(dabba::gemma_rms_norm));
  m.impl("gemma_fused_add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(dabba::gemma_fused_add_rms_norm));
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::silu_and_mul));
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, TORCH_FN(dabba::gelu_tanh_and_mul));
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(dabba::rotary_embedding));
}

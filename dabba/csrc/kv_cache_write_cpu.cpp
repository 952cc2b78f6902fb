// Writing a step's keys and values into the paged KV cache (write_kv_cache): full precision as
// they are, or quantized to 8-bit codes with a float32 scale per token and kv head exactly as
// dabba/attention/kv_quant.py's KVQuant.quantize does. The layout is paged_attention_cpu.cpp's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "paged_attention.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace dabba {

// This step's keys and values [num_tokens, num_kv_heads, head_dim] into their slots: values as
// rows, keys transposed within the block. One call per layer instead of a chain of indexing ops.
template <typename scalar_t>
void write_kv_impl(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slot_mapping) {
  const int64_t num_tokens = k.size(0), num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_blocks = value_cache.size(1), block_size = value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* kc = key_cache.data_ptr<scalar_t>();
  scalar_t* vc = value_cache.data_ptr<scalar_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const scalar_t* ksrc = kp + t * k.stride(0) + h * k.stride(1);
      const scalar_t* vsrc = vp + t * v.stride(0) + h * v.stride(1);
      scalar_t* kdst = kc + ((h * num_blocks + block) * head_dim) * block_size + offset;
      for (int64_t d = 0; d < head_dim; ++d) kdst[d * block_size] = ksrc[d];
      std::memcpy(vc + ((h * num_blocks + block) * block_size + offset) * head_dim, vsrc, head_dim * sizeof(scalar_t));
    }
  }
}

// float -> float8_e4m3fn bits exactly as c10::Float8_e4m3fn(float) converts (to nearest even;
// saturating at 448 past the largest finite value, NaN to NaN), with selects instead of its
// branches, so that a loop over a row vectorises.
inline uint8_t float_to_e4m3fn_bits(float f) {
  constexpr uint32_t kOverflow = UINT32_C(1087) << 20;  // 480.0f: the first value past 448's rounding range
  constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // adding it leaves a subnormal's code in the low bits
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  float magnitude, magic, shifted;
  std::memcpy(&magnitude, &bits, sizeof(magnitude));
  std::memcpy(&magic, &kDenormMagic, sizeof(magic));
  shifted = magnitude + magic;
  uint32_t denorm;
  std::memcpy(&denorm, &shifted, sizeof(denorm));
  denorm -= kDenormMagic;
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t large = bits > UINT32_C(0x7f800000) ? 0x7fu : 0x7eu;
  const uint32_t code = bits >= kOverflow ? large : bits < (UINT32_C(121) << 23) ? denorm : normal;
  return static_cast<uint8_t>(code | sign);
}

// max |x[i]| over n floats, in 16 lanes (a scalar max reduction is not vectorised).
inline float max_abs(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  vfloat vmax = {};
  for (int64_t i = 0; i < full; i += kLanes) {
    const vfloat v = load16(x + i);
    const vfloat a = select(v < vfloat{}, -v, v);
    vmax = select(vmax > a, vmax, a);
  }
  float m = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) m = std::max(m, vmax[i]);
  for (int64_t i = full; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// x[0..n) -> codes[0..n) and the scale they share, as KVQuant.quantize computes them:
// scale = max(max|x| / q_max, 1e-12) and y = x / scale (true divisions, as torch's), then int8:
// y rounded half to even (torch.round) and clamped to +-q_max; fp8: y to float8_e4m3fn. xf: n
// floats of scratch.
template <typename scalar_t, typename code_t>
float quantize_row(const scalar_t* x, int64_t n, float q_max, float* xf, code_t* codes) {
  for (int64_t i = 0; i < n; ++i) xf[i] = static_cast<float>(x[i]);
  const float scale = std::max(max_abs(xf, n) / q_max, 1e-12f);
  if constexpr (std::is_same_v<code_t, int8_t>) {
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<int8_t>(std::clamp(std::nearbyint(xf[i] / scale), -q_max, q_max));
  } else {
    uint8_t* bits = reinterpret_cast<uint8_t*>(codes);
    for (int64_t i = 0; i < n; ++i) bits[i] = float_to_e4m3fn_bits(xf[i] / scale);
  }
  return scale;
}

// write_kv_impl for an 8-bit cache: each token's head vector quantized on its own (one scale per
// token and kv head), codes where write_kv_impl puts values, scales at [kv head, block, offset].
template <typename scalar_t, typename code_t>
void write_kv_codes_impl(at::Tensor& key_cache, at::Tensor& value_cache, at::Tensor& key_scales,
                         at::Tensor& value_scales, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& slot_mapping, float q_max) {
  const int64_t num_kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t num_blocks = value_cache.size(1), block_size = value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  code_t* kc = static_cast<code_t*>(key_cache.data_ptr());
  code_t* vc = static_cast<code_t*>(value_cache.data_ptr());
  float* ks = key_scales.data_ptr<float>();
  float* vs = value_scales.data_ptr<float>();
  // A prompt's thousands of rows in parallel; a decode step's few in one thread.
  at::parallel_for(0, k.size(0) * num_kv_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(head_dim);
    std::vector<code_t> codes(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      const int64_t row = (h * num_blocks + block) * block_size + offset;  // the token's scale, its value row
      ks[row] = quantize_row(kp + t * k.stride(0) + h * k.stride(1), head_dim, q_max, xf.data(), codes.data());
      code_t* kdst = kc + ((h * num_blocks + block) * head_dim) * block_size + offset;
      for (int64_t d = 0; d < head_dim; ++d) kdst[d * block_size] = codes[d];
      vs[row] = quantize_row(vp + t * v.stride(0) + h * v.stride(1), head_dim, q_max, xf.data(), vc + row * head_dim);
    }
  });
}

void write_kv_cache(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& key_scales,
                    const c10::optional<at::Tensor>& value_scales, double q_max) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [num_tokens, num_kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous");
  TORCH_CHECK(value_cache.size(0) == k.size(1) && value_cache.size(3) == k.size(2) &&
              key_cache.size(0) == k.size(1) && key_cache.size(1) == value_cache.size(1) &&
              key_cache.size(2) == k.size(2) && key_cache.size(3) == value_cache.size(2),
              "key_cache must be [kv_heads, blocks, head_dim, block_size], value_cache [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == k.size(0), "slot_mapping must be [num_tokens] int64");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "dtype mismatch");
  check_cache_kind(k, key_cache, value_cache, key_scales, value_scales);
  const int64_t num_slots = value_cache.size(1) * value_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  if (!is_code_dtype(key_cache.scalar_type())) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
      write_kv_impl<scalar_t>(key_cache, value_cache, k, v, slot_mapping);
    });
    return;
  }
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(q_max > 0 && q_max <= (int8 ? 127.0 : 448.0),
              "q_max must be in (0, ", int8 ? "127" : "448", "] for ", key_cache.scalar_type(), " codes");
  at::Tensor key_scale_t = *key_scales, value_scale_t = *value_scales;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {  // (check_cache_kind refused double)
      if (int8)
        write_kv_codes_impl<scalar_t, int8_t>(key_cache, value_cache, key_scale_t, value_scale_t, k, v, slot_mapping,
                                              static_cast<float>(q_max));
      else
        write_kv_codes_impl<scalar_t, c10::Float8_e4m3fn>(key_cache, value_cache, key_scale_t, value_scale_t, k, v,
                                                          slot_mapping, static_cast<float>(q_max));
    }
  });
}

}  // namespace dabba

// An 8-bit cache passes its codes as key_cache/value_cache (int8, or uint8 storage viewed as
// float8_e4m3fn) with key_scales/value_scales and KVQuant.q_max.
TORCH_LIBRARY_FRAGMENT(dabba_cpu, m) {
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor k, Tensor v, Tensor slot_mapping, "
        "Tensor(c!)? key_scales=None, Tensor(d!)? value_scales=None, float q_max=0.) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(dabba::write_kv_cache));
}

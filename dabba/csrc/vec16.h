// 16 float32 (or int32) lanes, and loads that widen bf16 (a 16-bit shift) or any other scalar to
// them: shared by the attention, KV-write and sampling kernels, portable to any CPU the compiler
// targets.
//
// A lane group is held as the widest vectors the build has: one 64-byte vector with AVX-512, two
// of 32 bytes with AVX/AVX2 (the avx2 variant), four of 16 with SSE or NEON. Written as one
// 64-byte GCC vector, a build without AVX-512 kept every value in memory (GCC has no register
// mode for it): the avx2 variant's decode attention ran 6x, its argmax 15x slower than the same
// lanes held as two 32-byte halves. Each lane's arithmetic is the same either way, so results
// are the same on every build.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dabba {

constexpr int64_t kLanes = 16;

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

// kLanes lanes of T in kParts native vectors: the operators act lane by lane, as GCC's vector
// extensions do; comparisons give all-ones (-1) or 0 per lane; select(mask, a, b) is the vector
// form of mask ? a : b.
template <typename T>
struct Lanes {
  static constexpr int kPartLanes = kVecBytes / sizeof(T);
  static constexpr int kParts = kLanes / kPartLanes;
  typedef T part_t __attribute__((vector_size(kVecBytes)));
  part_t part[kParts];

  T operator[](int64_t i) const { return part[i / kPartLanes][i % kPartLanes]; }

  template <typename Op>
  static Lanes map(const Lanes& a, const Lanes& b, Op op) {
    Lanes r;
    for (int i = 0; i < kParts; ++i) r.part[i] = op(a.part[i], b.part[i]);
    return r;
  }
  static Lanes splat(T s) {
    Lanes r;
    for (int i = 0; i < kParts; ++i) r.part[i] = part_t{} + s;
    return r;
  }
  friend Lanes operator+(const Lanes& a, const Lanes& b) { return map(a, b, [](part_t x, part_t y) { return x + y; }); }
  friend Lanes operator*(const Lanes& a, const Lanes& b) { return map(a, b, [](part_t x, part_t y) { return x * y; }); }
  friend Lanes operator|(const Lanes& a, const Lanes& b) { return map(a, b, [](part_t x, part_t y) { return x | y; }); }
  friend Lanes operator*(T s, const Lanes& a) {
    Lanes r;
    for (int i = 0; i < kParts; ++i) r.part[i] = s * a.part[i];
    return r;
  }
  friend Lanes operator-(const Lanes& a) {
    Lanes r;
    for (int i = 0; i < kParts; ++i) r.part[i] = -a.part[i];
    return r;
  }
  Lanes& operator+=(const Lanes& b) { return *this = *this + b; }
  Lanes& operator*=(const Lanes& b) { return *this = *this * b; }
  Lanes& operator|=(const Lanes& b) { return *this = *this | b; }
  Lanes& operator+=(T s) { return *this = *this + splat(s); }
};

typedef Lanes<float> vfloat;
typedef Lanes<int32_t> vint;

namespace vec16_detail {
template <typename Cmp>
inline vint compare(const vfloat& a, const vfloat& b, Cmp cmp) {
  vint r;
  for (int i = 0; i < vfloat::kParts; ++i) r.part[i] = cmp(a.part[i], b.part[i]);
  return r;
}
}  // namespace vec16_detail

inline vint operator>(const vfloat& a, const vfloat& b) {
  return vec16_detail::compare(a, b, [](vfloat::part_t x, vfloat::part_t y) { return x > y; });
}
inline vint operator<(const vfloat& a, const vfloat& b) { return b > a; }
inline vint operator!=(const vfloat& a, const vfloat& b) {
  return vec16_detail::compare(a, b, [](vfloat::part_t x, vfloat::part_t y) { return x != y; });
}

// mask ? a : b per lane (mask lanes all-ones or 0, as the comparisons give).
template <typename T>
inline Lanes<T> select(const vint& mask, const Lanes<T>& a, const Lanes<T>& b) {
  Lanes<T> r;
  for (int i = 0; i < vint::kParts; ++i) r.part[i] = mask.part[i] ? a.part[i] : b.part[i];
  return r;
}

// 0, 1, .., 15.
inline vint lane_indices() {
  vint r;
  for (int64_t i = 0; i < kLanes; ++i) r.part[i / vint::kPartLanes][i % vint::kPartLanes] = static_cast<int32_t>(i);
  return r;
}

inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, const vfloat& v) { std::memcpy(p, &v, sizeof(v)); }

// 16 consecutive elements widened to float32.
template <typename scalar_t>
inline vfloat load16_as_float(const scalar_t* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

template <>
inline vfloat load16_as_float<float>(const float* p) {
  return load16(p);
}

// bf16 is float32's upper half: each part's lanes widened to 32 bits and shifted up.
template <>
inline vfloat load16_as_float<at::BFloat16>(const at::BFloat16* p) {
  constexpr int n = vfloat::kPartLanes;
  typedef uint16_t bits16 __attribute__((vector_size(n * sizeof(uint16_t))));
  typedef uint32_t bits32 __attribute__((vector_size(n * sizeof(uint32_t))));
  vfloat out;
  for (int i = 0; i < vfloat::kParts; ++i) {
    bits16 bits;
    std::memcpy(&bits, p + i * n, sizeof(bits));
    const bits32 wide = __builtin_convertvector(bits, bits32) << 16;
    std::memcpy(&out.part[i], &wide, sizeof(wide));
  }
  return out;
}

}  // namespace dabba

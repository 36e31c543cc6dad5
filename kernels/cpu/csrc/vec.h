// fp32 vectors of the CPU's width (GCC vector extensions), loads and stores of kLanes elements
// of any supported type, lane reductions, and vector exp2.
#pragma once

#include <algorithm>
#include <utility>

#include "common.h"

namespace prefixserve {

// The CPU's own vector width: GCC splits a wider vector type into pieces through the stack.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vushort __attribute__((vector_size(kLanes * 2)));
typedef _Float16 vhalf __attribute__((vector_size(kLanes * 2)));

inline vfloat broadcast(float x) { return vfloat{} + x; }

inline vfloat load_vec(const float* src) {
  vfloat out;
  std::memcpy(&out, src, sizeof(out));
  return out;
}
inline vfloat load_vec(const bf16* src) {
  vushort bits;
  std::memcpy(&bits, src, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vuint) << 16);
}
inline vfloat load_vec(const _Float16* src) {
  vhalf half;
  std::memcpy(&half, src, sizeof(half));
  return __builtin_convertvector(half, vfloat);
}

inline void store_vec(float* dst, vfloat x) { std::memcpy(dst, &x, sizeof(x)); }
inline void store_vec(bf16* dst, vfloat x) {  // round to nearest even; NaN stays NaN
  const vuint bits = reinterpret_cast<vuint>(x);
  const vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vuint nan = (bits >> 16) | 0x40u;
  const vushort out = __builtin_convertvector(x != x ? nan : rounded, vushort);
  std::memcpy(dst, &out, sizeof(out));
}
inline void store_vec(_Float16* dst, vfloat x) {
  const vhalf out = __builtin_convertvector(x, vhalf);
  std::memcpy(dst, &out, sizeof(out));
}

// The vector (f(0), ..., f(kLanes - 1)), as a compile-time constant (shuffle masks).
template <typename F, int... kIndex>
constexpr vint lane_indices(F f, std::integer_sequence<int, kIndex...>) {
  return vint{f(kIndex)...};
}
template <typename F>
constexpr vint lane_indices(F f) {
  return lane_indices(f, std::make_integer_sequence<int, kLanes>{});
}

// Lane-wise op with the vector's halves swapped, then its quarters, ...: every lane ends up with the result.
template <int kDistance = kLanes / 2, typename Op>
inline float reduce(vfloat x, Op op) {
  constexpr vint partner = lane_indices([](int i) { return i ^ kDistance; });
  x = op(x, __builtin_shuffle(x, partner));
  if constexpr (kDistance > 1) {
    return reduce<kDistance / 2>(x, op);
  } else {
    return x[0];
  }
}
inline float reduce_max(vfloat x) {
  return reduce(x, [](vfloat a, vfloat b) { return a > b ? a : b; });
}
inline float reduce_sum(vfloat x) {
  return reduce(x, [](vfloat a, vfloat b) { return a + b; });
}

// 2^x lane by lane, as exp2_approx: within 2 ulp for x < 128, exactly 0 below -126.
inline vfloat exp2_approx(vfloat x) {
  const auto underflow = x < -126.0f;
  x = underflow ? broadcast(-126.0f) : x;
  const vfloat round_magic = broadcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat whole = (x + round_magic) - round_magic;
  const vfloat f = x - whole;
  vfloat p = broadcast(1.5252733804059841e-05f);
  p = p * f + 1.5403530393381610e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const vint exponent_bits = (__builtin_convertvector(whole, vint) + 127) << 23;
  return underflow ? broadcast(0.0f) : p * reinterpret_cast<vfloat>(exponent_bits);
}

// Lane c of the result is the sum of the lanes of partial[c] (partial is overwritten): a
// transpose-and-add tree. Each level adds the interleaved halves of pairs of vectors, each
// holding kCount items of kLanes / kCount lanes, into vectors of half as many items of twice the lanes.
template <int kCount = kLanes>
inline vfloat sum_lanes_of_each(vfloat (&partial)[kLanes]) {
  constexpr int kHalf = kCount / 2;  // of (x, y): the first, then the second half of every 2 * kHalf lanes
  constexpr vint first = lane_indices([](int j) { return j / kHalf * 2 * kHalf + j % kHalf; });
  constexpr vint second = first + kHalf;
  for (int i = 0; i < kHalf; ++i) {
    const vfloat &x = partial[2 * i], &y = partial[2 * i + 1];
    partial[i] = __builtin_shuffle(x, y, first) + __builtin_shuffle(x, y, second);
  }
  if constexpr (kHalf > 1) {
    return sum_lanes_of_each<kHalf>(partial);
  } else {
    return partial[0];
  }
}

}  // namespace prefixserve

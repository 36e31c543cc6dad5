// 16-lane fp32 vectors (GCC vector extensions: AVX-512 where the CPU has it, narrower units
// otherwise), loads and stores of 16 elements of any supported type, and vector exp2.
#pragma once

#include <algorithm>

#include "common.h"

namespace prefixserve {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vushort __attribute__((vector_size(32)));
typedef _Float16 vhalf __attribute__((vector_size(32)));

inline vfloat broadcast(float x) { return vfloat{} + x; }

inline vfloat load16(const float* src) {
  vfloat out;
  std::memcpy(&out, src, sizeof(out));
  return out;
}
inline vfloat load16(const bf16* src) {
  vushort bits;
  std::memcpy(&bits, src, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vuint) << 16);
}
inline vfloat load16(const _Float16* src) {
  vhalf half;
  std::memcpy(&half, src, sizeof(half));
  return __builtin_convertvector(half, vfloat);
}

inline void store16(float* dst, vfloat x) { std::memcpy(dst, &x, sizeof(x)); }
inline void store16(bf16* dst, vfloat x) {  // round to nearest even; NaN stays NaN
  const vuint bits = reinterpret_cast<vuint>(x);
  const vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vuint nan = (bits >> 16) | 0x40u;
  const vushort out = __builtin_convertvector(x != x ? nan : rounded, vushort);
  std::memcpy(dst, &out, sizeof(out));
}
inline void store16(_Float16* dst, vfloat x) {
  const vhalf out = __builtin_convertvector(x, vhalf);
  std::memcpy(dst, &out, sizeof(out));
}

// Lane-wise op with the vector's halves swapped, four times: every lane ends up with the result.
template <typename Op>
inline float reduce(vfloat x, Op op) {
  x = op(x, __builtin_shuffle(x, vint{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = op(x, __builtin_shuffle(x, vint{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = op(x, __builtin_shuffle(x, vint{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  x = op(x, __builtin_shuffle(x, vint{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return x[0];
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

}  // namespace prefixserve

namespace prefixserve {

// Lane c of the result is the sum of the lanes of partial[c]: a transpose-and-add tree that
// turns 16 dot-product partial sums into one vector of 16 dot products (15 adds, 30 shuffles).
inline vfloat sum_lanes_of_each(const vfloat (&partial)[kLanes]) {
  vfloat pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; ++i) {  // items 2i, 2i+1: 8 lanes each
    const vfloat &x = partial[2 * i], &y = partial[2 * i + 1];
    pairs[i] = __builtin_shuffle(x, y, vint{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(x, y, vint{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int i = 0; i < 4; ++i) {  // items 4i..4i+3: 4 lanes each
    const vfloat &x = pairs[2 * i], &y = pairs[2 * i + 1];
    quads[i] = __builtin_shuffle(x, y, vint{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(x, y, vint{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  }
  for (int i = 0; i < 2; ++i) {  // items 8i..8i+7: 2 lanes each
    const vfloat &x = quads[2 * i], &y = quads[2 * i + 1];
    octets[i] = __builtin_shuffle(x, y, vint{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
                __builtin_shuffle(x, y, vint{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  }
  return __builtin_shuffle(octets[0], octets[1], vint{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(octets[0], octets[1], vint{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

}  // namespace prefixserve

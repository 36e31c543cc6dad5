// Element types, conversions and dtype dispatch shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace prefixserve {

// dtype codes, as kernels/cpu/library.py passes them
enum DType : int64_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <> inline bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((bits >> 16) | 0x40)};  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16{static_cast<uint16_t>(bits >> 16)};
}

// x rounded to T and back: reproduces torch's rounding of an intermediate result in T
template <typename T> inline float round_to(float x) { return to_float(from_float<T>(x)); }

constexpr float kLog2e = 1.4426950408889634f;

// Below this many elements an element-wise kernel runs on the calling thread: waking the OpenMP team
// costs more than the work, and on a busy machine a parallel region waits for its slowest thread's
// next time slice (a 64-row decode step of the default model on 2 threads, another process running:
// 4x slower than on 1 thread).
constexpr int64_t kMinParallelElements = int64_t{1} << 16;

// Calls f with a value of the element type that a dtype code names.
template <typename F> void dispatch(int64_t dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(float{}); break;
    case kBFloat16: f(bf16{}); break;
    case kFloat16: f(_Float16{}); break;
  }
}

}  // namespace prefixserve

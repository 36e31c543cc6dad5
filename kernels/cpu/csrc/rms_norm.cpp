// RMSNorm with an optional fused residual add: kernels.rms_norm.rms_norm_ref, rounding where it does.
#include <cmath>

#include "kernels.h"
#include "common.h"

namespace prefixserve {
namespace {

template <typename T>
void rms_norm(T* out, T* new_residual, const T* x, const T* residual, const T* weight, int64_t num_tokens,
              int64_t hidden_size, int64_t stride_x, int64_t stride_residual, float eps) {
#pragma omp parallel for schedule(static) if (num_tokens * hidden_size >= kMinParallelElements)
  for (int64_t token = 0; token < num_tokens; ++token) {
    const T* row = x + token * stride_x;
    if (residual != nullptr) {  // the sum, rounded to T as torch's x + residual is, is both output and input
      const T* residual_row = residual + token * stride_residual;
      T* sum = new_residual + token * hidden_size;
#pragma omp simd
      for (int64_t i = 0; i < hidden_size; ++i) sum[i] = from_float<T>(to_float(row[i]) + to_float(residual_row[i]));
      row = sum;
    }
    float sum_of_squares = 0.0f;
#pragma omp simd reduction(+ : sum_of_squares)
    for (int64_t i = 0; i < hidden_size; ++i) sum_of_squares += to_float(row[i]) * to_float(row[i]);
    const float inverse_rms = 1.0f / std::sqrt(sum_of_squares / hidden_size + eps);
    T* out_row = out + token * hidden_size;
#pragma omp simd
    for (int64_t i = 0; i < hidden_size; ++i) {
      out_row[i] = from_float<T>(round_to<T>(to_float(row[i]) * inverse_rms) * to_float(weight[i]));
    }
  }
}

}  // namespace
}  // namespace prefixserve

// out and new_residual are contiguous [num_tokens, hidden_size]; residual may be null (no add).
extern "C" void prefixserve_rms_norm(int64_t dtype, void* out, void* new_residual, const void* x,
                                     const void* residual, const void* weight, int64_t num_tokens,
                                     int64_t hidden_size, int64_t stride_x, int64_t stride_residual, float eps) {
  using namespace prefixserve;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    rms_norm<T>(static_cast<T*>(out), static_cast<T*>(new_residual), static_cast<const T*>(x),
                static_cast<const T*>(residual), static_cast<const T*>(weight), num_tokens, hidden_size, stride_x,
                stride_residual, eps);
  });
}

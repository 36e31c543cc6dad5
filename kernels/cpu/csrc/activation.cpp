// SwiGLU's activation: silu(gate) * up over the fused [gate | up] projection, rounding as
// kernels.activation.silu_and_mul_ref does.
#include <algorithm>

#include "kernels.h"
#include "vec.h"

namespace prefixserve {
namespace {

template <typename T>
void silu_and_mul_vec(T* out, const T* gate, const T* up) {
  const vfloat g = load_vec(gate);
  T silu[kLanes];  // rounded to T, as torch's silu output is
  store_vec(silu, g / (1.0f + exp2_approx(g * -kLog2e)));
  store_vec(out, load_vec(silu) * load_vec(up));
}

template <typename T>
void silu_and_mul(T* out, const T* gate_up, int64_t num_tokens, int64_t size, int64_t stride_token) {
#pragma omp parallel for schedule(static) if (num_tokens * size >= kMinParallelElements)
  for (int64_t token = 0; token < num_tokens; ++token) {
    const T* gate = gate_up + token * stride_token;
    const T* up = gate + size;
    T* out_row = out + token * size;
    int64_t i = 0;
    for (; i + kLanes <= size; i += kLanes) silu_and_mul_vec(out_row + i, gate + i, up + i);
    if (i < size) {  // the last partial vector, through zero-padded copies
      T gate_tail[kLanes] = {}, up_tail[kLanes] = {}, out_tail[kLanes];
      std::copy(gate + i, gate + size, gate_tail);
      std::copy(up + i, up + size, up_tail);
      silu_and_mul_vec(out_tail, gate_tail, up_tail);
      std::copy_n(out_tail, size - i, out_row + i);
    }
  }
}

}  // namespace
}  // namespace prefixserve

// gate_up [num_tokens, 2 * size] with row stride stride_token -> out contiguous [num_tokens, size].
extern "C" void prefixserve_silu_and_mul(int64_t dtype, void* out, const void* gate_up, int64_t num_tokens,
                                         int64_t size, int64_t stride_token) {
  using namespace prefixserve;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    silu_and_mul<T>(static_cast<T*>(out), static_cast<const T*>(gate_up), num_tokens, size, stride_token);
  });
}

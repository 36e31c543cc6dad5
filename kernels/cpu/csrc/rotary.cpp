// Rotary position embedding, rotate-half layout: kernels.rotary.apply_rotary_ref, fp32 math.
#include "kernels.h"
#include "common.h"

namespace prefixserve {
namespace {

// x1, x2 = halves of x: out = (x1 cos - x2 sin, x2 cos + x1 sin)
template <typename T>
void rotate(T* out, const T* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    out[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
    out[i + half] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void apply_rotary(T* query_out, T* key_out, const T* query, const T* key, const int64_t* positions,
                  const float* cos_sin_cache, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t stride_query_token, int64_t stride_query_head,
                  int64_t stride_key_token, int64_t stride_key_head) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens * (num_heads + num_kv_heads) * head_dim >= \
                                                    kMinParallelElements)
  for (int64_t token = 0; token < num_tokens; ++token) {
    const float* cos = cos_sin_cache + positions[token] * head_dim;
    const float* sin = cos + half;
    for (int64_t head = 0; head < num_heads; ++head) {
      rotate(query_out + (token * num_heads + head) * head_dim,
             query + token * stride_query_token + head * stride_query_head, cos, sin, half);
    }
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      rotate(key_out + (token * num_kv_heads + head) * head_dim,
             key + token * stride_key_token + head * stride_key_head, cos, sin, half);
    }
  }
}

}  // namespace
}  // namespace prefixserve

// query_out / key_out are contiguous; cos_sin_cache is contiguous fp32 [max_position, head_dim].
extern "C" void prefixserve_apply_rotary(int64_t dtype, void* query_out, void* key_out, const void* query,
                                         const void* key, const int64_t* positions, const float* cos_sin_cache,
                                         int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, int64_t stride_query_token, int64_t stride_query_head,
                                         int64_t stride_key_token, int64_t stride_key_head) {
  using namespace prefixserve;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    apply_rotary<T>(static_cast<T*>(query_out), static_cast<T*>(key_out), static_cast<const T*>(query),
                    static_cast<const T*>(key), positions, cos_sin_cache, num_tokens, num_heads, num_kv_heads,
                    head_dim, stride_query_token, stride_query_head, stride_key_token, stride_key_head);
  });
}

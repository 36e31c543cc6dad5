// Writing new tokens' K/V into the paged cache through a slot mapping (negative slot: skipped),
// as kernels.cache_write.write_kv_cache_ref. A byte copy per token and head: any element type.
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "common.h"

extern "C" void prefixserve_write_kv_cache(const char* key, const char* value, char* key_cache, char* value_cache,
                                           const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                                           int64_t head_bytes, int64_t block_size, int64_t stride_key_token,
                                           int64_t stride_key_head, int64_t stride_value_token,
                                           int64_t stride_value_head, int64_t stride_cache_block,
                                           int64_t stride_cache_slot, int64_t stride_cache_head) {
  // strides in bytes
  using prefixserve::kMinParallelElements;  // head_bytes / 4: the fp32 elements of as many bytes
#pragma omp parallel for schedule(static) if (num_tokens * num_kv_heads * head_bytes / 4 >= kMinParallelElements)
  for (int64_t token = 0; token < num_tokens; ++token) {
    const int64_t slot = slot_mapping[token];
    if (slot < 0) continue;
    const int64_t base = (slot / block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot;
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      const int64_t offset = base + head * stride_cache_head;
      std::memcpy(key_cache + offset, key + token * stride_key_token + head * stride_key_head, head_bytes);
      std::memcpy(value_cache + offset, value + token * stride_value_token + head * stride_value_head, head_bytes);
    }
  }
}

// The kernels that decoder.cpp chains, as their own files define them for kernels/cpu/library.py.
#pragma once

#include <cstdint>

extern "C" {
void prefixserve_rms_norm(int64_t dtype, void* out, void* new_residual, const void* x, const void* residual,
                          const void* weight, int64_t num_tokens, int64_t hidden_size, int64_t stride_x,
                          int64_t stride_residual, float eps);
void prefixserve_linear(int64_t dtype, void* out, const void* x, const void* packed, const void* bias,
                        int64_t num_rows, int64_t in_features, int64_t out_features, int64_t stride_x);
void prefixserve_apply_rotary(int64_t dtype, void* query_out, void* key_out, const void* query, const void* key,
                              const int64_t* positions, const float* cos_sin_cache, int64_t num_tokens,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t stride_query_token,
                              int64_t stride_query_head, int64_t stride_key_token, int64_t stride_key_head);
void prefixserve_write_kv_cache(const char* key, const char* value, char* key_cache, char* value_cache,
                                const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                                int64_t head_bytes, int64_t block_size, int64_t stride_key_token,
                                int64_t stride_key_head, int64_t stride_value_token, int64_t stride_value_head,
                                int64_t stride_cache_block, int64_t stride_cache_slot, int64_t stride_cache_head);
int prefixserve_paged_attention(int64_t dtype, void* out, const void* query, const void* key_cache,
                                const void* value_cache, const int32_t* block_tables, const int32_t* query_start_loc,
                                const int32_t* seq_lens, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, int64_t stride_query_token,
                                int64_t stride_query_head, int64_t stride_out_token, int64_t stride_out_head,
                                int64_t stride_cache_block, int64_t stride_cache_slot, int64_t stride_cache_head,
                                int64_t stride_block_table, float scale);
void prefixserve_silu_and_mul(int64_t dtype, void* out, const void* gate_up, int64_t num_tokens, int64_t size,
                              int64_t stride_token);
}

// A Llama-family model's decoder layers for one small batch in one call: per layer the kernels that
// replica/executor/model.py calls one at a time from Python, in the same order on the same operands (so
// the hidden states come out bit for bit the same), without the Python between them, which at a decode
// step's few rows costs more than the kernels do.
#include <utility>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace prefixserve {
namespace {

// A layer's row of the pointer table; packed weights as kernels/cpu/linear.py packs them. qkv_bias may be 0,
// and q_norm and k_norm (Qwen3's RMSNorm of each head of q and k, before RoPE) both 0.
enum LayerPointer {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kOutput, kPostNorm, kGateUp, kDown, kKeyCache, kValueCache,
  kLayerPointers
};

const void* at(const int64_t* pointers, LayerPointer which) { return reinterpret_cast<const void*>(pointers[which]); }

struct Shape {
  int64_t dtype, element_size, num_tokens, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  int64_t qkv_size() const { return q_size() + 2 * kv_size(); }
};

struct StepInputs {
  const int64_t* positions;
  const float* cos_sin_cache;
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t num_reqs, block_size, stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table;
  float eps, scale;
};

// One row of activations per token for each intermediate result of a layer.
class Activations {
 public:
  explicit Activations(const Shape& s) {
    const std::pair<char**, int64_t> widths[] = {
        {&normed, s.hidden_size}, {&mixed, s.hidden_size}, {&spare_residual, s.hidden_size}, {&qkv, s.qkv_size()},
        {&normed_query, s.q_size()}, {&normed_key, s.kv_size()}, {&query, s.q_size()}, {&key, s.kv_size()},
        {&attention, s.q_size()}, {&gate_up, 2 * s.intermediate_size}, {&activated, s.intermediate_size}};
    int64_t row_bytes = 0;
    for (const auto& [buffer, width] : widths) row_bytes += width * s.element_size;
    storage_.resize(static_cast<size_t>(s.num_tokens * row_bytes));
    char* next = storage_.data();
    for (const auto& [buffer, width] : widths) {
      *buffer = next;
      next += s.num_tokens * width * s.element_size;
    }
  }

  char *normed, *mixed, *spare_residual, *qkv, *normed_query, *normed_key, *query, *key, *attention, *gate_up,
      *activated;

 private:
  std::vector<char> storage_;
};

// Where rotary reads q and k: in qkv, or with q_norm and k_norm, their heads RMS-normed apart from it.
struct QueryKey {
  const char *query, *key;
  int64_t stride_query_token, stride_key_token;
};

QueryKey normed_query_key(const Shape& s, const StepInputs& in, const int64_t* pointers, Activations& a) {
  const int64_t bytes = s.element_size, D = s.head_dim;
  const char* key = a.qkv + s.q_size() * bytes;
  if (pointers[kQNorm] == 0) return {a.qkv, key, s.qkv_size(), s.qkv_size()};
  for (int64_t t = 0; t < s.num_tokens; ++t) {  // each token's heads as rows of head_dim
    prefixserve_rms_norm(s.dtype, a.normed_query + t * s.q_size() * bytes, nullptr, a.qkv + t * s.qkv_size() * bytes,
                         nullptr, at(pointers, kQNorm), s.num_heads, D, D, 0, in.eps);
    prefixserve_rms_norm(s.dtype, a.normed_key + t * s.kv_size() * bytes, nullptr, key + t * s.qkv_size() * bytes,
                         nullptr, at(pointers, kKNorm), s.num_kv_heads, D, D, 0, in.eps);
  }
  return {a.normed_query, a.normed_key, s.q_size(), s.kv_size()};
}

// Attention's half of a layer, from the normed input to the output projection (head_dim one that the
// attention kernel takes: kernels/cpu/decoder.py checks).
void attend(const Shape& s, const StepInputs& in, const int64_t* pointers, Activations& a) {
  char* key_cache = reinterpret_cast<char*>(pointers[kKeyCache]);
  char* value_cache = reinterpret_cast<char*>(pointers[kValueCache]);
  const int64_t T = s.num_tokens, bytes = s.element_size, D = s.head_dim;
  prefixserve_linear(s.dtype, a.qkv, a.normed, at(pointers, kQkv), at(pointers, kQkvBias), T, s.hidden_size,
                     s.qkv_size(), s.hidden_size);
  const QueryKey qk = normed_query_key(s, in, pointers, a);
  prefixserve_apply_rotary(s.dtype, a.query, a.key, qk.query, qk.key, in.positions, in.cos_sin_cache, T, s.num_heads,
                           s.num_kv_heads, D, qk.stride_query_token, D, qk.stride_key_token, D);
  prefixserve_write_kv_cache(a.key, a.qkv + (s.q_size() + s.kv_size()) * bytes, key_cache, value_cache,
                             in.slot_mapping, T, s.num_kv_heads, D * bytes, in.block_size, s.kv_size() * bytes,
                             D * bytes, s.qkv_size() * bytes, D * bytes, in.stride_cache_block * bytes,
                             in.stride_cache_slot * bytes, in.stride_cache_head * bytes);
  prefixserve_paged_attention(s.dtype, a.attention, a.query, key_cache, value_cache, in.block_tables,
                              in.query_start_loc, in.seq_lens, in.num_reqs, s.num_heads, s.num_kv_heads, D,
                              in.block_size, s.q_size(), D, s.q_size(), D, in.stride_cache_block,
                              in.stride_cache_slot, in.stride_cache_head, in.stride_block_table, in.scale);
  prefixserve_linear(s.dtype, a.mixed, a.attention, at(pointers, kOutput), nullptr, T, s.q_size(), s.hidden_size,
                     s.q_size());
}

}  // namespace
}  // namespace prefixserve

// hidden [num_tokens, hidden_size] (the embeddings; overwritten) -> out: the final norm of the last layer's
// output plus its residual, as the Python layers compute it. layers: [num_layers, LayerPointer] addresses.
// Attention takes one group of requests (block_tables, query_start_loc, seq_lens) for every token.
extern "C" void prefixserve_decoder_layers(
    int64_t dtype, void* out, void* hidden, const int64_t* layers, int64_t num_layers, const void* final_norm,
    const int64_t* positions, const float* cos_sin_cache, const int64_t* slot_mapping, const int32_t* block_tables,
    const int32_t* query_start_loc, const int32_t* seq_lens, int64_t num_reqs, int64_t num_tokens,
    int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
    int64_t block_size, int64_t stride_cache_block, int64_t stride_cache_slot, int64_t stride_cache_head,
    int64_t stride_block_table, float eps, float scale) {
  using namespace prefixserve;
  const int64_t element_size = dtype == kFloat32 ? 4 : 2;
  const Shape s{dtype, element_size, num_tokens, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size};
  const StepInputs in{positions, cos_sin_cache, slot_mapping, block_tables, query_start_loc, seq_lens, num_reqs,
                      block_size, stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
                      eps, scale};
  Activations a(s);
  const int64_t T = num_tokens, H = hidden_size, I = intermediate_size;
  // the residual stream: the embeddings, then each norm's sum of its input and the residual before
  char* residual = static_cast<char*>(hidden);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t* pointers = layers + layer * kLayerPointers;
    if (layer == 0) {
      prefixserve_rms_norm(dtype, a.normed, nullptr, hidden, nullptr, at(pointers, kInputNorm), T, H, H, 0, eps);
    } else {
      prefixserve_rms_norm(dtype, a.normed, a.spare_residual, a.mixed, residual, at(pointers, kInputNorm), T, H,
                           H, H, eps);
      std::swap(residual, a.spare_residual);
    }
    attend(s, in, pointers, a);
    prefixserve_rms_norm(dtype, a.normed, a.spare_residual, a.mixed, residual, at(pointers, kPostNorm), T, H, H, H,
                         eps);
    std::swap(residual, a.spare_residual);
    prefixserve_linear(dtype, a.gate_up, a.normed, at(pointers, kGateUp), nullptr, T, H, 2 * I, H);
    prefixserve_silu_and_mul(dtype, a.activated, a.gate_up, T, I, 2 * I);
    prefixserve_linear(dtype, a.mixed, a.activated, at(pointers, kDown), nullptr, T, I, H, I);
  }
  prefixserve_rms_norm(dtype, out, a.spare_residual, a.mixed, residual, final_norm, T, H, H, H, eps);
}

// Constrained decoding's token bitmask applied to fp32 logits, as kernels.bitmask.apply_token_bitmask_ref does.
#include <cstdint>
#include <limits>

#include "common.h"

// logits [*, vocab_size] fp32 with row stride stride_logits; bitmask [num_rows, num_words] int32;
// mask row m applies to logits row logit_rows[m]. A word of all ones (the usual case inside free text)
// costs one compare.
extern "C" void prefixserve_apply_token_bitmask(void* logits, const void* bitmask, const void* logit_rows,
                                                int64_t num_rows, int64_t vocab_size, int64_t stride_logits,
                                                int64_t num_words) {
  using namespace prefixserve;
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const auto* words = static_cast<const int32_t*>(bitmask);
  const auto* rows = static_cast<const int64_t*>(logit_rows);
#pragma omp parallel for schedule(static) if (num_rows * vocab_size >= kMinParallelElements)
  for (int64_t m = 0; m < num_rows; ++m) {
    float* row = static_cast<float*>(logits) + rows[m] * stride_logits;
    const int32_t* mask = words + m * num_words;
    for (int64_t word = 0; word * 32 < vocab_size; ++word) {
      const uint32_t bits = word < num_words ? static_cast<uint32_t>(mask[word]) : 0u;
      if (bits == 0xffffffffu) continue;
      const int64_t end = word * 32 + 32 < vocab_size ? word * 32 + 32 : vocab_size;
      for (int64_t token = word * 32; token < end; ++token) {
        if (!((bits >> (token - word * 32)) & 1u)) row[token] = kMinusInf;
      }
    }
  }
}

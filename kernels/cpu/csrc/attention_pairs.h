// One work item of paged attention in bf16 on the AVX512-BF16 dot product (vdpbf16ps), for tiles of many
// query rows (prefill chunks): the rows sit in the vectors' lanes, up to 32 of them, so that
//   scores[position][rows] += K[position][2p, 2p+1] . Q[rows][2p, 2p+1]    (one key pair broadcast)
//   out[dim][rows] += (V[c][dim], V[c+1][dim]) . (P[c][rows], P[c+1][rows])  (one value pair broadcast)
// take two multiply-adds an instruction with no lane ever reduced across, and the online softmax's maxima,
// sums and rescales are lane-wise too. Keys are read as bf16 straight from the cache; the softmax weights
// are rounded to bf16 for the values' dot products (as GPU flash attention does), their sums kept in fp32.
// A row's arithmetic does not depend on the other rows of its tile, nor on where the tile starts.
#pragma once

#ifdef __AVX512BF16__
#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "vec.h"

namespace prefixserve {

// One KV head's context of one request: its key and value rows through the block table.
struct PairedContext {
  const bf16* key_cache;    // at the KV head
  const bf16* value_cache;  // at the KV head
  const int32_t* block_table;
  int64_t block_size, stride_block, stride_slot;
};

// A tile's query rows: row r is token r / group's query head r % group of the KV head's group.
struct PairedRows {
  const bf16* query;  // row 0
  bf16* out;          // row 0
  int64_t num_rows, group, stride_token, stride_head, stride_out_token, stride_out_head;
  int64_t first_position;  // row 0's token's; each token sees the context up to its own position
};

template <int kHeadDim>
class PairedTile {
  static_assert(kHeadDim % 32 == 0);
  static constexpr int kPairs = kHeadDim / 2;
  static constexpr int kMaxRowVecs = 2;
  static constexpr int kPositions = 32;  // context positions per online-softmax update
  static constexpr float kInfinity = std::numeric_limits<float>::infinity();

 public:
  static constexpr int64_t kMaxRows = kMaxRowVecs * 16;

  void run(const PairedRows& rows, const PairedContext& context, float scale) {
    if (rows.num_rows > 16) {
      run_rows<2>(rows, context, scale);
    } else {
      run_rows<1>(rows, context, scale);
    }
  }

 private:
  template <int kRowVecs>
  void run_rows(const PairedRows& rows, const PairedContext& context, float scale) {
    load_rows<kRowVecs>(rows);
    const int64_t num_tokens = (rows.num_rows + rows.group - 1) / rows.group;
    const int64_t context_end = rows.first_position + num_tokens;  // the last token sees up to here
    int64_t block = 0, slot = 0;  // of the next position: no division per position
    for (int64_t start = 0; start < context_end; start += kPositions) {
      const int count = static_cast<int>(std::min<int64_t>(kPositions, context_end - start));
      for (int c = 0; c < count; ++c) {
        const int64_t offset = context.block_table[block] * context.stride_block + slot * context.stride_slot;
        keys_[c] = context.key_cache + offset;
        value_rows_[c] = context.value_cache + offset;
        if (++slot == context.block_size) ++block, slot = 0;
      }
      std::fill(keys_ + count, keys_ + kPositions, keys_[0]);  // scored, then masked: past every row's position
      score<kRowVecs>(scale * kLog2e);
      if (start + kPositions - 1 > rows.first_position) mask<kRowVecs>(start);
      const int num_pairs = (count + 1) / 2;
      load_values(count);
      update_softmax<kRowVecs>(num_pairs);
      accumulate<kRowVecs>(num_pairs);
    }
    store_rows(rows);
  }

  template <int kRowVecs>
  void load_rows(const PairedRows& rows) {
    std::fill_n(&query_[0][0], kPairs * kMaxRows, 0u);  // padding rows: zero queries, finite scores
    std::fill_n(&out_[0][0], kHeadDim * kMaxRows, 0.0f);
    for (int64_t row = 0; row < kRowVecs * 16; ++row) {
      const int64_t token = std::min(row, rows.num_rows - 1) / rows.group;
      position_[row] = static_cast<int32_t>(rows.first_position + token);
      if (row >= rows.num_rows) continue;
      const bf16* src = rows.query + token * rows.stride_token + row % rows.group * rows.stride_head;
      for (int p = 0; p < kPairs; ++p) std::memcpy(&query_[p][row], src + 2 * p, 4);
    }
    std::fill_n(max_, kMaxRows, -kInfinity);
    std::fill_n(denominator_, kMaxRows, 0.0f);
  }

  // scores_[c] = the rows' scores against position c's key, in base 2.
  template <int kRowVecs>
  void score(float scale_log2) {
    constexpr int kBlock = 16 / kRowVecs;  // positions at once: 16 independent sums
    for (int first = 0; first < kPositions; first += kBlock) {
      __m512 acc[kBlock][kRowVecs];
      for (auto& sums : acc) std::fill_n(sums, kRowVecs, _mm512_setzero_ps());
      for (int p = 0; p < kPairs; ++p) {
        __m512bh query[kRowVecs];
        for (int v = 0; v < kRowVecs; ++v) query[v] = (__m512bh)_mm512_load_si512(&query_[p][16 * v]);
        for (int c = 0; c < kBlock; ++c) {
          int32_t bits;
          std::memcpy(&bits, keys_[first + c] + 2 * p, 4);
          const __m512bh key = (__m512bh)_mm512_set1_epi32(bits);
          for (int v = 0; v < kRowVecs; ++v) acc[c][v] = _mm512_dpbf16_ps(acc[c][v], key, query[v]);
        }
      }
      for (int c = 0; c < kBlock; ++c) {
        for (int v = 0; v < kRowVecs; ++v) {
          store_vec(&scores_[first + c][16 * v], vfloat(acc[c][v]) * scale_log2);
        }
      }
    }
  }

  // -infinity where a position lies past its row's token.
  template <int kRowVecs>
  void mask(int64_t start) {
    for (int v = 0; v < kRowVecs; ++v) {
      vint position;
      std::memcpy(&position, &position_[16 * v], sizeof(position));
      for (int c = 0; c < kPositions; ++c) {
        const vfloat scores = load_vec(&scores_[c][16 * v]);
        const vint here = broadcast_int(static_cast<int32_t>(start + c));
        store_vec(&scores_[c][16 * v], here <= position ? scores : broadcast(-kInfinity));
      }
    }
  }

  // values_[pair][dim] = (V[2 pair][dim], V[2 pair + 1][dim]) as bf16 bits, zeros past the context.
  void load_values(int count) {
    alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i low = _mm512_load_si512(kLow);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int pair = 0; 2 * pair < count; ++pair) {
      const bf16* first = value_rows_[2 * pair];
      const bf16* second = 2 * pair + 1 < count ? value_rows_[2 * pair + 1] : nullptr;
      for (int dim = 0; dim < kHeadDim; dim += 32) {
        const __m512i a = _mm512_loadu_si512(first + dim);
        const __m512i b = second ? _mm512_loadu_si512(second + dim) : _mm512_setzero_si512();
        _mm512_store_si512(&values_[pair][dim], _mm512_permutex2var_epi16(a, low, b));
        _mm512_store_si512(&values_[pair][dim + 16], _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }

  // The chunk's weights exp2(score - max) into weights_ as bf16 pairs; the running maxima and sums moved to
  // the new maxima, and the factor that moves the outputs there into rescale_.
  template <int kRowVecs>
  void update_softmax(int num_pairs) {
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                             8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    for (int v = 0; v < kRowVecs; ++v) {
      vfloat highest = load_vec(&max_[16 * v]);
      const vfloat old_max = highest;
      for (int c = 0; c < kPositions; ++c) {
        const vfloat scores = load_vec(&scores_[c][16 * v]);
        highest = highest > scores ? highest : scores;
      }
      vfloat sum{};
      for (int pair = 0; pair < num_pairs; ++pair) {
        const vfloat even = exp2_approx(load_vec(&scores_[2 * pair][16 * v]) - highest);
        const vfloat odd = exp2_approx(load_vec(&scores_[2 * pair + 1][16 * v]) - highest);
        sum += even + odd;
        const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(__m512(odd), __m512(even));
        _mm512_store_si512(&weights_[pair][16 * v], _mm512_permutexvar_epi16(interleave, halves));
      }
      const vfloat rescale = exp2_approx(old_max - highest);
      store_vec(&max_[16 * v], highest);
      store_vec(&denominator_[16 * v], load_vec(&denominator_[16 * v]) * rescale + sum);
      store_vec(&rescale_[16 * v], rescale);
    }
  }

  // out_[dim] = out_[dim] * rescale_ + the chunk's weighted values.
  template <int kRowVecs>
  void accumulate(int num_pairs) {
    constexpr int kBlock = 16 / kRowVecs;  // dims at once: 16 independent sums
    for (int first = 0; first < kHeadDim; first += kBlock) {
      __m512 acc[kBlock][kRowVecs];
      for (int d = 0; d < kBlock; ++d) {
        for (int v = 0; v < kRowVecs; ++v) {
          acc[d][v] = __m512(load_vec(&out_[first + d][16 * v]) * load_vec(&rescale_[16 * v]));
        }
      }
      for (int pair = 0; pair < num_pairs; ++pair) {
        __m512bh weights[kRowVecs];
        for (int v = 0; v < kRowVecs; ++v) weights[v] = (__m512bh)_mm512_load_si512(&weights_[pair][16 * v]);
        for (int d = 0; d < kBlock; ++d) {
          const __m512bh value = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(values_[pair][first + d]));
          for (int v = 0; v < kRowVecs; ++v) acc[d][v] = _mm512_dpbf16_ps(acc[d][v], value, weights[v]);
        }
      }
      for (int d = 0; d < kBlock; ++d) {
        for (int v = 0; v < kRowVecs; ++v) _mm512_store_ps(&out_[first + d][16 * v], acc[d][v]);
      }
    }
  }

  void store_rows(const PairedRows& rows) const {
    constexpr vint kDims = lane_indices([](int d) { return d * kMaxRows; });  // a row's dims in out_
    for (int64_t row = 0; row < rows.num_rows; ++row) {
      bf16* dst = rows.out + row / rows.group * rows.stride_out_token + row % rows.group * rows.stride_out_head;
      const float inverse = 1.0f / denominator_[row];
      for (int dim = 0; dim < kHeadDim; dim += 16) {
        const vfloat sums = vfloat(_mm512_i32gather_ps(__m512i(kDims), &out_[dim][row], 4));
        store_vec(dst + dim, sums * inverse);
      }
    }
  }

  static vint broadcast_int(int32_t x) { return vint{} + x; }

  alignas(64) uint32_t query_[kPairs][kMaxRows];      // the rows' query pairs, bf16 bits, one lane a row
  alignas(64) float out_[kHeadDim][kMaxRows];         // the rows' weighted sums of values, one vector a dim
  alignas(64) float scores_[kPositions][kMaxRows];    // the chunk's scores, base 2, one vector a position
  alignas(64) uint32_t weights_[kPositions / 2][kMaxRows];  // (P[2 pair], P[2 pair + 1]) as bf16 bits
  alignas(64) uint32_t values_[kPositions / 2][kHeadDim];
  alignas(64) float max_[kMaxRows];
  alignas(64) float denominator_[kMaxRows];
  alignas(64) float rescale_[kMaxRows];
  alignas(64) int32_t position_[kMaxRows];  // the token each row belongs to
  const bf16* keys_[kPositions];  // the chunk's positions' rows
  const bf16* value_rows_[kPositions];
};

}  // namespace prefixserve
#endif

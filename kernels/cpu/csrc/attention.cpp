// Paged attention over block tables for a mixed batch of prefill chunks and decodes, with the
// semantics of kernels.attention.paged_attention_ref.
//
// A work item is one KV head of one tile of a request's query tokens. Its rows are those tokens
// times the query heads sharing that KV head, so each K/V position is read and converted once for
// the whole group. It walks the context through the block table in chunks of kChunkVecs vectors' width
// of positions: per row, each vector's width of dot products becomes one vector of scores, then one
// online-softmax update (fp32, base 2) for the whole chunk, so its horizontal reductions and rescale
// are paid once per kChunkVecs * kLanes positions. In bf16 with AVX512-BF16, a work item of many rows runs as a
// PairedTile instead (attention_pairs.h): a prefill chunk's rows in the lanes, two multiply-adds an instruction.
#include <algorithm>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_pairs.h"
#include "kernels.h"
#include "vec.h"

namespace prefixserve {
namespace {

constexpr int64_t kRowsPerTile = 32;  // query rows per work item (at least one token's group)
constexpr int kChunkVecs = 4;         // score vectors per online-softmax update
constexpr int kChunk = kChunkVecs * kLanes;  // context positions per chunk
constexpr int64_t kPrefetchBlocks = 2;      // how far ahead of the one being read a position's lines are asked for
constexpr float kInfinity = std::numeric_limits<float>::infinity();
#ifdef __AVX512BF16__
// From this many rows on a bf16 work item runs as a PairedTile: below, most of its 16 lanes would idle.
constexpr int64_t kMinPairedRows = 8;
template <typename T, int kHeadDim>
constexpr bool kPairs = std::is_same_v<T, bf16> && kHeadDim % 32 == 0;
template <typename T, int kHeadDim>
using PairedWorkspace = std::conditional_t<kPairs<T, kHeadDim>, std::unique_ptr<PairedTile<kHeadDim>>, std::nullptr_t>;
#else
template <typename T, int kHeadDim>
using PairedWorkspace = std::nullptr_t;
#endif

struct AttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t num_reqs, num_heads, num_kv_heads, block_size;
  int64_t stride_query_token, stride_query_head, stride_out_token, stride_out_head;
  int64_t stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table;
  float scale;
};

template <typename T, int kHeadDim>
class PagedAttention {
  static constexpr int kVecs = kHeadDim / kLanes;
  static_assert(kVecs * kLanes == kHeadDim);

 public:
  explicit PagedAttention(const AttentionArgs& args)
      : a_(args), group_(args.num_heads / args.num_kv_heads),
        tokens_per_tile_(std::max<int64_t>(1, kRowsPerTile / group_)) {}

  void run() const {
    std::vector<int64_t> first_tile(a_.num_reqs + 1, 0);  // request r owns tiles [first_tile[r], first_tile[r+1])
    int64_t num_scores = 0;  // query tokens x context positions, summed over the requests
    for (int64_t r = 0; r < a_.num_reqs; ++r) {
      const int64_t query_len = a_.query_start_loc[r + 1] - a_.query_start_loc[r];
      first_tile[r + 1] = first_tile[r] + (query_len + tokens_per_tile_ - 1) / tokens_per_tile_;
      num_scores += query_len * a_.seq_lens[r];
    }
    const int64_t num_items = first_tile[a_.num_reqs] * a_.num_kv_heads;
#pragma omp parallel if (num_scores * a_.num_heads * kHeadDim >= kMinParallelElements)
    {
      std::vector<Row> rows(tokens_per_tile_ * group_);
      auto chunk = std::make_unique<Chunk>();
      PairedWorkspace<T, kHeadDim> paired{};  // made at its first tile
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < num_items; ++item) {
        const int64_t tile = item / a_.num_kv_heads;
        const int64_t req = std::upper_bound(first_tile.begin(), first_tile.end(), tile) - first_tile.begin() - 1;
        attend_tile(req, item % a_.num_kv_heads, tile - first_tile[req], rows, *chunk, paired);
      }
    }
  }

 private:
  struct Row {
    vfloat query[kVecs];  // pre-scaled by scale * log2(e)
    vfloat acc[kVecs];
    float max_score, denominator;
  };
  struct Chunk {  // up to kChunk context positions of one KV head, in fp32
    vfloat keys[kChunk][kVecs];
    vfloat values[kChunk][kVecs];
  };

  void attend_tile(int64_t req, int64_t kv_head, int64_t tile, std::vector<Row>& rows, Chunk& chunk,
                   PairedWorkspace<T, kHeadDim>& paired) const {
    const int64_t query_start = a_.query_start_loc[req];
    const int64_t query_len = a_.query_start_loc[req + 1] - query_start;
    const int64_t first_token = tile * tokens_per_tile_;
    const int64_t num_tokens = std::min(tokens_per_tile_, query_len - first_token);
    const int64_t first_position = a_.seq_lens[req] - query_len + first_token;
    const int64_t num_rows = num_tokens * group_;
#ifdef __AVX512BF16__
    if constexpr (kPairs<T, kHeadDim>) {
      if (num_rows >= kMinPairedRows && num_rows <= PairedTile<kHeadDim>::kMaxRows) {
        if (!paired) paired.reset(new PairedTile<kHeadDim>);
        paired->run(paired_rows(query_start + first_token, kv_head, num_rows, first_position),
                    paired_context(req, kv_head), a_.scale);
        return;
      }
    }
#endif
    for (int64_t row = 0; row < num_rows; ++row) load_row(query_start + first_token, kv_head, row, rows[row]);

    const int64_t context_end = first_position + num_tokens;  // the last row sees up to here
    for (int64_t chunk_start = 0; chunk_start < context_end; chunk_start += kChunk) {
      const int64_t chunk_len = std::min<int64_t>(kChunk, context_end - chunk_start);
      load_chunk(req, kv_head, chunk_start, chunk_len, context_end, chunk);
      for (int64_t row = 0; row < num_rows; ++row) {
        const int64_t position = first_position + row / group_;
        if (position >= chunk_start) attend_chunk(std::min(chunk_len, position - chunk_start + 1), chunk, rows[row]);
      }
    }
    for (int64_t row = 0; row < num_rows; ++row) store_row(query_start + first_token, kv_head, row, rows[row]);
  }

#ifdef __AVX512BF16__
  PairedRows paired_rows(int64_t token, int64_t kv_head, int64_t num_rows, int64_t first_position) const {
    return {query_head(token, kv_head, 0),
            static_cast<T*>(a_.out) + token * a_.stride_out_token + kv_head * group_ * a_.stride_out_head,
            num_rows, group_, a_.stride_query_token, a_.stride_query_head, a_.stride_out_token,
            a_.stride_out_head, first_position};
  }

  PairedContext paired_context(int64_t req, int64_t kv_head) const {
    const int64_t head = kv_head * a_.stride_cache_head;
    return {static_cast<const T*>(a_.key_cache) + head, static_cast<const T*>(a_.value_cache) + head,
            a_.block_tables + req * a_.stride_block_table, a_.block_size, a_.stride_cache_block,
            a_.stride_cache_slot};
  }
#endif

  const T* query_head(int64_t token, int64_t kv_head, int64_t row) const {
    return static_cast<const T*>(a_.query) + (token + row / group_) * a_.stride_query_token +
           (kv_head * group_ + row % group_) * a_.stride_query_head;
  }

  void load_row(int64_t token, int64_t kv_head, int64_t row, Row& out) const {
    const T* src = query_head(token, kv_head, row);
    for (int v = 0; v < kVecs; ++v) {
      out.query[v] = load_vec(src + v * kLanes) * (a_.scale * kLog2e);
      out.acc[v] = vfloat{};
    }
    out.max_score = -kInfinity;
    out.denominator = 0.0f;
  }

  // Blocks sit anywhere in the cache, and the hardware prefetchers lose the stream at each block's end: each
  // position's lines kPrefetchBlocks blocks on are asked for as this one's are read (decode attention 1.8x as
  // fast on random block tables, 1.3-1.5x on ordered ones: benchmarks/results/step.md).
  void load_chunk(int64_t req, int64_t kv_head, int64_t chunk_start, int64_t chunk_len, int64_t context_end,
                  Chunk& out) const {
    const int32_t* block_table = a_.block_tables + req * a_.stride_block_table;
    const int64_t num_blocks = (context_end + a_.block_size - 1) / a_.block_size;
    int64_t block = chunk_start / a_.block_size, slot = chunk_start % a_.block_size;  // no division per position
    for (int64_t c = 0; c < kChunk; ++c) {
      if (c >= chunk_len) {  // past the context: zeros, never a read through the block table
        std::fill_n(out.keys[c], kVecs, vfloat{});
        std::fill_n(out.values[c], kVecs, vfloat{});
        continue;
      }
      const int64_t in_block = slot * a_.stride_cache_slot + kv_head * a_.stride_cache_head;
      const int64_t offset = block_table[block] * a_.stride_cache_block + in_block;
      if (block + kPrefetchBlocks < num_blocks) {
        prefetch(block_table[block + kPrefetchBlocks] * a_.stride_cache_block + in_block);
      }
      if (++slot == a_.block_size) ++block, slot = 0;
      const T* key = static_cast<const T*>(a_.key_cache) + offset;
      const T* value = static_cast<const T*>(a_.value_cache) + offset;
      for (int v = 0; v < kVecs; ++v) {
        out.keys[c][v] = load_vec(key + v * kLanes);
        out.values[c][v] = load_vec(value + v * kLanes);
      }
    }
  }

  // The key's and the value's lines at offset, towards L2.
  void prefetch(int64_t offset) const {
    constexpr int64_t kLineElements = 64 / sizeof(T);
    for (int64_t e = 0; e < kHeadDim; e += kLineElements) {
      __builtin_prefetch(static_cast<const T*>(a_.key_cache) + offset + e, 0, 2);
      __builtin_prefetch(static_cast<const T*>(a_.value_cache) + offset + e, 0, 2);
    }
  }

  // One row against the first `visible` positions of the chunk: the online-softmax update.
  static void attend_chunk(int64_t visible, const Chunk& chunk, Row& row) {
    const int num_vecs = static_cast<int>((visible + kLanes - 1) / kLanes);
    vfloat scores[kChunkVecs];
    vfloat highest = broadcast(-kInfinity);
    for (int s = 0; s < num_vecs; ++s) {
      scores[s] = score_vec(row, chunk.keys + s * kLanes, static_cast<int32_t>(visible - s * kLanes));
      highest = highest > scores[s] ? highest : scores[s];
    }
    const float new_max = std::max(row.max_score, reduce_max(highest));
    const float rescale = exp2_approx(broadcast(row.max_score - new_max))[0];
    vfloat weights[kChunkVecs];
    vfloat weight_sum = vfloat{};
    for (int s = 0; s < num_vecs; ++s) {
      weights[s] = exp2_approx(scores[s] - new_max);
      weight_sum += weights[s];
    }
    row.max_score = new_max;
    row.denominator = row.denominator * rescale + reduce_sum(weight_sum);
    vfloat acc[kVecs];
    for (int v = 0; v < kVecs; ++v) acc[v] = row.acc[v] * rescale;
    for (int64_t c = 0; c < visible; ++c) {
      const float weight = weights[c / kLanes][c % kLanes];
      for (int v = 0; v < kVecs; ++v) acc[v] += weight * chunk.values[c][v];
    }
    std::copy_n(acc, kVecs, row.acc);
  }

  // The row's scores against kLanes positions, -infinity from the `visible`-th on.
  static vfloat score_vec(const Row& row, const vfloat (*keys)[kVecs], int32_t visible) {
    vfloat partial[kLanes];
    for (int c = 0; c < kLanes; ++c) {
      partial[c] = row.query[0] * keys[c][0];
      for (int v = 1; v < kVecs; ++v) partial[c] += row.query[v] * keys[c][v];
    }
    constexpr vint lane = lane_indices([](int c) { return c; });
    return lane < visible ? sum_lanes_of_each(partial) : broadcast(-kInfinity);
  }

  void store_row(int64_t token, int64_t kv_head, int64_t row, const Row& in) const {
    T* dst = static_cast<T*>(a_.out) + (token + row / group_) * a_.stride_out_token +
             (kv_head * group_ + row % group_) * a_.stride_out_head;
    const float inverse = 1.0f / in.denominator;
    for (int v = 0; v < kVecs; ++v) store_vec(dst + v * kLanes, in.acc[v] * inverse);
  }

  const AttentionArgs& a_;
  const int64_t group_;
  const int64_t tokens_per_tile_;
};

// Runs the instantiation for head_dim, one of kHeadDims; false if it is none of them.
template <typename T, int... kHeadDims>
bool run_attention(const AttentionArgs& args, int64_t head_dim) {
  return ((head_dim == kHeadDims && (PagedAttention<T, kHeadDims>(args).run(), true)) || ...);
}

}  // namespace
}  // namespace prefixserve

// Returns 0, or -1 if head_dim is not one of the dims instantiated here (library.py HEAD_DIMS).
extern "C" int prefixserve_paged_attention(
    int64_t dtype, void* out, const void* query, const void* key_cache, const void* value_cache,
    const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
    int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t stride_query_token, int64_t stride_query_head, int64_t stride_out_token, int64_t stride_out_head,
    int64_t stride_cache_block, int64_t stride_cache_slot, int64_t stride_cache_head,
    int64_t stride_block_table, float scale) {
  using namespace prefixserve;
  const AttentionArgs args{out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                           num_reqs, num_heads, num_kv_heads, block_size,
                           stride_query_token, stride_query_head, stride_out_token, stride_out_head,
                           stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table, scale};
  bool supported = false;
  dispatch(dtype, [&](auto element) { supported = run_attention<decltype(element), 16, 32, 64, 80, 96, 128, 256>(args, head_dim); });
  return supported ? 0 : -1;
}

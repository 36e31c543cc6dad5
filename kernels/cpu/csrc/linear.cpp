// Linear layers at decode batch sizes: out = x W^T (+ bias) for a few rows of x, with fp32 accumulation,
// on weights packed once so that one vector load holds kLanes outputs' weights for kPair consecutive inputs:
// packed[block][pair][lane][i] = W[block * kLanes + lane][pair * kPair + i], zero-padded. Each input (pair)
// of a row of x is broadcast and multiplies a whole vector of outputs, so no lane is ever reduced
// across; a pass over a panel of the weights serves every row of x while the panel is in the cache, so
// the weights stream from memory once (oneDNN is faster from a hundred rows or so on).
#include <algorithm>
#include <omp.h>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec.h"

namespace prefixserve {
namespace {

// bf16 with the AVX512-BF16 dot product takes its inputs in pairs; everything else one at a time.
template <typename T>
constexpr int kPair = 1;
#ifdef __AVX512BF16__
template <>
constexpr int kPair<bf16> = 2;
#endif

constexpr int kMaxRows = 4;                     // rows of x per tile
constexpr int kTileBlocks = kLanes == 16 ? 4 : 2;  // output vectors per tile: its accumulators fill the registers
constexpr int64_t kPanelBlocks = 8;             // output vectors whose weights stay cached across all rows
// Below this many multiply-adds a call runs on the calling thread (waking the team costs more).
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

template <typename T>
struct LinearArgs {
  T* out;
  const T* x;
  const T* packed;
  const T* bias;
  int64_t num_rows, in_features, out_features, stride_x;

  int64_t num_pairs() const { return (in_features + kPair<T> - 1) / kPair<T>; }
  int64_t block_size() const { return num_pairs() * kLanes * kPair<T>; }
};

// Adds the bias to a tile's sums and stores them, rounded to T, leaving out the padding outputs.
template <typename T, int kRows, int kBlocks>
void store_tile(const LinearArgs<T>& a, int64_t row, int64_t block, vfloat (&acc)[kRows][kBlocks]) {
  for (int j = 0; j < kBlocks; ++j) {
    const int64_t first = (block + j) * kLanes;
    const int64_t count = std::min<int64_t>(kLanes, a.out_features - first);
    vfloat bias{};
    if (a.bias != nullptr) {
      T padded[kLanes] = {};
      std::copy_n(a.bias + first, count, padded);
      bias = load_vec(padded);
    }
    for (int m = 0; m < kRows; ++m) {
      T* out = a.out + (row + m) * a.out_features + first;
      if (count == kLanes) {
        store_vec(out, acc[m][j] + bias);
      } else {
        T tail[kLanes];
        store_vec(tail, acc[m][j] + bias);
        std::copy_n(tail, count, out);
      }
    }
  }
}

template <typename T, int kRows, int kBlocks>
void tile(const LinearArgs<T>& a, int64_t row, int64_t block) {
  vfloat acc[kRows][kBlocks] = {};
  const T* weights = a.packed + block * a.block_size();
  for (int64_t k = 0; k < a.in_features; ++k) {
    vfloat w[kBlocks];
    for (int j = 0; j < kBlocks; ++j) w[j] = load_vec(weights + j * a.block_size() + k * kLanes);
    for (int m = 0; m < kRows; ++m) {
      const vfloat input = broadcast(to_float(a.x[(row + m) * a.stride_x + k]));
      for (int j = 0; j < kBlocks; ++j) acc[m][j] += input * w[j];
    }
  }
  store_tile<T, kRows, kBlocks>(a, row, block, acc);
}

#ifdef __AVX512BF16__
template <int kRows, int kBlocks>
void tile_bf16_pairs(const LinearArgs<bf16>& a, int64_t row, int64_t block) {
  __m512 acc[kRows][kBlocks];
  for (auto& sums : acc) std::fill_n(sums, kBlocks, _mm512_setzero_ps());
  const bf16* weights = a.packed + block * a.block_size();
  // pair_bits(row of x): the pair's two inputs as the 32 bits that every lane of the broadcast gets
  const auto accumulate = [&](int64_t p, auto pair_bits) {
    __m512bh w[kBlocks];
    for (int j = 0; j < kBlocks; ++j) {
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(weights + j * a.block_size() + p * 2 * kLanes));
    }
    for (int m = 0; m < kRows; ++m) {
      const auto input = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_bits(a.x + (row + m) * a.stride_x)));
      for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], input, w[j]);
    }
  };
  const int64_t full_pairs = a.in_features / 2;
  for (int64_t p = 0; p < full_pairs; ++p) {
    accumulate(p, [p](const bf16* x) {
      int32_t bits;
      std::memcpy(&bits, x + 2 * p, sizeof(bits));
      return bits;
    });
  }
  if (a.in_features % 2) {  // the last input, paired with a zero
    accumulate(full_pairs, [p = full_pairs](const bf16* x) { return int32_t{x[2 * p].bits}; });
  }
  vfloat sums[kRows][kBlocks];
  std::memcpy(sums, acc, sizeof(sums));
  store_tile<bf16, kRows, kBlocks>(a, row, block, sums);
}
#endif

template <typename T, int kRows, int kBlocks>
void run_tile(const LinearArgs<T>& a, int64_t row, int64_t block) {
#ifdef __AVX512BF16__
  if constexpr (kPair<T> == 2) {
    tile_bf16_pairs<kRows, kBlocks>(a, row, block);
    return;
  }
#endif
  tile<T, kRows, kBlocks>(a, row, block);
}

// Output vectors [first, last) for kRows rows from row on.
template <typename T, int kRows>
void tile_rows(const LinearArgs<T>& a, int64_t row, int64_t first, int64_t last) {
  constexpr int kBlocks = kRows == 1 ? 2 * kTileBlocks : kTileBlocks;  // one row: more independent sums
  int64_t block = first;
  for (; block + kBlocks <= last; block += kBlocks) run_tile<T, kRows, kBlocks>(a, row, block);
  for (; block < last; ++block) run_tile<T, kRows, 1>(a, row, block);
}

template <typename T>
void linear_panel(const LinearArgs<T>& a, int64_t first, int64_t last) {
  int64_t row = 0;
  for (; row + kMaxRows <= a.num_rows; row += kMaxRows) tile_rows<T, kMaxRows>(a, row, first, last);
  switch (a.num_rows - row) {
    case 1: tile_rows<T, 1>(a, row, first, last); break;
    case 2: tile_rows<T, 2>(a, row, first, last); break;
    case 3: tile_rows<T, 3>(a, row, first, last); break;
  }
}

template <typename T>
void linear(const LinearArgs<T>& a) {
  const int64_t num_blocks = (a.out_features + kLanes - 1) / kLanes;
#pragma omp parallel if (a.num_rows * a.out_features * a.in_features >= kMinParallelMacs)
  {
    // each thread a contiguous share of the output vectors, a cached panel at a time
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t end = num_blocks * (me + 1) / threads;
    for (int64_t first = num_blocks * me / threads; first < end; first += kPanelBlocks) {
      linear_panel(a, first, std::min(end, first + kPanelBlocks));
    }
  }
}

template <typename T>
void pack(T* packed, const T* weight, int64_t out_features, int64_t in_features) {
  const LinearArgs<T> a{nullptr, nullptr, packed, nullptr, 0, in_features, out_features, 0};
  const int64_t num_blocks = (out_features + kLanes - 1) / kLanes;
  std::fill_n(packed, num_blocks * a.block_size(), from_float<T>(0.0f));
  for (int64_t n = 0; n < out_features; ++n) {
    T* lane = packed + n / kLanes * a.block_size() + n % kLanes * kPair<T>;
    for (int64_t k = 0; k < in_features; ++k) {
      lane[k / kPair<T> * kLanes * kPair<T> + k % kPair<T>] = weight[n * in_features + k];
    }
  }
}

}  // namespace
}  // namespace prefixserve

// The most rows to run on this kernel rather than oneDNN's packed matmul, measured on the default model (2 cores
// of an AMD EPYC, benchmarks/results/step.md): in bf16 with the AVX512-BF16 dot product its projections took
// 0.95x oneDNN's time at 128 rows (1.3x at 256); in fp32 with AVX-512 0.97x at 16; compiled for AVX2 (with
// oneDNN held to AVX2), 1.14x at 4 rows, where the whole decode step, its layers in one call, was still 0.9x.
extern "C" int64_t prefixserve_linear_max_rows(int64_t dtype) {
  using namespace prefixserve;
  int64_t rows = 0;
  dispatch(dtype, [&](auto element) { rows = kPair<decltype(element)> == 2 ? 128 : (kLanes == 16 ? 16 : 4); });
  return rows;
}

// Elements of the packed copy of an [out_features, in_features] weight.
extern "C" int64_t prefixserve_packed_linear_size(int64_t dtype, int64_t out_features, int64_t in_features) {
  using namespace prefixserve;
  int64_t size = 0;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    size = (out_features + kLanes - 1) / kLanes * LinearArgs<T>{nullptr, nullptr, nullptr, nullptr, 0, in_features,
                                                               out_features, 0}.block_size();
  });
  return size;
}

// weight contiguous [out_features, in_features] -> packed (packed_linear_size elements).
extern "C" void prefixserve_pack_linear_weight(int64_t dtype, void* packed, const void* weight, int64_t out_features,
                                               int64_t in_features) {
  using namespace prefixserve;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    pack<T>(static_cast<T*>(packed), static_cast<const T*>(weight), out_features, in_features);
  });
}

// x [num_rows, in_features] with row stride stride_x, packed weight, bias [out_features] or null
// -> out contiguous [num_rows, out_features].
extern "C" void prefixserve_linear(int64_t dtype, void* out, const void* x, const void* packed, const void* bias,
                                   int64_t num_rows, int64_t in_features, int64_t out_features, int64_t stride_x) {
  using namespace prefixserve;
  dispatch(dtype, [&](auto element) {
    using T = decltype(element);
    linear<T>({static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(packed),
               static_cast<const T*>(bias), num_rows, in_features, out_features, stride_x});
  });
}

// canteen::skinny_linear: bfloat16 x @ w^T (+ bias) for the few rows of a decode step (one
// row per sequence, or one sequence and the drafts it verifies), every weight read once.
//
// Layout (worker/quant.py, pack_lanes): output rows in blocks of 16, one 32-bit lane per row
// holding a pair of adjacent weights, so one AVX512-BF16 dot product (vdpbf16ps) adds the
// products of a pair of x's columns to 16 outputs at once, and no horizontal sum is left:
//   lanes [ceil(N / 16), ceil(K / 2), 16, 2] bfloat16, lanes[b, p, l] = (w[16b + l, 2p],
//   w[16b + l, 2p + 1]), zero past N and K.
// Each block's sums run along K pair by pair in float32 (oneDNN's bfloat16 matmul also sums
// bfloat16 products in float32; only the order differs). Several blocks go at once, so
// there are enough independent sums to hide the dot product's latency: one row otherwise
// waits on a single chain, and many rows otherwise wait on loads.
//
// Measured here (AMD EPYC Zen 4, two threads, SmolLM2's layers): README, Speed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 12;  // rows of x a call takes (worker/quant.py, SKINNY_ROWS)

// x's rows as pairs of bfloat16 (32 bits each), zero-padded to ``pairs``: what one lane meets.
std::vector<uint32_t> x_pairs(const at::BFloat16* x, int64_t rows, int64_t k, int64_t pairs) {
  std::vector<uint32_t> out(rows * pairs, 0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out.data() + r * pairs, x + r * k, k * sizeof(uint16_t));
  return out;
}

inline float bf16_low(uint32_t v) { return at::BFloat16(static_cast<uint16_t>(v), at::BFloat16::from_bits()); }
inline float bf16_high(uint32_t v) { return at::BFloat16(static_cast<uint16_t>(v >> 16), at::BFloat16::from_bits()); }

// Rows rows of x against Blocks blocks of 16 output rows, starting at ``w``; sums out[r][16 b + l].
// Rows and Blocks are template arguments so the sums live in registers.
template <int Rows, int Blocks>
void lane_dots(const uint32_t* x, int64_t pairs, const uint32_t* w, float* out) {
  const int64_t block_words = pairs * kLanes;  // 32-bit words per block
#if defined(__AVX512BF16__)
  __m512 acc[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[Blocks];
    for (int b = 0; b < Blocks; ++b)
      wv[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + b * block_words + p * kLanes));
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) {
      const auto xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * pairs + p])));
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + (r * Blocks + b) * kLanes, acc[r][b]);
#else
  float acc[Rows][Blocks][kLanes] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    for (int r = 0; r < Rows; ++r) {
      const float x0 = bf16_low(x[r * pairs + p]), x1 = bf16_high(x[r * pairs + p]);
      for (int b = 0; b < Blocks; ++b) {
        const uint32_t* wp = w + b * block_words + p * kLanes;
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[r][b][l] += x0 * bf16_low(wp[l]) + x1 * bf16_high(wp[l]);
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
#endif
}

// Blocks at once for a row count: enough independent sums (8-24) within the 32 registers.
constexpr int blocks_for_rows(int rows) { return rows <= 2 ? 4 : rows <= 8 ? 3 : 2; }
constexpr int kMaxBlocks = 4;

using LaneFn = void (*)(const uint32_t*, int64_t, const uint32_t*, float*);
template <int... R>
constexpr std::array<LaneFn, sizeof...(R)> wide_dots(std::integer_sequence<int, R...>) {
  return {lane_dots<R + 1, blocks_for_rows(R + 1)>...};
}
template <int... R>
constexpr std::array<LaneFn, sizeof...(R)> one_dots(std::integer_sequence<int, R...>) {
  return {lane_dots<R + 1, 1>...};
}
constexpr auto kWideDots = wide_dots(std::make_integer_sequence<int, kMaxRows>{});
constexpr auto kOneDots = one_dots(std::make_integer_sequence<int, kMaxRows>{});

// x [M <= 12, K] bfloat16 @ the weight [n, K]^T (+ bias), the weight in pack_lanes' layout.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& lanes, int64_t n,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= kMaxRows && x.scalar_type() == at::kBFloat16,
              "skinny_linear: x bfloat16 [M <= 12, K]");
  const int64_t rows = x.size(0), k = x.size(1), pairs = (k + 1) / 2, blocks = (n + kLanes - 1) / kLanes;
  TORCH_CHECK(lanes.scalar_type() == at::kBFloat16 &&
                  lanes.sizes() == at::IntArrayRef({blocks, pairs, kLanes, 2}),
              "skinny_linear: lanes bfloat16 [ceil(N / 16), ceil(K / 2), 16, 2] for x's K");
  const auto b = canteen::padded_bias(bias, n, blocks * kLanes, "skinny_linear");
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const auto xc = x.contiguous(), lc = lanes.contiguous();
  const auto xp = x_pairs(xc.data_ptr<at::BFloat16>(), rows, k, pairs);
  const auto* wp = reinterpret_cast<const uint32_t*>(lc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  const int wide = blocks_for_rows(static_cast<int>(rows));
  const LaneFn wide_dots = kWideDots[rows - 1], one_dots = kOneDots[rows - 1];
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    float sums[kMaxRows * kMaxBlocks * kLanes];
    for (int64_t blk = begin; blk < end;) {
      const int count = end - blk >= wide ? wide : 1;
      (count == wide ? wide_dots : one_dots)(xp.data(), pairs, wp + blk * pairs * kLanes, sums);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < count * kLanes; ++i) {
          const int64_t j = blk * kLanes + i;
          if (j < n) op[r * n + j] = static_cast<at::BFloat16>(sums[r * count * kLanes + i] + b[j]);
        }
      blk += count;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def("skinny_linear(Tensor x, Tensor lanes, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("skinny_linear", &skinny_linear); }

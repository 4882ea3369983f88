// canteen::skinny_linear for float32: x @ w^T (+ bias) for any number of rows, every weight
// read once from memory (dense.cpp holds the bfloat16 kernel and the op).
//
// oneDNN's float32 matmul reads SmolLM2's weights at about half the machine's read speed at
// one row and reaches a third of its own GEMM speed at 16 (AMD EPYC, AVX2; README, Speed).
// Layout (worker/model/quant.py, pack_lanes): output rows in blocks of 16, one float per lane:
//   lanes [ceil(N / 16), K, 16, 1] float32, lanes[b, k, l] = w[16b + l, k], zero past N.
// So one vector (two on AVX2) of a block's weights meets one broadcast x[r, k] in one fused
// multiply-add, and each output's sum runs along K in order, k = 0, 1, ..., with one
// rounding per step: whatever the rows beside it, whatever the vector width (std::fma
// without AVX2), a row's outputs have the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>

#include "common.h"

namespace canteen {
namespace {

constexpr int64_t kLanes = 16;

// 16 float32 sums: one AVX-512 register, two AVX2 ones, or plain floats.
struct Sum16 {
#if defined(__AVX512F__)
  __m512 v = _mm512_setzero_ps();
  void fma(float x, const float* w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), _mm512_loadu_ps(w), v); }
  void store(float* out) const { _mm512_storeu_ps(out, v); }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  void fma(float x, const float* w) {
    const __m256 xv = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), lo);
    hi = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), hi);
  }
  void store(float* out) const {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  }
#else
  float v[kLanes] = {};
  void fma(float x, const float* w) {
    for (int l = 0; l < kLanes; ++l) v[l] = std::fma(x, w[l], v[l]);
  }
  void store(float* out) const { std::copy(v, v + kLanes, out); }
#endif
};

// Rows rows of x (``k`` apart) against Blocks blocks of 16 outputs (``block`` floats apart):
// out[r * stride + 16 b + l]. Template arguments, so that the sums stay in registers.
template <int Rows, int Blocks>
void dots(const float* x, int64_t k, const float* w, int64_t block, float* out, int64_t stride) {
  Sum16 acc[Rows][Blocks];
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const float xv = x[r * k + i];
      for (int b = 0; b < Blocks; ++b) acc[r][b].fma(xv, w + b * block + i * kLanes);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) acc[r][b].store(out + r * stride + b * kLanes);
}

// Rows a register tile takes, and the blocks that go with a tile of r rows: sums and
// weights within the vector registers (16 on AVX2, 32 on AVX-512).
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
constexpr int blocks_for(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 3 : 2; }
#else
constexpr int kTileRows = 6;
constexpr int blocks_for(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
#endif
constexpr int kMostBlocks = 4;
constexpr int64_t kChunkRows = 64;  // rows whose sums a task holds at once (on its stack)

using DotFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
template <int Blocks, int... R>
constexpr std::array<DotFn, sizeof...(R)> dots_for(std::integer_sequence<int, R...>) {
  return {dots<R + 1, Blocks>...};
}
using Row = std::array<DotFn, kTileRows>;
constexpr std::array<Row, kMostBlocks> kDots = {
    dots_for<1>(std::make_integer_sequence<int, kTileRows>{}),
    dots_for<2>(std::make_integer_sequence<int, kTileRows>{}),
    dots_for<3>(std::make_integer_sequence<int, kTileRows>{}),
    dots_for<4>(std::make_integer_sequence<int, kTileRows>{}),
};

// Rows [0, rows) of x, rows <= kChunkRows, against ``count`` blocks at ``w``, a register tile
// of rows at a time (the blocks stay in cache between tiles): sums[r * count * 16 + 16 b + l].
void block_sums(const float* x, int64_t rows, int64_t k, const float* w, int64_t block, int count,
                float* sums) {
  const int64_t stride = count * kLanes;
  for (int64_t r = 0; r < rows; r += kTileRows) {
    const int64_t tile = std::min<int64_t>(kTileRows, rows - r);
    kDots[count - 1][tile - 1](x + r * k, k, w, block, sums + r * stride, stride);
  }
}

using FloatFinish = canteen::Finish<float>;

// Every row of x against one unit of blocks, kChunkRows rows at a time: ``sums_of(x, n,
// sums)`` fills a chunk's sums and ``finish(first, n, sums)`` stores them.
template <typename Sums, typename Done>
void all_rows(const float* x, int64_t rows, int64_t k, float* sums, Sums sums_of, Done finish) {
  for (int64_t r0 = 0; r0 < rows; r0 += kChunkRows) {
    const int64_t n = std::min(kChunkRows, rows - r0);
    sums_of(x + r0 * k, n, sums);
    finish(r0, n, sums);
  }
}

// A gate block and its up block ``half`` blocks on: in one pass as two blocks where the
// register tile has room for both (one row: 5% faster on AVX2), else one after the other.
void gated(const float* x, int64_t rows, int64_t k, const float* w, int64_t blocks, const FloatFinish& fin) {
  const int64_t half = blocks / 2, block = k * kLanes;
  const bool paired = blocks_for(static_cast<int>(std::min<int64_t>(rows, kTileRows))) >= 2;
  at::parallel_for(0, half, 2, [&](int64_t begin, int64_t end) {
    float sums[kChunkRows * 2 * kLanes];
    float* up = sums + kChunkRows * kLanes;
    for (int64_t blk = begin; blk < end; ++blk) {
      const float* gw = w + blk * block;
      const float* uw = w + (blk + half) * block;
      if (paired) {  // sums[r * 32 + l]: the gate's, then the up block's at + 16
        all_rows(
            x, rows, k, sums, [&](const float* xs, int64_t n, float* s) { block_sums(xs, n, k, gw, half * block, 2, s); },
            [&](int64_t r0, int64_t n, const float* s) {
              for (int64_t r = 0; r < n; ++r)
                fin.gate(r0 + r, blk * kLanes, s + r * 2 * kLanes, s + (r * 2 + 1) * kLanes);
            });
        continue;
      }
      all_rows(
          x, rows, k, sums,
          [&](const float* xs, int64_t n, float* s) {
            block_sums(xs, n, k, gw, block, 1, s);
            block_sums(xs, n, k, uw, block, 1, up);
          },
          [&](int64_t r0, int64_t n, const float* s) {
            for (int64_t r = 0; r < n; ++r) fin.gate(r0 + r, blk * kLanes, s + r * kLanes, up + r * kLanes);
          });
    }
  });
}

void plain(const float* x, int64_t rows, int64_t k, const float* w, int64_t blocks, const FloatFinish& fin) {
  const int64_t block = k * kLanes;
  const int wide = blocks_for(static_cast<int>(std::min<int64_t>(rows, kTileRows)));
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    float sums[kChunkRows * kMostBlocks * kLanes];
    for (int64_t blk = begin; blk < end;) {
      const int count = static_cast<int>(std::min<int64_t>(wide, end - blk));
      all_rows(
          x, rows, k, sums,
          [&](const float* xs, int64_t n, float* s) { block_sums(xs, n, k, w + blk * block, block, count, s); },
          [&](int64_t r0, int64_t n, const float* s) {
            for (int64_t r = 0; r < n; ++r)
              for (int b = 0; b < count; ++b) fin.store(r0 + r, (blk + b) * kLanes, s + (r * count + b) * kLanes);
          });
      blk += count;
    }
  });
}

}  // namespace

at::Tensor skinny_linear_float(const at::Tensor& x, const at::Tensor& lanes, int64_t n,
                               const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& residual, bool gate,
                               const std::vector<const float*>& addend) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = (n + kLanes - 1) / kLanes;
  TORCH_CHECK(lanes.scalar_type() == at::kFloat &&
                  lanes.sizes() == at::IntArrayRef({blocks, k, kLanes, 1}),
              "skinny_linear: lanes float32 [ceil(N / 16), K, 16, 1] for x's K");
  const auto b = padded_bias(bias, n, blocks * kLanes, "skinny_linear");
  const auto res = residual_rows<float>(residual, x, n, gate, "skinny_linear");
  auto out = at::empty({rows, gate ? n / 2 : n}, x.options());
  if (rows == 0) return out;
  const FloatFinish fin = (gate ? FloatFinish::gated(out.data_ptr<float>(), n, b.data())
                                : FloatFinish{out.data_ptr<float>(), n, b.data(), res})
                              .with(addend);
  const auto xc = x.contiguous(), lc = lanes.contiguous();
  (gate ? gated : plain)(xc.data_ptr<float>(), rows, k, lc.data_ptr<float>(), blocks, fin);
  return out;
}

}  // namespace canteen

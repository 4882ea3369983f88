// canteen::skinny_linear: bfloat16 x @ w^T (+ bias) for every row count a step has: the rows
// of a decode step, the drafts a sequence verifies, a prefill chunk. Every row's outputs are
// computed by the same instructions in the same order whatever the rows beside it, so a
// sequence gets the same bits alone or in any batch (README, Exactness). Each weight block is
// read from memory once for all rows. float32 inputs go to dense_float.cpp's kernel, with a
// layout of their own.
//
// Layout (worker/model/quant.py, pack_lanes): output rows in blocks of 16, one 32-bit lane per row
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

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define CANTEEN_AMX 1
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int kMaxRows = 12;  // rows of x a call takes (worker/model/quant.py, SKINNY_ROWS)
using Finish = canteen::Finish<at::BFloat16>;

// x's rows as pairs of bfloat16 (32 bits each), zero-padded to ``pairs``: what one lane meets.
std::vector<uint32_t> x_pairs(const at::BFloat16* x, int64_t rows, int64_t k, int64_t pairs) {
  std::vector<uint32_t> out(rows * pairs, 0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out.data() + r * pairs, x + r * k, k * sizeof(uint16_t));
  return out;
}

inline float bf16_low(uint32_t v) { return at::BFloat16(static_cast<uint16_t>(v), at::BFloat16::from_bits()); }
inline float bf16_high(uint32_t v) { return at::BFloat16(static_cast<uint16_t>(v >> 16), at::BFloat16::from_bits()); }

// Rows rows of x against Blocks blocks of 16 output rows, the first at ``w``, the next
// ``block_words`` 32-bit words apart; sums out[r][16 b + l]. Rows and Blocks are template
// arguments so the sums live in registers.
template <int Rows, int Blocks>
void lane_dots(const uint32_t* x, int64_t pairs, const uint32_t* w, int64_t block_words, float* out) {
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

using LaneFn = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*);
template <int Blocks, int... R>
constexpr std::array<LaneFn, sizeof...(R)> fixed_dots(std::integer_sequence<int, R...>) {
  return {lane_dots<R + 1, Blocks>...};
}
// kDots[blocks - 1][rows - 1]
using RowFns = std::array<LaneFn, kMaxRows>;
constexpr std::array<RowFns, kMaxBlocks> kDots = {
    fixed_dots<1>(std::make_integer_sequence<int, kMaxRows>{}),
    fixed_dots<2>(std::make_integer_sequence<int, kMaxRows>{}),
    fixed_dots<3>(std::make_integer_sequence<int, kMaxRows>{}),
    fixed_dots<4>(std::make_integer_sequence<int, kMaxRows>{}),
};

// The rows of a register tile when ``rows`` rows go in tiles of at most kMaxRows, as even as
// can be (13 rows: 7 and 6). A tile's size never changes a row's sums, only the speed.
int64_t tile_rows(int64_t rows) {
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  return (rows + tiles - 1) / tiles;
}

#if defined(CANTEEN_AMX)
// With AMX (Xeon Sapphire Rapids on), one TDPBF16PS multiplies 16 rows of x by a 16 x 32
// tile of the weight, and the lanes layout is already AMX's B tile: for a block b, the 16
// pairs p in [16c, 16c + 16) are 16 rows of 64 bytes, one kilobyte in a row. Rows go 32 at
// a time (two tiles) against a task's blocks while they stay in cache. Every output is the
// same float32 sum along K, tile of K by tile of K, whatever the row count, so a row's result
// does not depend on the rows beside it; a machine with AMX takes it for every row count.
constexpr int64_t kTile = 16;          // rows of a tile, and pairs of K per tile
constexpr int64_t kTileBytes = 1024;   // 16 rows x 64 bytes
constexpr int kAmxBlocks = 4;          // C tiles 0-3, x in tile 4, weights in tiles 5-7

// Linux hands AMX's tile state to a process only on request (arch_prctl); once per process.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Tiles of x's rows and of their sums hold only the rows x has, so x needs no padding: for
// one tile of rows, C tiles 0-3 and x's tile 4 hold ``rows``; for two (amx_blocks2), C tiles
// 2-3 and x's tile 5 hold the second tile's ``rows - 16``. Weight tiles hold 16 pairs of K.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t x_rows) {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = kTile;
    const auto first = static_cast<uint8_t>(std::min<int64_t>(x_rows, kTile));
    const auto second = static_cast<uint8_t>(x_rows - first);
    if (second == 0) {
      rows[0] = rows[1] = rows[2] = rows[3] = rows[4] = first;
    } else {
      rows[2] = rows[3] = rows[5] = second;
    }
  }
};

// 16 rows of x (row stride ``x_stride`` bytes) against Count blocks of lanes starting at
// w[0..Count), ``chunks`` tiles of K each; float32 sums to out[Count][16][16].
template <int Count>
void amx_blocks(const uint8_t* x, int64_t x_stride, const uint8_t* const* w, int64_t chunks, float* out) {
  _tile_zero(0);
  if constexpr (Count > 1) _tile_zero(1);
  if constexpr (Count > 2) _tile_zero(2);
  if constexpr (Count > 3) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t at = c * kTileBytes;
    _tile_loadd(4, x + c * 64, x_stride);
    _tile_loadd(5, w[0] + at, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (Count > 1) {
      _tile_loadd(6, w[1] + at, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (Count > 2) {
      _tile_loadd(7, w[2] + at, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (Count > 3) {
      _tile_loadd(5, w[3] + at, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, 64);
  if constexpr (Count > 1) _tile_stored(1, out + 256, 64);
  if constexpr (Count > 2) _tile_stored(2, out + 512, 64);
  if constexpr (Count > 3) _tile_stored(3, out + 768, 64);
}

// 32 rows of x (two tiles of rows, ``x_group`` bytes apart) against Count <= 2 blocks at
// w[0..Count): sums to out[2][Count][16][16]. Each weight tile is loaded once for both.
template <int Count>
void amx_blocks2(const uint8_t* x, int64_t x_stride, int64_t x_group, const uint8_t* const* w,
                 int64_t chunks, float* out) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (Count > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t at = c * kTileBytes;
    _tile_loadd(4, x + c * 64, x_stride);
    _tile_loadd(5, x + x_group + c * 64, x_stride);
    _tile_loadd(6, w[0] + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (Count > 1) {
      _tile_loadd(7, w[1] + at, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 64);
  _tile_stored(2, out + Count * 256, 64);
  if constexpr (Count > 1) {
    _tile_stored(1, out + 256, 64);
    _tile_stored(3, out + 768, 64);
  }
}

using AmxFn = void (*)(const uint8_t*, int64_t, const uint8_t* const*, int64_t, float*);
constexpr AmxFn kAmxFns[kAmxBlocks] = {amx_blocks<1>, amx_blocks<2>, amx_blocks<3>, amx_blocks<4>};
using Amx2Fn = void (*)(const uint8_t*, int64_t, int64_t, const uint8_t* const*, int64_t, float*);
constexpr Amx2Fn kAmx2Fns[2] = {amx_blocks2<1>, amx_blocks2<2>};

// A task finishes ``units`` of 16 outputs: one block each, or with a gate two (the gate's
// block and the up block ``half`` blocks on), for every row of x, 32 rows (two tiles) at a
// time while its weights stay in cache.
void amx_linear(const at::Tensor& x, const uint8_t* w, int64_t n, const Finish& fin) {
  const int64_t rows = x.size(0), k = x.size(1), pass_rows = 2 * kTile;
  const int64_t blocks = (n + kLanes - 1) / kLanes, chunks = k / 32, block_bytes = chunks * kTileBytes;
  const auto* xb = reinterpret_cast<const uint8_t*>(x.data_ptr<at::BFloat16>());
  const bool gate = fin.inner > 0;
  const int64_t half = gate ? blocks / 2 : 0, units = gate ? half : blocks;
  // blocks a task takes: four for one tile of rows, two for two (the C tiles are four), and
  // fewer where that leaves under 16 tasks, so two threads split a small linear evenly
  int per_task = (rows <= kTile ? kAmxBlocks : 2) / (gate ? 2 : 1);
  while (per_task > 1 && units < 16 * per_task) per_task /= 2;
  const int64_t tasks = (units + per_task - 1) / per_task;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    int64_t configured = 0;  // the rows the loaded tile configuration holds
    alignas(64) float sums[2 * kAmxBlocks * kTile * kLanes];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * per_task;
      const int count = static_cast<int>(std::min<int64_t>(per_task, units - first));
      const uint8_t* ws[kAmxBlocks];
      for (int i = 0; i < count; ++i) {
        ws[i] = w + (first + i) * block_bytes;
        if (gate) ws[count + i] = w + (half + first + i) * block_bytes;
      }
      const int used = gate ? 2 * count : count;
      for (int64_t r0 = 0; r0 < rows; r0 += pass_rows) {
        const int64_t pass = std::min(pass_rows, rows - r0);
        if (pass != configured) {
          const TileConfig config(pass);
          _tile_loadconfig(&config);
          configured = pass;
        }
        const uint8_t* xr = xb + r0 * k * 2;
        if (pass <= kTile)
          kAmxFns[used - 1](xr, k * 2, ws, chunks, sums);
        else
          kAmx2Fns[used - 1](xr, k * 2, kTile * k * 2, ws, chunks, sums);
        for (int64_t r = 0; r < pass; ++r) {
          const float* row = sums + (r / kTile) * used * kTile * kLanes + (r % kTile) * kLanes;
          for (int i = 0; i < count; ++i) {
            const int64_t j = (first + i) * kLanes;
            if (gate)
              fin.gate(r0 + r, j, row + i * kTile * kLanes, row + (count + i) * kTile * kLanes);
            else
              fin.store(r0 + r, j, row + i * kTile * kLanes);
          }
        }
      }
    }
    if (configured) _tile_release();
  });
}

// Whether AMX takes this linear: by its K alone, never by the row count, so a row's sums
// come from the same instructions whatever the step's width.
bool amx_takes(int64_t k) { return k % 32 == 0 && amx_ready(); }
#else
bool amx_takes(int64_t) { return false; }
#endif

// The AVX512-BF16 (or plain) dot products: a task's blocks go ``wide`` at a time, or with a
// gate as pairs of the gate's block and the up block ``half`` blocks on; for each, every row
// of x in register tiles, so a block's weights are read from memory once for all rows.
void lanes_linear(const std::vector<uint32_t>& xp, int64_t rows, int64_t pairs, const uint32_t* wp,
                  int64_t blocks, const Finish& fin) {
  const int64_t block_words = pairs * kLanes, tile = tile_rows(rows);
  // One tile of rows at ``blk``, ``count`` blocks ``apart`` words apart; then finished.
  auto tiles = [&](int64_t blk, int count, int64_t apart, float* sums) {
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
      const int64_t n = std::min(tile, rows - r0);
      kDots[count - 1][n - 1](xp.data() + r0 * pairs, pairs, wp + blk * block_words, apart, sums);
      for (int64_t r = 0; r < n; ++r) {
        if (fin.inner > 0) {
          fin.gate(r0 + r, blk * kLanes, sums + r * 2 * kLanes, sums + (r * 2 + 1) * kLanes);
          continue;
        }
        for (int b = 0; b < count; ++b)
          fin.store(r0 + r, (blk + b) * kLanes, sums + (r * count + b) * kLanes);
      }
    }
  };
  if (fin.inner > 0) {
    const int64_t half = blocks / 2;
    at::parallel_for(0, half, 2, [&](int64_t begin, int64_t end) {
      float sums[kMaxRows * 2 * kLanes];
      for (int64_t blk = begin; blk < end; ++blk) tiles(blk, 2, half * block_words, sums);
    });
    return;
  }
  const int wide = blocks_for_rows(static_cast<int>(tile));
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    float sums[kMaxRows * kMaxBlocks * kLanes];
    for (int64_t blk = begin; blk < end;) {
      const int count = end - blk >= wide ? wide : 1;
      tiles(blk, count, block_words, sums);
      blk += count;
    }
  });
}

// x [M, K] bfloat16 (any M) @ the weight [n, K]^T (+ bias), the weight in
// pack_lanes' layout, finished plainly, onto ``residual`` [M, n], or through the SiLU gate
// (``gate``: outputs [gate | up], half of them a multiple of 16; returns [M, n / 2]); with
// ``addend`` [R, n] added first to rows ``addend_rows`` (common.h, Finish).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& lanes, int64_t n,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                         bool gate, const c10::optional<at::Tensor>& addend,
                         const c10::optional<at::Tensor>& addend_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "skinny_linear: x bfloat16 or float32 [M, K]");
  if (x.scalar_type() == at::kFloat)
    return canteen::skinny_linear_float(x, lanes, n, bias, residual, gate,
                                        canteen::addend_rows<float>(addend, addend_rows, x, n, "skinny_linear"));
  const int64_t rows = x.size(0), k = x.size(1), pairs = (k + 1) / 2, blocks = (n + kLanes - 1) / kLanes;
  TORCH_CHECK(lanes.scalar_type() == at::kBFloat16 &&
                  lanes.sizes() == at::IntArrayRef({blocks, pairs, kLanes, 2}),
              "skinny_linear: lanes bfloat16 [ceil(N / 16), ceil(K / 2), 16, 2] for x's K");
  const auto b = canteen::padded_bias(bias, n, blocks * kLanes, "skinny_linear");
  const auto res = canteen::residual_rows(residual, x, n, gate, "skinny_linear");
  auto out = at::empty({rows, gate ? n / 2 : n}, x.options());
  const auto added = canteen::addend_rows(addend, addend_rows, x, n, "skinny_linear");
  const Finish fin = (gate ? Finish::gated(out.data_ptr<at::BFloat16>(), n, b.data())
                           : Finish{out.data_ptr<at::BFloat16>(), n, b.data(), res})
                         .with(added);
  if (rows == 0) return out;
  const auto xc = x.contiguous(), lc = lanes.contiguous();
#if defined(CANTEEN_AMX)
  if (amx_takes(k)) {
    amx_linear(xc, reinterpret_cast<const uint8_t*>(lc.data_ptr<at::BFloat16>()), n, fin);
    return out;
  }
#endif
  const auto xp = x_pairs(xc.data_ptr<at::BFloat16>(), rows, k, pairs);
  lanes_linear(xp, rows, pairs, reinterpret_cast<const uint32_t*>(lc.data_ptr<at::BFloat16>()), blocks, fin);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def(
      "skinny_linear(Tensor x, Tensor lanes, int n, Tensor? bias, Tensor? residual=None, "
      "bool gate=False, Tensor? addend=None, Tensor? addend_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("skinny_linear", &skinny_linear); }

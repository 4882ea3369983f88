// canteen::quant_linear: 4- or 8-bit weights as shipped x bfloat16 activations as they are.
//
// Weights come in groups of 32 along K with w = d * q + m, d and m float16: q in 0..15 (4 bits;
// a GGUF Q4_1 block as is) or q in -128..127 (8 bits; a GGUF Q8_0 block, m = 0, or int8
// weights with one scale per row). Every q is exact in bfloat16 and every product x * q is
// exact in float32, so a group's share of a dot product is
//   sum_i w_i x_i = d * sum_i q_i x_i + m * sum_i x_i
// with the first sum a chain of bfloat16 dot products (vdpbf16ps) of x as it is and q widened
// to bfloat16 in registers, and the second, the group's sum of x, computed once per row and
// step and shared by every output. Nothing is rounded but the float32 sums, which run in one
// fixed order: groups along K, and within a group the pairs 0, 8, 1, 9, ..., 7, 15 (4 bits)
// or 0..15 (8 bits).
//
// One arithmetic for every row count. One row streams the packed weights (a quarter of
// bfloat16's bytes at 4 bits); a wide step widens each chunk of a block's weights once into
// registers and uses it for a register tile of up to 12 rows. A row's sums never depend on the
// tile it lands in or on the rows beside it: batched equals alone (README, Exactness).
//
// Layout (worker/model/quant.py, pack_groups): output rows in blocks of 16, one 32-bit lane
// per output holding a pair of adjacent weights (as skinny_linear's lanes). Per block and
// group, 16 pairs of 16 lanes x 2 weights: at 8 bits 16 chunks of 32 bytes, chunk p the int8
// weights of pair p; at 4 bits 8 chunks of 32 bytes, chunk s holding pair s in its low
// nibbles and pair s + 8 in its high ones. scales [blocks, groups, 2, 16] float16: d, then m.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "share.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CANTEEN_BF16_DOTS 1
#endif

namespace {

constexpr int64_t kGroup = 32, kBlock = 16, kPairs = kGroup / 2;
constexpr int kMaxRows = 12;      // rows of a register tile (8-bit weights)
constexpr int kMaxGateRows = 6;   // with a gate, whose tiles hold two blocks
// 4-bit weights without a gate go in tiles of 6 rows against 2 blocks too: each x pair
// broadcast feeds two dot products, for a third more widenings of the (cheap) 4-bit chunks.
// On the Zen 4 (2026-12-07, each projection against skinny_linear, alternating, 2 threads;
// docs/speed-history.md) that took the down, q/k/v and o projections from 1.04-1.10x
// bfloat16's time to 0.87-1.00x at 16-32 rows; 8-bit chunks cost twice as much to widen and
// lost (the head 1.03-1.17x -> 1.37-1.40x at 32 rows), so they keep 12-row tiles.
constexpr int kMax4BitRows = 6;

template <int Bits>
constexpr int64_t kGroupBytes = kBlock * kGroup * Bits / 8;

// x as the kernel reads it: rows of bfloat16 pairs, and each group's sum of x.
struct XRows {
  const uint32_t* pairs;  // [rows, k / 2]
  const float* xsum;      // [rows, groups]
  int64_t k_pairs, groups;

  XRows from(int64_t first) const { return {pairs + first * k_pairs, xsum + first * groups, k_pairs, groups}; }
};

inline float bf16_bits(uint16_t v) { return at::BFloat16(v, at::BFloat16::from_bits()); }

// Each row's sum of x per group of 32: two halves of 16 added lane by lane, then the 16 sums
// in a fixed tree (scalar here; the same tree of vector adds below).
std::vector<float> group_sums(const at::BFloat16* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<float> out(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const at::BFloat16* v = x + r * k + g * kGroup;
#if defined(CANTEEN_BF16_DOTS)
      const __m512 s = _mm512_add_ps(canteen::load16(v), canteen::load16(v + 16));
      out[r * groups + g] = _mm512_reduce_add_ps(s);
#else
      float s[kBlock];
      for (int64_t i = 0; i < kBlock; ++i) s[i] = static_cast<float>(v[i]) + static_cast<float>(v[i + kBlock]);
      for (int64_t w = kBlock / 2; w > 0; w /= 2)
        for (int64_t i = 0; i < w; ++i) s[i] += s[i + w];
      out[r * groups + g] = s[0];
#endif
    }
  }
  return out;
}

#if defined(CANTEEN_BF16_DOTS)
constexpr bool kVectorized = true;

// How far ahead a block's weights are asked for (lowbit's measurements on the Xeon: 1-4 KB
// ahead took a streamed 4-bit step from 16 to 13.5 ms; README, Speed): prefetch_ahead.

#ifndef CANTEEN_PREFETCH_BYTES
#define CANTEEN_PREFETCH_BYTES 4096
#endif

// Asks for the weights CANTEEN_PREFETCH_BYTES (4 KB) ahead of group ``g`` of block ``b`` in the order the
// blocks are read, and for the scales of the block read after it. Blocks side by side (no
// gate, ``apart`` one block) are read ``Blocks`` at a time, so the block after block b is
// b + Blocks, not b + 1 (which is being read now): without this, once a block's last 4 KB
// were near, its stream asked for bytes already in cache, and the next blocks started on
// cache misses (a 4-bit block is 4.5 KB, so most of every block). A gate's two streams each
// move one block on. Prefetches change no result, only when the bytes arrive.
template <int Bits, int Blocks>
inline void prefetch_ahead(const uint8_t* w, int64_t apart, const at::Half* scales, int64_t scales_apart,
                           int64_t groups, int b, int64_t g) {
  constexpr int64_t kAhead = CANTEEN_PREFETCH_BYTES;
  const int64_t block_bytes = groups * kGroupBytes<Bits>, block_scales = groups * 2 * kBlock;
  const int64_t step = apart == block_bytes ? Blocks : 1;  // blocks on to this stream's next
  int64_t off = g * kGroupBytes<Bits> + kAhead;
  const uint8_t* base = w + b * apart;
  if (off >= block_bytes) {
    base += step * block_bytes;
    off -= block_bytes;
  }
  const char* ahead = reinterpret_cast<const char*>(base + off);
  for (int64_t line = 0; line < kGroupBytes<Bits>; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  // a group's 16 d and 16 m: one line, the next block's of the same group
  _mm_prefetch(reinterpret_cast<const char*>(scales + b * scales_apart + step * block_scales + g * 2 * kBlock),
               _MM_HINT_T0);
}

// 0..15 as bfloat16 bits, in the first 16 words; vpermw looks the nibbles up in it.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32] = {};
  for (int i = 0; i < 16; ++i) t[i] = at::BFloat16(static_cast<float>(i)).x;
  return _mm512_load_si512(t);
}

inline __m512bh pair_of(const uint32_t* x, int64_t at) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[at])));
}

// Rows rows of x against Blocks blocks of 16 outputs, the first at ``w``, the next
// ``apart`` bytes on (scales ``scales_apart`` halves on); sums to out[r][b][16]. Rows and
// Blocks are template arguments so the sums live in registers; each (row, block) runs the
// same instructions in the same order for every Rows and Blocks.
template <int Bits, int Rows, int Blocks>
void group_dots(const uint8_t* w, int64_t apart, const at::Half* scales, int64_t scales_apart, const XRows& x,
                float* out) {
  __m512 y[Rows][Blocks], dot[Rows][Blocks];
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) y[r][b] = _mm512_setzero_ps();
  const __m512i table = nibble_table(), nibble = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < x.groups; ++g) {
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Blocks; ++b) dot[r][b] = _mm512_setzero_ps();
    const int64_t pair0 = g * kPairs;
    for (int b = 0; b < Blocks; ++b) prefetch_ahead<Bits, Blocks>(w, apart, scales, scales_apart, x.groups, b, g);
    if constexpr (Bits == 4) {
      for (int s = 0; s < 8; ++s) {
        for (int b = 0; b < Blocks; ++b) {
          const uint8_t* wp = w + b * apart + g * kGroupBytes<4> + 32 * s;
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
          const auto lo = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_and_si512(v, nibble), table));
          const auto hi = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
#pragma GCC unroll 12
          for (int r = 0; r < Rows; ++r) {
            const uint32_t* xr = x.pairs + r * x.k_pairs;
            dot[r][b] = _mm512_dpbf16_ps(dot[r][b], pair_of(xr, pair0 + s), lo);
            dot[r][b] = _mm512_dpbf16_ps(dot[r][b], pair_of(xr, pair0 + s + 8), hi);
          }
        }
      }
    } else {
      for (int p = 0; p < kPairs; ++p) {
        for (int b = 0; b < Blocks; ++b) {
          const uint8_t* wp = w + b * apart + g * kGroupBytes<8> + 32 * p;
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp))));
          const __m512 hi =
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16))));
          const __m512bh q = _mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128
#pragma GCC unroll 12
          for (int r = 0; r < Rows; ++r)
            dot[r][b] = _mm512_dpbf16_ps(dot[r][b], pair_of(x.pairs + r * x.k_pairs, pair0 + p), q);
        }
      }
    }
    for (int b = 0; b < Blocks; ++b) {
      const auto* sp = reinterpret_cast<const __m256i*>(scales + b * scales_apart + g * 2 * kBlock);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(sp)), m = _mm512_cvtph_ps(_mm256_loadu_si256(sp + 1));
      for (int r = 0; r < Rows; ++r) {
        y[r][b] = _mm512_fmadd_ps(d, dot[r][b], y[r][b]);
        y[r][b] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.xsum[r * x.groups + g]), y[r][b]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + (r * Blocks + b) * kBlock, y[r][b]);
}

#else
#if defined(__AVX2__)
constexpr bool kVectorized = true;  // the loops below, vectorized by the compiler
#else
constexpr bool kVectorized = false;
#endif

// The weight of lane l in pair p of a block's group (layout above).
template <int Bits>
inline float weight_at(const uint8_t* wg, int p, int l, int e) {
  if constexpr (Bits == 4) {
    const uint8_t byte = wg[32 * (p % 8) + 2 * l + e];
    return static_cast<float>(p < 8 ? byte & 0x0F : byte >> 4);
  } else {
    return static_cast<float>(static_cast<int8_t>(wg[32 * p + 2 * l + e]));
  }
}

// The same sums without bfloat16 dot products: per lane, the pairs in the same order, each
// pair's two exact products added in turn.
template <int Bits, int Rows, int Blocks>
void group_dots(const uint8_t* w, int64_t apart, const at::Half* scales, int64_t scales_apart, const XRows& x,
                float* out) {
  for (int r = 0; r < Rows; ++r) {
    const uint32_t* xr = x.pairs + r * x.k_pairs;
    for (int b = 0; b < Blocks; ++b) {
      float y[kBlock] = {};
      for (int64_t g = 0; g < x.groups; ++g) {
        const uint8_t* wg = w + b * apart + g * kGroupBytes<Bits>;
        float dot[kBlock] = {};
        for (int i = 0; i < kPairs; ++i) {
          const int p = Bits == 4 ? (i % 2 ? 8 + i / 2 : i / 2) : i;
          const uint32_t xp = xr[g * kPairs + p];
          const float x0 = bf16_bits(static_cast<uint16_t>(xp)), x1 = bf16_bits(static_cast<uint16_t>(xp >> 16));
#pragma omp simd
          for (int l = 0; l < kBlock; ++l) {
            dot[l] += x0 * weight_at<Bits>(wg, p, l, 0);
            dot[l] += x1 * weight_at<Bits>(wg, p, l, 1);
          }
        }
        const at::Half* sp = scales + b * scales_apart + g * 2 * kBlock;
        const float xs = x.xsum[r * x.groups + g];
        for (int l = 0; l < kBlock; ++l) {
          y[l] += static_cast<float>(sp[l]) * dot[l];
          y[l] += static_cast<float>(sp[kBlock + l]) * xs;
        }
      }
      std::memcpy(out + (r * Blocks + b) * kBlock, y, sizeof(y));
    }
  }
}
#endif

// Blocks at once for a tile of rows: enough independent chains for one row, and two sums per
// (row, block) within the 32 registers for many.
constexpr int blocks_for_rows(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 3 : rows <= 6 ? 2 : 1; }
constexpr int kMaxBlocks = 4;

using DotFn = void (*)(const uint8_t*, int64_t, const at::Half*, int64_t, const XRows&, float*);
template <int Bits, int Blocks, int... R>
constexpr std::array<DotFn, sizeof...(R)> row_fns(std::integer_sequence<int, R...>) {
  return {group_dots<Bits, R + 1, Blocks>...};
}
using RowFns = std::array<DotFn, kMaxRows>;
template <int Bits>
constexpr std::array<RowFns, kMaxBlocks> kDots = {
    row_fns<Bits, 1>(std::make_integer_sequence<int, kMaxRows>{}),
    row_fns<Bits, 2>(std::make_integer_sequence<int, kMaxRows>{}),
    row_fns<Bits, 3>(std::make_integer_sequence<int, kMaxRows>{}),
    row_fns<Bits, 4>(std::make_integer_sequence<int, kMaxRows>{}),
};

// The rows of a register tile when ``rows`` go in tiles of at most ``most``, as even as can be
// (13 rows: 7 and 6). A tile's size never changes a row's sums, only the speed.
int64_t tile_rows(int64_t rows, int64_t most) {
  const int64_t tiles = (rows + most - 1) / most;
  return (rows + tiles - 1) / tiles;
}

// One thread's share of a call must be worth waking it: on the Zen 4 one thread streamed
// SmolLM2's int4 q/k/v and o projections (up to 384 KiB) as fast as two.
constexpr int64_t kMinTaskBytes = 64 * 1024;

struct Packed {
  const uint8_t* w;
  const at::Half* scales;
  int64_t block_bytes, block_scales, blocks;
  const std::array<RowFns, kMaxBlocks>* dots;
  int64_t max_rows;  // of a register tile without a gate
};

// Every block of 16 outputs (with a gate: each gate block beside the up block ``half`` on)
// for every row of x, in register tiles, a task's blocks while they are in cache.
template <typename T>
void quant_blocks(const Packed& pk, const XRows& x, int64_t rows, const canteen::Finish<T>& fin) {
  const bool gate = fin.inner > 0;
  const int64_t half = gate ? pk.blocks / 2 : 0, units = gate ? half : pk.blocks;
  const int64_t tile = tile_rows(rows, gate ? kMaxGateRows : pk.max_rows);
  const int wide = gate ? 2 : blocks_for_rows(static_cast<int>(tile));
  const int64_t unit_bytes = pk.block_bytes * (gate ? 2 : 1);
  const int64_t grain = std::max<int64_t>(gate ? 2 : 4, kMinTaskBytes / std::max<int64_t>(unit_bytes, 1));
  const auto body = [&](int64_t begin, int64_t end) {
    float sums[kMaxRows * kMaxBlocks * kBlock];
    for (int64_t blk = begin; blk < end;) {
      const int count = gate ? 2 : (end - blk >= wide ? wide : 1);
      const int64_t apart = gate ? half : 1;
      for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t n = std::min(tile, rows - r0);
        (*pk.dots)[count - 1][n - 1](pk.w + blk * pk.block_bytes, apart * pk.block_bytes,
                                     pk.scales + blk * pk.block_scales, apart * pk.block_scales, x.from(r0), sums);
        for (int64_t r = 0; r < n; ++r) {
          const float* row = sums + r * count * kBlock;
          if (gate) {
            fin.gate(r0 + r, blk * kBlock, row, row + kBlock);
            continue;
          }
          for (int b = 0; b < count; ++b) fin.store(r0 + r, (blk + b) * kBlock, row + b * kBlock);
        }
      }
      blk += gate ? 1 : count;
    }
  };
  // A narrow step on one torch thread shares its bigger linears with the step helper (share.h).
  if (at::get_num_threads() == 1 && !at::in_parallel_region() && canteen::has_step_helper()) {
    canteen::shared_for(units, (grain + wide - 1) / wide * wide, body);
  } else {
    at::parallel_for(0, units, grain, body);
  }
}

// x [M, K] @ the weight [N, K]^T (+ bias): packed [ceil(N / 16), K / 32, 256 or 512]
// uint8 (4 or 8 bits), scales [ceil(N / 16), K / 32, 2, 16] float16; finished plainly, onto
// ``residual`` [M, N], or through the SiLU gate (common.h, Finish), with ``addend`` [R, N]
// added first to rows ``addend_rows``. x is read in bfloat16 (a
// float32 or float16 x is rounded to it first) and the result is in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        int64_t n, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, bool gate,
                        const c10::optional<at::Tensor>& addend, const c10::optional<at::Tensor>& addend_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x [M, K]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(k % kGroup == 0, "quant_linear: K a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(0) == blocks &&
                  packed.size(1) == k / kGroup && (packed.size(2) == 256 || packed.size(2) == 512),
              "quant_linear: packed uint8 [ceil(N / 16), K / 32, 256 (4 bits) or 512 (8 bits)]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf &&
                  scales.sizes() == at::IntArrayRef({blocks, k / kGroup, 2, kBlock}),
              "quant_linear: scales float16 [ceil(N / 16), K / 32, 2, 16]");
  const auto xb = x.to(at::kBFloat16).contiguous(), pc = packed.contiguous(), sc = scales.contiguous();
  const auto xsum = group_sums(xb.data_ptr<at::BFloat16>(), rows, k);
  const XRows xr{reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>()), xsum.data(), k / 2, k / kGroup};
  const auto b = canteen::padded_bias(bias, n, blocks * kBlock, "quant_linear");
  auto out = at::empty({rows, gate ? n / 2 : n}, x.options());
  const bool four = pc.size(2) == 256;
  const Packed pk{pc.data_ptr<uint8_t>(), sc.data_ptr<at::Half>(), pc.size(1) * pc.size(2),
                  sc.size(1) * 2 * kBlock, blocks, four ? &kDots<4> : &kDots<8>,
                  four ? kMax4BitRows : kMaxRows};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "quant_linear_out", [&] {
    using T = scalar_t;
    const T* res = canteen::residual_rows<T>(residual, x, n, gate, "quant_linear");
    const auto added = canteen::addend_rows<T>(addend, addend_rows, x, n, "quant_linear");
    const auto fin = (gate ? canteen::Finish<T>::gated(out.data_ptr<T>(), n, b.data())
                           : canteen::Finish<T>{out.data_ptr<T>(), n, b.data(), res})
                         .with(added);
    if (rows > 0) quant_blocks<T>(pk, xr, rows, fin);
  });
  return out;
}

// Whether quant_linear runs vectorized on this build (AVX512-BF16 dot products, or the
// compiler's AVX2 loops).
bool quant_vectorized() { return kVectorized; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def("quant_vectorized() -> bool", &quant_vectorized);
  m.def(
      "quant_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, "
      "Tensor? residual=None, bool gate=False, Tensor? addend=None, Tensor? addend_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("quant_linear", &quant_linear); }

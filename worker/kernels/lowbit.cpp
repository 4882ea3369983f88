// canteen::quant_linear: 4- or 8-bit weights x int8 activations (llama.cpp's Q4_1 x Q8_1
// arithmetic), for decode steps and short chunks.
//
// Weights come in groups of 32 along K with w = d * u + m: u in 0..15 (4 bits; a GGUF Q4_1
// block as is) or 0..255 (8 bits; int8 weights q with scale s as u = q + 128, d = s,
// m = -128 s), d and m float16. Each row of x is quantized per group of 32 to int8 with
// sx = max|x| / 127, so a group's share of a dot product is one integer dot:
//   sum_i w_i x_i ~= d * sx * sum_i u_i xq_i + m * sx * sum_i xq_i.
// This rounds the activations to 8 bits, which torch's low-bit kernels do not; in exchange
// the weights stream at near the memory's bandwidth where those kernels are compute-bound.
//
// Rows are taken eight at a time against each block of 16 outputs while its weights are in
// L1, so the weights stream from memory once whatever the row count, and each row's result is
// the same bits as in a call of its own (its activations are quantized alone, its sums run in
// the same order): batched equals alone.
//
// Layout (worker/model/quant.py, pack_groups): output rows in blocks of 16, one 32-bit lane per row,
// so no horizontal sums. Per block and group, chunks of 16 lanes x 4 bytes: at 8 bits chunk c
// holds each row's weights 4c..4c+3 of the group (8 chunks); at 4 bits chunk c holds 4c..4c+3
// in its low nibbles and 4c+16..4c+19 in its high ones (4 chunks). scales [blocks, groups, 2,
// 16] float16: d, then m.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using canteen::to_float;

constexpr int64_t kGroup = 32, kBlock = 16;
constexpr int64_t kMaxRows = 8;  // rows of x one pass over a block takes

struct Q8Rows {
  int64_t rows, k, groups;
  std::vector<int8_t> q;    // [rows, k]
  std::vector<float> sx;    // [rows, groups]: each group's scale
  std::vector<float> xsum;  // [rows, groups]: sx * the sum of the group's int8 values
};

#if defined(__AVX512F__)
// One group of 32 float32 or bfloat16 values as quantize_rows rounds them, two vectors at a
// time: the same max, the same products, and the conversion rounds to nearest even as
// std::nearbyint does in the default rounding mode, so the same int8 values and sums.
template <typename T>
void quantize_group(const T* x, int8_t* q, float* sx, float* xsum) {
  const __m512 a = canteen::load16(x), b = canteen::load16(x + 16);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  if (top == 0.f) return;
  const __m512 inv = _mm512_set1_ps(127.f / top);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sx = top / 127.f;
  *xsum = top / 127.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
}
#endif

template <typename T>
Q8Rows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  Q8Rows out{rows, k, groups, std::vector<int8_t>(rows * k, 0), std::vector<float>(rows * groups, 0.f),
             std::vector<float>(rows * groups, 0.f)};
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g)
        quantize_group(x + r * k + g * kGroup, out.q.data() + r * k + g * kGroup, &out.sx[r * groups + g],
                       &out.xsum[r * groups + g]);
    return out;
  }
#endif
  float v[kGroup];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      to_float(x + r * k + g * kGroup, v, kGroup);
      float top = 0.f;
      for (float f : v) top = std::max(top, std::abs(f));
      if (top == 0.f) continue;
      const float inv = 127.f / top;
      int32_t sum = 0;
      int8_t* q = out.q.data() + r * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        sum += q[i];
      }
      out.sx[r * groups + g] = top / 127.f;
      out.xsum[r * groups + g] = top / 127.f * static_cast<float>(sum);
    }
  }
  return out;
}

// ``rows`` rows of a Q8Rows from ``first`` on, as block_dots reads them.
struct Q8View {
  const int8_t* q;
  const float* sx;
  const float* xsum;
  int64_t k, groups;

  Q8View(const Q8Rows& x, int64_t first)
      : q(x.q.data() + first * x.k), sx(x.sx.data() + first * x.groups),
        xsum(x.xsum.data() + first * x.groups), k(x.k), groups(x.groups) {}
};

// Bytes per block and group, and 32-bit chunks of 16 lanes in them.
template <int Bits>
constexpr int64_t kGroupBytes = kBlock * kGroup * Bits / 8;
template <int Bits>
constexpr int kChunks = Bits == 4 ? 4 : 8;

// The four int8 activations chunk c's (or, at 4 bits, its high nibbles') weights meet.
inline int32_t four(const int8_t* xq, int64_t at) {
  int32_t v;
  std::memcpy(&v, xq + at, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVectorized = true;

// How far ahead block_dots asks for the weights it will read. A thread streaming a linear's
// blocks from memory reached only 9-10 GB/s with the hardware prefetchers alone; asking
// 4 KB ahead took a step of SmolLM2 at int4 from 16.1-16.4 to 13.4-13.7 ms at 16 rows and
// from 5.9-6.3 to 5.2-5.3 at one (int8: 19.4-20.0 to 15.9-16.0, 7.5-7.8 to 7.1-7.2), on a
// 2-core Xeon with AMX (2026-12-05, alternating A/B of bench/decode_step.py). 1-3 KB gave
// about the same, 8 KB less (README, Speed).
constexpr int64_t kPrefetchBytes = 4096;

// out[r][0..16) for one block of 16 weight rows against every row of x.
template <int Bits, int Rows>
void block_dots(const uint8_t* w, const at::Half* scales, const Q8View& x, float (*out)[kBlock]) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < x.groups; ++g, w += kGroupBytes<Bits>, scales += 2 * kBlock) {
    __m512i u[8];  // chunk c's weights meet activations 4c..4c+3
    // this group's lines kPrefetchBytes on (its scales a quarter as far): past the end of a
    // task they read the next block or the next task's, and a prefetch never faults
    for (int c = 0; c < kChunks<Bits>; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64 * c), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scales) + kPrefetchBytes / 4, _MM_HINT_T0);
    for (int c = 0; c < kChunks<Bits>; ++c) {
      const __m512i v = _mm512_loadu_si512(w + 64 * c);
      if constexpr (Bits == 4) {
        u[c] = _mm512_and_si512(v, nibble);
        u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      } else {
        u[c] = v;
      }
    }
    const auto* sp = reinterpret_cast<const __m256i*>(scales);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(sp));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(sp + 1));
    for (int r = 0; r < Rows; ++r) {
      const int8_t* xq = x.q + r * x.k + g * kGroup;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, u[c], _mm512_set1_epi32(four(xq, 4 * c)));
        odd = _mm512_dpbusd_epi32(odd, u[c + 1], _mm512_set1_epi32(four(xq, 4 * c + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      const int64_t at = r * x.groups + g;
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x.sx[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.xsum[at]), acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out[r], acc[r]);
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr bool kVectorized = true;

// Two 8-lane halves per block. u8 x s8 pairs are summed in int16 by maddubs, which saturates
// at 32767: 4-bit pairs (2 * 15 * 128) never reach it; 8-bit ones (2 * 255 * 128) can, so
// 8-bit weights are widened to int16 first and multiplied with madd.
template <int Bits, int Rows>
void block_dots(const uint8_t* w, const at::Half* scales, const Q8View& x, float (*out)[kBlock]) {
  __m256 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < x.groups; ++g, w += kGroupBytes<Bits>, scales += 2 * kBlock) {
    for (int h = 0; h < 2; ++h) {
      __m256i u[8];
      for (int c = 0; c < kChunks<Bits>; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32 * h));
        if constexpr (Bits == 4) {
          u[c] = _mm256_and_si256(v, nibble);
          u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        } else {
          u[c] = v;
        }
      }
      const auto* sp = reinterpret_cast<const __m128i*>(scales + 8 * h);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(sp));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(sp + 2));
      for (int r = 0; r < Rows; ++r) {
        const int8_t* xq = x.q + r * x.k + g * kGroup;
        __m256i sum = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i xv = _mm256_set1_epi32(four(xq, 4 * c));
          if constexpr (Bits == 4) {
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], xv), ones));
          } else {
            const __m256i ulo = _mm256_unpacklo_epi8(u[c], _mm256_setzero_si256());
            const __m256i uhi = _mm256_unpackhi_epi8(u[c], _mm256_setzero_si256());
            const __m256i xlo = _mm256_srai_epi16(_mm256_unpacklo_epi8(xv, xv), 8);
            const __m256i xhi = _mm256_srai_epi16(_mm256_unpackhi_epi8(xv, xv), 8);
            // madd leaves each row's dword as two halves, spread over lo and hi: hadd joins them
            sum = _mm256_add_epi32(sum, _mm256_hadd_epi32(_mm256_madd_epi16(ulo, xlo), _mm256_madd_epi16(uhi, xhi)));
          }
        }
        const int64_t at = r * x.groups + g;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x.sx[at])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.xsum[at]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}

#else
constexpr bool kVectorized = false;

// A plain loop, kept for correctness on CPUs without either (the worker then prefers torch's
// kernels, see quant_vectorized).
template <int Bits, int Rows>
void block_dots(const uint8_t* w, const at::Half* scales, const Q8View& x, float (*out)[kBlock]) {
  for (int r = 0; r < Rows; ++r) std::fill(out[r], out[r] + kBlock, 0.f);
  for (int64_t g = 0; g < x.groups; ++g, w += kGroupBytes<Bits>, scales += 2 * kBlock) {
    for (int r = 0; r < Rows; ++r) {
      const int8_t* xq = x.q + r * x.k + g * kGroup;
      const int64_t at = r * x.groups + g;
      for (int64_t lane = 0; lane < kBlock; ++lane) {
        int32_t dot = 0;
        for (int64_t c = 0; c < kChunks<Bits>; ++c) {
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = w[64 * c + 4 * lane + i];
            if (Bits == 4) {
              dot += (byte & 0x0F) * xq[4 * c + i] + (byte >> 4) * xq[16 + 4 * c + i];
            } else {
              dot += byte * xq[4 * c + i];
            }
          }
        }
        const float d = static_cast<float>(scales[lane]), m = static_cast<float>(scales[kBlock + lane]);
        out[r][lane] += static_cast<float>(dot) * (d * x.sx[at]) + m * x.xsum[at];
      }
    }
  }
}
#endif

// Rows is a template argument so the accumulators live in registers.
using BlockFn = void (*)(const uint8_t*, const at::Half*, const Q8View&, float (*)[kBlock]);
template <int Bits>
constexpr BlockFn kBlockDots[kMaxRows] = {
    block_dots<Bits, 1>, block_dots<Bits, 2>, block_dots<Bits, 3>, block_dots<Bits, 4>,
    block_dots<Bits, 5>, block_dots<Bits, 6>, block_dots<Bits, 7>, block_dots<Bits, 8>};

// One thread's share of a call must be worth waking it. On the AMD EPYC Zen 4 one thread
// streamed SmolLM2's int4 q/k/v and o projections (up to 384 KiB) as fast as two; on the Xeon
// with AMX one core reads about half the memory's speed, and splitting from 64 KiB on made
// an int4 step's linears about 5% faster there (not measured again on the Zen 4).
constexpr int64_t kMinTaskBytes = 64 * 1024;

// Every block of 16 outputs, or with a gate each gate block with the up block ``half`` on;
// ``dots`` holds block_dots for 1..kMaxRows rows.
template <typename T>
void quant_blocks(const BlockFn* dots, const uint8_t* pp, const at::Half* sp, int64_t block_bytes,
                  int64_t block_scales, const Q8Rows& q8, int64_t blocks, const canteen::Finish<T>& fin) {
  const int64_t rows = q8.rows, half = fin.inner > 0 ? blocks / 2 : 0, units = half ? half : blocks;
  const int64_t unit_bytes = block_bytes * (half ? 2 : 1);
  const int64_t grain = std::max<int64_t>(half ? 2 : 4, kMinTaskBytes / std::max<int64_t>(unit_bytes, 1));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum_rows(rows * kBlock), up_rows(half ? rows * kBlock : 0);
    auto* sums = reinterpret_cast<float (*)[kBlock]>(sum_rows.data());
    auto* ups = reinterpret_cast<float (*)[kBlock]>(up_rows.data());
    auto pass = [&](int64_t blk, float (*into)[kBlock]) {  // every row, eight at a time
      for (int64_t first = 0; first < rows; first += kMaxRows) {
        const int64_t n = std::min(kMaxRows, rows - first);
        dots[n - 1](pp + blk * block_bytes, sp + blk * block_scales, Q8View(q8, first), into + first);
      }
    };
    for (int64_t blk = begin; blk < end; ++blk) {
      pass(blk, sums);
      if (half) {
        pass(half + blk, ups);
        for (int64_t r = 0; r < rows; ++r) fin.gate(r, blk * kBlock, sums[r], ups[r]);
      } else {
        for (int64_t r = 0; r < rows; ++r) fin.store(r, blk * kBlock, sums[r]);
      }
    }
  });
}

// x [M, K] @ the weight [N, K]^T (+ bias): packed [ceil(N / 16), K / 32, 256 or 512]
// uint8 (4 or 8 bits), scales [ceil(N / 16), K / 32, 2, 16] float16; finished plainly, onto
// ``residual`` [M, N], or through the SiLU gate (common.h, Finish).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        int64_t n, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, bool gate) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x [M, K]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(k % kGroup == 0, "quant_linear: K a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(0) == blocks &&
                  packed.size(1) == k / kGroup && (packed.size(2) == 256 || packed.size(2) == 512),
              "quant_linear: packed uint8 [ceil(N / 16), K / 32, 256 (4 bits) or 512 (8 bits)]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf &&
                  scales.sizes() == at::IntArrayRef({blocks, k / kGroup, 2, kBlock}),
              "quant_linear: scales float16 [ceil(N / 16), K / 32, 2, 16]");
  const auto xc = x.contiguous(), pc = packed.contiguous(), sc = scales.contiguous();
  Q8Rows q8;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "quant_linear", [&] {
    q8 = quantize_rows(xc.data_ptr<scalar_t>(), rows, k);
  });
  const auto b = canteen::padded_bias(bias, n, blocks * kBlock, "quant_linear");
  auto out = at::empty({rows, gate ? n / 2 : n}, xc.options());
  const int64_t block_bytes = pc.size(1) * pc.size(2), block_scales = sc.size(1) * 2 * kBlock;
  const BlockFn* dots = pc.size(2) == 256 ? kBlockDots<4> : kBlockDots<8>;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "quant_linear_out", [&] {
    using T = scalar_t;
    const T* res = canteen::residual_rows<T>(residual, xc, n, gate, "quant_linear");
    const auto fin = gate ? canteen::Finish<T>::gated(out.data_ptr<T>(), n, b.data())
                          : canteen::Finish<T>{out.data_ptr<T>(), n, b.data(), res};
    if (rows > 0) quant_blocks<T>(dots, pc.data_ptr<uint8_t>(), sc.data_ptr<at::Half>(), block_bytes, block_scales, q8, blocks, fin);
  });
  return out;
}

// Whether quant_linear runs vectorized on this build (AVX512-VNNI, or AVX2 with F16C and FMA).
bool quant_vectorized() { return kVectorized; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def("quant_vectorized() -> bool", &quant_vectorized);
  m.def(
      "quant_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, "
      "Tensor? residual=None, bool gate=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("quant_linear", &quant_linear); }

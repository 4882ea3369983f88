// canteen::lora_add: the LoRA deltas of a step's adapters on one linear's output, each
// adapter on its own rows only, added in place (worker/lora/slots.py, stack.cpp).
//
// For adapter g (rank r, scale s) and each of its rows x, with the linear's outputs in P
// parts side by side (q | k | v, gate | up, or one part) and A_g stacking the parts' A:
//
//   z          = T(T(A_g x) * T(s))                       [P r] (T: the activations' dtype)
//   y[part i] += B_gi z[i r, (i + 1) r)   as y = T(y + T(sum))   (part i's own B: no zeros)
//
// Every sum runs as skinny_linear's (dense.cpp, dense_float.cpp) along K in order: bfloat16
// pair by pair with vdpbf16ps (plain float32 products without AVX512-BF16), float32 with one
// fused multiply-add per k. So the bits are those of skinny_linear(A) * s, then
// skinny_linear(B, residual=y) on the block-diagonal B; and a row's bits depend on its own
// input and its adapter only, never on how many rows share the adapter or which adapters
// sit beside it. All of it is one call: no gathers, scatters or temporaries as tensors.
//
// Weights, per adapter: A's lanes (pack_lanes of [P r, in]; empty: the adapter lacks this
// linear), then each part's B lanes (pack_lanes of [out_i, r]; empty: it lacks that part).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace canteen {
namespace {

constexpr int64_t kLanes = 16;
constexpr int kTileRows = 8;   // rows of one register tile
// Below this many weight words a call's rows meet, one thread: a fork and join costs more.
constexpr int64_t kParallelWords = 1 << 16;
constexpr int kMostBlocks = 3; // blocks of 16 outputs a tile takes at once (24 sums: 8 rows x 3)
// Lanes (64 bytes each) each weight stream is fetched ahead: a step's few rows do too little
// work per lane for the hardware prefetcher alone to keep the loads from waiting on memory.
constexpr int64_t kAhead = 64;

// How a lane holds x's values: a pair of bfloat16 in 32 bits, or one float32.
template <typename T>
struct Words;
template <>
struct Words<at::BFloat16> {
  using W = uint32_t;
  static constexpr int64_t per = 2;
};
template <>
struct Words<float> {
  using W = float;
  static constexpr int64_t per = 1;
};

// Rows rows of x (``steps`` words apart) against Blocks blocks of lanes (``block`` words
// apart): out[(r * Blocks + b) * 16 + l], each sum along K in order (see the top).
template <typename T, int Rows, int Blocks>
void sums(const typename Words<T>::W* x, int64_t stride, int64_t steps, const typename Words<T>::W* w,
          int64_t block, float* out) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    __m512 acc[Rows][Blocks];
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < steps; ++p) {
      __m512bh wv[Blocks];
      for (int b = 0; b < Blocks; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(w + b * block + (p + kAhead) * kLanes), _MM_HINT_T0);
        wv[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + b * block + p * kLanes));
      }
      for (int r = 0; r < Rows; ++r) {
        const auto xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * stride + p])));
        for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + (r * Blocks + b) * kLanes, acc[r][b]);
#else
    auto low = [](uint32_t v) { return static_cast<float>(at::BFloat16(static_cast<uint16_t>(v), at::BFloat16::from_bits())); };
    auto high = [](uint32_t v) { return static_cast<float>(at::BFloat16(static_cast<uint16_t>(v >> 16), at::BFloat16::from_bits())); };
    float acc[Rows][Blocks][kLanes] = {};
    for (int64_t p = 0; p < steps; ++p)
      for (int r = 0; r < Rows; ++r) {
        const float x0 = low(x[r * stride + p]), x1 = high(x[r * stride + p]);
        for (int b = 0; b < Blocks; ++b) {
          const uint32_t* wp = w + b * block + p * kLanes;
          for (int l = 0; l < kLanes; ++l) acc[r][b][l] += x0 * low(wp[l]) + x1 * high(wp[l]);
        }
      }
    std::memcpy(out, acc, sizeof(acc));
#endif
  } else {
#if defined(__AVX512F__)
    __m512 acc[Rows][Blocks];
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < steps; ++k) {
      __m512 wv[Blocks];
      for (int b = 0; b < Blocks; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(w + b * block + (k + kAhead) * kLanes), _MM_HINT_T0);
        wv[b] = _mm512_loadu_ps(w + b * block + k * kLanes);
      }
      for (int r = 0; r < Rows; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * stride + k]);
        for (int b = 0; b < Blocks; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int b = 0; b < Blocks; ++b) _mm512_storeu_ps(out + (r * Blocks + b) * kLanes, acc[r][b]);
#else
    float acc[Rows][Blocks][kLanes] = {};
    for (int64_t k = 0; k < steps; ++k)
      for (int r = 0; r < Rows; ++r)
        for (int b = 0; b < Blocks; ++b)
          for (int l = 0; l < kLanes; ++l) acc[r][b][l] = std::fma(x[r * stride + k], w[b * block + k * kLanes + l], acc[r][b][l]);
    std::memcpy(out, acc, sizeof(acc));
#endif
  }
}

template <typename T>
using SumFn = void (*)(const typename Words<T>::W*, int64_t, int64_t, const typename Words<T>::W*, int64_t, float*);
template <typename T, int Blocks, int... R>
constexpr std::array<SumFn<T>, sizeof...(R)> sums_for(std::integer_sequence<int, R...>) {
  return {sums<T, R + 1, Blocks>...};
}
// kSums<T>[blocks - 1][rows - 1]
template <typename T>
constexpr std::array<std::array<SumFn<T>, kTileRows>, kMostBlocks> kSums = {
    sums_for<T, 1>(std::make_integer_sequence<int, kTileRows>{}),
    sums_for<T, 2>(std::make_integer_sequence<int, kTileRows>{}),
    sums_for<T, 3>(std::make_integer_sequence<int, kTileRows>{}),
};

// Sums of ``rows`` rows (``stride`` words apart, ``steps`` words each) against ``count``
// blocks, a register tile of rows at a time: out[(r * count + b) * 16 + l].
template <typename T>
void tile_sums(const typename Words<T>::W* x, int64_t rows, int64_t stride, int64_t steps,
               const typename Words<T>::W* w, int64_t block, int count, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, rows - r0);
    kSums<T>[count - 1][n - 1](x + r0 * stride, stride, steps, w, block, out + r0 * count * kLanes);
  }
}

// One unit of work: an adapter's rows against up to kMostBlocks blocks of one weight.
struct Task {
  int64_t adapter, part, block, count;  // part -1: A
};

template <typename T>
struct Step {
  using W = typename Words<T>::W;
  const at::Tensor* weights;
  int64_t parts;
  const int64_t* part_sizes;
  std::vector<int64_t> first;      // per adapter: its first row in the packed buffers
  std::vector<int64_t> counts, ranks, offsets;  // offsets: each part's first output
  int64_t total = 0;                              // rows of every adapter
  std::vector<float> scales;       // T(scale), as a float
  int64_t in_steps = 0, z_width = 0, z_steps = 0;
  std::vector<W> xs;               // rows' inputs as words, adapter after adapter
  std::vector<float> zf;           // rows' A sums [rows, z_width]
  std::vector<W> zs;               // rows' scaled z as words, [parts, rows, z_steps]

  const at::Tensor& a(int64_t g) const { return weights[g * (1 + parts)]; }
  const at::Tensor& b(int64_t g, int64_t i) const { return weights[g * (1 + parts) + 1 + i]; }
};

template <typename T>
void run_a(Step<T>& s, const Task& t) {
  const int64_t rows = s.counts[t.adapter], at = s.first[t.adapter];
  const auto* w = reinterpret_cast<const typename Words<T>::W*>(s.a(t.adapter).data_ptr()) + t.block * s.in_steps * kLanes;
  float out[kTileRows * kMostBlocks * kLanes];
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, rows - r0);
    tile_sums<T>(s.xs.data() + (at + r0) * s.in_steps, n, s.in_steps, s.in_steps, w, s.in_steps * kLanes,
                 static_cast<int>(t.count), out);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < t.count; ++b)  // as Finish::store with a zero bias
        std::memcpy(s.zf.data() + (at + r0 + r) * s.z_width + (t.block + b) * kLanes,
                    out + (r * t.count + b) * kLanes, kLanes * sizeof(float));
  }
}

// dst[i] = T(dst[i] + T(sum[i])), i < count <= 16: as Finish::store with a zero bias and
// the residual dst (common.h), 16 at a time where the vector units have it.
inline void add_sums(at::BFloat16* dst, const float* sum, int64_t count) {
#if defined(__AVX512BF16__)
  if (count == kLanes) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sum), _mm512_setzero_ps());
    const __m512 total = _mm512_add_ps(bf16_load16(dst), bf16_widen16(bf16_round16(v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_round16(total));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i)
    dst[i] = static_cast<at::BFloat16>(static_cast<float>(dst[i]) + static_cast<float>(static_cast<at::BFloat16>(sum[i] + 0.f)));
}

inline void add_sums(float* dst, const float* sum, int64_t count) {
#if defined(__AVX512F__)
  if (count == kLanes) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sum), _mm512_setzero_ps());
    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), v));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = dst[i] + (sum[i] + 0.f);
}

// dst[i] = T(sum[i] + 0), i < count <= 16: T(-0.0 + T(sum)), add_sums' bits onto lora_deltas'
// -0.0 (x + -0.0 is x, and sum + 0 is never -0.0), without reading dst.
inline void store_sums(at::BFloat16* dst, const float* sum, int64_t count) {
#if defined(__AVX512BF16__)
  if (count == kLanes) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sum), _mm512_setzero_ps());
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16_round16(v));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<at::BFloat16>(sum[i] + 0.f);
}

inline void store_sums(float* dst, const float* sum, int64_t count) {
  for (int64_t i = 0; i < count; ++i) dst[i] = sum[i] + 0.f;
}

// rows_of: each listed row's output row in y, the deltas added; nullptr: y holds the listed
// rows in order (lora_deltas), the deltas stored.
template <typename T>
void run_b(Step<T>& s, const Task& t, T* y, const int64_t* rows_of, int64_t n_out) {
  const int64_t rows = s.counts[t.adapter], at = s.first[t.adapter], size = s.part_sizes[t.part];
  const int64_t offset = s.offsets[t.part];
  const int64_t steps = s.b(t.adapter, t.part).size(1);  // ceil(rank / words' values)
  const auto* w = reinterpret_cast<const typename Words<T>::W*>(s.b(t.adapter, t.part).data_ptr()) + t.block * steps * kLanes;
  float out[kTileRows * kMostBlocks * kLanes];
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, rows - r0);
    const auto* z = s.zs.data() + (t.part * s.total + at + r0) * s.z_steps;
    tile_sums<T>(z, n, s.z_steps, steps, w, steps * kLanes, static_cast<int>(t.count), out);
    for (int64_t r = 0; r < n; ++r) {
      T* dst = y + (rows_of ? rows_of[at + r0 + r] : at + r0 + r) * n_out + offset;
      for (int64_t b = 0; b < t.count; ++b) {
        const int64_t j = (t.block + b) * kLanes;
        const float* sum = out + (r * t.count + b) * kLanes;
        const int64_t count = std::min<int64_t>(kLanes, size - j);
        rows_of ? add_sums(dst + j, sum, count) : store_sums(dst + j, sum, count);
      }
    }
  }
}

// out[i] = T(T(sum[i]) * scale), i < count <= 16: Finish::store with a zero bias, then
// torch's multiply by the scale in T.
inline void scale16(at::BFloat16* out, const float* sum, float scale, int64_t count) {
#if defined(__AVX512BF16__)
  alignas(64) float in[kLanes] = {};
  std::memcpy(in, sum, count * sizeof(float));
  const __m512 z = bf16_widen16(bf16_round16(_mm512_add_ps(_mm512_load_ps(in), _mm512_setzero_ps())));
  alignas(32) at::BFloat16 done[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(done), bf16_round16(_mm512_mul_ps(z, _mm512_set1_ps(scale))));
  std::memcpy(out, done, count * sizeof(at::BFloat16));
#else
  for (int64_t i = 0; i < count; ++i)
    out[i] = static_cast<at::BFloat16>(static_cast<float>(static_cast<at::BFloat16>(sum[i] + 0.f)) * scale);
#endif
}

inline void scale16(float* out, const float* sum, float scale, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = (sum[i] + 0.f) * scale;
}

// The rows' scaled z, from their A sums: z = T(T(sum) * T(scale)), then as words per part.
template <typename T>
void scale_z(Step<T>& s, int64_t g) {
  using W = typename Words<T>::W;
  std::vector<T> part(s.z_steps * Words<T>::per);
  for (int64_t r = s.first[g]; r < s.first[g] + s.counts[g]; ++r)
    for (int64_t i = 0; i < s.parts; ++i) {
      std::fill(part.begin(), part.end(), static_cast<T>(0.f));
      const float* sum = s.zf.data() + r * s.z_width + i * s.ranks[g];
      for (int64_t j = 0; j < s.ranks[g]; j += kLanes)
        scale16(part.data() + j, sum + j, s.scales[g], std::min<int64_t>(kLanes, s.ranks[g] - j));
      std::memcpy(s.zs.data() + (i * s.total + r) * s.z_steps, part.data(), s.z_steps * sizeof(W));
    }
}

// Tasks for A (part -1) or for the parts' B: blocks of each adapter's weights, by three.
template <typename T>
std::vector<Task> tasks(const Step<T>& s, bool for_a) {
  std::vector<Task> out;
  for (int64_t g = 0; g < static_cast<int64_t>(s.counts.size()); ++g) {
    if (!s.counts[g] || !s.a(g).numel()) continue;
    for (int64_t i = for_a ? -1 : 0; i < (for_a ? 0 : s.parts); ++i) {
      const at::Tensor& w = i < 0 ? s.a(g) : s.b(g, i);
      for (int64_t blk = 0; blk < (w.numel() ? w.size(0) : 0); blk += kMostBlocks)
        out.push_back({g, i, blk, std::min<int64_t>(kMostBlocks, w.size(0) - blk)});
    }
  }
  return out;
}

// Every A task, then the scaled z, then every B task, in one parallel region (one fork and
// join a call: a step makes four calls a layer) where the work is worth a second thread.
template <typename T>
void run_all(Step<T>& s, T* y, const int64_t* rows_of, int64_t n_out) {
  const std::vector<Task> a_tasks = tasks(s, true), b_tasks = tasks(s, false);
  const auto num_a = static_cast<int64_t>(a_tasks.size()), num_b = static_cast<int64_t>(b_tasks.size());
  const int64_t words = s.total * (s.in_steps * s.z_width + s.z_steps * n_out);
  const int threads = words < kParallelWords || at::in_parallel_region() ? 1 : at::get_num_threads();
  // where each adapter's A is one task (rank <= 16 over three parts), it scales its own z:
  // one wait between A and B a call, not two
  bool whole = true;
  for (const Task& t : a_tasks) whole = whole && t.block == 0 && t.count == s.a(t.adapter).size(0);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_a; ++t) {
      run_a(s, a_tasks[t]);
      if (whole) scale_z(s, a_tasks[t].adapter);
    }
    if (!whole) {
#pragma omp single
      for (int64_t g = 0; g < static_cast<int64_t>(s.counts.size()); ++g)
        if (s.counts[g] && s.a(g).numel()) scale_z(s, g);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_b; ++t) run_b(s, b_tasks[t], y, rows_of, n_out);
  }
}

template <typename T>
void add_deltas(at::Tensor& y, const at::Tensor& x, const int64_t* rows_of, at::IntArrayRef counts,
                const double* scales, at::IntArrayRef ranks, const at::Tensor* weights, at::IntArrayRef parts,
                bool packed) {
  using W = typename Words<T>::W;
  constexpr int64_t per = Words<T>::per;
  Step<T> s{weights, static_cast<int64_t>(parts.size()), parts.data()};
  const int64_t adapters = static_cast<int64_t>(counts.size()), k = x.size(1);
  int64_t total = 0, max_rank = 0;
  for (int64_t g = 0; g < adapters; ++g) {
    s.first.push_back(total);
    s.counts.push_back(counts[g]);
    s.ranks.push_back(ranks[g]);
    s.scales.push_back(static_cast<float>(static_cast<T>(static_cast<float>(scales[g]))));
    total += counts[g];
    if (s.a(g).numel()) {
      s.z_width = std::max(s.z_width, s.a(g).size(0) * kLanes);
      max_rank = std::max(max_rank, ranks[g]);
    }
  }
  for (int64_t i = 0, at = 0; i < s.parts; at += parts[i++]) s.offsets.push_back(at);
  s.total = total;
  s.in_steps = (k + per - 1) / per;
  s.z_steps = (max_rank + per - 1) / per;
  if (!total || !s.z_width) return;
  // the rows' inputs as words, zero-padded to whole words
  s.xs.assign(total * s.in_steps, W{});
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < total; ++r) std::memcpy(s.xs.data() + r * s.in_steps, xp + rows_of[r] * k, k * sizeof(T));
  s.zf.assign(total * s.z_width, 0.f);
  s.zs.assign(s.parts * total * s.z_steps, W{});
  run_all(s, y.data_ptr<T>(), packed ? nullptr : rows_of, y.size(1));
}

}  // namespace

void lora_add_into(at::Tensor& y, const at::Tensor& x, const int64_t* rows, at::IntArrayRef counts,
                   const double* scales, at::IntArrayRef ranks, const at::Tensor* weights, at::IntArrayRef parts,
                   bool packed) {
  int64_t sum = 0, total = 0;
  for (const int64_t p : parts) sum += p;
  for (const int64_t c : counts) total += c;
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && (packed ? y.size(0) == total : x.size(0) == y.size(0)) &&
                  x.is_contiguous() && y.is_contiguous() && x.scalar_type() == y.scalar_type() && y.size(1) == sum,
              "lora_add: x [T, in] and y [T, sum(parts)] ([rows, sum(parts)] packed), contiguous, one dtype");
  TORCH_CHECK(counts.size() == ranks.size(), "lora_add: one count and one rank per adapter");
  for (int64_t r = 0; r < total; ++r)
    TORCH_CHECK(rows[r] >= 0 && rows[r] < x.size(0), "lora_add: row ", rows[r], " outside x's ", x.size(0), " rows");
  const int64_t per = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  for (size_t g = 0; g < counts.size(); ++g) {
    const at::Tensor* w = weights + g * (1 + parts.size());
    for (size_t i = 0; i <= parts.size(); ++i) {
      if (!w[i].numel()) continue;
      // A [ceil(P r / 16), ceil(in / per), 16, per]; part i's B [ceil(out_i / 16), ceil(r / per), 16, per]
      const int64_t blocks = i ? (parts[i - 1] + kLanes - 1) / kLanes : w[i].size(0);
      const int64_t steps = i ? (ranks[g] + per - 1) / per : (x.size(1) + per - 1) / per;
      TORCH_CHECK(w[i].is_contiguous() && w[i].scalar_type() == x.scalar_type() &&
                      w[i].sizes() == at::IntArrayRef({blocks, steps, kLanes, per}) &&
                      (i || blocks * kLanes >= static_cast<int64_t>(parts.size()) * ranks[g]),
                  "lora_add: adapter ", g, " weight ", i, " is not pack_lanes' layout of A [P r, in] or ",
                  "B [out_i, r] in x's dtype");
    }
  }
  if (x.scalar_type() == at::kBFloat16)
    add_deltas<at::BFloat16>(y, x, rows, counts, scales, ranks, weights, parts, packed);
  else if (x.scalar_type() == at::kFloat)
    add_deltas<float>(y, x, rows, counts, scales, ranks, weights, parts, packed);
  else
    TORCH_CHECK(false, "lora_add: x bfloat16 or float32");
}

namespace {

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef counts,
              const at::Tensor& scales, at::IntArrayRef ranks, at::TensorList weights, at::IntArrayRef parts,
              bool packed = false) {
  int64_t total = 0;
  for (const int64_t c : counts) total += c;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == total,
              "lora_add: rows int64, every adapter's rows, adapter after adapter");
  TORCH_CHECK(scales.scalar_type() == at::kDouble && scales.numel() == static_cast<int64_t>(counts.size()),
              "lora_add: scales float64, one per adapter");
  TORCH_CHECK(weights.size() == counts.size() * (1 + parts.size()), "lora_add: A and each part's B per adapter");
  const auto sc = scales.contiguous();
  lora_add_into(y, x, rows.data_ptr<int64_t>(), counts, sc.data_ptr<double>(), ranks, weights.data(), parts,
                packed);
}

// The deltas alone, [rows, sum(parts)], listed row after listed row: T(delta), and -0.0
// (an exact no-op addend) where an adapter lacks a part. The addend a fused linear takes
// (skinny_linear's and quant_linear's ``addend``, with ``rows`` as ``addend_rows``).
at::Tensor lora_deltas(const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef counts, const at::Tensor& scales,
                       at::IntArrayRef ranks, at::TensorList weights, at::IntArrayRef parts) {
  int64_t sum = 0;
  for (const int64_t p : parts) sum += p;
  auto d = at::full({rows.numel(), sum}, -0.0, x.options());
  lora_add(d, x, rows, counts, scales, ranks, weights, parts, true);
  return d;
}

}  // namespace
}  // namespace canteen

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def(
      "lora_add(Tensor(a!) y, Tensor x, Tensor rows, int[] counts, Tensor scales, int[] ranks, "
      "Tensor[] weights, int[] parts) -> ()");
  m.def(
      "lora_deltas(Tensor x, Tensor rows, int[] counts, Tensor scales, int[] ranks, Tensor[] weights, "
      "int[] parts) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) {
  m.impl("lora_add", [](at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef counts,
                        const at::Tensor& scales, at::IntArrayRef ranks, at::TensorList weights,
                        at::IntArrayRef parts) { canteen::lora_add(y, x, rows, counts, scales, ranks, weights, parts); });
  m.impl("lora_deltas", &canteen::lora_deltas);
}

// canteen::paged_decode_into: attention of one new token per row over that row's paged KV
// slots, read in place from the pool (no per-layer gather copies, no float32 copies of the
// keys), written into the step's output rows: one op instead of about twenty.
//
// Float32 sums throughout. For bfloat16 pools on CPUs with AVX512-BF16 the scores are
// bfloat16 dot products of q and the keys as stored (exact products, float32 sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using canteen::dot;
using canteen::to_float;

// Per-thread scratch of decode_one, reused across calls (no allocation per row and head).
struct Scratch {
  std::vector<float> q, acc, scores, row, total;
  void size(int64_t group, int64_t dim, int64_t len) {
    q.resize(group * dim), acc.assign(group * dim, 0.f), scores.resize(group * len);
    row.resize(dim), total.resize(group);
  }
};

// Softmax numerators of each head's scores [group, len] in place; their sums into total.
inline void exp_scores(float* scores, int64_t group, int64_t len, float* total) {
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < len; ++j) s[j] -= top;
    canteen::exp_inplace(s, len);
    float sum = 0.f;
    for (int64_t j = 0; j < len; ++j) sum += s[j];
    total[h] = sum;
  }
}

#if defined(__AVX512F__)
using canteen::load16;

// decode_one for float32 or bfloat16 with D = 16 V: each key and value row is loaded once
// for the G heads, and each head's dot product stays in V vector registers.
template <typename T, int V>
void decode_one_vec(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t len,
                    int64_t group, float scale, T* out, Scratch& w) {
  constexpr int64_t dim = 16 * V;
  w.size(group, dim, len);
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < dim; ++d) w.q[h * dim + d] = static_cast<float>(q[h * dim + d]) * scale;
  for (int64_t j = 0; j < len; ++j) {
    __m512 k[V];
    for (int v = 0; v < V; ++v) k[v] = load16(keys + slots[j] * dim + 16 * v);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = w.q.data() + h * dim;
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
      for (int v = 1; v < V; ++v) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), k[v], sum);
      w.scores[h * len + j] = _mm512_reduce_add_ps(sum);
    }
  }
  exp_scores(w.scores.data(), group, len, w.total.data());
  for (int64_t h = 0; h < group; ++h) {
    __m512 acc[V];
    for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    const float* p = w.scores.data() + h * len;
    for (int64_t j = 0; j < len; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int v = 0; v < V; ++v)
        acc[v] = _mm512_fmadd_ps(pj, load16(values + slots[j] * dim + 16 * v), acc[v]);
    }
    const __m512 inv = _mm512_set1_ps(w.total[h]);
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(w.acc.data() + h * dim + 16 * v, _mm512_div_ps(acc[v], inv));
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(w.acc[h * dim + d]);
  }
}
#endif

#if defined(__AVX512BF16__)
// out lane i = the sum of v[i]'s 16 lanes, for 16 vectors: a transpose tree of 15 adds where
// 16 horizontal sums would take 64 shuffles and adds. v is overwritten.
inline __m512 lane_sums(__m512* v) {
  for (int i = 0; i < 8; ++i)  // halves: [v2i's 8 partial sums | v2i+1's]
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: v4i..v4i+3, 4 partial sums each
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // quarter q: [v(q) x2, v(q + 4) x2] from 8i on
    const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // quarter q: [v(q), v(q + 4), v(q + 8), v(q + 12)]; then back into order
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// The cache lines of a key or value row a later position reads (its block may be anywhere).
inline void prefetch_row(const at::BFloat16* row, int64_t dim) {
  for (int64_t b = 0; b < dim * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// exp_scores with the max and the sum in vector registers (another summation order).
inline void exp_scores_vec(float* scores, int64_t group, int64_t len, float* total) {
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * len;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = static_cast<__mmask16>(len - j >= 16 ? 0xFFFF : (1u << (len - j)) - 1);
      top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = static_cast<__mmask16>(len - j >= 16 ? 0xFFFF : (1u << (len - j)) - 1);
      const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t));
      _mm512_mask_storeu_ps(s + j, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    total[h] = _mm512_reduce_add_ps(sum);
  }
}

// decode_one for bfloat16 with D = 32 P: the scores are bfloat16 dot products (vdpbf16ps:
// exact products, float32 sums) of q and each key as stored, 16 positions at a time; the
// values are loaded once for all G heads, whose sums stay in registers (up to 16 / P at a
// time). About a third of decode_one_vec's instructions.
template <int P>
void decode_one_bf16(const at::BFloat16* q, const at::BFloat16* keys, const at::BFloat16* values,
                     const int64_t* slots, int64_t len, int64_t group, float scale, at::BFloat16* out,
                     Scratch& w) {
  constexpr int64_t dim = 32 * P;
  w.size(group, dim, len);
  for (int64_t h = 0; h < group; ++h) {
    __m512bh qv[P];
    for (int p = 0; p < P; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(q + h * dim + 32 * p);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - j0);
      __m512 acc[16];
      for (int64_t i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i >= n) continue;
        const at::BFloat16* k = keys + slots[j0 + i] * dim;
        if (j0 + 16 + i < len) prefetch_row(keys + slots[j0 + 16 + i] * dim, dim);
        for (int p = 0; p < P; ++p)
          acc[i] = _mm512_dpbf16_ps(acc[i], qv[p], (__m512bh)_mm512_loadu_si512(k + 32 * p));
      }
      const __m512 sums = _mm512_mul_ps(lane_sums(acc), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(w.scores.data() + h * len + j0, static_cast<__mmask16>((1u << n) - 1), sums);
    }
  }
  exp_scores_vec(w.scores.data(), group, len, w.total.data());
  constexpr int kAtOnce = 8 / P > 0 ? 8 / P : 1;  // heads whose sums share the registers
  for (int64_t h0 = 0; h0 < group; h0 += kAtOnce) {
    const int64_t heads = std::min<int64_t>(kAtOnce, group - h0);
    __m512 acc[kAtOnce][2 * P];
    for (int h = 0; h < kAtOnce; ++h)
      for (int v = 0; v < 2 * P; ++v) acc[h][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      __m512 row[2 * P];
      for (int v = 0; v < 2 * P; ++v) row[v] = load16(values + slots[j] * dim + 16 * v);
      if (j + 8 < len) prefetch_row(values + slots[j + 8] * dim, dim);
#pragma GCC unroll 8
      for (int h = 0; h < kAtOnce; ++h) {
        if (h >= heads) break;
        const __m512 pj = _mm512_set1_ps(w.scores[(h0 + h) * len + j]);
        for (int v = 0; v < 2 * P; ++v) acc[h][v] = _mm512_fmadd_ps(pj, row[v], acc[h][v]);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const __m512 total = _mm512_set1_ps(w.total[h0 + h]);
      at::BFloat16* o = out + (h0 + h) * dim;
      for (int v = 0; v < 2 * P; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * v),
                            canteen::bf16_round16(_mm512_div_ps(acc[h][v], total)));
    }
  }
}
#endif

// One (row, kv head): the G query heads that share it, over the row's first `len` slots.
template <typename T>
void decode_one(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t len,
                int64_t group, int64_t dim, float scale, T* out) {
  thread_local Scratch w;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    switch (dim) {
      case 64: return decode_one_bf16<2>(q, keys, values, slots, len, group, scale, out, w);
      case 128: return decode_one_bf16<4>(q, keys, values, slots, len, group, scale, out, w);
      case 32: return decode_one_bf16<1>(q, keys, values, slots, len, group, scale, out, w);
      default: break;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    switch (dim) {
      case 64: return decode_one_vec<T, 4>(q, keys, values, slots, len, group, scale, out, w);
      case 128: return decode_one_vec<T, 8>(q, keys, values, slots, len, group, scale, out, w);
      case 32: return decode_one_vec<T, 2>(q, keys, values, slots, len, group, scale, out, w);
      case 16: return decode_one_vec<T, 1>(q, keys, values, slots, len, group, scale, out, w);
      default: break;
    }
  }
#endif
  w.size(group, dim, len);
  float* qf = w.q.data();
  for (int64_t h = 0; h < group; ++h) {
    to_float(q + h * dim, qf + h * dim, dim);
    for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] *= scale;
  }
  for (int64_t j = 0; j < len; ++j) {
    to_float(keys + slots[j] * dim, w.row.data(), dim);
    for (int64_t h = 0; h < group; ++h) w.scores[h * len + j] = dot(qf + h * dim, w.row.data(), dim);
  }
  exp_scores(w.scores.data(), group, len, w.total.data());
  for (int64_t j = 0; j < len; ++j) {
    to_float(values + slots[j] * dim, w.row.data(), dim);
    for (int64_t h = 0; h < group; ++h) {
      const float p = w.scores[h * len + j];
      float* a = w.acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * w.row[d];
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(w.acc[h * dim + d] / w.total[h]);
}

// Contiguous ranges of the (row, kv head) tasks, one per part (thread), of about equal work: a
// task costs its row's keys plus a fixed share (kTaskKeys). A step mixes decode rows over ~100
// keys with a prompt chunk's rows over ~2,000, and a prefill's rows attend over 1, 2, ..., n
// keys: ranges of equal task counts would leave one thread with most of the keys while the
// other waits at the region's end. Which thread computes a row never changes its bits.
constexpr int64_t kTaskKeys = 16;
std::vector<int64_t> balanced_cuts(const int64_t* lens, int64_t batch, int64_t kv_heads, int64_t parts) {
  const int64_t tasks = batch * kv_heads;
  std::vector<int64_t> cuts(parts + 1, tasks);
  cuts[0] = 0;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += (lens[b] + kTaskKeys) * kv_heads;
  int64_t done = 0, part = 1;
  for (int64_t t = 0; t < tasks && part < parts; ++t) {
    const int64_t cost = lens[t / kv_heads] + kTaskKeys;
    // cut before t where that leaves this part nearer its share than taking t would
    while (part < parts && 2 * (done + cost) * parts > (2 * part * total + cost * parts)) {
      cuts[part++] = t;
    }
    done += cost;
  }
  for (int64_t p = 1; p <= parts; ++p) cuts[p] = std::max(cuts[p], cuts[p - 1]);
  return cuts;
}

// Attention of rows[b] for b < B, each one query over the first lens[b] slots of its slot
// table, written into out[rows[b]]: q [T, heads, D] (the step's queries), pool [2, kv_heads,
// slots, D] (one layer), slots [S, W], lens [B] <= W, and tables [B] (row b reads slot table
// tables[b]; without it, table b). A decode row has a table of its own; the rows of a
// prefill chunk share their sequence's one. Every row goes through decode_one, whatever
// it is: a query's softmax and weighted sum reduce over its keys in position order, so its
// output is the same bits in a decode step, in a prefill chunk, after a preemption or
// behind a prefix-cache hit.
void paged_decode_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& pool,
                       const at::Tensor& slots, const at::Tensor& lens, const at::Tensor& rows,
                       double scale, const c10::optional<at::Tensor>& tables) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 4 && slots.dim() == 2 && lens.dim() == 1 &&
                  rows.dim() == 1 && out.dim() == 2,
              "paged_decode: out [T, H * D], q [T, H, D], pool [2, KVH, S, D], slots [S, W], "
              "lens [B], rows [B]");
  TORCH_CHECK(pool.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_decode: q, pool and out dtypes differ");
  TORCH_CHECK(pool.is_contiguous() && q.is_contiguous() && out.is_contiguous() &&
                  slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "paged_decode: contiguous q, pool and out, int64 slots, lens and rows");
  const auto sc = slots.contiguous();
  const auto lc = lens.contiguous();
  const auto rc = rows.contiguous();
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = pool.size(1), num_slots = pool.size(2), width = sc.size(1);
  const int64_t batch = lc.size(0), num_tables = sc.size(0);
  TORCH_CHECK(pool.size(3) == dim && heads % kv_heads == 0 && rc.size(0) == batch &&
                  out.size(0) == tokens && out.size(1) == heads * dim,
              "paged_decode: shapes disagree");
  at::Tensor tc;
  if (tables.has_value() && tables->defined()) {
    TORCH_CHECK(tables->dim() == 1 && tables->size(0) == batch && tables->scalar_type() == at::kLong,
                "paged_decode: tables int64 [B]");
    tc = tables->contiguous();
  } else {
    TORCH_CHECK(num_tables == batch, "paged_decode: slots [B, W] without tables");
  }
  const int64_t group = heads / kv_heads;
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  const int64_t* len_ptr = lc.data_ptr<int64_t>();
  const int64_t* row_ptr = rc.data_ptr<int64_t>();
  const int64_t* table_ptr = tc.defined() ? tc.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> used(num_tables, 0);  // the most slots any row reads of each table
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= width, "paged_decode: lens out of range");
    TORCH_CHECK(row_ptr[b] >= 0 && row_ptr[b] < tokens, "paged_decode: rows out of range");
    TORCH_CHECK(!table_ptr || (table_ptr[b] >= 0 && table_ptr[b] < num_tables),
                "paged_decode: tables out of range");
    int64_t& most = used[table_ptr ? table_ptr[b] : b];
    most = std::max(most, len_ptr[b]);
  }
  for (int64_t t = 0; t < num_tables; ++t)
    for (int64_t j = 0; j < used[t]; ++j)
      TORCH_CHECK(slot_ptr[t * width + j] >= 0 && slot_ptr[t * width + j] < num_slots,
                  "paged_decode: slots out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = pool.data_ptr<scalar_t>();
    const scalar_t* vp = kp + kv_heads * num_slots * dim;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t parts = std::max<int64_t>(std::min<int64_t>(at::get_num_threads(), batch * kv_heads), 1);
    const auto cuts = balanced_cuts(len_ptr, batch, kv_heads, parts);
    at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = cuts[first]; task < cuts[last]; ++task) {
        const int64_t b = task / kv_heads, g = task % kv_heads;
        const int64_t table = table_ptr ? table_ptr[b] : b;
        const int64_t at_q = (row_ptr[b] * heads + g * group) * dim;
        decode_one<scalar_t>(qp + at_q, kp + g * num_slots * dim, vp + g * num_slots * dim,
                             slot_ptr + table * width, len_ptr[b], group, dim,
                             static_cast<float>(scale), op + at_q);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def(
      "paged_decode_into(Tensor(a!) out, Tensor q, Tensor pool, Tensor slots, Tensor lens, "
      "Tensor rows, float scale, Tensor? tables=None) -> ()");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("paged_decode_into", &paged_decode_into); }

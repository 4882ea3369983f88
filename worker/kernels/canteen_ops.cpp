// Canteen's CPU kernels: the decode-step work that torch only offers as many small ops.
//
//   canteen::paged_decode_into  attention of one new token per row over that row's paged
//                               KV slots, read in place from the pool (no per-layer gather
//                               copies, no float32 copies of the keys), written into the
//                               step's output rows: one op instead of about twenty
//   canteen::rms_norm           transformers' RMSNorm in one pass (eight ops there)
//   canteen::silu_mul           the MLP's gate, silu(gate) * up, in one pass
//   canteen::rotary             rotary on q or k straight out of the fused QKV output
//   canteen::rotary_kv          rotary on q and k, and k and v written into the paged pool,
//                               in one pass over a decode step's QKV output
//
// dense.cpp adds canteen::skinny_linear (bfloat16 x @ w^T for a few rows, near read
// bandwidth), lowbit.cpp canteen::quant_linear (4- and 8-bit weights, int8 activations).
//
// All of them compute in float32 and round where the ops they replace round.
// worker/kernels/__init__.py builds the kernels with the machine's own compiler and loads it;
// without it the worker keeps its pure-torch path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
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
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

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

// Decode attention of rows[b] for b < B, written into out[rows[b]]: q [T, heads, D] (the
// step's queries), pool [2, kv_heads, slots, D] (one layer), slots [B, W], lens [B] <= W.
void paged_decode_into(at::Tensor& out, const at::Tensor& q, const at::Tensor& pool,
                       const at::Tensor& slots, const at::Tensor& lens, const at::Tensor& rows,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 4 && slots.dim() == 2 && lens.dim() == 1 &&
                  rows.dim() == 1 && out.dim() == 2,
              "paged_decode: out [T, H * D], q [T, H, D], pool [2, KVH, S, D], slots [B, W], "
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
  const int64_t batch = sc.size(0);
  TORCH_CHECK(pool.size(3) == dim && heads % kv_heads == 0 && lc.size(0) == batch &&
                  rc.size(0) == batch && out.size(0) == tokens && out.size(1) == heads * dim,
              "paged_decode: shapes disagree");
  const int64_t group = heads / kv_heads;
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  const int64_t* len_ptr = lc.data_ptr<int64_t>();
  const int64_t* row_ptr = rc.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= width, "paged_decode: lens out of range");
    TORCH_CHECK(row_ptr[b] >= 0 && row_ptr[b] < tokens, "paged_decode: rows out of range");
    for (int64_t j = 0; j < len_ptr[b]; ++j)
      TORCH_CHECK(slot_ptr[b * width + j] >= 0 && slot_ptr[b * width + j] < num_slots,
                  "paged_decode: slots out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = pool.data_ptr<scalar_t>();
    const scalar_t* vp = kp + kv_heads * num_slots * dim;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, g = task % kv_heads;
        const int64_t at_q = (row_ptr[b] * heads + g * group) * dim;
        decode_one<scalar_t>(qp + at_q, kp + g * num_slots * dim, vp + g * num_slots * dim,
                             slot_ptr + b * width, len_ptr[b], group, dim,
                             static_cast<float>(scale), op + at_q);
      }
    });
  });
}

// transformers' SiLU-gated MLP input: silu(x[:, :I]) * x[:, I:], each op rounded to x's
// dtype as torch rounds it. The exp is torch's own: SLEEF's where torch's silu runs
// vectorized, std::exp on the tail of a row it leaves to its scalar loop.
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x [T, 2 * I]");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), inner = xc.size(1) / 2;
  auto out = at::empty({rows, inner}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t vector_end = canteen::torch_vector_end<scalar_t>(inner);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> e(inner);  // exp(-gate)
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * inner;
        const scalar_t* up = gate + inner;
        for (int64_t i = 0; i < inner; ++i) e[i] = -static_cast<float>(gate[i]);
        canteen::exp_inplace(e.data(), vector_end);
        for (int64_t i = vector_end; i < inner; ++i) e[i] = std::exp(e[i]);
        for (int64_t i = 0; i < inner; ++i) {
          const auto act = static_cast<scalar_t>(static_cast<float>(gate[i]) / (1.f + e[i]));
          op[r * inner + i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// Rotary on the first `heads` heads of x [T, >= heads, D] (a view into the QKV output), as
// worker/model.py's _rotate: x * cos + swap_halves(x) * signed_sin, each op rounded like
// torch's; returns [T, heads, D].
// One head of rotary: o = x * cos + rotate_half(x) * sin, each product and the sum rounded to
// T as transformers' apply_rotary_pos_emb rounds them (sin carries rotate_half's signs).
template <typename T>
inline void rotate_head(const T* in, const T* cp, const T* sp, int64_t dim, T* o) {
  const int64_t half = dim / 2;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (half % 16 == 0 && dim % 2 == 0) {
      using canteen::bf16_load16, canteen::bf16_round16, canteen::bf16_widen16;
      const auto round = [](__m512 v) { return bf16_widen16(bf16_round16(v)); };
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 swapped = bf16_load16(in + (d < half ? d + half : d - half));
        const __m512 a = round(_mm512_mul_ps(bf16_load16(in + d), bf16_load16(cp + d)));
        const __m512 b = round(_mm512_mul_ps(swapped, bf16_load16(sp + d)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), bf16_round16(_mm512_add_ps(a, b)));
      }
      return;
    }
  }
#endif
  const auto one = [&](int64_t d, T swapped) {
    const auto a = static_cast<T>(static_cast<float>(in[d]) * static_cast<float>(cp[d]));
    const auto b = static_cast<T>(static_cast<float>(swapped) * static_cast<float>(sp[d]));
    o[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  };
  // two straight halves (the second half's partner is the first half's), so both vectorize
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) one(d, in[d + half]);
#pragma omp simd
  for (int64_t d = half; d < 2 * half; ++d) one(d, in[d - half]);
  if (dim % 2) one(dim - 1, in[dim - 1 - half]);
}

std::pair<at::Tensor, at::Tensor> rotary_tables(const at::Tensor& x, const at::Tensor& cos,
                                                const at::Tensor& signed_sin) {
  const int64_t tokens = x.size(0), dim = x.size(2);
  auto cc = cos.reshape({tokens, dim}).contiguous();
  auto sc = signed_sin.reshape({tokens, dim}).contiguous();
  TORCH_CHECK(cc.scalar_type() == x.scalar_type() && sc.scalar_type() == x.scalar_type(),
              "rotary: cos and sin in x's dtype");
  return {cc, sc};
}

at::Tensor rotary(const at::Tensor& x, int64_t heads, const at::Tensor& cos,
                  const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && heads <= x.size(1), "rotary: x [T, n, D]");
  const int64_t tokens = x.size(0), dim = x.size(2);
  const auto [cc, sc] = rotary_tables(x, cos, signed_sin);
  auto out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* cp = cc.data_ptr<T>();
    const T* sp = sc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_head(xp + t * s0 + h * s1, cp + t * dim, sp + t * dim, dim, op + (t * heads + h) * dim);
    });
  });
  return out;
}

// A decode step's QKV output [T, H + 2 KVH, D] in one pass: returns the queries rotated
// ([T, H, D]), and writes the rotated keys and the values into one layer's pool [2, KVH, S, D]
// at slot_mapping[t]; the values of rotary() and index_copy_, bit for bit.
at::Tensor rotary_kv(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                     const at::Tensor& signed_sin, at::Tensor& pool, const at::Tensor& slot_mapping) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(1) == heads + 2 * kv_heads,
              "rotary_kv: qkv [T, heads + 2 kv_heads, D], contiguous");
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.size(0) == 2 && pool.size(1) == kv_heads &&
                  pool.size(3) == qkv.size(2) && pool.scalar_type() == qkv.scalar_type(),
              "rotary_kv: pool [2, kv_heads, slots, D] in qkv's dtype, contiguous");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), slots = pool.size(2);
  const auto sm = slot_mapping.contiguous();
  TORCH_CHECK(sm.scalar_type() == at::kLong && sm.numel() == tokens, "rotary_kv: slot_mapping int64 [T]");
  const int64_t* slot = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "rotary_kv: slot ", slot[t], " out of range");
  const auto [cc, sc] = rotary_tables(qkv, cos, signed_sin);
  auto q = at::empty({tokens, heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_kv", [&] {
    using T = scalar_t;
    const T* xp = qkv.data_ptr<T>();
    const T* cp = cc.data_ptr<T>();
    const T* sp = sc.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* keys = pool.data_ptr<T>();
    T* values = keys + kv_heads * slots * dim;
    const int64_t width = (heads + 2 * kv_heads) * dim;
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* row = xp + t * width;
        for (int64_t h = 0; h < heads; ++h)
          rotate_head(row + h * dim, cp + t * dim, sp + t * dim, dim, qp + (t * heads + h) * dim);
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t off = (g * slots + slot[t]) * dim;
          rotate_head(row + (heads + g) * dim, cp + t * dim, sp + t * dim, dim, keys + off);
          std::memcpy(values + off, row + (heads + kv_heads + g) * dim, dim * sizeof(T));
        }
      }
    });
  });
  return q;
}

#if defined(__AVX512BF16__)
// rms_norm's rows [begin, end) for bfloat16 x and out, 16 features at a time (another order
// for the sum of squares; the same roundings).
void rms_rows_bf16(const at::BFloat16* x, const float* w, int64_t hidden, int64_t begin, int64_t end,
                   float eps, at::BFloat16* out) {
  using canteen::bf16_load16, canteen::bf16_round16, canteen::bf16_widen16;
  for (int64_t r = begin; r < end; ++r) {
    const at::BFloat16* row = x + r * hidden;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      const __m512 v = bf16_load16(row + i);
      squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));  // squares rounded, as torch's pow(2)
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / hidden + eps);
    const __m512 scale = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < hidden; i += 16) {
      // the normed value is rounded to x's dtype before the weight multiplies it
      const __m512 normed = bf16_widen16(bf16_round16(_mm512_mul_ps(bf16_load16(row + i), scale)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * hidden + i),
                          bf16_round16(_mm512_mul_ps(_mm512_loadu_ps(w + i), normed)));
    }
  }
}
#endif

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), float32 inside.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight [hidden]");
  TORCH_CHECK(weight.is_contiguous(), "rms_norm: contiguous weight");
  const auto xc = x.contiguous();
  const int64_t hidden = xc.size(-1), rows = xc.numel() / hidden;
  std::vector<float> wf(hidden);  // the weight in float32, without a tensor of its own
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm_w", [&] {
    to_float(weight.data_ptr<scalar_t>(), wf.data(), hidden);
  });
  auto out = at::empty(xc.sizes(), xc.options().dtype(at::promote_types(x.scalar_type(), weight.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "rms_norm_out", [&] {
      using o_t = scalar_t;
      const x_t* xp = xc.data_ptr<x_t>();
      o_t* op = out.data_ptr<o_t>();
      const float* wp = wf.data();
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<x_t, at::BFloat16> && std::is_same_v<o_t, at::BFloat16>) {
          if (hidden % 16 == 0)  // the casts are no-ops: x_t and o_t are bfloat16 here
            return rms_rows_bf16(reinterpret_cast<const at::BFloat16*>(xp), wp, hidden, begin, end,
                                 static_cast<float>(eps), reinterpret_cast<at::BFloat16*>(op));
        }
#endif
        std::vector<float> row(hidden);
        for (int64_t r = begin; r < end; ++r) {
          to_float(xp + r * hidden, row.data(), hidden);
          const float inv = 1.f / std::sqrt(dot(row.data(), row.data(), hidden) / hidden + static_cast<float>(eps));
          for (int64_t i = 0; i < hidden; ++i) {
            // the normed value is rounded to x's dtype before the weight multiplies it
            const float n = static_cast<float>(static_cast<x_t>(row[i] * inv));
            op[r * hidden + i] = static_cast<o_t>(wp[i] * n);
          }
        }
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(canteen, m) {
  m.def(
      "paged_decode_into(Tensor(a!) out, Tensor q, Tensor pool, Tensor slots, Tensor lens, "
      "Tensor rows, float scale) -> ()");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, int heads, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def(
      "rotary_kv(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor signed_sin, "
      "Tensor(a!) pool, Tensor slot_mapping) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) {
  m.impl("paged_decode_into", &paged_decode_into);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("rotary_kv", &rotary_kv);
  m.impl("rms_norm", &rms_norm);
}

// Canteen's CPU kernels: the decode-step work that torch only offers as many small ops.
//
//   canteen::paged_decode  attention of one new token per row over that row's paged KV
//                          slots, read in place from the pool (no per-layer gather copies,
//                          no float32 copies of the keys, one op instead of about twenty)
//   canteen::rms_norm      transformers' RMSNorm in one pass (it is eight ops there)
//
// Both accumulate in float32 like the ops they replace. worker/kernels/__init__.py builds
// this file with the machine's own compiler and loads it; without it the worker keeps its
// pure-torch path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (row, kv head): the G query heads that share it, over the row's first `len` slots.
template <typename T>
void decode_one(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t len,
                int64_t group, int64_t dim, float scale, T* out) {
  std::vector<float> qf(group * dim), row(dim), acc(group * dim, 0.f), scores(group * len);
  for (int64_t h = 0; h < group; ++h) {
    to_float(q + h * dim, qf.data() + h * dim, dim);
    for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] *= scale;
  }
  for (int64_t j = 0; j < len; ++j) {
    to_float(keys + slots[j] * dim, row.data(), dim);
    for (int64_t h = 0; h < group; ++h) scores[h * len + j] = dot(qf.data() + h * dim, row.data(), dim);
  }
  std::vector<float> total(group);
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores.data() + h * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) top = std::max(top, s[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - top);
      sum += s[j];
    }
    total[h] = sum;
  }
  for (int64_t j = 0; j < len; ++j) {
    to_float(values + slots[j] * dim, row.data(), dim);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * len + j];
      float* a = acc.data() + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<T>(acc[h * dim + d] / total[h]);
}

// q [B, heads, D]; pool [2, kv_heads, slots, D] (one layer); slots [B, W]; lens [B] <= W.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& slots,
                        const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 4 && slots.dim() == 2 && lens.dim() == 1,
              "paged_decode: q [B, H, D], pool [2, KVH, S, D], slots [B, W], lens [B]");
  TORCH_CHECK(pool.scalar_type() == q.scalar_type(), "paged_decode: q and pool dtypes differ");
  TORCH_CHECK(pool.is_contiguous() && slots.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong,
              "paged_decode: a contiguous pool and int64 slots and lens");
  const auto qc = q.contiguous();
  const auto sc = slots.contiguous();
  const auto lc = lens.contiguous();
  const int64_t rows = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t kv_heads = pool.size(1), num_slots = pool.size(2), width = sc.size(1);
  TORCH_CHECK(pool.size(3) == dim && heads % kv_heads == 0 && sc.size(0) == rows &&
                  lc.size(0) == rows,
              "paged_decode: shapes disagree");
  const int64_t group = heads / kv_heads;
  auto out = at::empty({rows, heads * dim}, qc.options());
  const int64_t* slot_ptr = sc.data_ptr<int64_t>();
  const int64_t* len_ptr = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= width, "paged_decode: lens out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = pool.data_ptr<scalar_t>();
    const scalar_t* vp = kp + kv_heads * num_slots * dim;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, g = task % kv_heads;
        const int64_t head = g * group;
        decode_one<scalar_t>(qp + (b * heads + head) * dim, kp + g * num_slots * dim,
                             vp + g * num_slots * dim, slot_ptr + b * width, len_ptr[b], group,
                             dim, static_cast<float>(scale), op + (b * heads + head) * dim);
      }
    });
  });
  return out;
}

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), float32 inside.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight [hidden]");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const int64_t hidden = xc.size(-1), rows = xc.numel() / hidden;
  auto out = at::empty(xc.sizes(), xc.options().dtype(at::promote_types(x.scalar_type(), weight.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "rms_norm_out", [&] {
      using o_t = scalar_t;
      const x_t* xp = xc.data_ptr<x_t>();
      o_t* op = out.data_ptr<o_t>();
      std::vector<float> wf(hidden);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "rms_norm_w", [&] {
        to_float(wc.data_ptr<scalar_t>(), wf.data(), hidden);
      });
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> row(hidden);
        for (int64_t r = begin; r < end; ++r) {
          to_float(xp + r * hidden, row.data(), hidden);
          const float inv = 1.f / std::sqrt(dot(row.data(), row.data(), hidden) / hidden + static_cast<float>(eps));
          for (int64_t i = 0; i < hidden; ++i) {
            // the normed value is rounded to x's dtype before the weight multiplies it
            const float n = static_cast<float>(static_cast<x_t>(row[i] * inv));
            op[r * hidden + i] = static_cast<o_t>(wf[i] * n);
          }
        }
      });
    });
  });
  return out;
}

// sum(x[i] * w[i]) over bfloat16 vectors, accumulated in float32 (what a oneDNN bfloat16
// matmul does; only the order of the sum differs).
inline float dot_bf16(const at::BFloat16* x, const at::BFloat16* w, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(x + i));
    const __m512i wv = _mm512_loadu_si512(reinterpret_cast<const void*>(w + i));
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(xv), reinterpret_cast<__m512bh>(wv));
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  float rest = 0.f;
#pragma omp simd reduction(+ : rest)
  for (int64_t j = i; j < n; ++j) rest += static_cast<float>(x[j]) * static_cast<float>(w[j]);
  return s + rest;
}

// x [M, K] @ w[N, K]^T (+ bias) for the few rows of a decode step: every weight is read once
// from its plain row-major layout while the M rows stay in cache.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "skinny_linear: bfloat16 x and w");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), n = wc.size(0);
  auto out = at::empty({rows, n}, xc.options());
  std::vector<float> b(n, 0.f);
  if (bias.has_value() && bias->defined()) {
    const auto bc = bias->to(at::kFloat).contiguous();
    std::memcpy(b.data(), bc.data_ptr<float>(), n * sizeof(float));
  }
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = wc.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t r = 0; r < rows; ++r)
        op[r * n + j] = static_cast<at::BFloat16>(dot_bf16(xp + r * k, wp + j * k, k) + b[j]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(canteen, m) {
  m.def("paged_decode(Tensor q, Tensor pool, Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("skinny_linear", &skinny_linear);
}

// Canteen's CPU kernels: the decode-step work that torch only offers as many small ops.
//
//   canteen::rms_norm           transformers' RMSNorm in one pass (eight ops there)
//   canteen::silu_mul           the MLP's gate, silu(gate) * up, in one pass
//   canteen::rotary             rotary on q or k straight out of the fused QKV output
//   canteen::rotary_kv          rotary on q and k, and k and v written into the paged pool,
//                               in one pass over a decode step's QKV output
//
// attention.cpp adds canteen::paged_decode_into (decode attention read in place from the
// paged pool), dense.cpp canteen::skinny_linear (bfloat16, or float32 through
// dense_float.cpp, x @ w^T for a few rows, near read bandwidth), lowbit.cpp
// canteen::quant_linear (4- and 8-bit weights as shipped, bfloat16 activations).
//
// All of them compute in float32 and round where the ops they replace round.
// worker/kernels/__init__.py builds the kernels with the machine's own compiler and loads it;
// without it the worker keeps its pure-torch path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <type_traits>
#include <vector>

namespace {

using canteen::dot;
using canteen::to_float;

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
// worker/model/forward.py's _rotate: x * cos + swap_halves(x) * signed_sin, each op rounded like
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
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, int heads, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def(
      "rotary_kv(Tensor qkv, int heads, int kv_heads, Tensor cos, Tensor signed_sin, "
      "Tensor(a!) pool, Tensor slot_mapping) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) {
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("rotary_kv", &rotary_kv);
  m.impl("rms_norm", &rms_norm);
}

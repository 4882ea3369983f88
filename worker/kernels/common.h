// Helpers shared by Canteen's CPU kernels (canteen_ops.cpp, attention.cpp, dense.cpp, lowbit.cpp,
// sampling.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// SLEEF's vectorized exp, the one torch's vectorized ops call (libtorch_cpu exports it).
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace canteen {

// Bytes in one of torch's CPU vectors here (its AVX512 or AVX2 kernels; 0: none).
#if defined(__AVX512F__)
constexpr int64_t kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int64_t kVecBytes = 32;
#else
constexpr int64_t kVecBytes = 0;
#endif

// exp of x[0, n) in place: SLEEF for whole vectors, std::exp for the rest.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_loadu_ps(x + i)));
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// How many leading elements of a contiguous run of n torch's elementwise kernels compute
// vectorized (two vectors of T at a time; the rest goes through the scalar function).
template <typename T>
constexpr int64_t torch_vector_end(int64_t n) {
  if (kVecBytes == 0) return 0;
  const int64_t step = 2 * kVecBytes / static_cast<int64_t>(sizeof(T));
  return n / step * step;
}

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

// 16 floats from float32 or bfloat16 (bfloat16 is float32's upper half).
#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// bfloat16 conversions of 16 floats at a time (round to nearest even, as c10::BFloat16).
#if defined(__AVX512BF16__)
inline __m256i bf16_round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 bf16_widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 bf16_load16(const at::BFloat16* p) {
  return bf16_widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// How a linear kernel (dense.cpp, lowbit.cpp) finishes a row's float32 sums. A plain linear
// stores T(sum + bias). The two ops that follow a decoder layer's linears can finish inside
// it instead, with the bits of the ops they replace:
//   residual  out = residual + T(sum + bias), as torch's ``x + linear(x)`` rounds it;
//   gate      the linear's outputs are [gate | up] (n = 2 x inner, inner a multiple of 16),
//             the kernel hands over the gate and up sums of the same 16 outputs together, and
//             out [rows, inner] = silu(gate) * up as canteen::silu_mul computes it.
// Either may take an addend first, on the rows that have one (a LoRA delta, lora.cpp): the
// linear's own output becomes T(T(sum + bias) + addend) before the residual or the gate, the
// bits of ``y += addend`` between the unfused linear and the op it feeds.
template <typename T>
struct Finish {
  T* out;
  int64_t n;              // the linear's outputs
  const float* bias;      // at least n, zero-padded
  const T* residual;      // [rows, n], or nullptr
  int64_t inner = 0;      // gate: n / 2; 0: no gate
  int64_t vector_end = 0; // gate: the leading outputs whose exp torch computes vectorized
  const T* const* addend = nullptr;  // per row: its n addends, or nullptr; nullptr: none

  static Finish gated(T* out, int64_t n, const float* bias) {
    return {out, n, bias, nullptr, n / 2, torch_vector_end<T>(n / 2)};
  }

  Finish with(const std::vector<const T*>& rows) const {
    Finish f = *this;
    f.addend = rows.empty() ? nullptr : rows.data();
    return f;
  }

  // Row r's sums of outputs [j, j + 16) (fewer where n ends).
  void store(int64_t r, int64_t j, const float* s) const {
    T* o = out + r * n + j;
    const T* res = residual ? residual + r * n + j : nullptr;
    const T* add = addend && addend[r] ? addend[r] + j : nullptr;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (j + 16 <= n) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(bias + j));
        if (add) v = _mm512_add_ps(bf16_widen16(bf16_round16(v)), bf16_load16(add));
        if (res) v = _mm512_add_ps(bf16_load16(res), bf16_widen16(bf16_round16(v)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_round16(v));
        return;
      }
    }
#endif
    for (int64_t i = 0; i < 16 && j + i < n; ++i) {
      T v = static_cast<T>(s[i] + bias[j + i]);
      if (add) v = static_cast<T>(static_cast<float>(v) + static_cast<float>(add[i]));
      o[i] = res ? static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(v)) : v;
    }
  }

  // Row r's gate sums ``g`` and up sums ``u`` of outputs [j, j + 16) of inner.
  void gate(int64_t r, int64_t j, const float* g, const float* u) const {
    T* o = out + r * inner + j;
    const T* add = addend && addend[r] ? addend[r] + j : nullptr;  // its gate; + inner: its up
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (j + 16 <= vector_end) {
        __m512 gv = bf16_widen16(bf16_round16(_mm512_add_ps(_mm512_loadu_ps(g), _mm512_loadu_ps(bias + j))));
        __m512 uv = bf16_widen16(bf16_round16(_mm512_add_ps(_mm512_loadu_ps(u), _mm512_loadu_ps(bias + inner + j))));
        if (add) {
          gv = bf16_widen16(bf16_round16(_mm512_add_ps(gv, bf16_load16(add))));
          uv = bf16_widen16(bf16_round16(_mm512_add_ps(uv, bf16_load16(add + inner))));
        }
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 act = bf16_widen16(bf16_round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), bf16_round16(_mm512_mul_ps(act, uv)));
        return;
      }
    }
#endif
    float gf[16], uf[16], e[16];
    const int64_t count = std::min<int64_t>(16, inner - j);
    for (int64_t i = 0; i < count; ++i) {
      gf[i] = static_cast<float>(static_cast<T>(g[i] + bias[j + i]));
      uf[i] = static_cast<float>(static_cast<T>(u[i] + bias[inner + j + i]));
      if (add) {
        gf[i] = static_cast<float>(static_cast<T>(gf[i] + static_cast<float>(add[i])));
        uf[i] = static_cast<float>(static_cast<T>(uf[i] + static_cast<float>(add[inner + i])));
      }
      e[i] = -gf[i];
    }
    if (j + 16 <= vector_end) {
      exp_inplace(e, 16);
    } else {
      for (int64_t i = 0; i < count; ++i) e[i] = std::exp(e[i]);
    }
    for (int64_t i = 0; i < count; ++i) {
      const auto act = static_cast<T>(gf[i] / (1.f + e[i]));
      o[i] = static_cast<T>(static_cast<float>(act) * uf[i]);
    }
  }
};

// A linear's bias as float32, zero-padded to ``padded`` outputs (zeros without one).
inline std::vector<float> padded_bias(const c10::optional<at::Tensor>& bias, int64_t n, int64_t padded,
                                      const char* op) {
  std::vector<float> b(padded, 0.f);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias [N]");
    const auto bc = bias->to(at::kFloat).contiguous();
    std::memcpy(b.data(), bc.data_ptr<float>(), n * sizeof(float));
  }
  return b;
}

// A fused linear's residual [rows, n] in x's dtype (nullptr without one), after checking it.
template <typename T = at::BFloat16>
inline const T* residual_rows(const c10::optional<at::Tensor>& residual, const at::Tensor& x, int64_t n,
                              bool gate, const char* op) {
  if (gate) {
    TORCH_CHECK(n % 32 == 0, op, ": a gate needs outputs [gate | up], each a multiple of 16, got ", n);
    TORCH_CHECK(!residual.has_value(), op, ": a residual or a gate, not both");
  }
  if (!residual.has_value()) return nullptr;
  TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->is_contiguous() &&
                  residual->sizes() == at::IntArrayRef({x.size(0), n}),
              op, ": residual [M, N] contiguous in x's dtype");
  return residual->data_ptr<T>();
}

// A fused linear's addends as per-row pointers (empty without them): ``addend`` [R, n] in
// x's dtype, row i added to output row ``rows``[i] (int64 [R], each row at most once).
template <typename T = at::BFloat16>
inline std::vector<const T*> addend_rows(const c10::optional<at::Tensor>& addend,
                                         const c10::optional<at::Tensor>& rows, const at::Tensor& x,
                                         int64_t n, const char* op) {
  TORCH_CHECK(addend.has_value() == rows.has_value(), op, ": an addend and its rows, or neither");
  if (!addend.has_value()) return {};
  const int64_t count = addend->size(0);
  TORCH_CHECK(addend->scalar_type() == x.scalar_type() && addend->is_contiguous() && addend->dim() == 2 &&
                  addend->size(1) == n,
              op, ": addend [R, N] contiguous in x's dtype");
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == count, op,
              ": addend_rows int64, one per addend row");
  std::vector<const T*> out(x.size(0), nullptr);
  const int64_t* r = rows->data_ptr<int64_t>();
  const T* a = addend->data_ptr<T>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < x.size(0), op, ": addend row ", r[i], " outside x's ", x.size(0), " rows");
    TORCH_CHECK(!out[r[i]], op, ": addend row ", r[i], " given twice");
    out[r[i]] = a + i * n;
  }
  return out;
}

// dense_float.cpp: skinny_linear for float32 x (dense.cpp's op dispatches to it).
at::Tensor skinny_linear_float(const at::Tensor& x, const at::Tensor& lanes, int64_t n,
                               const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& residual, bool gate,
                               const std::vector<const float*>& addend);

// lora.cpp: each adapter's LoRA delta added into y on its own rows (canteen::lora_add's
// arguments, rows and scales as pointers); ``packed``: into y's row i for listed row i.
void lora_add_into(at::Tensor& y, const at::Tensor& x, const int64_t* rows, at::IntArrayRef counts,
                   const double* scales, at::IntArrayRef ranks, const at::Tensor* weights, at::IntArrayRef parts,
                   bool packed = false);

}  // namespace canteen

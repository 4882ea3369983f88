// Helpers shared by Canteen's CPU kernels (canteen_ops.cpp, dense.cpp, lowbit.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

}  // namespace canteen

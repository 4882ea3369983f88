// Helpers shared by Canteen's CPU kernels (canteen_ops.cpp, dense.cpp, lowbit.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace canteen {

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

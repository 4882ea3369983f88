// canteen::greedy_pick: the sampler's per-row reductions over the vocabulary in one op.
//
// For each row of float32 or bfloat16 logits [N, V]: the largest logit (as float32), the
// first index holding it (what torch.max and torch.argmax return), and, when asked, the log
// of the row's softmax denominator (what torch.logsumexp returns, summed in another order),
// so that a token's logprob is its logit minus it. torch takes two reductions of several
// passes each, and a few hundred microseconds for the rows of a verifying step; this reads
// each row twice.
// A NaN in a row wins the max and makes the denominator NaN, as in torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

struct Pick {
  float best;
  int64_t index;
};

// The first index of a NaN in x, or n.
int64_t first_nan(const float* x, int64_t n) {
  int64_t i = 0;
  while (i < n && !std::isnan(x[i])) ++i;
  return i;
}

Pick row_max(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(top);
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_max_ps(acc, v);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  top = _mm512_reduce_max_ps(acc);
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    top = x[i] > top ? x[i] : top;
    nan |= std::isnan(x[i]);
  }
  if (nan) {  // torch's max returns the first NaN
    const int64_t at = first_nan(x, n);
    return {x[at], at};
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 want = _mm512_set1_ps(top);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), want, _CMP_EQ_OQ);
    if (hit) return {top, i + __builtin_ctz(hit)};
  }
#endif
  for (; i < n && x[i] != top; ++i) {
  }
  return {top, i < n ? i : 0};  // every logit -inf: index 0, as torch
}

// row_norm is one pass in registers with AVX-512; otherwise it needs a scratch row.
#if defined(__AVX512F__)
constexpr bool kNormScratch = false;
#else
constexpr bool kNormScratch = true;
#endif

float row_norm(const float* x, int64_t n, float top, std::vector<float>& scratch) {
  if (!std::isfinite(top)) return top;  // every logit -inf, an inf, or a NaN
#if defined(__AVX512F__)
  // one pass, four independent sums (SLEEF's exp is the cost: keep its pipeline full)
  const __m512 t = _mm512_set1_ps(top);
  __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u)
      sums[u] = _mm512_add_ps(sums[u], Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16 * u), t)));
  for (; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), t));
    sums[0] = _mm512_mask_add_ps(sums[0], m, sums[0], e);
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
  return std::log(_mm512_reduce_add_ps(total)) + top;
#else
  for (int64_t i = 0; i < n; ++i) scratch[i] = x[i] - top;
  canteen::exp_inplace(scratch.data(), n);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += scratch[i];
  return std::log(sum) + top;
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits, bool with_norm) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "greedy_pick: float32 or bfloat16 logits [N, V], V > 0");
  const auto lc = logits.contiguous();
  const bool bf16 = lc.scalar_type() == at::kBFloat16;
  const int64_t rows = lc.size(0), vocab = lc.size(1);
  const auto out = lc.options().dtype(at::kFloat);
  auto best = at::empty({rows}, out);
  auto chosen = at::empty({rows}, out.dtype(at::kLong));
  auto norm = at::empty({with_norm ? rows : 0}, out);
  float* bp = best.data_ptr<float>();
  int64_t* cp = chosen.data_ptr<int64_t>();
  float* np = norm.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(with_norm && kNormScratch ? vocab : 0);
    // bfloat16 logits: each row widened (exactly) into a float32 row that stays in cache for
    // both passes, instead of a float32 copy of every row written out first
    std::vector<float> widened(bf16 ? vocab : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = nullptr;
      if (bf16) {
        const at::BFloat16* raw = lc.data_ptr<at::BFloat16>() + r * vocab;
        for (int64_t i = 0; i < vocab; ++i) widened[i] = static_cast<float>(raw[i]);
        x = widened.data();
      } else {
        x = lc.data_ptr<float>() + r * vocab;
      }
      const Pick pick = row_max(x, vocab);
      bp[r] = pick.best;
      cp[r] = pick.index;
      if (with_norm) np[r] = row_norm(x, vocab, pick.best, scratch);
    }
  });
  return {best, chosen, norm};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def("greedy_pick(Tensor logits, bool with_norm) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("greedy_pick", &greedy_pick); }

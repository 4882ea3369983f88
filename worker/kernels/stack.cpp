// canteen::decode_layers: every decoder layer of a decode step of a few rows, in one op.
//
// worker/model/forward.py's Layer runs about fifteen ops per layer; for the one row of a single
// stream (or a draft model's forwards) each op's Python and dispatch cost, times thirty
// layers, is a third of the step. It takes every step the kernels can compute: decode rows,
// verified drafts and prefill chunks alike. This op runs the same ops, in the same order, on the same
// kernels (canteen::rms_norm, skinny_linear or quant_linear, rotary_kv, paged_decode_into,
// silu_mul; torch's arithmetic), so its outputs are the Python path's bit for bit;
// only the Python between them is gone, and the residual adds and the SiLU gate finish
// inside the linears before them (the same bits, a pass and an op fewer each).
// worker/model/forward.py decides when it applies (CPU kernels, a llama-like layer without q/k norms,
// linears with a kernel of Canteen's) and keeps the Python path otherwise.
//
// Per layer, ``weights`` holds 14 tensors: the two norms' weights, then for the qkv, o,
// gate-up and down linears (a, b, bias): skinny_linear's lanes and an empty b, or
// quant_linear's packed weights and scales; an empty bias for none. ``sizes`` holds each
// linear's output features. ``groups`` holds 4 tensors per attention group: slots [S, W],
// lens [B], rows [B] and tables [B] (empty: row b reads table b), as paged_decode_into takes
// them.
//
// LoRA (worker/lora/slots.py, StepLora.kernel_args): ``lora`` holds every adapter's rows (int64,
// adapter after adapter) and the adapters' scales (float64), then per layer, per linear, per
// adapter: A's lanes and each part's B lanes (empty where the adapter lacks them);
// ``lora_sizes`` holds the rows and rank per adapter, then the linears' part sizes (q, k, v;
// o; gate, up; down). For a linear an adapter targets, lora.cpp computes the adapters'
// deltas on their rows first, and the linear adds them to its own outputs before its residual
// add or SiLU gate (common.h, Finish's addend): the bits of StepLora.apply's in-place add
// between the unfused linear and the add or silu_mul (the Python layer path), with every
// linear still fused and no extra pass over the step's rows.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kPerLayer = 14, kLinears = 4;

c10::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

struct Ops {
  using Opt = c10::optional<at::Tensor>;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Opt&,
                                      const Opt&, bool, const Opt&, const Opt&)>
      skinny;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, const Opt&, const Opt&, bool, const Opt&, const Opt&)>
      quant;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&,
                                      const at::Tensor&)>
      rotary;
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                const Opt&)>
      attend;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                      const at::Tensor&, at::Tensor&, const at::Tensor&)>
      rotary_kv;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      auto find = [&](const char* name) { return d.findSchemaOrThrow(name, ""); };
      return Ops{
          find("canteen::skinny_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Opt&,
                                const Opt&, bool, const Opt&, const Opt&)>(),
          find("canteen::quant_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                const Opt&, const Opt&, bool, const Opt&, const Opt&)>(),
          find("canteen::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
          find("canteen::rotary")
              .typed<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&)>(),
          find("canteen::paged_decode_into")
              .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, double, const Opt&)>(),
          find("canteen::silu_mul").typed<at::Tensor(const at::Tensor&)>(),
          find("canteen::rotary_kv")
              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                const at::Tensor&, at::Tensor&, const at::Tensor&)>(),
      };
    }();
    return ops;
  }

  // The linear of (a, b, bias) at ``w``, the addend (LoRA deltas and their rows) added to its
  // outputs first, finished onto ``residual`` or through the SiLU gate.
  at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t n, const Opt& residual = {},
                    bool gate = false, const std::pair<Opt, Opt>& add = {}) const {
    return w[1].numel() == 0 ? skinny.call(x, w[0], n, given(w[2]), residual, gate, add.first, add.second)
                             : quant.call(x, w[0], w[1], n, given(w[2]), residual, gate, add.first, add.second);
  }
};

// A step's adapters (worker/lora/slots.py, StepLora.kernel_args): lora.cpp adds each one's
// delta on its own rows of a linear's output, in one call per linear.
struct Lora {
  static constexpr int64_t kParts[kLinears] = {3, 1, 2, 1};  // q | k | v, o, gate | up, down
  int64_t adapters = 0;
  at::TensorList list;    // rows, scales, then per layer, linear and adapter: A, each part's B
  at::IntArrayRef sizes;  // counts and ranks per adapter, then every linear's part sizes

  const at::Tensor* weights(int64_t layer, int64_t linear) const {
    int64_t at = 0;
    for (int64_t l = 0; l < linear; ++l) at += 1 + kParts[l];
    return list.data() + 2 + (layer * (kLinears + 7) + at) * adapters;
  }
  at::IntArrayRef parts(int64_t linear) const {
    int64_t at = 2 * adapters;
    for (int64_t l = 0; l < linear; ++l) at += kParts[l];
    return sizes.slice(at, kParts[linear]);
  }
  bool targets(int64_t layer, int64_t linear) const {
    const at::Tensor* w = weights(layer, linear);
    for (int64_t g = 0; g < adapters; ++g)
      if (w[g * (1 + kParts[linear])].numel()) return true;
    return false;
  }
  // The adapters' deltas of the linear of x and their rows (the linear's addend), or none
  // where no adapter targets it.
  std::pair<c10::optional<at::Tensor>, c10::optional<at::Tensor>> addend(const at::Tensor& x, int64_t layer,
                                                                         int64_t linear) const {
    if (!targets(layer, linear)) return {};
    int64_t out = 0;
    for (const int64_t p : parts(linear)) out += p;
    auto d = at::full({list[0].numel(), out}, -0.0, x.options());  // -0.0: an exact no-op
    canteen::lora_add_into(d, x, list[0].data_ptr<int64_t>(), sizes.slice(0, adapters), list[1].data_ptr<double>(),
                           sizes.slice(adapters, adapters), weights(layer, linear), parts(linear), true);
    return {d, list[0]};
  }
};

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& kv_pool, at::TensorList weights,
                         at::IntArrayRef sizes, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, at::TensorList groups, int64_t heads,
                         int64_t kv_heads, double scale, double eps, double residual,
                         at::TensorList lora_list, at::IntArrayRef lora_sizes) {
  const int64_t layers = kv_pool.size(0), dim = kv_pool.size(5), tokens = x_in.size(0);
  TORCH_CHECK(kv_pool.dim() == 6 && kv_pool.is_contiguous(),
              "decode_layers: kv_pool [layers, 2, blocks, block_size, kv_heads, D], contiguous");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer &&
                  static_cast<int64_t>(sizes.size()) == layers * kLinears,
              "decode_layers: 14 weights and 4 sizes per layer");
  TORCH_CHECK(groups.size() % 4 == 0, "decode_layers: groups of (slots, lens, rows, tables)");
  const int64_t adapters = lora_sizes.empty() ? 0 : (static_cast<int64_t>(lora_sizes.size()) - 7) / 2;
  const Lora lora{adapters, lora_list, lora_sizes};
  TORCH_CHECK(lora_sizes.empty() ? lora_list.empty()
                                 : static_cast<int64_t>(lora_sizes.size()) == 2 * adapters + 7 &&
                                       static_cast<int64_t>(lora_list.size()) == 2 + layers * (kLinears + 7) * adapters &&
                                       lora_list[0].scalar_type() == at::kLong && lora_list[0].is_contiguous() &&
                                       lora_list[1].scalar_type() == at::kDouble && lora_list[1].numel() == adapters,
              "decode_layers: lora holds rows (int64) and scales (float64), then A and each part's B "
              "per layer, linear and adapter; lora_sizes counts and ranks per adapter, then the "
              "linears' part sizes (3, 1, 2, 1)");
  const Ops& ops = Ops::get();
  at::Tensor x = x_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kPerLayer;
    const int64_t* n = sizes.data() + layer * kLinears;
    const auto pool = kv_pool.select(0, layer).view({2, kv_heads, -1, dim});
    const auto normed_in = ops.norm.call(x, w[0], eps);
    auto qkv = ops.linear(normed_in, w + 2, n[0], {}, false, lora.addend(normed_in, layer, 0));
    qkv = qkv.view({tokens, -1, dim});
    auto pool_layer = pool;  // rotary_kv writes the keys and values through it
    const auto q = ops.rotary_kv.call(qkv, heads, kv_heads, cos, sin, pool_layer, slot_mapping);
    auto attended = at::empty({tokens, heads * dim}, q.options());
    for (size_t g = 0; g < groups.size(); g += 4)
      ops.attend.call(attended, q, pool, groups[g], groups[g + 1], groups[g + 2], scale, given(groups[g + 3]));
    // the residual adds and the SiLU gate finish inside the linears where they can (common.h)
    const auto o_add = lora.addend(attended, layer, 1);
    x = residual == 1.0 ? ops.linear(attended, w + 5, n[1], x, false, o_add)
                        : x + ops.linear(attended, w + 5, n[1], {}, false, o_add) * residual;
    const auto normed = ops.norm.call(x, w[1], eps);
    const auto up_add = lora.addend(normed, layer, 2);
    const auto act = n[2] % 32 == 0 ? ops.linear(normed, w + 8, n[2], {}, true, up_add)
                                    : ops.silu_mul.call(ops.linear(normed, w + 8, n[2], {}, false, up_add));
    const auto down_add = lora.addend(act, layer, 3);
    x = residual == 1.0 ? ops.linear(act, w + 11, n[3], x, false, down_add)
                        : x + ops.linear(act, w + 11, n[3], {}, false, down_add) * residual;
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(canteen, m) {
  m.def(
      "decode_layers(Tensor x, Tensor(a!) kv_pool, Tensor[] weights, int[] sizes, Tensor cos, "
      "Tensor sin, Tensor slot_mapping, Tensor[] groups, int heads, int kv_heads, float scale, "
      "float eps, float residual, Tensor[] lora, int[] lora_sizes) -> Tensor");
}

TORCH_LIBRARY_IMPL(canteen, CPU, m) { m.impl("decode_layers", &decode_layers); }

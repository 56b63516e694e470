//@ ch13
// Scaled dot-product attention. F.scaled_dot_product_attention asks a
// per-device DispatchStub, _fused_sdp_choice_stub, which kernel to use. With
// no acme entry in the stub, PrivateUse1 tensors always get the "math" path:
// a dozen composite ops, correct but unfused. Registering a choice function
// lets acme answer "overrideable", and ATen then calls the fused op
// _scaled_dot_product_fused_attention_overrideable, and autograd its
// backward: both have default kernels that only raise, so acme implements
// them.
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "aten/device_views.h"
#include "aten/generator.h"
#include "aten/routed_ops.h"
//> ch23 attention-on-stream-include
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include <deque>
#include <vector>

#include "aten/attention_rows.h"
#include "aten/launch.h"
#include "aten/philox_batch.h"
#include "aten/run_on_stream.h"
//< ch23 attention-on-stream-include

namespace acme {
namespace {

//> ch13 sdp-choice
// Which SDPA kernel runs: acme's fused kernel where it applies and the user
// allows it (torch.nn.attention.sdpa_kernel), else ATen's math path.
int64_t choose_sdp_backend(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                           double dropout_p, bool is_causal, std::optional<double> scale,
                           bool enable_gqa) {
  const auto& context = at::globalContext();
  const bool supported =
      !query.is_nested() && !key.is_nested() && !value.is_nested() &&
      at::isFloatingType(query.scalar_type()) &&
      // The fused op has no grouped-query form: those go to the math path.
      (!enable_gqa || query.dim() < 3 || query.size(-3) == key.size(-3)) &&
      // Nor one that broadcasts a query of another rank (CUDA's fused
      // kernels ask for 4-D inputs alike): the math path broadcasts.
      query.dim() == key.dim() && key.dim() == value.dim() &&
      // Nor a forward derivative or a batching rule (as CUDA's fused ops):
      // under forward-mode AD and torch.func's transforms, the math path.
      !query._fw_grad(/*level=*/0).defined() && !key._fw_grad(0).defined() &&
      !value._fw_grad(0).defined() &&
      !query.key_set().has_any(c10::DispatchKeySet(
          {c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper}));
  if (supported && context.userEnabledOverrideableSDP())
    return static_cast<int64_t>(at::SDPBackend::overrideable);
  if (context.userEnabledMathSDP()) return static_cast<int64_t>(at::SDPBackend::math);
  return static_cast<int64_t>(at::SDPBackend::error);  // "No viable backend" from ATen
}
//< ch13 sdp-choice

//> ch13 sdp-kernels
// Half and bfloat16 inputs are computed in float, as fused kernels do.
at::Tensor compute(const at::Tensor& t) {
  return at::isReducedFloatingType(t.scalar_type()) ? t.to(at::kFloat) : t;
}

// Attention scores q·kᵀ·scale, with the causal mask (top-left aligned, as the
// math path) or the additive mask (ATen has already turned a boolean mask
// into 0 and -inf).
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias,
                  bool is_causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (is_causal) {
    const at::Tensor kept = at::ones({s.size(-2), s.size(-1)}, s.options().dtype(at::kBool)).tril();
    s.masked_fill_(kept.logical_not(), -std::numeric_limits<double>::infinity());
  }
  if (bias.defined()) s = s + compute(bias);
  return s;
}

// softmax(s) and its row log-sum-exp, in two passes over s and one over the
// probabilities: the largest score m of a row has the largest probability,
// exp(m - lse), so lse = m - log(max p). A row masked out entirely attends to
// nothing: its probabilities are 0 (as ATen's math path) and its lse -inf.
std::pair<at::Tensor, at::Tensor> softmax_and_logsumexp(const at::Tensor& s) {
  if (s.size(-1) == 0) {  // no keys: nothing to attend to (amax refuses an empty row)
    return {at::zeros_like(s), at::full(s.sizes().slice(0, s.dim() - 1),
                                         -std::numeric_limits<double>::infinity(), s.options())};
  }
  at::Tensor p = at::_softmax(s, -1, /*half_to_float=*/false);
  const at::Tensor top = s.amax(-1);
  const at::Tensor empty_rows = top.isneginf();  // their softmax is 0 / 0
  if (empty_rows.any().item<bool>()) p.masked_fill_(empty_rows.unsqueeze(-1), 0.0);
  const at::Tensor lse = at::where(empty_rows, top, top - p.amax(-1).log_());
  return {p, lse};
}

// softmax(s) again, from the saved row log-sum-exp, overwriting s.
at::Tensor probabilities(at::Tensor& s, const at::Tensor& logsumexp) {
  const at::Tensor lse = logsumexp.unsqueeze(-1);
  s.sub_(lse).exp_();
  const at::Tensor empty_rows = lse.isneginf();  // -inf - -inf: NaN, which is 0 here
  if (empty_rows.any().item<bool>()) s.masked_fill_(empty_rows, 0.0);
  return s;
}

//> ch13 dropout-keep < ch23 dropout-keep
// // The dropout mask is drawn with acme's generator (chapter 5's bernoulli
// // kernel) from a counter range reserved once in forward. Backward redraws
// // the same mask from the saved (seed, offset) instead of storing it.
// at::Tensor dropout_keep(c10::Device device, at::IntArrayRef sizes, double dropout_p,
//                         uint64_t seed, uint64_t offset) {
//   at::Generator generator = new_generator(device.index());
//   {
//     const std::lock_guard<std::mutex> lock(generator.mutex());
//     generator.set_current_seed(seed);
//     generator.set_offset(offset);
//   }
//   return at::empty(sizes, at::TensorOptions().device(device).dtype(at::kBool))
//       .bernoulli_(1.0 - dropout_p, generator);
// }
//< ch13 dropout-keep
//> ch23 dropout-keep
// The dropout mask: chapter 5's bernoulli_ numbers, from a counter range
// reserved once in forward. Backward redraws the same mask from the saved
// (seed, offset) instead of storing it. From chapter 23 the kernels run on
// the stream's worker, and the mask is drawn there, into host memory, with
// no generator or kernel of its own.
at::Tensor draw_keep(at::IntArrayRef sizes, double dropout_p, uint64_t seed, uint64_t offset) {
  at::Tensor keep = at::empty(sizes, at::TensorOptions().dtype(at::kBool));
  bool* kept = keep.data_ptr<bool>();
  const double p_keep = 1.0 - dropout_p;
  at::parallel_for(0, keep.numel(), /*grain_size=*/1 << 14, [&](int64_t begin, int64_t end) {
    fill_blocks(PhiloxRange{seed, offset}, kept, begin, end,
                [p_keep](int64_t, const PhiloxBlock& b) {
                  // bernoulli_'s test: the block's first 53 bits as a double in [0, 1).
                  const uint64_t bits = static_cast<uint64_t>(b[0]) << 32 | b[1];
                  return static_cast<double>(bits >> 11) * 0x1p-53 < p_keep;
                });
  });
  return keep;
}

// Here, where a device's cores are the host's, drawing a mask costs more than
// keeping it: the last few masks drawn are kept, read-only, for the backward
// and for activation checkpointing's recompute, which ask for the same ones.
at::Tensor dropout_keep(c10::Device /*device*/, at::IntArrayRef sizes, double dropout_p,
                        uint64_t seed, uint64_t offset) {
  struct Kept {
    std::vector<int64_t> sizes;
    double dropout_p;
    uint64_t seed, offset;
    at::Tensor keep;
  };
  constexpr size_t kMasks = 8;
  constexpr int64_t kBytes = int64_t{64} << 20;  // at most this much kept
  static std::mutex mutex;
  static auto* kept = new std::deque<Kept>;  // never destroyed: kernels may run at exit
  static int64_t kept_bytes = 0;
  const auto same = [&](const Kept& k) {
    return k.seed == seed && k.offset == offset && k.dropout_p == dropout_p &&
           sizes.equals(k.sizes);
  };
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = std::find_if(kept->begin(), kept->end(), same);
    if (found != kept->end()) return found->keep;
  }
  at::Tensor keep = draw_keep(sizes, dropout_p, seed, offset);
  if (keep.numel() <= kBytes) {
    const std::lock_guard<std::mutex> lock(mutex);
    kept->push_back({sizes.vec(), dropout_p, seed, offset, keep});
    kept_bytes += keep.numel();
    while (kept->size() > kMasks || kept_bytes > kBytes) {
      kept_bytes -= kept->front().keep.numel();
      kept->pop_front();
    }
  }
  return keep;
}
//< ch23 dropout-keep

// `computed` (a CPU result) on the device in the layout the op's meta kernel
// (torch/_meta_registrations.py) promises, which the compiler plans its
// buffers by: the dimensions in the order of `like`'s strides, as the meta's
// alloc_with_matching_layout and empty_like lay them out.
at::Tensor on_device_like(const at::Tensor& computed, const at::Tensor& like) {
  if (!computed.defined()) return computed;
  at::Tensor result;
  if (computed.sizes() == like.sizes()) {
    result = at::empty_like(like, computed.options().device(like.device()));
  } else {
    std::vector<int64_t> order(like.dim());
    for (int64_t d = 0; d < like.dim(); ++d) order[d] = d;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return like.stride(a) > like.stride(b); });
    std::vector<int64_t> strides(like.dim());
    int64_t stride = 1;
    for (auto d = order.rbegin(); d != order.rend(); ++d) {
      strides[*d] = stride;
      stride *= computed.size(*d);
    }
    result = at::empty_strided(computed.sizes(), strides,
                               computed.options().device(like.device()));
  }
  DeviceViews view;
  view(result).copy_(computed);
  return result;
}

double default_scale(const at::Tensor& query, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
}
//> ch23 attention-arithmetic

// Counter blocks from the device's default generator, in call order.
PhiloxRange reserve_counters(c10::DeviceIndex device, uint64_t blocks) {
  auto* generator = at::check_generator<AcmeGeneratorImpl>(default_generator(device));
  const std::lock_guard<std::mutex> lock(generator->mutex_);
  return generator->reserve(blocks);
}

// The forward's arithmetic on device views: the output and the row
// log-sum-exp, as CPU tensors. counters(n) gives the range of n counter
// blocks the dropout mask comes from: reserved as the kernel runs
// (attention(), the host waiting) or by the host before the launch
// (attention_launched, below).
template <class Counters>
std::pair<at::Tensor, at::Tensor> attention_arithmetic(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& bias, double dropout_p, bool is_causal, double scale,
    const Counters& counters) {
  // A row at a time where attention_rows.cpp takes the inputs, with the
  // same counter blocks and mask. (dropout_p 1, every probability dropped,
  // keeps the composite's arithmetic.)
  const at::Tensor q = compute(query), k = compute(key), v = compute(value);
  const at::Tensor b = bias.defined() ? compute(bias) : bias;
  if (dropout_p < 1 && attention_rows_apply(q, k, v, b)) {
    at::Tensor keep;
    if (dropout_p > 0) {
      const std::vector<int64_t> sizes = scores_shape(q, k);
      const PhiloxRange range = counters(static_cast<uint64_t>(c10::multiply_integers(sizes)));
      keep = dropout_keep(query.device(), sizes, dropout_p, range.seed, range.first);
    }
    auto [out, logsumexp] = attention_rows_forward(q, k, v, b, keep, dropout_p, is_causal, scale);
    return {out.to(query.scalar_type()), logsumexp};
  }
  const at::Tensor s = scores(q, k, bias, is_causal, scale);
  auto [p, logsumexp] = softmax_and_logsumexp(s);
  if (dropout_p > 0) {
    const PhiloxRange range = counters(static_cast<uint64_t>(p.numel()));
    p.mul_(dropout_keep(query.device(), p.sizes(), dropout_p, range.seed, range.first))
        .mul_(1.0 / (1.0 - dropout_p));  // p is this kernel's own
  }
  return {at::matmul(p, v).to(query.scalar_type()), logsumexp};
}

at::Tensor philox_tensor(uint64_t bits) {
  return at::scalar_tensor(static_cast<int64_t>(bits), at::kLong);
}
//< ch23 attention-arithmetic

using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt,
                           c10::SymInt, at::Tensor, at::Tensor, at::Tensor>;

Forward attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                  bool return_debug_mask, std::optional<double> scale) {
  const c10::Device device = query.device();
  const at::Tensor bias = attn_bias.value_or(at::Tensor());
  check_same_device("aten::_scaled_dot_product_fused_attention_overrideable", device,
                    {key, value, bias});
  // ATen's own words: from PyTorch 2.14 its front end refuses the pair before
  // asking acme, so a caller sees the same message on either release.
  TORCH_CHECK(!(is_causal && bias.defined()),
              "scaled_dot_product_attention: Explicit attn_mask should not be set when "
              "is_causal=True");
  TORCH_CHECK(!return_debug_mask, c10::DeviceType::PrivateUse1,
              " fused attention has no debug mask");
  TORCH_CHECK(dropout_p >= 0 && dropout_p <= 1, "dropout_p must be in [0, 1], got ", dropout_p);
//> ch13 attention-body < ch23 attention-body
//   DeviceViews view;
//   const at::Tensor q = compute(view(query)), k = compute(view(key)), v = compute(view(value));
//   const at::Tensor s = scores(q, k, bias.defined() ? view(bias) : bias, is_causal,
//                               default_scale(query, scale));
//   auto [p, logsumexp] = softmax_and_logsumexp(s);
//   uint64_t seed = 0, offset = 0;
//   if (dropout_p > 0) {
//     auto* generator = at::check_generator<AcmeGeneratorImpl>(default_generator(device.index()));
//     {
//       const std::lock_guard<std::mutex> lock(generator->mutex_);
//       const PhiloxRange range = generator->reserve(static_cast<uint64_t>(p.numel()));
//       seed = range.seed;
//       offset = range.first;
//     }
//     const at::Tensor keep = dropout_keep(device, p.sizes(), dropout_p, seed, offset);
//     p.mul_(view(keep)).mul_(1.0 / (1.0 - dropout_p));  // p is this kernel's own
//   }
//   const at::Tensor out = at::matmul(p, v).to(query.scalar_type());
//   const auto philox = [](uint64_t bits) {
//     return at::scalar_tensor(static_cast<int64_t>(bits), at::kLong);
//   };
//   return {on_device_like(out, query),
//           on_device(logsumexp, device),  // float, or double for double inputs
//           at::Tensor(), at::Tensor(),  // cumulative sequence lengths: nested tensors only
//           query.size(-2), key.size(-2),
//           philox(seed), philox(offset),
//           at::Tensor()};
//< ch13 attention-body
//> ch23 attention-body
  DeviceViews view;
  PhiloxRange range{0, 0};
  const auto [out, logsumexp] = attention_arithmetic(
      view(query), view(key), view(value), bias.defined() ? view(bias) : bias, dropout_p,
      is_causal, default_scale(query, scale),
      [&](uint64_t blocks) { return range = reserve_counters(device.index(), blocks); });
  return {on_device_like(out, query),
          on_device(logsumexp, device),  // float, or double for double inputs
          at::Tensor(), at::Tensor(),  // cumulative sequence lengths: nested tensors only
          query.size(-2), key.size(-2),
          philox_tensor(range.seed), philox_tensor(range.first),
          at::Tensor()};
//< ch23 attention-body
}

using Backward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
//> ch23 attention-rows-backward

// The backward a row at a time (attention_rows.cpp), where it takes the
// inputs: q, k, v, d_out and the bias as compute() leaves them.
std::optional<Backward> backward_by_rows(
    const at::Tensor& d_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& bias, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> wanted,
    const at::Tensor& logsumexp, double dropout_p, bool is_causal,
    const at::Tensor& philox_seed, const at::Tensor& philox_offset, double factor) {
  if (dropout_p >= 1 || d_out.scalar_type() != q.scalar_type() ||
      !attention_rows_apply(q, k, v, bias))
    return std::nullopt;
  at::Tensor keep;
  if (dropout_p > 0) {
    keep = dropout_keep(query.device(), scores_shape(q, k), dropout_p,
                        static_cast<uint64_t>(philox_seed.item<int64_t>()),
                        static_cast<uint64_t>(philox_offset.item<int64_t>()));
  }
  const bool bias_wanted = wanted[3] && attn_bias.defined();
  const AttentionRowGrads grads = attention_rows_backward(
      d_out, q, k, v, bias, logsumexp, keep, dropout_p, is_causal, factor, bias_wanted);
  const auto result = [](bool want, const at::Tensor& grad, const at::Tensor& like) {
    if (!want) return at::Tensor();
    return on_device_like(grad.sum_to_size(like.sizes()).to(like.scalar_type()), like);
  };
  return Backward{result(wanted[0], grads.q, query), result(wanted[1], grads.k, key),
                  result(wanted[2], grads.v, value), result(bias_wanted, grads.scores, attn_bias)};
}
//< ch23 attention-rows-backward

Backward attention_backward(const at::Tensor& grad_out, const at::Tensor& query,
                            const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
                            const at::Tensor& out, const at::Tensor& logsumexp,
                            const at::Tensor& /*cum_seq_q*/, const at::Tensor& /*cum_seq_k*/,
                            int64_t /*max_q*/, int64_t /*max_k*/, double dropout_p,
                            bool is_causal, const at::Tensor& philox_seed,
                            const at::Tensor& philox_offset, std::optional<double> scale) {
  const c10::Device device = query.device();
  check_same_device("aten::_scaled_dot_product_fused_attention_overrideable_backward", device,
                    {grad_out, key, value, attn_bias, out, logsumexp});
  DeviceViews view;
  const double factor = default_scale(query, scale);
  const at::Tensor q = compute(view(query)), k = compute(view(key)), v = compute(view(value));
  // A gradient of sum() comes expanded (stride 0), which BLAS cannot take.
  const at::Tensor d_out = compute(view(grad_out)).contiguous();
//> ch23 attention-backward-rows
  const at::Tensor bias = attn_bias.defined() ? compute(view(attn_bias)) : attn_bias;
  if (auto grads = backward_by_rows(d_out, q, k, v, bias, query, key, value, attn_bias,
                                    grad_input_mask, view(logsumexp), dropout_p, is_causal,
                                    philox_seed, philox_offset, factor)) {
    return *std::move(grads);
  }
//< ch23 attention-backward-rows
  at::Tensor s = scores(q, k, attn_bias.defined() ? view(attn_bias) : attn_bias,
                        is_causal, factor);
  const at::Tensor p = probabilities(s, view(logsumexp));
  at::Tensor p_used = p, d_p = at::matmul(d_out, v.transpose(-2, -1));
  if (dropout_p > 0) {
    const at::Tensor keep = view(dropout_keep(device, p.sizes(), dropout_p,
                                              static_cast<uint64_t>(philox_seed.item<int64_t>()),
                                              static_cast<uint64_t>(philox_offset.item<int64_t>())));
    const double kept_scale = 1.0 / (1.0 - dropout_p);
    p_used = (p * keep).mul_(kept_scale);
    d_p.mul_(keep).mul_(kept_scale);
  }
  // Softmax's backward: dS = P ∘ (dP − rowsum(dP ∘ P)), in d_p's memory.
  const at::Tensor d_s = d_p.sub_((d_p * p).sum(-1, /*keepdim=*/true)).mul_(p);
  const auto result = [&](bool wanted, const at::Tensor& grad, const at::Tensor& like) {
    if (!wanted) return at::Tensor();
    return on_device_like(grad.sum_to_size(like.sizes()).to(like.scalar_type()), like);
  };
  return {result(grad_input_mask[0], at::matmul(d_s, k).mul_(factor), query),
          result(grad_input_mask[1], at::matmul(d_s.transpose(-2, -1), q).mul_(factor), key),
          result(grad_input_mask[2], at::matmul(p_used.transpose(-2, -1), d_out), value),
          result(grad_input_mask[3] && attn_bias.defined(), d_s, attn_bias)};
}
//< ch13 sdp-kernels
//> ch23 attention-launched

// The forward without waiting (chapter 23). The first call with given
// shapes runs attention() above on the stream, the host waiting, and raises
// what it raises. Later calls with those shapes take their dropout counters
// here, in call order, allocate the results as that call's were, and launch
// the arithmetic.
Forward attention_launched(const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& value, const std::optional<at::Tensor>& attn_bias,
                           double dropout_p, bool is_causal, bool return_debug_mask,
                           std::optional<double> scale) {
  static auto* passed = new PassedShapes;
  std::vector<int64_t> shapes;
  // attention() checks dropout_p's value: whether it passed is in the key.
  const bool keyable =
      add_to_shape_key(shapes, query) && add_to_shape_key(shapes, key) &&
      add_to_shape_key(shapes, value) && add_to_shape_key(shapes, attn_bias) &&
      add_to_shape_key(shapes, is_causal) && add_to_shape_key(shapes, return_debug_mask) &&
      add_to_shape_key(shapes, dropout_p >= 0 && dropout_p <= 1);
  const auto layouts = keyable ? passed->find(shapes) : std::nullopt;
  if (!layouts) {
    Forward results = OnStream<"attention", attention>::call(
        query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, scale);
    if (keyable) {
      passed->remember(std::move(shapes),
                       {layout_of(std::get<0>(results)), layout_of(std::get<1>(results))});
    }
    return results;
  }
  const c10::DeviceIndex device = query.device().index();
  const at::Tensor out = allocate_result((*layouts)[0], device);
  const at::Tensor logsumexp = allocate_result((*layouts)[1], device);
  // A counter block for each attention probability: logsumexp has a row's.
  const auto blocks = static_cast<uint64_t>(logsumexp.numel() * key.size(-2));
  const PhiloxRange range = dropout_p > 0 ? reserve_counters(device, blocks) : PhiloxRange{0, 0};
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(device, "attention",
                [q = view(query), k = view(key), v = view(value),
                 bias = attn_bias ? view(*attn_bias) : at::Tensor(), out_view = view(out),
                 logsumexp_view = view(logsumexp), dropout_p, is_causal,
                 factor = default_scale(query, scale), range, blocks] {
                  const auto [o, lse] = attention_arithmetic(
                      q, k, v, bias, dropout_p, is_causal, factor, [&](uint64_t needed) {
                        TORCH_CHECK(needed == blocks, "attention: ", blocks,
                                    " counter blocks were reserved, the kernel needs ", needed);
                        return range;
                      });
                  copy_result("attention", out_view, o);
                  copy_result("attention", logsumexp_view, lse);
                });
  return {out, logsumexp, at::Tensor(), at::Tensor(), query.size(-2), key.size(-2),
          philox_tensor(range.seed), philox_tensor(range.first), at::Tensor()};
}
//< ch23 attention-launched

}  // namespace
}  // namespace acme

//> ch13 register-attention
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &acme::choose_sdp_backend)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // The same answer for those who ask the op rather than the stub (Python's
  // torch._fused_sdp_choice, the compiler): through the fallback they would
  // get the CPU's answer, a kernel acme does not run.
  m.impl("_fused_sdp_choice", TORCH_FN(acme::choose_sdp_backend));
//> ch13 register-attention-kernels < ch23 register-attention-kernels
//   m.impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(acme::attention));
//   m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
//          TORCH_FN(acme::attention_backward));
//< ch13 register-attention-kernels
//> ch23 register-attention-kernels
  // The kernels run on the stream's worker (chapter 23): the host waits for
  // the first call with given shapes, and launches later ones. The backward
  // kernel works on device views as it is, so it is its own arithmetic.
  using acme::LaunchedOnStream;
  m.impl("_scaled_dot_product_fused_attention_overrideable",
         TORCH_FN(acme::attention_launched));
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         TORCH_FN((LaunchedOnStream<"attention backward", acme::attention_backward,
                                    acme::attention_backward>::call)));
//< ch23 register-attention-kernels
}
//< ch13 register-attention

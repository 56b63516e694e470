//@ ch13
// The Transformer's fast path. nn.TransformerEncoder in eval mode, given a
// padding mask, packs its input into a nested tensor (only the tokens that
// are not padding), runs each layer on it with _transformer_encoder_layer_fwd,
// and pads the result back with to_padded_tensor. PyTorch takes this path on
// the CPU, CUDA and any PrivateUse1 device alike (torch/nn/modules/
// transformer.py), so a backend without nested tensors fails there on a
// tensor its user never made. acme implements the path's three ops on dense
// device tensors; the nested tensor only carries the packed tokens (a device
// buffer) and each sequence's size (a CPU tensor) from one op to the next.
// Any other op on an acme nested tensor still meets layouts.cpp's refusal.
#include <ATen/NestedTensorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/nested/NestedTensorUtils.h>
#include <ATen/ops/_native_multi_head_attention_native.h>
#include <ATen/ops/_transformer_encoder_layer_fwd.h>
#include <ATen/ops/_transformer_encoder_layer_fwd_native.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch13 nested-path
// Which places of a [batch, length] grid hold tokens, for sequences of these
// lengths, left-aligned (the only layout the fast path makes).
at::Tensor token_places(const at::Tensor& lengths, int64_t length) {
  return at::arange(length, lengths.options()).unsqueeze(0) < lengths.unsqueeze(1);
}

// (batch, length, features) as a nested tensor of `lengths` tokens each.
at::Tensor pack(const at::Tensor& padded, const at::Tensor& lengths) {
  const at::Tensor places = token_places(lengths, padded.size(1)).to(padded.device());
  // Token by token, each token's features in order: the packed buffer.
  const at::Tensor tokens = padded.masked_select(places.unsqueeze(-1));
  const at::Tensor sizes = at::stack({lengths, at::full_like(lengths, padded.size(2))}, 1);
  return at::native::wrap_buffer(tokens, sizes);
}

// The nested tensor's tokens back in a (batch, length, features) grid.
at::Tensor unpack(const at::Tensor& nested, double padding, int64_t length) {
  const at::Tensor& sizes = at::native::get_nested_tensor_impl(nested)->get_nested_sizes();
  TORCH_CHECK(sizes.dim() == 2 && sizes.size(1) == 2, kAcme,
              ": the Transformer fast path's nested tensors hold (tokens, features) sequences");
  const at::Tensor lengths = sizes.select(1, 0), buffer = at::native::get_buffer(nested);
  const int64_t batch = sizes.size(0), features = batch ? sizes[0][1].item<int64_t>() : 0;
  length = std::max(length, lengths.numel() ? lengths.max().item<int64_t>() : int64_t{0});
  at::Tensor padded = at::full({batch, length, features}, padding, buffer.options());
  const at::Tensor places = token_places(lengths, length).to(buffer.device());
  padded.masked_scatter_(places.unsqueeze(-1), buffer);
  return padded;
}

at::Tensor nested_tensor_from_mask(const at::Tensor& t, const at::Tensor& mask, bool mask_check) {
  TORCH_CHECK(t.dim() == 3 && mask.dim() == 2 && mask.scalar_type() == at::kBool,
              "_nested_tensor_from_mask: expected a 3-D tensor and a 2-D bool mask, got ",
              t.sizes(), " and ", mask.sizes(), " ", mask.scalar_type());
  const at::Tensor lengths = mask.sum(1).cpu();  // the host keeps the sizes
  if (mask_check) {
    TORCH_CHECK(mask.cpu().equal(token_places(lengths, mask.size(1))),
                "_nested_tensor_from_mask: mask is not left-aligned: each row must be all "
                "True up to its length, then False");
  }
  return pack(t, lengths);
}

at::Tensor to_padded_tensor(const at::Tensor& nested, double padding,
                            at::OptionalSymIntArrayRef output_size) {
  TORCH_CHECK(!output_size || output_size->size() == 3, "to_padded_tensor: output_size must "
              "have 3 dimensions for the Transformer fast path's nested tensors");
  at::Tensor padded = unpack(nested, padding, output_size ? (*output_size)[1].expect_int() : 0);
  TORCH_CHECK(!output_size || (padded.size(0) == (*output_size)[0].expect_int() &&
                               padded.size(1) == (*output_size)[1].expect_int() &&
                               padded.size(2) == (*output_size)[2].expect_int()),
              "to_padded_tensor: output_size ", *output_size, " is smaller than the nested "
              "tensor's sizes, or does not match its batch and features");
  return padded;
}

// One layer, on the padded grid with the padding masked out of attention
// (mask_type 1: a key padding mask, True where there is no token); the
// padding's own rows are computed and dropped when the result is packed.
at::Tensor encoder_layer(const at::Tensor& src, int64_t embed_dim, int64_t num_heads,
                         const at::Tensor& qkv_weight, const at::Tensor& qkv_bias,
                         const at::Tensor& proj_weight, const at::Tensor& proj_bias, bool use_gelu,
                         bool norm_first, double eps, const at::Tensor& norm_weight_1,
                         const at::Tensor& norm_bias_1, const at::Tensor& norm_weight_2,
                         const at::Tensor& norm_bias_2, const at::Tensor& ffn_weight_1,
                         const at::Tensor& ffn_bias_1, const at::Tensor& ffn_weight_2,
                         const at::Tensor& ffn_bias_2, const std::optional<at::Tensor>& mask,
                         std::optional<int64_t> mask_type) {
  TORCH_CHECK(!mask.has_value() || !mask->defined(), kAcme,
              ": _transformer_encoder_layer_fwd on a nested tensor takes no mask (the nested "
              "tensor already leaves the padding out)");
  const at::Tensor lengths =
      at::native::get_nested_tensor_impl(src)->get_nested_sizes().select(1, 0);
  const at::Tensor padded = unpack(src, 0.0, 0);
  const at::Tensor padding = token_places(lengths, padded.size(1)).logical_not().to(padded.device());
  const at::Tensor out = at::_transformer_encoder_layer_fwd(
      padded, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
      norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1,
      ffn_bias_1, ffn_weight_2, ffn_bias_2, padding, /*mask_type=*/1);
  return pack(out, lengths);
}
//< ch13 nested-path

//> ch13 dense-path
// Two operators of the dense fast paths that PyTorch has CPU and CUDA kernels
// for only, as compositions of operators acme runs. The split of a fused
// q|k|v projection into heads, with its bias, q scaled by 1/sqrt(head_dim)
// (as the CPU kernel does):
std::tuple<at::Tensor, at::Tensor, at::Tensor> transform_bias_rescale_qkv(
    const at::Tensor& qkv, const at::Tensor& qkv_bias, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(2) % (3 * num_heads) == 0, kAcme,
              ": _transform_bias_rescale_qkv takes (batch, tokens, 3 * heads * head_dim), got ",
              qkv.sizes(), " for ", num_heads, " heads");
  const int64_t batch = qkv.size(0), tokens = qkv.size(1);
  const int64_t head_dim = qkv.size(2) / (3 * num_heads);
  const at::Tensor parts = (qkv + qkv_bias)
                               .view({batch, tokens, 3, num_heads, head_dim})
                               .permute({2, 0, 3, 1, 4});
  const double scale = 1.0 / std::sqrt(double(head_dim));
  return {parts[0].mul(scale).contiguous(), parts[1].contiguous(), parts[2].contiguous()};
}

// A linear layer's product with its activation, as the CPU's kernel computes
// it: addmm, then GELU (exact) or ReLU in place.
at::Tensor addmm_activation(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                            const at::Scalar& beta, const at::Scalar& alpha, bool use_gelu) {
  at::Tensor result = at::addmm(self, mat1, mat2, beta, alpha);
  return use_gelu ? at::gelu_(result) : at::relu_(result);
}
//< ch13 dense-path

}  // namespace
}  // namespace acme

//> ch13 register-nested-path
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_nested_tensor_from_mask", TORCH_FN(acme::nested_tensor_from_mask));
  // The dense fast paths of nn.MultiheadAttention and TransformerEncoderLayer
  // (eval mode, no grad). PyTorch's own functions for them are composites of
  // dispatched ops, registered for the CPU and CUDA only: registered here too,
  // their ops run on acme's kernels (without, the fallback copies the weights
  // to the host at every call). The _cpu in the name is only where it lives.
  m.impl("_native_multi_head_attention",
         TORCH_FN(at::native::native_multi_head_attention_cpu));
  m.impl("_transformer_encoder_layer_fwd",
         TORCH_FN(at::native::transformer_encoder_layer_forward));
  m.impl("_transform_bias_rescale_qkv", TORCH_FN(acme::transform_bias_rescale_qkv));
  m.impl("_addmm_activation", TORCH_FN(acme::addmm_activation));
}
TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  m.impl("to_padded_tensor", TORCH_FN(acme::to_padded_tensor));
  m.impl("_transformer_encoder_layer_fwd", TORCH_FN(acme::encoder_layer));
}
//< ch13 register-nested-path

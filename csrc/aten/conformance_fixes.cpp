//@ ch14
// Places where PyTorch (2.13 to 2.15) treats a PrivateUse1 device differently
// from CUDA, found by running PyTorch's own OpInfo and ModuleInfo samples on
// acme (chapter 14). None raised an error: each was silently wrong.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_native_batch_norm_legit.h>
//> ch14 pixel-shuffle-include
#include <ATen/ops/pixel_shuffle_native.h>
#include <ATen/ops/pixel_unshuffle_native.h>
//< ch14 pixel-shuffle-include
#include <torch/library.h>

namespace acme {
namespace {

//> ch14 batch-norm
// native_batch_norm writes the running mean and variance in training mode, but
// its schema does not say so (no `Tensor(a!)`). The CPU fallback copies back
// only the arguments a schema marks as written, so on acme the running
// statistics never moved. `_native_batch_norm_legit` is the same computation
// with an honest schema; the fallback runs it and copies the statistics back.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps) {
  bool has_mean = running_mean.has_value() && running_mean->defined();
  bool has_var = running_var.has_value() && running_var->defined();
  // The CPU's own check and wording: a ValueError.
  TORCH_CHECK_VALUE(has_mean == has_var,
                    "running_mean and running_var must either both be None or neither be None");
  if (!has_mean) {
    return at::_native_batch_norm_legit(input, weight, bias, training, momentum, eps);
  }
  at::Tensor mean = *running_mean;
  at::Tensor var = *running_var;
  return at::_native_batch_norm_legit(input, weight, bias, mean, var, training, momentum, eps);
}
//< ch14 batch-norm

//> ch14 pixel-shuffle
// pixel_shuffle has a CPU kernel and, for every other device, ATen's
// composite (reshape, permute, copy), which returns a contiguous tensor: a
// channels-last input came back channels-first, where the CPU keeps it
// channels-last. acme runs the composite on the device and gives the result
// the input's memory format. (Not the CPU's kernel through the fallback: for
// an empty input that kernel returns the input's shape, which is wrong.)
at::Tensor pixel_shuffle(const at::Tensor& self, int64_t upscale_factor) {
  return at::native::math_pixel_shuffle(self, upscale_factor)
      .contiguous(self.suggest_memory_format());
}

at::Tensor pixel_unshuffle(const at::Tensor& self, int64_t downscale_factor) {
  return at::native::math_pixel_unshuffle(self, downscale_factor)
      .contiguous(self.suggest_memory_format());
}
//< ch14 pixel-shuffle

}  // namespace
}  // namespace acme

//> ch14 register-fixes
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_batch_norm", TORCH_FN(acme::native_batch_norm));
//> ch14 register-pixel-shuffle
  m.impl("pixel_shuffle", TORCH_FN(acme::pixel_shuffle));
  m.impl("pixel_unshuffle", TORCH_FN(acme::pixel_unshuffle));
//< ch14 register-pixel-shuffle
}
//< ch14 register-fixes

//@ ch04
// Autocast: inside torch.autocast("privateuseone"), an op on acme tensors first
// meets the AutocastPrivateUse1 dispatch key. acme's kernels there cast the
// inputs as the op's policy says, then call the op again below autocast.
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "aten/autocast.h"

namespace acme {
namespace {

using at::autocast::CastPolicy;
constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch04 policies
// The single list of acme's autocast policies. The registrations and the table
// Python reads (autocast_rules) both expand it, so they cannot disagree.
// OP(name, policy) is the op's default overload; OVERLOAD names another one.
#define ACME_AUTOCAST_POLICIES(OP, OVERLOAD)                     \
  /* Matmul-like: the work the low-precision units are for. */   \
  OP(mm, lower_precision_fp)                                     \
  OP(bmm, lower_precision_fp)                                    \
  OP(addmm, lower_precision_fp)                                  \
  OP(baddbmm, lower_precision_fp)                                \
  OP(matmul, lower_precision_fp)                                 \
  OP(linear, lower_precision_fp)                                 \
  /* Range or precision sensitive: computed in float32. */       \
  OP(exp, fp32)                                                  \
  OP(log, fp32)                                                  \
  OP(rsqrt, fp32)                                                \
  OVERLOAD(pow, Tensor_Scalar, fp32)                             \
  OP(layer_norm, fp32)                                           \
  OP(mse_loss, fp32)                                             \
  OP(binary_cross_entropy_with_logits, fp32)                     \
  /* Reductions with a dtype= argument: autocast fills it in. */ \
  OVERLOAD(softmax, int, fp32_set_opt_dtype)                     \
  OVERLOAD(log_softmax, int, fp32_set_opt_dtype)                 \
  OP(sum, fp32_set_opt_dtype)                                    \
  OVERLOAD(sum, dim_IntList, fp32_set_opt_dtype)                 \
  OP(cumsum, fp32_set_opt_dtype)                                 \
  /* Several inputs of possibly different types: the widest. */  \
  OP(cat, promote)                                               \
  OP(stack, promote)                                             \
  OP(addcmul, promote)                                           \
  OP(addcdiv, promote)                                           \
  OP(dot, promote)
//< ch04 policies

//> ch04 dtypes
constexpr c10::ScalarType kAutocastDtypes[] = {c10::ScalarType::Half,
                                               c10::ScalarType::BFloat16};

// torch.autocast checks the dtype against torch.privateuseone's list, but the
// state it sets can also be set directly (torch.set_autocast_dtype). Upstream's
// wrappers would then cast to whatever is set, float64 or int8 included.
void check_autocast_dtype() {
  const c10::ScalarType dtype = at::autocast::get_autocast_dtype(kAcme);
  if (std::ranges::find(kAutocastDtypes, dtype) != std::end(kAutocastDtypes)) return;
  std::string supported;
  for (const auto candidate : kAutocastDtypes) {
    supported += supported.empty() ? "torch." : " or torch.";
    supported += c10::getDtypeNames(candidate).first;
  }
  TORCH_CHECK_VALUE(false, kAcme, " autocast: torch.", c10::getDtypeNames(dtype).first,
                    " is not a lower-precision dtype ", kAcme, " supports; use ", supported);
}
//< ch04 dtypes

//> ch04 kernel
// One kernel per (op, policy): check the autocast dtype, then run upstream's
// policy wrapper, which excludes AutocastPrivateUse1, casts the arguments and
// calls the op again from the top of the dispatcher.
template <CastPolicy policy, class Signature, Signature* F>
struct AutocastKernel;

template <CastPolicy policy, class Ret, class... Args, Ret (*F)(Args...)>
struct AutocastKernel<policy, Ret(Args...), F> {
  using Wrapped =
      typename at::autocast::WrapFunction<policy, kAcme, Ret(Args...), Ret(Args...), F>::type;

  static Ret call(Args... args) {
    check_autocast_dtype();
    return Wrapped::call(args...);
  }
};
//< ch04 kernel

//> ch04 rules
#define ACME_RULE(op, policy) AutocastRule{"aten::" #op, #policy},
#define ACME_RULE_OVERLOAD(op, overload, policy) \
  AutocastRule{"aten::" #op "." #overload, #policy},
constexpr AutocastRule kRules[] = {ACME_AUTOCAST_POLICIES(ACME_RULE, ACME_RULE_OVERLOAD)};
#undef ACME_RULE
#undef ACME_RULE_OVERLOAD
//< ch04 rules

}  // namespace

std::span<const AutocastRule> autocast_rules() { return kRules; }

std::span<const c10::ScalarType> autocast_dtypes() { return kAutocastDtypes; }

}  // namespace acme

//> ch04 register
// ATEN_FN(op) is the op's C++ entry point (at::_ops::op::call); its type is the
// signature the dispatcher checks the registration against.
#define ACME_REGISTER(op, policy)                                              \
  m.impl("aten::" #op,                                                         \
         &acme::AutocastKernel<at::autocast::CastPolicy::policy,               \
                               decltype(ATEN_FN(op)), &ATEN_FN(op)>::call);
#define ACME_REGISTER_OVERLOAD(op, overload, policy)                           \
  m.impl("aten::" #op "." #overload,                                           \
         &acme::AutocastKernel<at::autocast::CastPolicy::policy,               \
                               decltype(ATEN_FN2(op, overload)),               \
                               &ATEN_FN2(op, overload)>::call);

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  ACME_AUTOCAST_POLICIES(ACME_REGISTER, ACME_REGISTER_OVERLOAD)
}
//< ch04 register

//> ch04 fallthrough
// Every other op: nothing to cast, so skip the key and go on to the next one
// (autograd, then the acme kernel or the CPU fallback).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}
//< ch04 fallthrough

//@ ch04
// Autocast: inside torch.autocast("privateuseone"), an op on acme tensors first
// meets the AutocastPrivateUse1 dispatch key. acme's kernels there cast the
// inputs as the op's policy says, then call the op again below autocast.
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "aten/autocast.h"

namespace acme {
namespace {

using at::autocast::CastPolicy;
constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch04 policies
// acme's policies are CUDA's: the op lists PyTorch's own CUDA registration
// expands (AT_FORALL_* in ATen/autocast_mode.h), so each release's list is the
// one acme registers, a loss in float32 included. One entry is (op) or
// (op, overload); ACME_FORALL_POLICIES(X) calls X(policy, entry...) for each,
// and the registrations and the table Python reads both expand it.
#define ACME_LOWER_PRECISION_FP(...) X(lower_precision_fp, __VA_ARGS__)
#define ACME_FP32(...) X(fp32, __VA_ARGS__)
#define ACME_FP32_SET_OPT_DTYPE(...) X(fp32_set_opt_dtype, __VA_ARGS__)
#define ACME_PROMOTE(...) X(promote, __VA_ARGS__)
// CUDA's registration also names a few ops one by one, outside those lists.
// PyTorch 2.14 added one that way: linalg_matrix_sqrth, new in 2.14, in float32.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define ACME_FORALL_FP32_ONE_BY_ONE(_) _(linalg_matrix_sqrth)
#else
#define ACME_FORALL_FP32_ONE_BY_ONE(_)
#endif
#define ACME_FORALL_POLICIES                            \
  AT_FORALL_LOWER_PRECISION_FP(ACME_LOWER_PRECISION_FP) \
  AT_FORALL_FP32(ACME_FP32)                             \
  ACME_FORALL_FP32_ONE_BY_ONE(ACME_FP32)                \
  AT_FORALL_FP32_SET_OPT_DTYPE(ACME_FP32_SET_OPT_DTYPE) \
  AT_FORALL_PROMOTE(ACME_PROMOTE)
// norm's overloads without a dtype= redispatch to the overload with one
// (policy fp32_append_dtype): AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE gives
// (function, "name.overload", registered type, redispatched type, policy).
//< ch04 policies

// An entry's parts: "aten::op" or "aten::op.overload", and ATEN_FN(op) or
// ATEN_FN2(op, overload), the op's C++ entry point.
#define ACME_PICK(_1, _2, NAME, ...) NAME
#define ACME_NAME1(op) "aten::" #op
#define ACME_NAME2(op, overload) "aten::" #op "." #overload
#define ACME_NAME(...) ACME_PICK(__VA_ARGS__, ACME_NAME2, ACME_NAME1)(__VA_ARGS__)
#define ACME_FN(...) ACME_PICK(__VA_ARGS__, ATEN_FN2, ATEN_FN)(__VA_ARGS__)

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
// calls F, the op again from the top of the dispatcher. F's type is the one
// registered, except where the policy appends an argument (fp32_append_dtype).
template <CastPolicy policy, class Registered, class Redispatched, Redispatched* F>
struct AutocastKernel;

template <CastPolicy policy, class Ret, class... Args, class Redispatched, Redispatched* F>
struct AutocastKernel<policy, Ret(Args...), Redispatched, F> {
  using Wrapped =
      typename at::autocast::WrapFunction<policy, kAcme, Ret(Args...), Redispatched, F>::type;

  static Ret call(Args... args) {
    check_autocast_dtype();
    return Wrapped::call(args...);
  }
};
//< ch04 kernel

//> ch04 banned
// binary_cross_entropy has no safe policy: after a sigmoid in float16 its log
// saturates. CUDA's autocast refuses it, with this advice; so does acme's.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
              "autocast (", kAcme, " autocast refuses them, as CUDA's does). Combine the sigmoid "
              "and the loss with torch.nn.functional.binary_cross_entropy_with_logits or "
              "torch.nn.BCEWithLogitsLoss, which are safe; or run the loss outside the autocast "
              "block on float32 inputs.");
}
//< ch04 banned

//> ch04 rules
#define X(policy, ...) AutocastRule{ACME_NAME(__VA_ARGS__), #policy},
#define ACME_APPEND_DTYPE_RULE(fn, name, registered, redispatched, policy) \
  AutocastRule{"aten::" name, #policy},
constexpr AutocastRule kRules[] = {
    ACME_FORALL_POLICIES AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(ACME_APPEND_DTYPE_RULE)
        AutocastRule{"aten::binary_cross_entropy", "banned"}};
#undef X
#undef ACME_APPEND_DTYPE_RULE
//< ch04 rules

}  // namespace

std::span<const AutocastRule> autocast_rules() { return kRules; }

std::span<const c10::ScalarType> autocast_dtypes() { return kAutocastDtypes; }

//> ch04 register
// The append-dtype list names its types as ATen's own sources do.
using at::IntArrayRef;
using at::Scalar;
using at::Tensor;
using c10::ScalarType;

#define X(policy, ...)                                                      \
  m.impl(ACME_NAME(__VA_ARGS__),                                           \
         &AutocastKernel<CastPolicy::policy, decltype(ACME_FN(__VA_ARGS__)), \
                         decltype(ACME_FN(__VA_ARGS__)), &ACME_FN(__VA_ARGS__)>::call);
#define ACME_REGISTER_APPEND_DTYPE(fn, name, registered, redispatched, policy) \
  m.impl("aten::" name,                                                        \
         &AutocastKernel<CastPolicy::policy, registered, redispatched, &fn>::call);

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  ACME_FORALL_POLICIES
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(ACME_REGISTER_APPEND_DTYPE)
  m.impl("aten::binary_cross_entropy", &binary_cross_entropy_banned);
}
#undef X
//< ch04 register

}  // namespace acme

//> ch04 fallthrough
// Every other op: nothing to cast, so skip the key and go on to the next one
// (autograd, then the acme kernel or the CPU fallback).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}
//< ch04 fallthrough

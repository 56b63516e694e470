//@ ch15
// Kernels for operators that belong to someone else's library. A library
// such as torchvision defines its operators (schema and CPU kernel) in its own
// namespace; acme adds a kernel for the device under that namespace, without
// touching the library and without linking it. The dispatcher joins the two
// by name whichever is loaded first. boxkit (tests/third_party/boxkit) plays
// the library here.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/core/stack.h>
#include <torch/csrc/jit/frontend/function_schema_parser.h>
#include <torch/library.h>

#include <vector>

#include "aten/device_views.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

//> ch15 nms-kernel
// acme's nms, written the way a parallel device would: all pairwise overlaps
// at once, then one greedy pass over the sorted boxes. Same contract as the
// library's CPU kernel: kept indices, best first, ties in input order.
at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  TORCH_CHECK(boxes.dim() == 2 && boxes.size(1) == 4, "boxkit::nms: boxes must be (N, 4), got ",
              boxes.sizes());
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == boxes.size(0),
              "boxkit::nms: scores must be (N,) with N = ", boxes.size(0));
  TORCH_CHECK(at::isFloatingType(boxes.scalar_type()) &&
                  boxes.scalar_type() == scores.scalar_type(),
              "boxkit::nms: boxes and scores must have the same floating-point dtype");
  check_same_device("boxkit::nms", boxes.device(), {scores});
  DeviceViews view;
  const at::Tensor b = view(boxes), order = view(scores).argsort(/*stable=*/true, 0, true);
  const at::Tensor x1 = b.select(1, 0), y1 = b.select(1, 1), x2 = b.select(1, 2),
                   y2 = b.select(1, 3);
  const at::Tensor area = (x2 - x1) * (y2 - y1);
  const at::Tensor w = (at::minimum(x2.unsqueeze(1), x2) - at::maximum(x1.unsqueeze(1), x1)).clamp_min(0);
  const at::Tensor h = (at::minimum(y2.unsqueeze(1), y2) - at::maximum(y1.unsqueeze(1), y1)).clamp_min(0);
  const at::Tensor overlap = w * h;
  const at::Tensor suppresses =
      (overlap / (area.unsqueeze(1) + area - overlap) > iou_threshold).contiguous();

  const int64_t n = boxes.size(0);
  const bool* over = suppresses.const_data_ptr<bool>();
  const int64_t* rank = order.const_data_ptr<int64_t>();
  std::vector<int64_t> kept;
  std::vector<char> removed(n, 0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = rank[r];
    if (removed[i]) continue;
    kept.push_back(i);
    for (int64_t j = 0; j < n; ++j) removed[j] |= over[i * n + j];
  }
  at::Tensor result = at::empty({static_cast<int64_t>(kept.size())},
                                boxes.options().dtype(at::kLong));
  if (!kept.empty()) {
    at::Tensor host = at::empty({static_cast<int64_t>(kept.size())}, at::kLong);
    std::copy(kept.begin(), kept.end(), host.mutable_data_ptr<int64_t>());
    view(result).copy_(host);
  }
  return result;
}
//< ch15 nms-kernel

//> ch15 boxed-nms
// The library owns the schema and may change it in its next release. A typed
// kernel (TORCH_FN) carries a schema inferred from its C++ signature, and the
// dispatcher compares the two when the second of them is loaded: a mismatch
// throws from a shared library's static initialiser, which aborts the
// process. Registered boxed, the kernel has no inferred schema; it checks the
// loaded library's schema when called and raises a Python exception instead.
constexpr const char* kNmsSchema =
    "boxkit::nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor";

void nms_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // A loaded library's schema does not change: compared on the first call only.
  static const std::string written_for = c10::toString(torch::jit::parseSchema(kNmsSchema));
  static const std::string loaded = c10::toString(op.schema());
  TORCH_CHECK(loaded == written_for, "The ", c10::DeviceType::PrivateUse1,
              " kernel for boxkit::nms was written for\n  ",
              written_for, "\nbut the loaded library defines\n  ", loaded,
              "\nUpdate csrc/aten/third_party_ops.cpp for this version of the library.");
  const auto args = torch::jit::pop(*stack, 3);
  torch::jit::push(*stack, nms(args[0].toTensor(), args[1].toTensor(), args[2].toDouble()));
}
//< ch15 boxed-nms

}  // namespace

//> ch15 register-nms
TORCH_LIBRARY_IMPL(boxkit, PrivateUse1, m) {
  m.impl("nms", torch::CppFunction::makeFromBoxedFunction<&nms_boxed>());
}
//< ch15 register-nms

//> ch15 nms-fallthrough
// nms returns indices, which cannot carry a gradient. A fallthrough at the
// autograd key skips the key instead of running PyTorch's autograd fallback,
// a boxed kernel that inspects every call (and refuses it in "error" mode).
// Only for outputs that cannot require grad: on a floating output a
// fallthrough drops the gradient silently (see custom_ops.cpp instead).
TORCH_LIBRARY_IMPL(boxkit, AutogradPrivateUse1, m) {
  m.impl("nms", torch::CppFunction::makeFallthrough());
}
//< ch15 nms-fallthrough

}  // namespace acme

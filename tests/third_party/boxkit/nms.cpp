// boxkit: a stand-in for a third-party library with compiled operators of its
// own, shaped like torchvision. It defines boxkit::nms and ships a CPU kernel
// only; it knows nothing about acme. (Built by tools/build_stages.py into
// _build/third_party/boxkit; it is not part of the acme backend.)
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

// Non-maximum suppression: walk the boxes (x1, y1, x2, y2) from the highest
// score down, keep a box unless it overlaps an already kept one by more than
// `iou_threshold` (intersection over union). Returns the kept indices, best
// first; equal scores keep their input order.
at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  TORCH_CHECK(boxes.dim() == 2 && boxes.size(1) == 4, "boxkit::nms: boxes must be (N, 4), got ",
              boxes.sizes());
  TORCH_CHECK(scores.dim() == 1 && scores.size(0) == boxes.size(0),
              "boxkit::nms: scores must be (N,) with N = ", boxes.size(0));
  TORCH_CHECK(boxes.scalar_type() == scores.scalar_type(),
              "boxkit::nms: boxes and scores must have the same dtype");
  const int64_t n = boxes.size(0);
  std::vector<int64_t> kept;
  AT_DISPATCH_FLOATING_TYPES(boxes.scalar_type(), "boxkit::nms", [&] {
    const auto b = boxes.contiguous();
    const auto s = scores.contiguous();
    const scalar_t* box = b.const_data_ptr<scalar_t>();
    const scalar_t* score = s.const_data_ptr<scalar_t>();
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t i, int64_t j) { return score[i] > score[j]; });
    auto area = [&](int64_t i) {
      return (box[4 * i + 2] - box[4 * i]) * (box[4 * i + 3] - box[4 * i + 1]);
    };
    for (const int64_t i : order) {
      bool keep = true;
      for (const int64_t k : kept) {
        const scalar_t w = std::max<scalar_t>(
            0, std::min(box[4 * i + 2], box[4 * k + 2]) - std::max(box[4 * i], box[4 * k]));
        const scalar_t h = std::max<scalar_t>(
            0, std::min(box[4 * i + 3], box[4 * k + 3]) - std::max(box[4 * i + 1], box[4 * k + 1]));
        const scalar_t overlap = w * h;
        if (overlap / (area(i) + area(k) - overlap) > iou_threshold) {
          keep = false;
          break;
        }
      }
      if (keep) kept.push_back(i);
    }
  });
  at::Tensor result = at::empty({static_cast<int64_t>(kept.size())}, boxes.options().dtype(at::kLong));
  std::copy(kept.begin(), kept.end(), result.mutable_data_ptr<int64_t>());
  return result;
}

}  // namespace

TORCH_LIBRARY(boxkit, m) {
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor");
}

TORCH_LIBRARY_IMPL(boxkit, CPU, m) { m.impl("nms", TORCH_FN(nms_cpu)); }

//@ ch18
// index_select, the op behind nn.Embedding: a native kernel whose failure
// depends on the data. An index out of range is found only by the kernel, on
// the stream, after the call returned (chapter 18); CUDA reports the same bug
// as a device-side assert.
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include "aten/device_views.h"
#include "aten/launch.h"
#include "aten/routed_ops.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

// What the CPU checks before it looks at a single index, here on the host, so
// that these mistakes still raise where they are made.
void check_arguments(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  check_same_device("aten::index_select", self.device(), {index});
  TORCH_CHECK_INDEX(index.dim() <= 1, "index_select(): Index is supposed to be a vector");
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
              "index_select(): Expected dtype int32 or int64 for index");
  TORCH_CHECK_INDEX(self.dim() > 0 || dim == 0 || dim == -1,
                    "index_select(): Index out of range for a 0-dimensional tensor");
}

at::Tensor& index_select_out(const at::Tensor& self, int64_t dim, const at::Tensor& index,
                             at::Tensor& out) {
  check_arguments(self, dim, index);
  check_same_device("aten::index_select", self.device(), {out});
  const int64_t wrapped = c10::maybe_wrap_dim(dim, self.dim());
  c10::SmallVector<int64_t, 6> sizes(self.sizes().begin(), self.sizes().end());
  if (self.dim() > 0) sizes[wrapped] = index.numel();
  at::native::resize_output(out, sizes);
  if (out.numel() == 0) return out;
  // The indices are checked by the kernel, against the data, on the stream.
  DeviceViews view(DeviceViews::kForLaunch);
  launch_kernel(self.device().index(), "aten::index_select", [source = view(self), wrapped, indices = view(index), result = view(out)] {
                  at::Tensor destination = result;
                  at::index_select_out(destination, source, wrapped, indices);
                });
  return out;
}

at::Tensor index_select(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  at::Tensor out = at::empty({0}, self.options());
  return index_select_out(self, dim, index, out);
}

}  // namespace
}  // namespace acme

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("index_select", TORCH_FN(acme::index_select));
  m.impl("index_select.out", TORCH_FN(acme::index_select_out));
}

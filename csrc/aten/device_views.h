//@ ch10
// Device memory seen as CPU tensors, for kernels that borrow PyTorch's CPU
// arithmetic: native kernels now, routed ops later.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <utility>

#include "aten/acme_check.h"
//> ch18 views-include
#include "aten/launch.h"
//< ch18 views-include
//> ch23 views-sizes-include
#include "aten/kernel_threads.h"
//< ch23 views-sizes-include

namespace acme {

//> ch10 views
// Where a kernel "running on the device" reads and writes a device pointer.
inline void* device_address(const void* device_pointer) {
  void* view = nullptr;
  ACME_CHECK(acmeDeviceAccess(&view, device_pointer));
  return view;
}

// CPU tensors that alias device memory through its device-side view: same
// sizes, strides, storage offset and dtype, no copy. Tensors sharing a device
// storage get views sharing one CPU storage, so the CPU kernels' own aliasing
// and overlap checks still see what aliases what. Views live for one kernel
// call; the device tensors they alias outlive it.
class DeviceViews {
 public:
//> ch18 views-modes
  // From chapter 18 kernels run later, on a stream. Host code that reads or
  // writes device memory through views first waits for the stream's earlier
  // kernels; a kernel being launched takes its views without waiting, since
  // the stream orders it after them anyway.
  enum Mode { kHostAccess, kForLaunch };
  explicit DeviceViews(Mode mode = kHostAccess) : mode_(mode) {}

//< ch18 views-modes
//> ch23 views-sizes
  // A launch's views tell it its size (kernel_threads.h); views that launched
  // nothing leave none behind for the next launch.
  ~DeviceViews() {
    if (mode_ == kForLaunch) forget_kernel_elements();
  }
  DeviceViews(const DeviceViews&) = delete;
  DeviceViews& operator=(const DeviceViews&) = delete;

//< ch23 views-sizes
  at::Tensor operator()(const at::TensorBase& t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return at::Tensor(t);
//> ch23 views-note
    if (mode_ == kForLaunch) note_kernel_elements(t.numel());
//< ch23 views-note
    for (const auto& [impl, view] : tensors_)
      if (impl == t.unsafeGetTensorImpl()) return view;
    at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
        storage_of(t), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
    auto* impl = view.unsafeGetTensorImpl();
    impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    impl->_set_conj(t.is_conj());  // lazy conjugation and negation travel along
    impl->_set_neg(t.is_neg());
    tensors_.emplace_back(t.unsafeGetTensorImpl(), view);
    return view;
  }

  // The CPU storage over the device-side view of t's storage: one for each
  // device storage, shared by every view of it.
  c10::Storage storage_of(const at::TensorBase& t) {
    const c10::StorageImpl* device_storage = t.storage().unsafeGetStorageImpl();
    for (const auto& [impl, storage] : storages_)
      if (impl == device_storage) return storage;
    const size_t nbytes = t.storage().nbytes();
//> ch18 views-wait
    if (mode_ == kHostAccess && nbytes > 0) wait_for_stream(t.device().index());
//< ch18 views-wait
    void* view = nbytes == 0 ? nullptr : device_address(t.storage().data());
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                         c10::DataPtr(view, c10::Device(c10::kCPU)),
                         /*allocator=*/nullptr, /*resizable=*/false);
    storages_.emplace_back(device_storage, storage);
    return storage;
  }

 private:
  c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 4> storages_;
  c10::SmallVector<std::pair<const c10::TensorImpl*, at::Tensor>, 4> tensors_;
//> ch18 views-mode-member
  Mode mode_;
//< ch18 views-mode-member
};
//< ch10 views

//> ch10 device-check
// Device views pass CPU tensors through untouched, so a kernel that uses them
// first refuses a tensor of another device, with the message PyTorch's own
// kernels give. Every acme kernel's check ends here.
inline void check_device(const char* op, c10::Device expected, const at::TensorBase& t) {
  TORCH_CHECK(!t.defined() || t.device() == expected,
              "Expected all tensors to be on the same device, but found at least two "
              "devices, ", expected, " and ", t.device(), "! (in the ",
              c10::DeviceType::PrivateUse1, " kernel for ", op, ")");
}
//< ch10 device-check

}  // namespace acme

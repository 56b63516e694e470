//@ ch16
// acme's StorageImpl: the storage of every acme tensor, carrying what the
// backend knows about the memory itself (as opposed to one tensor's view of
// it, which is BackendMeta's place: chapter 7).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdint>
#include <optional>

namespace acme {

struct AcmeStorageImpl final : c10::StorageImpl {
  using c10::StorageImpl::StorageImpl;

  // How many times this memory has been sent to another process.
  std::atomic<int64_t> times_shared{0};
  // For memory opened from another process's handle: that process's id.
  int64_t shared_by_pid = 0;
};

// The AcmeStorageImpl behind an acme storage (every acme storage has one).
AcmeStorageImpl& acme_storage(const c10::Storage& storage);

// New acme tensors on the current device, as at::detail::empty_generic and
// empty_strided_generic make them, but with their storage made through
// c10::make_storage_impl, which those two do not call.
at::Tensor empty_acme(c10::IntArrayRef sizes, c10::ScalarType dtype,
                      std::optional<c10::MemoryFormat> memory_format);
at::Tensor empty_strided_acme(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                              c10::ScalarType dtype);

}  // namespace acme

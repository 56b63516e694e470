//@ ch16
// Registering acme's StorageImpl: c10::make_storage_impl, which PyTorch calls
// whenever it creates a storage for a device (empty tensors, torch.UntypedStorage,
// torch.load), asks this function for PrivateUse1.
#include "aten/storage.h"

#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>

#include "aten/allocator.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

//> ch16 storage-create
c10::intrusive_ptr<c10::StorageImpl> make_acme_storage(c10::StorageImpl::use_byte_size_t,
                                                       c10::SymInt size_bytes,
                                                       c10::DataPtr data_ptr,
                                                       c10::Allocator* allocator,
                                                       bool resizable) {
  // torch.UntypedStorage(n, device=...) passes no memory: allocate it here.
  if (data_ptr.get() == nullptr && allocator != nullptr)
    data_ptr = allocator->allocate(size_bytes.expect_int());
  return c10::make_intrusive<AcmeStorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                              std::move(size_bytes), std::move(data_ptr),
                                              allocator, resizable);
}

// Static registration, like the others: before the first acme storage exists.
const bool registered = [] {
  c10::SetStorageImplCreate(c10::DeviceType::PrivateUse1, &make_acme_storage);
  return true;
}();
//< ch16 storage-create

//> ch16 empty
at::Tensor tensor_with_storage(size_t nbytes, c10::ScalarType dtype) {
  c10::Allocator* allocator = device_allocator();
  c10::DataPtr data = allocator->allocate(nbytes);
  const c10::Device device = data.device();
  c10::Storage storage(c10::make_storage_impl(c10::StorageImpl::use_byte_size_t(),
                                              static_cast<int64_t>(nbytes), std::move(data),
                                              allocator, /*resizable=*/true, device));
  return at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(dtype));
}
//< ch16 empty

}  // namespace

//> ch16 empty-tensors
at::Tensor empty_acme(c10::IntArrayRef sizes, c10::ScalarType dtype,
                      std::optional<c10::MemoryFormat> memory_format) {
  at::detail::check_size_nonnegative(sizes);
  const size_t nbytes =
      at::detail::computeStorageNbytesContiguous(sizes, c10::elementSize(dtype));
  at::Tensor t = tensor_with_storage(nbytes, dtype);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  if (memory_format && *memory_format != c10::MemoryFormat::Contiguous)
    t.unsafeGetTensorImpl()->empty_tensor_restride(*memory_format);
  return t;
}

at::Tensor empty_strided_acme(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                              c10::ScalarType dtype) {
  at::detail::check_size_nonnegative(sizes);
  const size_t nbytes = at::detail::computeStorageNbytes(sizes, strides, c10::elementSize(dtype));
  at::Tensor t = tensor_with_storage(nbytes, dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  return t;
}
//< ch16 empty-tensors

AcmeStorageImpl& acme_storage(const c10::Storage& storage) {
  auto* impl = dynamic_cast<AcmeStorageImpl*>(storage.unsafeGetStorageImpl());
  TORCH_CHECK(impl != nullptr, kAcme, ": expected a storage made by the ", kAcme,
              " backend's StorageImpl, got one on ", storage.device());
  return *impl;
}

}  // namespace acme

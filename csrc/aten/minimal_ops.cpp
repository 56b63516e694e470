//@ ch01
// The minimal op set: the twelve kernels PyTorch needs before an acme tensor
// can be created, viewed, copied to and from the CPU, and read back.
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include "aten/acme_check.h"
#include "aten/allocator.h"
//> ch18 copies-includes
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "aten/launch.h"
#include "aten/pinned_memory.h"
//< ch18 copies-includes
//> ch16 storage-include
#include "aten/storage.h"
//< ch16 storage-include
//> ch23 index-checks-include
#include "aten/index_checks.h"
//< ch23 index-checks-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name
const c10::DispatchKeySet kAcmeKeys{c10::DispatchKey::PrivateUse1};

//> ch01 empty
at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                 std::optional<at::Layout> layout, std::optional<at::Device> device,
                 std::optional<bool> pin_memory,
                 std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), kAcme, " tensors cannot be pinned");
  // The allocator serves the current device: make it the requested one.
  const c10::OptionalDeviceGuard guard(device);
//> ch01 empty-generic < ch16 empty-acme
//   return at::detail::empty_generic(size, device_allocator(), kAcmeKeys,
//                                    c10::dtype_or_default(dtype), memory_format);
//< ch01 empty-generic
//> ch16 empty-acme
  return empty_acme(size, c10::dtype_or_default(dtype), memory_format);
//< ch16 empty-acme
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout,
                         std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), kAcme, " tensors cannot be pinned");
  const c10::OptionalDeviceGuard guard(device);
//> ch01 empty-strided-generic < ch16 empty-strided-acme
//   return at::detail::empty_strided_generic(size, stride, device_allocator(),
//                                            kAcmeKeys, c10::dtype_or_default(dtype));
//< ch01 empty-strided-generic
//> ch16 empty-strided-acme
  return empty_strided_acme(size, stride, c10::dtype_or_default(dtype));
//< ch16 empty-strided-acme
}
//< ch01 empty

//> ch01 views
// Views share the device storage and only change sizes, strides and offset:
// the device-independent implementations in ATen do exactly that.
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size,
                      c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size,
                         c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}
//< ch01 views

//> ch01 resize
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  // Same shape: keep the layout. A strided view stays a view (the CPU fallback
  // "resizes" every out= argument, views included, to the shape it already has).
  if (self.sizes() == size && !memory_format) return self;
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format) impl->empty_tensor_restride(*memory_format);
  const size_t needed = at::detail::computeStorageNbytes(
      self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  const c10::Storage& storage = self.storage();
  if (needed > storage.nbytes()) {
    TORCH_CHECK(storage.resizable(), kAcme, ": cannot resize a storage that is not resizable");
    // Grow: allocate on the storage's device, keep the old bytes.
    const c10::DeviceGuard guard(self.device());
    c10::DataPtr fresh = device_allocator()->allocate(needed);
    if (storage.nbytes() > 0) {
      ACME_CHECK(acmeMemcpy(fresh.get(), storage.data(), storage.nbytes(),
                            acmeMemcpyDeviceToDevice));
    }
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(needed);
  }
  return self;
}
//< ch01 resize

//> ch01 set
at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source,
                               int64_t storage_offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  // A storage on another device would leave an acme tensor pointing at memory
  // acme cannot reach (PyTorch's own check; CPU and CUDA kernels run it too).
  at::native::checkSetStorage(self, source, storage_offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(source));
  // An empty stride list means "contiguous".
  const auto contiguous = c10::contiguous_strides(size);
  at::native::setStrided(self, size, stride.empty() ? c10::IntArrayRef(contiguous) : stride,
                         storage_offset);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage_offset(self, source.storage(), source.storage_offset(),
                            source.sizes(), source.strides());
}
//< ch01 set

//> ch01 copy
//> ch01 copy-bytes < ch18 copy-bytes
// // Every copy below moves its bytes here, synchronously (chapter 18 puts
// // them on a stream).
// void copy_bytes(void* dst, const void* src, size_t count, acmeMemcpyKind kind) {
//   ACME_CHECK(acmeMemcpy(dst, src, count, kind));
// }
//< ch01 copy-bytes
//> ch18 copy-bytes
// Every copy below moves its bytes here, on the current stream of the device
// whose memory it touches. A copy into host memory returns once the bytes are
// there (the runtime waits for the stream); one from the host returns once
// the runtime has staged them, and a pinned source, which the runtime does
// not stage, waits for the copy. Between two devices, each side's stream
// waits for the other's, so neither reads or reuses memory too early.
void copy_bytes(void* dst, const void* src, size_t count, acmeMemcpyKind kind) {
  auto device_of = [](const void* p) {
    acmePointerAttributes attributes;
    ACME_CHECK(acmePointerGetAttributes(&attributes, p));
    return static_cast<c10::DeviceIndex>(attributes.device);
  };
  const c10::DeviceIndex to = kind == acmeMemcpyDeviceToHost ? -1 : device_of(dst);
  const c10::DeviceIndex from = kind == acmeMemcpyHostToDevice ? -1 : device_of(src);
  const c10::DeviceIndex device = to >= 0 ? to : from;
  if (to >= 0 && from >= 0) stream_wait(to, from);
  const acmeStream_t stream = current_stream(device);
  ACME_CHECK(acmeMemcpyAsync(dst, src, count, kind, stream));
  if (to >= 0 && from >= 0) stream_wait(from, to);
  const void* host = from < 0 ? src : to < 0 ? dst : nullptr;
  if (host && is_pinned(host)) ACME_CHECK(acmeStreamSynchronize(stream));
}
//< ch18 copy-bytes

// The byte range of the storage a (possibly strided) tensor covers.
struct Extent {
  int64_t first;  // in elements, from the start of the storage
  int64_t length;
};

Extent extent_of(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset(), t.numel() == 0 ? 0 : last + 1};
}

char* storage_bytes(const at::Tensor& t, int64_t first_element) {
  return static_cast<char*>(t.storage().mutable_data()) + first_element * t.element_size();
}

// Lazy conjugate / negative views (t.conj() on complex tensors) keep the raw
// bytes and set a bit; the bytes moved by memcpy are raw.
bool has_lazy_bits(const at::Tensor& t) { return t.is_conj() || t.is_neg(); }

// A CPU tensor with the same sizes, strides and lazy bits as the device tensor
// `t`, filled by copying the storage range `t` covers (one memcpy).
at::Tensor to_host(const at::Tensor& t) {
  const Extent e = extent_of(t);
  at::Tensor host = at::empty({e.length}, t.options().device(at::kCPU));
  copy_bytes(host.data_ptr(), storage_bytes(t, e.first), e.length * t.element_size(),
             acmeMemcpyDeviceToHost);
  host = host.as_strided(t.sizes(), t.strides(), 0);
  if (t.is_conj()) host = host.conj();
  if (t.is_neg()) host = host._neg_view();
  return host;
}

// Writes a CPU tensor into the device tensor `dst` (any layout, any dtype).
void from_host(const at::Tensor& src, const at::Tensor& dst) {
  if (dst.is_non_overlapping_and_dense() && dst.is_contiguous() && !has_lazy_bits(dst)) {
    // The common case: one memcpy of a contiguous, converted source.
    const at::Tensor ready = src.to(dst.scalar_type()).resolve_conj().resolve_neg().contiguous();
    copy_bytes(dst.data_ptr(), ready.const_data_ptr(), dst.nbytes(), acmeMemcpyHostToDevice);
    return;
  }
  // Strided destination: read the range it covers, update it on the host with
  // the CPU's copy_, write the range back. Bytes between elements survive.
  const at::Tensor staging = to_host(dst);
  staging.copy_(src);
  const Extent e = extent_of(dst);
  copy_bytes(storage_bytes(dst, e.first), staging.storage().data(),
             e.length * dst.element_size(), acmeMemcpyHostToDevice);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), kAcme, " copy: undefined tensor");
  // copy_ broadcasts its source; the device paths below want equal shapes.
  at::Tensor src = self;
  if (src.sizes() != dst.sizes()) {
    TORCH_CHECK(at::is_expandable_to(src.sizes(), dst.sizes()),
                kAcme, " copy: source of shape ", src.sizes(),
                " cannot be copied into a destination of shape ", dst.sizes());
    src = src.expand(dst.sizes());
  }
  if (dst.numel() == 0) return dst;

  const bool src_on_acme = src.device().type() == c10::DeviceType::PrivateUse1;
  const bool dst_on_acme = dst.device().type() == c10::DeviceType::PrivateUse1;
//> ch18 non-blocking
  // non_blocking=True between the device and pinned memory: the one copy that
  // returns before its bytes moved. The pinned block is not handed out again
  // until the stream has passed the copy (PyTorch's host allocator waits for
  // the event record_event leaves).
  const at::Tensor& host_side = src_on_acme ? dst : src;
  if (non_blocking && src_on_acme != dst_on_acme && is_pinned(host_side.const_data_ptr()) &&
      src.scalar_type() == dst.scalar_type() && src.is_contiguous() && dst.is_contiguous() &&
      !has_lazy_bits(src) && !has_lazy_bits(dst)) {
    const at::Tensor& device_side = src_on_acme ? src : dst;
    const c10::DeviceIndex device = device_side.device().index();
    ACME_CHECK(acmeMemcpyAsync(dst.data_ptr(), src.const_data_ptr(), dst.nbytes(),
                               src_on_acme ? acmeMemcpyDeviceToHost : acmeMemcpyHostToDevice,
                               current_stream(device)));
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)
                                   ->getStream(device_side.device());
    at::getHostAllocator(c10::DeviceType::PrivateUse1)
        ->record_event(const_cast<void*>(host_side.const_data_ptr()),
                       host_side.storage().data_ptr().get_context(), stream);
//> ch23 note-pinned-copy
    if (dst_on_acme) note_copied_from_host(dst);  // index_checks.h
//< ch23 note-pinned-copy
    return dst;
  }
//< ch18 non-blocking
  if (src_on_acme && !dst_on_acme) {
    dst.copy_(to_host(src));  // the CPU's copy_ converts dtype and layout
  } else if (!src_on_acme && dst_on_acme) {
    from_host(src, dst);
//> ch23 note-copy
    note_copied_from_host(dst);
//< ch23 note-copy
  } else {
    const bool same_layout = src.scalar_type() == dst.scalar_type() &&
                             src.is_contiguous() && dst.is_contiguous() &&
                             !has_lazy_bits(src) && !has_lazy_bits(dst);
    if (same_layout) {
      copy_bytes(dst.data_ptr(), src.const_data_ptr(), dst.nbytes(), acmeMemcpyDeviceToDevice);
    } else {
      from_host(to_host(src), dst);  // convert on the host (no device kernels yet)
    }
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  // The CPU fallback calls this for out= arguments: the result decides the
  // shape, and an out= tensor that has to be resized takes the result's
  // strides as well, as the CPU kernel's own resize does (a column-major
  // LAPACK result stays so); one of the right shape keeps its own.
  const bool resized = dst.sizes() != self.sizes();
  dst.resize_(self.sizes());
  if (resized && self.is_non_overlapping_and_dense()) {
    dst.unsafeGetTensorImpl()->set_sizes_and_strides(self.sizes(), self.strides());
  }
  return copy_from(self, dst, false);
}

c10::Scalar local_scalar_dense(const at::Tensor& self) {
  // tensor.item(): bring one element to the host, then read it there.
  at::Tensor host = at::empty({}, self.options().device(at::kCPU));
  copy_bytes(host.data_ptr(), self.const_data_ptr(), self.element_size(),
             acmeMemcpyDeviceToHost);
  return at::_local_scalar_dense(host);
}
//< ch01 copy

}  // namespace

//> ch01 register
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(empty));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
}

// The copies handle lazy conjugate/negative views themselves (to_host above).
// Without these fallthroughs, PyTorch's Conjugate fallback would resolve the
// view with a clone, whose copy calls _copy_from again: endless recursion.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
//< ch01 register

}  // namespace acme

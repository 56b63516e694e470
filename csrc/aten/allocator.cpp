//@ ch01 < ch12
// The device allocator: how PyTorch gets acme memory for every tensor storage.
// Chapter 12 replaces it with a caching allocator (caching_allocator.cpp).
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include "aten/acme_check.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

void free_device_memory(void* ptr) {
  // A deleter runs inside destructors: it must not throw. A failure here means
  // the pointer was not ours, which is a bug worth a loud message.
  const acmeError_t err = acmeFree(ptr);
  if (err != acmeSuccess) {
    TORCH_WARN(kAcme, ": freeing device memory failed: ", acmeGetErrorName(err),
               ": ", acmeGetLastErrorMessage());
  }
}

struct AcmeAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    // Memory goes to the current device: ops set it with a DeviceGuard first.
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    void* ptr = nullptr;
    const acmeError_t err = acmeMalloc(&ptr, nbytes);
    // Out-of-memory gets PyTorch's own exception type (torch.OutOfMemoryError),
    // so callers can catch it exactly as they do for CUDA.
    TORCH_CHECK_WITH(OutOfMemoryError, err != acmeErrorMemoryAllocation,
                     kAcme, " out of memory: ", acmeGetLastErrorMessage());
    ACME_CHECK(err);
    return {ptr, ptr, &free_device_memory,
            c10::Device(c10::DeviceType::PrivateUse1, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_device_memory; }

  // Used by PyTorch to clone a storage: both sides live on the device.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    ACME_CHECK(acmeMemcpy(dest, src, count, acmeMemcpyDeviceToDevice));
  }
};

AcmeAllocator allocator;

}  // namespace

c10::Allocator* device_allocator() { return &allocator; }

}  // namespace acme

// Makes c10::GetAllocator(PrivateUse1) return ours, e.g. for storage resizes.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &acme::allocator);

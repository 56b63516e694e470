//@ ch03
// The PrivateUse1 hooks: PyTorch's generic questions about an accelerator
// ("is it available?", "which device is current?"). The autograd engine asks
// them before it runs a backward pass on the device, so backward() needs them.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceType.h>
//> ch05 hooks-generator-includes
#include "aten/generator.h"
//< ch05 hooks-generator-includes

//> ch11 hooks-includes
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <atomic>

#include "aten/pinned_memory.h"
#include "runtime/acme_device.h"
//< ch11 hooks-includes
#include "aten/acme_check.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

//> ch11 initialized-flag
// Set once init() has succeeded: PyTorch calls init() at most once per
// process (at::Context::lazyInitDevice), and retries it if it threw.
std::atomic<bool> initialized{false};

//< ch11 initialized-flag
struct AcmeHooks final : at::PrivateUse1HooksInterface {
  // Both must never throw: PyTorch calls them just to find out.
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return deviceCount() > 0; }

  c10::DeviceIndex deviceCount() const override {
    int count = 0;
    return acmeGetDeviceCount(&count) == acmeSuccess ? static_cast<c10::DeviceIndex>(count) : 0;
  }

//> ch03 context < ch11 context
//   // acme needs no per-device context: a valid device is always ready.
//   bool hasPrimaryContext(c10::DeviceIndex device) const override {
//     return device >= 0 && device < deviceCount();
//   }
//
//   void init() const override {}
//< ch03 context
//> ch11 context
  // "Has this device been set up?": true once the backend is initialized.
  bool hasPrimaryContext(c10::DeviceIndex device) const override {
    return initialized.load() && device >= 0 && device < deviceCount();
  }

  // Lazy initialization: PyTorch calls this before it first needs the device
  // (a generator, a pinned allocation, a pointer's device), and the device
  // module's _lazy_init calls it before the first tensor. It raises, with the
  // runtime's message, when there is no device or the process is a child of
  // fork() whose parent had initialized acme.
  void init() const override {
    ACME_CHECK(acmeInit());
    initialized.store(true);
  }
//< ch11 context

  c10::DeviceIndex getCurrentDevice() const override {
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    return static_cast<c10::DeviceIndex>(device);
  }

  void setCurrentDevice(c10::DeviceIndex device) const override {
    ACME_CHECK(acmeSetDevice(device));
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex previous = getCurrentDevice();
    if (device != previous) setCurrentDevice(device);
    return previous;
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  at::Device getDeviceFromPtr(void* data) const override {
    acmePointerAttributes attributes{};
    ACME_CHECK(acmePointerGetAttributes(&attributes, data));
    TORCH_CHECK(attributes.isDevice, kAcme, ": ", data, " is not ", kAcme, " device memory");
    return {c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(attributes.device)};
  }
//> ch11 hooks-memory

  // Pinned host memory: tensor.pin_memory(), is_pinned() and the non_blocking
  // copies to the CPU ask for these.
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }

  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }

  // untyped_storage().resize_(n) on the device: a new allocation of n bytes on
  // the storage's device, the old bytes copied over (as many as fit).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), kAcme, ": cannot resize this storage: it is not resizable "
                "(its memory was not allocated by the ", kAcme, " allocator, e.g. from_blob)");
    const size_t keep = std::min(newsize, impl->nbytes());
    c10::DeviceGuard guard(impl->device());
    at::DataPtr fresh = impl->allocator()->allocate(newsize);
    if (keep > 0) {
      ACME_CHECK(acmeMemcpy(fresh.get(), impl->data(), keep, acmeMemcpyDeviceToDevice));
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
//< ch11 hooks-memory
//> ch05 hooks-generator

  // The current route for random numbers (PyTorch 2.13 to 2.15): default and new
  // generators come from the hooks.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }

  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return new_generator(device);
  }
//< ch05 hooks-generator
};

// Registered when the library loads, like every other registration here.
const bool registered = [] {
  //> ch03 backend-name < ch08 -
  // // PyTorch only believes an accelerator is present (torch.accelerator, the
  // // autograd engine's device threads) once the PrivateUse1 backend is
  // // registered by name, even under its default name. (From chapter 8 on the
  // // Python package registers the real name, before this library loads.)
  // // Skipped if the user renamed it first: a second name would throw, and abort here.
  // if (!c10::is_privateuse1_backend_registered()) {
  //   c10::register_privateuse1_backend("privateuseone");
  // }
  //< ch03 backend-name
  at::RegisterPrivateUse1HooksInterface(new AcmeHooks());
  return true;
}();

}  // namespace
}  // namespace acme

//@ ch01
// The device guard: how PyTorch asks "which acme device is current?" and
// switches it around an op (c10::DeviceGuard). Creating a tensor needs it.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "aten/acme_check.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

struct AcmeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kAcme; }

  c10::Device getDevice() const override {
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    return {kAcme, static_cast<c10::DeviceIndex>(device)};
  }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kAcme, "acme guard got a ", device.type(), " device");
    ACME_CHECK(acmeSetDevice(device.index()));
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device previous = getDevice();
    if (previous.index() != device.index()) setDevice(device);
    return previous;
  }

  // Called while unwinding a guard: it must not throw.
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    (void)acmeSetDevice(device.index());
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    int count = 0;
    return acmeGetDeviceCount(&count) == acmeSuccess
               ? static_cast<c10::DeviceIndex>(count)
               : 0;
  }

//> ch01 one-stream
  // Until streams exist (chapter 6) every device has one, synchronous,
  // default stream; PyTorch still asks for it by name.
  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }

  c10::Stream exchangeStream(c10::Stream stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
  }
//< ch01 one-stream
};

}  // namespace
}  // namespace acme

C10_REGISTER_GUARD_IMPL(PrivateUse1, acme::AcmeGuardImpl);

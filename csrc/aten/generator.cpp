//@ ch05
// The acme generator, the per-device default generators the hooks hand to
// PyTorch (hooks.cpp), and the op that lets Python reach them.
#include "aten/generator.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "aten/acme_check.h"

namespace acme {

//> ch05 generator-impl
AcmeGeneratorImpl::AcmeGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      seed_(seed) {}

void AcmeGeneratorImpl::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}

uint64_t AcmeGeneratorImpl::seed() {
  const uint64_t fresh = c10::detail::getNonDeterministicRandom();
  set_current_seed(fresh);
  return fresh;
}

PhiloxRange AcmeGeneratorImpl::reserve(uint64_t blocks) {
  const PhiloxRange range{seed_, offset_};
  offset_ += blocks;
  return range;
}

AcmeGeneratorImpl* AcmeGeneratorImpl::clone_impl() const {
  auto* copy = new AcmeGeneratorImpl(device().index(), seed_);
  copy->offset_ = offset_;
  return copy;
}
//< ch05 generator-impl

//> ch05 state
// The state travels as a CPU uint8 tensor, as for every PyTorch generator.
// Made by the CPU allocator directly, not through the dispatcher: a state read
// while torch.compile traces (under a fake-tensor mode) must still be real.
c10::intrusive_ptr<c10::TensorImpl> AcmeGeneratorImpl::get_state() const {
  at::Tensor state = at::detail::empty_cpu({static_cast<int64_t>(kStateBytes)}, at::kByte,
                                           std::nullopt, std::nullopt, std::nullopt,
                                           std::nullopt);
  auto* bytes = state.mutable_data_ptr<uint8_t>();
  std::memcpy(bytes, &seed_, sizeof seed_);
  std::memcpy(bytes + sizeof seed_, &offset_, sizeof offset_);
  return state.getIntrusivePtr();
}

void AcmeGeneratorImpl::set_state(const c10::TensorImpl& state) {
  at::detail::check_rng_state(state);  // a contiguous CPU uint8 tensor
  TORCH_CHECK(state.numel() == static_cast<int64_t>(kStateBytes),
              c10::DeviceType::PrivateUse1, " generator state must be ", kStateBytes,
              " bytes (a uint64 seed and a uint64 offset), got ", state.numel(), " bytes");
  const auto* bytes = static_cast<const uint8_t*>(state.data());
  std::memcpy(&seed_, bytes, sizeof seed_);
  std::memcpy(&offset_, bytes + sizeof seed_, sizeof offset_);
}
//< ch05 state

//> ch05 default-generators
namespace {

c10::DeviceIndex device_count() {
  int count = 0;
  ACME_CHECK(acmeGetDeviceCount(&count));
  return static_cast<c10::DeviceIndex>(count);
}

// -1 is PyTorch's "the current device".
c10::DeviceIndex resolve(c10::DeviceIndex device) {
  if (device == -1) {
    int current = 0;
    ACME_CHECK(acmeGetDevice(&current));
    device = static_cast<c10::DeviceIndex>(current);
  }
  TORCH_CHECK(device >= 0 && device < device_count(), c10::DeviceType::PrivateUse1,
              ": no device ", static_cast<int>(device), " (there are ",
              static_cast<int>(device_count()), " ", c10::DeviceType::PrivateUse1, " devices)");
  return device;
}

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex device) {
  // One per device, created together on first use (thread-safe static
  // initialisation) and never destroyed: Python may hold them until exit.
  static const auto* generators = [] {
    auto* all = new std::vector<at::Generator>;
    for (c10::DeviceIndex d = 0; d < device_count(); ++d) {
      all->push_back(at::make_generator<AcmeGeneratorImpl>(d));
    }
    return all;
  }();
  return (*generators)[resolve(device)];
}

at::Generator new_generator(c10::DeviceIndex device) {
  return at::make_generator<AcmeGeneratorImpl>(resolve(device));
}
//< ch05 default-generators

}  // namespace acme

//> ch05 default-generator-op
// PyTorch has no Python accessor for a PrivateUse1 default generator; this op
// is the device module's (device.py). A returned Generator reaches Python as
// the same torch.Generator object every time. (The schema says `Generator?`
// because a C++ at::Generator may be undefined; this one never is.)
TORCH_LIBRARY_FRAGMENT(acme, m) {
  m.def("default_generator(int device) -> Generator?",
        [](int64_t device) { return acme::default_generator(static_cast<c10::DeviceIndex>(device)); });
}
//< ch05 default-generator-op

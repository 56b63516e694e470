//@ ch11
// Pinned host memory for PyTorch: what pin_memory(), empty(..., pin_memory=True),
// DataLoader(pin_memory=True) and non_blocking copies to the CPU allocate. A
// plain allocator: every allocation and every free is a runtime call.
//
// It is registered as PrivateUse1's at::HostAllocator too, the interface
// torch.accelerator.empty_host_cache() and the host statistics go through (with
// none registered, empty_host_cache() crashes the process in PyTorch 2.13).
#include "aten/pinned_memory.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Device.h>

#include <cstring>

#include "aten/acme_check.h"

namespace acme {
namespace {

void free_pinned(void* ptr) {
  // Runs inside destructors: warn, never throw.
  const acmeError_t err = acmeHostFree(ptr);
  if (err != acmeSuccess) {
    TORCH_WARN("acme: freeing pinned host memory failed: ", acmeGetErrorName(err), ": ",
               acmeGetLastErrorMessage());
  }
}

struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    const acmeError_t err = acmeHostAlloc(&ptr, nbytes);
    TORCH_CHECK_WITH(OutOfMemoryError, err != acmeErrorMemoryAllocation, "acme: ",
                     acmeGetLastErrorMessage());
    ACME_CHECK(err);
    // Pinned memory is host memory: its tensors are CPU tensors.
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // Nothing is cached, and every copy is synchronous: no stream can still be
  // using a block when it is freed.
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}

  // No PyTorch 2.13 API asks a PrivateUse1 host allocator for these; a plain
  // allocator keeps no statistics (chapter 12's caching allocator does).
  at::HostStats get_stats() override { no_statistics(); }
  void reset_accumulated_stats() override { no_statistics(); }
  void reset_peak_stats() override { no_statistics(); }

 private:
  [[noreturn]] static void no_statistics() {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "acme: the plain pinned allocator keeps no statistics");
  }
};

PinnedAllocator& allocator() {
  static PinnedAllocator* instance = new PinnedAllocator;  // outlives every tensor
  return *instance;
}

const bool registered = [] {
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &allocator());
  return true;
}();

}  // namespace

c10::Allocator* pinned_allocator() { return &allocator(); }

bool is_pinned(const void* ptr) {
  int pinned = 0;
  return acmeHostIsPinned(ptr, &pinned) == acmeSuccess && pinned;
}

}  // namespace acme

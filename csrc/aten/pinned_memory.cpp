//@ ch11
// Pinned host memory for PyTorch: what pin_memory(), empty(..., pin_memory=True),
// DataLoader(pin_memory=True) and non_blocking copies to the CPU allocate.
//
// It is registered as PrivateUse1's at::HostAllocator too, the interface
// torch.accelerator.empty_host_cache() and the host statistics go through (with
// none registered, empty_host_cache() crashes PyTorch 2.13 and 2.14).
#include "aten/pinned_memory.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Device.h>

#include <cstring>
//> ch12 host-cache-includes
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
//< ch12 host-cache-includes

#include "aten/acme_check.h"
#include "runtime/acme_host.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

//> ch11 plain-pinned < ch12 host-cache
// void free_pinned(void* ptr) {
//   // Runs inside destructors: warn, never throw.
//   const acmeError_t err = acmeHostFree(ptr);
//   if (err != acmeSuccess) {
//     TORCH_WARN(kAcme, ": freeing pinned host memory failed: ", acmeGetErrorName(err), ": ",
//                acmeGetLastErrorMessage());
//   }
// }
//
// struct PinnedAllocator final : at::HostAllocator {
//   c10::DataPtr allocate(size_t nbytes) override {
//     void* ptr = nullptr;
//     const acmeError_t err = acmeHostAlloc(&ptr, nbytes);
//     TORCH_CHECK_WITH(OutOfMemoryError, err != acmeErrorMemoryAllocation, kAcme, ": ",
//                      acmeGetLastErrorMessage());
//     ACME_CHECK(err);
//     // Pinned memory is host memory: its tensors are CPU tensors.
//     return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
//   }
//
//   c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
//
//   void copy_data(void* dest, const void* src, std::size_t count) const override {
//     std::memcpy(dest, src, count);
//   }
//
//   // Nothing is cached, and every copy is synchronous: no stream can still be
//   // using a block when it is freed.
//   bool record_event(void*, void*, c10::Stream) override { return true; }
//   void empty_cache() override {}
//
//   // No PyTorch API (2.13 to 2.15) asks a PrivateUse1 host allocator for these; a plain
//   // allocator keeps no statistics (chapter 12's caching allocator does).
//   at::HostStats get_stats() override { no_statistics(); }
//   void reset_accumulated_stats() override { no_statistics(); }
//   void reset_peak_stats() override { no_statistics(); }
//
//  private:
//   [[noreturn]] static void no_statistics() {
//     TORCH_CHECK_NOT_IMPLEMENTED(false, kAcme,
//                                 ": the plain pinned allocator keeps no statistics");
//   }
// };
//
// PinnedAllocator& allocator() {
//   static PinnedAllocator* instance = new PinnedAllocator;  // outlives every tensor
//   return *instance;
// }
//
// const bool registered = [] {
//   at::setHostAllocator(c10::DeviceType::PrivateUse1, &allocator());
//   return true;
// }();
//< ch11 plain-pinned
//> ch12 host-cache
// PyTorch's own caching host allocator (ATen/core/CachingHostAllocator.h), the
// one CUDA and XPU use: sizes round up to powers of two, freed blocks are kept
// for reuse, and a block that a stream used (record_event, from non_blocking
// copies) is reused only once an event recorded on that stream has passed.
// A backend supplies the runtime calls below; the caching is upstream's.
struct PinnedImpl final : at::CachingHostAllocatorImpl<c10::Stream, c10::Event> {
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  void allocate_host_memory(size_t size, void** ptr) override {
    const acmeError_t err = acmeHostAlloc(ptr, size);
    TORCH_CHECK_WITH(OutOfMemoryError, err != acmeErrorMemoryAllocation, kAcme, ": ",
                     acmeGetLastErrorMessage());
    ACME_CHECK(err);
  }

  void free_block(at::HostBlock<c10::Stream>* block) override {
    ACME_CHECK(acmeHostFree(block->ptr_));
  }

  void record_stream(std::optional<std::vector<c10::Event>>& events,
                     c10::Stream stream) override {
    c10::Event event(c10::DeviceType::PrivateUse1);
    event.record(stream);
    events->push_back(std::move(event));
  }

  bool query_event(c10::Event& event) override { return event.query(); }

  c10::Stream get_current_stream() const override {
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)
        ->getStream(c10::Device(c10::DeviceType::PrivateUse1,
                                static_cast<c10::DeviceIndex>(device)));
  }

  bool stream_is_capturing(c10::Stream) const override { return false; }  // no graphs
};

void free_pinned_block(void* ctx);

struct PinnedAllocator final : at::CachingHostAllocatorInterface<PinnedImpl, free_pinned_block> {
};

PinnedAllocator& allocator() {
  static PinnedAllocator* instance = new PinnedAllocator;  // outlives every tensor
  return *instance;
}

void free_pinned_block(void* ctx) {
  try {  // runs inside destructors: warn, never throw
    allocator().free(ctx);
  } catch (const std::exception& e) {
    TORCH_WARN(kAcme, ": freeing pinned host memory failed: ", e.what());
  }
}

const bool registered = [] {
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &allocator());
  return true;
}();

//< ch12 host-cache
}  // namespace

c10::Allocator* pinned_allocator() { return &allocator(); }

bool is_pinned(const void* ptr) {
  int pinned = 0;
  return acmeHostIsPinned(ptr, &pinned) == acmeSuccess && pinned;
}

}  // namespace acme

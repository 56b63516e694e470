//@ ch19
// The legacy profiler's device hooks (chapter 19). Without Kineto,
// torch.autograd.profiler.profile(use_device="acme") times each operator on
// the device with a pair of events recorded on the current stream, through
// these stubs. Unregistered, every operator warns "PrivateUse1 used in
// profiler but not enabled" and device times come out as garbage.
#include <torch/csrc/profiler/stubs/base.h>

#include <c10/util/ApproximateClock.h>

#include "aten/acme_check.h"
#include "aten/launch.h"
#include "runtime/acme_runtime.h"

namespace acme {
namespace {

using torch::profiler::impl::ProfilerVoidEventStub;

struct LegacyStubs final : torch::profiler::impl::ProfilerStubs {
  // Called around every operator, where an exception becomes a warning per
  // operator: a failed record leaves no event, and its interval reads 0.
  void record(c10::DeviceIndex* device, ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    if (cpu_ns) *cpu_ns = c10::getTime();
    int current = 0;
    acmeEvent_t e = nullptr;
    if (acmeGetDevice(&current) != acmeSuccess ||
        acmeEventCreate(&e, current, acmeEventTiming) != acmeSuccess)
      return;
    if (device) *device = static_cast<c10::DeviceIndex>(current);
    *event = ProfilerVoidEventStub(e, [](void* p) { acmeEventDestroy(static_cast<acmeEvent_t>(p)); });
    if (acmeEventRecord(e, current_stream(static_cast<c10::DeviceIndex>(current))) != acmeSuccess)
      event->reset();
  }

  // Microseconds between two records, once both ran (0 if they are on two
  // devices). Called when the results are read: a kernel's failure that the
  // wait reveals is raised there, not lost.
  float elapsed(const ProfilerVoidEventStub* begin,
                const ProfilerVoidEventStub* end) const override {
    if (!*begin || !*end) return 0;
    auto b = static_cast<acmeEvent_t>(begin->get()), e = static_cast<acmeEvent_t>(end->get());
    const acmeError_t waited = acmeEventSynchronize(e);
    if (waited == acmeErrorLaunchFailure) ACME_CHECK(waited);
    float ms = 0;
    if (waited != acmeSuccess || acmeEventElapsedTime(&ms, b, e) != acmeSuccess) return 0;
    return ms * 1000;
  }

  // Range markers are for an external tool, as NVTX is for CUDA; acme has none.
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }

  void onEachDevice(std::function<void(int)> op) const override {
    int count = 0, previous = 0;
    if (acmeGetDeviceCount(&count) != acmeSuccess || acmeGetDevice(&previous) != acmeSuccess)
      return;
    for (int device = 0; device < count; ++device) {
      if (acmeSetDevice(device) != acmeSuccess) continue;
      op(device);
    }
    acmeSetDevice(previous);
  }

  // When a profile starts and stops: a failure is reported there.
  void synchronize() const override { ACME_CHECK(acmeDeviceSynchronize()); }
};

const bool registered = [] {
  static LegacyStubs stubs;
  torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  return true;
}();

}  // namespace
}  // namespace acme

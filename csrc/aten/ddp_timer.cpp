//@ ch23
// DDP's timer (chapter 23). DistributedDataParallel's logger times each
// iteration's forward, backward and gradient communication with a timer made
// for the model's device type by c10d's TimerRegistry. PyTorch registers
// timers for the CPU and CUDA; for any other device every DDP process warns
// "Time stats are currently only collected for CPU and CUDA devices" and its
// logging data (model._get_ddp_logging_data()) has no timings. acme's timer
// marks each moment with an event on the current stream (chapter 6) and
// measures between two of them on the device, as CUDA's timer does.
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <array>
#include <memory>
#include <optional>

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

class AcmeTimer final : public c10d::Timer {
 public:
  explicit AcmeTimer(c10::Device device) : device_(device) {}

  void record(Event event) override {
    Timer::record(event);  // the host's clock too: DDP reads both
    const c10::DeviceGuard guard(device_);
    const auto* impl = c10::impl::getDeviceGuardImpl(kAcme);
    // BACKEND_DEFAULT: an event that keeps a timestamp (enable_timing=True).
    auto& slot = events_[static_cast<size_t>(event)];
    slot = std::make_unique<c10::Event>(kAcme, c10::EventFlag::BACKEND_DEFAULT);
    slot->record(impl->getStream(device_));
  }

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const auto& first = events_[static_cast<size_t>(start)];
    const auto& last = events_[static_cast<size_t>(end)];
    if (!first || !last) return std::nullopt;  // not recorded this iteration
    last->synchronize();  // the moment has happened on the device
    const double milliseconds = first->elapsedTime(*last);
    if (milliseconds < 0) return std::nullopt;  // recorded out of order
    return static_cast<int64_t>(milliseconds * 1e6);
  }

 private:
  c10::Device device_;
  std::array<std::unique_ptr<c10::Event>, 5> events_;  // one per Timer::Event
};

}  // namespace
}  // namespace acme

//> ch23 register-ddp-timer
namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, acme::AcmeTimer)
}  // namespace c10d
//< ch23 register-ddp-timer

//@ ch01
// The device guard: how PyTorch asks "which acme device is current?" and
// switches it around an op (c10::DeviceGuard). Creating a tensor needs it.
#include <c10/core/impl/DeviceGuardImplInterface.h>
//> ch06 guard-includes
#include <c10/core/Stream.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>
//< ch06 guard-includes

#include "aten/acme_check.h"
//> ch06 guard-streams-include
#include "runtime/acme_streams.h"
//< ch06 guard-streams-include
//> ch12 guard-allocator-include
#include <c10/core/CachingDeviceAllocator.h>
//< ch12 guard-allocator-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;
//> ch06 stream-ids

// A c10::Stream is a plain value: a device and a 64-bit id. Id 0 is the
// device's default stream (c10's convention); any other id is the runtime's
// stream handle itself, so no table is needed to map one to the other.
c10::StreamId id_of(acmeStream_t stream) {
  return static_cast<c10::StreamId>(reinterpret_cast<uintptr_t>(stream));
}

acmeStream_t native(const c10::Stream& stream) {
  acmeStream_t handle = nullptr;
  if (stream.id() == 0) {
    ACME_CHECK(acmeStreamGetDefault(&handle, stream.device_index()));
    return handle;
  }
  handle = reinterpret_cast<acmeStream_t>(static_cast<uintptr_t>(stream.id()));
  int device = -1;
  ACME_CHECK(acmeStreamGetDevice(handle, &device));  // also rejects stale handles
  TORCH_CHECK(device == stream.device_index(), kAcme, ": stream ", stream.id(),
              " belongs to device ", device, ", not to device ", int{stream.device_index()});
  return handle;
}

// A device index, checked against the device count (-1 means "current").
c10::DeviceIndex checked_index(c10::DeviceIndex index) {
  if (index == -1) {
    int current = 0;
    ACME_CHECK(acmeGetDevice(&current));
    return static_cast<c10::DeviceIndex>(current);
  }
  int count = 0;
  ACME_CHECK(acmeGetDeviceCount(&count));
  TORCH_CHECK(index >= 0 && index < count, kAcme, ": invalid device index ", int{index},
              ": there are ", count, " ", kAcme, " devices");
  return index;
}

// The current stream, per thread and per device, as CUDA does it. Every
// thread starts on the default streams. ACME_DEVICE_COUNT is at most 16.
std::array<c10::StreamId, 16>& current_streams() {
  thread_local std::array<c10::StreamId, 16> ids{};
  return ids;
}

// New streams come from a fixed pool per device, handed out in turn. A
// c10::Stream has no destructor, so a stream made per request could never be
// destroyed; CUDA's backend pools its streams for the same reason.
constexpr size_t kPoolSize = 8;

c10::StreamId pooled_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static auto* pools = new std::map<c10::DeviceIndex, std::pair<std::vector<acmeStream_t>, size_t>>;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& [streams, next] = (*pools)[index];
  if (streams.size() < kPoolSize && next == streams.size()) {
    acmeStream_t created = nullptr;
    ACME_CHECK(acmeStreamCreate(&created, index));
    streams.push_back(created);
  }
  return id_of(streams[next++ % kPoolSize]);
}
//< ch06 stream-ids

struct AcmeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kAcme; }

  c10::Device getDevice() const override {
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    return {kAcme, static_cast<c10::DeviceIndex>(device)};
  }

  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kAcme, kAcme, " guard got a ", device.type(), " device");
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
//> ch11 capability

  // torch.accelerator.get_device_capability(): the dtypes a tensor on the
  // device may have, i.e. that acme can allocate and copy to and from the
  // host (tests/test_hooks.py tries each). Not the sub-byte integers, which
  // PyTorch's copy has no kernel for (on the CPU neither), nor the packed
  // quantized dtypes.
  c10::DeviceCapability getDeviceCapability(c10::Device device) const override {
    checked_index(device.index());
    c10::DeviceCapability capability;  // starts with every dtype
    auto& dtypes = capability.capability_data.supported_scalar_types;
    dtypes.has_UInt1 = dtypes.has_UInt2 = dtypes.has_UInt3 = dtypes.has_UInt4 = 0;
    dtypes.has_UInt5 = dtypes.has_UInt6 = dtypes.has_UInt7 = 0;
    dtypes.has_Int1 = dtypes.has_Int2 = dtypes.has_Int3 = dtypes.has_Int4 = 0;
    dtypes.has_Int5 = dtypes.has_Int6 = dtypes.has_Int7 = 0;
    dtypes.has_QUInt4x2 = dtypes.has_QUInt2x4 = 0;  // packed quantized: never
//> ch11 no-quantized < ch22 -
//     // The other quantized dtypes arrive in chapter 22.
//     dtypes.has_QInt8 = dtypes.has_QUInt8 = dtypes.has_QInt32 = 0;
//< ch11 no-quantized
    return capability;
  }
//< ch11 capability

//> ch01 one-stream < ch06 streams
//   // Until streams exist (chapter 6) every device has one, synchronous,
//   // default stream; PyTorch still asks for it by name.
//   c10::Stream getStream(c10::Device device) const override {
//     return c10::Stream(c10::Stream::DEFAULT, device);
//   }
//
//   c10::Stream exchangeStream(c10::Stream stream) const override {
//     return c10::Stream(c10::Stream::DEFAULT, stream.device());
//   }
//< ch01 one-stream
//> ch06 streams
  // ---- streams ----

  c10::Stream getStream(c10::Device device) const override {
    const c10::DeviceIndex index = checked_index(device.index());
    return c10::Stream(c10::Stream::UNSAFE, {kAcme, index}, current_streams()[index]);
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, {kAcme, checked_index(device.index())});
  }

  // acme has no stream priorities: every stream is equal.
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    const c10::DeviceIndex index = checked_index(device.index());
    return c10::Stream(c10::Stream::UNSAFE, {kAcme, index}, pooled_stream(index));
  }

  c10::Stream getNewStream(c10::Device device, int) const override {
    return getStreamFromGlobalPool(device, false);
  }

  // Makes `stream` current for its device, on this thread only.
  c10::Stream exchangeStream(c10::Stream stream) const override {
    const c10::Device device(kAcme, checked_index(stream.device_index()));
    (void)native(c10::Stream(c10::Stream::UNSAFE, device, stream.id()));  // must exist
    c10::StreamId& current = current_streams()[device.index()];
    const c10::Stream previous(c10::Stream::UNSAFE, device, current);
    current = stream.id();
    return previous;
  }

  void* getStreamNativeHandle(const c10::Stream stream) const override {
    return native(stream);
  }

  bool queryStream(const c10::Stream& stream) const override {
    int complete = 0;
    ACME_CHECK(acmeStreamQuery(native(stream), &complete));
    return complete != 0;
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    ACME_CHECK(acmeStreamSynchronize(native(stream)));
  }

  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    const c10::DeviceIndex index = checked_index(device_index);
    int previous = 0;
    ACME_CHECK(acmeGetDevice(&previous));
    ACME_CHECK(acmeSetDevice(index));
    const acmeError_t err = acmeDeviceSynchronize();  // acts on the current device
    (void)acmeSetDevice(previous);
    ACME_CHECK(err);
  }

  // ---- events ----
  // PyTorch holds an event as a void* it starts as nullptr and hands back to
  // us; the native event is created on first record, on the stream's device.

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                kAcme, ": an event of device ", int{device_index},
                " cannot be recorded on a stream of device ", int{stream.device_index()});
    const acmeStream_t native_stream = native(stream);
    if (*event == nullptr) {
      // enable_timing=True arrives as BACKEND_DEFAULT.
      const unsigned flags =
          flag == c10::EventFlag::BACKEND_DEFAULT ? acmeEventTiming : acmeEventDefault;
      acmeEvent_t created = nullptr;
      ACME_CHECK(acmeEventCreate(&created, stream.device_index(), flags));
      *event = created;
    }
    ACME_CHECK(acmeEventRecord(static_cast<acmeEvent_t>(*event), native_stream));
  }

  // Work queued on `stream` from now on waits for the event (any device's).
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;  // never recorded: nothing to wait for
    ACME_CHECK(acmeStreamWaitEvent(native(stream), static_cast<acmeEvent_t>(event)));
  }

  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    int complete = 0;
    ACME_CHECK(acmeEventQuery(static_cast<acmeEvent_t>(event), &complete));
    return complete != 0;
  }

  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    ACME_CHECK(acmeEventSynchronize(static_cast<acmeEvent_t>(event)));
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, kAcme, ": both events must be recorded before elapsed_time");
    float ms = 0;
    ACME_CHECK(acmeEventElapsedTime(&ms, static_cast<acmeEvent_t>(start),
                                    static_cast<acmeEvent_t>(end)));
    return ms;
  }

  // Called from ~Event: must not throw.
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (event != nullptr) (void)acmeEventDestroy(static_cast<acmeEvent_t>(event));
  }
//< ch06 streams
//> ch12 record-data-ptr

  // The autograd engine calls this when a gradient made on one stream is
  // consumed on another (InputBuffer::add): the caching allocator must keep
  // the block until that stream has passed its free. Tensor.record_stream
  // reaches the same allocator call through aten::record_stream. A stream of
  // another device cannot reuse the block; older releases may still pass one.
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr,
                             const c10::Stream& stream) const override {
    if (data_ptr.device() != stream.device()) return;
    c10::getDeviceAllocator(kAcme)->recordStream(data_ptr, stream);
  }
//< ch12 record-data-ptr
};

}  // namespace
}  // namespace acme

C10_REGISTER_GUARD_IMPL(PrivateUse1, acme::AcmeGuardImpl);

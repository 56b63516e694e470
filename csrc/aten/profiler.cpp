//@ ch19
// acme's device work in torch.profiler traces (chapter 19). Kineto, the
// library under torch.profiler, takes plugins for devices it does not know:
// an IActivityProfiler that opens a session per profile. The session turns the
// runtime's activity records into Kineto activities: kernels, copies and
// memsets on their device and stream, each linked to the operator that queued
// it, and the host calls that queued them.
//
// Kineto's headers hide the registry unless USE_KINETO is defined, as it is
// inside PyTorch's own build. PyTorch's wheels include Kineto, so an extension
// that defines it links against what is there.
#ifndef USE_KINETO
#define USE_KINETO
#endif
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <libkineto.h>  // CpuTraceBuffer
#include <output_base.h>
#include <unistd.h>

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/acme_activity.h"
#include "runtime/acme_streams.h"

namespace acme {
namespace {

using libkineto::ActivityType;

// The kinds a session traces, and what Kineto calls them.
ActivityType activity_type(acmeActivityKind kind) {
  switch (kind) {
    case acmeActivityKernel: return ActivityType::CONCURRENT_KERNEL;
    case acmeActivityMemcpy: return ActivityType::GPU_MEMCPY;
    case acmeActivityMemset: return ActivityType::GPU_MEMSET;
    default: return ActivityType::PRIVATEUSE1_RUNTIME;
  }
}

const std::set<ActivityType> kTraced = {
    ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY, ActivityType::GPU_MEMSET,
    ActivityType::PRIVATEUSE1_RUNTIME};

// Traces count time in nanoseconds since the epoch; the runtime's clock is a
// monotonic one. The offset between them, taken once per session.
int64_t clock_offset() {
  uint64_t runtime = 0;
  const auto before = std::chrono::system_clock::now();
  acmeGetTimestamp(&runtime);
  const auto after = std::chrono::system_clock::now();
  const auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        (before.time_since_epoch() + after.time_since_epoch()) / 2)
                        .count();
  return wall - static_cast<int64_t>(runtime);
}

// The trace's row for a stream: torch's stream id, 0 for the default stream.
int64_t stream_row(int device, uint64_t stream) {
  acmeStream_t default_stream = nullptr;
  if (acmeStreamGetDefault(&default_stream, device) == acmeSuccess &&
      reinterpret_cast<uintptr_t>(default_stream) == stream)
    return 0;
  return static_cast<int64_t>(stream);
}

// A device's row in the trace: "acme 0", below the host's rows.
libkineto::DeviceInfo device_info(int device) {
  const std::string name = c10::str(c10::get_privateuse1_backend(), " ", device);
  return {device, (int64_t{1} << 32) + device, name, name};
}

// Kineto's activities point at a span; ours lives as long as the process.
const libkineto::TraceSpan& device_span() {
  static const libkineto::TraceSpan* span = new libkineto::TraceSpan(0, 0, "acme");
  return *span;
}

class Session final : public libkineto::IActivityProfilerSession {
 public:
  explicit Session(std::set<ActivityType> wanted) : wanted_(std::move(wanted)) {}

  void start() override {
    offset_ = clock_offset();
    acmeActivityEnable(1);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  // Stopping waits for the work queued meanwhile on every device, so its
  // records are all in.
  void stop() override {
    acmeActivityEnable(0);
    std::vector<acmeActivityRecord> batch(1024);
    size_t count = 0;
    while (acmeActivityFlush(batch.data(), batch.size(), &count) == acmeSuccess && count)
      records_.insert(records_.end(), batch.begin(), batch.begin() + count);
    uint64_t dropped = 0;
    if (acmeActivityDropped(&dropped) == acmeSuccess && dropped) {
      errors_.push_back(c10::str(c10::get_privateuse1_backend(), ": the trace lost ", dropped,
                                 " device activities (the runtime keeps at most 1,048,576 "
                                 "per profile); profile fewer steps at a time"));
      TORCH_WARN(errors_.back());  // Kineto only logs a session's errors
    }
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return errors_; }

  // Kineto calls these on the thread of each operator that begins and ends:
  // work queued in between carries the operator's id.
  void pushCorrelationId(uint64_t id) override { acmeActivityPushExternalId(id); }
  void popCorrelationId() override { acmeActivityPopExternalId(); }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) { return nullptr; }, 0, 0);
  }

  void processTrace(libkineto::ActivityLogger& logger,
                    libkineto::getLinkedActivityCallback linked, int64_t, int64_t) override {
    std::map<int, std::set<int64_t>> rows;  // device -> stream rows used
    for (const acmeActivityRecord& r : records_) {
      const ActivityType type = activity_type(r.kind);
      if (!wanted_.count(type)) continue;
      auto a = std::make_unique<libkineto::GenericTraceActivity>(device_span(), type, r.name);
      a->startTime = static_cast<int64_t>(r.start) + offset_;
      a->endTime = static_cast<int64_t>(r.end) + offset_;
      a->id = static_cast<int32_t>(r.correlation);
      a->linked = r.externalId ? linked(static_cast<int32_t>(r.externalId)) : nullptr;
      // An arrow from the host call to the work it queued.
      a->flow.id = static_cast<uint32_t>(r.correlation);
      a->flow.type = libkineto::kLinkAsyncCpuGpu;
      if (r.kind == acmeActivityHostCall) {
        a->device = static_cast<int32_t>(::getpid());  // the host rows: process, thread
        a->resource = static_cast<int32_t>(r.thread);
        a->threadId = static_cast<int32_t>(r.thread);
        a->flow.start = 1;
      } else {
        a->device = r.device;  // the device rows: device, stream
        a->resource = static_cast<int32_t>(stream_row(r.device, r.stream));
        rows[r.device].insert(a->resource);
        if (r.bytes) a->addMetadataQuoted("bytes", std::to_string(r.bytes));
      }
      a->log(logger);
      activities_.push_back(std::move(a));
    }
    // Names for the device rows: "acme 0", then "stream 0 (default)", ...
    for (const auto& [device, streams] : rows) {
      logger.handleDeviceInfo(device_info(device), 0);
      for (int64_t stream : streams)
        logger.handleResourceInfo(
            {stream, stream, device,
             stream == 0 ? std::string("stream 0 (default)") : c10::str("stream ", stream)},
            0);
    }
  }

  // Kineto asks for one device; the others are named in processTrace. That a
  // session names any keeps Kineto from adding rows "GPU 0" to "GPU 15".
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    int device = 0;
    acmeGetDevice(&device);
    return std::make_unique<libkineto::DeviceInfo>(device_info(device));
  }
  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

 private:
  std::set<ActivityType> wanted_;
  int64_t offset_ = 0;
  std::vector<acmeActivityRecord> records_;
  std::vector<std::unique_ptr<libkineto::GenericTraceActivity>> activities_;
  std::vector<std::string> errors_;
};

class ActivityProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return kTraced; }

  // A session only when the profile asked for device activity
  // (ProfilerActivity.PrivateUse1); a CPU-only profile costs acme nothing.
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& requested, const libkineto::Config&) override {
    std::set<ActivityType> wanted;
    for (ActivityType type : requested)
      if (kTraced.count(type)) wanted.insert(type);
    if (!requested.count(ActivityType::CONCURRENT_KERNEL)) return nullptr;
    return std::make_unique<Session>(std::move(wanted));
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t, int64_t, const std::set<ActivityType>& requested,
      const libkineto::Config& config) override {
    return configure(requested, config);
  }

 private:
  std::string name_ = c10::get_privateuse1_backend();  // made once Kineto starts
};

// PyTorch hands the factory to Kineto when Kineto starts.
REGISTER_PRIVATEUSE1_PROFILER(ActivityProfiler);

}  // namespace
}  // namespace acme

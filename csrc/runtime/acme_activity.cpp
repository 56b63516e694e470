//@ ch19
// Activity tracing: a record of what the device ran and when, for profilers.
// The calls that queue work take a Trace before queueing (one atomic load when
// tracing is off); the work, wrapped by `traced`, notes when its stream ran it.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "runtime/acme_activity.h"
#include "runtime/internal.h"

using acme::internal::fail;

namespace {

constexpr size_t kMaxRecords = size_t{1} << 20;

struct Buffer {
  std::atomic<bool> on{false};
  std::atomic<uint64_t> generation{0};  // one per start: stale ids and work are dropped
  std::atomic<uint64_t> next_correlation{1};
  std::mutex mutex;
  std::deque<acmeActivityRecord> records;
  uint64_t dropped = 0;
};

// Never destroyed: workers may record during static destruction.
Buffer& buffer() {
  static Buffer* b = new Buffer;
  return *b;
}

// The ids this thread pushed, valid for one tracing generation.
struct ExternalIds {
  uint64_t generation = 0;
  std::vector<uint64_t> stack;

  std::vector<uint64_t>& current() {
    const uint64_t now = buffer().generation.load(std::memory_order_relaxed);
    if (generation != now) {
      stack.clear();
      generation = now;
    }
    return stack;
  }
};
thread_local ExternalIds external_ids;

uint64_t thread_id() {
  thread_local const uint64_t id = static_cast<uint64_t>(::syscall(SYS_gettid));
  return id;
}

void add(const acme::internal::Trace& t, const acmeActivityRecord& record) {
  Buffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.mutex);
  // Work that ends after its trace stopped belongs to no trace.
  if (!b.on.load(std::memory_order_relaxed) ||
      b.generation.load(std::memory_order_relaxed) != t.generation)
    return;
  if (b.records.size() >= kMaxRecords) {
    ++b.dropped;
    return;
  }
  b.records.push_back(record);
}

acmeActivityRecord make(const acme::internal::Trace& t, acmeActivityKind kind, const char* name,
                        int device, uint64_t stream) {
  acmeActivityRecord r{};
  r.kind = kind;
  std::strncpy(r.name, name, sizeof r.name - 1);
  r.device = device;
  r.stream = stream;
  r.correlation = t.correlation;
  r.externalId = t.external_id;
  return r;
}

}  // namespace

uint64_t acme::internal::now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

acme::internal::Trace acme::internal::begin_trace() {
  Buffer& b = buffer();
  if (!b.on.load(std::memory_order_acquire)) return {};  // sees the generation it started
  const auto& ids = external_ids.current();
  return {true, b.generation.load(std::memory_order_relaxed),
          b.next_correlation.fetch_add(1, std::memory_order_relaxed), ids.empty() ? 0 : ids.back(),
          now()};
}

void acme::internal::record_host_call(const Trace& t, const char* function, int device,
                                      uint64_t stream) {
  if (!t.on) return;
  acmeActivityRecord r = make(t, acmeActivityHostCall, function, device, stream);
  r.thread = thread_id();
  r.start = t.start;
  r.end = now();
  add(t, r);
}

void acme::internal::record_work(const Trace& t, const Work& what, int device, uint64_t stream,
                                 uint64_t start, uint64_t end) {
  if (!t.on) return;
  acmeActivityRecord r = make(t, what.kind, what.name, device, stream);
  r.bytes = what.bytes;
  r.start = start;
  r.end = end;
  add(t, r);
}

std::function<void()> acme::internal::traced(const Trace& t, const Work& what, int device,
                                             uint64_t stream, std::function<void()> work) {
  if (!t.on) return work;
  return [t, what, device, stream, work = std::move(work)] {
    const uint64_t start = now();
    work();
    record_work(t, what, device, stream, start, now());
  };
}

extern "C" {

acmeError_t acmeActivityEnable(int enable) {
  if (enable != 0 && enable != 1)
    return fail(acmeErrorInvalidValue, "acmeActivityEnable: enable is %d, not 0 or 1", enable);
  Buffer& b = buffer();
  if (!enable && b.on.load(std::memory_order_acquire)) {
    // The work queued while tracing, on every device, ends before the trace
    // does (failures stay for the calls that report them).
    int count = 0;
    if (acmeGetDeviceCount(&count) == acmeSuccess)
      for (int device = 0; device < count; ++device) acme::internal::wait_for_device(device);
  }
  std::lock_guard<std::mutex> lock(b.mutex);
  if (enable) {
    b.records.clear();
    b.dropped = 0;
    b.generation.fetch_add(1, std::memory_order_relaxed);
  }
  b.on.store(enable != 0, std::memory_order_release);
  return acmeSuccess;
}

acmeError_t acmeActivityFlush(acmeActivityRecord* records, size_t capacity, size_t* count) {
  if (!count) return fail(acmeErrorInvalidValue, "acmeActivityFlush: count is NULL");
  *count = 0;
  if (!records && capacity)
    return fail(acmeErrorInvalidValue, "acmeActivityFlush: records is NULL");
  Buffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.mutex);
  const size_t n = std::min(capacity, b.records.size());
  std::copy_n(b.records.begin(), n, records);
  b.records.erase(b.records.begin(), b.records.begin() + static_cast<std::ptrdiff_t>(n));
  *count = n;
  return acmeSuccess;
}

acmeError_t acmeActivityDropped(uint64_t* dropped) {
  if (!dropped) return fail(acmeErrorInvalidValue, "acmeActivityDropped: dropped is NULL");
  Buffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.mutex);
  *dropped = b.dropped;
  return acmeSuccess;
}

acmeError_t acmeActivityPushExternalId(uint64_t id) {
  external_ids.current().push_back(id);
  return acmeSuccess;
}

acmeError_t acmeActivityPopExternalId(void) {
  auto& ids = external_ids.current();
  if (ids.empty())
    return fail(acmeErrorInvalidValue,
                "acmeActivityPopExternalId: this thread has no pushed id to pop");
  ids.pop_back();
  return acmeSuccess;
}

acmeError_t acmeGetTimestamp(uint64_t* nanoseconds) {
  if (!nanoseconds) return fail(acmeErrorInvalidValue, "acmeGetTimestamp: nanoseconds is NULL");
  *nanoseconds = acme::internal::now();
  return acmeSuccess;
}

}  // extern "C"

//@ ch06
// What the runtime's own files share with each other; not part of the C API.
#pragma once

#include <functional>

#include "runtime/acme_streams.h"
//> ch19 internal-activity-include
#include "runtime/acme_activity.h"
//< ch19 internal-activity-include

namespace acme::internal {

// From acme_runtime.cpp: the checks every entry point starts with, the calling
// thread's current device, and recording a failure's detailed message.
acmeError_t enter();
acmeError_t check_device(int device);
int current_device();
__attribute__((format(printf, 2, 3))) acmeError_t fail(acmeError_t code, const char* format,
                                                        ...);

// From acme_streams.cpp: queues `work` on a stream (NULL: the current device's
// default stream). `caller` names the API function in error messages.
//> ch06 submit-decl < ch19 submit-decl
// acmeError_t submit(acmeStream_t stream, const char* caller, std::function<void()> work);
//< ch06 submit-decl
//> ch19 submit-decl
// Chapter 19: `what` names the work in traces (Work is below); with `wait`,
// the call also waits for the work and reports its stream's failure.
struct Work;
acmeError_t submit(acmeStream_t stream, const char* caller, const Work& what,
                   std::function<void()> work, bool wait = false);
//< ch19 submit-decl
//> ch18 internal-sync

// Chapter 18, kernels that fail after their launch returned. From
// acme_streams.cpp: the device's unreported kernel failure as an error of
// `caller` (acmeSuccess if none); waiting for a device's queued work, then
// reporting; the same for one stream. From acme_runtime.cpp: whether
// ACME_LAUNCH_BLOCKING=1.
acmeError_t take_failure(int device, const char* caller);
void wait_for_device(int device);
acmeError_t synchronize_device(int device, const char* caller);
acmeError_t synchronize(acmeStream_t stream, const char* caller);
bool launch_blocking();
//< ch18 internal-sync
//> ch19 internal-activity

// Chapter 19, from acme_activity.cpp: tracing for profilers. A call that
// queues work takes a Trace first (empty when tracing is off), wraps the work
// with `traced` so its stream's worker times it, and records itself last.
struct Trace {
  bool on = false;
  uint64_t generation = 0;  // which trace: work that ends in a later one is not its
  uint64_t correlation = 0, external_id = 0, start = 0;
};
// What a trace calls a piece of device work.
struct Work {
  acmeActivityKind kind;
  const char* name;  // a literal, or a buffer that outlives the work
  uint64_t bytes = 0;
};
Trace begin_trace();
std::function<void()> traced(const Trace& t, const Work& what, int device, uint64_t stream,
                             std::function<void()> work);
void record_work(const Trace& t, const Work& what, int device, uint64_t stream, uint64_t start,
                 uint64_t end);
void record_host_call(const Trace& t, const char* function, int device, uint64_t stream);
uint64_t now();  // the runtime clock, nanoseconds
//< ch19 internal-activity

}  // namespace acme::internal

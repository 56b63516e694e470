//@ ch06
// What the runtime's own files share with each other; not part of the C API.
#pragma once

#include <functional>

#include "runtime/acme_runtime.h"

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
acmeError_t submit(acmeStream_t stream, const char* caller, std::function<void()> work);
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

}  // namespace acme::internal

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

}  // namespace acme::internal

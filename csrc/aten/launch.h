//@ ch18
// Launching work on the device's streams (chapter 18): every kernel, copy and
// wait of the torch glue goes through here, on the stream PyTorch calls
// current for the tensors' device.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <functional>
#include <utility>

#include "runtime/acme_streams.h"

namespace acme {

// This thread's current stream of `device`, as the runtime's handle.
acmeStream_t current_stream(c10::DeviceIndex device);

// Queues `kernel` (a callable) on the current stream of `device` and returns
// at once. It runs on the stream's worker, so it must own what it uses:
// device views and copies, never references to the caller's tensors. An
// exception it throws becomes the kernel's failure, reported (naming `name`)
// by the next call that waits for the device, or by this launch with
// ACME_LAUNCH_BLOCKING=1.
template <class Kernel>
void launch_kernel(c10::DeviceIndex device, const char* name, Kernel kernel);

// A CUDA op picks its kernel by dtype on the host, so a dtype without a
// kernel raises where the op was called. acme's borrowed CPU kernels find out
// only when they run. So the first time a kernel meets a `key` (its operands'
// dtypes and ranks), the launch runs `probe` first, here on the host: the same
// kernel over one-element CPU stand-ins, which raises what the kernel would.
void check_once(const char* name, c10::ArrayRef<int64_t> key, const std::function<void()>& probe);

// Waits until the current stream of `device` has run everything queued on it
// so far: what host code does before it touches device memory itself.
void wait_for_stream(c10::DeviceIndex device);

// Work queued on the current stream of `waiting` from now on starts only once
// the current stream of `done` has run what is queued on it now.
void stream_wait(c10::DeviceIndex waiting, c10::DeviceIndex done);

// ---- how launch_kernel hands a C++ callable to the runtime's C interface ----

// Runs call(body) on the worker with the kernel's guards; 0, or 1 with the
// exception's message in `message`.
int run_kernel_body(void (*call)(void*), void* body, char* message, size_t size);
void launch_on(c10::DeviceIndex device, const char* name, acmeKernelFunction run, void* args,
               void (*release)(void*));

template <class Kernel>
void launch_kernel(c10::DeviceIndex device, const char* name, Kernel kernel) {
  auto run = [](void* body, char* message, size_t size) {
    return run_kernel_body([](void* b) { (*static_cast<Kernel*>(b))(); }, body, message, size);
  };
  auto release = [](void* body) { delete static_cast<Kernel*>(body); };
  launch_on(device, name, run, new Kernel(std::move(kernel)), release);
}

}  // namespace acme

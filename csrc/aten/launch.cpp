//@ ch18
#include "aten/launch.h"

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/hash.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_set>
//> ch23 flag-include
#include <utility>
//< ch23 flag-include

#include "aten/acme_check.h"
//> ch23 kernel-threads-include
#include "aten/kernel_threads.h"
//< ch23 kernel-threads-include
//> ch23 run-on-stream-include
#include "aten/run_on_stream.h"
//< ch23 run-on-stream-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

// The default streams' handles never change: look each one up once.
acmeStream_t default_stream(c10::DeviceIndex device) {
  static std::array<std::atomic<acmeStream_t>, 16> handles{};
  TORCH_CHECK(device >= 0 && device < 16, kAcme, ": invalid device index ", int{device});
  acmeStream_t handle = handles[device].load(std::memory_order_acquire);
  if (!handle) {
    ACME_CHECK(acmeStreamGetDefault(&handle, device));
    handles[device].store(handle, std::memory_order_release);
  }
  return handle;
}

// The (kernel, key) pairs whose probe has passed.
struct Checked {
  std::mutex mutex;
  std::unordered_set<size_t> passed;
};

Checked& checked() {
  static Checked* c = new Checked;  // kernels may launch during exit
  return *c;
}

}  // namespace

acmeStream_t current_stream(c10::DeviceIndex device) {
  const c10::Stream stream =
      c10::impl::getDeviceGuardImpl(kAcme)->getStream(c10::Device(kAcme, device));
  if (stream.id() == 0) return default_stream(device);
  // Any other id is the runtime's handle itself (chapter 6).
  return reinterpret_cast<acmeStream_t>(static_cast<uintptr_t>(stream.id()));
}
//> ch23 inside-kernel-flag

namespace {
thread_local c10::DeviceIndex running_device = -1;

// How many CPU threads the device's kernels use: the intra-op thread count
// when acme was loaded, before any DataLoader ran. Read later, it may be 1:
// DataLoader(pin_memory=True) sets 1 for its pinning thread, and ATen keeps
// that count for the whole process, where a new thread's init_num_threads
// finds it.
int device_threads() {
  static const int count = at::get_num_threads();
  return count;
}
[[maybe_unused]] const int device_threads_at_load = device_threads();  // read it now

// The worker is a thread PyTorch never saw: give it the device's thread
// count, once, before its first kernel. ATen's first parallel call on a
// thread sets that thread's count to the process-wide one: get_num_threads
// makes that happen first, so it cannot undo a count set later.
void prepare_worker_threads() {
  thread_local const bool threads_set =
      (at::get_num_threads(), at::set_num_threads(device_threads()), true);
  (void)threads_set;
}
}  // namespace

c10::DeviceIndex running_kernel_device() { return running_device; }

RunningKernel::RunningKernel(c10::DeviceIndex device)
    : before_(std::exchange(running_device, device)) {}

RunningKernel::~RunningKernel() { running_device = before_; }

c10::Stream current_c10_stream(c10::DeviceIndex device) {
  return c10::impl::getDeviceGuardImpl(kAcme)->getStream(c10::Device(kAcme, device));
}

c10::Stream set_current_stream_here(const c10::Stream& stream) {
  return c10::impl::getDeviceGuardImpl(kAcme)->exchangeStream(stream);
}
//< ch23 inside-kernel-flag

int run_kernel_body(void (*call)(void*), void* body, char* message, size_t size) {
//> ch18 worker-threads < ch23 worker-threads
//   // The worker is a thread PyTorch never saw: give it the intra-op thread
//   // count the user chose, once.
//   thread_local const bool threads_set = (at::init_num_threads(), true);
//   (void)threads_set;
//< ch18 worker-threads
//> ch23 worker-threads
  prepare_worker_threads();
//< ch23 worker-threads
//> ch23 body-inline
  // No message buffer: launch_on runs this kernel inside a body, under its
  // guards already, and what the kernel throws is the body's, type intact.
  if (message == nullptr) {
    call(body);
    return 0;
  }
//< ch23 body-inline
  try {
    // A kernel computes on CPU views that nothing differentiates, and it is
    // device work, not a host op for the profiler (chapter 19) to list.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::RecordFunctionGuard not_a_host_op(false);
    call(body);
    return 0;
  } catch (const c10::Error& e) {
    std::snprintf(message, size, "%s", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::snprintf(message, size, "%s", e.what());
  } catch (...) {
    std::snprintf(message, size, "an exception that is not a std::exception");
  }
  return 1;
}

//> ch23 threaded-launch
namespace {
// A kernel, with the thread count and graph flag it was queued with: the
// worker runs it with them (kernel_threads.h).
struct Threaded {
  acmeKernelFunction run;
  void* args;
  void (*release)(void*);
  int threads;
  bool in_graph;
};

int run_threaded(void* kernel, char* message, size_t size) {
  const auto* k = static_cast<const Threaded*>(kernel);
  prepare_worker_threads();  // first, or it would undo the count set here
  use_kernel_threads(k->threads);  // kept for the next kernel, which often wants it too
  const bool graph_before = set_in_compiled_graph(k->in_graph);
  const int result = k->run(k->args, message, size);
  set_in_compiled_graph(graph_before);
  return result;
}

void release_threaded(void* kernel) {
  const auto* k = static_cast<const Threaded*>(kernel);
  if (k->release) k->release(k->args);
  delete k;
}
}  // namespace
//< ch23 threaded-launch

void launch_on(c10::DeviceIndex device, const char* name, acmeKernelFunction run, void* args,
               void (*release)(void*)) {
//> ch23 launch-threads
  // How many threads this kernel gets: the sizes its DeviceViews noted, or
  // the device's count when it viewed nothing (kernel_threads.h).
  const int threads = kernel_threads(take_kernel_elements(), device_threads());
//< ch23 launch-threads
//> ch23 launch-inline
  if (device == running_kernel_device()) {  // inside a body: its stream has got here
    const struct Release {
      void (*release)(void*);
      void* args;
      ~Release() {
        if (release) release(args);
      }
    } owned{release, args};
    // It runs with the body's thread count, whatever its own size: the body's
    // first call and the launches of later calls must round alike.
    TORCH_INTERNAL_ASSERT(run(args, nullptr, 0) == 0, name, ": failed without an exception");
    return;
  }
//< ch23 launch-inline
//> ch23 launch-threaded
  // Every kernel carries its count when the device has more than one thread:
  // the worker keeps the last count it set, so a large kernel after a small
  // one must say so too.
  if (device_threads() > 1) {
    // The runtime releases the wrapper (and so `args`) in every case.
    ACME_CHECK(acmeLaunchKernel(current_stream(device), name, run_threaded,
                                new Threaded{run, args, release, threads, in_compiled_graph()},
                                release_threaded));
    return;
  }
//< ch23 launch-threaded
  // The runtime releases `args` in every case, a failed launch included.
  ACME_CHECK(acmeLaunchKernel(current_stream(device), name, run, args, release));
}

void check_once(const char* name, c10::ArrayRef<int64_t> key, const std::function<void()>& probe) {
  size_t hash = std::hash<std::string_view>()(name);
  for (int64_t k : key) hash = c10::hash_combine(hash, static_cast<size_t>(k));
  thread_local std::unordered_set<size_t> passed_here;  // no lock on the common path
  if (passed_here.count(hash)) return;
  Checked& c = checked();
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    if (c.passed.count(hash)) {
      passed_here.insert(hash);
      return;
    }
  }
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    probe();  // throws what the kernel would throw
  }
  passed_here.insert(hash);
  const std::lock_guard<std::mutex> lock(c.mutex);
  c.passed.insert(hash);
}

void wait_for_stream(c10::DeviceIndex device) {
//> ch23 wait-inside
  if (device == running_kernel_device()) return;  // the stream is here already
//< ch23 wait-inside
  ACME_CHECK(acmeStreamSynchronize(current_stream(device)));
}

void stream_wait(c10::DeviceIndex waiting, c10::DeviceIndex done) {
  if (waiting == done) return;  // one stream orders itself
  auto* impl = c10::impl::getDeviceGuardImpl(kAcme);
  c10::Event event(kAcme);
  event.record(impl->getStream(c10::Device(kAcme, done)));
  event.block(impl->getStream(c10::Device(kAcme, waiting)));
}

}  // namespace acme

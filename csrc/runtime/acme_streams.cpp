//@ ch06
// Streams and events. Each stream is an in-order queue of work with a worker
// thread of its own, standing in for a hardware queue: the host queues work
// and moves on, the worker runs it. An event is a numbered mark: recording it
// queues "mark record n complete" on a stream, and waiting for it means
// waiting until the worker has got that far.
#include <cinttypes>
//> ch23 streams-wake-include
#include <algorithm>
//< ch23 streams-wake-include
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
//> ch18 streams-includes
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
//< ch18 streams-includes
#include <system_error>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/acme_streams.h"
#include "runtime/internal.h"

using acme::internal::enter;
using acme::internal::fail;

namespace {

using Clock = std::chrono::steady_clock;  // monotonic: what elapsed times need

//> ch06 runtime-event
struct Event {
  uint64_t id;
  int device;
  bool timing;

  std::mutex mutex;
  std::condition_variable changed;
  uint64_t recorded = 0;   // records issued so far; record n is "version n"
  uint64_t completed = 0;  // the highest version a stream has reached
  Clock::time_point when;  // when `completed` was reached

  // Runs on a stream's worker when the stream reaches the mark.
  void complete(uint64_t version) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (version <= completed) return;
      completed = version;
      when = Clock::now();
    }
    changed.notify_all();
  }

  void wait_for(uint64_t version) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return completed >= version; });
  }
};
//< ch06 runtime-event

//> ch23 serving
struct Stream;
// The stream whose worker this thread is, while it runs an item of its queue.
thread_local const Stream* serving = nullptr;

//< ch23 serving
//> ch06 runtime-stream
struct Stream {
  uint64_t id;
  int device;
  bool is_default;

  std::mutex mutex;
  std::condition_variable changed;  // work queued, work done, or stopping
  // Each item: the work, then what to announce when the stream counts it as
  // done (an event), in the same critical section as the count, so a query of
  // either never contradicts the other.
  std::deque<std::pair<std::function<void()>, std::function<void()>>> queue;
  uint64_t submitted = 0, completed = 0;
  bool stopping = false;
//> ch18 stream-spin-state
  std::atomic<uint64_t> queued{0};  // `submitted`, for a worker looking without the lock
  bool worker_asleep = false;
//< ch18 stream-spin-state
//> ch23 stream-wake-at
  uint64_t wake_at = UINT64_MAX;  // the least `completed` a drain() waits for
//< ch23 stream-wake-at

  // False if the stream is being destroyed: its worker may be gone already.
  bool push(std::function<void()> work, std::function<void()> then = {}) {
//> ch23 push-inline
    // Work a running item queues on its own stream would wait behind that
    // item forever: it runs now, which is where the queue has got to.
    if (serving == this) {
      if (work) work();
      std::lock_guard<std::mutex> lock(mutex);
      if (then) then();
      return true;
    }
//< ch23 push-inline
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stopping) return false;
      queue.emplace_back(std::move(work), std::move(then));
      ++submitted;
//> ch18 push-wakes
      queued.store(submitted, std::memory_order_release);
      if (!worker_asleep) return true;  // a busy or spinning worker finds it
//< ch18 push-wakes
    }
    changed.notify_all();
    return true;
  }

  bool idle() {
    std::lock_guard<std::mutex> lock(mutex);
    return completed == submitted;
  }

  // Waits for the work queued so far, not for work queued meanwhile.
  void drain() {
//> ch23 drain-inline
    if (serving == this) return;  // everything queued before the running item is done
//< ch23 drain-inline
    std::unique_lock<std::mutex> lock(mutex);
    const uint64_t target = submitted;
//> ch06 drain-wait < ch23 drain-wait
//     changed.wait(lock, [&] { return completed >= target; });
//< ch06 drain-wait
//> ch23 drain-wait
    // The worker wakes waiters when the least target among them is reached,
    // not after every item: each wake-up takes a core from the device's
    // threads only to find the queue unfinished.
    while (completed < target) {
      wake_at = std::min(wake_at, target);
      changed.wait(lock);
    }
//< ch23 drain-wait
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    changed.notify_all();
  }
};

// What a call that queues work says when `push` refused it.
acmeError_t destroyed(const Stream& s, const char* caller) {
  return fail(acmeErrorInvalidHandle, "%s: stream %" PRIu64 " was destroyed", caller, s.id);
}

// The worker: runs the queue in order, one item at a time. It owns a reference
// to the stream, so a destroyed stream finishes its queue before going away.
void serve(std::shared_ptr<Stream> s) {
  (void)enter();  // the signal stack checked mode wants on every thread
  std::unique_lock<std::mutex> lock(s->mutex);
  for (;;) {
//> ch06 serve-wait < ch18 serve-wait
//     s->changed.wait(lock, [&] { return !s->queue.empty() || s->stopping; });
//< ch06 serve-wait
//> ch18 serve-wait
    // Kernels come in bursts: look for the next one for a little while
    // before sleeping, which spares each launch the cost of waking the worker.
    if (s->queue.empty() && !s->stopping) {
      const uint64_t seen = s->submitted;
      lock.unlock();
      const auto until = Clock::now() + std::chrono::microseconds(50);
      while (s->queued.load(std::memory_order_acquire) == seen && Clock::now() < until)
        std::this_thread::yield();  // a host thread computing has the cores first
      lock.lock();
    }
    s->worker_asleep = true;
    s->changed.wait(lock, [&] { return !s->queue.empty() || s->stopping; });
    s->worker_asleep = false;
//< ch18 serve-wait
    if (s->queue.empty()) return;  // stopping, and nothing left to do
    auto [work, then] = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
//> ch06 serve-run < ch23 serve-run
//     if (work) work();
//< ch06 serve-run
//> ch23 serve-run
    serving = s.get();
    if (work) work();
    serving = nullptr;
//< ch23 serve-run
    lock.lock();
    ++s->completed;
    if (then) then();  // under the stream's lock: both facts change at once
//> ch06 serve-notify < ch23 serve-notify
//     s->changed.notify_all();
//< ch06 serve-notify
//> ch23 serve-notify
    if (s->completed >= s->wake_at) {
      s->wake_at = UINT64_MAX;  // waiters not done yet ask again
      s->changed.notify_all();
    }
//< ch23 serve-notify
  }
}
//< ch06 runtime-stream

//> ch06 runtime-handles
// Handles are numbers from one counter, never reused; the low bit tells a
// stream (1) from an event (0). A stale handle is thus recognised for what it
// was, and can never alias a newer object.
struct Handles {
  std::mutex mutex;
  uint64_t next = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Stream>> streams;
  std::unordered_map<uint64_t, std::shared_ptr<Event>> events;
  std::map<int, std::shared_ptr<Stream>> defaults;  // by device, created on first use
  // Every stream of a device, destroyed ones still draining included.
  std::map<int, std::vector<std::weak_ptr<Stream>>> by_device;

  uint64_t new_id(bool stream) { return (next++ << 1) | (stream ? 1 : 0); }
};

// Never destroyed: workers may still run during static destruction.
Handles& handles() {
  static Handles* h = new Handles;
  return *h;
}

uint64_t id_of(const void* handle) { return reinterpret_cast<uintptr_t>(handle); }
acmeStream_t stream_handle(uint64_t id) { return reinterpret_cast<acmeStream_t>(id); }
acmeEvent_t event_handle(uint64_t id) { return reinterpret_cast<acmeEvent_t>(id); }

// Why `id` names no live object of the wanted kind.
acmeError_t bad_handle(const Handles& h, uint64_t id, bool want_stream, const char* caller) {
  const char* wanted = want_stream ? "stream" : "event";
  const bool is_stream = id & 1;
  if (id != 0 && (id >> 1) < h.next) {
    if (is_stream != want_stream)
      return fail(acmeErrorInvalidHandle, "%s: %" PRIu64 " is %s handle, not %s handle",
                  caller, id, is_stream ? "a stream" : "an event",
                  want_stream ? "a stream" : "an event");
    return fail(acmeErrorInvalidHandle, "%s: %s %" PRIu64 " was destroyed", caller, wanted, id);
  }
  return fail(acmeErrorInvalidHandle, "%s: %" PRIu64 " is not %s handle (never created)", caller,
              id, want_stream ? "a stream" : "an event");
}

// Simulator only. The workers are threads, and a child of fork() has none of
// its parent's: work queued on the parent's streams there would wait forever.
// Every stream and event call refuses in such a child (chapter 11 refuses
// every call, as a real driver does). Read and set with the handles lock held.
pid_t workers_pid = 0;  // the process whose streams have workers; 0 before any

acmeError_t refuse_in_forked_child(const char* caller) {
  if (workers_pid == 0 || workers_pid == getpid()) return acmeSuccess;
  return fail(acmeErrorForkedChild,
              "%s: this process is a child of fork(), and its parent's acme streams run on "
              "threads that exist only in the parent; start child processes with the 'spawn' "
              "method (multiprocessing.set_start_method('spawn'))", caller);
}

// Starts a stream's worker. Call with the handles lock held.
acmeError_t start(Handles& h, int device, bool is_default, const char* caller,
                  std::shared_ptr<Stream>* out) {
  if (acmeError_t e = refuse_in_forked_child(caller)) return e;
  workers_pid = getpid();
  auto s = std::make_shared<Stream>();
  s->id = h.new_id(true);
  s->device = device;
  s->is_default = is_default;
  try {
    std::thread(serve, s).detach();
  } catch (const std::system_error& e) {
    return fail(acmeErrorMemoryAllocation, "%s: cannot start the stream's worker thread: %s",
                caller, e.what());
  }
  h.streams.emplace(s->id, s);
  auto& all = h.by_device[device];
  std::erase_if(all, [](const std::weak_ptr<Stream>& w) { return w.expired(); });
  all.push_back(s);
  *out = std::move(s);
  return acmeSuccess;
}

acmeError_t default_stream(int device, const char* caller, std::shared_ptr<Stream>* out) {
  if (acmeError_t e = acme::internal::check_device(device)) return e;
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  if (acmeError_t e = refuse_in_forked_child(caller)) return e;
  auto& slot = h.defaults[device];
  if (!slot) {
    if (acmeError_t e = start(h, device, true, caller, &slot)) return e;
  }
  *out = slot;
  return acmeSuccess;
}

acmeError_t find_stream(acmeStream_t handle, const char* caller, std::shared_ptr<Stream>* out) {
  if (!handle) return default_stream(acme::internal::current_device(), caller, out);
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  if (acmeError_t e = refuse_in_forked_child(caller)) return e;
  auto it = h.streams.find(id_of(handle));
  if (it == h.streams.end()) return bad_handle(h, id_of(handle), true, caller);
  *out = it->second;
  return acmeSuccess;
}

acmeError_t find_event(acmeEvent_t handle, const char* caller, std::shared_ptr<Event>* out) {
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  if (acmeError_t e = refuse_in_forked_child(caller)) return e;
  auto it = h.events.find(id_of(handle));
  if (it == h.events.end()) return bad_handle(h, id_of(handle), false, caller);
  *out = it->second;
  return acmeSuccess;
}
//< ch06 runtime-handles
//> ch18 kernel-failures

// The first kernel failure of each device that no call has reported yet. A
// kernel fails long after its launch returned, so the next call that waits
// for the device reports it, as asynchronous errors work on real hardware.
struct KernelFailure {
  std::string kernel;
  uint64_t stream;
  bool default_stream;
  std::string message;
};

struct Failures {
  std::mutex mutex;
  std::map<int, KernelFailure> by_device;
};

Failures& failures() {
  static Failures* f = [] {
    // A failure no call reported before the process ends is still said, once.
    std::atexit([] {
      Failures& all = failures();
      std::lock_guard<std::mutex> lock(all.mutex);
      for (const auto& [device, k] : all.by_device)
        std::fprintf(stderr, "acme: kernel %s failed on device %d and no call reported it "
                     "before the process exited: %s\n", k.kernel.c_str(), device,
                     k.message.c_str());
    });
    return new Failures;  // never destroyed, like the handles
  }();
  return *f;
}

void record_failure(int device, KernelFailure failure) {
  Failures& f = failures();
  std::lock_guard<std::mutex> lock(f.mutex);
  f.by_device.try_emplace(device, std::move(failure));  // the first one stays
}

// ACME_LAUNCH_BLOCKING=1: a launch is over only when its work is, and a
// failure is reported by the launch, at the line that caused it.
acmeError_t finish_blocking(Stream& s, const char* caller) {
  s.drain();
  return acme::internal::take_failure(s.device, caller);
}

// Waits for everything queued on the device's streams so far.
void drain_device(int device) {
  std::vector<std::shared_ptr<Stream>> streams;
  {
    Handles& h = handles();
    std::lock_guard<std::mutex> lock(h.mutex);
    for (const auto& weak : h.by_device[device])
      if (auto s = weak.lock()) streams.push_back(std::move(s));
  }
  for (const auto& s : streams) s->drain();
}
//< ch18 kernel-failures

}  // namespace

//> ch06 submit-head < ch19 submit-head
// acmeError_t acme::internal::submit(acmeStream_t stream, const char* caller,
//                                    std::function<void()> work) {
//   std::shared_ptr<Stream> s;
//   if (acmeError_t e = find_stream(stream, caller, &s)) return e;
//   if (!s->push(std::move(work))) return destroyed(*s, caller);  // since find_stream
//< ch06 submit-head
//> ch19 submit-head
acmeError_t acme::internal::submit(acmeStream_t stream, const char* caller, const Work& what,
                                   std::function<void()> work, bool wait) {
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, caller, &s)) return e;
  const Trace trace = begin_trace();
  if (!s->push(traced(trace, what, s->device, s->id, std::move(work))))
    return destroyed(*s, caller);
//< ch19 submit-head
//> ch18 submit-blocking < ch19 submit-blocking
//   if (launch_blocking()) return finish_blocking(*s, caller);
//< ch18 submit-blocking
//> ch19 submit-blocking
  const acmeError_t e = wait || launch_blocking() ? finish_blocking(*s, caller) : acmeSuccess;
  record_host_call(trace, caller, s->device, s->id);  // the call's whole time, waits included
  if (e) return e;
//< ch19 submit-blocking
  return acmeSuccess;
}
//> ch18 internal-waits

acmeError_t acme::internal::take_failure(int device, const char* caller) {
  KernelFailure k;
  {
    Failures& f = failures();
    std::lock_guard<std::mutex> lock(f.mutex);
    auto it = f.by_device.find(device);
    if (it == f.by_device.end()) return acmeSuccess;
    k = std::move(it->second);
    f.by_device.erase(it);
  }
  char stream[48] = "the default stream";
  if (!k.default_stream) std::snprintf(stream, sizeof stream, "stream %" PRIu64, k.stream);
  if (launch_blocking())
    return fail(acmeErrorLaunchFailure,
                "kernel %s failed on %s of device %d: %s (reported by %s, its launch: "
                "ACME_LAUNCH_BLOCKING=1)",
                k.kernel.c_str(), stream, device, k.message.c_str(), caller);
  return fail(acmeErrorLaunchFailure,
              "kernel %s failed on %s of device %d: %s (it ran asynchronously; reported by "
              "%s, the first call since to wait for the device. ACME_LAUNCH_BLOCKING=1 makes "
              "the launch report it)",
              k.kernel.c_str(), stream, device, k.message.c_str(), caller);
}

void acme::internal::wait_for_device(int device) { drain_device(device); }

acmeError_t acme::internal::synchronize_device(int device, const char* caller) {
  drain_device(device);
  return take_failure(device, caller);
}

acmeError_t acme::internal::synchronize(acmeStream_t stream, const char* caller) {
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, caller, &s)) return e;
  s->drain();
  return take_failure(s->device, caller);
}
//< ch18 internal-waits

extern "C" {

//> ch06 runtime-stream-api
acmeError_t acmeStreamCreate(acmeStream_t* stream, int device) {
  if (acmeError_t e = enter()) return e;
  if (!stream) return fail(acmeErrorInvalidValue, "acmeStreamCreate: stream is NULL");
  *stream = nullptr;
  if (acmeError_t e = acme::internal::check_device(device)) return e;
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  std::shared_ptr<Stream> s;
  if (acmeError_t e = start(h, device, false, "acmeStreamCreate", &s)) return e;
  *stream = stream_handle(s->id);
  return acmeSuccess;
}

acmeError_t acmeStreamDestroy(acmeStream_t stream) {
  if (acmeError_t e = enter()) return e;
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, "acmeStreamDestroy", &s)) return e;
  if (s->is_default)
    return fail(acmeErrorInvalidValue,
                "acmeStreamDestroy: stream %" PRIu64 " is the default stream of device %d, "
                "which cannot be destroyed",
                s->id, s->device);
  {
    Handles& h = handles();
    std::lock_guard<std::mutex> lock(h.mutex);
    h.streams.erase(s->id);
  }
  s->stop();  // the worker drains the queue, then exits
  return acmeSuccess;
}

acmeError_t acmeStreamGetDefault(acmeStream_t* stream, int device) {
  if (acmeError_t e = enter()) return e;
  if (!stream) return fail(acmeErrorInvalidValue, "acmeStreamGetDefault: stream is NULL");
  std::shared_ptr<Stream> s;
  if (acmeError_t e = default_stream(device, "acmeStreamGetDefault", &s)) return e;
  *stream = stream_handle(s->id);
  return acmeSuccess;
}

acmeError_t acmeStreamGetDevice(acmeStream_t stream, int* device) {
  if (acmeError_t e = enter()) return e;
  if (!device) return fail(acmeErrorInvalidValue, "acmeStreamGetDevice: device is NULL");
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, "acmeStreamGetDevice", &s)) return e;
  *device = s->device;
  return acmeSuccess;
}

acmeError_t acmeStreamQuery(acmeStream_t stream, int* complete) {
  if (acmeError_t e = enter()) return e;
  if (!complete) return fail(acmeErrorInvalidValue, "acmeStreamQuery: complete is NULL");
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, "acmeStreamQuery", &s)) return e;
  *complete = s->idle() ? 1 : 0;
  return acmeSuccess;
}

acmeError_t acmeStreamSynchronize(acmeStream_t stream) {
  if (acmeError_t e = enter()) return e;
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, "acmeStreamSynchronize", &s)) return e;
  s->drain();
//> ch06 stream-sync-return < ch18 stream-sync-return
//   return acmeSuccess;
//< ch06 stream-sync-return
//> ch18 stream-sync-return
  return acme::internal::take_failure(s->device, "acmeStreamSynchronize");
//< ch18 stream-sync-return
}

acmeError_t acmeStreamWaitEvent(acmeStream_t stream, acmeEvent_t event) {
  if (acmeError_t e = enter()) return e;
  std::shared_ptr<Stream> s;
  std::shared_ptr<Event> ev;
  if (acmeError_t e = find_stream(stream, "acmeStreamWaitEvent", &s)) return e;
  if (acmeError_t e = find_event(event, "acmeStreamWaitEvent", &ev)) return e;
  uint64_t version;
  {
    std::lock_guard<std::mutex> lock(ev->mutex);
    version = ev->recorded;  // the latest record issued before this call
  }
  if (version == 0) return acmeSuccess;  // never recorded: nothing to wait for
  // The worker blocks on the event; work queued behind the wait waits too.
  if (!s->push([ev, version] { ev->wait_for(version); }))
    return destroyed(*s, "acmeStreamWaitEvent");
  return acmeSuccess;
}

acmeError_t acmeLaunchSleepKernel(acmeStream_t stream, unsigned microseconds) {
  if (acmeError_t e = enter()) return e;
//> ch06 sleep-submit < ch19 sleep-submit
//   return acme::internal::submit(stream, "acmeLaunchSleepKernel", [microseconds] {
//     std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
//   });
//< ch06 sleep-submit
//> ch19 sleep-submit
  return acme::internal::submit(stream, "acmeLaunchSleepKernel", {acmeActivityKernel, "sleep"},
                                [microseconds] {
                                  std::this_thread::sleep_for(
                                      std::chrono::microseconds(microseconds));
                                });
//< ch19 sleep-submit
}

acmeError_t acmeDeviceSynchronize(void) {
  if (acmeError_t e = enter()) return e;
//> ch06 device-sync-body < ch18 device-sync-body
//   const int device = acme::internal::current_device();
//   std::vector<std::shared_ptr<Stream>> streams;
//   {
//     Handles& h = handles();
//     std::lock_guard<std::mutex> lock(h.mutex);
//     if (acmeError_t e = refuse_in_forked_child("acmeDeviceSynchronize")) return e;
//     for (const auto& weak : h.by_device[device])
//       if (auto s = weak.lock()) streams.push_back(std::move(s));
//   }
//   for (const auto& s : streams) s->drain();
//   return acmeSuccess;
//< ch06 device-sync-body
//> ch18 device-sync-body
  return acme::internal::synchronize_device(acme::internal::current_device(),
                                            "acmeDeviceSynchronize");
//< ch18 device-sync-body
}
//< ch06 runtime-stream-api

//> ch06 runtime-event-api
acmeError_t acmeEventCreate(acmeEvent_t* event, int device, unsigned flags) {
  if (acmeError_t e = enter()) return e;
  if (!event) return fail(acmeErrorInvalidValue, "acmeEventCreate: event is NULL");
  *event = nullptr;
  if (flags & ~unsigned{acmeEventTiming})
    return fail(acmeErrorInvalidValue, "acmeEventCreate: unknown flags 0x%x", flags);
  if (acmeError_t e = acme::internal::check_device(device)) return e;
  auto ev = std::make_shared<Event>();
  ev->device = device;
  ev->timing = flags & acmeEventTiming;
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  ev->id = h.new_id(false);
  h.events.emplace(ev->id, ev);
  *event = event_handle(ev->id);
  return acmeSuccess;
}

acmeError_t acmeEventDestroy(acmeEvent_t event) {
  if (acmeError_t e = enter()) return e;
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  // Queued records and waits hold their own reference to the event.
  if (h.events.erase(id_of(event)) == 0)
    return bad_handle(h, id_of(event), false, "acmeEventDestroy");
  return acmeSuccess;
}

acmeError_t acmeEventRecord(acmeEvent_t event, acmeStream_t stream) {
  if (acmeError_t e = enter()) return e;
  std::shared_ptr<Event> ev;
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_event(event, "acmeEventRecord", &ev)) return e;
  if (acmeError_t e = find_stream(stream, "acmeEventRecord", &s)) return e;
  if (ev->device != s->device)
    return fail(acmeErrorDeviceMismatch,
                "acmeEventRecord: event %" PRIu64 " belongs to device %d but stream %" PRIu64
                " to device %d; an event can only be recorded on a stream of its own device",
                ev->id, ev->device, s->id, s->device);
  uint64_t version;
  {
    std::lock_guard<std::mutex> lock(ev->mutex);
    version = ++ev->recorded;
  }
  if (!s->push({}, [ev, version] { ev->complete(version); })) {
    ev->complete(version);  // no stream will reach the mark: never leave a waiter hanging
    return destroyed(*s, "acmeEventRecord");
  }
  return acmeSuccess;
}

acmeError_t acmeEventQuery(acmeEvent_t event, int* complete) {
  if (acmeError_t e = enter()) return e;
  if (!complete) return fail(acmeErrorInvalidValue, "acmeEventQuery: complete is NULL");
  std::shared_ptr<Event> ev;
  if (acmeError_t e = find_event(event, "acmeEventQuery", &ev)) return e;
  std::lock_guard<std::mutex> lock(ev->mutex);
  *complete = ev->completed >= ev->recorded ? 1 : 0;
  return acmeSuccess;
}

acmeError_t acmeEventSynchronize(acmeEvent_t event) {
  if (acmeError_t e = enter()) return e;
  std::shared_ptr<Event> ev;
  if (acmeError_t e = find_event(event, "acmeEventSynchronize", &ev)) return e;
  uint64_t version;
  {
    std::lock_guard<std::mutex> lock(ev->mutex);
    version = ev->recorded;
  }
  ev->wait_for(version);
//> ch06 event-sync-return < ch18 event-sync-return
//   return acmeSuccess;
//< ch06 event-sync-return
//> ch18 event-sync-return
  return acme::internal::take_failure(ev->device, "acmeEventSynchronize");
//< ch18 event-sync-return
}

acmeError_t acmeEventElapsedTime(float* ms, acmeEvent_t start, acmeEvent_t end) {
  if (acmeError_t e = enter()) return e;
  if (!ms) return fail(acmeErrorInvalidValue, "acmeEventElapsedTime: ms is NULL");
  std::shared_ptr<Event> events[2];
  if (acmeError_t e = find_event(start, "acmeEventElapsedTime", &events[0])) return e;
  if (acmeError_t e = find_event(end, "acmeEventElapsedTime", &events[1])) return e;
  if (events[0]->device != events[1]->device)
    return fail(acmeErrorDeviceMismatch,
                "acmeEventElapsedTime: event %" PRIu64 " belongs to device %d and event %" PRIu64
                " to device %d; elapsed time needs two events of one device",
                events[0]->id, events[0]->device, events[1]->id, events[1]->device);
  Clock::time_point when[2];
  for (int i = 0; i < 2; ++i) {
    Event& ev = *events[i];
    if (!ev.timing)
      return fail(acmeErrorInvalidValue,
                  "acmeEventElapsedTime: event %" PRIu64 " was created without "
                  "acmeEventTiming, so it takes no timestamps",
                  ev.id);
    std::lock_guard<std::mutex> lock(ev.mutex);
    if (ev.recorded == 0)
      return fail(acmeErrorInvalidValue, "acmeEventElapsedTime: event %" PRIu64
                  " was never recorded", ev.id);
    if (ev.completed < ev.recorded)
      return fail(acmeErrorNotReady,
                  "acmeEventElapsedTime: the latest record of event %" PRIu64
                  " has not completed yet; synchronize the event first",
                  ev.id);
    when[i] = ev.when;
  }
  *ms = std::chrono::duration<float, std::milli>(when[1] - when[0]).count();
  return acmeSuccess;
}
//< ch06 runtime-event-api

//> ch18 launch-kernel

// A kernel's launch: what the worker needs, and the release owed to the
// caller. One allocation per launch, freed by the worker once it ran.
struct Launch {
  char name[64];
  acmeKernelFunction function;
  void* args;
  void (*release)(void*);
  int device;
  uint64_t stream;
  bool default_stream;
//> ch19 launch-trace-field
  acme::internal::Trace trace{};  // set after construction
//< ch19 launch-trace-field

  void run() {
//> ch19 kernel-start
    const uint64_t start = trace.on ? acme::internal::now() : 0;
//< ch19 kernel-start
    char message[1024] = "";
    if (function(args, message, sizeof message) != 0) {
      if (message[0] == '\0') std::snprintf(message, sizeof message, "no message given");
      record_failure(device, {name, stream, default_stream, message});
    }
//> ch19 kernel-record
    if (trace.on)
      acme::internal::record_work(trace, {acmeActivityKernel, name}, device, stream, start,
                                  acme::internal::now());
//< ch19 kernel-record
    if (release) release(args);  // on the worker, before the stream counts it done
  }
};

acmeError_t acmeLaunchKernel(acmeStream_t stream, const char* name, acmeKernelFunction function,
                             void* args, void (*release)(void*)) {
  auto refuse = [&](acmeError_t e) {  // every way out releases args exactly once
    if (release) release(args);
    return e;
  };
  if (acmeError_t e = enter()) return refuse(e);
  if (!name || !function)
    return refuse(fail(acmeErrorInvalidValue, "acmeLaunchKernel: %s is NULL",
                       name ? "function" : "name"));
  std::shared_ptr<Stream> s;
  if (acmeError_t e = find_stream(stream, "acmeLaunchKernel", &s)) return refuse(e);
  auto* launch = new Launch{{}, function, args, release, s->device, s->id, s->is_default};
  std::strncpy(launch->name, name, sizeof launch->name - 1);
//> ch19 launch-begin-trace
  const acme::internal::Trace trace = acme::internal::begin_trace();
  launch->trace = trace;  // the worker may delete `launch` before push returns
//< ch19 launch-begin-trace
  if (!s->push([launch] {
        launch->run();
        delete launch;
      })) {
    delete launch;
    return refuse(destroyed(*s, "acmeLaunchKernel"));
  }
//> ch18 launch-finish < ch19 launch-finish
//   if (!acme::internal::launch_blocking()) return acmeSuccess;
//   return finish_blocking(*s, "acmeLaunchKernel");
//< ch18 launch-finish
//> ch19 launch-finish
  const acmeError_t e =
      acme::internal::launch_blocking() ? finish_blocking(*s, "acmeLaunchKernel") : acmeSuccess;
  acme::internal::record_host_call(trace, "acmeLaunchKernel", s->device, s->id);
  return e;
//< ch19 launch-finish
}
//< ch18 launch-kernel

}  // extern "C"

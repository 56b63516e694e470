// A ThreadSanitizer driver for the acme runtime alone (no PyTorch): threads
// that allocate, copy, fail, free, launch kernels, and use streams and events
// at the same time, some of them on the same objects, while a profiler turns
// activity tracing on and off. Built and run by
// tests/test_threads.py::test_runtime_under_thread_sanitizer with
// -fsanitize=thread; exits non-zero on a wrong result (TSan reports races).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/acme_activity.h"
#include "runtime/acme_host.h"
#include "runtime/acme_runtime.h"
#include "runtime/acme_streams.h"

namespace {

std::atomic<int> failures{0};

#define EXPECT(cond)                                                        \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: %s failed (last error: %s)\n", __FILE__, \
                   __LINE__, #cond, acmeGetLastErrorMessage());             \
      failures.fetch_add(1);                                                \
      return;                                                               \
    }                                                                       \
  } while (0)

constexpr int kThreads = 8;
constexpr int kIterations = 300;

// Allocate, fill, copy across devices, read back, fail on purpose, free.
void memory_worker(int index) {
  const int home = index % 2, other = 1 - home;
  EXPECT(acmeSetDevice(home) == acmeSuccess);
  std::vector<unsigned char> host(4096), back(4096);
  for (int i = 0; i < kIterations; ++i) {
    const size_t n = 1 + (static_cast<size_t>(i) * 131 + index * 17) % 4000;
    for (size_t k = 0; k < n; ++k) host[k] = static_cast<unsigned char>(k * 7 + i + index);
    void *a = nullptr, *b = nullptr;
    EXPECT(acmeMalloc(&a, n) == acmeSuccess);
    EXPECT(acmeMallocOnDevice(&b, n, other) == acmeSuccess);
    EXPECT(acmeMemcpy(a, host.data(), n, acmeMemcpyHostToDevice) == acmeSuccess);
    EXPECT(acmeMemcpy(b, a, n, acmeMemcpyDeviceToDevice) == acmeSuccess);
    std::memset(back.data(), 0, n);
    EXPECT(acmeMemcpy(back.data(), b, n, acmeMemcpyDeviceToHost) == acmeSuccess);
    EXPECT(std::memcmp(back.data(), host.data(), n) == 0);
    acmePointerAttributes attributes;
    EXPECT(acmePointerGetAttributes(&attributes, static_cast<char*>(b) + n - 1) == acmeSuccess);
    EXPECT(attributes.isDevice == 1 && attributes.device == other && attributes.base == b);
    // An overrun, whose message (kept per thread) must name this thread's excess.
    EXPECT(acmeMemcpy(a, host.data(), n + index + 1, acmeMemcpyHostToDevice) ==
           acmeErrorInvalidDevicePointer);
    const std::string excess = "by " + std::to_string(index + 1) + " bytes";
    EXPECT(std::strstr(acmeGetLastErrorMessage(), excess.c_str()) != nullptr);
    EXPECT(acmeMemset(a, index, n) == acmeSuccess);
    size_t bytes = 0, blocks = 0;
    EXPECT(acmeMemoryStats(home, &bytes, &blocks, nullptr) == acmeSuccess);
    EXPECT(blocks >= 1);
    EXPECT(acmeFree(a) == acmeSuccess);
    EXPECT(acmeFree(b) == acmeSuccess);
    // (No double free here: another thread may already have been given the
    // same address, and freeing it again would free that thread's memory.)
    int device = -1;
    EXPECT(acmeGetDevice(&device) == acmeSuccess && device == home);
  }
}

// Streams: async copies whose device memory is freed before they run, events
// recorded and waited for across threads, a stream shared by all threads.
acmeStream_t shared_stream = nullptr;

void stream_worker(int index) {
  const int device = index % 2;
  EXPECT(acmeSetDevice(device) == acmeSuccess);
  acmeStream_t mine = nullptr;
  acmeEvent_t event = nullptr;
  EXPECT(acmeStreamCreate(&mine, device) == acmeSuccess);
  EXPECT(acmeEventCreate(&event, device, acmeEventTiming) == acmeSuccess);
  std::vector<unsigned char> host(1024, static_cast<unsigned char>(index)), back(1024);
  for (int i = 0; i < kIterations; ++i) {
    void* p = nullptr;
    EXPECT(acmeMalloc(&p, host.size()) == acmeSuccess);
    EXPECT(acmeLaunchSleepKernel(mine, 20) == acmeSuccess);
    EXPECT(acmeMemcpyAsync(p, host.data(), host.size(), acmeMemcpyHostToDevice, mine) ==
           acmeSuccess);
    EXPECT(acmeMemsetAsync(p, index + 1, 512, mine) == acmeSuccess);
    EXPECT(acmeMemcpyAsync(back.data(), p, back.size(), acmeMemcpyDeviceToHost, mine) ==
           acmeSuccess);
    EXPECT(acmeFree(p) == acmeSuccess);  // the queued work keeps it mapped
    EXPECT(acmeEventRecord(event, mine) == acmeSuccess);
    if (shared_stream && device == 0) {
      EXPECT(acmeStreamWaitEvent(shared_stream, event) == acmeSuccess);
      EXPECT(acmeLaunchSleepKernel(shared_stream, 5) == acmeSuccess);
    }
    int done = 0;
    EXPECT(acmeEventQuery(event, &done) == acmeSuccess);
    EXPECT(acmeEventSynchronize(event) == acmeSuccess);
    EXPECT(back[0] == index + 1 && back[511] == index + 1 && back[512] == index);
    if (i % 50 == 0) EXPECT(acmeDeviceSynchronize() == acmeSuccess);
  }
  float ms = -1;
  EXPECT(acmeEventElapsedTime(&ms, event, event) == acmeSuccess && ms == 0);
  EXPECT(acmeStreamSynchronize(mine) == acmeSuccess);
  EXPECT(acmeStreamDestroy(mine) == acmeSuccess);
  EXPECT(acmeEventDestroy(event) == acmeSuccess);
  int complete = 0;
  EXPECT(acmeStreamQuery(mine, &complete) == acmeErrorInvalidHandle);
}

// Kernels (chapter 18): host functions each stream's worker runs in launch
// order. Every kernel counts itself in a counter of its launching thread and
// checks that it finds its own sequence number there, so a lost, repeated or
// reordered kernel shows; it may also check memory a copy queued before it
// wrote. The kernel threads use a device of their own (kKernelDevice): the
// failures they cause on purpose are reported by the next synchronizing call
// on that device, which must not be another worker's call expecting success.
constexpr int kKernelThreads = 4;
constexpr int kKernelDevice = 2;
acmeStream_t kernel_shared_stream = nullptr;  // on kKernelDevice, used by every kernel thread
std::atomic<int> kernel_order_errors{0}, kernel_data_errors{0};
// A failure is the device's, not the thread's: a thread that launches a
// failing kernel holds this exclusively until it has seen its failure
// reported; every other call that may report a failure holds it shared.
std::shared_mutex failure_gate;

struct KernelArgs {
  int* counter = nullptr;  // this thread's count of its kernels run on the stream
  int sequence = 0;        // the count this kernel must find
  bool fail = false;       // fails on purpose, after counting itself
  const unsigned char* check = nullptr;  // memory that must hold check_value
  size_t check_size = 0;
  unsigned char check_value = 0;
  std::atomic<int> ran{0}, released{0};
};

int counting_kernel(void* raw, char* message, size_t size) {
  auto* a = static_cast<KernelArgs*>(raw);
  a->ran.fetch_add(1);
  if (*a->counter != a->sequence) kernel_order_errors.fetch_add(1);
  *a->counter = a->sequence + 1;
  for (size_t k = 0; k < a->check_size; ++k) {
    if (a->check[k] != a->check_value) {
      kernel_data_errors.fetch_add(1);
      break;
    }
  }
  if (!a->fail) return 0;
  std::snprintf(message, size, "failed on purpose as kernel %d", a->sequence);
  return 1;
}

void count_release(void* raw) { static_cast<KernelArgs*>(raw)->released.fetch_add(1); }

void kernel_worker(int index) {
  EXPECT(acmeSetDevice(kKernelDevice) == acmeSuccess);
  acmeStream_t mine = nullptr;
  EXPECT(acmeStreamCreate(&mine, kKernelDevice) == acmeSuccess);
  int mine_count = 0, shared_count = 0;  // written by the streams' workers only
  int mine_next = 0, shared_next = 0;    // sequence numbers handed out
  std::vector<std::unique_ptr<KernelArgs>> launched;  // checked once the device ran them
  auto launch = [&](acmeStream_t stream, const char* name, bool fail = false,
                    const void* check = nullptr, size_t check_size = 0,
                    unsigned char check_value = 0) {
    auto args = std::make_unique<KernelArgs>();
    const bool on_mine = stream == mine;
    args->counter = on_mine ? &mine_count : &shared_count;
    args->sequence = on_mine ? mine_next++ : shared_next++;
    args->fail = fail;
    args->check = static_cast<const unsigned char*>(check);
    args->check_size = check_size;
    args->check_value = check_value;
    launched.push_back(std::move(args));
    return acmeLaunchKernel(stream, name, counting_kernel, launched.back().get(), count_release);
  };
  // Declared after `launched`, so destroyed before it: an EXPECT that returns
  // early must not free args that kernels still queued would use. (Through the
  // gate too: it may report, and so take, another thread's failure.)
  struct Drain {
    acmeStream_t streams[2];
    ~Drain() {
      std::shared_lock<std::shared_mutex> gate(failure_gate);
      for (acmeStream_t s : streams) (void)acmeStreamSynchronize(s);
    }
  } drain{{mine, kernel_shared_stream}};
  constexpr size_t n = 2048;
  void* pinned = nullptr;
  EXPECT(acmeHostAlloc(&pinned, n) == acmeSuccess);
  std::vector<unsigned char> host(n), back(n);
  for (int i = 0; i < kIterations; ++i) {
    // As a framework does around each operator. A trace that starts meanwhile
    // drops this thread's stack, so the pop may find it empty: not an error here.
    EXPECT(acmeActivityPushExternalId(static_cast<uint64_t>(i) + 1) == acmeSuccess);
    const auto value = static_cast<unsigned char>(i * 3 + index);
    const auto other = static_cast<unsigned char>(value ^ 0x5a);
    std::memset(host.data(), value, n);
    EXPECT(launch(mine, "count") == acmeSuccess);
    EXPECT(launch(kernel_shared_stream, "count_shared") == acmeSuccess);
    // A pageable source is staged before the call returns: overwrite it at once.
    void* p = nullptr;
    EXPECT(acmeMalloc(&p, n) == acmeSuccess);
    EXPECT(acmeMemcpyAsync(p, host.data(), n, acmeMemcpyHostToDevice, mine) == acmeSuccess);
    std::memset(host.data(), 0, n);
    void* view = nullptr;
    EXPECT(acmeDeviceAccess(&view, p) == acmeSuccess);
    EXPECT(launch(mine, "check_copy", false, view, n, value) == acmeSuccess);
    EXPECT(acmeMemsetAsync(p, other, n, mine) == acmeSuccess);
    EXPECT(acmeMemcpyAsync(pinned, p, n, acmeMemcpyDeviceToHost, mine) == acmeSuccess);
    EXPECT(launch(mine, "check_pinned", false, pinned, n, other) == acmeSuccess);
    if (i % 3 == 0) {
      // Into pageable memory: synchronous, so it may report a failure.
      std::shared_lock<std::shared_mutex> gate(failure_gate);
      EXPECT(acmeMemcpyAsync(back.data(), p, n, acmeMemcpyDeviceToHost, mine) == acmeSuccess);
      EXPECT(back[0] == other && back[n - 1] == other);
    }
    (void)acmeActivityPopExternalId();
    EXPECT(acmeFree(p) == acmeSuccess);  // waits for the device: the kernels above ran
    EXPECT(static_cast<unsigned char*>(pinned)[n / 2] == other);
    // ...and each was released exactly once, before its stream counted it done.
    for (const auto& args : launched) EXPECT(args->ran.load() == 1 && args->released.load() == 1);
    launched.clear();
    if (i % 20 == 10) {
      // A kernel that fails: the next synchronization reports it, once, by name.
      std::unique_lock<std::shared_mutex> gate(failure_gate);
      const acmeStream_t target = (i / 20) % 2 ? mine : kernel_shared_stream;
      const std::string name = "fail_t" + std::to_string(index) + "_i" + std::to_string(i);
      EXPECT(launch(target, name.c_str(), true) == acmeSuccess);
      EXPECT(launch(target, "after_failure") == acmeSuccess);  // the stream goes on
      EXPECT(acmeStreamSynchronize(target) == acmeErrorLaunchFailure);
      const char* message = acmeGetLastErrorMessage();
      EXPECT(std::strstr(message, ("kernel " + name + " failed").c_str()) != nullptr);
      EXPECT(std::strstr(message, "of device 2: failed on purpose") != nullptr);
      EXPECT(std::strstr(message, "the default stream") == nullptr);
      EXPECT(std::strstr(message, "reported by acmeStreamSynchronize") != nullptr);
      EXPECT(acmeStreamSynchronize(target) == acmeSuccess);
    }
    if (i % 50 == 25) {
      // Launches that cannot be queued release their args before returning.
      acmeStream_t gone = nullptr;
      EXPECT(acmeStreamCreate(&gone, kKernelDevice) == acmeSuccess);
      EXPECT(acmeStreamDestroy(gone) == acmeSuccess);
      KernelArgs refused;
      EXPECT(acmeLaunchKernel(gone, "refused", counting_kernel, &refused, count_release) ==
             acmeErrorInvalidHandle);
      EXPECT(refused.released.load() == 1 && refused.ran.load() == 0);
      EXPECT(acmeLaunchKernel(mine, nullptr, counting_kernel, &refused, count_release) ==
             acmeErrorInvalidValue);
      EXPECT(refused.released.load() == 2 && refused.ran.load() == 0);
    }
  }
  {
    std::shared_lock<std::shared_mutex> gate(failure_gate);
    EXPECT(acmeStreamSynchronize(mine) == acmeSuccess);
    EXPECT(acmeStreamSynchronize(kernel_shared_stream) == acmeSuccess);
  }
  EXPECT(mine_count == mine_next && shared_count == shared_next);
  for (const auto& args : launched) EXPECT(args->ran.load() == 1 && args->released.load() == 1);
  EXPECT(acmeStreamDestroy(mine) == acmeSuccess);
  EXPECT(acmeHostFree(pinned) == acmeSuccess);
}

// One thread destroys streams that others are still using: every call on a
// destroyed handle must fail cleanly, never touch freed memory.
void destroy_while_used() {
  for (int round = 0; round < 50; ++round) {
    acmeStream_t s = nullptr;
    EXPECT(acmeStreamCreate(&s, round % 2) == acmeSuccess);
    std::atomic<bool> go{false};
    std::vector<std::thread> users;
    for (int u = 0; u < 3; ++u) {
      users.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        for (int k = 0; k < 100; ++k) {
          int complete = 0;
          const acmeError_t e = acmeStreamQuery(s, &complete);
          if (e != acmeSuccess && e != acmeErrorInvalidHandle) failures.fetch_add(1);
          const acmeError_t f = acmeLaunchSleepKernel(s, 1);
          if (f != acmeSuccess && f != acmeErrorInvalidHandle) failures.fetch_add(1);
        }
      });
    }
    go.store(true);
    std::this_thread::yield();
    EXPECT(acmeStreamDestroy(s) == acmeSuccess);
    for (auto& t : users) t.join();
  }
}

// A profiler (chapter 19): starts and stops tracing and drains the records
// while the other threads queue work; every record must be whole.
void tracing_worker() {
  std::vector<acmeActivityRecord> batch(256);
  for (int round = 0; round < 100; ++round) {
    EXPECT(acmeActivityEnable(1) == acmeSuccess);
    for (int k = 0; k < 10; ++k) {
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      size_t count = 0;
      EXPECT(acmeActivityFlush(batch.data(), batch.size(), &count) == acmeSuccess);
      for (size_t i = 0; i < count; ++i) {
        const acmeActivityRecord& r = batch[i];
        EXPECT(r.kind >= acmeActivityKernel && r.kind <= acmeActivityHostCall);
        EXPECT(r.start <= r.end && r.correlation != 0 && r.name[0] != '\0');
        EXPECT(r.device >= 0 && r.stream != 0);
        EXPECT(r.kind != acmeActivityHostCall || r.thread != 0);
      }
    }
    EXPECT(acmeActivityEnable(0) == acmeSuccess);
  }
  size_t count = 1;
  while (count) EXPECT(acmeActivityFlush(batch.data(), batch.size(), &count) == acmeSuccess);
}

}  // namespace

int main() {
  // The kernel threads' device of their own (read on the runtime's first call).
  setenv("ACME_DEVICE_COUNT", "3", /*overwrite=*/0);
  int count = 0;
  if (acmeGetDeviceCount(&count) != acmeSuccess || count <= kKernelDevice) {
    std::fprintf(stderr, "need %d devices: %s\n", kKernelDevice + 1, acmeGetLastErrorMessage());
    return 2;
  }
  if (acmeStreamCreate(&shared_stream, 0) != acmeSuccess) return 2;
  if (acmeStreamCreate(&kernel_shared_stream, kKernelDevice) != acmeSuccess) return 2;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(memory_worker, i);
  for (int i = 0; i < kThreads / 2; ++i) threads.emplace_back(stream_worker, i);
  for (int i = 0; i < kKernelThreads; ++i) threads.emplace_back(kernel_worker, i);
  threads.emplace_back(destroy_while_used);
  threads.emplace_back(tracing_worker);
  // A thread blocked for good in a runtime call is a failure to report, not a
  // run that outlasts the test's timeout (a few seconds is normal under TSan).
  std::atomic<bool> finished{false};
  std::thread watchdog([&finished] {
    for (int tenth = 0; tenth < 1200 && !finished.load(); ++tenth)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (finished.load()) return;
    std::fprintf(stderr, "hang: the workers have not finished after 120 s: a thread is "
                         "blocked in a runtime call\n");
    std::fflush(stderr);
    std::_Exit(3);
  });
  for (auto& t : threads) t.join();
  finished.store(true);
  watchdog.join();
  if (acmeStreamSynchronize(shared_stream) != acmeSuccess) return 2;
  if (acmeStreamDestroy(shared_stream) != acmeSuccess) return 2;
  if (acmeStreamSynchronize(kernel_shared_stream) != acmeSuccess) return 2;
  if (acmeStreamDestroy(kernel_shared_stream) != acmeSuccess) return 2;
  if (kernel_order_errors.load() || kernel_data_errors.load()) {
    std::fprintf(stderr, "kernels: %d ran out of order, %d saw wrong data\n",
                 kernel_order_errors.load(), kernel_data_errors.load());
    return 1;
  }
  for (int d = 0; d < count; ++d) {
    size_t bytes = 1, blocks = 1;
    acmeSetDevice(d);
    acmeDeviceSynchronize();
    if (acmeMemoryStats(d, &bytes, &blocks, nullptr) != acmeSuccess || bytes || blocks) {
      std::fprintf(stderr, "device %d: %zu bytes in %zu blocks still in use\n", d, bytes, blocks);
      return 1;
    }
  }
  if (failures.load()) {
    std::fprintf(stderr, "%d failures\n", failures.load());
    return 1;
  }
  std::printf("ok: %d memory threads x %d iterations, %d stream threads, %d kernel threads, "
              "checked mode %d\n",
              kThreads, kIterations, kThreads / 2, kKernelThreads, acmeCheckedMode());
  return 0;
}

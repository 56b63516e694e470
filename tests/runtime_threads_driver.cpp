// A ThreadSanitizer driver for the acme runtime alone (no PyTorch): threads
// that allocate, copy, fail, free, and use streams and events at the same
// time, some of them on the same objects. Built and run by
// tests/test_threads.py::test_runtime_under_thread_sanitizer with
// -fsanitize=thread; exits non-zero on a wrong result (TSan reports races).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "runtime/acme_runtime.h"

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

}  // namespace

int main() {
  int count = 0;
  if (acmeGetDeviceCount(&count) != acmeSuccess || count < 2) {
    std::fprintf(stderr, "need 2 devices: %s\n", acmeGetLastErrorMessage());
    return 2;
  }
  if (acmeStreamCreate(&shared_stream, 0) != acmeSuccess) return 2;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(memory_worker, i);
  for (int i = 0; i < kThreads / 2; ++i) threads.emplace_back(stream_worker, i);
  threads.emplace_back(destroy_while_used);
  for (auto& t : threads) t.join();
  if (acmeStreamSynchronize(shared_stream) != acmeSuccess) return 2;
  if (acmeStreamDestroy(shared_stream) != acmeSuccess) return 2;
  for (int d = 0; d < 2; ++d) {
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
  std::printf("ok: %d memory threads x %d iterations, %d stream threads, checked mode %d\n",
              kThreads, kIterations, kThreads / 2, acmeCheckedMode());
  return 0;
}

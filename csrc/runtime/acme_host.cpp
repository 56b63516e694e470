//@ ch11
// Pinned host memory: host allocations the runtime knows about. On real
// hardware they are page-locked so that the device's copy engines can reach
// them; here they are ordinary host memory kept in a table, which is all it
// takes to answer "is this pointer pinned?".
#include "runtime/acme_host.h"

#include <cinttypes>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>

#include <pthread.h>

#include "runtime/internal.h"

namespace {

constexpr size_t kHostAlignment = 4096;

struct HostTable {
  std::mutex mutex;
  std::map<uintptr_t, size_t> live;  // base -> size
};

// Never destroyed: pinned tensors may be freed during static destruction.
HostTable& table() {
  static HostTable* t = [] {
    auto* created = new HostTable;
    // Held across fork(), like the device registry: a child may still free.
    pthread_atfork([] { table().mutex.lock(); }, [] { table().mutex.unlock(); },
                   [] { table().mutex.unlock(); });
    return created;
  }();
  return *t;
}

}  // namespace

extern "C" {

acmeError_t acmeHostAlloc(void** ptr, size_t size) {
  using acme::internal::fail;
  if (acmeError_t e = acme::internal::enter()) return e;
  if (!ptr) return fail(acmeErrorInvalidValue, "acmeHostAlloc: ptr is NULL");
  *ptr = nullptr;
  if (size == 0) return acmeSuccess;
  if (size > SIZE_MAX - kHostAlignment)
    return fail(acmeErrorMemoryAllocation, "acmeHostAlloc: %zu bytes cannot be allocated", size);
  const size_t rounded = (size + kHostAlignment - 1) & ~(kHostAlignment - 1);
  void* p = std::aligned_alloc(kHostAlignment, rounded);
  if (!p)
    return fail(acmeErrorMemoryAllocation,
                "out of pinned host memory: the host could not provide %zu bytes", size);
  HostTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.live.emplace(reinterpret_cast<uintptr_t>(p), size);
  *ptr = p;
  return acmeSuccess;
}

acmeError_t acmeHostFree(void* ptr) {
  if (!ptr) return acmeSuccess;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  HostTable& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.live.find(p);
    if (it == t.live.end())
      return acme::internal::fail(acmeErrorInvalidValue,
                                  "acmeHostFree(0x%" PRIxPTR "): not the base of a pinned host "
                                  "allocation (acmeHostAlloc)",
                                  p);
    t.live.erase(it);
  }
  std::free(ptr);
  return acmeSuccess;
}

acmeError_t acmeHostIsPinned(const void* ptr, int* isPinned) {
  if (!isPinned)
    return acme::internal::fail(acmeErrorInvalidValue, "acmeHostIsPinned: isPinned is NULL");
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  HostTable& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  auto it = t.live.upper_bound(p);
  *isPinned = 0;
  if (it != t.live.begin()) {
    --it;
    *isPinned = p - it->first < it->second ? 1 : 0;
  }
  return acmeSuccess;
}

}  // extern "C"

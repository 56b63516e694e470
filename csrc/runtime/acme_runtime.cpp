//@ ch00
// The acme runtime: configuration, devices, the allocation registry, and the
// checked copies. Checked mode's mappings and fault handler live in
// checked_memory.cpp.
#include "runtime/acme_runtime.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
//> ch11 fork-include
#include <atomic>

#include <pthread.h>
//< ch11 fork-include

#include "runtime/checked_memory.h"
//> ch11 device-include
#include "runtime/acme_device.h"
//< ch11 device-include
//> ch18 host-include
#include "runtime/acme_host.h"
//< ch18 host-include
//> ch16 ipc-include
#include "runtime/acme_ipc.h"
//< ch16 ipc-include
//> ch06 internal-include
#include "runtime/internal.h"
//< ch06 internal-include

namespace {

constexpr int kMaxDevices = 16;

// ---- errors ----

thread_local char last_error[1024] = "no error";

__attribute__((format(printf, 2, 3))) acmeError_t fail(acmeError_t code, const char* format,
                                                        ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(last_error, sizeof last_error, format, args);
  va_end(args);
  return code;
}

// "512 bytes", "768 KiB", "63.9 MiB", "1.00 GiB": three significant digits.
struct HumanSize {
  char text[32];
  explicit HumanSize(size_t bytes) {
    if (bytes < 1024) {
      std::snprintf(text, sizeof text, "%zu bytes", bytes);
      return;
    }
    const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double value = static_cast<double>(bytes) / 1024;
    int unit = 0;
    while (value >= 1024 && unit < 5) {
      value /= 1024;
      ++unit;
    }
    const int decimals = value < 10 ? 2 : value < 100 ? 1 : 0;
    std::snprintf(text, sizeof text, "%.*f %s", decimals, value, units[unit]);
  }
};

// ---- configuration (read once from the environment) ----

struct Config {
  acmeError_t status = acmeSuccess;
  char message[512] = "";
  int device_count = 2;
  size_t capacity = size_t{16} << 30;
  bool checked = true;
//> ch12 poison-config
  bool poison = false;  // ACME_CHECKED=2: new memory is filled with 0xff bytes
//< ch12 poison-config
//> ch18 blocking-config
  bool launch_blocking = false;  // ACME_LAUNCH_BLOCKING=1
//< ch18 blocking-config
};

// Digits with an optional K/M/G/T suffix (powers of 1024), optionally followed
// by "B" or "iB": "4096", "64M", "1GiB".
bool parse_size(const char* text, size_t* out) {
  if (!std::isdigit(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* end;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno == ERANGE) return false;
  int shift = 0;
  switch (std::toupper(static_cast<unsigned char>(*end))) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
  }
  if (shift) {
    ++end;
    if (*end == 'i') ++end;
  }
  if (*end == 'B' || *end == 'b') ++end;
  if (*end != '\0' || value > (SIZE_MAX >> shift)) return false;
  *out = static_cast<size_t>(value) << shift;
  return true;
}

Config load_config() {
  Config c;
  if (const char* text = std::getenv("ACME_DEVICE_COUNT")) {
    char* end;
    const long n = std::strtol(text, &end, 10);
//> ch00 device-count-range < ch11 device-count-range
//     if (!std::isdigit(static_cast<unsigned char>(text[0])) || *end != '\0' || n < 1 ||
//         n > kMaxDevices) {
//       c.status = acmeErrorInitialization;
//       std::snprintf(c.message, sizeof c.message,
//                     "ACME_DEVICE_COUNT=\"%s\" is invalid: it must be an integer from 1 to %d",
//                     text, kMaxDevices);
//< ch00 device-count-range
//> ch11 device-count-range
    // 0 is a machine without acme devices: valid, and every device call says so.
    if (!std::isdigit(static_cast<unsigned char>(text[0])) || *end != '\0' || n < 0 ||
        n > kMaxDevices) {
      c.status = acmeErrorInitialization;
      std::snprintf(c.message, sizeof c.message,
                    "ACME_DEVICE_COUNT=\"%s\" is invalid: it must be an integer from 0 to %d",
                    text, kMaxDevices);
//< ch11 device-count-range
      return c;
    }
    c.device_count = static_cast<int>(n);
  }
  if (const char* text = std::getenv("ACME_DEVICE_MEMORY")) {
    if (!parse_size(text, &c.capacity) || c.capacity == 0) {
      c.status = acmeErrorInitialization;
      std::snprintf(c.message, sizeof c.message,
                    "ACME_DEVICE_MEMORY=\"%s\" is invalid: it must be a positive number of "
                    "bytes, optionally with a K, M, G or T suffix (e.g. \"64M\")",
                    text);
      return c;
    }
  }
  if (const char* text = std::getenv("ACME_CHECKED")) {
    if (std::strcmp(text, "0") == 0) {
      c.checked = false;
//> ch00 checked-values < ch12 checked-values
//     } else if (std::strcmp(text, "1") != 0) {
//       c.status = acmeErrorInitialization;
//       std::snprintf(c.message, sizeof c.message,
//                     "ACME_CHECKED=\"%s\" is invalid: it must be 1 (checked device memory, the "
//                     "default) or 0 (plain host memory)",
//                     text);
//< ch00 checked-values
//> ch12 checked-values
    } else if (std::strcmp(text, "2") == 0) {
      c.poison = true;
    } else if (std::strcmp(text, "1") != 0) {
      c.status = acmeErrorInitialization;
      std::snprintf(c.message, sizeof c.message,
                    "ACME_CHECKED=\"%s\" is invalid: it must be 1 (checked device memory, the "
                    "default), 2 (checked, and new memory poisoned) or 0 (plain host memory)",
                    text);
//< ch12 checked-values
    }
  }
//> ch18 blocking-parse
  if (const char* text = std::getenv("ACME_LAUNCH_BLOCKING")) {
    if (std::strcmp(text, "1") == 0) {
      c.launch_blocking = true;
    } else if (std::strcmp(text, "0") != 0) {
      c.status = acmeErrorInitialization;
      std::snprintf(c.message, sizeof c.message,
                    "ACME_LAUNCH_BLOCKING=\"%s\" is invalid: it must be 0 (kernels run "
                    "asynchronously, the default) or 1 (every launch waits for its kernel)",
                    text);
      return c;
    }
  }
//< ch18 blocking-parse
  return c;
}

const Config& config() {
  static const Config c = load_config();
  return c;
}

//> ch11 initialization
// ---- initialization, and fork() ----

// Set in the child of a fork() that happened after initialization. The child
// has none of the parent's threads (stream workers), and in checked mode it
// shares the parent's device memory: letting it compute would be a hang or a
// silent write into the parent's tensors.
std::atomic<bool> forked_child{false};

void lock_for_fork();  // with the registry, below
void unlock_after_fork();

acmeError_t initialize() {
  if (forked_child.load(std::memory_order_relaxed))
    return fail(acmeErrorForkedChild,
                "the acme runtime was initialized before this process was forked, and a "
                "child of fork() cannot use it: start child processes with the 'spawn' "
                "method (multiprocessing.set_start_method('spawn'))");
  if (config().device_count == 0)
    return fail(acmeErrorNoDevice, "no acme device is present (ACME_DEVICE_COUNT=0)");
  // Every call passes here: a flag keeps it to one load once done (call_once
  // alone costs tens of nanoseconds per call).
  static std::atomic<bool> done{false};
  if (done.load(std::memory_order_acquire)) return acmeSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    // The registry's lock is held across fork(), so the child never inherits
    // it locked by a thread that does not exist there.
    pthread_atfork(&lock_for_fork, &unlock_after_fork, [] {
      unlock_after_fork();
      forked_child.store(true, std::memory_order_relaxed);
    });
  });
  done.store(true, std::memory_order_release);
  return acmeSuccess;
}

//< ch11 initialization
// Every entry point starts here.
acmeError_t enter() {
  const Config& c = config();
  if (c.status != acmeSuccess) return fail(c.status, "%s", c.message);
//> ch11 enter-initializes
  if (acmeError_t e = initialize()) return e;
//< ch11 enter-initializes
  if (c.checked) acme::checked::ensure_signal_stack();
  return acmeSuccess;
}
//> ch11 enter-uninitialized

// The entry of the calls that work without a device and in a forked child:
// the device count, the properties, frees.
acmeError_t enter_uninitialized() {
  const Config& c = config();
  if (c.status != acmeSuccess) return fail(c.status, "%s", c.message);
  if (c.checked) acme::checked::ensure_signal_stack();
  return acmeSuccess;
}
//< ch11 enter-uninitialized

acmeError_t check_device(int device) {
  const int count = config().device_count;
  if (device >= 0 && device < count) return acmeSuccess;
  return fail(acmeErrorInvalidDevice, "invalid device ordinal %d: there %s %d acme device%s",
              device, count == 1 ? "is" : "are", count, count == 1 ? "" : "s");
}

thread_local int current_device = 0;

// ---- the allocation registry ----

struct Allocation {
  uintptr_t base = 0;
  size_t size = 0;  // requested
  size_t span = 0;  // reserved: page-rounded in checked mode
  int device = 0;
  char* view = nullptr;  // the device's view of base
  int slot = -1;         // fault-table slot (checked mode)
  acme::checked::Mapping mapping;
//> ch16 imported
  bool imported = false;  // opened from another process's handle
//< ch16 imported

  ~Allocation() {
    if (mapping.device) {
      acme::checked::unmap(mapping);
    } else {
      std::free(view);
    }
  }
};

// Shared ownership lets an in-flight copy keep its memory mapped even if
// another thread frees it meanwhile (and, later, a queued stream operation).
using AllocationRef = std::shared_ptr<Allocation>;

struct Registry {
  std::mutex mutex;
  std::map<uintptr_t, AllocationRef> live;  // by base
  struct Stats {
    size_t bytes = 0, blocks = 0, peak = 0;
  } stats[kMaxDevices];
  // Recently freed bases, so a double free can be called one.
  uintptr_t freed[64] = {};
  unsigned freed_next = 0;

  // The allocation whose reserved span contains p.
  AllocationRef containing(uintptr_t p) const {
    auto it = live.upper_bound(p);
    if (it == live.begin()) return nullptr;
    --it;
    return p - it->first < it->second->span ? it->second : nullptr;
  }
  // The allocation whose requested bytes contain p (its reserved tail excluded).
  AllocationRef holding(uintptr_t p) const {
    AllocationRef a = containing(p);
    return a && p - a->base < a->size ? a : nullptr;
  }
  // Some allocation overlapping [p, p + n), n > 0.
  AllocationRef overlapping(uintptr_t p, size_t n) const {
    if (AllocationRef a = containing(p)) return a;
    auto it = live.upper_bound(p);
    return it != live.end() && it->first - p < n ? it->second : nullptr;
  }
};

// Never destroyed: memory may still be freed during static destruction.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}
//> ch11 fork-lock

void lock_for_fork() { registry().mutex.lock(); }
void unlock_after_fork() { registry().mutex.unlock(); }
//< ch11 fork-lock

// ---- validated operations ----

// One side of a copy or memset, resolved to the device's view.
struct Side {
  char* address = nullptr;
  AllocationRef keep;  // holds device memory mapped until the operation ran
};

// A device range must lie inside one live allocation. `what` starts the
// message, e.g. "copy of 64 bytes from".
acmeError_t resolve_device(const Registry& r, uintptr_t p, size_t n, const char* what,
                           Side* side) {
  AllocationRef a = r.containing(p);
  if (!a)
    return fail(acmeErrorInvalidDevicePointer,
                "%s 0x%" PRIxPTR ": not a device pointer (no live acme allocation contains it)",
                what, p);
  const size_t offset = p - a->base;
  if (offset > a->size || n > a->size - offset)
    return fail(acmeErrorInvalidDevicePointer,
                "%s 0x%" PRIxPTR " overruns the device allocation at 0x%" PRIxPTR
                " (%zu bytes, device %d) by %zu bytes",
                what, p, a->base, a->size, a->device, offset + n - a->size);
  side->address = a->view + offset;
  side->keep = std::move(a);
  return acmeSuccess;
}

// A host range must not touch device memory. `fix` says what to do instead.
acmeError_t resolve_host(const Registry& r, uintptr_t p, size_t n, const char* fix,
                         Side* side) {
  if (p == 0) return fail(acmeErrorInvalidValue, "host pointer is NULL for a copy of %zu bytes", n);
  if (AllocationRef a = r.overlapping(p, n))
    return fail(acmeErrorHostAccessToDevice,
                "host access to device memory: 0x%" PRIxPTR " lies in the allocation at 0x%" PRIxPTR
                " (%zu bytes, device %d); %s",
                std::max(p, a->base), a->base, a->size, a->device, fix);
  side->address = reinterpret_cast<char*>(p);
  return acmeSuccess;
}

//> ch00 run-comment < ch06 run-comment
// // Runs a validated operation. Today it runs at once on the calling thread; a
// // stream would queue it instead (the Sides keep their memory alive).
//< ch00 run-comment
//> ch06 run-comment
// Runs a validated operation: at once on the calling thread (acmeMemcpy), or
// later on a stream's worker (acmeMemcpyAsync), the Sides keeping the device
// memory mapped until then.
//< ch06 run-comment
void run_copy(const Side& dst, const Side& src, size_t count) {
  std::memmove(dst.address, src.address, count);
}
void run_fill(const Side& dst, int value, size_t count) {
  std::memset(dst.address, value, count);
}

acmeError_t check_range(uintptr_t p, size_t n) {
  if (p + n < p)
    return fail(acmeErrorInvalidValue,
                "the range 0x%" PRIxPTR " + %zu bytes wraps around the address space", p, n);
  return acmeSuccess;
}

// Validates both sides of a copy under the registry lock. count 0 is valid
// and resolves nothing.
acmeError_t prepare_copy(void* dst, const void* src, size_t count, acmeMemcpyKind kind,
                         Side* dst_side, Side* src_side) {
  if (kind < acmeMemcpyHostToHost || kind > acmeMemcpyDeviceToDevice)
    return fail(acmeErrorInvalidValue, "acmeMemcpy: invalid kind %d", static_cast<int>(kind));
  if (count == 0) return acmeSuccess;
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (acmeError_t e = check_range(d, count)) return e;
  if (acmeError_t e = check_range(s, count)) return e;
  const bool dst_on_device = kind == acmeMemcpyHostToDevice || kind == acmeMemcpyDeviceToDevice;
  const bool src_on_device = kind == acmeMemcpyDeviceToHost || kind == acmeMemcpyDeviceToDevice;

  char to[64], from[64];
  std::snprintf(to, sizeof to, "copy of %zu bytes to", count);
  std::snprintf(from, sizeof from, "copy of %zu bytes from", count);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  acmeError_t e = dst_on_device
                      ? resolve_device(r, d, count, to, dst_side)
                      : resolve_host(r, d, count, "write it with acmeMemcpyHostToDevice", dst_side);
  if (e) return e;
  return src_on_device
             ? resolve_device(r, s, count, from, src_side)
             : resolve_host(r, s, count, "copy it with acmeMemcpyDeviceToHost", src_side);
}

acmeError_t prepare_fill(void* devPtr, size_t count, Side* side) {
  if (count == 0) return acmeSuccess;
  const auto p = reinterpret_cast<uintptr_t>(devPtr);
  if (acmeError_t e = check_range(p, count)) return e;
  char what[64];
  std::snprintf(what, sizeof what, "memset of %zu bytes at", count);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return resolve_device(r, p, count, what, side);
}

}  // namespace
//> ch06 internal

// The private interface acme_streams.cpp uses (runtime/internal.h).
namespace acme::internal {

acmeError_t enter() { return ::enter(); }
acmeError_t check_device(int device) { return ::check_device(device); }
int current_device() { return ::current_device; }

acmeError_t fail(acmeError_t code, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(last_error, sizeof last_error, format, args);
  va_end(args);
  return code;
}

}  // namespace acme::internal
//< ch06 internal
//> ch18 internal-blocking

bool acme::internal::launch_blocking() { return config().launch_blocking; }

namespace {

// The synchronous calls first wait for the devices they touch.
acmeError_t wait_for_devices(const Side& a, const Side& b, const char* caller) {
  int first = -1;
  for (const Side* side : {&a, &b}) {
    if (!side->keep || side->keep->device == first) continue;
    first = side->keep->device;
    if (acmeError_t e = acme::internal::synchronize_device(first, caller)) return e;
  }
  return acmeSuccess;
}

//> ch19 copy-traces
// Chapter 19: what traces call a copy, and the device it ran on (-1 for one
// between host buffers, which no trace shows).
const char* copy_name(acmeMemcpyKind kind) {
  switch (kind) {
    case acmeMemcpyHostToDevice: return "Memcpy HtoD";
    case acmeMemcpyDeviceToHost: return "Memcpy DtoH";
    case acmeMemcpyDeviceToDevice: return "Memcpy DtoD";
    default: return "Memcpy HtoH";
  }
}
int device_of(const Side& a, const Side& b) {
  return a.keep ? a.keep->device : b.keep ? b.keep->device : -1;
}

// A synchronous copy or fill runs on the calling thread once the device is
// idle; traces show it on the default stream, as CUDA's do. The host call's
// record covers the wait before it too.
template <class Run>
void run_traced(const acme::internal::Trace& t, const acme::internal::Work& what, int device,
                const char* caller, const Run& run) {
  const uint64_t start = t.on ? acme::internal::now() : 0;
  run();
  if (!t.on || device < 0) return;
  const uint64_t end = acme::internal::now();
  acmeStream_t stream = nullptr;
  if (acmeStreamGetDefault(&stream, device) != acmeSuccess) return;
  const auto id = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(stream));
  acme::internal::record_work(t, what, device, id, start, end);
  acme::internal::record_host_call(t, caller, device, id);
}
//< ch19 copy-traces
bool is_pinned(const void* p) {
  int pinned = 0;
  return acmeHostIsPinned(p, &pinned) == acmeSuccess && pinned;
}

}  // namespace
//< ch18 internal-blocking

extern "C" {

const char* acmeGetErrorName(acmeError_t error) {
  switch (error) {
    case acmeSuccess: return "acmeSuccess";
    case acmeErrorInvalidDevice: return "acmeErrorInvalidDevice";
    case acmeErrorInvalidValue: return "acmeErrorInvalidValue";
    case acmeErrorMemoryAllocation: return "acmeErrorMemoryAllocation";
    case acmeErrorInvalidDevicePointer: return "acmeErrorInvalidDevicePointer";
    case acmeErrorHostAccessToDevice: return "acmeErrorHostAccessToDevice";
    case acmeErrorInitialization: return "acmeErrorInitialization";
    case acmeErrorInvalidHandle: return "acmeErrorInvalidHandle";
    case acmeErrorDeviceMismatch: return "acmeErrorDeviceMismatch";
    case acmeErrorNotReady: return "acmeErrorNotReady";
    case acmeErrorNoDevice: return "acmeErrorNoDevice";
    case acmeErrorForkedChild: return "acmeErrorForkedChild";
    case acmeErrorLaunchFailure: return "acmeErrorLaunchFailure";
    case acmeErrorCommFailure: return "acmeErrorCommFailure";
  }
  return "acmeErrorUnrecognized";
}

const char* acmeGetErrorString(acmeError_t error) {
  switch (error) {
    case acmeSuccess: return "no error";
    case acmeErrorInvalidDevice: return "invalid device ordinal";
    case acmeErrorInvalidValue: return "invalid argument";
    case acmeErrorMemoryAllocation: return "out of device memory";
    case acmeErrorInvalidDevicePointer: return "invalid device pointer";
    case acmeErrorHostAccessToDevice: return "host access to device memory";
    case acmeErrorInitialization: return "invalid runtime configuration";
    case acmeErrorInvalidHandle: return "invalid stream or event handle";
    case acmeErrorDeviceMismatch: return "stream or event of another device";
    case acmeErrorNotReady: return "work not completed yet";
    case acmeErrorNoDevice: return "no acme device is present";
    case acmeErrorForkedChild: return "runtime used in a child of fork()";
    case acmeErrorLaunchFailure: return "a kernel failed while it ran";
    case acmeErrorCommFailure: return "the communicator failed";
  }
  return "unrecognized error code";
}

const char* acmeGetLastErrorMessage(void) { return last_error; }

acmeError_t acmeGetDeviceCount(int* count) {
//> ch00 count-enter < ch11 count-enter
//   if (acmeError_t e = enter()) return e;
//< ch00 count-enter
//> ch11 count-enter
  if (acmeError_t e = enter_uninitialized()) return e;
//< ch11 count-enter
  if (!count) return fail(acmeErrorInvalidValue, "acmeGetDeviceCount: count is NULL");
  *count = config().device_count;
  return acmeSuccess;
}

acmeError_t acmeSetDevice(int device) {
  if (acmeError_t e = enter()) return e;
  if (acmeError_t e = check_device(device)) return e;
  current_device = device;
  return acmeSuccess;
}

acmeError_t acmeGetDevice(int* device) {
  if (acmeError_t e = enter()) return e;
  if (!device) return fail(acmeErrorInvalidValue, "acmeGetDevice: device is NULL");
  *device = current_device;
  return acmeSuccess;
}

//> ch00 device-sync < ch06 -
// acmeError_t acmeDeviceSynchronize(void) { return enter(); }
//
//< ch00 device-sync
//> ch00 checked-mode < ch12 checked-mode
// int acmeCheckedMode(void) { return config().checked ? 1 : 0; }
//< ch00 checked-mode
//> ch12 checked-mode
int acmeCheckedMode(void) { return config().poison ? 2 : config().checked ? 1 : 0; }
//< ch12 checked-mode

acmeError_t acmeMallocOnDevice(void** devPtr, size_t size, int device) {
  if (acmeError_t e = enter()) return e;
  if (!devPtr) return fail(acmeErrorInvalidValue, "acmeMalloc: devPtr is NULL");
  *devPtr = nullptr;
  if (acmeError_t e = check_device(device)) return e;
  if (size == 0) return acmeSuccess;
  const Config& c = config();
  Registry& r = registry();

  // Reserve the capacity first, so concurrent allocations cannot jointly exceed it.
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    Registry::Stats& s = r.stats[device];
    if (size > c.capacity - s.bytes)
      return fail(acmeErrorMemoryAllocation,
                  "out of memory on device %d: tried to allocate %s; %s of %s in use", device,
                  HumanSize(size).text, HumanSize(s.bytes).text, HumanSize(c.capacity).text);
    s.bytes += size;
    s.blocks += 1;
  }
  auto unreserve = [&] {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.stats[device].bytes -= size;
    r.stats[device].blocks -= 1;
  };

  auto a = std::make_shared<Allocation>();
  a->size = size;
  a->device = device;
//> ch00 map-allocation < ch16 map-allocation
//   if (c.checked) {
//     acme::checked::install_fault_handler();
//     const char* what = "";
//     if (int err = acme::checked::map(size, &a->mapping, &what)) {
//       unreserve();
//       return fail(acmeErrorMemoryAllocation,
//                   "out of memory on device %d: %s failed for %s: %s (checked mode maps each "
//                   "allocation twice; ACME_CHECKED=0 avoids that)",
//                   device, what, HumanSize(size).text, std::strerror(err));
//     }
//     a->base = reinterpret_cast<uintptr_t>(a->mapping.device);
//     a->view = static_cast<char*>(a->mapping.view);
//     a->span = a->mapping.span;
//     // Registered before the pointer is handed out, so a fault on it is reported.
//     a->slot = acme::checked::add(a->base, size, a->span, device);
//     if (a->slot < 0) {
//       unreserve();
//       return fail(acmeErrorMemoryAllocation,
//                   "out of memory on device %d: too many live allocations in checked mode",
//                   device);
//     }
//   } else {
//     // Rounded up because aligned_alloc wants a multiple of the alignment.
//     const size_t rounded = size <= SIZE_MAX - 63 ? (size + 63) & ~size_t{63} : 0;
//     void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
//     if (!p) {
//       unreserve();
//       return fail(acmeErrorMemoryAllocation,
//                   "out of memory on device %d: the host could not provide %s", device,
//                   HumanSize(size).text);
//     }
//     a->base = reinterpret_cast<uintptr_t>(p);
//     a->view = static_cast<char*>(p);
//     a->span = size;
//   }
//< ch00 map-allocation
//> ch16 map-allocation
  // Memory comes from a memfd in both modes, so that it can be shared with
  // another process; checked mode maps it twice (see checked_memory.h).
  if (c.checked) acme::checked::install_fault_handler();
  const char* what = "";
  if (int err = acme::checked::map(size, c.checked, &a->mapping, &what)) {
    unreserve();
    return fail(acmeErrorMemoryAllocation,
                "out of memory on device %d: %s failed for %s: %s", device, what,
                HumanSize(size).text, std::strerror(err));
  }
  a->base = reinterpret_cast<uintptr_t>(a->mapping.device);
  a->view = static_cast<char*>(a->mapping.view);
  a->span = a->mapping.span;
  if (c.checked) {
    // Registered before the pointer is handed out, so a fault on it is reported.
    a->slot = acme::checked::add(a->base, size, a->span, device);
    if (a->slot < 0) {
      unreserve();
      return fail(acmeErrorMemoryAllocation,
                  "out of memory on device %d: too many live allocations in checked mode",
                  device);
    }
  }
//< ch16 map-allocation
//> ch12 poison-new
  // Reading memory nobody wrote is a bug that zeroed pages hide: 0xff bytes
  // read as NaN in every floating-point type and as -1 in signed integers.
  if (c.poison) std::memset(a->view, 0xff, size);
//< ch12 poison-new

  {
    std::lock_guard<std::mutex> lock(r.mutex);
    Registry::Stats& s = r.stats[device];
    s.peak = std::max(s.peak, s.bytes);
    r.live.emplace(a->base, a);
  }
  *devPtr = reinterpret_cast<void*>(a->base);
  return acmeSuccess;
}

acmeError_t acmeMalloc(void** devPtr, size_t size) {
  return acmeMallocOnDevice(devPtr, size, current_device);
}

acmeError_t acmeFree(void* devPtr) {
//> ch00 free-enter < ch11 free-enter
//   if (acmeError_t e = enter()) return e;
//< ch00 free-enter
//> ch11 free-enter
  if (acmeError_t e = enter_uninitialized()) return e;
//< ch11 free-enter
  if (!devPtr) return acmeSuccess;
  const auto p = reinterpret_cast<uintptr_t>(devPtr);
  Registry& r = registry();
  AllocationRef a;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.live.find(p);
    if (it == r.live.end()) {
      if (AllocationRef inside = r.containing(p))
        return fail(acmeErrorInvalidDevicePointer,
                    "acmeFree(0x%" PRIxPTR "): not the base of an allocation; it lies inside "
                    "the allocation at 0x%" PRIxPTR " (%zu bytes, device %d)",
                    p, inside->base, inside->size, inside->device);
      if (std::find(std::begin(r.freed), std::end(r.freed), p) != std::end(r.freed))
        return fail(acmeErrorInvalidDevicePointer,
                    "acmeFree(0x%" PRIxPTR "): double free: this allocation was already freed",
                    p);
      return fail(acmeErrorInvalidDevicePointer,
                  "acmeFree(0x%" PRIxPTR "): not a device pointer (no live acme allocation "
                  "starts there)",
                  p);
    }
//> ch16 free-imported
    if (it->second->imported)
      return fail(acmeErrorInvalidDevicePointer,
                  "acmeFree(0x%" PRIxPTR "): this allocation was opened from another "
                  "process's handle; close it with acmeIpcCloseMemHandle",
                  p);
//< ch16 free-imported
    a = std::move(it->second);
    r.live.erase(it);
    r.stats[a->device].bytes -= a->size;
    r.stats[a->device].blocks -= 1;
    r.freed[r.freed_next++ % std::size(r.freed)] = p;
    if (a->slot >= 0) acme::checked::remove(a->slot);  // before the unmap
  }
//> ch18 free-waits
  // Queued kernels reach memory through views the runtime does not track:
  // the memory stays mapped until the device has run them. (A forked child
  // has no workers to wait for; it only lets go of its copy.)
  if (!forked_child.load(std::memory_order_relaxed)) acme::internal::wait_for_device(a->device);
//< ch18 free-waits
  return acmeSuccess;  // `a` unmaps now, or when the last in-flight copy ends
}

acmeError_t acmeMemcpy(void* dst, const void* src, size_t count, acmeMemcpyKind kind) {
  if (acmeError_t e = enter()) return e;
  Side dst_side, src_side;
  if (acmeError_t e = prepare_copy(dst, src, count, kind, &dst_side, &src_side)) return e;
//> ch19 memcpy-begin-trace
  const acme::internal::Trace trace = acme::internal::begin_trace();
//< ch19 memcpy-begin-trace
//> ch18 memcpy-waits
  if (acmeError_t e = wait_for_devices(dst_side, src_side, "acmeMemcpy")) return e;
//< ch18 memcpy-waits
//> ch00 memcpy-run < ch19 memcpy-run
//   if (count) run_copy(dst_side, src_side, count);
//< ch00 memcpy-run
//> ch19 memcpy-run
  if (count)
    run_traced(trace, {acmeActivityMemcpy, copy_name(kind), count},
               device_of(dst_side, src_side), "acmeMemcpy",
               [&] { run_copy(dst_side, src_side, count); });
//< ch19 memcpy-run
  return acmeSuccess;
}

acmeError_t acmeMemset(void* devPtr, int value, size_t count) {
  if (acmeError_t e = enter()) return e;
  Side side;
  if (acmeError_t e = prepare_fill(devPtr, count, &side)) return e;
//> ch19 memset-begin-trace
  const acme::internal::Trace trace = acme::internal::begin_trace();
//< ch19 memset-begin-trace
//> ch18 memset-waits
  if (acmeError_t e = wait_for_devices(side, Side{}, "acmeMemset")) return e;
//< ch18 memset-waits
//> ch00 memset-run < ch19 memset-run
//   if (count) run_fill(side, value, count);
//< ch00 memset-run
//> ch19 memset-run
  if (count)
    run_traced(trace, {acmeActivityMemset, "Memset", count}, device_of(side, Side{}),
               "acmeMemset", [&] { run_fill(side, value, count); });
//< ch19 memset-run
  return acmeSuccess;
}
//> ch06 async-copies
// Validated now, with the same messages as the synchronous calls; run when the
// stream reaches them. The lambdas own the Sides, so freed device memory stays
// mapped until the work is done.
acmeError_t acmeMemcpyAsync(void* dst, const void* src, size_t count, acmeMemcpyKind kind,
                            acmeStream_t stream) {
  if (acmeError_t e = enter()) return e;
  Side dst_side, src_side;
  if (acmeError_t e = prepare_copy(dst, src, count, kind, &dst_side, &src_side)) return e;
//> ch06 memcpy-async-submit < ch18 memcpy-async-submit
//   return acme::internal::submit(stream, "acmeMemcpyAsync", [dst_side, src_side, count] {
//     if (count) run_copy(dst_side, src_side, count);
//   });
//< ch06 memcpy-async-submit
//> ch18 memcpy-async-submit
  // Pageable memory, either way, is what the device cannot reach on its own:
  // a source is staged now, a destination is written before the call returns.
  std::shared_ptr<char[]> staging;
  if (kind == acmeMemcpyHostToDevice && count && !is_pinned(src)) {
    staging.reset(new char[count]);
    std::memcpy(staging.get(), src, count);
    src_side.address = staging.get();
  }
//> ch18 memcpy-async-queue < ch19 memcpy-async-queue
//   const acmeError_t e = acme::internal::submit(
//       stream, "acmeMemcpyAsync", [dst_side, src_side, count, staging] {
//         if (count) run_copy(dst_side, src_side, count);
//       });
//   if (e || kind != acmeMemcpyDeviceToHost || !count || is_pinned(dst)) return e;
//   return acme::internal::synchronize(stream, "acmeMemcpyAsync");
//< ch18 memcpy-async-queue
//> ch19 memcpy-async-queue
  // The wait is part of the call, so the trace's record of the call covers it.
  const bool wait = kind == acmeMemcpyDeviceToHost && count && !is_pinned(dst);
  return acme::internal::submit(
      stream, "acmeMemcpyAsync", {acmeActivityMemcpy, copy_name(kind), count},
      [dst_side, src_side, count, staging] {
        if (count) run_copy(dst_side, src_side, count);
      },
      wait);
//< ch19 memcpy-async-queue
//< ch18 memcpy-async-submit
}

acmeError_t acmeMemsetAsync(void* devPtr, int value, size_t count, acmeStream_t stream) {
  if (acmeError_t e = enter()) return e;
  Side side;
  if (acmeError_t e = prepare_fill(devPtr, count, &side)) return e;
//> ch06 memset-async-queue < ch19 memset-async-queue
//   return acme::internal::submit(stream, "acmeMemsetAsync", [side, value, count] {
//     if (count) run_fill(side, value, count);
//   });
//< ch06 memset-async-queue
//> ch19 memset-async-queue
  return acme::internal::submit(stream, "acmeMemsetAsync", {acmeActivityMemset, "Memset", count},
                                [side, value, count] {
                                  if (count) run_fill(side, value, count);
                                });
//< ch19 memset-async-queue
}
//< ch06 async-copies

acmeError_t acmePointerGetAttributes(acmePointerAttributes* attributes, const void* ptr) {
  if (acmeError_t e = enter()) return e;
  if (!attributes)
    return fail(acmeErrorInvalidValue, "acmePointerGetAttributes: attributes is NULL");
  *attributes = {-1, 0, nullptr, 0};
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (AllocationRef a = r.containing(reinterpret_cast<uintptr_t>(ptr)))
    *attributes = {a->device, 1, reinterpret_cast<void*>(a->base), a->size};
  return acmeSuccess;
}

acmeError_t acmeMemGetInfo(size_t* free, size_t* total) {
  if (acmeError_t e = enter()) return e;
  if (!free || !total) return fail(acmeErrorInvalidValue, "acmeMemGetInfo: free or total is NULL");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  *total = config().capacity;
  *free = *total - r.stats[current_device].bytes;
  return acmeSuccess;
}

acmeError_t acmeMemoryStats(int device, size_t* bytesInUse, size_t* blocksInUse,
                            size_t* peakBytes) {
  if (acmeError_t e = enter()) return e;
  if (acmeError_t e = check_device(device)) return e;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const Registry::Stats& s = r.stats[device];
  if (bytesInUse) *bytesInUse = s.bytes;
  if (blocksInUse) *blocksInUse = s.blocks;
  if (peakBytes) *peakBytes = s.peak;
  return acmeSuccess;
}

//> ch11 init-and-properties
acmeError_t acmeInit(void) { return enter(); }

acmeError_t acmeGetDeviceProperties(acmeDeviceProperties* properties, int device) {
  if (acmeError_t e = enter_uninitialized()) return e;
  if (!properties)
    return fail(acmeErrorInvalidValue, "acmeGetDeviceProperties: properties is NULL");
  if (acmeError_t e = check_device(device)) return e;
  *properties = {};
  std::snprintf(properties->name, sizeof properties->name, "acme A1 (simulated)");
  properties->totalMemory = config().capacity;
  properties->major = 1;
  properties->minor = 0;
  properties->checked = config().checked ? 1 : 0;
  return acmeSuccess;
}

//< ch11 init-and-properties
acmeError_t acmeDeviceAccess(void** kernelView, const void* devPtr) {
  if (acmeError_t e = enter()) return e;
  if (!kernelView) return fail(acmeErrorInvalidValue, "acmeDeviceAccess: kernelView is NULL");
  *kernelView = nullptr;
  if (!devPtr) return acmeSuccess;
  const auto p = reinterpret_cast<uintptr_t>(devPtr);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  AllocationRef a = r.holding(p);
  if (!a)
    return fail(acmeErrorInvalidDevicePointer,
                "acmeDeviceAccess(0x%" PRIxPTR "): not inside a live device allocation", p);
  *kernelView = a->view + (p - a->base);
  return acmeSuccess;
}

//> ch16 ipc-functions
acmeError_t acmeIpcGetMemHandle(acmeIpcMemHandle* handle, size_t* offset, const void* devPtr) {
  if (acmeError_t e = enter()) return e;
  if (!handle || !offset)
    return fail(acmeErrorInvalidValue, "acmeIpcGetMemHandle: handle or offset is NULL");
  const auto p = reinterpret_cast<uintptr_t>(devPtr);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  AllocationRef a = r.holding(p);
  if (!a)
    return fail(acmeErrorInvalidDevicePointer,
                "acmeIpcGetMemHandle(0x%" PRIxPTR "): not inside a live device allocation", p);
  *handle = {a->mapping.fd, a->size, a->device};
  *offset = p - a->base;
  return acmeSuccess;
}

acmeError_t acmeIpcOpenMemHandle(void** devPtr, acmeIpcMemHandle handle) {
  if (acmeError_t e = enter()) return e;
  if (!devPtr) return fail(acmeErrorInvalidValue, "acmeIpcOpenMemHandle: devPtr is NULL");
  *devPtr = nullptr;
  if (acmeError_t e = check_device(handle.device)) return e;
  if (handle.fd < 0 || handle.size == 0)
    return fail(acmeErrorInvalidValue, "acmeIpcOpenMemHandle: not a handle (fd %d, size %zu)",
                handle.fd, handle.size);
  const Config& c = config();
  auto a = std::make_shared<Allocation>();
  const char* what = "";
  if (int err = acme::checked::map_existing(handle.fd, handle.size, c.checked, &a->mapping, &what))
    return fail(acmeErrorInvalidValue,
                "acmeIpcOpenMemHandle: fd %d is not the memory of a %zu-byte acme allocation "
                "(%s: %s)", handle.fd, handle.size, what, std::strerror(err));
  a->size = handle.size;
  a->device = handle.device;
  a->imported = true;
  a->base = reinterpret_cast<uintptr_t>(a->mapping.device);
  a->view = static_cast<char*>(a->mapping.view);
  a->span = a->mapping.span;
  if (c.checked) {
    acme::checked::install_fault_handler();
    a->slot = acme::checked::add(a->base, a->size, a->span, a->device);
    if (a->slot < 0)
      return fail(acmeErrorMemoryAllocation,
                  "acmeIpcOpenMemHandle: too many live allocations in checked mode");
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  // Counted like this process's own allocations (not against its capacity:
  // the memory was reserved by the process that allocated it).
  Registry::Stats& s = r.stats[a->device];
  s.bytes += a->size;
  s.blocks += 1;
  s.peak = std::max(s.peak, s.bytes);
  r.live.emplace(a->base, a);
  *devPtr = reinterpret_cast<void*>(a->base);
  return acmeSuccess;
}

acmeError_t acmeIpcCloseMemHandle(void* devPtr) {
  if (acmeError_t e = enter_uninitialized()) return e;
  const auto p = reinterpret_cast<uintptr_t>(devPtr);
  Registry& r = registry();
  AllocationRef a;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.live.find(p);
    if (it == r.live.end() || !it->second->imported)
      return fail(acmeErrorInvalidDevicePointer,
                  "acmeIpcCloseMemHandle(0x%" PRIxPTR "): not an allocation opened with "
                  "acmeIpcOpenMemHandle", p);
    a = std::move(it->second);
    r.live.erase(it);
    r.stats[a->device].bytes -= a->size;
    r.stats[a->device].blocks -= 1;
    if (a->slot >= 0) acme::checked::remove(a->slot);
  }
//> ch18 close-waits
  if (!forked_child.load(std::memory_order_relaxed)) acme::internal::wait_for_device(a->device);
//< ch18 close-waits
  return acmeSuccess;  // `a` unmaps now, or when the last in-flight copy ends
}
//< ch16 ipc-functions
}  // extern "C"

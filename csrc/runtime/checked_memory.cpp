//@ ch00
// Checked mode: every allocation is a memfd mapped twice, once PROT_NONE (the
// device pointer) and once read-write (the device's view), so a host
// dereference of a device pointer faults. A SIGSEGV handler then says which
// allocation was touched before letting the process die as usual.
#include "runtime/checked_memory.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
//> ch16 map-includes
#include <fcntl.h>
#include <sys/stat.h>
//< ch16 map-includes

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>

namespace acme::checked {
namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

// ---- the fault table ----
// The handler may run at any moment, on any thread, so it cannot take locks:
// it scans fixed slots, each guarded by a sequence counter (odd = being
// written). Writers are serialized by slot_mutex; the handler only reads.

struct Slot {
  std::atomic<uint64_t> seq{0};
  std::atomic<uintptr_t> base{0};  // 0 = empty
  std::atomic<size_t> size{0};
  std::atomic<size_t> span{0};
  std::atomic<int> device{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Two mappings per allocation and Linux's default vm.max_map_count of 65530
// bound live checked allocations to ~32k anyway.
constexpr int kSlots = 1 << 15;
Slot slots[kSlots];
std::atomic<int> slots_used{0};  // slots at or past this index were never used
std::mutex slot_mutex;
int free_slots[kSlots];  // stack of recycled slot ids, under slot_mutex
int free_count = 0;

void write_slot(Slot& s, uintptr_t base, size_t size, size_t span, int device) {
  const uint64_t seq = s.seq.load(std::memory_order_relaxed);
  s.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  s.size.store(size, std::memory_order_relaxed);
  s.span.store(span, std::memory_order_relaxed);
  s.device.store(device, std::memory_order_relaxed);
  s.base.store(base, std::memory_order_relaxed);
  s.seq.store(seq + 2, std::memory_order_release);
}

struct Hit {
  uintptr_t base;
  size_t size;
  int device;
};

// Async-signal-safe: atomics only, bounded retries.
bool lookup(uintptr_t addr, Hit* hit) {
  const int used = slots_used.load(std::memory_order_acquire);
  for (int i = 0; i < used; ++i) {
    const Slot& s = slots[i];
    for (int attempt = 0; attempt < 64; ++attempt) {
      const uint64_t seq = s.seq.load(std::memory_order_acquire);
      if (seq & 1) continue;
      const uintptr_t base = s.base.load(std::memory_order_relaxed);
      const size_t size = s.size.load(std::memory_order_relaxed);
      const size_t span = s.span.load(std::memory_order_relaxed);
      const int device = s.device.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.seq.load(std::memory_order_relaxed) != seq) continue;
      // The whole PROT_NONE span faults, including the page-rounding tail.
      if (base != 0 && addr >= base && addr - base < span) {
        *hit = {base, size, device};
        return true;
      }
      break;
    }
  }
  return false;
}

// ---- the SIGSEGV handler ----

struct sigaction previous_action;

// A tiny formatter on a stack buffer: snprintf is not async-signal-safe.
struct Report {
  char text[512];
  size_t length = 0;
  void put(const char* s) {
    while (*s && length < sizeof text) text[length++] = *s++;
  }
  void put_number(uintptr_t value, unsigned radix) {
    char digits[24];
    int n = 0;
    do {
      digits[n++] = "0123456789abcdef"[value % radix];
      value /= radix;
    } while (value);
    if (radix == 16) put("0x");
    while (n && length < sizeof text) text[length++] = digits[--n];
  }
  void write_to_stderr() const {
    for (size_t done = 0; done < length;) {
      const ssize_t w = ::write(STDERR_FILENO, text + done, length - done);
      if (w <= 0 && errno != EINTR) return;
      if (w > 0) done += static_cast<size_t>(w);
    }
  }
};

void on_segv(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  Hit hit;
  // SEGV_ACCERR: a protection fault (our PROT_NONE pages), not kill -SEGV.
  if (info && info->si_code == SEGV_ACCERR &&
      lookup(reinterpret_cast<uintptr_t>(info->si_addr), &hit)) {
    Report r;
    r.put("acme: the host touched device memory at ");
    r.put_number(reinterpret_cast<uintptr_t>(info->si_addr), 16);
    r.put(": it lies in the allocation at ");
    r.put_number(hit.base, 16);
    r.put(" (");
    r.put_number(hit.size, 10);
    r.put(" bytes, device ");
    r.put_number(static_cast<uintptr_t>(hit.device), 10);
    r.put(
        "). Device memory must be copied to the host (acmeMemcpy DeviceToHost, or "
        "tensor.cpu()) before the host reads it.\n");
    r.write_to_stderr();
    // Returning re-executes the faulting access, now under the previous handler
    // (by default: the process dies of SIGSEGV, as it would have without us).
    sigaction(SIGSEGV, &previous_action, nullptr);
    errno = saved_errno;
    return;
  }
  // Not ours: behave as if we had never been installed.
  if (previous_action.sa_flags & SA_SIGINFO) {
    if (previous_action.sa_sigaction) previous_action.sa_sigaction(sig, info, context);
  } else if (previous_action.sa_handler == SIG_DFL || previous_action.sa_handler == SIG_IGN) {
    sigaction(SIGSEGV, &previous_action, nullptr);
  } else {
    previous_action.sa_handler(sig);
  }
  errno = saved_errno;
}

// A thread's alternate signal stack, so the handler can run even when the
// fault is a stack overflow (not ours, but we are first in line).
struct SignalStack {
  void* memory = nullptr;
  SignalStack() {
    stack_t current;
    if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return;
    const size_t size = 64 * 1024 + static_cast<size_t>(SIGSTKSZ);
    memory = std::malloc(size);
    if (!memory) return;
    stack_t stack{};
    stack.ss_sp = memory;
    stack.ss_size = size;
    if (sigaltstack(&stack, nullptr) != 0) {
      std::free(memory);
      memory = nullptr;
    }
  }
  ~SignalStack() {
    if (!memory) return;
    stack_t current;
    // Leave it alone if someone replaced it with their own since.
    if (sigaltstack(nullptr, &current) == 0 && current.ss_sp == memory) {
      stack_t off{};
      off.ss_flags = SS_DISABLE;
      sigaltstack(&off, nullptr);
      std::free(memory);
    }
  }
};

}  // namespace

//> ch00 map < ch16 map
// int map(size_t size, Mapping* out, const char** what) {
//   const size_t page = page_size();
//   if (size > SIZE_MAX - page) {
//     *what = "size";
//     return ENOMEM;
//   }
//   const size_t span = (size + page - 1) / page * page;
//   const int fd = memfd_create("acme-device-memory", MFD_CLOEXEC);
//   if (fd < 0) {
//     *what = "memfd_create";
//     return errno;
//   }
//   int err = 0;
//   void* device = MAP_FAILED;
//   void* view = MAP_FAILED;
//   if (ftruncate(fd, static_cast<off_t>(span)) != 0) {
//     *what = "ftruncate";
//     err = errno;
//   } else if ((device = mmap(nullptr, span, PROT_NONE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
//     *what = "mmap";
//     err = errno;
//   } else if ((view = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
//              MAP_FAILED) {
//     *what = "mmap";
//     err = errno;
//     munmap(device, span);
//   }
//   close(fd);  // the two mappings keep the memory alive
//   if (err) return err;
//   *out = {device, view, span};
//   return 0;
// }
//
// void unmap(const Mapping& m) {
//   munmap(m.device, m.span);
//   munmap(m.view, m.span);
// }
//< ch00 map
//> ch16 map
namespace {

// Maps `span` bytes of `fd`: a PROT_NONE device mapping and a read-write view
// when checked, else one read-write mapping serving as both.
int map_fd(int fd, size_t span, bool checked, Mapping* out, const char** what) {
  void* view = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (view == MAP_FAILED) {
    *what = "mmap";
    return errno;
  }
  void* device = view;
  if (checked && (device = mmap(nullptr, span, PROT_NONE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
    *what = "mmap";
    const int err = errno;
    munmap(view, span);
    return err;
  }
  *out = {device, view, span, fd};
  return 0;
}

}  // namespace

int map(size_t size, bool checked, Mapping* out, const char** what) {
  const size_t page = page_size();
  if (size > SIZE_MAX - page) {
    *what = "size";
    return ENOMEM;
  }
  const size_t span = (size + page - 1) / page * page;
  const int fd = memfd_create("acme-device-memory", MFD_CLOEXEC);
  if (fd < 0) {
    *what = "memfd_create";
    return errno;
  }
  int err = 0;
  if (ftruncate(fd, static_cast<off_t>(span)) != 0) {
    *what = "ftruncate";
    err = errno;
  } else {
    err = map_fd(fd, span, checked, out, what);
  }
  if (err) close(fd);  // else kept in out->fd, for sharing
  return err;
}

int map_existing(int fd, size_t size, bool checked, Mapping* out, const char** what) {
  const size_t page = page_size();
  const size_t span = (size + page - 1) / page * page;
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *what = "fstat";
    return errno;
  }
  if (static_cast<size_t>(st.st_size) < span) {
    *what = "the handle's size";
    return EINVAL;  // not the memory the handle says it is
  }
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) {
    *what = "dup";
    return errno;
  }
  const int err = map_fd(own, span, checked, out, what);
  if (err) close(own);
  return err;
}

void unmap(const Mapping& m) {
  if (m.device != m.view) munmap(m.device, m.span);
  munmap(m.view, m.span);
  if (m.fd >= 0) close(m.fd);
}
//< ch16 map

int add(uintptr_t base, size_t size, size_t span, int device) {
  std::lock_guard<std::mutex> lock(slot_mutex);
  int slot;
  if (free_count > 0) {
    slot = free_slots[--free_count];
  } else {
    slot = slots_used.load(std::memory_order_relaxed);
    if (slot == kSlots) return -1;
  }
  write_slot(slots[slot], base, size, span, device);
  if (slot == slots_used.load(std::memory_order_relaxed))
    slots_used.store(slot + 1, std::memory_order_release);
  return slot;
}

void remove(int slot) {
  std::lock_guard<std::mutex> lock(slot_mutex);
  write_slot(slots[slot], 0, 0, 0, 0);
  free_slots[free_count++] = slot;
}

void install_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action{};
    action.sa_sigaction = on_segv;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &action, &previous_action);
  });
}

void ensure_signal_stack() {
  thread_local SignalStack stack;  // built on the thread's first call
  (void)stack;
}

}  // namespace acme::checked

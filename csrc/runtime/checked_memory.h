//@ ch00
// Checked mode's machinery, private to the runtime: device memory the host
// cannot touch, and a SIGSEGV report when it does.
#pragma once

#include <cstddef>
#include <cstdint>

namespace acme::checked {

// One allocation as two views of the same pages: `device` is PROT_NONE (the
// pointer handed out, so host dereferences fault), `view` is read-write (the
// device's own view). `span` is the size rounded up to whole pages.
struct Mapping {
  void* device = nullptr;
  void* view = nullptr;
  size_t span = 0;
};

// Maps `size` bytes. Returns 0, or the errno of the failing call (named in *what).
int map(size_t size, Mapping* out, const char** what);
void unmap(const Mapping& m);

// The table the signal handler searches. add() returns a slot id, or -1 when
// the table is full; call remove() before unmapping.
int add(uintptr_t base, size_t size, size_t span, int device);
void remove(int slot);

// Installs the SIGSEGV handler (once per process).
void install_fault_handler();
// Gives the calling thread an alternate signal stack, if it has none yet.
void ensure_signal_stack();

}  // namespace acme::checked

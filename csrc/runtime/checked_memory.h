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
//> ch00 mapping < ch16 mapping
// struct Mapping {
//   void* device = nullptr;
//   void* view = nullptr;
//   size_t span = 0;
// };
//
// // Maps `size` bytes. Returns 0, or the errno of the failing call (named in *what).
// int map(size_t size, Mapping* out, const char** what);
// void unmap(const Mapping& m);
//< ch00 mapping
//> ch16 mapping
// `fd` is the memory's descriptor, kept open so the allocation can be shared
// with another process (acmeIpcGetMemHandle). Without checked mode there is
// one read-write mapping: `device` and `view` are equal.
struct Mapping {
  void* device = nullptr;
  void* view = nullptr;
  size_t span = 0;
  int fd = -1;
};

// Maps `size` bytes of new memory: twice when `checked`, once otherwise.
// Returns 0, or the errno of the failing call (named in *what).
int map(size_t size, bool checked, Mapping* out, const char** what);
// Maps memory another process shares: `fd` is duplicated, not taken.
int map_existing(int fd, size_t size, bool checked, Mapping* out, const char** what);
void unmap(const Mapping& m);
//< ch16 mapping

// The table the signal handler searches. add() returns a slot id, or -1 when
// the table is full; call remove() before unmapping.
int add(uintptr_t base, size_t size, size_t span, int device);
void remove(int slot);

// Installs the SIGSEGV handler (once per process).
void install_fault_handler();
// Gives the calling thread an alternate signal stack, if it has none yet.
void ensure_signal_stack();

}  // namespace acme::checked

//@ ch16
// Sharing acme tensors' memory between processes (torch.multiprocessing).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace acme {

// What a receiving process needs to open a storage another process shares.
// The descriptors belong to the sender: send duplicates.
struct SharedStorage {
  int device;
  int memory_fd;       // the runtime allocation holding the storage
  size_t memory_size;  // that allocation's size
  size_t offset;       // the storage's offset in it
  size_t nbytes;       // the storage's size
  int counter_fd;      // a shared count of receivers still holding it
};

// Shares `tensor`'s storage. The sender keeps the storage alive (its memory
// is not reused) until the receiver releases it and collect_shared() runs.
SharedStorage share_storage(const at::Tensor& tensor);

// Opens storage another process shared, as a 1-D uint8 tensor over all of it.
// The runtime takes a copy of memory_fd (the caller still owns it); counter_fd
// becomes the storage's, closed when the storage dies.
at::Tensor open_shared_storage(const SharedStorage& shared, int64_t sender_pid);

// Lets go of every shared storage all receivers have released; returns how
// many are still held elsewhere.
size_t collect_shared();

// A receiver that already holds the storage (a second send of it) hands the
// new lease back at once, without opening the memory; closes counter_fd.
void release_lease(int counter_fd);

}  // namespace acme

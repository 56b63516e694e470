//@ ch21
// acme's c10d backend (chapter 21): what torch.distributed calls for
// collectives on acme tensors. It drives the runtime's collective library
// (acmeAllReduce and friends), as ProcessGroupNCCL drives NCCL.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace acme {

// The factory torch.distributed.Backend.register_backend calls: one backend
// per process group, as rank `rank` of `size`. The store is the group's own
// (rank 0 posts the communicator's id in it); `timeout` bounds every wait.
c10::intrusive_ptr<c10d::Backend> make_process_group_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout);

}  // namespace acme

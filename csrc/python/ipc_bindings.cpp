//@ ch16
#include "python/ipc_bindings.h"

#include <torch/csrc/utils/pybind.h>

#include "aten/ipc.h"
#include "aten/storage.h"

void acme_bind_ipc(pybind11::module_& m) {
  m.def(
      "_share",
      [](const at::Tensor& t) {
        const acme::SharedStorage s = acme::share_storage(t);
        return pybind11::make_tuple(s.device, s.memory_fd, s.memory_size, s.offset, s.nbytes,
                                    s.counter_fd);
      },
      "Share t's storage: (device, memory_fd, memory_size, offset, nbytes, counter_fd).");
  m.def(
      "_open_shared",
      [](int device, int memory_fd, size_t memory_size, size_t offset, size_t nbytes,
         int counter_fd, int64_t sender_pid) {
        return acme::open_shared_storage(
            {device, memory_fd, memory_size, offset, nbytes, counter_fd}, sender_pid);
      },
      "Open a storage another process shared, as a uint8 tensor over all of it.");
  m.def("_release_lease", &acme::release_lease,
        "Hand back a lease on a storage this process already holds (closes counter_fd).");
  m.def("_ipc_collect", &acme::collect_shared,
        "Release shared storages every receiver has let go of; returns how many are still held.");
  m.def(
      "_storage_info",
      [](const at::Tensor& t) {
        const acme::AcmeStorageImpl& impl = acme::acme_storage(t.storage());
        pybind11::dict info;
        info["times_shared"] = impl.times_shared.load();
        info["shared_by_pid"] = impl.shared_by_pid;
        return info;
      },
      "What acme's StorageImpl knows about t's storage.");
}

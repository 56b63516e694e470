//@ ch11
// Lazy initialization and fork, with PyTorch's own machinery
// (torch/csrc/utils/device_lazy_init.h) rather than a handler of our own.
#include "python/device_bindings.h"

#include <ATen/Context.h>
#include <torch/csrc/utils/device_lazy_init.h>

void acme_bind_device(pybind11::module_& m) {
  m.def(
      "_init",
      [] {
        // After this, a fork()ed child is "in bad fork" and PyTorch calls the
        // device module's _lazy_init again before its first acme tensor.
        torch::utils::register_fork_handler_for_device_init(at::kPrivateUse1);
        // Runs the hooks' init() once per process (again if it threw).
        at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
      },
      "Initialize acme for this process (the device module's _lazy_init calls this).");
  m.def(
      "_is_in_bad_fork", [] { return torch::utils::is_device_in_bad_fork(at::kPrivateUse1); },
      "True in a child of fork() whose parent had initialized acme.");
}

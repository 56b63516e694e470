//@ ch21
#include "python/distributed_bindings.h"

#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include "aten/collectives.h"

void acme_bind_distributed(pybind11::module_& m) {
  // The store arrives, and the backend leaves, as the Python classes
  // torch.distributed registered for them (pybind11 shares them with us).
  m.def("_make_process_group_backend", &acme::make_process_group_backend, pybind11::arg("store"),
        pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"),
        "The c10d backend for acme tensors, as rank `rank` of `size`.");
}

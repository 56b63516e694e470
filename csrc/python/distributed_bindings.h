//@ ch21
// acme's c10d backend, seen from Python (src/torch_acme/distributed.py).
#pragma once

#include <pybind11/pybind11.h>

// Adds _make_process_group_backend to torch_acme._C.
void acme_bind_distributed(pybind11::module_& m);

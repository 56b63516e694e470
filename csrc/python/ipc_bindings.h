//@ ch16
// Sharing acme tensors between processes, seen from Python
// (src/torch_acme/multiprocessing.py).
#pragma once

#include <pybind11/pybind11.h>

// Adds _share, _open_shared, _ipc_collect and _storage_info to torch_acme._C.
void acme_bind_ipc(pybind11::module_& m);

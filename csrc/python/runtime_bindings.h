//@ ch00
// Python bindings of the acme vendor runtime (chapter 0 drives the device
// from Python through these, before any PyTorch integration).
#pragma once

#include <pybind11/pybind11.h>

// Fills `m` (the torch_acme._C.runtime submodule) with the runtime's functions,
// the MemcpyKind enum and the AcmeError exception.
void acme_bind_runtime(pybind11::module_& m);

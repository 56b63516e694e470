//@ ch20
// torch.compile's kernels for acme, seen from Python (src/torch_acme/inductor.py).
#pragma once

#include <pybind11/pybind11.h>

// Adds _launch_compiled to torch_acme._C.
void acme_bind_compile(pybind11::module_& m);

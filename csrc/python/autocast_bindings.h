//@ ch04
// Python bindings of acme's autocast policy table (chapter 4).
#pragma once

#include <pybind11/pybind11.h>

// Fills `m` (the torch_acme._C.autocast submodule).
void acme_bind_autocast(pybind11::module_& m);

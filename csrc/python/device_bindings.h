//@ ch11
// The device module's lazy initialization, seen from Python.
#pragma once

#include <pybind11/pybind11.h>

// Adds _init() and _is_in_bad_fork() to torch_acme._C.
void acme_bind_device(pybind11::module_& m);

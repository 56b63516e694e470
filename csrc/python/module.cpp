// The extension module torch_acme._C: the Python face's native half.
// Only this file and the bindings beside it include pybind11.
#include <pybind11/pybind11.h>

#include "python/runtime_bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native part of torch_acme: runtime bindings and the torch glue.";
  auto runtime = m.def_submodule("runtime", "The acme vendor runtime, driven directly.");
  acme_bind_runtime(runtime);
}

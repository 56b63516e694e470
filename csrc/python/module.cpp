// The extension module torch_acme._C: the Python face's native half.
// Only this file and the bindings beside it include pybind11.
#include <pybind11/pybind11.h>

#include "python/runtime_bindings.h"
//> ch03 bind-drain-include
#include "aten/autograd.h"
//< ch03 bind-drain-include
//> ch04 bind-autocast-include
#include "python/autocast_bindings.h"
//< ch04 bind-autocast-include
//> ch11 bind-device-include
#include "python/device_bindings.h"
//< ch11 bind-device-include
//> ch16 bind-ipc-include
#include "python/ipc_bindings.h"
//< ch16 bind-ipc-include
//> ch20 bind-compile-include
#include "python/compile_bindings.h"
//< ch20 bind-compile-include
//> ch21 bind-distributed-include
#include "python/distributed_bindings.h"
//< ch21 bind-distributed-include

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native part of torch_acme: runtime bindings and the torch glue.";
  auto runtime = m.def_submodule("runtime", "The acme vendor runtime, driven directly.");
  acme_bind_runtime(runtime);
//> ch03 bind-drain
  // The GIL is released: the device threads may need it to free Python tensors.
  m.def("_drain_autograd_threads", &acme::drain_autograd_device_threads,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Wait until acme's autograd threads have released every finished graph.");
//< ch03 bind-drain
//> ch03 bind-override
  // The Library comes back as PyTorch's own binding of it, torch._C._DispatchModule;
  // deleting it removes its kernels.
  m.def("_override_tanh_autograd", &acme::override_tanh_autograd,
        "Register chapter 3's tanh autograd override while the returned object lives.");
//< ch03 bind-override
//> ch04 bind-autocast
  auto autocast = m.def_submodule("autocast", "acme's autocast policies, as registered.");
  acme_bind_autocast(autocast);
//< ch04 bind-autocast
//> ch11 bind-device
  acme_bind_device(m);
//< ch11 bind-device
//> ch16 bind-ipc
  acme_bind_ipc(m);
//< ch16 bind-ipc
//> ch20 bind-compile
  acme_bind_compile(m);
//< ch20 bind-compile
//> ch21 bind-distributed
  acme_bind_distributed(m);
//< ch21 bind-distributed
}

//@ ch20
#include "python/compile_bindings.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "aten/compiled_kernels.h"
//> ch23 graph-flag-include
#include "aten/kernel_threads.h"
//< ch23 graph-flag-include

namespace {
constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name
}  // namespace

void acme_bind_compile(pybind11::module_& m) {
//> ch23 graph-flag
  // torch_acme.inductor.graph_call sets it around a compiled graph's call.
  m.def("_set_in_compiled_graph", &acme::set_in_compiled_graph, pybind11::arg("inside"));
//< ch23 graph-flag
  m.def(
      "_launch_compiled",
      [](const std::string& name, uintptr_t entry, const std::string& signature,
         const pybind11::tuple& args) {
        // `signature` has one letter per argument of the kernel: 'p' for a
        // pointer (a tensor must come), 'i' for an int64 (an int must come).
        TORCH_CHECK(args.size() == signature.size(), kAcme, ": compiled kernel ", name,
                    " takes ", signature.size(), " arguments, got ", args.size());
        std::vector<acme::CompiledKernelArgument> arguments(args.size());
        for (size_t i = 0; i < args.size(); ++i) {
          PyObject* arg = args[i].ptr();
          if (signature[i] == 'p') {
            TORCH_CHECK_TYPE(THPVariable_Check(arg), kAcme, ": compiled kernel ", name,
                             " expects a tensor as argument ", i, ", got ",
                             Py_TYPE(arg)->tp_name);
            arguments[i].tensor = THPVariable_Unpack(arg);
          } else {
            TORCH_CHECK_TYPE(PyLong_Check(arg), kAcme, ": compiled kernel ", name,
                             " expects an int as argument ", i, ", got ", Py_TYPE(arg)->tp_name);
            arguments[i].integer = pybind11::cast<int64_t>(args[i]);
          }
        }
        acme::launch_compiled_kernel(name, reinterpret_cast<acme::CompiledKernelEntry>(entry),
                                     arguments);
      },
      "Queue a kernel torch.compile generated (its entry point's address) on the current stream "
      "of its tensors' device.");
}

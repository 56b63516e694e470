//@ ch20
// Launching the kernels torch.compile generates for acme (chapter 20). Inductor
// writes each fused kernel as a C++ function over raw pointers; the Python
// face (src/torch_acme/inductor.py) compiles it with an entry point that takes
// its arguments as one array, and every call comes here to be queued.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace acme {

// The entry point every compiled kernel exports: its arguments in order,
// pointers as addresses, integers as int64 bits.
using CompiledKernelEntry = void (*)(const uint64_t* arguments);

// One argument of a call: a tensor (passed as a pointer) or an integer.
struct CompiledKernelArgument {
  std::optional<at::Tensor> tensor;
  int64_t integer = 0;
};

// Queues entry(arguments) on the current stream of the tensors' device. Each
// tensor becomes the address of its data in the runtime's device-side view
// (acmeDeviceAccess), never the host mapping of device memory: the kernel
// runs "on the device", and checked mode still catches host code that touches
// device memory. Tensors on another device type, or on two acme devices,
// raise here.
void launch_compiled_kernel(const std::string& name, CompiledKernelEntry entry,
                            const std::vector<CompiledKernelArgument>& arguments);

}  // namespace acme

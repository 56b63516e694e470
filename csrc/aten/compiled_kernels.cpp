//@ ch20
#include "aten/compiled_kernels.h"

#include <c10/util/Exception.h>

#include <utility>

#include "aten/device_views.h"
#include "aten/launch.h"

namespace acme {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

void launch_compiled_kernel(const std::string& name, CompiledKernelEntry entry,
                            const std::vector<CompiledKernelArgument>& arguments) {
  TORCH_CHECK(entry != nullptr, kAcme, ": compiled kernel ", name, " has no entry point");
  std::optional<c10::Device> device;
  std::vector<uint64_t> slots;
  slots.reserve(arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const CompiledKernelArgument& argument = arguments[i];
    if (!argument.tensor) {
      slots.push_back(static_cast<uint64_t>(argument.integer));
      continue;
    }
    const at::Tensor& t = *argument.tensor;
    TORCH_CHECK(t.device().type() == kAcme, kAcme, ": compiled kernel ", name, " got a tensor on ",
                t.device(), " as argument ", i, "; kernels Inductor generates for ", kAcme,
                " read ", kAcme, " memory only");
    TORCH_CHECK(!device || *device == t.device(), kAcme, ": compiled kernel ", name,
                " got tensors on ", *device, " and ", t.device(),
                "; one kernel runs on one device");
    device = t.device();
    // An empty tensor may point just past its allocation; the kernel reads none of it.
    const bool empty = t.numel() == 0;
    slots.push_back(empty ? 0 : reinterpret_cast<uint64_t>(device_address(t.data_ptr())));
  }
  TORCH_CHECK(device, kAcme, ": compiled kernel ", name, " got no tensor, so no device to run on");
  // The kernel owns its argument array; the tensors stay with the caller, as
  // with any acme kernel (chapter 18): the caching allocator keeps their
  // memory from being reused before this stream has run the kernel.
  launch_kernel(device->index(), name.c_str(),
                [entry, slots = std::move(slots)] { entry(slots.data()); });
}

}  // namespace acme

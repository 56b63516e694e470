//@ ch11
// Lazy initialization and fork, with PyTorch's own machinery
// (torch/csrc/utils/device_lazy_init.h) rather than a handler of our own.
#include "python/device_bindings.h"

#include <ATen/Context.h>
#include <torch/csrc/utils/device_lazy_init.h>
//> ch12 memory-bindings-include
#include <ATen/core/CachingHostAllocator.h>

#include "aten/memory_snapshot.h"
//< ch12 memory-bindings-include

void acme_bind_device(pybind11::module_& m) {
  m.def(
      "_init",
      [] {
        // After this, a fork()ed child is "in bad fork" and PyTorch calls the
        // device module's _lazy_init again before its first acme tensor.
        torch::utils::register_fork_handler_for_device_init(at::kPrivateUse1);
        // Runs the hooks' init() once per process (again if it threw).
        at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
      },
      "Initialize acme for this process (the device module's _lazy_init calls this).");
  m.def(
      "_is_in_bad_fork", [] { return torch::utils::is_device_in_bad_fork(at::kPrivateUse1); },
      "True in a child of fork() whose parent had initialized acme.");
//> ch12 memory-bindings
  m.def(
      "_host_memory_stats",
      [] {
        // The figures PyTorch's caching host allocator keeps (chapter 12).
        const at::HostStats s = at::getHostAllocator(at::kPrivateUse1)->get_stats();
        pybind11::dict out;
        auto put = [&](const char* name, const c10::CachingAllocator::Stat& stat) {
          out[(std::string(name) + ".current").c_str()] = stat.current;
          out[(std::string(name) + ".peak").c_str()] = stat.peak;
          out[(std::string(name) + ".allocated").c_str()] = stat.allocated;
          out[(std::string(name) + ".freed").c_str()] = stat.freed;
        };
        put("active_requests", s.active_requests);
        put("active_bytes", s.active_bytes);
        put("allocations", s.allocations);
        put("allocated_bytes", s.allocated_bytes);
        out["num_host_alloc"] = s.num_host_alloc;
        out["num_host_free"] = s.num_host_free;
        return out;
      },
      "Statistics of acme's pinned host memory cache.");
  m.def(
      "_memory_snapshot",
      [](int device) {
        // torch.cuda.memory_snapshot()'s keys, so that PyTorch's tools
        // (torch.cuda._memory_viz) read it; acme records no allocation stacks.
        pybind11::list segments;
        for (const auto& s : acme::memory_snapshot(device)) {
          pybind11::list blocks;
          size_t address = s.address;  // blocks tile their segment, in order
          for (const auto& b : s.blocks) {
            const char* state = b.allocated ? "active_allocated"
                                : b.active  ? "active_pending_free"
                                            : "inactive";
            blocks.append(pybind11::dict(
                pybind11::arg("address") = address, pybind11::arg("size") = b.size,
                pybind11::arg("requested_size") = b.requested_size,
                pybind11::arg("state") = state, pybind11::arg("frames") = pybind11::list()));
            address += b.size;
          }
          segments.append(pybind11::dict(
              pybind11::arg("device") = s.device, pybind11::arg("address") = s.address,
              pybind11::arg("total_size") = s.total_size,
              pybind11::arg("allocated_size") = s.allocated_size,
              pybind11::arg("active_size") = s.active_size,
              pybind11::arg("requested_size") = s.requested_size,
              pybind11::arg("stream") = reinterpret_cast<intptr_t>(s.stream),
              pybind11::arg("segment_type") = s.is_large ? "large" : "small",
              pybind11::arg("segment_pool_id") = pybind11::make_tuple(
                  s.owner_private_pool_id.first, s.owner_private_pool_id.second),
              pybind11::arg("is_expandable") = s.is_expandable,
              pybind11::arg("frames") = pybind11::list(), pybind11::arg("blocks") = blocks));
        }
        return segments;
      },
      pybind11::arg("device"), "The caching allocator's segments and blocks on a device.");
//< ch12 memory-bindings
}

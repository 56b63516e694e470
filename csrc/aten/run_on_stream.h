//@ ch23
// Kernels whose host side needs their results at once, run on the stream
// (chapter 23): the body is launched on the caller's current stream and the
// caller waits for it, so its arithmetic runs where every other kernel runs,
// on the stream's worker, with the device's threads.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "aten/device_views.h"
#include "aten/launch.h"
#include "aten/reuse_fence.h"

namespace acme {

// On a stream's worker, while a run_on_stream body (below) runs: the body's
// device, else -1. Launches on that device run at once and waits for it
// return at once: its stream has got here. Other devices are waited for and
// launched on as from the host.
c10::DeviceIndex running_kernel_device();

// Marks this thread as running a body for `device`, until destroyed.
class RunningKernel {
 public:
  explicit RunningKernel(c10::DeviceIndex device);
  ~RunningKernel();
  RunningKernel(const RunningKernel&) = delete;
  RunningKernel& operator=(const RunningKernel&) = delete;

 private:
  c10::DeviceIndex before_;
};

// Runs `body` as a kernel on the current stream of `device` and waits for it.
// For kernels whose host side needs their results at once (a result whose
// size depends on the data, a value to branch on): their arithmetic still
// runs where every other kernel runs, on the stream's worker, and the body
// may use the caller's locals, since the caller waits. What the body throws
// is rethrown here, its type intact (an IndexError stays an IndexError).
// `elements` sizes its thread count (kernel_threads.h); inside another body
// it runs at once, with that body's.
c10::Stream current_c10_stream(c10::DeviceIndex device);
c10::Stream set_current_stream_here(const c10::Stream& stream);  // returns the one before

template <class Body>
auto run_on_stream(c10::DeviceIndex device, const char* name, int64_t elements, Body&& body)
    -> decltype(body()) {
  using Result = decltype(body());
  if (device == running_kernel_device()) return body();
  // A reference result travels as a pointer, no result as a flag.
  using Kept = std::conditional_t<std::is_void_v<Result>, bool,
               std::conditional_t<std::is_reference_v<Result>,
                                  std::remove_reference_t<Result>*, Result>>;
  std::optional<Kept> result;
  std::exception_ptr error;
  const c10::Stream stream = current_c10_stream(device);
  // The caller's thread-local state that a kernel's results depend on.
  c10::WarningHandler* const warnings = c10::WarningUtils::get_warning_handler();
  const bool inference = c10::InferenceMode::is_enabled();
  // The body allocates later than the host queued it: blocks freed from now
  // on may have users queued behind it, and stay untouched (allocator.h).
  const uint64_t freed_before = blocks_freed_so_far();
  set_kernel_elements(elements);
  launch_kernel(device, name, [&] {
    try {
      // The caller's stream is current here too: memory the body allocates
      // belongs to it, as if the host had allocated it. Warnings go where
      // the caller's go (Python's warnings module).
      const struct StreamHere {
        c10::Stream before;
        ~StreamHere() { set_current_stream_here(before); }
      } stream_here{set_current_stream_here(stream)};
      const c10::WarningUtils::WarningHandlerGuard warnings_here(warnings);
      const RunningKernel running(device);
      const ReuseOnlyFreedBefore reuse(freed_before);
      std::optional<c10::InferenceMode> inference_here;
      if (inference) inference_here.emplace();  // (off, it would undo the worker's guards)
      if constexpr (std::is_void_v<Result>) {
        body();
        result.emplace(true);
      } else if constexpr (std::is_reference_v<Result>) {
        result.emplace(&body());
      } else {
        result.emplace(body());
      }
    } catch (...) {
      error = std::current_exception();
    }
  });
  wait_for_stream(device);  // the body has run when this returns, even by throwing
  if (error) std::rethrow_exception(error);
  TORCH_INTERNAL_ASSERT(result, name, ": the kernel did not run");
  if constexpr (std::is_reference_v<Result>) {
    return **result;
  } else if constexpr (!std::is_void_v<Result>) {
    return std::move(*result);
  }
}

// A kernel's name as a template argument: OnStream<"aten::op", kernel>.
template <size_t N>
struct KernelName {
  constexpr KernelName(const char (&name)[N]) { std::copy_n(name, N, text); }
  char text[N];
};

// The device of the first acme tensor among a kernel's arguments, or -1.
template <class... Args>
c10::DeviceIndex first_acme_device(const Args&... args) {
  c10::DeviceIndex device = -1;
  auto one = [&](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) {
      if (device < 0 && a.defined() && a.device().type() == c10::DeviceType::PrivateUse1)
        device = a.device().index();
    }
  };
  (one(args), ...);
  return device;
}

// The size a kernel registered below gets its thread count by
// (kernel_threads.h): its largest tensor argument, the same for a first call
// that runs as a body and for the later calls that are launched.
template <class... Args>
int64_t largest_tensor(const Args&... args) {
  int64_t largest = 0;
  auto one = [&](const auto& a) {
    using U = std::decay_t<decltype(a)>;
    if constexpr (std::is_same_v<U, at::Tensor>) {
      if (a.defined()) largest = std::max(largest, a.numel());
    } else if constexpr (std::is_same_v<U, std::optional<at::Tensor>>) {
      if (a && a->defined()) largest = std::max(largest, a->numel());
    }
  };
  (one(args), ...);
  return largest;
}

// A kernel written to run on the host, registered to run on the stream:
// m.impl("op", TORCH_FN((OnStream<"aten::op", kernel>::call))).
template <KernelName name, auto kernel, class Signature = decltype(kernel)>
struct OnStream;
template <KernelName name, auto kernel, class R, class... Args>
struct OnStream<name, kernel, R (*)(Args...)> {
  static R call(Args... args) {
    const c10::DeviceIndex device = first_acme_device(args...);
    if (device < 0) return kernel(std::forward<Args>(args)...);
    return run_on_stream(device, name.text, largest_tensor(args...),
                         [&]() -> R { return kernel(std::forward<Args>(args)...); });
  }
};

// ---- kernels whose results' shapes follow from their arguments' shapes ----
// Once a call with given shapes has run as above, and raised what the kernel
// raises for them, later calls with those shapes need not wait: the host
// allocates the results, shaped as that call's were, and launches the
// arithmetic, as a CUDA op does.

// Enough of a result to allocate it before the kernel runs.
struct ResultLayout {
  bool defined = false;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

inline ResultLayout layout_of(const at::Tensor& t) {
  return t.defined() ? ResultLayout{true, t.sizes().vec(), t.strides().vec(), t.scalar_type()}
                     : ResultLayout{};
}

// A launched call's result, allocated by the host as the first call's was.
inline at::Tensor allocate_result(const ResultLayout& layout, c10::DeviceIndex device) {
  if (!layout.defined) return at::Tensor();
  return at::empty_strided(layout.sizes, layout.strides,
                           at::TensorOptions(layout.dtype)
                               .device(c10::Device(c10::DeviceType::PrivateUse1, device)));
}

// The shape keys whose first call has run, waiting, without an error, with
// the layouts of the results it made. One per kernel, made with `new` and
// never destroyed: kernels may launch during exit.
class PassedShapes {
 public:
  std::optional<std::vector<ResultLayout>> find(const std::vector<int64_t>& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = layouts_.find(key);
    if (found == layouts_.end()) return std::nullopt;
    return found->second;
  }
  void remember(std::vector<int64_t> key, std::vector<ResultLayout> layouts) {
    const std::lock_guard<std::mutex> lock(mutex_);
    layouts_.emplace(std::move(key), std::move(layouts));
  }

 private:
  std::mutex mutex_;
  std::map<std::vector<int64_t>, std::vector<ResultLayout>> layouts_;
};

// Writes a launched kernel's result where the host allocated it, which must
// be what the first call with these shapes made: never a cast or a broadcast.
inline void copy_result(const char* name, const at::Tensor& allocated,
                        const at::Tensor& computed) {
  TORCH_CHECK(computed.defined() && computed.sizes() == allocated.sizes() &&
                  computed.scalar_type() == allocated.scalar_type(),
              name, ": a result of sizes ", allocated.sizes(), " and dtype ",
              allocated.scalar_type(), " was allocated, the kernel computed ",
              computed.defined() ? computed.sizes() : at::IntArrayRef{}, " ",
              computed.defined() ? computed.scalar_type() : c10::ScalarType::Undefined);
  allocated.copy_(computed);
}

template <class T>
struct IsBoolArray : std::false_type {};
template <size_t N>
struct IsBoolArray<std::array<bool, N>> : std::true_type {};

// Adds what `a` says about the results' shapes to `key`: false if the call
// must wait (a tensor on another device, which the kernel refuses).
template <class T>
bool add_to_shape_key(std::vector<int64_t>& key, const T& a) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    if (!a.defined()) {
      key.push_back(-1);
      return true;
    }
    if (a.device().type() != c10::DeviceType::PrivateUse1) return false;
    key.insert(key.end(), {a.device().index(), static_cast<int64_t>(a.scalar_type()), a.dim(),
                           a.storage_offset()});
    key.insert(key.end(), a.sizes().begin(), a.sizes().end());
    key.insert(key.end(), a.strides().begin(), a.strides().end());
    return true;
  } else if constexpr (std::is_same_v<U, std::optional<at::Tensor>>) {
    return a ? add_to_shape_key(key, *a) : (key.push_back(-2), true);
  } else if constexpr (std::is_same_v<U, at::IntArrayRef>) {
    key.push_back(static_cast<int64_t>(a.size()));
    key.insert(key.end(), a.begin(), a.end());
    return true;
  } else if constexpr (IsBoolArray<U>::value) {
    key.insert(key.end(), a.begin(), a.end());
    return true;
  } else if constexpr (std::is_integral_v<U>) {  // int64_t, bool
    key.push_back(static_cast<int64_t>(a));
    return true;
  } else if constexpr (std::is_same_v<U, std::optional<double>>) {
    return true;  // a scale: no shape follows from it
  } else {
    static_assert(std::is_floating_point_v<U>, "no shape key for this argument type");
    return true;  // a factor, an epsilon: no shape follows from it
  }
}

// A launched kernel's own key: add_to_shape_key's, and a CPU scalar (a
// zero-dimensional CPU tensor, such as attention's dropout seed) is keyed by
// its dtype, since kept_for_launch copies its value at the launch.
template <class T>
bool add_to_launch_key(std::vector<int64_t>& key, const T& a) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (a.defined() && a.device().is_cpu() && a.dim() == 0) {
      key.insert(key.end(), {-3, static_cast<int64_t>(a.scalar_type())});
      return true;
    }
  }
  return add_to_shape_key(key, a);
}

// An argument as the launched kernel keeps it: tensors as device views, CPU
// scalars copied (the host may change them once the launch returns), sizes
// copied (an IntArrayRef only borrows them).
template <class T>
auto kept_for_launch(DeviceViews& view, const T& a) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    return a.defined() && a.device().is_cpu() ? a.clone() : view(a);
  } else if constexpr (std::is_same_v<U, std::optional<at::Tensor>>) {
    return a ? std::optional<at::Tensor>(view(*a)) : std::optional<at::Tensor>();
  } else if constexpr (std::is_same_v<U, at::IntArrayRef>) {
    return a.vec();
  } else {
    return U(a);
  }
}

// Calls f on each tensor of a result: one tensor, or a tuple of them.
template <class R, class F>
void for_each_result(R& results, F f) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    f(results);
  } else {
    std::apply([&](auto&... t) { (f(t), ...); }, results);
  }
}

// A kernel registered to run on the stream, launched without waiting once
// its shapes have passed: LaunchedOnStream<"name", kernel, compute>, where
// `kernel` is the host kernel (what the first call runs, waiting) and
// `compute` its arithmetic alone, with the same signature, on CPU tensors
// (device views), returning CPU results.
template <KernelName name, auto kernel, auto compute, class Signature = decltype(kernel)>
struct LaunchedOnStream;
template <KernelName name, auto kernel, auto compute, class R, class... Args>
struct LaunchedOnStream<name, kernel, compute, R (*)(Args...)> {
  static R call(Args... args) {
    const c10::DeviceIndex device = first_acme_device(args...);
    if (device < 0) return kernel(args...);
    std::vector<int64_t> key;
    const bool keyable = (add_to_launch_key(key, args) && ...);
    static auto* passed = new PassedShapes;
    const auto layouts = keyable ? passed->find(key) : std::nullopt;
    if (!layouts) {
      R results = run_on_stream(device, name.text, largest_tensor(args...),
                                [&]() -> R { return kernel(args...); });
      std::vector<c10::ScalarType> argument_dtypes;
      auto note_dtype = [&](const auto& a) {
        if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) {
          if (a.defined()) argument_dtypes.push_back(a.scalar_type());
        }
      };
      (note_dtype(args), ...);
      bool launchable = keyable;
      std::vector<ResultLayout> made;
      for_each_result(results, [&](const at::Tensor& t) {
        // A dtype no argument has may be the default dtype, which a launched
        // kernel would read when it runs, not when it was called: wait.
        if (t.defined() && std::find(argument_dtypes.begin(), argument_dtypes.end(),
                                     t.scalar_type()) == argument_dtypes.end())
          launchable = false;
        made.push_back(layout_of(t));
      });
      if (launchable) passed->remember(std::move(key), std::move(made));
      return results;
    }
    R results;
    std::vector<at::Tensor> written;
    DeviceViews view(DeviceViews::kForLaunch);
    size_t r = 0;
    for_each_result(results, [&](at::Tensor& t) {
      t = allocate_result((*layouts)[r++], device);
      written.push_back(view(t));
    });
    set_kernel_elements(largest_tensor(args...));  // as the first call was
    launch_kernel(device, name.text,
                  [written = std::move(written),
                   kept = std::make_tuple(kept_for_launch(view, args)...)]() mutable {
                    R computed = std::apply([](auto&... a) { return compute(a...); }, kept);
                    size_t i = 0;
                    for_each_result(computed, [&](const at::Tensor& t) {
                      const at::Tensor& into = written[i++];
                      if (into.defined()) copy_result(name.text, into, t);
                    });
                  });
    return results;
  }
};

}  // namespace acme

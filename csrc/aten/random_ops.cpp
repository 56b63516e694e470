//@ ch05
// Random kernels that run on the device and draw from the acme generator.
// Element i of an op reads Philox counter block `first + i` of the range the
// op reserved, so the numbers depend on the seed, the offset and the element's
// index, never on the tensor's layout or on how the work is split.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/DistributionTemplates.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
//> ch14 complex-include
#include <ATen/ops/view_as_real.h>
//< ch14 complex-include
#include <c10/util/MathConstants.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_set>

#include "aten/acme_check.h"
#include "aten/cpu_fallback.h"
#include "aten/generator.h"
//> ch18 random-launch-include
#include "aten/launch.h"
//< ch18 random-launch-include
//> ch23 random-on-stream-include
#include "aten/philox_batch.h"
#include "aten/run_on_stream.h"
//< ch23 random-on-stream-include

//> ch05 openmp-check
// at::parallel_for is a template in ATen's headers: with PyTorch's OpenMP
// build its `omp parallel` is compiled here, and a library built without
// OpenMP runs every such loop on one thread, silently.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "at::parallel_for needs OpenMP here: see CMakeLists.txt, ch05 openmp"
#endif
//< ch05 openmp-check

namespace acme {
namespace {

//> ch05 launch
// The generator an op uses: its generator= argument, or the default generator
// of the device the tensor lives on. A CPU generator is refused here.
AcmeGeneratorImpl* generator_for(const std::optional<at::Generator>& gen, c10::Device device) {
  return at::get_generator_or_default<AcmeGeneratorImpl>(gen, default_generator(device.index()));
}

// Reserving the counter range is the only step that touches shared state, so
// it is the only step under the generator's lock; the kernel runs without it.
PhiloxRange reserve(const std::optional<at::Generator>& gen, c10::Device device, uint64_t blocks) {
  AcmeGeneratorImpl* generator = generator_for(gen, device);
  const std::lock_guard<std::mutex> lock(generator->mutex_);
  return generator->reserve(blocks);
}

// The address at which a device kernel reads and writes a tensor's data.
template <typename T>
T* device_view(const at::Tensor& t) {
//> ch18 random-waits
  // These kernels run on the calling thread (until chapter 23 registers
  // them to run on the stream): after the stream's earlier kernels, which
  // may use the same memory.
  wait_for_stream(t.device().index());
//< ch18 random-waits
  void* view = nullptr;
  ACME_CHECK(acmeDeviceAccess(&view, t.const_data_ptr()));
  return static_cast<T*>(view);
}

// "Launches" a kernel over `self`: out[i] = sample(i, counter block first + i).
// The kernel writes a contiguous buffer; a strided `self` gets a contiguous
// temporary that copy_ then scatters into it.
template <typename scalar_t, typename Sample>
void launch(const at::Tensor& self, const std::optional<at::Generator>& gen, Sample sample) {
  at::assert_no_internal_overlap(self);  // expanded tensors: one element, many places
  const int64_t n = self.numel();
  if (n == 0) return;
  const PhiloxRange range = reserve(gen, self.device(), static_cast<uint64_t>(n));
  const bool direct = self.is_contiguous();
  const at::Tensor dense = direct ? self : at::empty(self.sizes(), self.options());
  scalar_t* out = device_view<scalar_t>(dense);
  // The device's threads: any split gives the same numbers.
  at::parallel_for(0, n, /*grain_size=*/1 << 14, [&](int64_t begin, int64_t end) {
//> ch05 launch-loop < ch23 launch-loop
//     for (int64_t i = begin; i < end; ++i) {
//       out[i] = sample(i, philox_block(range.seed, range.first + static_cast<uint64_t>(i)));
//     }
//< ch05 launch-loop
//> ch23 launch-loop
    fill_blocks(range, out, begin, end, sample);
//< ch23 launch-loop
  });
  if (!direct) self.copy_(dense);
}
//< ch05 launch

//> ch05 bits
// Random bits to numbers.
uint64_t bits64(const PhiloxBlock& b, int first = 0) {
  return static_cast<uint64_t>(b[first]) << 32 | b[first + 1];
}

// k / 2^53 with k uniform in [0, 2^53): a double in [0, 1).
double uniform53(const PhiloxBlock& b, int first = 0) {
  return static_cast<double>(bits64(b, first) >> 11) * 0x1p-53;  // exact, as ldexp
}

// k / 2^digits, as many random bits as T's mantissa holds: exact in T.
template <typename T>
T unit(const PhiloxBlock& b) {
  constexpr int digits = std::numeric_limits<T>::digits;
  return static_cast<T>(bits64(b) >> (64 - digits)) * (T{1} / static_cast<T>(uint64_t{1} << digits));
}

// Box-Muller: two uniforms make one standard normal (its sine twin is dropped
// so that every element stays a function of its own block).
double standard_normal(const PhiloxBlock& b) {
  const double u1 = 1.0 - uniform53(b, 0);  // (0, 1]: the log stays finite
  const double u2 = uniform53(b, 2);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * c10::pi<double> * u2);
}
//< ch05 bits

//> ch05 uniform-normal
// The CPU's bounds: from and to within the dtype, a range it can hold.
template <typename scalar_t>
void check_uniform_bounds(const at::Tensor& self, double from, double to) {
  const auto lowest = static_cast<double>(std::numeric_limits<scalar_t>::lowest());
  const auto highest = static_cast<double>(std::numeric_limits<scalar_t>::max());
  TORCH_CHECK(from >= lowest && from <= highest, "from is out of bounds for ", self.dtype());
  TORCH_CHECK(to >= lowest && to <= highest, "to is out of bounds for ", self.dtype());
  TORCH_CHECK(from <= to, "uniform_ expects to return a [from, to) range, but found from=",
              from, " > to=", to);
  TORCH_CHECK(to - from <= highest, "uniform_ expects to-from <= std::numeric_limits<",
              self.scalar_type(), ">::max(), but found to=", to, " and from=", from,
              " which result in to-from to exceed the limit");
}

// Made as the CPU makes it: the sample is computed in the op's arithmetic
// type (float for float16 and bfloat16, with 24 random bits; double with 53)
// and rounded once to the tensor's dtype, so float16 and bfloat16 get the
// CPU's fine grid near 0, not 2^11 or 2^8 evenly spaced values. A sample that
// rounds up to `to` becomes `from`, the CPU's rule.
at::Tensor& uniform_(at::Tensor& self, double from, double to, std::optional<at::Generator> gen) {
  //> ch14 complex-uniform
  if (self.is_complex()) {  // as on the CPU: real and imaginary parts, each uniform
    at::Tensor parts = at::view_as_real(self);
    uniform_(parts, from, to, gen);
    return self;
  }
  //< ch14 complex-uniform
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "uniform_", [&] {
    check_uniform_bounds<scalar_t>(self, from, to);
    using opmath_t = at::opmath_type<scalar_t>;
    const auto lo = static_cast<opmath_t>(from), hi = static_cast<opmath_t>(to);
    const auto lo_here = static_cast<scalar_t>(from), hi_here = static_cast<scalar_t>(to);
    launch<scalar_t>(self, gen, [lo, hi, lo_here, hi_here](int64_t, const PhiloxBlock& b) {
      const auto v = static_cast<scalar_t>(unit<opmath_t>(b) * (hi - lo) + lo);
      return v == hi_here ? lo_here : v;
    });
  });
  return self;
}

at::Tensor& normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  TORCH_CHECK(std >= 0.0, "normal expects std >= 0.0, but found std ", std);
  //> ch14 complex-normal
  if (self.is_complex()) {  // as on the CPU: each part gets half the variance
    at::Tensor parts = at::view_as_real(self);
    normal_(parts, mean, std / std::sqrt(2.0), gen);
    return self;
  }
  //< ch14 complex-normal
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "normal_", [&] {
    launch<scalar_t>(self, gen, [mean, std](int64_t, const PhiloxBlock& b) {
      return static_cast<scalar_t>(mean + std * standard_normal(b));
    });
  });
  return self;
}
//< ch05 uniform-normal

//> ch05 random-ints
// random_'s three overloads, with the CPU's bounds. ATen ships them in
// ATen/native/DistributionTemplates.h: update_from/update_to move a float
// dtype's bounds to values that round inside [from, to), and
// check_from_to_in_range names a bound the dtype cannot hold.
namespace templates = at::native::templates;

// base + k, k uniform in [0, range) (range 0: every 64-bit value), as scalar_t.
at::Tensor& random_range(at::Tensor& self, uint64_t range, int64_t base,
                         const std::optional<at::Generator>& gen) {
  AT_DISPATCH_V2(self.scalar_type(), "random_", AT_WRAP([&] {
    launch<scalar_t>(self, gen, [range, base](int64_t, const PhiloxBlock& b) {
      const uint64_t k = range == 0 ? bits64(b) : bits64(b) % range;
      return static_cast<scalar_t>(static_cast<int64_t>(static_cast<uint64_t>(base) + k));
    });
  }), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_ALL_TYPES),
      AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  return self;
}

// The largest integer random_() and random_(from) draw: 2^digits for a float
// dtype, the largest value of an integral one.
int64_t largest_draw(at::ScalarType type) {
  int64_t largest = 1;  // bool
  AT_DISPATCH_V2(type, "random_", AT_WRAP([&] {
    if constexpr (std::is_floating_point_v<scalar_t> || !std::numeric_limits<scalar_t>::is_integer) {
      largest = int64_t{1} << std::min(std::numeric_limits<scalar_t>::digits, 63);
    } else if constexpr (!std::is_same_v<scalar_t, bool>) {
      largest = static_cast<int64_t>(std::numeric_limits<scalar_t>::max());
    }
  }), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_ALL_TYPES),
      AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  return largest;
}

// random_(): 0 up to the largest draw. The CPU has no such kernel for the
// unsigned 16-, 32- and 64-bit dtypes; neither has acme.
at::Tensor& random_(at::Tensor& self, std::optional<at::Generator> gen) {
  TORCH_CHECK_NOT_IMPLEMENTED(!at::isBarebonesUnsignedType(self.scalar_type()),
                              "\"random_\" not implemented for '",
                              toString(self.scalar_type()), "'");
  return random_range(self, static_cast<uint64_t>(largest_draw(self.scalar_type())) + 1, 0, gen);
}

at::Tensor& random_from(at::Tensor& self, int64_t from, std::optional<int64_t> to,
                        std::optional<at::Generator> gen) {
  const bool floating = at::isFloatingType(self.scalar_type());
  if (to) {  // [from, to)
    int64_t last = *to;
    TORCH_CHECK(from < last, "random_ expects 'from' to be less than 'to', but got from=", from,
                " >= to=", last);
    if (floating) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "random_", [&] {
        from = templates::update_from<scalar_t>(from);
        last = templates::update_to<scalar_t>(last);
      });
      TORCH_CHECK(from < last, "random_ expects 'from' casted to dtype to be less than 'to' "
                  "casted to dtype, but got from=", from, " >= to=", last);
    }
    templates::check_from_to_in_range(from, last - 1, self.dtype());
    return random_range(self, static_cast<uint64_t>(last) - static_cast<uint64_t>(from), from,
                        gen);
  }
  if (from == std::numeric_limits<int64_t>::lowest()) {  // every 64-bit value
    const auto type = self.scalar_type();
    TORCH_CHECK(type == at::kLong || type == at::kDouble || type == at::kFloat ||
                    type == at::kBFloat16,
                "random_ from the lowest int64 with no 'to' draws every 64-bit integer: it takes "
                "int64, float64, float32 or bfloat16 tensors, not ", type);
    return random_range(self, 0, from, gen);
  }
  const int64_t largest = largest_draw(self.scalar_type());  // [from, largest]
  if (floating) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "random_", [&] {
      from = templates::update_from<scalar_t>(from);
    });
    TORCH_CHECK(from < largest, "random_ expects 'from' casted to dtype to be less than or equal "
                "to 'to_inc' casted to dtype, but got from=", from, " > to_inc=", largest);
  }
  templates::check_from_to_in_range(from, largest, self.dtype());
  return random_range(self, static_cast<uint64_t>(largest) - static_cast<uint64_t>(from) + 1,
                      from, gen);
}

at::Tensor& random_to(at::Tensor& self, int64_t to, std::optional<at::Generator> gen) {
  return random_from(self, 0, to, gen);
}
//< ch05 random-ints

//> ch05 bernoulli
at::Tensor& bernoulli_scalar_(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  TORCH_CHECK(p >= 0 && p <= 1, "bernoulli_ expects p to be in [0, 1], but got p=", p);
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, self.scalar_type(), "bernoulli_", [&] {
    launch<scalar_t>(self, gen, [p](int64_t, const PhiloxBlock& b) {
      return static_cast<scalar_t>(uniform53(b) < p);
    });
  });
  return self;
}

at::Tensor& bernoulli_tensor_(at::Tensor& self, const at::Tensor& p, std::optional<at::Generator> gen) {
  TORCH_CHECK(at::is_expandable_to(p.sizes(), self.sizes()), "bernoulli_: p of shape ", p.sizes(),
              " cannot be broadcast to the shape of self, ", self.sizes());
  // p broadcast to self's shape, as float64, in a dense device buffer the
  // kernel reads by element index (copy_ broadcasts and converts).
  at::Tensor probs = at::empty(self.sizes(), self.options().dtype(at::kDouble));
  probs.copy_(p);
  const double* pv = device_view<double>(probs);
  for (int64_t i = 0; i < probs.numel(); ++i) {  // a validation pass, on the device's view
    TORCH_CHECK(pv[i] >= 0 && pv[i] <= 1,
                "bernoulli_ expects all elements of p to be in [0, 1], but found ", pv[i]);
  }
  AT_DISPATCH_ALL_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, self.scalar_type(), "bernoulli_", [&] {
    launch<scalar_t>(self, gen, [pv](int64_t i, const PhiloxBlock& b) {
      return static_cast<scalar_t>(uniform53(b) < pv[i]);
    });
  });
  return self;
}

// torch.bernoulli(p, out=...); torch.bernoulli(p) itself is composite in ATen
// and reaches bernoulli_.Tensor above.
at::Tensor& bernoulli_out(const at::Tensor& p, std::optional<at::Generator> gen, at::Tensor& out) {
  out.resize_(p.sizes());
  return bernoulli_tensor_(out, p, gen);
}
//< ch05 bernoulli

//> ch05 dropout
// PyTorch's kernels give dropout's results the input's layout (empty_like: a
// channels-last input, channels-last results); acme's kernel writes them
// densely, so a strided layout costs one device-side copy each.
std::tuple<at::Tensor, at::Tensor> in_layout_of(const at::Tensor& input, const at::Tensor& output,
                                                const at::Tensor& mask) {
  at::Tensor laid_out = at::empty_like(input);
  if (laid_out.strides() == output.strides()) return {output, mask};
  at::Tensor laid_out_mask = at::empty_like(input, mask.options());
  laid_out.copy_(output);
  laid_out_mask.copy_(mask);
  return {laid_out, laid_out_mask};
}

// F.dropout in training mode: one kernel draws the mask and scales the kept
// elements by 1 / (1 - p). The mask is saved for backward, which is
// deterministic and may run anywhere.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  at::Tensor output = at::empty(input.sizes(), input.options());
  at::Tensor mask = at::empty(input.sizes(), input.options().dtype(at::kBool));
  if (train.has_value() && !*train) {  // evaluation: identity, everything kept
    output.copy_(input);
    if (mask.numel() > 0) ACME_CHECK(acmeMemset(mask.data_ptr(), 1, mask.nbytes()));
    return in_layout_of(input, output, mask);
  }
  const at::Tensor dense_input = input.contiguous();
  const double keep = 1.0 - p;
  const double scale = keep == 0.0 ? 0.0 : 1.0 / keep;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "native_dropout", [&] {
    const scalar_t* x = device_view<scalar_t>(dense_input);
    bool* kept = device_view<bool>(mask);
    launch<scalar_t>(output, std::nullopt, [=](int64_t i, const PhiloxBlock& b) {
      kept[i] = uniform53(b) < keep;
      return static_cast<scalar_t>(static_cast<double>(x[i]) * (kept[i] ? scale : 0.0));
    });
  });
  return in_layout_of(input, output, mask);
}
//< ch05 dropout
//> ch23 dropout-launched

// native_dropout without waiting (chapter 23). A random kernel must take its
// counter range in call order: the one above takes it on the stream while
// the host waits; this one takes it here, on the host, and launches the
// kernel that draws the mask and scales. The same numbers.
std::tuple<at::Tensor, at::Tensor> native_dropout_launched(const at::Tensor& input, double p,
                                                           std::optional<bool> train) {
  const bool evaluation = train.has_value() && !*train;
  if (evaluation || input.device().type() != c10::DeviceType::PrivateUse1)
    return OnStream<"aten::native_dropout", native_dropout>::call(input, p, train);
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  at::Tensor output = at::empty(input.sizes(), input.options());
  at::Tensor mask = at::empty(input.sizes(), input.options().dtype(at::kBool));
  const int64_t n = output.numel();
  const double keep = 1.0 - p;
  const double scale = keep == 0.0 ? 0.0 : 1.0 / keep;
  DeviceViews view(DeviceViews::kForLaunch);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "native_dropout", [&] {
    if (n == 0) return;
    const PhiloxRange range = reserve(std::nullopt, input.device(), static_cast<uint64_t>(n));
    launch_kernel(input.device().index(), "aten::native_dropout",
                  [x = view(input.contiguous()), out = view(output), kept = view(mask), range,
                   keep, scale, n] {
      const scalar_t* in = x.const_data_ptr<scalar_t>();
      scalar_t* written = out.data_ptr<scalar_t>();
      bool* kept_here = kept.data_ptr<bool>();
      const auto sample = [=](int64_t i, const PhiloxBlock& b) {
        kept_here[i] = uniform53(b) < keep;
        return static_cast<scalar_t>(static_cast<double>(in[i]) * (kept_here[i] ? scale : 0.0));
      };
      at::parallel_for(0, n, /*grain_size=*/1 << 14, [&](int64_t begin, int64_t end) {
        fill_blocks(range, written, begin, end, sample);
      });
    });
  });
  return in_layout_of(input, output, mask);
}
//< ch23 dropout-launched

//> ch05 seeded-fallback
// The long tail (randperm, multinomial, exponential_...) still runs on the
// CPU, but never on the CPU's default generator: each call draws a 64-bit
// seed from the acme generator and hands the CPU kernel a fresh CPU generator
// seeded with it. The op then follows the acme seed and generator= argument,
// and leaves torch's CPU stream alone.
void seeded_cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto args = stack->end() - static_cast<std::ptrdiff_t>(schema.arguments().size());
  std::optional<c10::Device> device;  // that of the first acme tensor argument
  for (auto it = args; it != stack->end() && !device; ++it) {
    if (it->isTensor() && it->toTensor().defined() &&
        it->toTensor().device().type() == c10::DeviceType::PrivateUse1) {
      device = it->toTensor().device();
    }
  }
  const auto slot = schema.argumentIndexWithName("generator");
  TORCH_INTERNAL_ASSERT(device && slot, c10::DeviceType::PrivateUse1, ": ", schema.operator_name(),
                        " is not a random op on a tensor of the ", c10::DeviceType::PrivateUse1,
                        " device");
  c10::IValue& generator = args[static_cast<std::ptrdiff_t>(*slot)];
  std::optional<at::Generator> given;
  if (!generator.isNone()) given = generator.toGenerator();
  const PhiloxRange range = reserve(given, *device, 1);
  generator = at::detail::createCPUGenerator(bits64(philox_block(range.seed, range.first)));
  warn_once(op, "with a CPU generator seeded from the device's generator.");
  at::native::cpu_fallback(op, stack);
}
//< ch05 seeded-fallback

}  // namespace
}  // namespace acme

//> ch05 register
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
//> ch05 register-kernels < ch23 register-kernels
//   m.impl("uniform_", TORCH_FN(acme::uniform_));
//   m.impl("normal_", TORCH_FN(acme::normal_));
//   m.impl("random_", TORCH_FN(acme::random_));
//   m.impl("random_.from", TORCH_FN(acme::random_from));
//   m.impl("random_.to", TORCH_FN(acme::random_to));
//   m.impl("bernoulli_.float", TORCH_FN(acme::bernoulli_scalar_));
//   m.impl("bernoulli_.Tensor", TORCH_FN(acme::bernoulli_tensor_));
//   m.impl("bernoulli.out", TORCH_FN(acme::bernoulli_out));
//   m.impl("native_dropout", TORCH_FN(acme::native_dropout));
//< ch05 register-kernels
//> ch23 register-kernels
  // The kernels run on the stream's worker, the host waiting (chapter 23).
  using acme::OnStream;
  m.impl("uniform_", TORCH_FN((OnStream<"aten::uniform_", acme::uniform_>::call)));
  m.impl("normal_", TORCH_FN((OnStream<"aten::normal_", acme::normal_>::call)));
  m.impl("random_", TORCH_FN((OnStream<"aten::random_", acme::random_>::call)));
  m.impl("random_.from", TORCH_FN((OnStream<"aten::random_", acme::random_from>::call)));
  m.impl("random_.to", TORCH_FN((OnStream<"aten::random_", acme::random_to>::call)));
  m.impl("bernoulli_.float",
         TORCH_FN((OnStream<"aten::bernoulli_", acme::bernoulli_scalar_>::call)));
  m.impl("bernoulli_.Tensor",
         TORCH_FN((OnStream<"aten::bernoulli_", acme::bernoulli_tensor_>::call)));
  m.impl("bernoulli.out", TORCH_FN((OnStream<"aten::bernoulli", acme::bernoulli_out>::call)));
  m.impl("native_dropout", TORCH_FN(acme::native_dropout_launched));
//< ch23 register-kernels
}
//< ch05 register

//> ch05 register-seeded
// Every aten op with a Generator argument that would otherwise reach the
// global CPU fallback (the composite ones, such as rand or randint, end in
// the kernels above).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name :
       {"exponential_", "cauchy_", "log_normal_", "geometric_", "normal.Tensor_float",
        "normal.Tensor_float_out", "normal.float_Tensor", "normal.float_Tensor_out",
        "normal.Tensor_Tensor", "normal.Tensor_Tensor_out", "randperm.generator_out",
        "multinomial", "multinomial.out", "poisson", "binomial", "_standard_gamma",
        "_sample_dirichlet", "rrelu_with_noise", "rrelu_with_noise_", "rrelu_with_noise.out"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&acme::seeded_cpu_fallback>());
  }
}
//< ch05 register-seeded

//@ ch13
// Layouts acme does not implement. A sparse, sparse-CSR, nested or quantized
// tensor whose data would live on acme dispatches to its own keys
// (SparsePrivateUse1, NestedTensorPrivateUse1, ...), not to PrivateUse1, so
// neither acme's kernels nor its CPU fallback see it. Unregistered, the
// dispatcher's message names an internal op and a backend the user never
// wrote ("Could not run 'aten::_sparse_coo_tensor_with_dims_and_tensors'
// with arguments from the 'Sparseacme' backend"). One boxed fallback per key
// says what is wrong and what to do instead.
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace acme {
namespace {

//> ch13 refuse-layout
constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

struct Layout {
  const char* name;
  const char* convert;  // how to get a dense tensor acme can take
};

template <const Layout& layout>
void refuse_layout(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, kAcme, " has no ", layout.name, " tensors (",
                              op.schema().operator_name(), " was called with one). Keep them ",
                              "on the CPU, or call ", layout.convert,
                              " first and move the dense result to ", kAcme, ".");
}

constexpr Layout kSparse{"sparse", ".to_dense()"};
constexpr Layout kSparseCsr{"sparse compressed (CSR/CSC/BSR/BSC)", ".to_dense()"};
constexpr Layout kNested{"nested", ".unbind() or .to_padded_tensor()"};
//< ch13 refuse-layout
//> ch13 quantized-layout < ch22 -
// constexpr Layout kQuantized{"quantized", ".dequantize()"};
//< ch13 quantized-layout

}  // namespace
}  // namespace acme

//> ch13 register-layouts
TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::refuse_layout<acme::kSparse>>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::refuse_layout<acme::kSparseCsr>>());
}
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::refuse_layout<acme::kNested>>());
}
//< ch13 register-layouts
//> ch13 refuse-quantized < ch22 register
// TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
//   m.fallback(torch::CppFunction::makeFromBoxedFunction<&acme::refuse_layout<acme::kQuantized>>());
// }
//< ch13 refuse-quantized

//@ ch23
#include "aten/kernel_threads.h"

#include <omp.h>

#include <algorithm>
#include <utility>

// MKL's per-thread count, which at::set_num_threads sets too. PyTorch's x86
// wheels link MKL into libtorch_cpu and export its C entry (the lower-case
// name is the Fortran one and takes a pointer). Weak: where PyTorch has no
// MKL, the symbol is null and only OpenMP's count changes.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace acme {
namespace {
thread_local int64_t kernel_elements = -1;
thread_local bool inside_graph = false;

void set_mkl_threads(int threads) {
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(threads);
}
}  // namespace

void note_kernel_elements(int64_t elements) {
  kernel_elements = std::max(kernel_elements, elements);
}

void forget_kernel_elements() { kernel_elements = -1; }

int64_t take_kernel_elements() { return std::exchange(kernel_elements, -1); }

void set_kernel_elements(int64_t elements) { kernel_elements = elements; }

bool set_in_compiled_graph(bool inside) { return std::exchange(inside_graph, inside); }

bool in_compiled_graph() { return inside_graph; }

int kernel_threads(int64_t elements, int device_threads) {
  if (inside_graph || elements < 0 || elements >= kOneThreadBelow) return device_threads;
  return 1;
}

void use_kernel_threads(int threads) {
  // OpenMP's own count is the reference: ATen may set it behind this file's
  // back (at::set_num_threads sets OpenMP's and MKL's together).
  if (threads == omp_get_max_threads()) return;
  omp_set_num_threads(threads);
  set_mkl_threads(threads);
}

}  // namespace acme

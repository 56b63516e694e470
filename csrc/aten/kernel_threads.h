//@ ch23
// How many CPU threads one acme kernel runs on. The simulated device computes
// on the host's own cores, so a kernel's second thread competes with the host
// thread that queues the next kernel: after every parallel region OpenMP's
// idle thread spins on a core for a while before it sleeps.
#pragma once

#include <cstdint>

namespace acme {

// A kernel whose largest tensor has fewer elements than this runs on one
// thread: too little work to pay for the second thread's barrier and its spin
// on the core the host needs. Larger kernels use the device's thread count.
constexpr int64_t kOneThreadBelow = int64_t{1} << 20;

// DeviceViews(kForLaunch) notes the size of every tensor it views on this
// thread; the launch takes the largest (-1: the launch viewed no tensor, its
// size is unknown). A DeviceViews that launches nothing forgets its sizes.
void note_kernel_elements(int64_t elements);
void forget_kernel_elements();
int64_t take_kernel_elements();
// The next launch's size is `elements`, whatever its views noted.
void set_kernel_elements(int64_t elements);

// Inside a compiled graph's call (torch_acme.inductor.graph_call) every kernel
// keeps the device's thread count: Inductor sized the graph's own kernels for
// it, and the graph's matrix multiplies need it. Returns the old value.
bool set_in_compiled_graph(bool inside);
bool in_compiled_graph();

// The rule: 1 for a kernel of known size below kOneThreadBelow launched
// outside a compiled graph, else `device_threads`. It depends on shapes and on
// the graph flag only, so seeded runs still agree bit for bit.
int kernel_threads(int64_t elements, int device_threads);

// Sets this thread's OpenMP and MKL thread counts (ATen's kernels, oneDNN
// and MKL read both), unless OpenMP's is `threads` already: a run of small
// kernels pays for the change once.
void use_kernel_threads(int threads);

}  // namespace acme

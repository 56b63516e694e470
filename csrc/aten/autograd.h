//@ ch03
#pragma once

#include <torch/library.h>

#include <memory>

namespace acme {
// Registers chapter 3's tanh autograd override (autograd.cpp) until the
// returned Library is destroyed.
std::unique_ptr<torch::Library> override_tanh_autograd();

// Called at interpreter exit: waits until the autograd engine's acme device
// threads have released every finished graph (see autograd.cpp).
void drain_autograd_device_threads();
}  // namespace acme

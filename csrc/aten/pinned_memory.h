//@ ch11
#pragma once

#include <c10/core/Allocator.h>

namespace acme {
// The allocator behind pin_memory() and non_blocking copies to the CPU
// (pinned_memory.cpp); the hooks hand it to PyTorch.
c10::Allocator* pinned_allocator();
// True if ptr lies in pinned host memory acme allocated. Never throws.
bool is_pinned(const void* ptr);
}  // namespace acme

//@ ch01
#pragma once

#include <c10/core/Allocator.h>

namespace acme {
// The allocator behind every acme tensor storage.
c10::Allocator* device_allocator();
}  // namespace acme

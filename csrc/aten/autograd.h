//@ ch03
#pragma once

namespace acme {
// Called at interpreter exit: waits until the autograd engine's acme device
// threads have released every finished graph (see autograd.cpp).
void drain_autograd_device_threads();
}  // namespace acme

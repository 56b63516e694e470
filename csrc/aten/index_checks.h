//@ ch23
// Index values the host can check without waiting for the stream (chapter
// 23). A loss's class indices and an embedding's indices reach the device by
// a copy from the host; the copy's event says when they are there, so an op
// that checks them at the call need not wait for every kernel queued since.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace acme {

// Called once a copy from host memory into all of `dst` (an acme tensor) has
// been queued on the current stream.
void note_copied_from_host(const at::Tensor& dst);

// True when every element of `indices` (int64, on acme) lies in [0, bound) or
// equals `allowed`, as read from the copy that wrote them. False when the
// values are not known that way (written on the device, or since the copy),
// or one of them is out of range: the caller then waits for the stream and
// the kernel checks, raising at the call.
bool copied_indices_in_range(const at::Tensor& indices, int64_t bound, int64_t allowed);

}  // namespace acme

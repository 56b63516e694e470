//@ ch12
// A header apart from allocator.h, which every kernel file reads: only the
// caching allocator and its bindings include it.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

#include <vector>

namespace acme {
//> ch12 snapshot
// What the caching allocator holds on a device, segment by segment, in c10's
// own types (CUDA's and XPU's allocators fill the same ones), so the bindings
// can give torch.acme.memory_snapshot() torch.cuda.memory_snapshot()'s keys
// and PyTorch's tools read it. A segment's `stream` holds acme's stream id
// (torch.Stream.stream_id), where CUDA records its cudaStream_t.
std::vector<c10::CachingDeviceAllocator::SegmentInfo> memory_snapshot(int device);
//< ch12 snapshot
}  // namespace acme

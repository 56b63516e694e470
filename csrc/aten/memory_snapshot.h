//@ ch12
// A header apart from allocator.h, which every kernel file reads: only the
// caching allocator and its bindings include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace acme {
//> ch12 snapshot
// What the caching allocator holds on a device, segment by segment
// (caching_allocator.cpp): torch.acme.memory_snapshot() and the book's pictures.
enum class BlockState { allocated, pending_free, free };
struct BlockSnapshot {
  uintptr_t address;
  size_t size;
  BlockState state;
};
struct SegmentSnapshot {
  uintptr_t address;
  size_t size;
  bool small;        // from the small pool
  int64_t stream;    // the stream its blocks serve (c10::StreamId)
  std::vector<BlockSnapshot> blocks;
};
std::vector<SegmentSnapshot> memory_snapshot(int device);
//< ch12 snapshot
}  // namespace acme

//@ ch01
#pragma once

#include <c10/core/Allocator.h>
//> ch12 snapshot-includes

#include <cstdint>
#include <vector>
//< ch12 snapshot-includes

namespace acme {
// The allocator behind every acme tensor storage.
c10::Allocator* device_allocator();
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

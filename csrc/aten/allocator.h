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
//> ch23 reuse-fence
// A kernel body that runs on the stream (run_on_stream, chapter 23) runs
// after work the host queued before it, but allocates at that point: a
// block freed meanwhile may still have users queued behind the body. While a
// ReuseOnlyFreedBefore(limit) lives on a thread, its allocations reuse only
// blocks freed before blocks_freed_so_far() returned `limit`.
uint64_t blocks_freed_so_far();

class ReuseOnlyFreedBefore {
 public:
  explicit ReuseOnlyFreedBefore(uint64_t limit);
  ~ReuseOnlyFreedBefore();
  ReuseOnlyFreedBefore(const ReuseOnlyFreedBefore&) = delete;
  ReuseOnlyFreedBefore& operator=(const ReuseOnlyFreedBefore&) = delete;

 private:
  uint64_t before_;
};
//< ch23 reuse-fence
}  // namespace acme

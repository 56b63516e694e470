//@ ch23
// The caching allocator's reuse fence (chapter 23). A kernel body that runs
// on the stream (run_on_stream.h) runs after work the host queued before it,
// but allocates at that point: a block freed meanwhile may still have users
// queued behind the body. While a ReuseOnlyFreedBefore(limit) lives on a
// thread, its allocations reuse only blocks freed before
// blocks_freed_so_far() returned `limit` (caching_allocator.cpp).
#pragma once

#include <cstdint>

namespace acme {

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

}  // namespace acme

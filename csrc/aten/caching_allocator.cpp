//@ ch12
// The caching device allocator: every acme tensor storage comes from here.
//
// Asking the runtime for memory is slow (in checked mode each acmeMalloc is a
// fresh double mapping whose pages fault on first touch), so freed blocks stay
// with this allocator and serve the next request of a fitting size on the same
// stream. The runtime only sees "segments": 2 MiB ones carved into blocks of up
// to 1 MiB (the small pool), 20 MiB ones for requests up to 10 MiB, and
// exactly-sized ones beyond (the large pool). A block larger than the request
// is split; a freed block merges with free neighbours of its segment.
//
// It is a c10::DeviceAllocator, the interface torch.accelerator's memory
// functions use, and keeps its figures in c10's own DeviceStats.
#include <ATen/core/Tensor.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_set>
//> ch23 fence-include
#include <utility>
//< ch23 fence-include
#include <vector>

#include "aten/acme_check.h"
#include "aten/allocator.h"
#include "aten/memory_snapshot.h"
//> ch18 cache-launch-include
#include "aten/launch.h"
//< ch18 cache-launch-include
//> ch23 fence-header
#include "aten/reuse_fence.h"
//< ch23 fence-header

namespace acme {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

//> ch12 pool-sizes
constexpr size_t kRound = 512;                 // every block size is a multiple of this
constexpr size_t kSmallRequest = 1 << 20;      // requests up to 1 MiB use the small pool,
constexpr size_t kSmallSegment = 2 << 20;      // carved out of 2 MiB segments
constexpr size_t kSharedLargeRequest = 10 << 20;  // larger ones up to 10 MiB share
constexpr size_t kLargeSegment = 20 << 20;        // 20 MiB segments; beyond, a segment
constexpr size_t kLargeStep = 2 << 20;            // of their own, in 2 MiB steps
constexpr int kMaxDevices = 16;
//< ch12 pool-sizes

//> ch12 alloc-conf
// PYTORCH_ALLOC_CONF, which c10 parses for every device type. Read at each
// request: its values are atomics that torch._C._accelerator_setAllocatorSettings
// may change at any time, and a malformed setting fails every read with a
// ValueError, so the first allocation reports it.
using AllocatorConfig = c10::CachingAllocator::AcceleratorAllocatorConfig;

struct Settings {
  size_t max_split = AllocatorConfig::max_split_size();  // unlimited unless set
  size_t max_non_split_rounding = AllocatorConfig::max_non_split_rounding_size();

  // A block of max_split_size_mb or more is never split, and serves only
  // requests that large which it exceeds by at most max_non_split_rounding_mb
  // (CUDA's rules): big blocks are not carved up by small requests.
  bool may_serve(size_t block, size_t request) const {
    return block < max_split ||
           (request >= max_split && block - request <= max_non_split_rounding);
  }
};
//< ch12 alloc-conf

c10::DeviceType kAcme = c10::DeviceType::PrivateUse1;

// "512 bytes", "2.00 MiB": sizes in messages, as CUDA's allocator prints them.
std::string human(size_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  return text;
}
//> ch23 reuse-fence-state

// Counts blocks going back to a pool, on every device (reuse-fence in allocator.h).
std::atomic<uint64_t> freed_counter{0};
thread_local uint64_t reuse_limit = UINT64_MAX;  // any block, outside a kernel body
//< ch23 reuse-fence-state

// A piece of a segment, handed out whole to one storage.
struct Block {
  c10::DeviceIndex device;
  c10::StreamId stream;  // the stream it was allocated on; it is reused there only
  size_t size;
  void* ptr;
  bool small;             // which pool it belongs to
  bool allocated = false;
  size_t requested = 0;   // bytes asked for (<= size) while allocated
  Block* prev = nullptr;  // neighbours in the same segment
  Block* next = nullptr;
  std::vector<c10::Stream> stream_uses;  // other streams that used it (recordStream)
  int pending_events = 0;                // events to pass before it may be reused
//> ch23 block-freed-at
  uint64_t freed_at = 0;  // blocks_freed_so_far() when it last went back to a pool
//< ch23 block-freed-at

  bool is_split() const { return prev || next; }
};

// Free blocks, ordered so that lower_bound finds the smallest fitting block on
// a stream (the lowest address among equals, which keeps segments compact).
struct BlockOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};
using Pool = std::set<Block*, BlockOrder>;

//> ch12 segment-size
size_t round_size(size_t size) {
  return size < kRound ? kRound : (size + kRound - 1) / kRound * kRound;
}

size_t segment_size(size_t rounded) {
  if (rounded <= kSmallRequest) return kSmallSegment;
  if (rounded < kSharedLargeRequest) return kLargeSegment;
  return (rounded + kLargeStep - 1) / kLargeStep * kLargeStep;
}
//< ch12 segment-size

// Updates the "all" figure and the block's pool figure of a statistic.
void count(StatArray& stat, bool small, int64_t delta) {
  for (auto type : {StatType::AGGREGATE, small ? StatType::SMALL_POOL : StatType::LARGE_POOL}) {
    Stat& s = stat[static_cast<size_t>(type)];
    if (delta >= 0) {
      s.increase(static_cast<size_t>(delta));
    } else {
      s.decrease(static_cast<size_t>(-delta));
    }
  }
}

void free_block_ctx(void* ctx);

// One device's cache. Every member is guarded by `mutex`.
class DeviceCache {
 public:
  explicit DeviceCache(c10::DeviceIndex device) : device_(device) {}

  //> ch12 cache-allocate
  Block* allocate(size_t size, c10::StreamId stream) {
    const Settings settings;  // before the lock: a bad PYTORCH_ALLOC_CONF throws here
//> ch12 allocate-lock < ch23 allocate-lock
//     std::lock_guard<std::mutex> lock(mutex_);
//< ch12 allocate-lock
//> ch23 allocate-lock
    std::unique_lock<std::mutex> lock(mutex_);  // new_segment may let go of it
//< ch23 allocate-lock
    process_events();
    const size_t rounded = round_size(size);
    const bool small = rounded <= kSmallRequest;
    Pool& pool = small ? small_ : large_;
    Block* block = take_free(pool, stream, rounded, settings);
//> ch12 allocate-segment < ch23 allocate-segment
//     if (!block) block = new_segment(size, rounded, small, stream);
//< ch12 allocate-segment
//> ch23 allocate-segment
    if (!block) block = new_segment(lock, size, rounded, small, stream);
//< ch23 allocate-segment
    // Split off the rest if it is worth keeping apart: any remainder in the
    // small pool, more than 1 MiB in the large one (never a max_split_size block).
    const size_t rest = block->size - rounded;
    if (small ? rest >= kRound : rest > kSmallRequest && block->size < settings.max_split) {
      auto* tail = new Block{device_, stream, rest, static_cast<char*>(block->ptr) + rounded, small};
//> ch23 tail-freed-at
      tail->freed_at = block->freed_at;  // the same memory, free since then
//< ch23 tail-freed-at
      tail->prev = block;
      tail->next = block->next;
      if (tail->next) tail->next->prev = tail;
      block->next = tail;
      block->size = rounded;
      put_free(tail);
    }
    block->allocated = true;
    block->requested = size;
    // ACME_CHECKED=2: a recycled block holds its last tensor's values, which
    // torch.empty would hand on silently; poisoned, they read as NaN.
//> ch12 poison-recycled < ch18 poison-recycled
//     if (poison_) ACME_CHECK(acmeMemset(block->ptr, 0xff, block->size));
//< ch12 poison-recycled
//> ch18 poison-recycled
    // On the stream, after the kernels that used the block before.
    if (poison_) ACME_CHECK(acmeMemsetAsync(block->ptr, 0xff, block->size, current_stream(device_)));
//< ch18 poison-recycled
    count(stats_.allocation, small, 1);
    count(stats_.allocated_bytes, small, static_cast<int64_t>(block->size));
    count(stats_.requested_bytes, small, static_cast<int64_t>(size));
    count(stats_.active, small, 1);
    count(stats_.active_bytes, small, static_cast<int64_t>(block->size));
//> ch19 report-allocate
    report_to_profiler(block->ptr, static_cast<int64_t>(block->size));
//< ch19 report-allocate
    return block;
  }
  //< ch12 cache-allocate

//> ch19 report-memory
  // torch.profiler(profile_memory=True) records each allocation and free,
  // with the device's totals; PyTorch makes this a no-op when no profiler asks.
  void report_to_profiler(void* ptr, int64_t delta) {
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    c10::reportMemoryUsageToProfiler(ptr, delta, stats_.allocated_bytes[all].current,
                                     stats_.reserved_bytes[all].current,
                                     c10::Device(kAcme, device_));
  }
//< ch19 report-memory

  //> ch12 cache-free
  void free(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    block->allocated = false;
    count(stats_.allocation, block->small, -1);
    count(stats_.allocated_bytes, block->small, -static_cast<int64_t>(block->size));
    count(stats_.requested_bytes, block->small, -static_cast<int64_t>(block->requested));
//> ch19 report-free
    report_to_profiler(block->ptr, -static_cast<int64_t>(block->size));
//< ch19 report-free
    if (block->stream_uses.empty()) {
      release(block);
      return;
    }
    // Other streams may still use the memory: it returns to the pool once an
    // event recorded on each of them now has completed.
    for (const c10::Stream& stream : block->stream_uses) {
      c10::Event event(kAcme);
      event.record(stream);
      pending_.emplace_back(std::move(event), block);
      ++block->pending_events;
    }
    block->stream_uses.clear();
  }

  void record_stream(Block* block, const c10::Stream& stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(block->allocated, kAcme, ": record_stream on memory that was already freed");
    if (stream.id() == block->stream) return;  // its own stream orders itself
    for (const c10::Stream& s : block->stream_uses)
      if (s == stream) return;
    block->stream_uses.push_back(stream);
  }
  //< ch12 cache-free

  // Returns every whole free segment to the runtime; true if any was.
  bool empty_cache() {
//> ch12 empty-cache < ch23 empty-cache
//     std::lock_guard<std::mutex> lock(mutex_);
//     return release_cached(/*wait_for_streams=*/true);
//< ch12 empty-cache
//> ch23 empty-cache
    std::unique_lock<std::mutex> lock(mutex_);
    return release_cached(lock);
//< ch23 empty-cache
  }

  DeviceStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_accumulated() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (StatArray* stat : stat_arrays())
      for (Stat& s : *stat) s.reset_accumulated();
    stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
    stats_.num_device_alloc = stats_.num_device_free = 0;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (StatArray* stat : stat_arrays())
      for (Stat& s : *stat) s.reset_peak();
  }

  std::vector<c10::CachingDeviceAllocator::SegmentInfo> snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<c10::CachingDeviceAllocator::SegmentInfo> out;
    for (Block* head : segments_) {
      c10::CachingDeviceAllocator::SegmentInfo segment;
      segment.device = device_;
      segment.address = reinterpret_cast<size_t>(head->ptr);
      segment.stream = reinterpret_cast<void*>(static_cast<intptr_t>(head->stream));
      segment.is_large = !head->small;
      for (Block* b = head; b; b = b->next) {
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = b->size;
        block.requested_size = b->allocated ? b->requested : 0;
        block.allocated = b->allocated;
        // Freed, but waiting for the events of the streams that used it.
        block.active = b->allocated || b->pending_events > 0;
        segment.total_size += b->size;
        segment.allocated_size += block.allocated ? b->size : 0;
        segment.requested_size += block.requested_size;
        segment.active_size += block.active ? b->size : 0;
        segment.blocks.push_back(std::move(block));
      }
      out.push_back(std::move(segment));
    }
    std::sort(out.begin(), out.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    return out;
  }

 private:
  std::array<StatArray*, 8> stat_arrays() {
    return {&stats_.allocation,     &stats_.segment,         &stats_.active,
            &stats_.inactive_split, &stats_.allocated_bytes, &stats_.reserved_bytes,
            &stats_.active_bytes,   &stats_.inactive_split_bytes};
  }

  // The smallest free block of at least `size` bytes on `stream`, removed from
  // the pool; nullptr if there is none.
  Block* take_free(Pool& pool, c10::StreamId stream, size_t size, const Settings& settings) {
    Block key{device_, stream, size, nullptr, false};
    auto it = pool.lower_bound(&key);
//> ch23 take-freed-before
    while (it != pool.end() && (*it)->stream == stream && (*it)->freed_at > reuse_limit) ++it;
//< ch23 take-freed-before
    if (it == pool.end() || (*it)->stream != stream) return nullptr;
    if (!settings.may_serve((*it)->size, size)) return nullptr;  // larger ones cannot either
    Block* block = *it;
    pool.erase(it);
    if (block->is_split()) {
      count(stats_.inactive_split, block->small, -1);
      count(stats_.inactive_split_bytes, block->small, -static_cast<int64_t>(block->size));
    }
    return block;
  }

  void put_free(Block* block) {
    (block->small ? small_ : large_).insert(block);
    if (block->is_split()) {
      count(stats_.inactive_split, block->small, 1);
      count(stats_.inactive_split_bytes, block->small, static_cast<int64_t>(block->size));
    }
  }

  //> ch12 new-segment
  // A fresh segment from the runtime, as one block. When the device is full,
  // the cache goes back to the runtime and the request is tried once more
  // (and, on a small device, with a segment of exactly the rounded size).
//> ch12 new-segment-head < ch23 new-segment-head
//   Block* new_segment(size_t requested, size_t rounded, bool small, c10::StreamId stream) {
//< ch12 new-segment-head
//> ch23 new-segment-head
  Block* new_segment(std::unique_lock<std::mutex>& lock, size_t requested, size_t rounded,
                     bool small, c10::StreamId stream) {
//< ch23 new-segment-head
    size_t size = segment_size(rounded);
    void* ptr = nullptr;
    acmeError_t err = acmeMallocOnDevice(&ptr, size, device_);
    if (err == acmeErrorMemoryAllocation) {
      ++stats_.num_alloc_retries;
//> ch12 new-segment-release < ch23 new-segment-release
//       release_cached(/*wait_for_streams=*/true);
//< ch12 new-segment-release
//> ch23 new-segment-release
      release_cached(lock);
//< ch23 new-segment-release
      err = acmeMallocOnDevice(&ptr, size, device_);
      if (err == acmeErrorMemoryAllocation && size > rounded) {
        size = rounded;
        err = acmeMallocOnDevice(&ptr, size, device_);
      }
    }
    if (err == acmeErrorMemoryAllocation) {
      ++stats_.num_ooms;
      out_of_memory(requested);
    }
    ACME_CHECK(err);
    ++stats_.num_device_alloc;
    count(stats_.segment, small, 1);
    count(stats_.reserved_bytes, small, static_cast<int64_t>(size));
    auto* block = new Block{device_, stream, size, ptr, small};
    segments_.insert(block);
    return block;
  }

  [[noreturn]] void out_of_memory(size_t requested) {
    const std::string runtime_message = acmeGetLastErrorMessage();
    size_t free = 0, total = 0;
    int previous = 0;
    if (acmeGetDevice(&previous) == acmeSuccess && acmeSetDevice(device_) == acmeSuccess) {
      acmeMemGetInfo(&free, &total);
      acmeSetDevice(previous);
    }
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    const auto allocated = static_cast<size_t>(stats_.allocated_bytes[all].current);
    const auto reserved = static_cast<size_t>(stats_.reserved_bytes[all].current);
//> ch19 report-oom
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(requested), allocated, reserved,
                                     c10::Device(kAcme, device_));
//< ch19 report-oom
    TORCH_CHECK_WITH(OutOfMemoryError, false, kAcme, " out of memory. Tried to allocate ",
                     human(requested), ". Device ", static_cast<int>(device_),
                     " has a total capacity of ", human(total), " of which ", human(free),
                     " is free. Of the memory in use, ", human(allocated),
                     " is allocated by PyTorch, and ", human(reserved - allocated),
                     " is reserved by PyTorch but unallocated (the cache was emptied and the "
                     "allocation retried). Runtime: ", runtime_message);
  }
  //< ch12 new-segment

  //> ch12 release
  // A block nobody uses any more goes back to its pool, merged with free
  // neighbours so the segment can become whole again.
  void release(Block* block) {
    count(stats_.active, block->small, -1);
    count(stats_.active_bytes, block->small, -static_cast<int64_t>(block->size));
    for (Block* neighbour : {block->prev, block->next}) {
      if (!neighbour || neighbour->allocated || neighbour->pending_events > 0) continue;
      Pool& pool = neighbour->small ? small_ : large_;
      pool.erase(neighbour);
      count(stats_.inactive_split, neighbour->small, -1);
      count(stats_.inactive_split_bytes, neighbour->small,
            -static_cast<int64_t>(neighbour->size));
      if (neighbour == block->prev) {
        block->ptr = neighbour->ptr;
        block->prev = neighbour->prev;
        if (block->prev) {
          block->prev->next = block;
        } else {  // it absorbed the segment's first block
          segments_.erase(neighbour);
          segments_.insert(block);
        }
      } else {
        block->next = neighbour->next;
        if (block->next) block->next->prev = block;
      }
      block->size += neighbour->size;
      delete neighbour;
    }
//> ch23 release-freed-at
    block->freed_at = freed_counter.fetch_add(1) + 1;
//< ch23 release-freed-at
    put_free(block);
  }
  //< ch12 release

  // Blocks whose recorded streams have all passed their free go back to the pool.
  void process_events() {
    while (!pending_.empty()) {
      auto& [event, block] = pending_.front();
      if (!event.query()) return;  // in the order they were recorded
      Block* done = block;
      pending_.pop_front();
      if (--done->pending_events == 0) release(done);
    }
  }

//> ch12 release-cached < ch23 release-cached
//   bool release_cached(bool wait_for_streams) {
//     if (wait_for_streams && !pending_.empty()) {
//       ++stats_.num_sync_all_streams;
//       for (auto& [event, block] : pending_) event.synchronize();
//       process_events();
//     }
//     bool released = false;
//     for (Pool* pool : {&small_, &large_}) {
//       for (auto it = pool->begin(); it != pool->end();) {
//         Block* block = *it;
//         if (block->is_split()) {  // part of a segment still in use
//           ++it;
//           continue;
//         }
//         it = pool->erase(it);
//         const acmeError_t err = acmeFree(block->ptr);
//         if (err != acmeSuccess) {
//           TORCH_WARN(kAcme, ": returning a cached segment failed: ", acmeGetErrorName(err), ": ",
//                      acmeGetLastErrorMessage());
//         }
//         ++stats_.num_device_free;
//         segments_.erase(block);
//         count(stats_.segment, block->small, -1);
//         count(stats_.reserved_bytes, block->small, -static_cast<int64_t>(block->size));
//         delete block;
//         released = true;
//       }
//     }
//     return released;
//   }
//< ch12 release-cached
//> ch23 release-cached
  // Returns every whole free segment to the runtime, after waiting for the
  // streams that still use freed blocks; true if any went back. It waits and
  // frees (acmeFree waits for the device) with `lock` let go: from chapter 23
  // kernels allocate on their stream's worker, and a worker stopped at this
  // mutex while its holder waits for that worker's stream would never come.
  bool release_cached(std::unique_lock<std::mutex>& lock) {
    if (!pending_.empty()) {
      ++stats_.num_sync_all_streams;
      decltype(pending_) waiting;
      waiting.swap(pending_);  // frees recorded meanwhile queue up anew
      lock.unlock();
      for (auto& [event, block] : waiting) event.synchronize();
      lock.lock();
      for (auto& [event, block] : waiting)
        if (--block->pending_events == 0) release(block);
      process_events();
    }
    std::vector<Block*> whole;  // taken out of the cache now, freed unlocked
    for (Pool* pool : {&small_, &large_}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* block = *it;
        if (block->is_split()) {  // part of a segment still in use
          ++it;
          continue;
        }
        it = pool->erase(it);
        ++stats_.num_device_free;
        segments_.erase(block);
        count(stats_.segment, block->small, -1);
        count(stats_.reserved_bytes, block->small, -static_cast<int64_t>(block->size));
        whole.push_back(block);
      }
    }
    if (whole.empty()) return false;
    lock.unlock();
    for (Block* block : whole) {
      const acmeError_t err = acmeFree(block->ptr);
      if (err != acmeSuccess) {
        TORCH_WARN(kAcme, ": returning a cached segment failed: ", acmeGetErrorName(err), ": ",
                   acmeGetLastErrorMessage());
      }
      delete block;
    }
    lock.lock();
    return true;
  }
//< ch23 release-cached

  const c10::DeviceIndex device_;
  const bool poison_ = acmeCheckedMode() == 2;
  std::mutex mutex_;
  Pool small_, large_;
  std::unordered_set<Block*> segments_;  // the first block of each segment
  std::deque<std::pair<c10::Event, Block*>> pending_;
  DeviceStats stats_;
};

class CachingAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    int device = 0;
    ACME_CHECK(acmeGetDevice(&device));
    const c10::Device where(kAcme, static_cast<c10::DeviceIndex>(device));
    if (nbytes == 0) return {nullptr, nullptr, &free_block_ctx, where};
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(kAcme)->getStream(where);
    Block* block = cache(where.index()).allocate(nbytes, stream.id());
    // The context is the block itself, so a free needs no lookup.
    return {block->ptr, block, &free_block_ctx, where};
  }

  void free(Block* block) { cache(block->device).free(block); }

  // Storage clones: both sides on the device.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    ACME_CHECK(acmeMemcpy(dest, src, count, acmeMemcpyDeviceToDevice));
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t) override {
    for (auto& cache : caches_)
      if (DeviceCache* c = cache.load(std::memory_order_acquire)) c->empty_cache();
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get_deleter() != &free_block_ctx || !ptr.get_context()) return;  // not ours
    auto* block = static_cast<Block*>(ptr.get_context());
    TORCH_CHECK(stream.device_type() == kAcme, kAcme, ": record_stream needs a stream of the ",
                kAcme, " device, got ", stream);
    TORCH_CHECK(stream.device_index() == block->device,
                kAcme, ": record_stream: the stream is on ", stream.device(),
                " but the memory is on ", c10::Device(kAcme, block->device),
                "; a stream can only use memory of its own device");
    cache(block->device).record_stream(block, stream);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return cache(checked(device)).stats();
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    cache(checked(device)).reset_accumulated();
  }
  void resetPeakStats(c10::DeviceIndex device) override { cache(checked(device)).reset_peak(); }

  std::vector<c10::CachingDeviceAllocator::SegmentInfo> snapshot(c10::DeviceIndex device) {
    return cache(checked(device)).snapshot();
  }

  // (free, total) bytes on the device, as the runtime counts them.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    checked(device);
    int previous = 0;
    ACME_CHECK(acmeGetDevice(&previous));
    ACME_CHECK(acmeSetDevice(device));
    size_t free = 0, total = 0;
    const acmeError_t err = acmeMemGetInfo(&free, &total);
    ACME_CHECK(acmeSetDevice(previous));
    ACME_CHECK(err);
    return {free, total};
  }

 private:
  c10::DeviceIndex checked(c10::DeviceIndex device) {
    int count = 0;
    ACME_CHECK(acmeGetDeviceCount(&count));
    TORCH_CHECK_VALUE(device >= 0 && device < count, kAcme, ": invalid device index ",
                      static_cast<int>(device), ": there ", count == 1 ? "is " : "are ", count,
                      " ", kAcme, " device", count == 1 ? "" : "s");
    return device;
  }

  DeviceCache& cache(c10::DeviceIndex device) {
    std::call_once(created_[device], [&] {
      caches_[device].store(new DeviceCache(device), std::memory_order_release);
    });
    return *caches_[device].load(std::memory_order_relaxed);
  }

  // Never destroyed: tensors may be freed during static destruction.
  std::array<std::atomic<DeviceCache*>, kMaxDevices> caches_{};
  std::array<std::once_flag, kMaxDevices> created_;
};

CachingAllocator& caching_allocator() {
  static CachingAllocator* instance = new CachingAllocator;
  return *instance;
}

void free_block_ctx(void* ctx) {
  // Runs inside destructors: never throws (a failing event record is a bug
  // worth a loud warning, not a crash).
  if (!ctx) return;
  try {
    caching_allocator().free(static_cast<Block*>(ctx));
  } catch (const std::exception& e) {
    TORCH_WARN(kAcme, ": freeing device memory failed: ", e.what());
  }
}

// Tensor.record_stream(s): "this memory is also used on stream s". PyTorch has
// no device-generic kernel for it, so each backend brings its own.
void record_stream(at::Tensor& self, c10::Stream stream) {
  caching_allocator().recordStream(self.storage().data_ptr(), stream);
}

}  // namespace

c10::Allocator* device_allocator() { return &caching_allocator(); }

std::vector<c10::CachingDeviceAllocator::SegmentInfo> memory_snapshot(int device) {
  return caching_allocator().snapshot(static_cast<c10::DeviceIndex>(device));
}
//> ch23 reuse-fence-api

uint64_t blocks_freed_so_far() { return freed_counter.load(); }

ReuseOnlyFreedBefore::ReuseOnlyFreedBefore(uint64_t limit)
    : before_(std::exchange(reuse_limit, limit)) {}

ReuseOnlyFreedBefore::~ReuseOnlyFreedBefore() { reuse_limit = before_; }
//< ch23 reuse-fence-api

}  // namespace acme

// c10::GetAllocator(PrivateUse1) and c10::getDeviceAllocator(PrivateUse1) return it.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &acme::caching_allocator());

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("record_stream", &acme::record_stream); }

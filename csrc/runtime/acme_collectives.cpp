//@ ch21
// Collective communication between processes: acme's NCCL. The transport is
// one shared-memory segment per communicator. Each rank owns a staging slot
// in it; a collective moves data in rounds: every rank writes its part into
// its own slot, a barrier, every rank reads what it needs from the others'
// slots, a barrier. Point-to-point messages use a buffer per ordered pair.
//
// Collectives are kernels (acmeLaunchKernel): they run on the stream's worker
// when the stream reaches them, reading and writing device memory through the
// device-side views, as every kernel does.
//
// Every wait is bounded: a rank that is not there in time, has exited (its
// lock on the segment is gone), or passed different sizes fails the
// collective on every rank with the same message, and the communicator stays
// failed, as NCCL's does after an error.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/acme_comm.h"
#include "runtime/internal.h"

namespace {

using acme::internal::fail;

constexpr int kMaxRanks = 64;
constexpr uint32_t kMagic = 0x6163636c;    // "accl": the segment is initialized
constexpr size_t kSlotBytes = 4u << 20;    // each rank's staging slot
constexpr size_t kChannelBytes = 256u << 10;  // each ordered pair's point-to-point buffer

enum Kind : int32_t {
  kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter, kAllToAll, kBarrier, kSend, kRecv
};

const char* kind_name(int32_t kind) {
  switch (kind) {
    case kAllReduce: return "all_reduce";
    case kBroadcast: return "broadcast";
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    case kAllToAll: return "all_to_all";
    case kBarrier: return "barrier";
    case kSend: return "send";
    case kRecv: return "recv";
  }
  return "?";
}

const char* type_name(int32_t type) {
  static const char* names[] = {"int8", "uint8", "int32", "int64",
                                "float16", "bfloat16", "float32", "float64"};
  return type >= 0 && type < 8 ? names[type] : "?";
}

size_t type_size(int32_t type) {
  static const size_t sizes[] = {1, 1, 4, 8, 2, 2, 4, 8};
  return sizes[type];
}

const char* op_name(int32_t op) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
  return op >= 0 && op < 8 ? names[op] : "?";
}

// What one rank passed to its current collective; all ranks must agree.
struct Call {
  int32_t kind = 0, type = 0, op = 0, root = 0;
  uint64_t count = 0;
};

bool operator==(const Call& a, const Call& b) {
  return a.kind == b.kind && a.type == b.type && a.op == b.op && a.root == b.root &&
         a.count == b.count;
}

// ---- the shared segment ----

struct alignas(64) RankState {
  std::atomic<uint64_t> arrived;  // the last barrier generation this rank reached
  std::atomic<int32_t> pid;       // nonzero once the rank has joined
  // Its calls, by the parity of the collective's number: a rank that is one
  // collective ahead must not overwrite the call the others are still reading.
  Call calls[2];
};

struct alignas(64) Channel {  // sender -> receiver, one chunk at a time
  std::atomic<uint64_t> posted;  // chunks the sender wrote
  std::atomic<uint64_t> taken;   // chunks the receiver consumed
  int32_t type;                  // of the message the posted chunk belongs to
  uint64_t count;
  uint64_t bytes;  // in the posted chunk
};

struct Header {
  uint32_t magic;
  int32_t nranks;
  std::atomic<int32_t> failed;  // 0 usable, 1 a rank is writing the reason, 2 failed
  char reason[512];
  RankState ranks[kMaxRanks];
  uint64_t splits[kMaxRanks][kMaxRanks];  // all_to_all: splits[a][b] elements a sends b
};

size_t round_up(size_t n) { return (n + 4095) & ~size_t{4095}; }

struct Layout {
  size_t channels, slots, result, buffers, total;
  explicit Layout(int n) {
    channels = round_up(sizeof(Header));
    slots = channels + round_up(sizeof(Channel) * n * n);
    result = slots + kSlotBytes * n;
    buffers = result + kSlotBytes;
    total = buffers + kChannelBytes * n * n;
  }
};

// ACME_COMM_DEBUG=1: every rank writes what each collective moves to stderr,
// as NCCL_DEBUG=INFO does for NCCL.
bool debug() {
  static const bool on = [] {
    const char* v = std::getenv("ACME_COMM_DEBUG");
    return v && std::strcmp(v, "1") == 0;
  }();
  return on;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + ts.tv_nsec;
}

// A process-local communicator. Queued collectives hold a reference, so a
// destroyed handle's segment stays mapped until they have run.
struct State {
  int rank = 0, nranks = 0;
  unsigned timeout_ms = 0;
  int fd = -1;
  char* base = nullptr;
  size_t bytes = 0;
  Header* h = nullptr;
  Channel* channels = nullptr;
  // Tickets: collectives run in the order they were queued, whatever stream.
  std::mutex queue_mutex;
  std::atomic<uint64_t> queued{0}, next{0};
  // Touched only by the running collective (tickets serialize them).
  uint64_t generation = 0;   // barriers so far
  uint64_t collectives = 0;  // collectives so far, for messages

  ~State() {
    if (base) munmap(base, bytes);
    if (fd >= 0) close(fd);
  }
  char* slot(int r) const { return base + Layout(nranks).slots + kSlotBytes * r; }
  char* result() const { return base + Layout(nranks).result; }
  Channel& channel(int from, int to) const { return channels[from * nranks + to]; }
  char* buffer(int from, int to) const {
    return base + Layout(nranks).buffers + kChannelBytes * (from * nranks + to);
  }
  // A rank is alive while it holds its lock on byte `r` of the segment: the
  // kernel drops a process's locks when it exits, however it exits.
  bool alive(int r) const {
    if (h->ranks[r].pid.load() == getpid()) return true;  // ranks on threads of this process
    struct flock lock = {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = r;
    lock.l_len = 1;
    if (fcntl(fd, F_GETLK, &lock) != 0) return true;
    return lock.l_type != F_UNLCK;
  }
  bool failed() const { return h->failed.load(std::memory_order_acquire) != 0; }
  std::string reason() const {
    // The rank writing the reason may die mid-sentence: wait for it a while.
    for (int i = 0; i < 100000 && h->failed.load(std::memory_order_acquire) == 1; ++i)
      sched_yield();
    if (h->failed.load(std::memory_order_acquire) == 1)
      return "a rank failed the communicator and exited before it said why";
    return std::string(h->reason, strnlen(h->reason, sizeof h->reason));
  }
  // Marks the communicator failed on every rank; the first reason wins.
  __attribute__((format(printf, 2, 3))) void fail_all(const char* format, ...) {
    int32_t expected = 0;
    if (!h->failed.compare_exchange_strong(expected, 1)) return;
    va_list args;
    va_start(args, format);
    std::vsnprintf(h->reason, sizeof h->reason, format, args);
    va_end(args);
    h->failed.store(2, std::memory_order_release);
  }
};

}  // namespace

struct acmeComm_st {
  std::shared_ptr<State> state;
};

namespace {

// One collective as it runs on a stream's worker.
struct Collective {
  std::shared_ptr<State> s;
  uint64_t ticket = 0;
  Call call;
  int peer = -1;  // send and recv
  const char* send = nullptr;  // device-side views
  char* recv = nullptr;
  std::vector<size_t> send_counts, send_offsets, recv_counts, recv_offsets;

  uint64_t deadline = 0;
  char what[96] = "";  // "all_reduce #3", for messages

//> ch21 bounded-wait
  // Waits until ready(); false once the communicator failed, the rank
  // laggard() names exited, or the deadline passed (the communicator is then
  // marked failed on every rank).
  template <class Ready, class Laggard>
  bool wait(Ready ready, Laggard laggard) {
    for (unsigned spins = 0;; ++spins) {
      if (ready()) return true;
      if (spins < 64) continue;
      if ((spins & 15) == 0) {
        if (s->failed()) return false;
        const int r = laggard();
        if (r >= 0 && s->h->ranks[r].pid.load() != 0 && !s->alive(r)) {
          s->fail_all("%s: rank %d (pid %d) exited; rank %d was waiting for it", what, r,
                      s->h->ranks[r].pid.load(), s->rank);
          return false;
        }
        if (deadline && now_ns() > deadline) {
          s->fail_all("%s: timed out after %.1f s; rank %d was waiting for rank %d", what,
                      s->timeout_ms / 1000.0, s->rank, r);
          return false;
        }
      }
      if (spins < 1024) {
        sched_yield();
      } else {
        timespec pause = {0, 50000};  // 50 us once it is clear the others are busy
        nanosleep(&pause, nullptr);
      }
    }
  }

  __attribute__((format(printf, 2, 3))) void note(const char* format, ...) const {
    if (!debug()) return;
    char line[256];
    va_list args;
    va_start(args, format);
    std::vsnprintf(line, sizeof line, format, args);
    va_end(args);
    std::fprintf(stderr, "acme comm: rank %d/%d %s: %s\n", s->rank, s->nranks, what, line);
  }

  // All ranks reach the same generation, or the collective fails.
  bool barrier() {
    const uint64_t g = ++s->generation;
    s->h->ranks[s->rank].arrived.store(g, std::memory_order_release);
    auto laggard = [&] {
      for (int r = 0; r < s->nranks; ++r)
        if (s->h->ranks[r].arrived.load(std::memory_order_acquire) < g) return r;
      return -1;
    };
    return wait([&] { return laggard() < 0; }, laggard);
  }

  // Publishes this rank's call and checks that every rank made the same one.
  // Every rank compares all with rank 0, so all name the same difference.
  bool agree() {
    const int parity = s->collectives % 2;
    s->h->ranks[s->rank].calls[parity] = call;
    if (!barrier()) return false;
    const Call& first = s->h->ranks[0].calls[parity];
    for (int r = 1; r < s->nranks; ++r) {
      const Call& other = s->h->ranks[r].calls[parity];
      if (other == first) continue;
      char described[2][160];
      describe(first, described[0], sizeof described[0]);
      describe(other, described[1], sizeof described[1]);
      s->fail_all("%s: the ranks disagree: rank 0 called %s, rank %d called %s", what,
                  described[0], r, described[1]);
      return false;
    }
    return true;
  }
//< ch21 bounded-wait

  static void describe(const Call& c, char* out, size_t size) {
    int n = std::snprintf(out, size, "%s of %" PRIu64 " %s", kind_name(c.kind), c.count,
                          type_name(c.type));
    if (c.kind == kAllReduce || c.kind == kReduceScatter)
      std::snprintf(out + n, size - n, " (%s)", op_name(c.op));
    if (c.kind == kBroadcast) std::snprintf(out + n, size - n, " from rank %d", c.root);
  }

  bool run();
  bool all_reduce();
  bool broadcast();
  bool all_gather();
  bool reduce_scatter();
  bool all_to_all();
  bool point_to_point();
};

// ---- reductions: dst[i] = srcs[0][i] op srcs[1][i] op ..., in rank order ----

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  if (x >= 0x7f800000) return sign | (x > 0x7f800000 ? 0x7e00 : 0x7c00);  // NaN, inf
  if (x >= 0x477ff000) return sign | 0x7c00;  // rounds past 65504: inf
  if (x < 0x38800000) {                        // a half subnormal: count units of 2^-24
    float a;
    std::memcpy(&a, &x, 4);
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));
  }
  x += 0xfff + ((x >> 13) & 1);  // round to nearest even at the cut
  return sign | uint16_t((x - (112u << 23)) >> 13);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t x;
  if (e == 0) {
    float f = float(m) / 16777216.0f;
    std::memcpy(&x, &f, 4);
    x |= sign;
  } else if (e == 31) {
    x = sign | 0x7f800000 | (m << 13);
  } else {
    x = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

uint16_t float_to_bfloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

float bfloat16_to_float(uint16_t b) {
  const uint32_t x = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Storage type, and the type the reduction computes in.
template <int Type> struct Types;
template <> struct Types<acmeInt8> { using T = int8_t; using A = int64_t; };
template <> struct Types<acmeUint8> { using T = uint8_t; using A = uint64_t; };
template <> struct Types<acmeInt32> { using T = int32_t; using A = int64_t; };
template <> struct Types<acmeInt64> { using T = int64_t; using A = int64_t; };
template <> struct Types<acmeFloat16> { using T = uint16_t; using A = float; };
template <> struct Types<acmeBfloat16> { using T = uint16_t; using A = float; };
template <> struct Types<acmeFloat32> { using T = float; using A = float; };
template <> struct Types<acmeFloat64> { using T = double; using A = double; };

template <int Type>
typename Types<Type>::A load(const char* p, size_t i) {
  typename Types<Type>::T v;
  std::memcpy(&v, p + i * sizeof v, sizeof v);
  if constexpr (Type == acmeFloat16) return half_to_float(v);
  else if constexpr (Type == acmeBfloat16) return bfloat16_to_float(v);
  else return v;
}

template <int Type>
void store(char* p, size_t i, typename Types<Type>::A a) {
  typename Types<Type>::T v;
  if constexpr (Type == acmeFloat16) v = float_to_half(a);
  else if constexpr (Type == acmeBfloat16) v = float_to_bfloat16(a);
  else v = static_cast<typename Types<Type>::T>(a);
  std::memcpy(p + i * sizeof v, &v, sizeof v);
}

template <class A, int Op>
A combine(A a, A b) {
  using U = std::make_unsigned_t<std::conditional_t<std::is_integral_v<A>, A, int>>;
  if constexpr (std::is_integral_v<A> && (Op == acmeSum || Op == acmeProd)) {
    // Integers wrap around, as the CPU's do (signed overflow is undefined in C++).
    return static_cast<A>(Op == acmeSum ? U(a) + U(b) : U(a) * U(b));
  } else if constexpr (Op == acmeSum || Op == acmeAvg) return a + b;
  else if constexpr (Op == acmeProd) return a * b;
  else if constexpr (Op == acmeMin || Op == acmeMax) {
    if constexpr (std::is_floating_point_v<A>) {
      if (std::isnan(a) || std::isnan(b)) return std::isnan(a) ? a : b;  // as torch.minimum
    }
    return Op == acmeMin ? std::min(a, b) : std::max(a, b);
  } else if constexpr (std::is_integral_v<A>) {
    if constexpr (Op == acmeBand) return a & b;
    else if constexpr (Op == acmeBor) return a | b;
    else return a ^ b;
  } else {
    return a;  // bitwise ops on floating types are refused before they run
  }
}

template <int Type, int Op>
void reduce_typed(char* dst, const char* const* srcs, int n, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    auto acc = load<Type>(srcs[0], i);
    for (int r = 1; r < n; ++r) acc = combine<decltype(acc), Op>(acc, load<Type>(srcs[r], i));
    if constexpr (Op == acmeAvg) acc = acc / static_cast<decltype(acc)>(n);
    store<Type>(dst, i, acc);
  }
}

template <int Type>
void reduce_op(int op, char* dst, const char* const* srcs, int n, size_t count) {
  switch (op) {
    case acmeSum: return reduce_typed<Type, acmeSum>(dst, srcs, n, count);
    case acmeProd: return reduce_typed<Type, acmeProd>(dst, srcs, n, count);
    case acmeMin: return reduce_typed<Type, acmeMin>(dst, srcs, n, count);
    case acmeMax: return reduce_typed<Type, acmeMax>(dst, srcs, n, count);
    case acmeAvg: return reduce_typed<Type, acmeAvg>(dst, srcs, n, count);
    case acmeBand: return reduce_typed<Type, acmeBand>(dst, srcs, n, count);
    case acmeBor: return reduce_typed<Type, acmeBor>(dst, srcs, n, count);
    case acmeBxor: return reduce_typed<Type, acmeBxor>(dst, srcs, n, count);
  }
}

void reduce(int type, int op, char* dst, const char* const* srcs, int n, size_t count) {
  switch (type) {
    case acmeInt8: return reduce_op<acmeInt8>(op, dst, srcs, n, count);
    case acmeUint8: return reduce_op<acmeUint8>(op, dst, srcs, n, count);
    case acmeInt32: return reduce_op<acmeInt32>(op, dst, srcs, n, count);
    case acmeInt64: return reduce_op<acmeInt64>(op, dst, srcs, n, count);
    case acmeFloat16: return reduce_op<acmeFloat16>(op, dst, srcs, n, count);
    case acmeBfloat16: return reduce_op<acmeBfloat16>(op, dst, srcs, n, count);
    case acmeFloat32: return reduce_op<acmeFloat32>(op, dst, srcs, n, count);
    case acmeFloat64: return reduce_op<acmeFloat64>(op, dst, srcs, n, count);
  }
}

// ---- the collectives ----

// Each chunk: every rank stages its part; rank r reduces the r-th share of
// the chunk across all slots into the result area; every rank copies the
// whole result out. (A reduce-scatter, then an all-gather.)
bool Collective::all_reduce() {
  const int n = s->nranks, me = s->rank;
  const size_t es = type_size(call.type), per_chunk = kSlotBytes / es;
  std::vector<const char*> srcs(n);
  for (size_t off = 0; off < call.count; off += per_chunk) {
    const size_t c = std::min(per_chunk, call.count - off);
    std::memcpy(s->slot(me), send + off * es, c * es);
    note("stage [%zu,%zu) -> slot %d", off, off + c, me);
    if (!barrier()) return false;
    const size_t lo = c * me / n, hi = c * (me + 1) / n;
    for (int r = 0; r < n; ++r) srcs[r] = s->slot(r) + lo * es;
    reduce(call.type, call.op, s->result() + lo * es, srcs.data(), n, hi - lo);
    note("reduce [%zu,%zu) of every slot -> result", off + lo, off + hi);
    if (!barrier()) return false;
    std::memcpy(recv + off * es, s->result(), c * es);
    note("copy [%zu,%zu) <- result", off, off + c);
    if (!barrier()) return false;  // nobody restages before everyone has read
  }
  return true;
}

bool Collective::broadcast() {
  const size_t es = type_size(call.type), per_chunk = kSlotBytes / es;
  for (size_t off = 0; off < call.count; off += per_chunk) {
    const size_t c = std::min(per_chunk, call.count - off);
    if (s->rank == call.root) std::memcpy(s->slot(call.root), recv + off * es, c * es);
    if (!barrier()) return false;
    if (s->rank != call.root) std::memcpy(recv + off * es, s->slot(call.root), c * es);
    if (!barrier()) return false;
  }
  return true;
}

bool Collective::all_gather() {
  const int n = s->nranks;
  const size_t es = type_size(call.type), per_chunk = kSlotBytes / es;
  for (size_t off = 0; off < call.count; off += per_chunk) {
    const size_t c = std::min(per_chunk, call.count - off);
    std::memcpy(s->slot(s->rank), send + off * es, c * es);
    if (!barrier()) return false;
    for (int r = 0; r < n; ++r) std::memcpy(recv + (r * call.count + off) * es, s->slot(r), c * es);
    if (!barrier()) return false;
  }
  return true;
}

bool Collective::reduce_scatter() {
  const int n = s->nranks, me = s->rank;
  const size_t es = type_size(call.type), per_chunk = kSlotBytes / es / n;
  std::vector<const char*> srcs(n);
  for (size_t off = 0; off < call.count; off += per_chunk) {
    const size_t c = std::min(per_chunk, call.count - off);
    for (int r = 0; r < n; ++r)  // block r of the chunk goes to rank r
      std::memcpy(s->slot(me) + r * c * es, send + (r * call.count + off) * es, c * es);
    if (!barrier()) return false;
    for (int r = 0; r < n; ++r) srcs[r] = s->slot(r) + me * c * es;
    reduce(call.type, call.op, recv + off * es, srcs.data(), n, c);
    if (!barrier()) return false;
  }
  return true;
}

// Rounds: in each, every rank stages up to `share` elements for each
// destination in that destination's share of its slot.
bool Collective::all_to_all() {
  const int n = s->nranks, me = s->rank;
  const size_t es = type_size(call.type), share = kSlotBytes / es / n;
  for (int r = 0; r < n; ++r) s->h->splits[me][r] = send_counts[r];
  if (!barrier()) return false;
  size_t most = 0;
  for (int r = 0; r < n; ++r) {
    if (s->h->splits[r][me] != recv_counts[r]) {
      s->fail_all("%s: rank %d expects %zu elements from rank %d, which sends it %" PRIu64, what,
                  me, recv_counts[r], r, s->h->splits[r][me]);
      return false;
    }
    for (int q = 0; q < n; ++q) most = std::max<size_t>(most, s->h->splits[r][q]);
  }
  for (size_t off = 0; off < most; off += share) {
    for (int r = 0; r < n; ++r)
      if (send_counts[r] > off)
        std::memcpy(s->slot(me) + r * share * es, send + (send_offsets[r] + off) * es,
                    std::min(share, send_counts[r] - off) * es);
    if (!barrier()) return false;
    for (int r = 0; r < n; ++r)
      if (recv_counts[r] > off)
        std::memcpy(recv + (recv_offsets[r] + off) * es, s->slot(r) + me * share * es,
                    std::min(share, recv_counts[r] - off) * es);
    if (!barrier()) return false;
  }
  return true;
}

// One chunk at a time through the pair's buffer; the receiver checks that
// the message is the size and type it expects.
bool Collective::point_to_point() {
  const bool sending = call.kind == kSend;
  Channel& ch = sending ? s->channel(s->rank, peer) : s->channel(peer, s->rank);
  char* buffer = sending ? s->buffer(s->rank, peer) : s->buffer(peer, s->rank);
  const size_t es = type_size(call.type), bytes = call.count * es;
  auto the_peer = [&] { return peer; };
  size_t off = 0;
  do {  // a message of 0 elements still sends one (empty) chunk
    const size_t c = std::min(kChannelBytes, bytes - off);
    if (sending) {
      if (!wait([&] { return ch.taken.load(std::memory_order_acquire) ==
                             ch.posted.load(std::memory_order_relaxed); },
                the_peer))
        return false;
      std::memcpy(buffer, send + off, c);
      ch.type = call.type;
      ch.count = call.count;
      ch.bytes = c;
      ch.posted.fetch_add(1, std::memory_order_release);
    } else {
      if (!wait([&] { return ch.posted.load(std::memory_order_acquire) >
                             ch.taken.load(std::memory_order_relaxed); },
                the_peer))
        return false;
      if (ch.type != call.type || ch.count != call.count) {
        s->fail_all("%s: rank %d expects %" PRIu64 " %s from rank %d, which sends %" PRIu64
                    " %s", what, s->rank, call.count, type_name(call.type), peer, ch.count,
                    type_name(ch.type));
        return false;
      }
      std::memcpy(recv + off, buffer, c);
      ch.taken.fetch_add(1, std::memory_order_release);
    }
    off += c;
  } while (off < bytes);
  return true;
}

bool Collective::run() {
  State& st = *s;
  if (call.kind == kSend || call.kind == kRecv)
    std::snprintf(what, sizeof what, "%s %s rank %d", kind_name(call.kind),
                  call.kind == kSend ? "to" : "from", peer);
  else
    std::snprintf(what, sizeof what, "%s #%" PRIu64, kind_name(call.kind), ++st.collectives);
  if (st.failed()) return false;
  char described[160];
  describe(call, described, sizeof described);
  note("%s", described);
  switch (call.kind) {
    case kSend:
    case kRecv: return point_to_point();
    case kBarrier: return agree() && barrier();
  }
  if (!agree()) return false;
  switch (call.kind) {
    case kAllReduce: return all_reduce();
    case kBroadcast: return broadcast();
    case kAllGather: return all_gather();
    case kReduceScatter: return reduce_scatter();
    case kAllToAll: return all_to_all();
  }
  return false;
}

int run_collective(void* args, char* message, size_t size) {
  auto* c = static_cast<Collective*>(args);
  State& st = *c->s;
  // Wait for this communicator's earlier collectives (queued on other
  // streams). No deadline of its own: each of those is bounded, and one that
  // fails marks the communicator failed, which ends this wait.
  const bool turn = c->wait(
      [&] { return st.next.load(std::memory_order_acquire) == c->ticket; }, [] { return -1; });
  if (!turn) {  // the communicator failed: so will every later collective
    std::snprintf(message, size, "%s", st.reason().c_str());
    return 1;
  }
  c->deadline = st.timeout_ms ? now_ns() + uint64_t(st.timeout_ms) * 1000000u : 0;
  const bool ok = c->run();
  st.next.store(c->ticket + 1, std::memory_order_release);
  if (ok) return 0;
  std::snprintf(message, size, "%s", st.reason().c_str());
  return 1;
}

void release_collective(void* args) { delete static_cast<Collective*>(args); }

// ---- checks at the call ----

acmeError_t check_comm(acmeComm_t comm, const char* caller) {
  if (!comm || !comm->state) return fail(acmeErrorInvalidValue, "%s: comm is NULL", caller);
  if (comm->state->failed())
    return fail(acmeErrorCommFailure, "%s: the communicator failed earlier: %s", caller,
                comm->state->reason().c_str());
  return acmeSuccess;
}

acmeError_t check_type(int type, int op, bool reduces, const char* caller) {
  if (type < acmeInt8 || type > acmeFloat64)
    return fail(acmeErrorInvalidValue, "%s: unknown data type %d", caller, type);
  if (!reduces) return acmeSuccess;
  if (op < acmeSum || op > acmeBxor)
    return fail(acmeErrorInvalidValue, "%s: unknown reduce op %d", caller, op);
  const bool floating = type >= acmeFloat16;
  if (floating && op >= acmeBand)
    return fail(acmeErrorInvalidValue, "%s: %s needs an integer type, not %s", caller,
                op_name(op), type_name(type));
  if (!floating && op == acmeAvg)
    return fail(acmeErrorInvalidValue, "%s: avg needs a floating type, not %s", caller,
                type_name(type));
  return acmeSuccess;
}

// count elements of es bytes, times `times`, without wrapping around.
acmeError_t byte_count(size_t count, size_t es, size_t times, const char* caller,
                       size_t* bytes) {
  if (count > SIZE_MAX / es / times)
    return fail(acmeErrorInvalidValue, "%s: %zu elements are more than memory holds", caller,
                count);
  *bytes = count * es * times;
  return acmeSuccess;
}

// The device-side view of `bytes` bytes at ptr, which must lie inside one
// allocation on the stream's device.
acmeError_t view(const void* ptr, size_t bytes, int device, const char* what,
                 const char* caller, char** out) {
  *out = nullptr;
  if (bytes == 0) return acmeSuccess;
  acmePointerAttributes a;
  if (acmeError_t e = acmePointerGetAttributes(&a, ptr)) return e;
  if (!a.isDevice)
    return fail(acmeErrorInvalidDevicePointer, "%s: %s %p is not device memory", caller, what,
                ptr);
  if (static_cast<const char*>(ptr) + bytes > static_cast<const char*>(a.base) + a.size)
    return fail(acmeErrorInvalidValue, "%s: %s holds fewer than the %zu bytes asked for", caller,
                what, bytes);
  if (a.device != device)
    return fail(acmeErrorDeviceMismatch, "%s: %s is on device %d, the stream on device %d",
                caller, what, a.device, device);
  void* v = nullptr;
  if (acmeError_t e = acmeDeviceAccess(&v, ptr)) return e;
  *out = static_cast<char*>(v);
  return acmeSuccess;
}

acmeError_t stream_device(acmeStream_t stream, int* device) {
  return stream ? acmeStreamGetDevice(stream, device) : acmeGetDevice(device);
}

// What every entry point starts with: a usable communicator, a known type
// (and op, for reductions), and the device of the stream it queues on.
acmeError_t begin(acmeComm_t comm, int type, int op, bool reduces, acmeStream_t stream,
                  const char* caller, int* device) {
  if (acmeError_t e = check_comm(comm, caller)) return e;
  if (acmeError_t e = check_type(type, op, reduces, caller)) return e;
  return stream_device(stream, device);
}

// The device-side view of a buffer of count x times elements of `type`.
acmeError_t buffer(const void* ptr, size_t count, size_t times, int type, int device,
                   const char* what, const char* caller, char** out) {
  size_t bytes = 0;
  if (acmeError_t e = byte_count(count, type_size(type), times, caller, &bytes)) return e;
  return view(ptr, bytes, device, what, caller, out);
}

// Takes a ticket and queues the collective on the stream. A ticket is only
// kept if the launch queued: one that never runs would hold up the rest.
acmeError_t queue(Collective* c, acmeComm_t comm, const char* caller, acmeStream_t stream) {
  State& st = *comm->state;
  std::lock_guard<std::mutex> lock(st.queue_mutex);
  c->s = comm->state;
  c->ticket = st.queued.load();
  const acmeError_t e = acmeLaunchKernel(stream, caller, run_collective, c, release_collective);
  // With ACME_LAUNCH_BLOCKING=1 a launch failure means the collective ran.
  if (e == acmeSuccess || e == acmeErrorLaunchFailure) st.queued.fetch_add(1);
  return e;
}

}  // namespace

extern "C" {

acmeError_t acmeCommGetUniqueId(acmeCommId* id) {
  if (!id) return fail(acmeErrorInvalidValue, "acmeCommGetUniqueId: id is NULL");
  std::random_device random;
  std::memset(id->name, 0, sizeof id->name);
  std::snprintf(id->name, sizeof id->name, "/acme-comm-%d-%08x%08x", int(getpid()), random(),
                random());
  return acmeSuccess;
}

acmeError_t acmeCommInitRank(acmeComm_t* comm, int nranks, acmeCommId id, int rank,
                             unsigned timeoutMs) {
  const char* caller = "acmeCommInitRank";
  if (!comm) return fail(acmeErrorInvalidValue, "%s: comm is NULL", caller);
  *comm = nullptr;
  if (nranks < 1 || nranks > kMaxRanks)
    return fail(acmeErrorInvalidValue, "%s: nranks is %d; it must be 1..%d", caller, nranks,
                kMaxRanks);
  if (rank < 0 || rank >= nranks)
    return fail(acmeErrorInvalidValue, "%s: rank %d is not in 0..%d", caller, rank, nranks - 1);
  id.name[sizeof id.name - 1] = 0;
  if (id.name[0] != '/') return fail(acmeErrorInvalidValue, "%s: not a communicator id", caller);

  auto s = std::make_shared<State>();
  s->rank = rank;
  s->nranks = nranks;
  s->timeout_ms = timeoutMs;
  const Layout layout(nranks);
  s->bytes = layout.total;
  const uint64_t deadline = timeoutMs ? now_ns() + uint64_t(timeoutMs) * 1000000u : 0;
  auto timed_out = [&] { return deadline && now_ns() > deadline; };
  if (rank == 0) {
    s->fd = shm_open(id.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (s->fd < 0)
      return fail(acmeErrorCommFailure, "%s: cannot create the segment %s: %s", caller, id.name,
                  std::strerror(errno));
    // Reserve the memory now: a full /dev/shm is an error here, not a SIGBUS later.
    const int reserved = posix_fallocate(s->fd, 0, off_t(layout.total));
    if (reserved != 0) {
      shm_unlink(id.name);
      return fail(acmeErrorCommFailure, "%s: cannot reserve %zu bytes in /dev/shm for %d ranks: %s",
                  caller, layout.total, nranks, std::strerror(reserved));
    }
  } else {  // rank 0 may not have made it yet
    struct stat st = {};
    while ((s->fd = shm_open(id.name, O_RDWR, 0600)) < 0 || fstat(s->fd, &st) != 0 ||
           size_t(st.st_size) != layout.total) {
      if (s->fd >= 0) close(s->fd);
      s->fd = -1;
      if (timed_out())
        return fail(acmeErrorCommFailure, "%s: rank %d timed out after %.1f s waiting for rank 0",
                    caller, rank, timeoutMs / 1000.0);
      usleep(1000);
    }
  }
  void* base = mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  // (Every rank computes the segment's size from nranks, so a rank told
  // another count never finds a segment of its size, and times out.)
  if (base == MAP_FAILED) {
    if (rank == 0) shm_unlink(id.name);
    return fail(acmeErrorCommFailure, "%s: cannot map the segment: %s", caller,
                std::strerror(errno));
  }
  s->base = static_cast<char*>(base);
  s->h = reinterpret_cast<Header*>(s->base);
  s->channels = reinterpret_cast<Channel*>(s->base + layout.channels);
  if (rank == 0) {  // the file starts zeroed: every counter is 0 already
    s->h->nranks = nranks;
    __atomic_store_n(&s->h->magic, kMagic, __ATOMIC_RELEASE);
  }
  while (__atomic_load_n(&s->h->magic, __ATOMIC_ACQUIRE) != kMagic) {
    if (timed_out())
      return fail(acmeErrorCommFailure, "%s: rank %d timed out waiting for rank 0", caller, rank);
    usleep(1000);
  }
  struct flock lock = {};  // held until this process exits: how the others see it alive
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = rank;
  lock.l_len = 1;
  if (fcntl(s->fd, F_SETLK, &lock) != 0) {
    if (rank == 0) shm_unlink(id.name);
    return fail(acmeErrorCommFailure, "%s: rank %d is taken by another process", caller, rank);
  }
  s->h->ranks[rank].pid.store(getpid());

  Collective join;  // every rank arrives at generation 1
  join.s = s;
  join.deadline = deadline;
  std::snprintf(join.what, sizeof join.what, "acmeCommInitRank");
  const bool joined = join.barrier();
  if (rank == 0) shm_unlink(id.name);  // all have it open, or never will: no name left behind
  if (!joined) return fail(acmeErrorCommFailure, "%s", s->reason().c_str());
  *comm = new acmeComm_st{std::move(s)};
  return acmeSuccess;
}

acmeError_t acmeCommDestroy(acmeComm_t comm) {
  delete comm;  // queued collectives keep the segment until they have run
  return acmeSuccess;
}

acmeError_t acmeCommGetError(acmeComm_t comm) { return check_comm(comm, "acmeCommGetError"); }

acmeError_t acmeAllReduce(const void* send, void* recv, size_t count, acmeDataType type,
                          acmeReduceOp op, acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeAllReduce";
  int device;
  if (acmeError_t e = begin(comm, type, op, true, stream, caller, &device)) return e;
  auto c = std::make_unique<Collective>();
  c->call = {kAllReduce, type, op, 0, count};
  char* in;
  if (acmeError_t e = buffer(send, count, 1, type, device, "send", caller, &in)) return e;
  if (acmeError_t e = buffer(recv, count, 1, type, device, "recv", caller, &c->recv)) return e;
  c->send = in;
  return queue(c.release(), comm, caller, stream);
}

acmeError_t acmeBroadcast(void* data, size_t count, acmeDataType type, int root,
                          acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeBroadcast";
  int device;
  if (acmeError_t e = begin(comm, type, 0, false, stream, caller, &device)) return e;
  if (root < 0 || root >= comm->state->nranks)
    return fail(acmeErrorInvalidValue, "%s: root %d is not a rank of 0..%d", caller, root,
                comm->state->nranks - 1);
  auto c = std::make_unique<Collective>();
  c->call = {kBroadcast, type, 0, root, count};
  if (acmeError_t e = buffer(data, count, 1, type, device, "buffer", caller, &c->recv)) return e;
  return queue(c.release(), comm, caller, stream);
}

acmeError_t acmeAllGather(const void* send, void* recv, size_t sendCount, acmeDataType type,
                          acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeAllGather";
  int device;
  if (acmeError_t e = begin(comm, type, 0, false, stream, caller, &device)) return e;
  auto c = std::make_unique<Collective>();
  c->call = {kAllGather, type, 0, 0, sendCount};
  const size_t n = comm->state->nranks;
  char* in;
  if (acmeError_t e = buffer(send, sendCount, 1, type, device, "send", caller, &in)) return e;
  if (acmeError_t e = buffer(recv, sendCount, n, type, device, "recv", caller, &c->recv))
    return e;
  c->send = in;
  return queue(c.release(), comm, caller, stream);
}

acmeError_t acmeReduceScatter(const void* send, void* recv, size_t recvCount, acmeDataType type,
                              acmeReduceOp op, acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeReduceScatter";
  int device;
  if (acmeError_t e = begin(comm, type, op, true, stream, caller, &device)) return e;
  auto c = std::make_unique<Collective>();
  c->call = {kReduceScatter, type, op, 0, recvCount};
  const size_t n = comm->state->nranks;
  char* in;
  if (acmeError_t e = buffer(send, recvCount, n, type, device, "send", caller, &in)) return e;
  if (acmeError_t e = buffer(recv, recvCount, 1, type, device, "recv", caller, &c->recv))
    return e;
  c->send = in;
  return queue(c.release(), comm, caller, stream);
}

acmeError_t acmeAllToAll(const void* send, const size_t* sendCounts, const size_t* sendOffsets,
                         void* recv, const size_t* recvCounts, const size_t* recvOffsets,
                         acmeDataType type, acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeAllToAll";
  int device;
  if (acmeError_t e = begin(comm, type, 0, false, stream, caller, &device)) return e;
  if (!sendCounts || !sendOffsets || !recvCounts || !recvOffsets)
    return fail(acmeErrorInvalidValue, "%s: a count or offset array is NULL", caller);
  const int n = comm->state->nranks;
  auto c = std::make_unique<Collective>();
  c->send_counts.assign(sendCounts, sendCounts + n);
  c->send_offsets.assign(sendOffsets, sendOffsets + n);
  c->recv_counts.assign(recvCounts, recvCounts + n);
  c->recv_offsets.assign(recvOffsets, recvOffsets + n);
  size_t send_end = 0, recv_end = 0;  // how far into each buffer the blocks reach
  for (int r = 0; r < n; ++r) {
    if (sendCounts[r] > SIZE_MAX - sendOffsets[r] || recvCounts[r] > SIZE_MAX - recvOffsets[r])
      return fail(acmeErrorInvalidValue, "%s: the blocks for rank %d overflow", caller, r);
    send_end = std::max(send_end, sendOffsets[r] + sendCounts[r]);
    recv_end = std::max(recv_end, recvOffsets[r] + recvCounts[r]);
  }
  c->call = {kAllToAll, type, 0, 0, 0};  // the counts are checked pairwise as it runs
  char* in;
  if (acmeError_t e = buffer(send, send_end, 1, type, device, "send", caller, &in)) return e;
  if (acmeError_t e = buffer(recv, recv_end, 1, type, device, "recv", caller, &c->recv))
    return e;
  // Rounds read the send buffer after writing the receive buffer: they must
  // not overlap.
  const size_t send_bytes = send_end * type_size(type), recv_bytes = recv_end * type_size(type);
  if (send_bytes && recv_bytes && in < c->recv + recv_bytes && c->recv < in + send_bytes)
    return fail(acmeErrorInvalidValue, "%s: send and recv overlap (all_to_all is not in place)",
                caller);
  c->send = in;
  return queue(c.release(), comm, caller, stream);
}

static acmeError_t point_to_point(int kind, const void* send, void* recv, size_t count,
                                  acmeDataType type, int peer, acmeComm_t comm,
                                  acmeStream_t stream, const char* caller) {
  int device;
  if (acmeError_t e = begin(comm, type, 0, false, stream, caller, &device)) return e;
  if (peer < 0 || peer >= comm->state->nranks || peer == comm->state->rank)
    return fail(acmeErrorInvalidValue, "%s: peer %d is not another rank of 0..%d", caller, peer,
                comm->state->nranks - 1);
  auto c = std::make_unique<Collective>();
  c->call = {kind, type, 0, 0, count};
  c->peer = peer;
  char* v;
  if (acmeError_t e = buffer(kind == kSend ? send : recv, count, 1, type, device, "buffer",
                             caller, &v))
    return e;
  if (kind == kSend) c->send = v;
  else c->recv = v;
  return queue(c.release(), comm, caller, stream);
}

acmeError_t acmeSend(const void* send, size_t count, acmeDataType type, int peer,
                     acmeComm_t comm, acmeStream_t stream) {
  return point_to_point(kSend, send, nullptr, count, type, peer, comm, stream, "acmeSend");
}

acmeError_t acmeRecv(void* recv, size_t count, acmeDataType type, int peer, acmeComm_t comm,
                     acmeStream_t stream) {
  return point_to_point(kRecv, nullptr, recv, count, type, peer, comm, stream, "acmeRecv");
}

acmeError_t acmeCommBarrier(acmeComm_t comm, acmeStream_t stream) {
  const char* caller = "acmeCommBarrier";
  if (acmeError_t e = check_comm(comm, caller)) return e;
  auto c = std::make_unique<Collective>();
  c->call = {kBarrier, 0, 0, 0, 0};
  return queue(c.release(), comm, caller, stream);
}

}  // extern "C"

//@ ch16
// torch.multiprocessing for acme tensors, below Python. The memory itself is
// shared through the runtime (acmeIpc*); what this file adds is lifetime. A
// sender must not reuse a block while a receiver still reads it, so each
// send comes with a lease the sender keeps the storage alive for (as CUDA's
// IPC in PyTorch does: CudaIPCSentData, torch.cuda.ipc_collect). A lease is
// a small shared file: a count, 1 until a receiver takes the lease over, and
// a read lock the receiver holds while its storage lives. The kernel drops a
// process's locks when it exits, so a receiver that dies, even killed, still
// gives the memory back.
#include "aten/ipc.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include "aten/acme_check.h"
#include "aten/storage.h"
#include "runtime/acme_ipc.h"
//> ch18 ipc-launch-include
#include "aten/launch.h"
//< ch18 ipc-launch-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;  // prints as the device's name

//> ch16 counter
// The lease's count: a memfd holding a std::atomic<int64_t>, which is
// lock-free on the platforms acme supports, so it works across processes.
struct Counter {
  int fd = -1;
  std::atomic<int64_t>* value = nullptr;
};

Counter new_counter() {
  Counter c;
  c.fd = memfd_create("acme-ipc-count", MFD_CLOEXEC);
  TORCH_CHECK(c.fd >= 0, kAcme, ": cannot share a tensor: memfd_create failed: ",
              std::strerror(errno));
  void* p = MAP_FAILED;
  if (ftruncate(c.fd, sizeof(std::atomic<int64_t>)) == 0)
    p = mmap(nullptr, sizeof(std::atomic<int64_t>), PROT_READ | PROT_WRITE, MAP_SHARED, c.fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(c.fd);
    TORCH_CHECK(false, kAcme, ": cannot share a tensor: mapping its count failed: ",
                std::strerror(err));
  }
  c.value = new (p) std::atomic<int64_t>(1);  // the receiver's reference
  return c;
}

std::atomic<int64_t>* open_counter(int fd) {
  void* p = mmap(nullptr, sizeof(std::atomic<int64_t>), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(p != MAP_FAILED, kAcme, ": cannot open a shared tensor's count: ",
              std::strerror(errno));
  return static_cast<std::atomic<int64_t>*>(p);
}

void close_counter(std::atomic<int64_t>* value) { munmap(value, sizeof(*value)); }

// The lease's lock: a POSIX read lock on its first byte, held by a receiver
// in another process. (POSIX locks belong to a process, so the sender cannot
// see its own: a receiver in the sending process keeps the count instead.)
bool take_lease_lock(int fd) {
  struct flock lock {};
  lock.l_type = F_RDLCK;
  lock.l_whence = SEEK_SET;
  lock.l_len = 1;
  return fcntl(fd, F_SETLK, &lock) == 0;
}

bool lease_locked_elsewhere(int fd) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_len = 1;
  return fcntl(fd, F_GETLK, &lock) != 0 || lock.l_type != F_UNLCK;
}
//< ch16 counter

//> ch16 sent
// The sender's side: every storage sent and not yet released. Never
// destroyed: at exit, storages still held elsewhere stay mapped there.
struct Sent {
  c10::Storage storage;
  Counter counter;
};

struct SentList {
  std::mutex mutex;
  std::vector<Sent> sent;
};

SentList& sent_list() {
  static auto* list = new SentList;
  return *list;
}
//< ch16 sent

//> ch16 receiver-release
// The receiver's side: what the storage's DataPtr deleter releases.
struct Received {
  void* base;                     // the opened allocation
  std::atomic<int64_t>* counter;  // the lease's count
  int lease_fd;                   // holds the lease's lock, in another process
  bool same_process;              // sent by this very process: the count holds it
};

void release_received(void* context) {
  auto* received = static_cast<Received*>(context);
  if (received->same_process) received->counter->fetch_sub(1);
  close(received->lease_fd);  // drops the lock
  close_counter(received->counter);
  acmeIpcCloseMemHandle(received->base);  // a deleter cannot throw
  delete received;
}
//< ch16 receiver-release

}  // namespace

//> ch16 share
SharedStorage share_storage(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().type() == c10::DeviceType::PrivateUse1,
              kAcme, ": share_storage expects a tensor on the ", kAcme, " device, got one on ",
              tensor.device());
  const c10::Storage& storage = tensor.storage();
  TORCH_CHECK(storage.nbytes() > 0, kAcme, ": an empty storage has no memory to share");
  collect_shared();
//> ch18 share-waits
  // The other process reads the memory as soon as it opens it: the kernels
  // queued to write it must have run.
  wait_for_stream(tensor.device().index());
//< ch18 share-waits
  acmeIpcMemHandle handle;
  size_t offset = 0;
  ACME_CHECK(acmeIpcGetMemHandle(&handle, &offset, storage.data()));
  Counter counter = new_counter();
  acme_storage(storage).times_shared += 1;
  {
    SentList& list = sent_list();
    std::lock_guard<std::mutex> lock(list.mutex);
    list.sent.push_back({storage, counter});
  }
  return {handle.device, handle.fd, handle.size, offset, storage.nbytes(), counter.fd};
}

size_t collect_shared() {
  std::vector<c10::Storage> released;  // freed outside the lock
  SentList& list = sent_list();
  std::lock_guard<std::mutex> lock(list.mutex);
  auto held = list.sent.begin();
  for (auto it = list.sent.begin(); it != list.sent.end(); ++it) {
    if (it->counter.value->load() == 0 && !lease_locked_elsewhere(it->counter.fd)) {
      close_counter(it->counter.value);
      close(it->counter.fd);
      released.push_back(std::move(it->storage));
    } else {
      if (held != it) *held = std::move(*it);
      ++held;
    }
  }
  list.sent.erase(held, list.sent.end());
  return list.sent.size();
}
//< ch16 share

//> ch16 open
at::Tensor open_shared_storage(const SharedStorage& shared, int64_t sender_pid) {
  void* base = nullptr;
  const acmeError_t opened =
      acmeIpcOpenMemHandle(&base, {shared.memory_fd, shared.memory_size, shared.device});
  if (opened != acmeSuccess) close(shared.counter_fd);
  ACME_CHECK(opened);
  if (shared.offset + shared.nbytes > shared.memory_size) {
    close(shared.counter_fd);
    acmeIpcCloseMemHandle(base);
    TORCH_CHECK(false, kAcme, ": a shared storage of ", shared.nbytes, " bytes at offset ",
                shared.offset, " does not fit its ", shared.memory_size, "-byte allocation");
  }
  // The lease's descriptor stays open while the storage lives, and is the
  // only one: closing any descriptor of a file drops the process's locks on it.
  const int lease_fd = shared.counter_fd;
  std::atomic<int64_t>* counter = nullptr;
  try {
    counter = open_counter(lease_fd);
  } catch (...) {
    close(lease_fd);
    acmeIpcCloseMemHandle(base);
    throw;
  }
  const bool same_process = sender_pid == getpid();
  if (!same_process) {
    // Lock first, then hand the count back: the lease is never unheld.
    if (!take_lease_lock(lease_fd)) {
      const int err = errno;
      close(lease_fd);
      close_counter(counter);
      acmeIpcCloseMemHandle(base);
      TORCH_CHECK(false, kAcme, ": cannot lock a shared tensor's lease: ", std::strerror(err));
    }
    counter->fetch_sub(1);
  }
  auto* received = new Received{base, counter, lease_fd, same_process};
  const c10::Device device(c10::DeviceType::PrivateUse1,
                           static_cast<c10::DeviceIndex>(shared.device));
  c10::DataPtr data(static_cast<char*>(base) + shared.offset, received, &release_received, device);
  auto impl = c10::make_intrusive<AcmeStorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                   static_cast<int64_t>(shared.nbytes),
                                                   std::move(data), /*allocator=*/nullptr,
                                                   /*resizable=*/false);
  impl->shared_by_pid = sender_pid;
  at::Tensor bytes = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(impl)), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::Make<uint8_t>());
  bytes.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(shared.nbytes)});
  return bytes;
}
//< ch16 open

//> ch16 release-lease
void release_lease(int counter_fd) {
  std::atomic<int64_t>* counter = nullptr;
  try {
    counter = open_counter(counter_fd);
  } catch (...) {
    close(counter_fd);
    throw;
  }
  counter->fetch_sub(1);  // the receiver's reference, never locked
  close_counter(counter);
  close(counter_fd);
}
//< ch16 release-lease

}  // namespace acme

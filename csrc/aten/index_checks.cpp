//@ ch23
#include "aten/index_checks.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>

#include "aten/device_views.h"

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

// One copy from the host into int64 device memory: where it wrote, the
// tensor's version then, and an event recorded on the stream just after it.
struct Copied {
  const c10::StorageImpl* storage = nullptr;
  // Keeps the StorageImpl's address from being reused by another storage while
  // the entry lives; it does not keep the memory (a weak reference).
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> pin;
  size_t begin = 0, end = 0;  // bytes of the storage
  uint32_t version = 0;
  std::shared_ptr<c10::Event> done;
};

// The last few copies: a training step copies its targets once, and the
// loss and its backward look for them in the same step.
struct Recent {
  std::mutex mutex;
  std::array<Copied, 8> copies;
  size_t next = 0;
};

Recent& recent() {
  static auto* r = new Recent;  // kernels may launch during exit
  return *r;
}

// Only contiguous int64 tensors are checked as indices; inference tensors
// have no version to tell a later write by.
bool checkable(const at::Tensor& t) {
  return t.scalar_type() == at::kLong && !t.is_inference() && t.is_contiguous();
}

size_t first_byte(const at::Tensor& t) {
  return static_cast<size_t>(t.storage_offset()) * t.element_size();
}

}  // namespace

void note_copied_from_host(const at::Tensor& dst) {
  if (!checkable(dst)) return;
  auto done = std::make_shared<c10::Event>(kAcme);
  done->record(c10::impl::getDeviceGuardImpl(kAcme)->getStream(dst.device()));
  Copied copied;
  copied.storage = dst.storage().unsafeGetStorageImpl();
  copied.pin = dst.storage().getWeakStorageImpl();
  copied.begin = first_byte(dst);
  copied.end = copied.begin + dst.nbytes();
  copied.version = dst.unsafeGetTensorImpl()->version_counter().current_version();
  copied.done = std::move(done);
  Recent& r = recent();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.copies[r.next++ % r.copies.size()] = std::move(copied);
}

bool copied_indices_in_range(const at::Tensor& indices, int64_t bound, int64_t allowed) {
  if (!indices.defined() || indices.device().type() != kAcme || !checkable(indices)) return false;
  const c10::StorageImpl* storage = indices.storage().unsafeGetStorageImpl();
  const size_t begin = first_byte(indices), end = begin + indices.nbytes();
  // A write through the dispatcher since the copy (in place, out=, on any
  // view) changed the version; the copy's values would be stale then.
  const uint32_t version = indices.unsafeGetTensorImpl()->version_counter().current_version();
  std::shared_ptr<c10::Event> done;
  {
    Recent& r = recent();
    const std::lock_guard<std::mutex> lock(r.mutex);
    for (const Copied& c : r.copies) {
      if (c.storage == storage && c.version == version && c.begin <= begin && end <= c.end) {
        done = c.done;
        break;
      }
    }
  }
  if (!done) return false;
  done->synchronize();  // the copy itself, not the kernels queued after it
  // Read where they lie: the copy has run and nothing queued since wrote them.
  DeviceViews view(DeviceViews::kForLaunch);
  const at::Tensor values = view(indices);
  const int64_t* value = values.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    if ((value[i] < 0 || value[i] >= bound) && value[i] != allowed) return false;
  }
  return true;
}

}  // namespace acme

//@ ch07
// Backend metadata that survives torch.save and torch.load. torch.save writes
// a device tensor's bytes and its location without help from the backend; what
// it cannot know is state the backend keeps beside the bytes. Here that is a
// "format tag", the kind of physical-layout code an NPU attaches to a tensor.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
//> ch16 flags-include
#include <map>
//< ch16 flags-include

namespace acme {
namespace {

constexpr auto kAcme = c10::DeviceType::PrivateUse1;

//> ch07 format-meta
// A tag lives on the TensorImpl, not on the storage: two tensors viewing one
// storage may read it in different formats. It is immutable (setting a tag
// installs a new object), so PyTorch's default BackendMeta::clone, which
// shares the object with the tensor's detached copies (nn.Parameter,
// state_dict()), is safe.
//> ch07 format-meta-struct < ch16 tensor-meta-struct
// struct AcmeFormatMeta final : c10::BackendMeta {
//   explicit AcmeFormatMeta(int64_t tag) : tag(tag) {}
//   const int64_t tag;
// };
//< ch07 format-meta-struct
//> ch16 tensor-meta-struct
// From chapter 16 it also keeps the flags other code sets through
// torch._C._set_tensor_metadata, which were dropped before; tag -1 means
// "flags only, no format tag".
struct AcmeFormatMeta final : c10::BackendMeta {
  AcmeFormatMeta(int64_t tag, std::map<std::string, bool> flags)
      : tag(tag), flags(std::move(flags)) {}
  const int64_t tag;
  const std::map<std::string, bool> flags;
};
//< ch16 tensor-meta-struct

// Eight bits are enough for a layout code and keep the checkpoint entry small.
constexpr int kTagBits = 8;
constexpr int64_t kTagLimit = int64_t{1} << kTagBits;

const AcmeFormatMeta* format_meta(const at::Tensor& t) {
  // Any backend may hang a BackendMeta here: only ours counts.
  return dynamic_cast<const AcmeFormatMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
}

//> ch07 set-format < ch16 set-format
// void set_format(const at::Tensor& t, int64_t tag) {
//   t.unsafeGetTensorImpl()->set_backend_meta(c10::make_intrusive<AcmeFormatMeta>(tag));
// }
//< ch07 set-format
//> ch16 set-format
void set_meta(const at::Tensor& t, int64_t tag, std::map<std::string, bool> flags) {
  t.unsafeGetTensorImpl()->set_backend_meta(
      c10::make_intrusive<AcmeFormatMeta>(tag, std::move(flags)));
}

void set_format(const at::Tensor& t, int64_t tag) {
  const auto* meta = format_meta(t);
  set_meta(t, tag, meta ? meta->flags : std::map<std::string, bool>{});
}
//< ch16 set-format
//< ch07 format-meta

//> ch07 ops
void set_backend_meta(const at::Tensor& self, int64_t tag) {
  TORCH_CHECK_VALUE(tag >= 0 && tag < kTagLimit, kAcme, ": a format tag is a number from 0 to ",
                    kTagLimit - 1, ", got ", tag);
  set_format(self, tag);
}

int64_t get_backend_meta(const at::Tensor& self) {
  const auto* meta = format_meta(self);
  return meta == nullptr ? -1 : meta->tag;
}
//< ch07 ops

//> ch07 encode
// A checkpoint stores a tensor's metadata as a dict of str -> bool, beside
// PyTorch's own "conj" and "neg" bits. An integer goes in as its bits, all of
// them written, plus a key saying a tag is present, so that the reader can
// tell "no tag" and "tag 0" apart, and a complete tag from a damaged entry.
const std::string kPresentKey = "acme.format";

std::string bit_key(int bit) { return kPresentKey + ".bit" + std::to_string(bit); }

// Runs inside torch.save, for every acme tensor (torch._C._get_tensor_metadata).
void write_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& metadata) {
  const auto* meta = format_meta(t);
  if (meta == nullptr) return;  // nothing written: the common case costs no space
//> ch16 write-flags
  for (const auto& [key, value] : meta->flags) metadata[key] = value;
  if (meta->tag < 0) return;
//< ch16 write-flags
  metadata[kPresentKey] = true;
  for (int bit = 0; bit < kTagBits; ++bit) metadata[bit_key(bit)] = (meta->tag >> bit) & 1;
}

// Runs inside torch.load, on the rebuilt tensor if it is an acme tensor
// (torch._C._set_tensor_metadata). Loaded to the CPU, the entry is ignored.
void read_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& metadata) {
//> ch16 read-flags
  // Every key that is not PyTorch's own nor acme's format tag is a flag.
  std::map<std::string, bool> flags;
  for (const auto& [key, value] : metadata)
    if (key != "conj" && key != "neg" && key.rfind(kPresentKey, 0) != 0) flags[key] = value;
  if (!flags.empty()) {
    const auto* meta = format_meta(t);
    if (meta) flags.insert(meta->flags.begin(), meta->flags.end());  // new values win
    set_meta(t, meta ? meta->tag : -1, std::move(flags));
  }
//< ch16 read-flags
  const auto present = metadata.find(kPresentKey);
  if (present == metadata.end()) return;
  TORCH_CHECK(present->second, kAcme, ": damaged checkpoint: '", kPresentKey, "' is false");
  int64_t tag = 0;
  for (int bit = 0; bit < kTagBits; ++bit) {
    const auto entry = metadata.find(bit_key(bit));
    TORCH_CHECK(entry != metadata.end(), kAcme, ": damaged checkpoint: the format tag has no '",
                bit_key(bit), "' entry");
    tag |= int64_t{entry->second} << bit;
  }
  set_format(t, tag);
}
//< ch07 encode

}  // namespace
}  // namespace acme

//> ch07 register-ops
// Fragments: chapter 5 also defines ops in the acme namespace.
TORCH_LIBRARY_FRAGMENT(acme, m) {
  m.def("set_backend_meta(Tensor self, int tag) -> ()");
  m.def("get_backend_meta(Tensor self) -> int");
}

TORCH_LIBRARY_IMPL(acme, PrivateUse1, m) {
  m.impl("set_backend_meta", TORCH_FN(acme::set_backend_meta));
  m.impl("get_backend_meta", TORCH_FN(acme::get_backend_meta));
}
//< ch07 register-ops

//> ch07 register-meta
// One pair per device type, once per process (a second registration throws).
// PyTorch only accepts one for PrivateUse1 (its allowlist).
namespace {
const bool meta_serialization_registered = [] {
  torch::jit::TensorBackendMetaRegistry(acme::kAcme, &acme::write_meta, &acme::read_meta);
  return true;
}();
}  // namespace
//< ch07 register-meta

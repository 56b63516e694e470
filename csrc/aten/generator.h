//@ ch05
// acme's random number generator: Philox4x32-10, a counter-based generator.
// A counter-based generator maps (key, counter) to random bits with a pure
// function, so thousands of device threads can each compute their own numbers
// from their own counter without sharing any state: the result does not
// depend on how the work is split. The generator itself is just two numbers.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <array>
#include <cstdint>

namespace acme {

// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as
// easy as 1, 2, 3", SC 2011): ten rounds of two 32x32->64-bit multiplies
// mixing a 128-bit counter under a 64-bit key, the key bumped by a Weyl
// sequence between rounds. It returns four 32-bit random words per counter.
using PhiloxBlock = std::array<uint32_t, 4>;

inline PhiloxBlock philox4x32_10(PhiloxBlock counter, std::array<uint32_t, 2> key) {
  constexpr uint64_t kMul0 = 0xD2511F53, kMul1 = 0xCD9E8D57;
  constexpr uint32_t kWeyl0 = 0x9E3779B9, kWeyl1 = 0xBB67AE85;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    const uint64_t p0 = kMul0 * counter[0];
    const uint64_t p1 = kMul1 * counter[2];
    counter = {static_cast<uint32_t>(p1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(p1),
               static_cast<uint32_t>(p0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(p0)};
  }
  return counter;
}

// acme's stream: the key is the 64-bit seed; counter block n is the 128-bit
// number n. Every random op reserves a range of blocks (one per element) and
// the generator's offset moves past them.
inline PhiloxBlock philox_block(uint64_t seed, uint64_t block) {
  return philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0, 0},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

// The blocks a kernel may use: seed, and the first block of its range.
struct PhiloxRange {
  uint64_t seed;
  uint64_t first;
};

// The generator's whole state is (seed, offset): 16 bytes, which is also the
// layout of get_state()'s tensor (two little-endian uint64). Like every
// GeneratorImpl, it is not thread-safe by itself: callers hold mutex_.
struct AcmeGeneratorImpl final : c10::GeneratorImpl {
  static constexpr size_t kStateBytes = 16;

  explicit AcmeGeneratorImpl(c10::DeviceIndex device, uint64_t seed = c10::default_rng_seed_val);

  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  void set_current_seed(uint64_t seed) override;  // also rewinds the offset to 0
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override;                       // a fresh nondeterministic seed
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  void set_state(const c10::TensorImpl& state) override;

  // Reserves `blocks` counter blocks for one kernel launch.
  PhiloxRange reserve(uint64_t blocks);

 private:
  AcmeGeneratorImpl* clone_impl() const override;

  uint64_t seed_;
  uint64_t offset_ = 0;  // the next unused counter block
};

// The per-device default generator (device -1: the current device), created
// on first use and shared by every op that gets no generator= argument.
const at::Generator& default_generator(c10::DeviceIndex device);

// A new generator, what torch.Generator(device="privateuseone") returns.
at::Generator new_generator(c10::DeviceIndex device);

}  // namespace acme

//@ ch23
// Philox for a run of consecutive counter blocks at once (philox_batch.cpp,
// chapter 23): the numbers generator.h's philox_block gives, faster.
#pragma once

#include <algorithm>
#include <cstdint>

#include "aten/generator.h"

namespace acme {

// Blocks first .. first + count - 1 (count at most kPhiloxBatch) at once, word
// k of block first + j in words[k][j]: philox_block's numbers, faster.
constexpr int kPhiloxBatch = 32;
void philox_batch(uint64_t seed, uint64_t first, int count, uint32_t (&words)[4][kPhiloxBatch]);

// out[i] = sample(i, counter block range.first + i) for i in [begin, end),
// the blocks a batch at a time: the loop of every kernel that draws numbers.
template <typename T, typename Sample>
void fill_blocks(const PhiloxRange& range, T* out, int64_t begin, int64_t end,
                 const Sample& sample) {
  alignas(32) uint32_t words[4][kPhiloxBatch];
  for (int64_t start = begin; start < end; start += kPhiloxBatch) {
    const int count = static_cast<int>(std::min<int64_t>(kPhiloxBatch, end - start));
    philox_batch(range.seed, range.first + static_cast<uint64_t>(start), count, words);
    for (int j = 0; j < count; ++j) {
      out[start + j] = sample(start + j, {words[0][j], words[1][j], words[2][j], words[3][j]});
    }
  }
}

}  // namespace acme

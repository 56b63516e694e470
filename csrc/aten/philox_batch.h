//@ ch23
// Philox for a run of consecutive counter blocks at once (philox_batch.cpp,
// chapter 23): the numbers generator.h's philox_block gives, faster.
#pragma once

#include <cstdint>

namespace acme {

// Blocks first .. first + count - 1 (count at most kPhiloxBatch) at once, word
// k of block first + j in words[k][j]: philox_block's numbers, faster.
constexpr int kPhiloxBatch = 32;
void philox_batch(uint64_t seed, uint64_t first, int count, uint32_t (&words)[4][kPhiloxBatch]);

}  // namespace acme

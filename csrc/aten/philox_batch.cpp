//@ ch23
// Philox for a run of consecutive counter blocks (chapter 23). One block at a
// time, each of Philox's ten rounds waits for the multiply of the round
// before, and the core idles through that latency. Thirty-two blocks at once,
// eight to an AVX2 register and four registers in flight, keep it busy: the
// same numbers, about five times faster. CPUs without AVX2 take the scalar
// path, block by block.
#include "aten/philox_batch.h"

#include "aten/generator.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACME_PHILOX_AVX2 1
#endif

namespace acme {
namespace {

#ifdef ACME_PHILOX_AVX2
// One Philox round on eight blocks: word k of block j is lane j of c[k].
// _mm256_mul_epu32 multiplies the even 32-bit lanes into 64-bit products, so
// the odd lanes take a second multiply after a shift; blends put the high and
// low halves of the eight products back into lane order.
__attribute__((target("avx2"))) inline void round8(__m256i (&c)[4], __m256i key0, __m256i key1) {
  const __m256i mul0 = _mm256_set1_epi64x(0xD2511F53), mul1 = _mm256_set1_epi64x(0xCD9E8D57);
  const __m256i even0 = _mm256_mul_epu32(c[0], mul0);
  const __m256i odd0 = _mm256_mul_epu32(_mm256_srli_epi64(c[0], 32), mul0);
  const __m256i even1 = _mm256_mul_epu32(c[2], mul1);
  const __m256i odd1 = _mm256_mul_epu32(_mm256_srli_epi64(c[2], 32), mul1);
  const __m256i low0 = _mm256_blend_epi32(even0, _mm256_slli_epi64(odd0, 32), 0xAA);
  const __m256i high0 = _mm256_blend_epi32(_mm256_srli_epi64(even0, 32), odd0, 0xAA);
  const __m256i low1 = _mm256_blend_epi32(even1, _mm256_slli_epi64(odd1, 32), 0xAA);
  const __m256i high1 = _mm256_blend_epi32(_mm256_srli_epi64(even1, 32), odd1, 0xAA);
  c[0] = _mm256_xor_si256(_mm256_xor_si256(high1, c[1]), key0);
  c[1] = low1;
  c[2] = _mm256_xor_si256(_mm256_xor_si256(high0, c[3]), key1);
  c[3] = low0;
}

__attribute__((target("avx2"))) void batch_avx2(uint64_t seed, uint64_t first,
                                                uint32_t (&words)[4][kPhiloxBatch]) {
  constexpr int kGroups = kPhiloxBatch / 8;
  // Counter of block first + j: (low word, high word, 0, 0).
  for (int j = 0; j < kPhiloxBatch; ++j) {
    words[0][j] = static_cast<uint32_t>(first + j);
    words[1][j] = static_cast<uint32_t>((first + j) >> 32);
  }
  __m256i c[kGroups][4];
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; ++g) {
    c[g][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[0] + 8 * g));
    c[g][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[1] + 8 * g));
    c[g][2] = c[g][3] = _mm256_setzero_si256();
  }
  uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += 0x9E3779B9;
      key1 += 0xBB67AE85;
    }
    const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key0));
    const __m256i k1 = _mm256_set1_epi32(static_cast<int>(key1));
#pragma GCC unroll 4
    for (int g = 0; g < kGroups; ++g) round8(c[g], k0, k1);  // independent: they overlap
  }
#pragma GCC unroll 4
  for (int g = 0; g < kGroups; ++g)
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[k] + 8 * g), c[g][k]);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

}  // namespace

void philox_batch(uint64_t seed, uint64_t first, int count, uint32_t (&words)[4][kPhiloxBatch]) {
#ifdef ACME_PHILOX_AVX2
  if (count == kPhiloxBatch && has_avx2()) return batch_avx2(seed, first, words);
#endif
  for (int j = 0; j < count; ++j) {
    const PhiloxBlock b = philox_block(seed, first + j);
    for (int k = 0; k < 4; ++k) words[k][j] = b[k];
  }
}

}  // namespace acme

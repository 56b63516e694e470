//@ ch23
// Attention a query row at a time. attention.cpp's composite runs a dozen
// ATen ops, each over the whole batch of scores: at a language model's sizes
// (32 keys, 16 features) their per-op costs outweigh the arithmetic. Here one
// pass per query row computes its scores, softmax, dropout and output while
// the row is in cache. The numbers are the composite's, up to rounding:
// scores q·k·scale (+ bias), probabilities exp(s - max) / sum, the kept ones
// times 1 / (1 - p), and the log-sum-exp max + log(sum).
#include "aten/attention_rows.h"

#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __x86_64__
#include <immintrin.h>
#endif

namespace acme {
namespace {

// One batch entry (a head of one sequence): sizes of its rows.
struct Shape {
  int64_t batch, queries, keys, features, values;  // G, Lq, Lk, D, Dv
};

// How many keys query row i sees: the causal mask is top-left aligned, as the
// composite's tril (and ATen's math path).
int64_t visible(const Shape& n, int64_t i, bool is_causal) {
  return is_causal ? std::min(i + 1, n.keys) : n.keys;
}

#if !defined(__GNUC__)  // Clang defines it too
#error "attention_rows.cpp needs GCC's or Clang's vector extension and attributes"
#endif
// The helpers below are inlined into each build of the kernels, so that
// they are compiled for its instruction set.
#define ACME_ROWS_INLINE __attribute__((always_inline)) inline

// Rows are padded with zeros to whole blocks of kLanes numbers, and a block
// is one value of GCC's and Clang's vector extension, Lanes<T>: its
// arithmetic compiles to vector instructions, two SSE registers for eight
// floats on any x86-64, one register where the kernels are built for AVX2
// (below). The helpers take blocks by reference: a vector passed by value
// would change the calling convention between the two builds.
constexpr int64_t kLanes = 8;
int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

template <typename T>
struct LanesOf;
template <>
struct LanesOf<float> {
  typedef float type __attribute__((vector_size(sizeof(float) * kLanes)));
};
template <>
struct LanesOf<double> {
  typedef double type __attribute__((vector_size(sizeof(double) * kLanes)));
};
template <typename T>
using Lanes = typename LanesOf<T>::type;

template <typename T>
ACME_ROWS_INLINE void load(Lanes<T>& block, const T* from) {
  std::memcpy(&block, from, sizeof block);
}
template <typename T>
ACME_ROWS_INLINE void store(T* to, const Lanes<T>& block) {
  std::memcpy(to, &block, sizeof block);
}

// rows [count][width] as columns [width][padded(count)], zero padded.
template <typename T>
ACME_ROWS_INLINE void columns_of(const T* rows, int64_t count, int64_t width,
                                 std::vector<T>& columns) {
  const int64_t stride = padded(count);
  columns.assign(width * stride, T(0));
  for (int64_t j = 0; j < count; ++j)
    for (int64_t d = 0; d < width; ++d) columns[d * stride + j] = rows[j * width + d];
}

// rows [count][width] as [count][padded(width)], zero padded.
template <typename T>
ACME_ROWS_INLINE void padded_rows(const T* rows, int64_t count, int64_t width,
                                  std::vector<T>& out) {
  const int64_t stride = padded(width);
  out.assign(count * stride, T(0));
  for (int64_t j = 0; j < count; ++j)
    std::copy(rows + j * width, rows + (j + 1) * width, out.begin() + j * stride);
}

// e^x of a block: std::exp. The AVX2 kernels take Avx2Math's, below.
struct PortableMath {
  template <typename T>
  static ACME_ROWS_INLINE void exp_block(T* x) {
    for (int64_t l = 0; l < kLanes; ++l) x[l] = std::exp(x[l]);
  }
};

// Query rows go through in groups of kGroup: each block of a key column (or
// of a value row) is loaded once for the group, and the group's sums are
// independent, so the core does not wait on one running sum.
constexpr int kGroup = 4;

// y[r] = Σ_{t<inner} a[r][t]·b[t] for r < R, over the blocks of b's rows
// that hold the first `columns` numbers: a row of scores (a = q, b = kᵀ) or
// of outputs (a = probabilities, b = v). Rows of a, b and y are a_stride,
// b_stride and y_stride numbers apart.
template <int R, typename T>
ACME_ROWS_INLINE void products(const T* a, int64_t a_stride, int64_t inner, const T* b,
                               int64_t b_stride, int64_t columns, T* y, int64_t y_stride) {
  for (int64_t c0 = 0; c0 < columns; c0 += kLanes) {
    Lanes<T> sum[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sum[r] = Lanes<T>{};
    for (int64_t t = 0; t < inner; ++t) {
      Lanes<T> block;
      load(block, b + t * b_stride + c0);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sum[r] += a[r * a_stride + t] * block;
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store(y + r * y_stride + c0, sum[r]);
  }
}

// rows[j] += Σ_{r<R} w[r][j]·x[r] for j < seen: rows, and x's rows, are
// `stride` (padded) numbers apart; w's rows w_stride apart.
template <int R, typename T>
ACME_ROWS_INLINE void add_outer(const T* w, int64_t w_stride, int64_t seen, const T* x,
                                int64_t stride, T* rows) {
  for (int64_t d0 = 0; d0 < stride; d0 += kLanes) {
    Lanes<T> xs[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) load(xs[r], x + r * stride + d0);
    for (int64_t j = 0; j < seen; ++j) {
      Lanes<T> sum;
      load(sum, rows + j * stride + d0);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sum += w[r * w_stride + j] * xs[r];
      store(rows + j * stride + d0, sum);
    }
  }
}

// s *= factor over the blocks that hold the first `seen`.
template <typename T>
ACME_ROWS_INLINE void scale_blocks(T* s, int64_t seen, T factor) {
  for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
    Lanes<T> block;
    load(block, s + j0);
    block *= factor;
    store(s + j0, block);
  }
}

// The largest of the blocks that hold the first `seen`, NaN if any is NaN
// (as amax).
template <typename T>
ACME_ROWS_INLINE T row_max(const T* s, int64_t seen) {
  Lanes<T> top = Lanes<T>{} - std::numeric_limits<T>::infinity();
  auto nan = top != top;
  for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
    Lanes<T> block;
    load(block, s + j0);
    nan |= block != block;
    top = block > top ? block : top;
  }
  T result = top[0];
  for (int64_t l = 0; l < kLanes; ++l) {
    if (nan[l]) return std::numeric_limits<T>::quiet_NaN();
    result = std::max(result, top[l]);
  }
  return result;
}

// s = exp(s - shift) over the blocks that hold the first `seen` (-inf
// becomes 0); returns the sum.
template <typename Math, typename T>
ACME_ROWS_INLINE T exp_shifted(T* s, int64_t seen, T shift) {
  Lanes<T> sum{};
  for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
    Lanes<T> block;
    load(block, s + j0);
    block -= shift;
    store(s + j0, block);
    Math::exp_block(s + j0);
    load(block, s + j0);
    sum += block;
  }
  T total = 0;
  for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
  return total;
}

// p[j] *= 1 / (1 - dropout_p) where kept, 0 where dropped, for j < seen.
template <typename T>
ACME_ROWS_INLINE void apply_mask(T* p, const bool* keep, int64_t seen, T kept_scale) {
  int64_t j0 = 0;
  for (; j0 + kLanes <= seen; j0 += kLanes) {
    Lanes<T> block, factor;
    load(block, p + j0);
    for (int64_t l = 0; l < kLanes; ++l) factor[l] = static_cast<T>(keep[j0 + l]) * kept_scale;
    block *= factor;
    store(p + j0, block);
  }
  for (int64_t j = j0; j < seen; ++j) p[j] *= static_cast<T>(keep[j]) * kept_scale;
}

template <typename T>
struct Rows {
  const T *q, *k, *v, *bias, *d_out, *lse_in;
  const bool* keep;
  Shape n;
  T scale, kept_scale;
  bool is_causal;
  T *out, *lse, *dq, *dk, *dv, *d_scores;
};

// What a batch entry's rows share: its keys as columns (for q·kᵀ), its
// values as padded rows, and row buffers. `stride`: a padded row of keys.
template <typename T>
struct Entry {
  explicit Entry(const Shape& n)
      : stride(padded(n.keys)), width(padded(n.features)), value_width(padded(n.values)),
        scores(kGroup * stride), out_rows(kGroup * value_width) {}
  int64_t stride, width, value_width;
  std::vector<T> k_columns, v_rows, scores, out_rows;
};

// A group's scores: scale · q·kᵀ (+ bias) for the keys each row sees, and
// -inf after them to the end of the group's last block. Returns how many
// keys the group's last row sees, the most any of them does.
template <int R, typename T>
ACME_ROWS_INLINE int64_t group_scores(const Rows<T>& a, Entry<T>& e, int64_t row, int64_t i) {
  const Shape& n = a.n;
  const int64_t group_seen = visible(n, i + R - 1, a.is_causal);
  products<R>(a.q + row * n.features, n.features, n.features, e.k_columns.data(), e.stride,
              group_seen, e.scores.data(), e.stride);
  for (int r = 0; r < R; ++r) {
    const int64_t seen = visible(n, i + r, a.is_causal);
    T* s = e.scores.data() + r * e.stride;
    scale_blocks(s, seen, a.scale);
    if (a.bias) {
      const T* b = a.bias + (row + r) * n.keys;
      for (int64_t j = 0; j < seen; ++j) s[j] += b[j];
    }
    std::fill(s + seen, s + padded(group_seen), -std::numeric_limits<T>::infinity());
  }
  return group_seen;
}

template <int R, typename Math, typename T>
ACME_ROWS_INLINE void forward_group(const Rows<T>& a, Entry<T>& e, int64_t row, int64_t i) {
  const Shape& n = a.n;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t group_seen = group_scores<R>(a, e, row, i);
  for (int r = 0; r < R; ++r) {
    const int64_t seen = visible(n, i + r, a.is_causal);
    T* p = e.scores.data() + r * e.stride;
    const T top = row_max(p, seen);
    if (top == neg_inf) {  // nothing to attend to: zeros, and a log-sum-exp of -inf
      std::fill(p, p + padded(group_seen), T(0));
      a.lse[row + r] = neg_inf;
      continue;
    }
    const T sum = exp_shifted<Math>(p, group_seen, top);  // 0 past `seen`
    a.lse[row + r] = top + std::log(sum);
    scale_blocks(p, seen, T(1) / sum);
    if (a.keep) apply_mask(p, a.keep + (row + r) * n.keys, seen, a.kept_scale);
  }
  products<R>(e.scores.data(), e.stride, group_seen, e.v_rows.data(), e.value_width,
              e.value_width, e.out_rows.data(), e.value_width);
  for (int r = 0; r < R; ++r) {
    const T* o = e.out_rows.data() + r * e.value_width;
    std::copy(o, o + n.values, a.out + (row + r) * n.values);
  }
}

template <typename Math, typename T>
ACME_ROWS_INLINE void forward_entries(const Rows<T>& a, int64_t begin, int64_t end) {
  const Shape& n = a.n;
  Entry<T> e(n);
  for (int64_t g = begin; g < end; ++g) {
    columns_of(a.k + g * n.keys * n.features, n.keys, n.features, e.k_columns);
    padded_rows(a.v + g * n.keys * n.values, n.keys, n.values, e.v_rows);
    int64_t i = 0;
    for (; i + kGroup <= n.queries; i += kGroup)
      forward_group<kGroup, Math>(a, e, g * n.queries + i, i);
    for (; i < n.queries; ++i) forward_group<1, Math>(a, e, g * n.queries + i, i);
  }
}

// The backward's buffers besides Entry's: dP, dS, the probabilities as
// used (after dropout), the group's q and dO rows padded, its dq, and the
// entry's dk and dv as they sum over its rows.
template <typename T>
struct BackwardEntry : Entry<T> {
  explicit BackwardEntry(const Shape& n)
      : Entry<T>(n), d_p(kGroup * this->stride), d_s(kGroup * this->stride),
        p_used(kGroup * this->stride), q_rows(kGroup * this->width),
        d_out_rows(kGroup * this->value_width), dq_rows(kGroup * this->width),
        dk_rows(n.keys * this->width), dv_rows(n.keys * this->value_width) {}
  std::vector<T> v_columns, k_rows, d_p, d_s, p_used, q_rows, d_out_rows, dq_rows, dk_rows,
      dv_rows;
};

// Softmax's backward, a group of rows at a time: with P the probabilities
// (from the saved log-sum-exp) and dP = dO·vᵀ (times the mask),
// dS = P ∘ (dP − rowsum(dP ∘ P)); dq = dS·k·scale, dk = dSᵀ·q·scale,
// dv = (P ∘ mask)ᵀ·dO.
template <int R, typename Math, typename T>
ACME_ROWS_INLINE void backward_group(const Rows<T>& a, BackwardEntry<T>& e, int64_t row,
                                     int64_t i) {
  const Shape& n = a.n;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t group_seen = group_scores<R>(a, e, row, i);
  products<R>(a.d_out + row * n.values, n.values, n.values, e.v_columns.data(), e.stride,
              group_seen, e.d_p.data(), e.stride);
  for (int r = 0; r < R; ++r) {
    const int64_t seen = visible(n, i + r, a.is_causal);
    T* p = e.scores.data() + r * e.stride;
    T* d_p = e.d_p.data() + r * e.stride;
    T* d_s = e.d_s.data() + r * e.stride;
    T* p_used = e.p_used.data() + r * e.stride;
    if (a.lse_in[row + r] == neg_inf) {  // a row that attended to nothing: all 0
      std::fill(d_s, d_s + padded(group_seen), T(0));
      std::fill(p_used, p_used + padded(group_seen), T(0));
      continue;
    }
    exp_shifted<Math>(p, group_seen, a.lse_in[row + r]);  // 0 past `seen`
    std::copy(p, p + padded(group_seen), p_used);
    std::fill(d_p + seen, d_p + padded(seen), T(0));
    if (a.keep) {
      apply_mask(p_used, a.keep + (row + r) * n.keys, seen, a.kept_scale);
      apply_mask(d_p, a.keep + (row + r) * n.keys, seen, a.kept_scale);
    }
    Lanes<T> products{};  // rowsum(dP ∘ P), a partial sum per lane
    for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
      Lanes<T> d_p_block, p_block;
      load(d_p_block, d_p + j0);
      load(p_block, p + j0);
      products += d_p_block * p_block;
    }
    T weighted = 0;
    for (int64_t l = 0; l < kLanes; ++l) weighted += products[l];
    for (int64_t j0 = 0; j0 < seen; j0 += kLanes) {
      Lanes<T> d_p_block, p_block;
      load(d_p_block, d_p + j0);
      load(p_block, p + j0);
      store(d_s + j0, (d_p_block - weighted) * p_block);
    }
    // Keys past `seen` add 0 to the group's sums.
    std::fill(d_s + seen, d_s + padded(group_seen), T(0));
    if (a.d_scores) std::copy(d_s, d_s + seen, a.d_scores + (row + r) * n.keys);
  }
  products<R>(e.d_s.data(), e.stride, group_seen, e.k_rows.data(), e.width, e.width,
              e.dq_rows.data(), e.width);
  scale_blocks(e.dq_rows.data(), R * e.width, a.scale);
  for (int r = 0; r < R; ++r) {
    const T* dq = e.dq_rows.data() + r * e.width;
    std::copy(dq, dq + n.features, a.dq + (row + r) * n.features);
    const T* q = a.q + (row + r) * n.features;
    std::copy(q, q + n.features, e.q_rows.begin() + r * e.width);
    const T* d_out = a.d_out + (row + r) * n.values;
    std::copy(d_out, d_out + n.values, e.d_out_rows.begin() + r * e.value_width);
  }
  add_outer<R>(e.d_s.data(), e.stride, group_seen, e.q_rows.data(), e.width, e.dk_rows.data());
  add_outer<R>(e.p_used.data(), e.stride, group_seen, e.d_out_rows.data(), e.value_width,
               e.dv_rows.data());
}

// A batch entry's dk and dv sum over its rows, so an entry's rows stay on
// one thread.
template <typename Math, typename T>
ACME_ROWS_INLINE void backward_entries(const Rows<T>& a, int64_t begin, int64_t end) {
  const Shape& n = a.n;
  BackwardEntry<T> e(n);
  for (int64_t g = begin; g < end; ++g) {
    const T* kg = a.k + g * n.keys * n.features;
    const T* vg = a.v + g * n.keys * n.values;
    columns_of(kg, n.keys, n.features, e.k_columns);
    columns_of(vg, n.keys, n.values, e.v_columns);
    padded_rows(kg, n.keys, n.features, e.k_rows);
    std::fill(e.dk_rows.begin(), e.dk_rows.end(), T(0));
    std::fill(e.dv_rows.begin(), e.dv_rows.end(), T(0));
    int64_t i = 0;
    for (; i + kGroup <= n.queries; i += kGroup)
      backward_group<kGroup, Math>(a, e, g * n.queries + i, i);
    for (; i < n.queries; ++i) backward_group<1, Math>(a, e, g * n.queries + i, i);
    scale_blocks(e.dk_rows.data(), n.keys * e.width, a.scale);
    for (int64_t j = 0; j < n.keys; ++j) {
      const T* dk = e.dk_rows.data() + j * e.width;
      std::copy(dk, dk + n.features, a.dk + (g * n.keys + j) * n.features);
      const T* dv = e.dv_rows.data() + j * e.value_width;
      std::copy(dv, dv + n.values, a.dv + (g * n.keys + j) * n.values);
    }
  }
}

#ifdef __x86_64__
#define ACME_ROWS_AVX2 1
#define ACME_AVX2 __attribute__((target("avx2")))

// e^x for eight floats at once: 2^n · e^r with n = round(x / ln 2) and
// |r| ≤ ln(2)/2, e^r by its Taylor series to r⁷/7!, within a few ulp of
// std::exp. Below e^-87 (the smallest normal float is e^-87.3) it gives 0,
// which softmax's masked keys (-inf) need; NaN stays NaN.
struct Avx2Math {
  static ACME_AVX2 void exp_block(float* x) {  // not forced inline: generic code calls it
    const __m256 in = _mm256_loadu_ps(x), lowest = _mm256_set1_ps(-87.0f);
    const __m256 v = _mm256_max_ps(lowest, in);  // max_ps gives its second operand if NaN
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n·ln 2, with ln 2 in two parts so that n·(the first) is exact.
    __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 e = _mm256_set1_ps(1.0f / 5040);
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f / 720));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f / 120));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f / 24));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f / 6));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(0.5f));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f));
    e = _mm256_add_ps(_mm256_mul_ps(e, r), _mm256_set1_ps(1.0f));
    // 2^n: n + 127 in a float's exponent field.
    const __m256i power = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    e = _mm256_mul_ps(e, _mm256_castsi256_ps(power));
    const __m256 kept = _mm256_or_ps(_mm256_cmp_ps(in, lowest, _CMP_GE_OQ),
                                     _mm256_cmp_ps(in, in, _CMP_UNORD_Q));
    _mm256_storeu_ps(x, _mm256_and_ps(e, kept));
  }
};
static_assert(kLanes == 8, "Avx2Math works on blocks of eight floats");

ACME_AVX2 void forward_entries_avx2(const Rows<float>& a, int64_t begin, int64_t end) {
  forward_entries<Avx2Math>(a, begin, end);
}
ACME_AVX2 void backward_entries_avx2(const Rows<float>& a, int64_t begin, int64_t end) {
  backward_entries<Avx2Math>(a, begin, end);
}
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// Each batch entry on one thread; floats with AVX2 where the CPU has it.
template <typename T>
void run_rows(const Rows<T>& a, bool backward) {
  at::parallel_for(0, a.n.batch, 1, [&](int64_t begin, int64_t end) {
#ifdef ACME_ROWS_AVX2
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx2()) {
        return backward ? backward_entries_avx2(a, begin, end)
                        : forward_entries_avx2(a, begin, end);
      }
    }
#endif
    backward ? backward_entries<PortableMath>(a, begin, end)
             : forward_entries<PortableMath>(a, begin, end);
  });
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  int64_t batch = 1;
  for (int64_t d = 0; d + 2 < q.dim(); ++d) batch *= q.size(d);
  return {batch, q.size(-2), k.size(-2), q.size(-1), v.size(-1)};
}

// The bias over the whole scores' shape, row-major: a broadcast mask is read
// once per batch entry, as the composite's addition reads it.
at::Tensor full_bias(const at::Tensor& bias, const std::vector<int64_t>& sizes) {
  return bias.defined() ? bias.expand(sizes).contiguous() : bias;
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// What forward and backward both hand the row kernels.
template <typename T>
Rows<T> inputs_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& bias, const at::Tensor& keep, const Shape& n,
                  double dropout_p, bool is_causal, double scale) {
  Rows<T> rows{};
  rows.q = q.const_data_ptr<T>(), rows.k = k.const_data_ptr<T>();
  rows.v = v.const_data_ptr<T>(), rows.bias = data_or_null<T>(bias);
  rows.keep = data_or_null<bool>(keep), rows.n = n, rows.is_causal = is_causal;
  rows.scale = T(scale), rows.kept_scale = T(dropout_p > 0 ? 1.0 / (1.0 - dropout_p) : 1.0);
  return rows;
}

}  // namespace

std::vector<int64_t> scores_shape(const at::Tensor& q, const at::Tensor& k) {
  std::vector<int64_t> sizes(q.sizes().begin(), q.sizes().end() - 1);
  sizes.push_back(k.size(-2));
  return sizes;
}

bool attention_rows_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bias) {
  const auto dtype = q.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) return false;
  if (k.scalar_type() != dtype || v.scalar_type() != dtype) return false;
  if (q.dim() < 2 || k.dim() != q.dim() || v.dim() != q.dim()) return false;
  const auto batch = q.sizes().slice(0, q.dim() - 2);
  if (k.sizes().slice(0, k.dim() - 2) != batch || v.sizes().slice(0, v.dim() - 2) != batch)
    return false;
  if (k.size(-1) != q.size(-1) || v.size(-2) != k.size(-2)) return false;
  return !bias.defined() ||
         (bias.scalar_type() == dtype && at::is_expandable_to(bias.sizes(), scores_shape(q, k)));
}

std::pair<at::Tensor, at::Tensor> attention_rows_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& bias, const at::Tensor& keep, double dropout_p, bool is_causal,
    double scale) {
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const Shape n = shape_of(q, k, v);
  const std::vector<int64_t> sizes = scores_shape(q, k);
  const at::Tensor b = full_bias(bias, sizes), kept = keep.defined() ? keep.contiguous() : keep;
  std::vector<int64_t> out_sizes(q.sizes().begin(), q.sizes().end() - 1);
  out_sizes.push_back(n.values);
  at::Tensor out = at::empty(out_sizes, q.options());
  at::Tensor lse = at::empty(at::IntArrayRef(sizes).slice(0, sizes.size() - 1), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention rows", [&] {
    using T = scalar_t;
    Rows<T> rows = inputs_of<T>(q, k, v, b, kept, n, dropout_p, is_causal, scale);
    rows.out = out.mutable_data_ptr<T>(), rows.lse = lse.mutable_data_ptr<T>();
    run_rows(rows, /*backward=*/false);
  });
  return {out, lse};
}

AttentionRowGrads attention_rows_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& bias, const at::Tensor& logsumexp,
    const at::Tensor& keep, double dropout_p, bool is_causal, double scale, bool want_scores) {
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const at::Tensor d_out = grad_out.contiguous(), lse = logsumexp.to(q.scalar_type()).contiguous();
  const Shape n = shape_of(q, k, v);
  const std::vector<int64_t> sizes = scores_shape(q, k);
  const at::Tensor b = full_bias(bias, sizes), kept = keep.defined() ? keep.contiguous() : keep;
  AttentionRowGrads grads{at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()),
                          at::empty(v.sizes(), v.options()),
                          want_scores ? at::zeros(sizes, q.options()) : at::Tensor()};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention rows backward", [&] {
    using T = scalar_t;
    Rows<T> rows = inputs_of<T>(q, k, v, b, kept, n, dropout_p, is_causal, scale);
    rows.d_out = d_out.const_data_ptr<T>(), rows.lse_in = lse.const_data_ptr<T>();
    rows.dq = grads.q.mutable_data_ptr<T>(), rows.dk = grads.k.mutable_data_ptr<T>();
    rows.dv = grads.v.mutable_data_ptr<T>();
    rows.d_scores = want_scores ? grads.scores.mutable_data_ptr<T>() : nullptr;
    run_rows(rows, /*backward=*/true);
  });
  return grads;
}

}  // namespace acme

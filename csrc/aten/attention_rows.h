//@ ch23
// Attention a query row at a time (attention_rows.cpp, chapter 23): the
// arithmetic of attention.cpp's composite in one pass per row, on CPU tensors
// (device views), in float or double.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace acme {

// The scores' shape (and the dropout mask's): q's batch dimensions, the
// queries, the keys.
std::vector<int64_t> scores_shape(const at::Tensor& q, const at::Tensor& k);

// Whether the row kernels take these inputs (as compute() leaves them): q, k
// and v of one floating dtype, float or double, with the same leading
// (batch) dimensions, and a bias of that dtype that broadcasts to the scores.
// Others keep the composite.
bool attention_rows_apply(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bias);

// The output and each row's log-sum-exp. keep is the dropout mask over the
// scores' shape (bool), undefined without dropout.
std::pair<at::Tensor, at::Tensor> attention_rows_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
    const at::Tensor& keep, double dropout_p, bool is_causal, double scale);

// Gradients of q, k and v, and of the scores (what the bias gets, summed to
// its shape by the caller) when want_scores. lse is the forward's.
struct AttentionRowGrads {
  at::Tensor q, k, v, scores;
};
AttentionRowGrads attention_rows_backward(
    const at::Tensor& d_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& bias, const at::Tensor& lse, const at::Tensor& keep, double dropout_p,
    bool is_causal, double scale, bool want_scores);

}  // namespace acme

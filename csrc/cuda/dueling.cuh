// The dueling aggregation and its backward: the one home of this arithmetic on the device.
//
// head_bias_dueling_kernel (dueling_forward.cu), dueling_backward_kernel (mixed_backward.cu)
// and the fused loss (loss/rows.cuh: branch_rows, q_at, branch_q, QuantileRows,
// write_head_grad_column, write_value_grad) all compute through these functions, so the fused path's q and
// d(head logits) are the same bits as the public ops' by construction.
//
// Branch d with n actions, at one atom:
//   forward:  a_k = logit_k + bias_k (biased_logit; the value v likewise),
//             mean = (sum over k, in order from 0.f, of a_k) / n (branch_mean),
//             q_k = (v + a_k) - mean (dueling_q);
//   backward: from dq_k = d(loss)/d(q_k) and g, a direct gradient of the head logits (0 when none):
//             sum = sum over k, in order from 0.f, of dq_k;  da_k = (dq_k - sum / n) + g_k
//             (dueling_advantage_grad);  dv = g_v + the branches' sums, in branch order.
// An ensemble (E members): each member's branches with its own value head v_e, dv_e over its
// own branches (BranchTable's entries, member-major).
// The parenthesisation is part of the contract: float addition is not associative.
//
// Without a value head (NetLayout::dueling false, BranchTable::dueling 0) nothing is
// aggregated: q_k = a_k (biased_logit alone) and da_k = dueling_advantage_grad(dq_k, 0, g_k) =
// (dq_k - 0) + g_k, with g_k = 0 where there is no direct gradient (so a -0 becomes +0, on every
// path alike). Entry k's head
// logits and bias start at column atoms * (value heads + action_offset[k]) of the compact head
// (NetLayout::branch_head(e, d).out_col), its padded logits at BranchTable::pad_col[k].
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "branch_table.cuh"
#include "layout.h"

namespace dqn_ops {
namespace cuda {

__device__ __forceinline__ float biased_logit(float logit, float bias) { return logit + bias; }

__device__ __forceinline__ float branch_mean(float sum, int actions) { return sum / actions; }

__device__ __forceinline__ float dueling_q(float v, float advantage, float mean) { return (v + advantage) - mean; }

__device__ __forceinline__ float dueling_advantage_grad(float dq, float dq_mean, float direct) {
  return (dq - dq_mean) + direct;
}

// The padding columns [width, round_up_to_align(width)) of one output head in a row of a BF16
// head gradient in the padded layout (head: the row's column pad_col), set to 0 so that the
// bf16 backward's GEMMs on padded sizes add nothing: columns width + first, + step, ... by the
// calling thread.
__device__ __forceinline__ void zero_head_padding(__nv_bfloat16* head, int64_t width, int first, int step) {
  for (int64_t i = width + first; i < round_up_to_align(width); i += step) head[i] = __float2bfloat16_rn(0.f);
}

// The public ops' dueling kernels, for the loss's composed path (_dqn_loss_on_logits on a
// configuration the fused kernel does not take). Each launches one kernel on `stream`.

// Whether the dueling kernels give each head its own blocks (a grid column per branch entry,
// and the backward's per value head too) for a launch whose rows make `row_blocks` blocks: when
// those are fewer than the SMs (a small batch of wide rows, or IQN's rows of one atom at
// B = 256), the heads' columns fill the GPU; with more rows, a thread walking a row's heads in
// turn reads each value once and launches fewer blocks, which measured faster (bench/NOTES.md,
// the dueling kernels' A/B). DQN_OPS_HEAD_COLUMNS=split|whole forces one shape. Defined in
// dueling_forward.cu.
bool split_heads(unsigned row_blocks);

// From the output layer's GEMM results in the padded layout (logits [rows, head_ld], no bias):
// head = logits + b_out, compact [rows, head_out] (head may be null: only q is written), and q
// [rows, total_actions, atoms] = the dueling aggregate, or without dueling (branches.dueling ==
// 0) the branch heads' biased logits.
// slots > 1 (IQN, one atom): the rows are (sample, fraction) pairs, row b * slots + i, and q is
// [rows / slots, total_actions, slots], fraction i in slot i. Defined in dueling_forward.cu.
void launch_head_bias_dueling(const float* logits, const float* b_out, float* head, float* q, int64_t rows,
                              const NetLayout& L, const BranchTable& branches, cudaStream_t stream,
                              int64_t slots = 1);

// d_head = grad_head + d(dueling aggregate)/d(head) . grad_q (without dueling: grad_q + grad_head,
// no value column), compact [rows, head_out] F32, and its BF16 copy in the padded layout
// [rows, head_ld], padding 0 (d_head_bf16 may be null; grad_q or grad_head may be null, not
// both). slots: as launch_head_bias_dueling's (grad_q then [rows / slots, total_actions, slots]).
// Defined in mixed_backward.cu.
void launch_dueling_backward(const float* grad_q, const float* grad_head, float* d_head, __nv_bfloat16* d_head_bf16,
                             int64_t rows, const NetLayout& L, const BranchTable& branches, cudaStream_t stream,
                             int64_t slots = 1);

}  // namespace cuda
}  // namespace dqn_ops

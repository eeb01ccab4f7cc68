// The loss kernels' launch constants and parameter block (loss.cu's parts: see loss.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

#include "fused_loss_limits.h"
#include "loss_args.h"

namespace dqn_ops {
namespace cuda {
// Internal linkage, as when these parts were one file: each header is included by loss.cu
// alone, and the compiler sees every call site of every device function.
namespace {

// Warps per block: a sample's (member, branch) entries take min(entries, kMaxWarps) warps of
// it, warp k entries k, k + kMaxWarps, ... (C51 and QR).
constexpr int kMaxWarps = 8;
// C51 with at most this many atoms runs the register version (c51_branch_small: a lane owns
// atoms `lane + 32 e`, 2 or 4 of them), the only one the fused loss has.
constexpr int kDuelingMaxAtoms = kFusedLossMaxAtoms;
constexpr int kTwoSlotMaxAtoms = 64;  // up to this many a lane owns 2 atoms (the 64-atom instantiation)
constexpr int kQChunk = 4;        // actions whose expected Q reduce together
constexpr int kStageUnroll = 12;  // loads in flight per lane while staging

// What the kernel's rows are, fixed per instantiation (a template argument, so each version
// compiles to its own work):
//   kQ: dqn_loss's q [batch, total_actions, atoms], the gradient to grad_q;
//   kHeadDueling, kHeadPlain: the fused loss (_dqn_loss_on_logits; C51's register version or
//     QR's): the output layer's raw GEMM rows plus each network's output bias, q formed as the
//     rows are read (kHeadDueling: the network has a value head per member and q is the dueling
//     aggregate; kHeadPlain: it has none and q is the biased branch logits), the gradient to
//     grad_head / grad_head_bf16. Entry d's logits and bias start at head_col_of(br, d,
//     value_heads_of(br) = LossParams::value_heads, atoms) of the compact head
//     (NetLayout::branch_head(e, d).out_col).
enum class LossRows { kQ, kHeadDueling, kHeadPlain };

constexpr bool reads_head(LossRows rows) { return rows != LossRows::kQ; }

struct LossParams {
  const float* q;
  const float* q_next_online;
  const float* q_next_target;
  const int64_t* actions;
  const float* rewards;
  const float* dones;
  const float* weights;  // nullptr: all 1
  const float* masks;    // [batch, E] bootstrap masks of an ensemble's members (BranchTable); nullptr: all 1
  const float* fractions;  // IQN: [batch, atoms] q's fractions, each sample's own; nullptr: QR's midpoints
  float* grad_q;
  float* td_error;
  float* loss;
  float* mean_q;
  float* partials;    // [2, gridDim.x]
  unsigned* counter;  // blocks finished: 0 at launch, and again after it (the last block resets it)
  int batch, total_actions, atoms;
  int next_atoms, target_atoms;  // q_next_online's and q_next_target's slots (IQN's K and N'; else atoms)
  int warps_per_sample, samples_per_block;
  int max_actions;  // the largest branch: sizes the staging area
  bool staged;      // general version: the rows are copied to shared memory first
  int work_floats;  // C51 / QR: shared memory per warp
  int sum_floats;   // the fused loss: a (sample, entry) row of the round buffers after the work areas (dqn_loss_kernel)
  int value_heads;  // the fused loss: value_heads_of(br), formed on the host (a division per use costs registers)
  float v_min, v_max, dz, gamma;
  LossType type;
  // The fused loss (reads_head): q, q_next_online and q_next_target are the output layer's
  // raw GEMM rows [batch, head_ld] (padded layout, no bias); the biases are b_online / b_target
  // (each network's b_out); the gradient goes to grad_head (F32 [batch, head_out]) and
  // grad_head_bf16 (padded [batch, head_ld]) instead of grad_q.
  const float* b_online;
  const float* b_target;
  float* grad_head;
  __nv_bfloat16* grad_head_bf16;
  int64_t head_ld, head_out;
};

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

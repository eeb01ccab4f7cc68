// The configurations the fused loss kernel (_dqn_loss_on_logits's single-launch CUDA path)
// takes; outside them the op composes the public ops' kernels instead (csrc/cuda/loss.cu).
// One home for the numbers: the CUDA kernels size themselves by them, and dqn_ops._C exports
// them (FUSED_LOSS_MAX_ATOMS, FUSED_LOSS_MAX_BRANCHES, csrc/dqn_ops.cpp) for the Python side.
#pragma once

namespace dqn_ops {

// C51: a lane holds atoms `lane` and `lane + 32` of a row in registers, and up to this many
// also `lane + 64` and `lane + 96`. (QR's fused loss takes every quantile count the CUDA loss
// does: a lane owns quantiles `lane`, `lane + 32`, ... through shared memory.)
constexpr int kFusedLossMaxAtoms = 128;
// Branches over all ensemble members (E * D table entries): a warp per entry, all of a
// sample's in one block, and each entry's row of per-atom sums kept in that block's shared
// memory until every member's value column is summed from them (two rounds' worth: 64 KiB at
// this many entries and 256 quantiles). The same limit holds without dueling, so that whether
// the fused kernel runs depends on the loss, the atoms and the entry count alone
// (dqn_ops.step.fused_loss_supported).
constexpr int kFusedLossMaxBranches = 32;

}  // namespace dqn_ops

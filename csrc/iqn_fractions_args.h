// iqn_fractions: the argument checks both backends share and the one formula of a fraction
// (csrc/philox.h's stream kIqnFractions), so the CPU and CUDA kernels make the same bits.
//
// IQN (Dabney et al. 2018) trains at quantile fractions drawn anew for every sample and step:
// tau [B, N] for the online network on s, tau' [B, N'] for the target network on s'
// (docs/iqn-design.md, "Fractions in the trainer"). Drawn from a device counter that the op
// advances, the step stays capturable in a CUDA graph and each replay draws new fractions.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "philox.h"

namespace dqn_ops {

constexpr const char* kIqnFractionsOp = "dqn_ops.iqn_fractions";

// tau'[b, j] draws at slot kIqnTargetSlot + j: the two sets never share a slot, and tau' stays
// the same whatever N is. Each set has fewer than 2^17 fractions, so every slot is below
// philox::draw's 2^18 (slot / 4 fills the 16 bits beside the stream).
constexpr uint32_t kIqnTargetSlot = uint32_t(1) << 17;
constexpr int64_t kIqnMaxFractions = int64_t(kIqnTargetSlot) - 1;

// philox::draw's row is a 32-bit word: rows row_offset .. row_offset + batch - 1 must fit in it
// (a larger row would wrap onto another row's numbers).
constexpr int64_t kIqnMaxRows = int64_t(1) << 32;

// rng: int64 [2] (seed, call), contiguous; batch >= 1; 1 <= n, n_target <= kIqnMaxFractions;
// row_offset >= 0 with row_offset + batch <= 2^32. The outputs go on rng's device.
inline void check_iqn_fractions_args(const at::Tensor& rng, int64_t batch, int64_t n, int64_t n_target,
                                     int64_t row_offset) {
  const char* op = kIqnFractionsOp;
  check_tensor(rng, op, "rng", rng.device(), at::kLong, {2});
  DQN_CHECK(batch >= 1, op, ": batch: expected at least 1 row, got ", batch);
  DQN_CHECK(n >= 1 && n <= kIqnMaxFractions, op, ": n: expected 1 <= n <= ", kIqnMaxFractions,
            " (the fractions of a row draw at philox slots below 2^17), got ", n);
  DQN_CHECK(n_target >= 1 && n_target <= kIqnMaxFractions, op, ": n_target: expected 1 <= n_target <= ",
            kIqnMaxFractions, " (the target fractions of a row draw at philox slots 2^17 + j, below 2^18), got ",
            n_target);
  DQN_CHECK(row_offset >= 0 && row_offset < kIqnMaxRows, op, ": row_offset: expected 0 <= row_offset < ",
            kIqnMaxRows, " (philox's row is 32 bits), got ", row_offset);
  DQN_CHECK(batch <= kIqnMaxRows - row_offset, op, ": batch: rows row_offset .. row_offset + batch - 1 must be below ",
            kIqnMaxRows, " (philox's row is 32 bits), got row_offset ", row_offset, " and batch ", batch);
}

// The fraction at (seed, call, row, slot): the draw's top 24 bits as a float in [0, 1 - 2^-24].
// tau[b, i] is slot i of row row_offset + b, tau'[b, j] slot kIqnTargetSlot + j.
DQN_OPS_HD float iqn_fraction(uint64_t seed, uint64_t call, uint32_t row, uint32_t slot) {
  return philox::uniform(philox::draw(philox::Stream::kIqnFractions, seed, call, row, slot));
}

}  // namespace dqn_ops

// bootstrap_masks: the argument checks both backends share and the one formula of a mask
// element (csrc/philox.h's stream kBootstrap), so the CPU and CUDA kernels make the same bits.
//
// Bootstrapped DQN (Osband et al. 2016) gives each transition one mask per ensemble member for
// its whole life in the replay. The mask is a pure function of (seed, replay index, member): no
// RNG state, nothing stored beside the transition, and the training step that draws it stays
// capturable in a CUDA graph.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "checks.h"
#include "philox.h"

namespace dqn_ops {

constexpr const char* kBootstrapMasksOp = "dqn_ops.bootstrap_masks";

// philox::draw's row (the member here) is a 32-bit word: more members would repeat another's draws.
constexpr int64_t kBootstrapMaxMembers = int64_t(1) << 32;

// indices: int64 [B] (any strides, B >= 0); members >= 1; 0 < p <= 1.
inline void check_bootstrap_masks_args(const at::Tensor& indices, int64_t members, double p) {
  const char* op = kBootstrapMasksOp;
  check_dtype(indices, op, "indices", at::kLong);
  DQN_CHECK(indices.dim() == 1, op, ": indices: expected a 1-D tensor [B] (the replay rows of the batch), got shape ",
            shape_str(indices.sizes()));
  DQN_CHECK(members >= 1 && members <= kBootstrapMaxMembers, op, ": members: expected 1 <= members <= ",
            kBootstrapMaxMembers, " (philox's row is 32 bits), got ", members);
  DQN_CHECK(p > 0 && p <= 1, op, ": p: expected 0 < p <= 1 (the probability that a member learns from a ",
            "transition), got ", std::to_string(p));
}

// The mask of member `member` for the transition at replay row `index`: 1 with probability p
// (the draw's top 24 bits as u in [0, 1), compared in double: 1 iff u < p, so p = 1 gives 1).
DQN_OPS_HD float bootstrap_mask(uint64_t seed, uint64_t index, uint32_t member, double p) {
  const float u = philox::uniform(philox::draw(philox::Stream::kBootstrap, seed, index, member, 0));
  return static_cast<double>(u) < p ? 1.0f : 0.0f;
}

}  // namespace dqn_ops

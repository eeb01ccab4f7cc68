// QR-DQN's expected Q on the device: the one home of this arithmetic, so that act's greedy
// action (act.cu) and the loss's double-DQN choice (loss/quantile.cuh) see the same value of
// an action, bit for bit, for the same quantiles.
//
// An action's expected Q is the mean of its N quantiles. A warp computes it: lane l sums the
// quantiles l, l + 32, ... in that order from 0.f, the warp adds the lanes' sums in
// warp_sum's butterfly order, and the total is divided by N. F32 throughout, so it may differ
// from the CPU reference (double precision) in the last bits, and a near-tie of two actions
// may break differently there.
#pragma once

#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {

// lane_sum: this lane's quantiles summed in order; every lane gets the mean.
__device__ __forceinline__ float quantile_mean(float lane_sum, int quantiles) {
  return warp_sum(lane_sum) / quantiles;
}

}  // namespace cuda
}  // namespace dqn_ops

// QR-DQN's arithmetic on the CPU, shared by the loss (csrc/loss_cpu.cpp) and act
// (csrc/act_cpu.cpp), so that the double-DQN choice and the greedy action read the quantiles alike.
#pragma once

#include <cstdint>

namespace dqn_ops {

// The quantile fraction of output i of n: the midpoint (2i + 1) / 2n of the i-th of n equal
// probability bins (QR-DQN's tau-hat).
inline double quantile_fraction(int64_t i, int64_t n) { return (2.0 * double(i) + 1.0) / (2.0 * double(n)); }

// The expected value of a quantile head's n outputs x[0..n): their mean, summed in order in double.
template <typename scalar_t>
double quantile_mean(const scalar_t* x, int64_t n) {
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += double(x[j]);
  return s / double(n);
}

}  // namespace dqn_ops

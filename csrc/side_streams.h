// The side-streams switch: whether the CUDA ops (csrc/cuda/side_stream.h) and the Python steps
// (dqn_ops/side_stream.py) run work that nothing after it on the current stream reads on side
// streams beside it, so that independent kernels of a small batch's step share the GPU instead
// of waiting for each other. The results are the same bits either way (the same kernels and
// cuBLAS calls, on other streams). On by default (the step is faster with them, bench/NOTES.md).
// Set by
//   - the environment variable DQN_OPS_SIDE_STREAM=0|1 (unset: 1), read once, at the first call of
//     side_streams_enabled(); any other value raises there;
//   - dqn_ops._C._set_side_streams(bool) (dqn_ops.side_stream.set_enabled), which returns the
//     previous setting.
// A process-wide setting read with one atomic load per call. A CUDA graph keeps the streams in
// force when it was captured. The CPU kernels ignore it. Defined in side_streams.cpp (built
// with or without CUDA).
#pragma once

namespace dqn_ops {

bool side_streams_enabled();
// Returns the previous setting.
bool set_side_streams(bool on);

}  // namespace dqn_ops

// The device-side call counter of an rng tensor (int64 [2] = seed, call; csrc/philox.h): the ops
// that draw from it (act, epsilon_greedy, iqn_fractions) advance it by one launch of their own
// after their draws. Every block of a drawing kernel reads rng[1], so no block may advance it
// before all have read it; stream order (and, under PDL, its pdl_enter: pdl.cuh) makes a
// one-thread kernel after the drawing one race-free, with no host sync (capturable in a CUDA
// graph).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "pdl.cuh"

namespace dqn_ops {
namespace cuda {
namespace {  // each .cu its own copy: no kernel symbol shared between translation units

// The next call: rng[1] + 1 as the unsigned counter it is (wrapping, never signed overflow).
__global__ void advance_call_kernel(int64_t* rng) {
  pdl_enter();
  rng[1] = static_cast<int64_t>(static_cast<uint64_t>(rng[1]) + 1u);
}

// Launches advance_call_kernel on `stream`, after whatever drew from rng there.
inline void advance_call(int64_t* rng, cudaStream_t stream) {
  launch(advance_call_kernel, 1, 1, 0, stream, rng);
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

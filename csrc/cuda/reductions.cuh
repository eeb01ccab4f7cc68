// Deterministic block and warp reductions, and the co-residency cap of cooperative launches,
// shared by the kernels of csrc/cuda/.
#pragma once

#include <cstdint>
#include <mutex>
#include <tuple>
#include <map>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

namespace dqn_ops {
namespace cuda {

// Sum over a block of N threads in a fixed tree order; every thread gets the result. smem
// holds at least N values of T (float, or double where a sum must not overflow F32).
template <int N, typename T>
__device__ T block_sum(T v, T* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = N / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
    __syncthreads();
  }
  const T r = smem[0];
  __syncthreads();
  return r;
}

// Butterfly reductions: every lane ends with the same value (each step adds the same pairs in
// every lane), so the result is deterministic and uniform across the warp.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over a block of kWarps warps: each warp's butterfly sum, then the warps' sums in warp
// order; every thread gets the result. scratch: >= kWarps floats. Two barriers, against
// block_sum's log2(N) + 2.
template <int kWarps>
__device__ float block_sum_by_warps(float x, float* scratch) {
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kWarps; ++w) t += scratch[w];
  return t;
}

// How many blocks of `kernel` fit on the current device at once: the grid a cooperative launch
// (grid-wide barriers) may use. Asked once per (device, kernel, threads, shared memory).
template <typename Kernel>
int cooperative_block_cap(Kernel kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  const auto key = std::make_tuple(static_cast<int>(c10::cuda::current_device()),
                                   reinterpret_cast<const void*>(kernel), threads, smem);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int cap = per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  cache.emplace(key, cap);
  return cap;
}

}  // namespace cuda
}  // namespace dqn_ops

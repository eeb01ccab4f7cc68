// The dynamic shared memory a block of a kernel may ask for on the current device.
//
// The device's per-block limit, less the kernel's own static shared memory as the compiler laid
// it out (cudaFuncGetAttributes' sharedSizeBytes). Not the sum of the kernel's __shared__
// objects: the dynamic array's alignment pads past it, and a limit computed from that sum is
// refused (cudaFuncSetAttribute) or lets a launch through that the runtime then refuses.
//   - SmemLimit::kDefault: the limit without an opt-in (cudaDevAttrMaxSharedMemoryPerBlock, 48
//     KiB), and no more than the kernel's maxDynamicSharedSizeBytes.
//   - SmemLimit::kOptIn: the opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), the value
//     to give cudaFuncAttributeMaxDynamicSharedMemorySize (opt_in_dynamic_smem).
// Queried once per (device, kernel, limit), then a cached lookup.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

namespace dqn_ops {
namespace cuda {

enum class SmemLimit { kDefault, kOptIn };

inline size_t dynamic_smem_limit(const void* kernel, SmemLimit which) {
  using Key = std::tuple<int, const void*, SmemLimit>;
  static std::mutex mutex;
  static std::map<Key, size_t> known;
  const int device = static_cast<int>(c10::cuda::current_device());
  const Key key{device, kernel, which};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  int per_block = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_block,
                                        which == SmemLimit::kOptIn ? cudaDevAttrMaxSharedMemoryPerBlockOptin
                                                                   : cudaDevAttrMaxSharedMemoryPerBlock,
                                        device));
  size_t limit = size_t(per_block) > attr.sharedSizeBytes ? size_t(per_block) - attr.sharedSizeBytes : 0;
  if (which == SmemLimit::kDefault) limit = std::min(limit, size_t(std::max(attr.maxDynamicSharedSizeBytes, 0)));
  known.emplace(key, limit);
  return limit;
}

// The same for a kernel of any signature.
template <typename... Args>
size_t dynamic_smem_limit(void (*kernel)(Args...), SmemLimit which) {
  return dynamic_smem_limit(reinterpret_cast<const void*>(kernel), which);
}

// Lets `kernel` launch on the current device with up to dynamic_smem_limit(kernel, kOptIn) bytes
// of dynamic shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize), set once per (device,
// kernel).
template <typename... Args>
void opt_in_dynamic_smem(void (*kernel)(Args...)) {
  using Key = std::tuple<int, const void*>;
  static std::mutex mutex;
  static std::set<Key> done;
  const void* k = reinterpret_cast<const void*>(kernel);
  const Key key{static_cast<int>(c10::cuda::current_device()), k};
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count(key)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(dynamic_smem_limit(k, SmemLimit::kOptIn))));
  done.insert(key);
}

}  // namespace cuda
}  // namespace dqn_ops

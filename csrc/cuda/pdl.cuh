// Programmatic dependent launch (PDL, sm_90 and newer) for the kernels of csrc/cuda/.
//
// Why: the training step is one CUDA graph whose kernels form a chain of a few dozen, and a plain
// kernel-to-kernel edge serialises fully: the next kernel is launched only once its predecessor
// has completed and flushed its memory, so every edge pays a gap plus the next kernel's launch and
// ramp. A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// (stream capture records it as a programmatic graph edge) may be scheduled as soon as every block
// of its predecessor has executed griddepcontrol.launch_dependents (or exited), and runs up to its
// own griddepcontrol.wait while the predecessor finishes.
//
// The rule, in every kernel here: at the top of the body, before any global-memory read or write
// (writes too: the predecessor may still be reading what this kernel overwrites), pdl_enter():
// pdl_wait(), then pdl_launch_dependents(). The wait returns once every prerequisite grid has
// completed and its writes are visible, so the trigger's place does not matter for correctness: it
// lets the dependent grid onto free SMs early, where it blocks in its own pdl_wait() until this
// grid has completed. Threads that return early (idle threads, a block that is not the last one) wait
// first too. As every kernel waits before it touches memory, and a grid completes only after all
// of its threads, completion is transitive along the chain: a kernel past its wait sees the writes
// of every kernel before it, not only of its direct predecessor. Device helpers need no wait of
// their own: the kernels that call them have waited.
//
// Both are no-ops in a kernel launched without the attribute (a plain launch, the cooperative
// launch of spectral_norm.cu, a device before sm_90), and compile to nothing below
// __CUDA_ARCH__ 900 (the extension also builds for sm_80 and sm_86/89).
//
// launch() and launch_ex() (a cudaLaunchConfig_t with attributes of its own, e.g. a cluster
// dimension) add the attribute only where all of these hold, and otherwise launch plainly
// (stream-ordered, as <<<...>>> does):
//   - the environment variable DQN_OPS_PDL is not "0" (read once per process: the A/B switch,
//     no rebuild; a CUDA graph keeps the edges it was captured with; a value other than 0 or 1
//     raises at the first launch);
//   - the current device is sm_90 or newer (compute capability major >= 9);
//   - the kernel's image for the device was compiled from compute_90 or newer PTX
//     (cudaFuncGetAttributes' ptxVersion): an image JIT-compiled from older PTX has its
//     pdl_wait() compiled out, and launching it with the attribute would race.
// Both check the launch with C10_CUDA_CHECK (in place of C10_CUDA_KERNEL_LAUNCH_CHECK).
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "../switches.h"

namespace dqn_ops {
namespace cuda {

// Blocks until the grids this one depends on programmatically have completed and their memory
// operations are visible; returns at once without such a dependency.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the grids that depend on this one programmatically be scheduled once every block of this
// grid has called it or exited (at the latest, at this grid's completion).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The top of every kernel's body (the rule above): wait for the predecessors, then let the
// dependents be scheduled.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}

namespace pdl {

// False under DQN_OPS_PDL=0 (switches.h: 0 or 1, unset 1). Read once per process.
inline bool enabled() {
  static const bool on = env_flag("DQN_OPS_PDL", true);
  return on;
}

// Whether `kernel` may take the attribute on the current device (see the top of this file).
// Found once per (device, kernel), then a cached lookup.
inline bool allowed(const void* kernel) {
  if (!enabled()) return false;
  const int device = static_cast<int>(c10::cuda::current_device());
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, kernel);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  bool ok = at::cuda::getDeviceProperties(device)->major >= 9;
  if (ok) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess) {
      ok = attr.ptxVersion >= 90;
    } else {
      (void)cudaGetLastError();  // no image for this device: the launch itself reports it
      ok = false;
    }
  }
  known.emplace(key, ok);
  return ok;
}

// The most attributes a caller's configuration may bring to launch_ex.
constexpr unsigned kMaxCallerAttributes = 4;

}  // namespace pdl

// Launches `kernel` with `config` (grid, block, shared memory, stream and the caller's
// attributes, config.attrs / numAttrs) plus the PDL attribute where pdl::allowed. The arguments
// convert to the kernel's parameter types as with <<<...>>> (cudaLaunchKernelEx's template).
template <typename... KArgs, typename... Args>
void launch_ex(cudaLaunchConfig_t config, void (*kernel)(KArgs...), Args&&... args) {
  TORCH_INTERNAL_ASSERT(config.numAttrs <= pdl::kMaxCallerAttributes, "launch_ex: at most ",
                        pdl::kMaxCallerAttributes, " caller attributes");
  cudaLaunchAttribute attrs[pdl::kMaxCallerAttributes + 1];
  for (unsigned i = 0; i < config.numAttrs; ++i) attrs[i] = config.attrs[i];
  if (pdl::allowed(reinterpret_cast<const void*>(kernel))) {
    cudaLaunchAttribute& a = attrs[config.numAttrs++];
    a = cudaLaunchAttribute{};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attrs;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute where pdl::allowed.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  launch_ex(config, kernel, std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace dqn_ops

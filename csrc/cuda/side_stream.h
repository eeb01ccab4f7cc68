// Work that nothing after it on the current stream reads, run beside the current stream.
//
// At small batches each cuBLAS GEMM of the step fills a few of the GPU's SMs for a few
// microseconds, and a stream runs them one after the other even where one does not read the
// other's output (the backward's dW GEMMs and its dX chain; the target network's output layer
// and the online network's). A SideStream forks such work onto a stream of its own and joins it
// back: fork() records an event on the current stream that the side stream waits for, join()
// the reverse; inside a CUDA-graph capture both become edges of the graph, so a replay runs the
// branches side by side. The same kernels and cuBLAS calls run either way (cuBLAS gets a
// workspace per stream from torch), so the results are the same bits; with the switch off
// (csrc/side_streams.h) or on a device that is not CUDA, run() runs its work on the current
// stream in place and fork() / join() do nothing.
//
// The side streams are the extension's own, one per (device, current stream, lane, host thread),
// created at first use and kept for the process (with the cuBLAS workspace torch gives each
// stream a GEMM runs on): never one of torch's pool streams, which a caller could be using as its
// current stream (a tensor allocated in a branch is freed into its side stream's pool, reused
// only after a later fork of the lane; dqn_ops/side_stream.py).
// Lane 0 is the ops'; the Python steps take lanes >= 1, so an op inside a Python branch forks
// onto yet another stream (its current stream is the branch's).
//
// Usage, with the work's inputs final on the current stream and its outputs allocated there
// beforehand (an allocation inside run() belongs to the side stream):
//   SideStream side(device);
//   side.fork();
//   side.run([&] { /* kernels, cuBLAS */ });
//   ...                    // the chain goes on, on the current stream
//   side.join();           // before anything reads what run() wrote; the destructor joins too
#pragma once

#include <cstdint>

#include <c10/core/Device.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "../side_streams.h"

namespace dqn_ops {
namespace cuda {

// A side stream with the events of its fork and join (recorded again at each: a wait takes the
// event's state when it is enqueued).
struct SideStreamSlot {
  cudaStream_t stream;
  cudaEvent_t fork, join;
};

// The side stream of (device, `current`, lane >= 0, the calling host thread), created at its
// first use (outside any capture's restrictions). Defined in side_stream.cu.
SideStreamSlot side_stream_slot(c10::DeviceIndex device, cudaStream_t current, int lane);

class SideStream {
 public:
  // The side stream of `device`'s current stream in `lane`; inactive when the switch is off.
  explicit SideStream(c10::Device device, int lane = 0);
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  // Joins a branch still open (an exception between fork and join): what the branch reads may be
  // freed once the current stream goes on.
  ~SideStream();

  bool active() const { return active_; }
  // The side stream waits for everything enqueued on the current stream so far.
  void fork();
  // `work` with the side stream current (after a fork), or in place when inactive.
  template <class F>
  void run(F&& work) {
    if (!active_) {
      work();
      return;
    }
    TORCH_INTERNAL_ASSERT(open_, "SideStream::run without a fork: the work would not wait for its inputs");
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(slot_.stream, device_));
    work();
  }
  // The current stream waits for everything enqueued on the side stream so far.
  void join();

 private:
  bool active_ = false, open_ = false;
  c10::DeviceIndex device_ = 0;
  cudaStream_t current_ = nullptr;
  SideStreamSlot slot_{};
};

}  // namespace cuda
}  // namespace dqn_ops

// The side streams' registry and SideStream (side_stream.h).
#include "side_stream.h"

#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

namespace dqn_ops {
namespace cuda {

SideStreamSlot side_stream_slot(c10::DeviceIndex device, cudaStream_t current, int lane) {
  TORCH_INTERNAL_ASSERT(lane >= 0, "side_stream_slot: lane ", lane);
  using Key = std::tuple<c10::DeviceIndex, cudaStream_t, int, std::thread::id>;
  static std::mutex mutex;
  static std::map<Key, SideStreamSlot> slots;
  const Key key{device, current, lane, std::this_thread::get_id()};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = slots.find(key);
  if (it != slots.end()) return it->second;
  // Creating a stream or an event enqueues nothing, but a capture in global mode would refuse
  // the calls all the same: the first use may come inside a capture.
  const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
  const c10::cuda::CUDAGuard guard(device);
  SideStreamSlot slot{};
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&slot.stream, cudaStreamNonBlocking));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&slot.fork, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&slot.join, cudaEventDisableTiming));
  slots.emplace(key, slot);
  return slot;
}

SideStream::SideStream(c10::Device device, int lane) {
  if (!device.is_cuda() || !side_streams_enabled()) return;
  active_ = true;
  device_ = device.index() >= 0 ? device.index() : c10::cuda::current_device();
  current_ = c10::cuda::getCurrentCUDAStream(device_).stream();
  slot_ = side_stream_slot(device_, current_, lane);
}

SideStream::~SideStream() {
  if (!open_) return;
  // No throw from a destructor: the error is cleared and the join skipped (CUDA is failing
  // already; the next checked call reports a sticky error).
  if (cudaEventRecord(slot_.join, slot_.stream) != cudaSuccess ||
      cudaStreamWaitEvent(current_, slot_.join, 0) != cudaSuccess)
    (void)cudaGetLastError();
}

void SideStream::fork() {
  if (!active_) return;
  C10_CUDA_CHECK(cudaEventRecord(slot_.fork, current_));
  C10_CUDA_CHECK(cudaStreamWaitEvent(slot_.stream, slot_.fork, 0));
  open_ = true;
}

void SideStream::join() {
  if (!open_) return;
  open_ = false;
  C10_CUDA_CHECK(cudaEventRecord(slot_.join, slot_.stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(current_, slot_.join, 0));
}

}  // namespace cuda
}  // namespace dqn_ops

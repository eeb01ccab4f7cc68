// The replay ops on CUDA (csrc/replay_args.h describes the state; csrc/replay_cpu.cpp is the
// reference). Launches per call: add 1, add_steps 2, sample 1, update_priorities 1.
//
// A kernel that must finish every row before a step over all of them (the tree's inner nodes
// above the new rows, the cursor, the RNG's call counter, the n-step scan) ends with "last block
// done": every block fences its writes and takes a ticket from a device counter; the block
// with the last ticket does that step and sets the counter back to zero. Which block comes
// last varies; what it computes does not (integer scans, node sums in a fixed order).
//
// Work per call at C = 10M rows (5 inner levels), SD = 96:
//   sample, B draws: a warp per draw descends 6 levels reading 32 children each (one 256-byte
//     row of F64 sums, the last 128 bytes of F32 leaves: ~1.4 KB a draw, 0.36 MB at B = 256,
//     5.8 MB at B = 4096; the lanes read the same addresses, one request a level), then gathers
//     the row (~0.8 KB). Latency-bound: 6 dependent reads, then the copy.
//   update_priorities, K indices: one block (leaves, then each touched node per level, a node
//     recomputed once per level where the level is small enough for a shared-memory bitmap).
//     K <= 4096 updates touch at most K nodes a level: < 6 * 4096 * 32 reads of L2.
//   add / add_steps: the copy (memory-bound), then the nodes above the new rows, level by level
//     in the last block (N new rows touch ~N / 32 + N / 1024 + ... + 6 nodes).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "pdl.cuh"
#include "replay_args.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUpdateThreads = 1024;
constexpr int kDedupBits = 32768;  // levels of at most this many nodes recompute each touched node once

// One row of the ring <- one source row, by the lanes of a warp.
__device__ __forceinline__ void copy_floats(float* __restrict__ dst, const float* __restrict__ src, int64_t n,
                                            int lane) {
  for (int64_t k = lane; k < n; k += 32) dst[k] = src[k];
}
__device__ __forceinline__ void copy_longs(int64_t* __restrict__ dst, const int64_t* __restrict__ src, int64_t n,
                                           int lane) {
  for (int64_t k = lane; k < n; k += 32) dst[k] = src[k];
}

__device__ __forceinline__ int64_t load_fresh_long(const int64_t* p) {
  return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(p)));
}

// True in every thread of the block that finishes last; the counter is then the caller's to reset.
__device__ bool last_block_done(int* counter) {
  __shared__ bool is_last;
  __threadfence();  // this thread's writes, visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

// The nodes above leaves [a, a + n) of the ring (wrapping at C), level by level, by one block.
__device__ void rebuild_range_block(const TreeRefs& t, int64_t a, int64_t n) {
  const int64_t C = t.layout.count[0];
  const int64_t a_end = a + n < C ? a + n : C, b_end = a + n > C ? a + n - C : 0;
  for (int l = 1; l <= t.layout.levels; ++l) {
    const int shift = kTreeFanLog * l;
    const int64_t lo_a = a >> shift, hi_a = (a_end - 1) >> shift;
    int64_t hi_b = b_end > 0 ? (b_end - 1) >> shift : -1;
    if (hi_b >= lo_a) hi_b = lo_a - 1;  // the wrapped part's nodes, those range a does not cover
    for (int64_t node = lo_a + threadIdx.x; node <= hi_a; node += blockDim.x) recompute_node(t, l, node);
    for (int64_t node = threadIdx.x; node <= hi_b; node += blockDim.x) recompute_node(t, l, node);
    __syncthreads();
  }
}

__device__ void advance_cursor(int64_t* cursor, int64_t w, int64_t n, int64_t C) {
  cursor[0] = (w + n) % C;
  const int64_t size = cursor[1] + n;
  cursor[1] = size < C ? size : C;
}

__device__ __forceinline__ int64_t wrapped_cursor(const int64_t* cursor, int64_t C) {
  return ((cursor[0] % C) + C) % C;  // a foreign cursor wraps, never writes out of bounds
}

unsigned grid_for(int64_t items, int per_block) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, 16 * sms)));
}

// ---------------------------------------------------------------------------------------
// _replay_add

struct Rows {
  const float* states;
  const int64_t* actions;
  const float* rewards;
  const float* next_states;
  const float* dones;
  int64_t n;
};

__global__ void __launch_bounds__(kThreads) add_kernel(Storage s, TreeRefs t, bool prioritized,
                                                       int64_t* __restrict__ cursor, int* __restrict__ counter,
                                                       Rows rows) {
  pdl_enter();
  const int lane = threadIdx.x % 32;
  const int64_t w = wrapped_cursor(cursor, s.C);
  for (int64_t k = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; k < rows.n; k += int64_t(gridDim.x) * kWarps) {
    const int64_t r = (w + k) % s.C;
    copy_floats(s.states + r * s.SD, rows.states + k * s.SD, s.SD, lane);
    copy_floats(s.next_states + r * s.SD, rows.next_states + k * s.SD, s.SD, lane);
    copy_longs(s.actions + r * s.D, rows.actions + k * s.D, s.D, lane);
    if (lane == 0) {
      s.rewards[r] = rows.rewards[k];
      s.dones[r] = rows.dones[k];
      if (prioritized) t.leaves[r] = *t.max_priority;
    }
  }
  if (!last_block_done(counter)) return;
  if (prioritized) rebuild_range_block(t, w, rows.n);
  if (threadIdx.x == 0) {
    advance_cursor(cursor, w, rows.n, s.C);
    *counter = 0;
  }
}

void replay_add_cuda(at::TensorList storage, Tensor& cursor, at::TensorList tree, Tensor& counter,
                     at::TensorList rows) {
  const int64_t N = check_replay_add_args(storage, cursor, tree, counter, rows);
  const c10::cuda::CUDAGuard guard(cursor.device());
  const Storage s = storage_refs(storage);
  const bool prioritized = !tree.empty();
  const TreeRefs t = prioritized ? tree_refs(tree, s.C) : TreeRefs{};
  const Rows r{rows[0].data_ptr<float>(), rows[1].data_ptr<int64_t>(), rows[2].data_ptr<float>(),
               rows[3].data_ptr<float>(), rows[4].data_ptr<float>(), N};
  launch(add_kernel, grid_for(N, kWarps), kThreads, 0, at::cuda::getCurrentCUDAStream(), s, t, prioritized,
         cursor.data_ptr<int64_t>(), counter.data_ptr<int>(), r);
}

// ---------------------------------------------------------------------------------------
// _replay_add_steps

struct Window {
  float* obs;       // [E, n, SD]
  int64_t* actions; // [E, n, D]
  float* rewards;   // [E, n]
  int64_t* pos;     // [E, 2]: ring start, pending steps
  int64_t* emit;    // [E + 1]: rows per env, then (scanned) each env's first row and the total
  int64_t E, n;
};

struct Step {
  const float* obs;
  const int64_t* actions;
  const float* rewards;
  const float* next_obs;
  const void* terminated;
  const void* truncated;
  bool flags_are_bool;
};

__device__ __forceinline__ bool flag_at(const void* p, bool is_bool, int64_t e) {
  return is_bool ? static_cast<const bool*>(p)[e] : static_cast<const float*>(p)[e] != 0.f;
}

// The step into each env's window (a warp per env); the last block turns the per-env row
// counts into each env's first row (an exclusive scan in env order) and the total.
__global__ void __launch_bounds__(kThreads) window_kernel(Window win, Step step, int64_t SD, int64_t D,
                                                          int* __restrict__ counter) {
  pdl_enter();
  const int lane = threadIdx.x % 32;
  for (int64_t e = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; e < win.E; e += int64_t(gridDim.x) * kWarps) {
    const int64_t start = win.pos[2 * e], len = win.pos[2 * e + 1], slot = (start + len) % win.n;
    copy_floats(win.obs + (e * win.n + slot) * SD, step.obs + e * SD, SD, lane);
    copy_longs(win.actions + (e * win.n + slot) * D, step.actions + e * D, D, lane);
    if (lane == 0) {
      win.rewards[e * win.n + slot] = step.rewards[e];
      const bool ended = flag_at(step.terminated, step.flags_are_bool, e) ||
                         flag_at(step.truncated, step.flags_are_bool, e);
      win.emit[e] = nstep_emits(ended, len + 1, win.n);
    }
  }
  if (!last_block_done(counter)) return;
  __shared__ int64_t partial[kThreads];
  const int64_t chunk = (win.E + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * chunk, hi = lo + chunk < win.E ? lo + chunk : win.E;
  int64_t sum = 0;
  for (int64_t e = lo; e < hi; ++e) sum += load_fresh_long(win.emit + e);
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int k = 0; k < kThreads; ++k) {
      const int64_t c = partial[k];
      partial[k] = run;
      run += c;
    }
    win.emit[win.E] = run;
  }
  __syncthreads();
  int64_t run = partial[threadIdx.x];
  for (int64_t e = lo; e < hi; ++e) {
    const int64_t c = load_fresh_long(win.emit + e);
    win.emit[e] = run;
    run += c;
  }
  if (threadIdx.x == 0) *counter = 0;
}

// The completed windows' rows at the cursor (a warp per env), the windows advanced; the last
// block rebuilds the tree above the new rows and moves the cursor.
__global__ void __launch_bounds__(kThreads) emit_kernel(Storage s, TreeRefs t, bool prioritized, Window win,
                                                        Step step, double gamma, int64_t* __restrict__ cursor,
                                                        int* __restrict__ counter) {
  pdl_enter();
  const int lane = threadIdx.x % 32;
  const int64_t w = wrapped_cursor(cursor, s.C), n = win.n;
  for (int64_t e = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; e < win.E; e += int64_t(gridDim.x) * kWarps) {
    const int64_t start = win.pos[2 * e], len = win.pos[2 * e + 1] + 1;
    const bool term = flag_at(step.terminated, step.flags_are_bool, e);
    const bool ended = term || flag_at(step.truncated, step.flags_are_bool, e);
    const int64_t first = win.emit[e], rows = win.emit[e + 1] - first;
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = (w + first + j) % s.C, slot = (start + j) % n;
      copy_floats(s.states + row * s.SD, win.obs + (e * n + slot) * s.SD, s.SD, lane);
      copy_longs(s.actions + row * s.D, win.actions + (e * n + slot) * s.D, s.D, lane);
      copy_floats(s.next_states + row * s.SD, step.next_obs + e * s.SD, s.SD, lane);
      if (lane == 0) {
        s.rewards[row] = nstep_return(win.rewards + e * n, start, n, j, len, gamma);
        s.dones[row] = nstep_done(term, len - j, n, gamma);
        if (prioritized) t.leaves[row] = *t.max_priority;
      }
    }
    __syncwarp();  // every lane has read this env's pos before lane 0 rewrites it (the copies diverge)
    if (lane == 0) {
      if (ended) {
        win.pos[2 * e] = 0;
        win.pos[2 * e + 1] = 0;
      } else if (len == n) {
        win.pos[2 * e] = (start + 1) % n;
        win.pos[2 * e + 1] = n - 1;
      } else {
        win.pos[2 * e + 1] = len;
      }
    }
  }
  if (!last_block_done(counter)) return;
  const int64_t total = win.emit[win.E];
  if (prioritized && total > 0) rebuild_range_block(t, w, total);
  if (threadIdx.x == 0) {
    advance_cursor(cursor, w, total, s.C);
    *counter = 0;
  }
}

void replay_add_steps_cuda(at::TensorList storage, Tensor& cursor, at::TensorList tree, at::TensorList window,
                           Tensor& counter, const Tensor& obs, const Tensor& actions, const Tensor& rewards,
                           const Tensor& next_obs, const Tensor& terminated, const Tensor& truncated, double gamma) {
  const AddStepsDims d = check_replay_add_steps_args(storage, cursor, tree, window, counter, obs, actions, rewards,
                                                     next_obs, terminated, truncated, gamma);
  const c10::cuda::CUDAGuard guard(cursor.device());
  const Storage s = storage_refs(storage);
  const TreeRefs t = d.prioritized ? tree_refs(tree, s.C) : TreeRefs{};
  const Window win{window[0].data_ptr<float>(), window[1].data_ptr<int64_t>(), window[2].data_ptr<float>(),
                   window[3].data_ptr<int64_t>(), window[4].data_ptr<int64_t>(), d.envs, d.n};
  const Step step{obs.data_ptr<float>(), actions.data_ptr<int64_t>(), rewards.data_ptr<float>(),
                  next_obs.data_ptr<float>(), terminated.data_ptr(), truncated.data_ptr(),
                  terminated.scalar_type() == at::kBool};
  const auto stream = at::cuda::getCurrentCUDAStream();
  int* counters = counter.data_ptr<int>();
  const unsigned blocks = grid_for(d.envs, kWarps);
  launch(window_kernel, blocks, kThreads, 0, stream, win, step, s.SD, s.D, counters);
  launch(emit_kernel, blocks, kThreads, 0, stream, s, t, d.prioritized, win, step, gamma, cursor.data_ptr<int64_t>(),
         counters + 1);
}

// ---------------------------------------------------------------------------------------
// _replay_sample

struct Out {
  float* states;
  int64_t* actions;
  float* rewards;
  float* next_states;
  float* dones;
  float* weights;
  int64_t* indices;
  int64_t B;
};

// A warp per draw: every lane descends (the same loads, one request each) and the lanes gather.
__global__ void __launch_bounds__(kThreads) sample_kernel(Storage s, TreeRefs t, bool prioritized,
                                                          const int64_t* __restrict__ cursor,
                                                          const float* __restrict__ beta, int64_t* __restrict__ rng,
                                                          int* __restrict__ counter, Out out) {
  pdl_enter();
  const int lane = threadIdx.x % 32;
  const uint64_t seed = static_cast<uint64_t>(rng[0]), call = static_cast<uint64_t>(rng[1]);
  int64_t size = cursor[1];
  size = size < 0 ? 0 : (size > s.C ? s.C : size);
  const double total = prioritized ? tree_total(t) : 0.0;
  const float p_min = prioritized ? tree_min(t) : 0.f;
  for (int64_t i = blockIdx.x * int64_t(kWarps) + threadIdx.x / 32; i < out.B; i += int64_t(gridDim.x) * kWarps) {
    const uint32_t bits = philox::draw(philox::Stream::kReplay, seed, call, static_cast<uint32_t>(i), 0);
    int64_t idx;
    float weight;
    if (prioritized) {
      idx = descend(t, stratified_target(i, out.B, bits, total));
      weight = importance_weight(p_min, load_fresh(t.leaves + idx), *beta);
    } else {
      idx = size > 0 ? philox::index_below(bits, static_cast<uint32_t>(size)) : 0;
      weight = size > 0 ? 1.f : 0.f;
    }
    copy_floats(out.states + i * s.SD, s.states + idx * s.SD, s.SD, lane);
    copy_floats(out.next_states + i * s.SD, s.next_states + idx * s.SD, s.SD, lane);
    copy_longs(out.actions + i * s.D, s.actions + idx * s.D, s.D, lane);
    if (lane == 0) {
      out.rewards[i] = s.rewards[idx];
      out.dones[i] = s.dones[idx];
      out.weights[i] = weight;
      out.indices[i] = idx;
    }
  }
  if (!last_block_done(counter)) return;
  if (threadIdx.x == 0) {
    rng[1] = static_cast<int64_t>(call + 1);
    *counter = 0;
  }
}

void replay_sample_cuda(at::TensorList storage, const Tensor& cursor, at::TensorList tree, const Tensor& beta,
                        Tensor& rng, Tensor& counter, at::TensorList out) {
  const int64_t B = check_replay_sample_args(storage, cursor, tree, beta, rng, counter, out);
  const c10::cuda::CUDAGuard guard(cursor.device());
  const Storage s = storage_refs(storage);
  const bool prioritized = !tree.empty();
  const TreeRefs t = prioritized ? tree_refs(tree, s.C) : TreeRefs{};
  const Out o{out[0].data_ptr<float>(), out[1].data_ptr<int64_t>(), out[2].data_ptr<float>(), out[3].data_ptr<float>(),
              out[4].data_ptr<float>(), out[5].data_ptr<float>(), out[6].data_ptr<int64_t>(), B};
  launch(sample_kernel, grid_for(B, kWarps), kThreads, 0, at::cuda::getCurrentCUDAStream(), s, t, prioritized,
         cursor.data_ptr<int64_t>(), beta.data_ptr<float>(), rng.data_ptr<int64_t>(), counter.data_ptr<int>(), o);
}

// ---------------------------------------------------------------------------------------
// _replay_update_priorities

// One block: the leaves (zeroed, then the largest new priority of each row by an integer
// atomicMax on the F32 bits: positive floats order as their bits, and a max is order-free),
// then every touched node, level by level.
__global__ void __launch_bounds__(kUpdateThreads) update_kernel(TreeRefs t, const int64_t* __restrict__ cursor,
                                                                const int64_t* __restrict__ indices,
                                                                const float* __restrict__ td, int64_t K, double alpha,
                                                                double eps, unsigned long long* __restrict__ skipped) {
  pdl_enter();
  __shared__ unsigned long long bad;
  __shared__ int most;
  __shared__ unsigned claimed[kDedupBits / 32];
  int64_t size = cursor[1];  // a foreign cursor is clamped to the leaves, as sample's is: no write past them
  size = size < 0 ? 0 : (size > t.layout.count[0] ? t.layout.count[0] : size);
  if (threadIdx.x == 0) {
    bad = 0;
    most = __float_as_int(*t.max_priority);
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t i = indices[k];
    if (i >= 0 && i < size && isfinite(td[k]))
      t.leaves[i] = 0.f;
    else
      atomicAdd(&bad, 1ull);
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
    const int64_t i = indices[k];
    if (!(i >= 0 && i < size && isfinite(td[k]))) continue;
    const int p = __float_as_int(priority_of(td[k], eps, alpha));
    atomicMax(reinterpret_cast<int*>(t.leaves + i), p);
    atomicMax(&most, p);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *t.max_priority = __int_as_float(most);
    if (bad > 0) *skipped += bad;
  }
  for (int l = 1; l <= t.layout.levels; ++l) {
    const bool dedup = t.layout.count[l] <= kDedupBits;
    if (dedup) {
      for (int k = threadIdx.x; k < kDedupBits / 32; k += blockDim.x) claimed[k] = 0u;
      __syncthreads();
    }
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      const int64_t i = indices[k];
      if (!(i >= 0 && i < size && isfinite(td[k]))) continue;
      const int64_t node = i >> (kTreeFanLog * l);
      if (dedup) {
        const unsigned bit = 1u << (node % 32);
        if (atomicOr(&claimed[node / 32], bit) & bit) continue;  // another thread recomputes it
      }
      recompute_node(t, l, node);
    }
    __syncthreads();
  }
}

void replay_update_priorities_cuda(at::TensorList tree, const Tensor& cursor, const Tensor& indices,
                                   const Tensor& td_error, Tensor& skipped, double alpha, double eps) {
  const int64_t K = check_replay_update_args(tree, cursor, indices, td_error, skipped, alpha, eps);
  if (K == 0) return;
  const c10::cuda::CUDAGuard guard(cursor.device());
  const TreeRefs t = tree_refs(tree, tree[0].size(0));
  launch(update_kernel, 1, kUpdateThreads, 0, at::cuda::getCurrentCUDAStream(), t, cursor.data_ptr<int64_t>(),
         indices.data_ptr<int64_t>(), td_error.data_ptr<float>(), K, alpha, eps,
         reinterpret_cast<unsigned long long*>(skipped.data_ptr<int64_t>()));
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("_replay_add", &cuda::replay_add_cuda);
  m.impl("_replay_add_steps", &cuda::replay_add_steps_cuda);
  m.impl("_replay_sample", &cuda::replay_sample_cuda);
  m.impl("_replay_update_priorities", &cuda::replay_update_priorities_cuda);
}

}  // namespace dqn_ops

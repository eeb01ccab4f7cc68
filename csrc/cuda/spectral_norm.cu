// batched_spectral_norm on CUDA: one cooperative launch runs the power iteration of every
// weight matrix, whatever their number and sizes.
//
// Work split. Matrix m is cut into K_m "virtual blocks" of about kElemsPerVirtualBlock
// elements: contiguous row slices (for W^T u and W v) and, in the reduction phase,
// contiguous column slices. K_m depends on the matrix's shape alone, so a matrix is computed
// the same way, to the bit, whether it shares the launch with others or runs alone (the
// one_launch_per_matrix path the equivalence test compares against). Physical blocks loop
// over the virtual blocks, so the grid never exceeds what can be co-resident, which the
// grid-wide barriers of a cooperative launch need.
//
// One power iteration, 4 phases separated by grid barriers:
//   A  each row slice k: partial[k, :] = W[slice, :]^T u[slice]
//   A2 each column slice: v~[c] = sum_k partial[k, c] (in k order), partial |v~|^2
//   B  each row slice: u~[r] = W[r, :] . v~ / |v~|, partial |u~|^2
//   C  u = u~ / |u~|, v = v~ / |v~|, sigma = |u~| (= u^T W v); after the last iteration,
//      W *= sigma_max / sigma where sigma > sigma_max, and the BF16 mirror of those rows.
// Every sum runs in a fixed order (no atomics): results are deterministic.
//
// Descriptors travel by value as the kernel's parameter (a CUDA graph records them), up to
// kMaxMatricesPerLaunch per launch; more matrices take more launches.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "reductions.cuh"
#include "spectral_args.h"

namespace dqn_ops {
namespace cuda {
namespace {

namespace cg = cooperative_groups;
using at::Tensor;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kElemsPerVirtualBlock = 16384;
// At most this many virtual blocks per matrix: each column of v~ sums K partials, and a
// larger K would make that reduction, not the reads of W, the long pole.
constexpr int64_t kMaxVirtualBlocks = 64;
// Phase A covers 128 columns a pass: 32 lanes x 4 columns, with every warp on its own rows.
constexpr int kColsPerLane = 4;
constexpr int kChunkCols = 32 * kColsPerLane;
// Phase B: rows a warp reduces together.
constexpr int kRowsPerPass = 4;
// Kernel parameters are limited to 4 KiB; 48 descriptors of 64 bytes leave room for the rest.
constexpr int kMaxMatricesPerLaunch = 48;

struct MatrixDesc {
  int64_t w_off, u_off, v_off;
  int64_t partial_off;  // its [K, cols] partial sums of W^T u in the scratch buffer
  int64_t norm_off;     // its K partial squared norms in the |v~|^2 and |u~|^2 scratch arrays
  int rows, cols;
  int vblocks;       // K
  int first_vblock;  // index of its first virtual block in this launch
  int index;         // position in sigma
  float sigma_max;
};

struct Batch {
  MatrixDesc m[kMaxMatricesPerLaunch];
  int count;
  int total_vblocks;
};
static_assert(sizeof(Batch) <= 3584, "kernel parameters must stay under 4 KiB");

// The number of virtual blocks of a [rows, cols] matrix: a function of its shape alone.
int virtual_blocks(int64_t rows, int64_t cols) {
  const int64_t k = (rows * cols + kElemsPerVirtualBlock - 1) / kElemsPerVirtualBlock;
  return static_cast<int>(std::max<int64_t>(1, std::min({k, rows, kMaxVirtualBlocks})));
}

__device__ __forceinline__ int find_matrix(const Batch& b, int vb) {
  int m = 0;
  while (m + 1 < b.count && b.m[m + 1].first_vblock <= vb) ++m;
  return m;
}

__device__ __forceinline__ float sum_partials(const float* p, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += p[i];
  return s;
}

// __grid_constant__: the kernel indexes the descriptors at run time; this keeps them in
// parameter memory instead of making a per-thread local copy.
__global__ void __launch_bounds__(kThreads)
    spectral_norm_kernel(const __grid_constant__ Batch b, float* __restrict__ params,
                         __nv_bfloat16* __restrict__ mirror, float* __restrict__ u, float* __restrict__ v,
                         float* __restrict__ sigma, float* __restrict__ partial, float* __restrict__ sq_v,
                         float* __restrict__ sq_u, int iterations, float eps) {
  __shared__ float smem[kWarps * kChunkCols];  // >= kThreads
  cg::grid_group grid = cg::this_grid();
  const int tid = threadIdx.x;

  for (int it = 0; it < iterations; ++it) {
    // A: partial[k, c] = sum over the slice's rows of W[r, c] u[r]. Each warp takes every
    // kWarps-th row of the slice; a lane keeps kColsPerLane independent sums (columns 32
    // apart, coalesced), so many loads are in flight; the warps' sums are added in warp order.
    for (int vb = blockIdx.x; vb < b.total_vblocks; vb += gridDim.x) {
      const MatrixDesc& d = b.m[find_matrix(b, vb)];
      const int k = vb - d.first_vblock;
      const int r0 = int(int64_t(k) * d.rows / d.vblocks), r1 = int(int64_t(k + 1) * d.rows / d.vblocks);
      const float* W = params + d.w_off;
      const float* um = u + d.u_off;
      const int warp = tid / 32, lane = tid % 32;
      for (int c0 = 0; c0 < d.cols; c0 += kChunkCols) {
        float acc[kColsPerLane] = {};
#pragma unroll 4
        for (int r = r0 + warp; r < r1; r += kWarps) {
          const float ur = um[r];
          const float* row = W + int64_t(r) * d.cols;
#pragma unroll
          for (int j = 0; j < kColsPerLane; ++j) {
            const int c = c0 + lane + 32 * j;
            if (c < d.cols) acc[j] = fmaf(row[c], ur, acc[j]);
          }
        }
#pragma unroll
        for (int j = 0; j < kColsPerLane; ++j) smem[warp * kChunkCols + lane + 32 * j] = acc[j];
        __syncthreads();
        if (tid < kChunkCols && c0 + tid < d.cols) {
          float sum = smem[tid];
          for (int w = 1; w < kWarps; ++w) sum += smem[w * kChunkCols + tid];
          partial[d.partial_off + int64_t(k) * d.cols + c0 + tid] = sum;
        }
        __syncthreads();
      }
    }
    grid.sync();

    // A2: v~ over the slice's columns: CT columns a pass, G = kThreads / CT groups each
    // summing every G-th partial, then the groups' sums in group order; its share of |v~|^2.
    for (int vb = blockIdx.x; vb < b.total_vblocks; vb += gridDim.x) {
      const MatrixDesc& d = b.m[find_matrix(b, vb)];
      const int k = vb - d.first_vblock;
      const int c0 = int(int64_t(k) * d.cols / d.vblocks), c1 = int(int64_t(k + 1) * d.cols / d.vblocks);
      const int ct = min(kThreads, max(32, (c1 - c0 + 31) / 32 * 32));
      const int groups = kThreads / ct;
      const int tc = tid % ct, g = tid / ct;
      const float* part = partial + d.partial_off;
      float sq = 0.f;
      for (int cc = c0; cc < c1; cc += ct) {
        const int c = cc + tc;
        float s = 0.f;
        if (c < c1 && g < groups)
          for (int j = g; j < d.vblocks; j += groups) s += part[int64_t(j) * d.cols + c];
        smem[tid] = s;
        __syncthreads();
        if (g == 0 && c < c1) {
          float total = smem[tc];
          for (int j = 1; j < groups; ++j) total += smem[j * ct + tc];
          v[d.v_off + c] = total;
          sq = fmaf(total, total, sq);
        }
        __syncthreads();
      }
      sq = block_sum<kThreads>(sq, smem);
      if (tid == 0) sq_v[d.norm_off + k] = sq;
    }
    grid.sync();

    // B: u~[r] = W[r, :] . v~ / |v~| over the slice's rows, a warp per row; its share of |u~|^2.
    for (int vb = blockIdx.x; vb < b.total_vblocks; vb += gridDim.x) {
      const MatrixDesc& d = b.m[find_matrix(b, vb)];
      const int k = vb - d.first_vblock;
      const int r0 = int(int64_t(k) * d.rows / d.vblocks), r1 = int(int64_t(k + 1) * d.rows / d.vblocks);
      const float inv_v = 1.f / fmaxf(sqrtf(sum_partials(sq_v + d.norm_off, d.vblocks)), eps);
      const float* W = params + d.w_off;
      const float* vm = v + d.v_off;
      const int warp = tid / 32, lane = tid % 32;
      float sq = 0.f;
      // kRowsPerPass rows of the warp at a time (rows kWarps apart), their loads and their warp
      // sums interleaved: one memory latency and one shuffle chain per pass instead of per row
      // (v2 took a row at a time). Each row's sum runs in the same order as before.
      for (int rp = r0 + warp; rp < r1; rp += kWarps * kRowsPerPass) {
        float dot[kRowsPerPass];
#pragma unroll
        for (int q = 0; q < kRowsPerPass; ++q) {
          const int r = rp + q * kWarps;
          float acc[4] = {};  // independent sums: four loads in flight per lane and row
          if (r < r1) {
            const float* row = W + int64_t(r) * d.cols;
            int c = lane;
            for (; c + 96 < d.cols; c += 128) {
#pragma unroll
              for (int j = 0; j < 4; ++j) acc[j] = fmaf(row[c + 32 * j], vm[c + 32 * j], acc[j]);
            }
#pragma unroll
            for (int j = 0; j < 3; ++j)  // the tail: fewer than 4 x 32 columns are left
              if (c + 32 * j < d.cols) acc[j] = fmaf(row[c + 32 * j], vm[c + 32 * j], acc[j]);
          }
          dot[q] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
#pragma unroll
        for (int q = 0; q < kRowsPerPass; ++q) dot[q] = warp_sum(dot[q]) * inv_v;
#pragma unroll
        for (int q = 0; q < kRowsPerPass; ++q) {
          const int r = rp + q * kWarps;
          if (lane == 0 && r < r1) {  // rows in increasing order: the same |u~|^2 sum as before
            u[d.u_off + r] = dot[q];
            sq = fmaf(dot[q], dot[q], sq);
          }
        }
      }
      sq = block_sum<kThreads>(sq, smem);
      if (tid == 0) sq_u[d.norm_off + k] = sq;
    }
    grid.sync();

    // C: normalise u (the slice's rows) and v (the slice's columns); sigma = |u~|; rescale.
    const bool last = it + 1 == iterations;
    for (int vb = blockIdx.x; vb < b.total_vblocks; vb += gridDim.x) {
      const MatrixDesc& d = b.m[find_matrix(b, vb)];
      const int k = vb - d.first_vblock;
      const int r0 = int(int64_t(k) * d.rows / d.vblocks), r1 = int(int64_t(k + 1) * d.rows / d.vblocks);
      const int c0 = int(int64_t(k) * d.cols / d.vblocks), c1 = int(int64_t(k + 1) * d.cols / d.vblocks);
      const float inv_v = 1.f / fmaxf(sqrtf(sum_partials(sq_v + d.norm_off, d.vblocks)), eps);
      const float s = sqrtf(sum_partials(sq_u + d.norm_off, d.vblocks));
      const float inv_u = 1.f / fmaxf(s, eps);
      for (int r = r0 + tid; r < r1; r += kThreads) u[d.u_off + r] *= inv_u;
      for (int c = c0 + tid; c < c1; c += kThreads) v[d.v_off + c] *= inv_v;
      if (last) {
        if (k == 0 && tid == 0) sigma[d.index] = s;
        if (s > d.sigma_max) {  // false for NaN: W is left alone and sigma reports the NaN
          const float scale = d.sigma_max / s;
          const int64_t e0 = d.w_off + int64_t(r0) * d.cols, e1 = d.w_off + int64_t(r1) * d.cols;
          for (int64_t e = e0 + tid; e < e1; e += kThreads) {
            const float w = params[e] * scale;
            params[e] = w;
            mirror[e] = __float2bfloat16_rn(w);
          }
        }
      }
      // The next iteration's phase A of this virtual block reads the u rows written here.
      __syncthreads();
    }
  }
}

// Blocks of spectral_norm_kernel that fit on the device at once (a cooperative launch's cap).
void launch(Batch& b, Tensor& params, Tensor& params_bf16, Tensor& u, Tensor& v, Tensor& sigma, float* partial,
            float* sq_v, float* sq_u, int iterations, float eps, cudaStream_t stream) {
  const int cap = cooperative_block_cap(spectral_norm_kernel, kThreads, 0);
  DQN_CHECK(cap > 0, kSpectralOp, ": the kernel cannot be resident on this device");
  const int grid = std::min(b.total_vblocks, cap);
  float* p = params.data_ptr<float>();
  auto* mirror = static_cast<__nv_bfloat16*>(params_bf16.data_ptr());
  float* up = u.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  float* sp = sigma.data_ptr<float>();
  void* args[] = {&b, &p, &mirror, &up, &vp, &sp, &partial, &sq_v, &sq_u, &iterations, &eps};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(spectral_norm_kernel), dim3(grid), dim3(kThreads),
                                             args, 0, stream));
}

void batched_spectral_norm_cuda(Tensor& params, Tensor& params_bf16, Tensor& u, Tensor& v, Tensor& sigma,
                                c10::IntArrayRef matrices, c10::ArrayRef<double> sigma_max,
                                int64_t n_power_iterations, double eps, bool one_launch_per_matrix) {
  const auto mats = check_spectral_args(params, params_bf16, u, v, sigma, matrices, sigma_max, n_power_iterations, eps);
  for (size_t m = 0; m < mats.size(); ++m)
    DQN_CHECK(mats[m].rows <= INT_MAX && mats[m].cols <= INT_MAX, kSpectralOp, ": matrices: matrix ", m,
              " has more than 2^31 - 1 rows or columns");
  DQN_CHECK(n_power_iterations <= INT_MAX, kSpectralOp, ": n_power_iterations too large");
  // Kernels must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(params.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // Scratch from torch's caching allocator: the [K, cols] partials of every matrix, then the
  // K partial squared norms of v~ and of u~.
  std::vector<MatrixDesc> descs;
  int64_t partial_len = 0, norm_len = 0;
  for (size_t m = 0; m < mats.size(); ++m) {
    const SpectralMatrix& s = mats[m];
    MatrixDesc d{};
    d.w_off = s.w_off;
    d.u_off = s.u_off;
    d.v_off = s.v_off;
    d.rows = static_cast<int>(s.rows);
    d.cols = static_cast<int>(s.cols);
    d.vblocks = virtual_blocks(s.rows, s.cols);
    d.partial_off = partial_len;
    d.norm_off = norm_len;
    d.index = static_cast<int>(m);
    d.sigma_max = s.sigma_max;
    partial_len += int64_t(d.vblocks) * s.cols;
    norm_len += d.vblocks;
    descs.push_back(d);
  }
  Tensor scratch = at::empty({partial_len + 2 * norm_len}, params.options());
  float* partial = scratch.data_ptr<float>();
  float* sq_v = partial + partial_len;
  float* sq_u = sq_v + norm_len;

  const size_t per_launch = one_launch_per_matrix ? 1 : kMaxMatricesPerLaunch;
  for (size_t first = 0; first < descs.size(); first += per_launch) {
    Batch b{};
    b.count = static_cast<int>(std::min(per_launch, descs.size() - first));
    for (int i = 0; i < b.count; ++i) {
      b.m[i] = descs[first + i];
      b.m[i].first_vblock = b.total_vblocks;
      DQN_CHECK(int64_t(b.total_vblocks) + b.m[i].vblocks <= INT_MAX, kSpectralOp, ": too many blocks");
      b.total_vblocks += b.m[i].vblocks;
    }
    launch(b, params, params_bf16, u, v, sigma, partial, sq_v, sq_u, static_cast<int>(n_power_iterations),
           static_cast<float>(eps), stream);
  }
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("batched_spectral_norm", &cuda::batched_spectral_norm_cuda); }

}  // namespace dqn_ops

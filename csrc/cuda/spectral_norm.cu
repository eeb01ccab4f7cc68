// batched_spectral_norm on CUDA, two strategies:
//   cluster (matrices whose rows fit a thread-block cluster's shared memory, where the device and
//     the binary can run it: see cluster_support): one launch, a cluster of blocks per matrix, no
//     grid barrier (spectral_norm_cluster_kernel, below);
//   cooperative (every other matrix; every matrix under SpectralStrategy::kCooperative,
//     csrc/spectral_args.h): one cooperative launch runs the power iteration of every such
//     matrix, whatever their number and sizes (spectral_norm_kernel). It runs on every device
//     these kernels build for (sm_80+).
// The two sum in different orders: they agree to float rounding, not to the bit. Within a
// strategy, a matrix's result depends on its shape and values alone.
//
// The cooperative strategy. Work split: Matrix m is cut into K_m "virtual blocks" of about kElemsPerVirtualBlock
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
#include <map>
#include <mutex>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "pdl.cuh"
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
  // No-ops under the cooperative launch (launch_cooperative: no PDL attribute); kept so that the
  // rule of pdl.cuh holds in every kernel, and the trigger still lets the next kernel start early.
  pdl_enter();
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
      // sums interleaved: one memory latency and one shuffle chain per pass instead of per row.
      // Each row's sum runs in the same order as a row at a time would add it.
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

// ---------------------------------------------------------------------------------------
// The cluster strategy: matrices whose rows fit in the shared memory of a thread-block cluster
// (sm_90) run one matrix per cluster of kCluster blocks, with no grid barrier. Block k of the cluster holds
// rows [k rows / kCluster, (k + 1) rows / kCluster) of W and its u slice in shared memory
// (W is read from global memory once per call, not once per phase), and the blocks exchange
// partial sums through distributed shared memory, separated by cluster barriers (hardware,
// not a grid-wide spin on global memory as in the cooperative strategy):
//   A  partial_k = W_k^T u_k;  barrier;  every block: v~ = sum_k partial_k (k order), |v~|^2
//   B  u~_k = W_k v~ / |v~|, partial |u~_k|^2;  barrier;  every block: |u~| (k order)
//   C  u = u~ / |u~|; rank 0 writes v = v~ / |v~| and sigma; W_k rescaled where sigma > sigma_max.
// A matrix's result depends on its shape and values alone (its own cluster): batched and
// one-launch-per-matrix still agree bit for bit. Larger matrices, and devices and binaries
// cluster_support turns down, take the cooperative kernel above.
constexpr int kCluster = 8;
// The most dynamic shared memory a block asks for: 160 KiB. Less where the device's opt-in
// limit is lower (cluster_support).
constexpr int64_t kClusterSmemFloats = 40 * 1024;

// Floats of dynamic shared memory a block of the cluster kernel needs for a [rows, cols] matrix.
int64_t cluster_smem_floats(int64_t rows, int64_t cols) {
  const int64_t slice_rows = (rows + kCluster - 1) / kCluster;
  // W slice, u slice, u~ slice, partial (this block's W^T u), v~, group scratch, |u~|^2 partial
  return slice_rows * cols + 2 * slice_rows + 2 * cols + kThreads + 1;
}

__global__ void __launch_bounds__(kThreads)
    spectral_norm_cluster_kernel(const __grid_constant__ Batch b, float* __restrict__ params,
                                 __nv_bfloat16* __restrict__ mirror, float* __restrict__ u_all,
                                 float* __restrict__ v_all, float* __restrict__ sigma, int iterations, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  pdl_enter();
  extern __shared__ float dyn[];
  namespace cgx = cooperative_groups;
  cgx::cluster_group cluster = cgx::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const MatrixDesc& d = b.m[blockIdx.x / kCluster];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rows = d.rows, cols = d.cols;
  const int r0 = int(int64_t(rank) * rows / kCluster), r1 = int(int64_t(rank + 1) * rows / kCluster);
  const int nr = r1 - r0;
  const int slice_rows = (rows + kCluster - 1) / kCluster;
  float* W = dyn;                              // [nr, cols]
  float* us = W + int64_t(slice_rows) * cols;  // u slice [nr]
  float* uu = us + slice_rows;                 // u~ slice [nr]
  float* part = uu + slice_rows;               // [cols]: this block's W^T u (read by the cluster)
  float* vv = part + cols;                     // [cols]: v~, then v
  float* scratch = vv + cols;                  // [kThreads]
  float* sq_part = scratch + kThreads;         // [1]: this block's |u~|^2 (read by the cluster)

  const float* Wg = params + d.w_off + int64_t(r0) * cols;
  for (int64_t e = tid; e < int64_t(nr) * cols; e += kThreads) W[e] = Wg[e];
  for (int r = tid; r < nr; r += kThreads) us[r] = u_all[d.u_off + r0 + r];
  __syncthreads();

  // Phase A's thread map: ct columns a pass, G row groups (rows g, g + G, ...), group sums in g order.
  const int ct = min(cols, kThreads), G = max(1, kThreads / ct);
  const int tc = tid % ct, g = tid / ct;
  float s = 0.f;
  for (int it = 0; it < iterations; ++it) {
    // A: part[c] = sum over the slice's rows of W[r, c] u[r]
    for (int c0 = 0; c0 < cols; c0 += ct) {
      const int c = c0 + tc;
      float acc = 0.f;
      if (g < G && c < cols)
        for (int r = g; r < nr; r += G) acc = fmaf(W[int64_t(r) * cols + c], us[r], acc);
      __syncthreads();  // scratch is free
      scratch[tid] = acc;
      __syncthreads();
      if (g == 0 && c < cols) {
        float t = scratch[tc];
        for (int j = 1; j < G; ++j) t += scratch[j * ct + tc];
        part[c] = t;
      }
    }
    cluster.sync();  // every block's part is complete
    // v~ = sum over the cluster's blocks of part, in rank order, computed by every block
    float sqv = 0.f;
    for (int c = tid; c < cols; c += kThreads) {
      float t = 0.f;
      for (int k = 0; k < kCluster; ++k) t += cluster.map_shared_rank(part, k)[c];
      vv[c] = t;
      sqv = fmaf(t, t, sqv);
    }
    sqv = block_sum_by_warps<kWarps>(sqv, scratch);
    const float inv_v = 1.f / fmaxf(sqrtf(sqv), eps);
    // B: u~[r] = W[r, :] . v~ / |v~|, a warp per row; this block's |u~|^2 in row order
    for (int r = warp; r < nr; r += kWarps) {
      float acc = 0.f;
      for (int c = lane; c < cols; c += 32) acc = fmaf(W[int64_t(r) * cols + c], vv[c], acc);
      acc = warp_sum(acc) * inv_v;
      if (lane == 0) uu[r] = acc;
    }
    __syncthreads();
    if (tid == 0) {
      float q = 0.f;
      for (int r = 0; r < nr; ++r) q = fmaf(uu[r], uu[r], q);
      sq_part[0] = q;
    }
    cluster.sync();  // every block's |u~|^2 partial is complete; no one reads part any more
    float squ = 0.f;
    for (int k = 0; k < kCluster; ++k) squ += cluster.map_shared_rank(sq_part, k)[0];
    // The last read of a peer's shared memory: arrive now, wait just before the exit, so that
    // phase C's and the clamp's stores do not stand in front of the barrier's release fence.
    // Earlier iterations need no barrier here: the next one's first cluster.sync comes before
    // any block writes sq_part again.
    if (it + 1 == iterations) cluster.barrier_arrive();
    s = sqrtf(squ);
    const float inv_u = 1.f / fmaxf(s, eps);
    // C: normalise; u stays in shared memory for the next iteration
    for (int r = tid; r < nr; r += kThreads) {
      us[r] = uu[r] * inv_u;
      u_all[d.u_off + r0 + r] = us[r];
    }
    if (rank == 0)
      for (int c = tid; c < cols; c += kThreads) v_all[d.v_off + c] = vv[c] * inv_v;
    __syncthreads();
  }
  if (rank == 0 && tid == 0) sigma[d.index] = s;
  if (s > d.sigma_max) {  // false for NaN: W is left alone and sigma reports the NaN
    const float scale = d.sigma_max / s;
    float* Wo = params + d.w_off + int64_t(r0) * cols;
    __nv_bfloat16* Mo = mirror + d.w_off + int64_t(r0) * cols;
    for (int64_t e = tid; e < int64_t(nr) * cols; e += kThreads) {
      const float w = W[e] * scale;
      Wo[e] = w;
      Mo[e] = __float2bfloat16_rn(w);
    }
  }
  cluster.barrier_wait();  // no block leaves while another may still read its shared memory
#else
  __trap();  // never launched: cluster_support sees ptxVersion < 90 and sends every matrix elsewhere
#endif
}

// A launch configuration of the cluster kernel: `clusters` clusters of kCluster blocks.
// attr is the storage config.attrs points to (launch_ex adds the PDL attribute to a copy).
cudaLaunchConfig_t cluster_config(int clusters, size_t smem_bytes, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// What the cluster strategy may use on one device: usable, and the dynamic shared memory a block
// may have (the kernel opted in to it). Not usable (every matrix takes the cooperative strategy)
// unless all of these hold:
//   - the device launches clusters (cudaDevAttrClusterLaunch: sm_90 and newer);
//   - the kernel the device runs has the real body: compiled for compute_90 or newer
//     (ptxVersion: the virtual architecture __CUDA_ARCH__ came from; a build without sm_90 code,
//     JIT-compiled from older PTX, runs the __trap() stub) into sm_90+ machine code
//     (binaryVersion);
//   - the opt-in succeeded: min(160 KiB, the device's opt-in limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
//     less the kernel's static shared memory), e.g. 99 KiB on sm_120 instead of Hopper's 227 KiB.
//     A matrix takes clusters only where its slice fits in what was opted in to;
//   - a cluster of kCluster blocks with that much shared memory can be resident
//     (cudaOccupancyMaxActiveClusters > 0; a MIG slice or an MPS share may hold fewer SMs or
//     less shared memory). If it cannot, the budget halves until one fits (smaller matrices keep
//     clusters) or falls below what the smallest matrix needs.
// A failed opt-in or occupancy query is a reason to fall back, not an error: its status is
// read and cleared (cudaGetLastError), and the device is recorded as opted in only after
// cudaFuncSetAttribute succeeded. Found once per device, then a cached lookup.
struct ClusterSupport {
  bool usable = false;
  int64_t smem_floats = 0;
};

ClusterSupport probe_cluster_support(int device) {
  ClusterSupport none;
  int cluster_launch = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device));
  if (!cluster_launch) return none;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, spectral_norm_cluster_kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // no loadable image of the kernel for this device
    return none;
  }
  if (attr.ptxVersion < 90 || attr.binaryVersion < 90) return none;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  int64_t bytes = std::min<int64_t>(kClusterSmemFloats * int64_t(sizeof(float)),
                                    int64_t(optin) - int64_t(attr.sharedSizeBytes));
  bytes = bytes / int64_t(sizeof(float)) * int64_t(sizeof(float));
  const int64_t smallest = cluster_smem_floats(1, 1) * int64_t(sizeof(float));
  if (bytes < smallest) return none;
  if (cudaFuncSetAttribute(spectral_norm_cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return none;
  }
  for (; bytes >= smallest; bytes = bytes / 2 / int64_t(sizeof(float)) * int64_t(sizeof(float))) {
    cudaLaunchAttribute la[1];
    const cudaLaunchConfig_t config = cluster_config(1, static_cast<size_t>(bytes), nullptr, la);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, spectral_norm_cluster_kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      return none;
    }
    if (clusters > 0) return ClusterSupport{true, bytes / int64_t(sizeof(float))};
  }
  return none;
}

const ClusterSupport& cluster_support(int device) {
  static std::mutex mutex;
  static std::map<int, ClusterSupport> known;  // nodes are stable: the reference outlives the lock
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it == known.end()) it = known.emplace(device, probe_cluster_support(device)).first;
  return it->second;
}

void launch_clusters(Batch& b, Tensor& params, Tensor& params_bf16, Tensor& u, Tensor& v, Tensor& sigma,
                     int iterations, float eps, cudaStream_t stream) {
  int64_t floats = 0;
  for (int i = 0; i < b.count; ++i) floats = std::max(floats, cluster_smem_floats(b.m[i].rows, b.m[i].cols));
  // Within what cluster_support opted in to: the caller sends only matrices that fit.
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t config = cluster_config(b.count, static_cast<size_t>(floats) * sizeof(float), stream, attr);
  float* p = params.data_ptr<float>();
  auto* mirror = static_cast<__nv_bfloat16*>(params_bf16.data_ptr());
  launch_ex(config, spectral_norm_cluster_kernel, b, p, mirror, u.data_ptr<float>(), v.data_ptr<float>(),
            sigma.data_ptr<float>(), iterations, eps);
}

// The cooperative strategy: one cooperative launch, its grid capped at the blocks of
// spectral_norm_kernel that fit on the device at once (virtual blocks beyond it loop).
void launch_cooperative(Batch& b, Tensor& params, Tensor& params_bf16, Tensor& u, Tensor& v, Tensor& sigma,
                        float* partial, float* sq_v, float* sq_u, int iterations, float eps, cudaStream_t stream) {
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
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

  // The choice depends on the strategy setting, the device (and the binary on it) and the
  // matrix's shape alone: a cached lookup per call.
  const ClusterSupport& cs = cluster_support(params.device().index());
  const bool clusters = cs.usable && spectral_strategy() == SpectralStrategy::kAuto;
  std::vector<MatrixDesc> small, large;
  for (const MatrixDesc& d : descs)
    (clusters && cluster_smem_floats(d.rows, d.cols) <= cs.smem_floats ? small : large).push_back(d);
  const size_t per_launch = one_launch_per_matrix ? 1 : kMaxMatricesPerLaunch;
  for (const bool cluster : {true, false}) {
    const std::vector<MatrixDesc>& group = cluster ? small : large;
    for (size_t first = 0; first < group.size(); first += per_launch) {
      Batch b{};  // the next per_launch matrices, their virtual blocks numbered in order
      b.count = static_cast<int>(std::min(per_launch, group.size() - first));
      for (int i = 0; i < b.count; ++i) {
        b.m[i] = group[first + i];
        b.m[i].first_vblock = b.total_vblocks;
        DQN_CHECK(int64_t(b.total_vblocks) + b.m[i].vblocks <= INT_MAX, kSpectralOp, ": too many blocks");
        b.total_vblocks += b.m[i].vblocks;
      }
      if (cluster)
        launch_clusters(b, params, params_bf16, u, v, sigma, static_cast<int>(n_power_iterations),
                        static_cast<float>(eps), stream);
      else
        launch_cooperative(b, params, params_bf16, u, v, sigma, partial, sq_v, sq_u,
                           static_cast<int>(n_power_iterations), static_cast<float>(eps), stream);
    }
  }
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("batched_spectral_norm", &cuda::batched_spectral_norm_cuda); }

}  // namespace dqn_ops

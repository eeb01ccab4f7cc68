// mixed_backward on CUDA: the network's backward pass into one flat F32 gradient buffer.
//
// cuBLAS takes no F32 x BF16 operand mix (docs/design.md), so each precision is a pair of
// operand types it accepts:
//   bf16: dY rounded to BF16 where it is produced; BF16 x BF16 -> F32, COMPUTE_32F;
//         dX reads the BF16 mirror (the weights the forward used).
//   tf32: F32 dY x F32 operands on TF32 tensor cores (COMPUTE_32F_FAST_TF32); dX reads the
//         F32 master weights, dW the saved BF16 activations upcast to F32 (exact).
//   fp32: as tf32 with COMPUTE_32F_PEDANTIC (full-precision FMA, for checks).
// In bf16 a layer's dX is instead one launch of dqn_ops's own GEMM (dense_layer.h, kInputGrad)
// where the dense layer kernel's mode gives it the layer: the layer before's ReLU mask and the
// BF16 copy in its epilogue, where the GEMM and a relu_backward pass were (input_grad_kernel).
// Bias gradients are column sums of the unrounded F32 dZ, every layer's in one launch (up to
// kMaxColumnSumJobs layers) in a fixed summation order (graph replays and eager calls agree
// bitwise); under DQN_OPS_EPILOGUE_COLUMN_SUMS a masked dZ's sums begin in the dense kernel's
// epilogue and IQN's dP's in its backward kernel, and their F32 values are not stored
// (epilogue_column_sums).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "../switches.h"
#include "branch_table.cuh"
#include "dense_layer.h"
#include "dueling.cuh"
#include "elementwise.cuh"
#include "gemm.cuh"
#include "network_args.h"
#include "pdl.cuh"
#include "side_stream.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;
constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // per thread, in the dueling backward kernel

// The sum, in order from 0.f, of one branch's dq at one atom (dq: its first action's entry,
// q_step between actions; null: 0.f), loaded kLoadsInFlight at a time: the branch's mean's
// gradient and its share of the value's.
__device__ __forceinline__ float branch_dq_sum(const float* __restrict__ dq, int size, int64_t q_step) {
  float sum = 0.f;
  if (!dq) return sum;
  for (int k0 = 0; k0 < size; k0 += kLoadsInFlight) {  // the chunk's loads first
    float x[kLoadsInFlight];
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j)
      if (k0 + j < size) x[j] = dq[int64_t(k0 + j) * q_step];
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j)
      if (k0 + j < size) sum += x[j];
  }
  return sum;
}

// Branch entry d's columns of d_head at atom z: per action k, dueling_advantage_grad(dq_k, the
// dq mean (0 without dueling or grad_q), the direct gradient g_k); their BF16 copies in the
// padded layout when low is not null. dq: the entry's first action's dq at z (null: none), gh:
// the row's direct gradient (null: none). Returns the entry's dq sum, the value's share (0.f
// without the mean's term).
__device__ __forceinline__ float write_branch_grad(const float* __restrict__ dq, const float* __restrict__ gh,
                                                   float* __restrict__ dh, __nv_bfloat16* __restrict__ low,
                                                   const BranchTable& branches, int d, int z, int atoms,
                                                   int value_heads, int64_t q_step) {
  const int size = branches.size[d];
  const bool mean_term = dq && value_heads;  // only dueling has the mean's term
  const float sum = mean_term ? branch_dq_sum(dq, size, q_step) : 0.f;
  const float mean = mean_term ? branch_mean(sum, size) : 0.f;
#pragma unroll 4
  for (int k = 0; k < size; ++k) {
    const int64_t col = head_col_of(branches, d, value_heads, atoms) + int64_t(atoms) * k + z;
    // Without grad_q: dq = 0 and mean = 0, so g = (0 - 0) + direct; without dueling
    // g = (dq - 0) + direct.
    const float g = dueling_advantage_grad(dq ? dq[int64_t(k) * q_step] : 0.f, mean, gh ? gh[col] : 0.f);
    dh[col] = g;
    if (low) low[branches.pad_col[d] + int64_t(k) * atoms + z] = __float2bfloat16_rn(g);
  }
  return sum;
}

// d_head = grad_head + d(dueling aggregate)/d(head) . grad_q (dueling.cuh), a thread per (row,
// atom) (row_group). Two shapes (split_heads): one block column, whose threads walk a row's
// entries in turn and sum each member's dv as they go; or a column per head, blockIdx.y branch
// entry d (y < branches.count) or member e's value head (y = count + e), the value head's
// threads summing its member's entries' dq again (the same sums, from L2) for dv. Without
// dueling (branches.dueling == 0: no value column, q_d = the branch's logits) there is no mean:
// the same formula with mean 0, d_head = (dq - 0) + grad_head. d_head is compact [rows,
// head_out]; the BF16 copy the `bf16` GEMMs read (d_head_bf16, may be null) is in the padded
// layout [rows, head_ld] of NetLayout, its padding columns 0.
__global__ void __launch_bounds__(kThreads) dueling_backward_kernel(const float* __restrict__ grad_q,
                                                                    const float* __restrict__ grad_head,
                                                                    float* __restrict__ d_head,
                                                                    __nv_bfloat16* __restrict__ d_head_bf16,
                                                                    int64_t head_ld, int64_t rows, int atoms,
                                                                    int64_t head_out, int total_actions,
                                                                    BranchTable branches, int64_t slots, bool split) {
  pdl_enter();
  const RowGroup grp = row_group(atoms);
  if (grp.idle) return;
  const int value_heads = value_heads_of(branches);  // the members' value heads' column blocks come first
  const int64_t value_ld = round_up_to_align(atoms);  // a value head's padded columns
  const int64_t q_step = int64_t(atoms) * slots;      // between two actions' entries in grad_q
  const int y = blockIdx.y;
  const bool value = split && y >= branches.count;  // a split column: member e's value head, else entry d
  const int e = value ? y - branches.count : 0;
  for (int64_t b = grp.first_row; b < rows; b += grp.row_stride) {
    const float* gh = grad_head ? grad_head + b * head_out : nullptr;
    // Row b is fraction b % slots of sample b / slots (slots = 1: sample b).
    const float* dq_row = grad_q ? grad_q + (b / slots) * total_actions * q_step + b % slots : nullptr;
    // Entry d's first action's dq at atom z.
    auto dq_of = [&](int d, int z) -> const float* {
      return dq_row ? dq_row + (int64_t(branches.action_offset[d]) * atoms + z) * slots : nullptr;
    };
    float* dh = d_head + b * head_out;
    __nv_bfloat16* low = d_head_bf16 ? d_head_bf16 + b * head_ld : nullptr;
    for (int z = grp.col; z < atoms; z += grp.width) {
      if (!split) {
        float dv = 0.f;  // the current member's value gradient
        for (int d = 0; d < branches.count; ++d) {
          const int64_t m = member_of(branches, d);
          if (value_heads && d % branches.per_member == 0) dv = gh ? gh[m * atoms + z] : 0.f;  // a member's first branch
          dv += write_branch_grad(dq_of(d, z), gh, dh, low, branches, d, z, atoms, value_heads, q_step);
          if (value_heads && d % branches.per_member == branches.per_member - 1) {  // the member's last branch
            dh[m * atoms + z] = dv;
            if (low) low[m * value_ld + z] = __float2bfloat16_rn(dv);
          }
        }
      } else if (value) {
        float dv = gh ? gh[e * atoms + z] : 0.f;
        for (int d = e * branches.per_member; d < (e + 1) * branches.per_member; ++d)
          dv += branch_dq_sum(dq_of(d, z), branches.size[d], q_step);
        dh[e * atoms + z] = dv;
        if (low) low[e * value_ld + z] = __float2bfloat16_rn(dv);
      } else {
        write_branch_grad(dq_of(y, z), gh, dh, low, branches, y, z, atoms, value_heads, q_step);
      }
    }
    if (low) {  // the padding columns 0, so padded GEMM sizes add nothing: every head's, or the column's one
      auto zero_padding = [&](int h) {  // h: a head in the padded order, the value heads first
        const bool is_value = h < value_heads;  // value head h at padded column h * value_ld
        const int64_t width = is_value ? atoms : int64_t(atoms) * branches.size[h - value_heads];
        zero_head_padding(low + (is_value ? h * value_ld : branches.pad_col[h - value_heads]), width, grp.col,
                          grp.width);
      };
      if (!split)
        for (int h = 0; h < value_heads + branches.count; ++h) zero_padding(h);
      else
        zero_padding(value ? e : y + value_heads);
    }
  }
}

// In place: d = relu_grad(h, d), the ReLU mask read off the saved BF16 activation
// (elementwise.cuh). Writes the BF16 copy for the `bf16` GEMMs when d_bf16 is not null.
__global__ void relu_backward_kernel(float* __restrict__ d, const __nv_bfloat16* __restrict__ h,
                                     __nv_bfloat16* __restrict__ d_bf16, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = relu_grad(__bfloat162float(h[i]), d[i]);
    d[i] = g;
    if (d_bf16) d_bf16[i] = __float2bfloat16_rn(g);
  }
}
// The same, 4 elements per thread (16-byte F32 and 8-byte BF16 accesses).
__global__ void relu_backward_x4_kernel(float4* __restrict__ d, const uint2* __restrict__ h, uint2* __restrict__ d_bf16,
                                        int64_t n4) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 m = unpack_bf16x4(h[i]), v = d[i];
    const float4 g = make_float4(relu_grad(m.x, v.x), relu_grad(m.y, v.y), relu_grad(m.z, v.z), relu_grad(m.w, v.w));
    d[i] = g;
    if (d_bf16) d_bf16[i] = pack_bf16x4(g.x, g.y, g.z, g.w);
  }
}

// IQN's layer backward (docs/iqn-design.md), a thread per (sample b, column t) of h_L [B, T]:
// from dz = d(z) [B * N, T] (z = h_L * phi, no ReLU of its own),
//   dh[b, t] = sum_i dz[b * N + i, t] phi[b * N + i, t]   (F32, i in order: deterministic)
//   dP[b * N + i, t] = phi > 0 ? dz h_L[b, t] : 0          (phi's pre-activation gradient)
// and dP's BF16 copy for the `bf16` GEMMs when dP_bf16 is not null. With dP_sums set (the bias
// gradient's column sums begun here: epilogue_column_sums), dP_sums[b, t] = sum_i dP[b * N + i,
// t], i in order, and dP itself may be null (not stored).
__global__ void iqn_backward_kernel(const float* __restrict__ dz, const __nv_bfloat16* __restrict__ h,
                                    const __nv_bfloat16* __restrict__ phi, float* __restrict__ dh,
                                    float* __restrict__ dP, __nv_bfloat16* __restrict__ dP_bf16,
                                    float* __restrict__ dP_sums, int64_t B, int64_t T, int64_t N) {
  pdl_enter();
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < B * T; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = j / T, t = j % T;
    const float hv = __bfloat162float(h[j]);
    float acc = 0.f, sum = 0.f;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t k = (b * N + i) * T + t;
      const float g = dz[k], p = __bfloat162float(phi[k]);
      acc += g * p;
      const float d = p > 0.f ? g * hv : 0.f;
      if (dP) dP[k] = d;
      if (dP_bf16) dP_bf16[k] = __float2bfloat16_rn(d);
      if (dP_sums) sum += d;
    }
    dh[j] = acc;
    if (dP_sums) dP_sums[j] = sum;
  }
}

// Up to kMaxUpcastJobs BF16 -> F32 copies in one launch (blockIdx.y picks the tensor).
constexpr int kMaxUpcastJobs = 8;
struct UpcastJobs {
  const __nv_bfloat16* src[kMaxUpcastJobs];
  float* dst[kMaxUpcastJobs];
  int64_t n[kMaxUpcastJobs];
};

__global__ void upcast_kernel(UpcastJobs jobs) {
  pdl_enter();
  const int j = blockIdx.y;
  const __nv_bfloat16* src = jobs.src[j];
  float* dst = jobs.dst[j];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < jobs.n[j]; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}

// Column sums of up to kMaxColumnSumJobs row-major F32 matrices [rows, cols_j] into dst_j:
// the bias gradients. Block (x, y) sums kColTile columns of one job over the rows of chunk y
// (kChunkRows rows): kRowLanes threads per column stride down the rows with 4 independent
// accumulators, then one fixed-order reduction in shared memory. With one chunk (rows <=
// kChunkRows) the block writes dst; otherwise it writes its chunk's partial sums and
// column_sum_chunks_kernel adds the chunks: a warp a column, lane l the chunks l, l + 32, ... in
// order, then the lanes' sums in a fixed shuffle tree (one thread adding every chunk in turn read
// hundreds a thread at IQN's fraction rows, a few in flight at a time). Deterministic: the order
// depends only on `rows`. Chunking the rows gives large batches enough blocks: one block per
// column tile over all rows leaves most of the GPU idle (48 blocks for the reference network).
constexpr int kColTile = 32, kRowLanes = 16, kRowUnroll = 4;
constexpr int64_t kChunkRows = 512;
constexpr int kMaxZeroRanges = 32;
constexpr int kMaxColumnSumJobs = 8;
struct ColumnSumJobs {
  const float* src[kMaxColumnSumJobs];
  float* dst[kMaxColumnSumJobs];
  int64_t cols[kMaxColumnSumJobs];
  int64_t first_block[kMaxColumnSumJobs + 1];  // job j owns column tiles [first_block[j], first_block[j+1])
  int64_t first_col[kMaxColumnSumJobs + 1];    // and columns [first_col[j], first_col[j+1]) of `partial`
  int count;
  int64_t rows;
  float* partial;  // [chunks, first_col[count]] when there is more than one chunk
  // The ranges [zero_begin, zero_end) of the gradient buffer that nothing else writes
  // (unwritten_ranges): block (0, 0) zeroes them, so the buffer needs no fill of its own.
  float* zero_base;
  int64_t zero_begin[kMaxZeroRanges], zero_end[kMaxZeroRanges];
  int zero_count;
};

// The job owning index i, given each job's first index (first_block or first_col).
__device__ __forceinline__ int column_sum_job(const int64_t* first, int count, int64_t i) {
  int j = 0;
  while (j + 1 < count && i >= first[j + 1]) ++j;
  return j;
}

__global__ void __launch_bounds__(kColTile* kRowLanes) column_sum_kernel(ColumnSumJobs jobs) {
  pdl_enter();
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    const int t = threadIdx.y * blockDim.x + threadIdx.x, n = blockDim.x * blockDim.y;
    for (int r = 0; r < jobs.zero_count; ++r)
      for (int64_t i = jobs.zero_begin[r] + t; i < jobs.zero_end[r]; i += n) jobs.zero_base[i] = 0.f;
  }
  const int j = column_sum_job(jobs.first_block, jobs.count, blockIdx.x);
  const int64_t cols = jobs.cols[j];
  const int64_t c = (blockIdx.x - jobs.first_block[j]) * kColTile + threadIdx.x;
  const int64_t r_end = std::min<int64_t>(jobs.rows, (blockIdx.y + 1) * kChunkRows);
  float s = 0.f;
  if (c < cols) {
    const float* src = jobs.src[j] + c;
    float acc[kRowUnroll] = {};
    int64_t r = blockIdx.y * kChunkRows + threadIdx.y;
    for (; r + (kRowUnroll - 1) * kRowLanes < r_end; r += kRowUnroll * kRowLanes)
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) acc[u] += src[(r + u * kRowLanes) * cols];
    for (; r < r_end; r += kRowLanes) acc[0] += src[r * cols];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) s += acc[u];
  }
  __shared__ float part[kRowLanes][kColTile];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = 0.f;
    for (int i = 0; i < kRowLanes; ++i) t += part[i][threadIdx.x];
    if (gridDim.y == 1) jobs.dst[j][c] = t;
    else jobs.partial[blockIdx.y * jobs.first_col[jobs.count] + jobs.first_col[j] + c] = t;
  }
}

constexpr int kChunkLanes = 32;  // a warp a column in column_sum_chunks_kernel
__global__ void column_sum_chunks_kernel(ColumnSumJobs jobs, int chunks) {
  pdl_enter();
  const int64_t total = jobs.first_col[jobs.count];
  const int lane = threadIdx.x % kChunkLanes;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kChunkLanes);
  // i is the warp's column, the same for all its lanes: every lane takes each iteration (the
  // shuffles' full mask).
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kChunkLanes; i < total; i += warps) {
    float t = 0.f;
    for (int k = lane; k < chunks; k += kChunkLanes) t += jobs.partial[k * total + i];
#pragma unroll
    for (int offset = kChunkLanes / 2; offset > 0; offset /= 2) t += __shfl_down_sync(0xffffffffu, t, offset);
    if (lane == 0) {
      const int j = column_sum_job(jobs.first_col, jobs.count, i);
      jobs.dst[j][i - jobs.first_col[j]] = t;
    }
  }
}

// A weight gradient dW = dY^T X over many rows (IQN's B x N fraction rows, large batches) has
// few output tiles and a long K: one cuBLAS GEMM runs it on a few SMs and leaves the rest idle.
// Split along K into `splits` row chunks, each chunk's product goes to a slice of a partial
// buffer, and sum_splits_kernel adds the slices in order: deterministic, the order fixed by the
// device's SM count, the layer's shape and the rows. kSplitMinRows: below it the GEMMs are short
// and the reduction's launch costs more than the split gains (bench/NOTES.md); kSplitMinChunk
// keeps each chunk's K long enough for the GEMM's own pipeline; kMaxSplits bounds the buffer.
constexpr int64_t kSplitMinRows = 32768, kSplitMinChunk = 1024, kMaxSplits = 16;

// How many K chunks dW [width, in_width] (count blocks) over `rows` takes: enough for about two
// 128 x 128 output tiles an SM, 1 (no split) below kSplitMinRows rows.
int64_t dw_splits(int64_t width, int64_t in_width, int64_t count, int64_t rows) {
  if (rows < kSplitMinRows) return 1;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t tiles = ((width + 127) / 128) * ((in_width + 127) / 128) * count;
  const int64_t wanted = (2 * sms + tiles - 1) / tiles;
  return std::max<int64_t>(1, std::min({wanted, kMaxSplits, rows / kSplitMinChunk}));
}

// dst_i[e] = sum over s in order of partial[s][i][e], for blocks i < count of n elements each,
// dst_i = dst + i * dst_stride: the split dW's slices into the flat gradient.
__global__ void sum_splits_kernel(const float* __restrict__ partial, int splits, int64_t count, int64_t n,
                                  float* __restrict__ dst, int64_t dst_stride) {
  pdl_enter();
  const int64_t total = count * n;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < total; j += int64_t(gridDim.x) * blockDim.x) {
    float t = 0.f;
    for (int s = 0; s < splits; ++s) t += partial[s * total + j];
    dst[(j / n) * dst_stride + j % n] = t;
  }
}

// The ranges of the flat gradient that backward_from_head's GEMMs and column sums leave
// unwritten: the layout's alignment gaps and, outside bf16 mode (whose output-head GEMMs run on
// the padded row count), the output heads' reserved rows. In order, disjoint.
std::vector<std::pair<int64_t, int64_t>> unwritten_ranges(const NetLayout& L, bool bf16) {
  std::vector<std::pair<int64_t, int64_t>> written = L.segments(/*padded_heads=*/bf16);
  std::sort(written.begin(), written.end());
  std::vector<std::pair<int64_t, int64_t>> gaps;
  int64_t at = 0;
  for (const auto& w : written) {
    if (w.first > at) gaps.emplace_back(at, w.first);
    at = std::max(at, w.first + w.second);
  }
  if (at < L.numel) gaps.emplace_back(at, L.numel);
  return gaps;
}

// F32 gradient of a layer's output and, in bf16 mode, its BF16 copy (the GEMM operand). Or, for
// a gradient whose F32 values only the bias gradient's column sums would read
// (epilogue_column_sums), the BF16 copy and `sums`, partial column sums of the F32 values, with
// f32 undefined: the dense kernel's by halves of its row tiles (dense_layer.h, col_sums) for a
// masked dZ, iqn_backward_kernel's by sample for IQN's dP.
struct Grad {
  Tensor f32, low, sums;
  const void* operand(bool bf16) const { return bf16 ? low.data_ptr() : f32.data_ptr(); }
  __nv_bfloat16* low_ptr() const { return low.defined() ? static_cast<__nv_bfloat16*>(low.data_ptr()) : nullptr; }
  // The rows whose column sums are the bias gradient.
  const Tensor& column_sum_rows() const { return sums.defined() ? sums : f32; }
};

// DQN_OPS_EPILOGUE_COLUMN_SUMS (switches.h): whether a bf16 backward's gradients that only a bias
// gradient's column sums would read in F32 keep partial column sums (Grad::sums) in place of the
// F32 values that the column-sum kernel would read back: a hidden layer's masked dZ on the dense
// kernel (its epilogue's tile sums) and IQN's dP (iqn_backward_kernel's per-sample sums). "auto",
// the default, from kEpilogueColumnSumMinRows rows, where the F32 gradient's write and read are
// the largest (IQN's fraction rows, where it measured faster: bench/NOTES.md; fewer rows were not
// timed); "off", never; "on", at any rows (the tests'). The bias gradients then
// differ from the other paths' in their summation order, so in rounding.
constexpr int64_t kEpilogueColumnSumMinRows = 32768;
bool epilogue_column_sums(int64_t rows) {
  static constexpr SwitchName kNames[] = {{"off", 0}, {"auto", 1}, {"on", 2}};
  static const int setting = env_switch("DQN_OPS_EPILOGUE_COLUMN_SUMS", kNames, 1);
  return setting == 2 || (setting == 1 && rows >= kEpilogueColumnSumMinRows);
}

// The backward from d(head logits) on: d_head.f32 compact [B, head_out], and in bf16 mode
// d_head.low in the padded layout [B, head_ld] with its padding columns 0. activations: the
// saved [states, h_1, ..., h_M] (BF16, checked by the caller).
std::tuple<Tensor, Tensor> backward_from_head(const Grad& d_head, at::TensorList activations, const Tensor& params,
                                              const Tensor& params_bf16, const NetLayout& L,
                                              BackwardPrecision precision, bool need_grad_states, const char* op) {
  // Kernels and cuBLAS must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(params.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t B = activations[0].size(0);
  const int64_t M = static_cast<int64_t>(L.hidden.size());  // hidden layer i's output: L.hidden_activation(i)
  const auto f32 = params.options();
  const auto bf16opt = params_bf16.options();
  const bool bf16 = precision == BackwardPrecision::kBF16;
  const cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F
                                      : precision == BackwardPrecision::kTF32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                               : CUBLAS_COMPUTE_32F_PEDANTIC;
  const cudaDataType_t op_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const size_t op_bytes = bf16 ? 2 : 4;
  auto at_elem = [&](const void* base, int64_t elem) {
    return static_cast<const void*>(static_cast<const char*>(base) + elem * op_bytes);
  };
  // GEMM operands of the chosen precision: dX reads the mirror (bf16) or the master (F32).
  const void* weights = bf16 ? params_bf16.data_ptr() : params.data_ptr();

  // Saved activations as GEMM operands: as saved (bf16) or upcast to F32, kMaxUpcastJobs per launch.
  std::vector<Tensor> acts_f32;
  if (!bf16) {
    for (const Tensor& a : activations) acts_f32.push_back(at::empty(a.sizes(), f32));
    for (size_t first = 0; first < activations.size(); first += kMaxUpcastJobs) {
      const int count = static_cast<int>(std::min<size_t>(kMaxUpcastJobs, activations.size() - first));
      UpcastJobs jobs{};
      int64_t most = 0;
      for (int i = 0; i < count; ++i) {
        jobs.src[i] = static_cast<const __nv_bfloat16*>(activations[first + i].data_ptr());
        jobs.dst[i] = acts_f32[first + i].data_ptr<float>();
        jobs.n[i] = activations[first + i].numel();
        most = std::max(most, jobs.n[i]);
      }
      launch(upcast_kernel, dim3(blocks_for(most, kThreads), count), kThreads, 0, stream, jobs);
    }
  }
  auto act = [&](int64_t i) { return bf16 ? activations[i].data_ptr() : acts_f32[i].data_ptr(); };
  auto make_grad = [&](int64_t rows, int64_t cols) {
    return Grad{at::empty({rows, cols}, f32), bf16 ? at::empty({rows, cols}, bf16opt) : Tensor()};
  };
  // A layer's input gradient: layer_backward makes its F32 part where it writes one.
  auto make_dx = [&](int64_t rows, int64_t cols) {
    return Grad{Tensor(), bf16 ? at::empty({rows, cols}, bf16opt) : Tensor()};
  };

  // The few elements no GEMM or column sum writes are zeroed by the column-sum kernel (a fill
  // of the whole buffer would be a launch of its own, which counts at small batches); with
  // more ranges than its parameters hold, the whole buffer is zeroed first.
  const std::vector<std::pair<int64_t, int64_t>> gaps = unwritten_ranges(L, bf16);
  const bool zero_in_column_sums = gaps.size() <= static_cast<size_t>(kMaxZeroRanges);
  Tensor grad = zero_in_column_sums ? at::empty({L.numel}, f32) : at::zeros({L.numel}, f32);
  float* g = grad.data_ptr<float>();

  // dW and dX of one layer of blocks (a dense layer is one block; the output heads are the
  // output layer's blocks) from dY, the gradient of its output (dy_ld elements between rows),
  // and its saved input, activation `in`: dW_k = dY_k^T X_k and dX_k = dY_k W_k on block k's
  // column slices, into dx [B, width of activation `in`] unless dx is null. A group of
  // same-shape blocks (block_groups) runs as one strided-batched GEMM. The dW GEMMs run on the
  // side stream (nothing in the chain reads them: the column sums write the bias segments),
  // joined before the gradient is returned; dX goes on along the chain.
  //
  // In bf16 mode dY is the BF16 copy and a block's columns start at its pad_col: for the output
  // heads the padded layout, whose padding columns are 0, so their GEMMs run on pad_width
  // (aligned operands, sizes multiples of 8), the padding rows of W add 0 to dX and their dW
  // rows are 0; a hidden layer's blocks have no padding (pad_col = out_col). The tf32 / fp32
  // checks read the compact F32 dY on the exact sizes.
  //
  // A block's dX either writes the next columns of dx or, where its input is one an earlier
  // block of the layer read (the output heads with H = 0: every head reads all of h_L), adds
  // its product to them (beta 1). Blocks sharing an input within a group (in_col_stride 0)
  // therefore run one GEMM each: one batch cannot add into one matrix.
  // The tensors the side stream reads live past the join: declared before `side`, they are
  // destroyed after its destructor joins, should an exception leave this function early.
  Grad d_out;                                  // the gradient flowing down the layers
  std::vector<std::pair<Grad, int64_t>> d_z;   // each layer's dZ (and IQN's dP) with its bias offset
  Tensor partial;                              // the column sums' chunks
  SideStream side(params.device());
  // dX in one launch of the dense kernel (dense_layer.h, kInputGrad: W read as stored, the next
  // ReLU's mask and the BF16 copy in its epilogue) where it applies: bf16 mode, blocks whose input
  // columns are disjoint. `mask`: the input activation where it is a ReLU's output, else null (no
  // mask, no BF16 copy: nothing reads it). `sums_only`: dx gets the column sums in place of its
  // F32 part (Grad::sums; a mask needed), else dx.f32 must be allocated. Returns whether it ran.
  auto input_grad_kernel = [&](const std::vector<HeadGroup>& groups, const void* dy, int64_t dy_ld, int64_t rows,
                               int64_t x_ld, Grad& dx, const __nv_bfloat16* mask, bool sums_only) {
    if (!bf16) return false;
    TORCH_INTERNAL_ASSERT(sums_only ? mask != nullptr : dx.f32.defined());
    const Tensor sums =
        sums_only ? at::empty({dense_column_sum_rows(rows, kDenseMinTileRows), x_ld}, f32) : Tensor();
    DenseLaunch dense(DenseEpilogue::kInputGrad);
    for (const HeadGroup& grp : groups) {
      const HeadSlice& s = grp.first;
      // A batch must tile its input columns: stride 0 (the output heads with H = 0) means their
      // products add up, which one launch cannot do.
      if (grp.count > 1 && grp.in_col_stride != s.in_width) return false;
      DenseProblem p;
      p.x = static_cast<const __nv_bfloat16*>(dy) + s.pad_col;
      p.x_ld = dy_ld;
      p.x_stride = grp.pad_col_stride;
      p.w = static_cast<const __nv_bfloat16*>(weights) + s.w_off;
      p.w_ld = s.in_width;
      p.w_stride = grp.w_stride;
      p.out = sums_only ? nullptr : dx.f32.data_ptr<float>() + s.in_col;
      p.col_sums = sums_only ? sums.data_ptr<float>() + s.in_col : nullptr;
      p.out_ld = x_ld;
      p.out_stride = grp.in_col_stride;
      p.aux = mask ? mask + s.in_col : nullptr;
      p.out_bf16 = mask ? dx.low_ptr() + s.in_col : nullptr;
      p.rows = rows;
      p.N = s.in_width;
      p.K = s.pad_width;
      p.batch = grp.count;
      if (!dense.add(p)) return false;
    }
    // The groups in order, each right after the one before: their columns cover dx once.
    int64_t next = 0;
    for (const HeadGroup& grp : groups) {
      if (grp.first.in_col != next) return false;
      next += grp.count * grp.first.in_width;
    }
    if (next != x_ld || !dense_applies(dense)) return false;
    const int tile_rows = dense_launch(dense, stream);
    if (sums_only) dx.sums = sums.narrow(0, 0, dense_column_sum_rows(rows, tile_rows));
    return true;
  };
  // Returns whether dx holds the masked gradient and its BF16 copy (the dense kernel ran with a
  // mask), so that the next relu_backward pass is not needed.
  auto layer_backward = [&](const std::vector<HeadSlice>& blocks, const void* dy, int64_t dy_ld, int64_t in,
                            Grad* dx, const std::string& what) {
    const int64_t x_ld = L.activation_width(in), rows = activations[in].size(0);
    const std::vector<HeadGroup> groups = block_groups(blocks);
    side.fork();
    side.run([&] {
      const std::string what_dw = what + " dW";
      for (const HeadGroup& grp : groups) {
        const HeadSlice& s = grp.first;
        const int64_t col = bf16 ? s.pad_col : s.out_col, width = bf16 ? s.pad_width : s.out_width;
        const int64_t dy_stride = bf16 ? grp.pad_col_stride : grp.out_col_stride;
        // `batch` dW GEMMs over k rows, the first of rows [r0, r0 + k) of block i, each next one's
        // operands dy_batch and x_batch elements further (the next block's columns, or the next
        // chunk's rows), their products at C, c_stride apart: the one place dW's operands are
        // addressed, for the blocks (batched over them) and the split's row chunks (a launch a
        // block, batched over its chunks).
        auto dw_gemm = [&](int64_t r0, int64_t k, int64_t i, int64_t dy_batch, int64_t x_batch, float* C,
                           int64_t c_stride, int64_t batch) {
          gemm_strided_batched(op, what_dw.c_str(), width, s.in_width, k,
                               Operand{at_elem(dy, r0 * dy_ld + col + i * dy_stride), op_type, dy_ld, true},
                               dy_batch,
                               Operand{at_elem(act(in), r0 * x_ld + s.in_col + i * grp.in_col_stride), op_type,
                                       x_ld, false},
                               x_batch, C, CUDA_R_32F, s.in_width, c_stride, batch, compute);
        };
        // Rows [r0, r0 + k) of every block of the group into C (block i at C + i * c_stride).
        auto dw_blocks = [&](int64_t r0, int64_t k, float* C, int64_t c_stride) {
          dw_gemm(r0, k, 0, dy_stride, grp.in_col_stride, C, c_stride, grp.count);
        };
        const int64_t splits = dw_splits(width, s.in_width, grp.count, rows);
        if (splits == 1) {
          dw_blocks(0, rows, g + s.w_off, grp.w_stride);
          continue;
        }
        // Chunks of `chunk` rows (a multiple of 64), the last one shorter: slice c of `slices`
        // holds chunk c's products, [count, width, in_width].
        const int64_t chunk = ((rows + splits - 1) / splits + 63) / 64 * 64;
        const int64_t slices = (rows + chunk - 1) / chunk, full = rows / chunk;
        const int64_t n = width * s.in_width, slice = grp.count * n;
        // Allocated on the side stream: freed into its pool, which only work queued after this on the
        // same stream (or, in a capture, the graph's pool on it) reuses.
        const Tensor partial_dw = at::empty({slices * slice}, f32);
        float* P = partial_dw.data_ptr<float>();
        // A launch per block, batched over the full chunks (their rows chunk * ld apart).
        for (int64_t i = 0; i < grp.count; ++i)
          dw_gemm(0, chunk, i, chunk * dy_ld, chunk * x_ld, P + i * n, slice, full);
        if (slices > full) dw_blocks(full * chunk, rows - full * chunk, P + full * slice, n);
        launch(sum_splits_kernel, blocks_for(slice, kThreads), kThreads, 0, at::cuda::getCurrentCUDAStream(), P,
               static_cast<int>(slices), grp.count, n, g + s.w_off, grp.w_stride);
      }
    });
    if (dx == nullptr) return false;
    const auto* mask = L.relu_output(static_cast<size_t>(in))
                           ? static_cast<const __nv_bfloat16*>(activations[in].data_ptr())
                           : nullptr;
    if (mask && epilogue_column_sums(rows) && input_grad_kernel(groups, dy, dy_ld, rows, x_ld, *dx, mask, true))
      return true;
    if (!dx->f32.defined()) dx->f32 = at::empty({rows, x_ld}, f32);
    if (input_grad_kernel(groups, dy, dy_ld, rows, x_ld, *dx, mask, false)) return mask != nullptr;
    float* const dx_f32 = dx->f32.data_ptr<float>();
    const std::string what_dx = what + " dX";
    int64_t written = 0;  // dx's columns [0, written) hold a product
    for (const HeadGroup& grp : groups) {
      const HeadSlice& s = grp.first;
      const int64_t col = bf16 ? s.pad_col : s.out_col, width = bf16 ? s.pad_width : s.out_width;
      const int64_t dy_stride = bf16 ? grp.pad_col_stride : grp.out_col_stride;
      const int64_t batch = grp.in_col_stride == 0 ? 1 : grp.count;
      for (int64_t i = 0; i < grp.count; i += batch) {
        const int64_t in_col = s.in_col + i * grp.in_col_stride;
        const int64_t end = in_col + (batch - 1) * grp.in_col_stride + s.in_width;
        const bool adds = end <= written;
        // parse_layout guarantees one of the two: blocks that partition the input columns in
        // order, or output heads that all read the whole input.
        DQN_CHECK((adds || in_col == written) && (batch == 1 || grp.in_col_stride == s.in_width), op, ": ", what,
                  ": block input columns [", in_col, ", ", end, ") neither follow nor repeat the ", written,
                  " columns before them (the layout should have been rejected)");
        gemm_strided_batched(op, what_dx.c_str(), rows, s.in_width, width,
                             Operand{at_elem(dy, col + i * dy_stride), op_type, dy_ld, false}, dy_stride,
                             Operand{at_elem(weights, s.w_off + i * grp.w_stride), op_type, s.in_width, false},
                             grp.w_stride, dx_f32 + in_col, CUDA_R_32F, x_ld, grp.in_col_stride, batch, compute,
                             adds ? 1.f : 0.f);
        written = std::max(written, end);
      }
    }
    DQN_CHECK(written == x_ld, op, ": ", what, ": the blocks read ", written, " of the ", x_ld,
              " input columns (the layout should have been rejected)");
    return false;
  };

  // Output heads: dY = d_head, into d(last hidden activation).
  const int64_t last = static_cast<int64_t>(L.num_activations()) - 1;
  d_out = make_dx(activations[last].size(0), L.head_in_width);
  bool d_out_masked = layer_backward(L.heads, bf16 ? d_head.low.data_ptr() : d_head.f32.data_ptr(),
                                     bf16 ? L.head_ld : L.head_out, last, &d_out, "output heads");

  // Hidden layers, last to first: dZ = mask . dH (in place), dW = dZ^T X, dX = dZ W. The mask
  // and the BF16 copy of a dX are the dense kernel's epilogue's (d_out_masked) or else the next
  // relu_backward's. d_z keeps each layer's dZ for its bias gradient (and IQN's dP for b_phi's),
  // with its bias offset, last layer first.
  for (int64_t i = M - 1; i >= 0; --i) {
    if (L.iqn() && i == L.trunk_layers - 1) {
      // d_out is d(z) on the B * N fraction rows: into d(h_L) [B, T] and phi's dP, dW_phi = dP^T c.
      TORCH_INTERNAL_ASSERT(d_out.f32.defined());  // z is no ReLU's output: its dX is stored whole
      const int64_t T = L.phi.out_width, rows = activations[L.z_activation()].size(0);
      // In bf16 dP's F32 values are read by b_phi's column sums alone: under the switch each
      // sample's sum of its fraction rows takes their place (Grad::sums, [B, T]).
      const bool sum_dP_by_sample = bf16 && epilogue_column_sums(rows);
      Grad dP = sum_dP_by_sample ? Grad{Tensor(), at::empty({rows, T}, bf16opt), at::empty({B, T}, f32)}
                                 : make_grad(rows, T);
      Grad dh = make_grad(B, T);
      const auto* h_L = static_cast<const __nv_bfloat16*>(activations[L.hidden_activation(i)].data_ptr());
      const auto* phi = static_cast<const __nv_bfloat16*>(activations[L.phi_activation()].data_ptr());
      auto ptr_or_null = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
      launch(iqn_backward_kernel, blocks_for(B * T, kThreads), kThreads, 0, stream, d_out.f32.data_ptr<float>(), h_L,
             phi, dh.f32.data_ptr<float>(), ptr_or_null(dP.f32), dP.low_ptr(), ptr_or_null(dP.sums), B, T, rows / B);
      layer_backward(L.phi.blocks, dP.operand(bf16), T, static_cast<int64_t>(L.cos_activation()), nullptr, "phi");
      d_z.emplace_back(std::move(dP), L.phi.b_off);
      d_out = std::move(dh);
      d_out_masked = false;
    }
    const HiddenLayer& layer = L.hidden[i];
    const int64_t out = static_cast<int64_t>(L.hidden_activation(static_cast<size_t>(i)));
    const int64_t rows = activations[out].size(0), n = rows * layer.out_width;
    if (!d_out_masked) {
      float* d = d_out.f32.data_ptr<float>();
      const auto* h = static_cast<const __nv_bfloat16*>(activations[out].data_ptr());
      __nv_bfloat16* d_low = d_out.low_ptr();
      if (n % 4 == 0 && aligned16(d, h, d_low))
        launch(relu_backward_x4_kernel, blocks_for(n / 4, kThreads), kThreads, 0, stream, reinterpret_cast<float4*>(d),
               reinterpret_cast<const uint2*>(h), reinterpret_cast<uint2*>(d_low), n / 4);
      else
        launch(relu_backward_kernel, blocks_for(n, kThreads), kThreads, 0, stream, d, h, d_low, n);
    }
    const bool need_dx = i > 0 || need_grad_states;
    Grad d_in = need_dx ? make_dx(rows, layer.in_width) : Grad{};
    d_out_masked = layer_backward(layer.blocks, d_out.operand(bf16), layer.out_width, out - 1,
                                  need_dx ? &d_in : nullptr, hidden_layer_name(L, static_cast<size_t>(i)));
    d_z.emplace_back(std::move(d_out), layer.b_off);
    d_out = std::move(d_in);
  }

  // Bias gradients, column sums of b_out's dY and each hidden layer's dZ (last layer first; the
  // partial sums where a dZ or dP has them, Grad::sums): kMaxColumnSumJobs of equal row
  // counts per launch, the most rows first (IQN's fraction rows, then the samples' and the
  // partial sums', in the order of their row counts), plus one more past kChunkRows rows; the
  // first also zeroes the gaps.
  std::vector<std::pair<const Tensor*, int64_t>> bias_groups = {{&d_head.f32, L.b_out}};
  for (const auto& dz : d_z) bias_groups.emplace_back(&dz.first.column_sum_rows(), dz.second);
  // The most rows first, ties in order: equal row counts next to each other share launches.
  std::stable_sort(bias_groups.begin(), bias_groups.end(),
                   [](const auto& a, const auto& b) { return a.first->size(0) > b.first->size(0); });
  // `partial` is reused by every launch: they run in stream order
  for (size_t first = 0, count = 0; first < bias_groups.size(); first += count) {
    const int64_t rows = bias_groups[first].first->size(0);
    count = 1;
    while (count < static_cast<size_t>(kMaxColumnSumJobs) && first + count < bias_groups.size() &&
           bias_groups[first + count].first->size(0) == rows)
      ++count;
    const int64_t chunks = std::max<int64_t>(1, (rows + kChunkRows - 1) / kChunkRows);
    DQN_CHECK(chunks <= 65535, op, ": batch too large for the bias-gradient kernel (", rows, " rows)");
    ColumnSumJobs jobs{};
    jobs.count = static_cast<int>(count);
    jobs.rows = rows;
    jobs.zero_base = g;
    jobs.zero_count = first == 0 && zero_in_column_sums ? static_cast<int>(gaps.size()) : 0;
    for (int r = 0; r < jobs.zero_count; ++r) {
      jobs.zero_begin[r] = gaps[r].first;
      jobs.zero_end[r] = gaps[r].second;
    }
    jobs.first_block[0] = jobs.first_col[0] = 0;
    for (int j = 0; j < jobs.count; ++j) {
      const auto& bias = bias_groups[first + j];
      jobs.src[j] = bias.first->data_ptr<float>();
      jobs.cols[j] = bias.first->size(1);
      jobs.dst[j] = g + bias.second;
      jobs.first_block[j + 1] = jobs.first_block[j] + (jobs.cols[j] + kColTile - 1) / kColTile;
      jobs.first_col[j + 1] = jobs.first_col[j] + jobs.cols[j];
    }
    const int64_t cols = jobs.first_col[jobs.count];
    if (chunks > 1) {
      if (!partial.defined() || partial.numel() < chunks * cols) partial = at::empty({chunks * cols}, f32);
      jobs.partial = partial.data_ptr<float>();
    }
    launch(column_sum_kernel,
           dim3(static_cast<unsigned>(jobs.first_block[jobs.count]), static_cast<unsigned>(chunks)),
           dim3(kColTile, kRowLanes), 0, stream, jobs);
    if (chunks > 1)
      launch(column_sum_chunks_kernel, blocks_for(cols * kChunkLanes, kThreads), kThreads, 0, stream, jobs,
             static_cast<int>(chunks));
  }

  side.join();  // the dW GEMMs
  // d_out is now d(states) (undefined without need_grad_states).
  Tensor grad_states = need_grad_states ? d_out.f32 : at::empty({0}, f32);
  return {grad, grad_states};
}

std::tuple<Tensor, Tensor> mixed_backward_cuda(const c10::optional<Tensor>& grad_q,
                                               const c10::optional<Tensor>& grad_head, at::TensorList activations,
                                               const Tensor& params, const Tensor& params_bf16,
                                               c10::IntArrayRef layout, c10::string_view precision_str,
                                               bool need_grad_states) {
  const char* op = kBackwardOp;
  const NetLayout L = parse_layout(layout, op);
  const std::string precision_s(precision_str);
  const SavedBatch batch = check_backward_args(grad_q, grad_head, activations, params, params_bf16, L, precision_s);
  const BackwardPrecision precision = parse_precision(precision_s, op);
  const BranchTable branches = make_branch_table(L, op);
  const c10::cuda::CUDAGuard guard(params.device());
  const int64_t rows = batch.B * batch.N;  // the head logits' rows: one per (sample, fraction) with IQN
  const bool bf16 = precision == BackwardPrecision::kBF16;
  Grad d_head{at::empty({rows, L.head_out}, params.options()),
              bf16 ? at::empty({rows, L.head_ld}, params_bf16.options()) : Tensor()};
  launch_dueling_backward(grad_q.has_value() ? grad_q->data_ptr<float>() : nullptr,
                          grad_head.has_value() ? grad_head->data_ptr<float>() : nullptr, d_head.f32.data_ptr<float>(),
                          d_head.low_ptr(), rows, L, branches, at::cuda::getCurrentCUDAStream(), batch.N);
  return backward_from_head(d_head, activations, params, params_bf16, L, precision, need_grad_states, op);
}

// _mixed_backward_from_head (the trainer's fused path; csrc/dqn_ops.cpp): the gradient of the
// head logits comes from _dqn_loss_on_logits, already in both layouts; no dueling step.
Tensor mixed_backward_from_head_cuda(const Tensor& grad_head, const Tensor& grad_head_bf16, at::TensorList activations,
                                     const Tensor& params, const Tensor& params_bf16, c10::IntArrayRef layout,
                                     c10::string_view precision_str) {
  const char* op = kBackwardFromHeadOp;
  const NetLayout L = parse_layout(layout, op);
  const std::string precision_s(precision_str);
  check_backward_from_head_args(grad_head, grad_head_bf16, activations, params, params_bf16, L, precision_s);
  const BackwardPrecision precision = parse_precision(precision_s, op);
  return std::get<0>(
      backward_from_head(Grad{grad_head, grad_head_bf16}, activations, params, params_bf16, L, precision, false, op));
}

}  // namespace

void launch_dueling_backward(const float* grad_q, const float* grad_head, float* d_head, __nv_bfloat16* d_head_bf16,
                             int64_t rows, const NetLayout& L, const BranchTable& branches, cudaStream_t stream,
                             int64_t slots) {
  const unsigned row_blocks = row_group_blocks(rows, L.atoms, kThreads);
  const bool split = split_heads(row_blocks);
  const dim3 grid(row_blocks, split ? static_cast<unsigned>(branches.count + value_heads_of(branches)) : 1);
  launch(dueling_backward_kernel, grid, kThreads, 0, stream, grad_q, grad_head, d_head, d_head_bf16, L.head_ld, rows,
         static_cast<int>(L.atoms), L.head_out, static_cast<int>(L.q_rows()), branches, slots, split);
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("mixed_backward", &cuda::mixed_backward_cuda);
  m.impl("_mixed_backward_from_head", &cuda::mixed_backward_from_head_cuda);
}

}  // namespace dqn_ops

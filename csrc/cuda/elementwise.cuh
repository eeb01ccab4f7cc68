// Helpers of the elementwise and row-wise kernels.
//
// Launch shape of the row-wise kernels (forward bias + ReLU, output bias + dueling, dueling
// backward): a group of `width` threads per row, one per column (striding when the row is
// wider than the block), as many rows per block as fit. Consecutive threads read consecutive
// columns, no index needs a 64-bit division (a per-element `i % cols` cost more than the
// memory traffic), and narrow rows (51 atoms, 64 float4s) do not leave most of a block idle,
// as a block per row would.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

namespace dqn_ops {
namespace cuda {

struct RowGroup {
  int width;           // threads per row
  int rows_per_block;  // rows a block takes at a time
  int col;             // this thread's first column
  int64_t first_row;   // this thread's first row (grid-striding by row_stride)
  int64_t row_stride;
  bool idle;           // the block's last threads when blockDim.x is not a multiple of width
};

__device__ inline RowGroup row_group(int64_t cols) {
  RowGroup g;
  g.width = static_cast<int>(cols < blockDim.x ? cols : blockDim.x);
  g.rows_per_block = blockDim.x / g.width;
  const int local_row = threadIdx.x / g.width;
  g.col = threadIdx.x - local_row * g.width;
  g.idle = local_row >= g.rows_per_block;
  g.first_row = int64_t(blockIdx.x) * g.rows_per_block + local_row;
  g.row_stride = int64_t(gridDim.x) * g.rows_per_block;
  return g;
}

// Blocks of `threads` for row_group over [rows, cols] (cols >= 1); grid-strides past 65536.
inline unsigned row_group_blocks(int64_t rows, int64_t cols, int threads) {
  const int64_t per_block = threads / std::min<int64_t>(cols, threads);
  return static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, 1 << 16));
}

// The hidden layers' ReLU: `v < 0 ? 0 : v` keeps a NaN a NaN (as torch.relu does), so a
// non-finite input stays visible downstream.
__device__ __forceinline__ float relu_keep_nan(float v) { return v < 0.f ? 0.f : v; }

// ReLU's backward: the gradient d of its output where the output h was positive, else 0. The mask
// reads the saved BF16 activation (BF16 keeps F32's exponent range, so h > 0 exactly where the F32
// pre-activation was); a NaN d passes where h > 0, a NaN h masks.
__device__ __forceinline__ float relu_grad(float h, float d) { return h > 0.f ? d : 0.f; }

// Four floats rounded to BF16 and packed for one 8-byte store.
__device__ __forceinline__ uint2 pack_bf16x4(float a, float b, float c, float d) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  return make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}
__device__ __forceinline__ float4 unpack_bf16x4(uint2 v) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// IQN's embedding input c[r, k] = bf16(cos(pi * k * tau[r])) (docs/iqn-design.md): the argument
// k * tau in F32, cospif (accurate to an ulp of F32) before the rounding to BF16. iqn_cosine is
// one column's F32 cosine; iqn_cosines8 columns k0 .. k0 + 7 of fraction t, rounded and packed for
// one 16-byte store (iqn_cosines_kernel, and the dense layer kernel where it forms phi's input).
__device__ __forceinline__ float iqn_cosine(float t, int k) { return cospif(float(k) * t); }
__device__ __forceinline__ uint4 iqn_cosines8(float t, int k0) {
  const uint2 lo = pack_bf16x4(iqn_cosine(t, k0), iqn_cosine(t, k0 + 1), iqn_cosine(t, k0 + 2), iqn_cosine(t, k0 + 3));
  const uint2 hi =
      pack_bf16x4(iqn_cosine(t, k0 + 4), iqn_cosine(t, k0 + 5), iqn_cosine(t, k0 + 6), iqn_cosine(t, k0 + 7));
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// IQN's z = bf16(h * phi) of two columns, each pair packed in a 32-bit word (z[r] = h_L[r / N] *
// phi[r]): the product of two BF16 values is exact in F32, so z is rounded once.
__device__ __forceinline__ unsigned bf16_product2(unsigned h, unsigned phi) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&phi));
  const __nv_bfloat162 z = __floats2bfloat162_rn(a.x * b.x, a.y * b.y);
  return *reinterpret_cast<const unsigned*>(&z);
}

// Whether every pointer is 16-byte aligned: the x4 kernels' float4 / 8-byte BF16 accesses
// (null pointers, unused operands, pass).
template <typename... Ptrs>
inline bool aligned16(const Ptrs*... ptrs) {
  return ((reinterpret_cast<uintptr_t>(ptrs) % 16 == 0) && ...);
}

}  // namespace cuda
}  // namespace dqn_ops

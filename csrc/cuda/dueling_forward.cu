// bf16_dueling_forward on CUDA: BF16 x BF16 -> F32 GEMMs (COMPUTE_32F) on torch's cuBLAS
// handle, with bias + ReLU + BF16 cast fused into one pass after each hidden layer's GEMMs; a
// dense hidden layer (a trunk layer, the heads' merged first layer) is instead one launch of
// dqn_ops's own GEMM with the bias + ReLU + cast in its epilogue (dense_layer.h), and the output
// layer one launch of it for every head, where its switch gives it the layer
// (csrc/dense_layer_mode.h; by default hidden layers of >= 128 outputs, and output layers of up
// to a bound of rows a network: dense_layer.cu).
//
// Launches, for L trunk layers and H head layers, with the dense layer kernel:
//   1 (states -> BF16)
//   + L for the trunk
//   + (H >= 1) 1 for head layer 1: every head's first layer is one GEMM over the adjacent rows
//     of W_h1
//   + for each head layer 2..H, a GEMM per group of its blocks (NetLayout's block_groups: the
//     value head's, then the branch heads' as one strided batch when they share a shape) + 1
//     bias/ReLU
//   + 1 for the output layer (without the kernel, a GEMM per head group: head_groups)
//   + 1 (output bias + dueling aggregation)
// = L + 3H + 1 for H >= 1 with two block groups a head layer: 6 for the reference config (L = 2,
// H = 1). A dense layer the kernel does not take is a GEMM and a bias + ReLU pass (two
// launches); on fewer than 8 states the first trunk layer is one launch of
// narrow_input_layer_kernel.
// _online_and_target_logits, the trainer's fused path, stops before the last kernel, and runs
// the online network on [s; s'] and the target network on s' together: with batch_networks,
// each hidden layer of both networks is one launch of the dense layer kernel or of the
// bias + ReLU pass, and each single-block group (a dense layer's, the value head's) one
// strided-batched GEMM (for the reference config 3 launches fewer than two passes, one per
// dense layer; the target then also runs on s, rows it does not need); both output layers are
// one launch of the kernel (or their GEMMs, the target's on a side stream).
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "branch_table.cuh"
#include "dense_layer.h"
#include "dueling.cuh"
#include "elementwise.cuh"
#include "forward.h"
#include "gemm.cuh"
#include "network_args.h"
#include "pdl.cuh"
#include "side_stream.h"
#include "switches.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;
constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // per thread, in the output-bias + dueling kernel

// states -> BF16; the x4 version takes 4 elements a thread (16-byte loads) where n and both
// pointers allow it.
__global__ void cast_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void cast_to_bf16_x4_kernel(const float4* __restrict__ in, uint2* __restrict__ out, int64_t n4) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    out[i] = pack_bf16x4(v.x, v.y, v.z, v.w);
  }
}

// out = bf16(relu(z + bias)), z [rows, cols] row-major, bias = bias_lo for the rows before
// `split` and bias_hi from there (two networks' layers stacked: hidden_layers); the x4 version
// takes 4 consecutive columns a thread (16-byte loads, 8-byte stores). `v < 0 ? 0 : v` keeps a
// NaN a NaN (relu_keep_nan).
// The x4 form, 4 consecutive columns' z and bias, packed for one 8-byte store.
__device__ __forceinline__ uint2 bias_relu_bf16x4(float4 z, float4 b) {
  return pack_bf16x4(relu_keep_nan(z.x + b.x), relu_keep_nan(z.y + b.y), relu_keep_nan(z.z + b.z),
                     relu_keep_nan(z.w + b.w));
}

__global__ void bias_relu_bf16_kernel(const float* __restrict__ z, const float* __restrict__ bias_lo,
                                      const float* __restrict__ bias_hi, int64_t split,
                                      __nv_bfloat16* __restrict__ out, int64_t rows, int64_t cols) {
  pdl_enter();
  const RowGroup g = row_group(cols);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < rows; r += g.row_stride) {
    const float* bias = r < split ? bias_lo : bias_hi;
    for (int64_t c = g.col; c < cols; c += g.width)
      out[r * cols + c] = __float2bfloat16_rn(relu_keep_nan(z[r * cols + c] + bias[c]));
  }
}
__global__ void bias_relu_bf16_x4_kernel(const float4* __restrict__ z, const float4* __restrict__ bias_lo,
                                         const float4* __restrict__ bias_hi, int64_t split,
                                         uint2* __restrict__ out, int64_t rows, int64_t cols4) {
  pdl_enter();
  const RowGroup g = row_group(cols4);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < rows; r += g.row_stride) {
    const float4* bias = r < split ? bias_lo : bias_hi;
    for (int64_t c = g.col; c < cols4; c += g.width)
      out[r * cols4 + c] = bias_relu_bf16x4(z[r * cols4 + c], bias[c]);
  }
}

// The first hidden layer where its input rows are narrower than 16 bytes (fewer than
// kNarrowInputWidth states): cuBLAS runs such a GEMM on an Ampere kernel that reads the rows 4
// bytes at a time, and the bias + ReLU would be a second launch, so this kernel computes the
// layer in one pass. out[R, 4c..4c+4) = bf16(relu(x[r] . W[j] + b[j])) over R < count * rows
// (rows R >= rows: the second network, on the same x), the K products summed in k order in F32
// from 0, then the F32 bias: the formula of the GEMM + bias_relu pair (a BF16 x BF16 product is
// exact in F32; the GEMM's summation order may differ). A thread per 4 consecutive outputs of a
// row (row_group); W [cols4 * 4, K] row-major.
constexpr int64_t kNarrowInputWidth = 8;
__global__ void narrow_input_layer_kernel(const __nv_bfloat16* __restrict__ x, int k_width,
                                          const __nv_bfloat16* __restrict__ w_lo,
                                          const __nv_bfloat16* __restrict__ w_hi, const float4* __restrict__ bias_lo,
                                          const float4* __restrict__ bias_hi, int64_t rows, uint2* __restrict__ out,
                                          int64_t all_rows, int64_t cols4) {
  pdl_enter();
  const RowGroup g = row_group(cols4);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < all_rows; r += g.row_stride) {
    const bool second = r >= rows;
    const __nv_bfloat16* xr = x + (second ? r - rows : r) * k_width;
    const __nv_bfloat16* w = second ? w_hi : w_lo;
    const float4* bias = second ? bias_hi : bias_lo;
    for (int64_t c = g.col; c < cols4; c += g.width) {
      const __nv_bfloat16* wc = w + 4 * c * k_width;
      float a[4] = {0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < k_width; ++k) {
        const float xk = __bfloat162float(xr[k]);
#pragma unroll
        for (int o = 0; o < 4; ++o) a[o] = fmaf(xk, __bfloat162float(wc[o * k_width + k]), a[o]);
      }
      out[r * cols4 + c] = bias_relu_bf16x4(make_float4(a[0], a[1], a[2], a[3]), bias[c]);
    }
  }
}

// From the output layer's GEMM results in the padded layout (logits [rows, head_ld], see
// NetLayout::head_ld) writes head = logits + b_out in the compact layout [rows, head_out] (head
// may be null: not written) and q[b, action, z]: with dueling the aggregate (dueling.cuh), else
// the branch head's biased logit itself (there is no value head: branch d's columns start at
// atoms * first, not atoms * (1 + first)); an ensemble's members each with its own value head
// (BranchTable's entries). A thread per (row, atom) (row_group) walks the branch entries of its
// block column, [blockIdx.y * entries, + entries) (split_heads: every entry, or one), in turn:
// an entry's logits are loaded together (kLoadsInFlight at a time: one memory latency per
// branch, not one per action) and read again, from L1, for the dueling q instead of from
// `head`; a member's value logit is read at its first entry in the column (and written to
// `head` at its first entry).
// kStaged (one atom, whole rows a block: launch_head_bias_dueling): a thread a row walks every
// entry of its row in turn, so its loads would be a latency each (one per branch, the rows'
// strided columns); instead the block first copies its rows' logits to shared memory in 16-byte
// loads of consecutive rows (rows are head_ld apart: the block's rows are one span of memory),
// row r at r * (head_ld + 1) (odd: a warp's reads of one column of 32 rows on distinct banks),
// and each thread reads its row there. The same arithmetic either way.
template <bool kStaged>
__global__ void __launch_bounds__(kThreads) head_bias_dueling_kernel(const float* __restrict__ logits,
                                                                     int64_t head_ld, const float* __restrict__ b_out,
                                                                     float* __restrict__ head, float* __restrict__ q,
                                                                     int64_t rows, int atoms, int64_t head_out,
                                                                     int total_actions, BranchTable branches,
                                                                     int64_t slots, int entries) {
  extern __shared__ float staged_rows[];
  pdl_enter();
  const RowGroup g = row_group(atoms);
  if (g.idle) return;
  const int value_heads = value_heads_of(branches);  // the members' value heads' atoms come first in `head`
  const int64_t value_ld = round_up_to_align(atoms);  // a value head's padded logit columns
  const int64_t q_step = int64_t(atoms) * slots;      // between two actions' entries in q
  const int d0 = blockIdx.y * entries, d1 = min(branches.count, d0 + entries);
  // Row b's head, q and dueling aggregate from its padded logits `in`.
  auto bias_dueling_row = [&](int64_t b, const float* in) {
    float* row = head ? head + b * head_out : nullptr;
    // Row b is fraction b % slots of sample b / slots (slots = 1: sample b).
    float* q_row = q + (b / slots) * total_actions * q_step + b % slots;
    for (int z = g.col; z < atoms; z += g.width) {
      float v = 0.f;  // the current member's value
      for (int d = d0; d < d1; ++d) {
        const bool member_first = d % branches.per_member == 0;
        if (value_heads && (member_first || d == d0)) {
          const int64_t e = member_of(branches, d);
          v = biased_logit(in[e * value_ld + z], b_out[e * atoms + z]);
          if (row && member_first) row[e * atoms + z] = v;
        }
        const int size = branches.size[d], first = branches.action_offset[d];
        const int64_t col = head_col_of(branches, d, value_heads, atoms) + z;  // branch d's compact column at atom z
        const float* adv = in + branches.pad_col[d] + z;
        const float* bias = b_out + col;
        float* out = row ? row + col : nullptr;
        float* q_out = q_row + (int64_t(first) * atoms + z) * slots;
        float sum = 0.f;
        for (int k0 = 0; k0 < size; k0 += kLoadsInFlight) {  // the chunk's loads first, then its stores
          float a[kLoadsInFlight];
#pragma unroll
          for (int j = 0; j < kLoadsInFlight; ++j)
            if (k0 + j < size) a[j] = biased_logit(adv[int64_t(k0 + j) * atoms], bias[int64_t(k0 + j) * atoms]);
#pragma unroll
          for (int j = 0; j < kLoadsInFlight; ++j)
            if (k0 + j < size) {
              if (out) out[int64_t(k0 + j) * atoms] = a[j];
              sum += a[j];
              if (!value_heads) q_out[int64_t(k0 + j) * q_step] = a[j];
            }
        }
        if (!value_heads) continue;
        const float mean = branch_mean(sum, size);
#pragma unroll 4
        for (int k = 0; k < size; ++k)
          q_out[int64_t(k) * q_step] =
              dueling_q(v, biased_logit(adv[int64_t(k) * atoms], bias[int64_t(k) * atoms]), mean);
      }
    }
  };
  if constexpr (!kStaged) {
    for (int64_t b = g.first_row; b < rows; b += g.row_stride) bias_dueling_row(b, logits + b * head_ld);
    return;
  }
  // Staged: a thread a row (g.width == 1), the block's loop uniform so that every thread reaches
  // the barriers.
  // head_ld % 4 == 0, logits 16-byte aligned; a block's chunks fit an int (its rows in 48 KB)
  const int staged_ld = static_cast<int>(head_ld) + 1, chunks = static_cast<int>(head_ld) / 4;
  for (int64_t first = int64_t(blockIdx.x) * blockDim.x; first < rows; first += int64_t(gridDim.x) * blockDim.x) {
    const int block_rows = static_cast<int>(min(int64_t(blockDim.x), rows - first));
    const float4* src = reinterpret_cast<const float4*>(logits + first * head_ld);
    for (int c = threadIdx.x; c < block_rows * chunks; c += blockDim.x) {
      const float4 v = src[c];
      float* dst = staged_rows + (c / chunks) * staged_ld + (c % chunks) * 4;
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < block_rows)
      bias_dueling_row(first + threadIdx.x, staged_rows + threadIdx.x * staged_ld);
    __syncthreads();  // every row read before the next rows are copied over them
  }
}

// IQN's embedding input c[r, k] (elementwise.cuh, iqn_cosine), r over the rows * N fractions. A
// row group (elementwise.cuh) of n / 8 threads a row where n is a multiple of 8, each thread 8
// columns and one 16-byte store; else n threads, a column each. Not a thread a column for every
// n: that makes a block of a few rows, each waiting out a load of tau for one cosine a thread,
// so the kernel is bound by the blocks' turnover, not by its bytes or its arithmetic.
__global__ void iqn_cosines_kernel(const float* __restrict__ tau, __nv_bfloat16* __restrict__ c, int64_t fractions,
                                   int n) {
  pdl_enter();
  const bool by8 = n % 8 == 0;
  const RowGroup g = row_group(by8 ? n / 8 : n);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < fractions; r += g.row_stride) {
    const float t = tau[r];
    __nv_bfloat16* const row = c + r * n;
    if (by8) {
      for (int k = 8 * g.col; k < n; k += 8 * g.width) *reinterpret_cast<uint4*>(row + k) = iqn_cosines8(t, k);
    } else {
      for (int k = g.col; k < n; k += g.width) row[k] = __float2bfloat16_rn(iqn_cosine(t, k));
    }
  }
}

// phi = bf16(relu(pre + b_phi)) and z = bf16(h_L[r / N] * phi) on the [rows * N, T] fraction
// rows: pre is phi's GEMM result (F32), h_L the last trunk layer [rows, T] (BF16). The product of
// two BF16 values is exact in F32, so z is rounded once, as the CPU kernel's. The x4 version
// takes 4 consecutive columns a thread (16-byte loads of pre, 8-byte loads of h_L and stores).
__global__ void iqn_phi_z_kernel(const float* __restrict__ pre, const float* __restrict__ b_phi,
                                 const __nv_bfloat16* __restrict__ h, __nv_bfloat16* __restrict__ phi,
                                 __nv_bfloat16* __restrict__ z, int64_t rows, int64_t cols, int64_t N) {
  pdl_enter();
  const RowGroup g = row_group(cols);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < rows; r += g.row_stride) {
    const __nv_bfloat16* h_row = h + (r / N) * cols;
    for (int64_t c = g.col; c < cols; c += g.width) {
      const __nv_bfloat16 p = __float2bfloat16_rn(relu_keep_nan(pre[r * cols + c] + b_phi[c]));
      phi[r * cols + c] = p;
      z[r * cols + c] = __float2bfloat16_rn(__bfloat162float(h_row[c]) * __bfloat162float(p));
    }
  }
}
__global__ void iqn_phi_z_x4_kernel(const float4* __restrict__ pre, const float4* __restrict__ b_phi,
                                    const uint2* __restrict__ h, uint2* __restrict__ phi, uint2* __restrict__ z,
                                    int64_t rows, int64_t cols4, int64_t N) {
  pdl_enter();
  const RowGroup g = row_group(cols4);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < rows; r += g.row_stride) {
    const uint2* h_row = h + (r / N) * cols4;
    for (int64_t c = g.col; c < cols4; c += g.width) {
      const float4 v = pre[r * cols4 + c], b = b_phi[c];
      const uint2 p = pack_bf16x4(relu_keep_nan(v.x + b.x), relu_keep_nan(v.y + b.y), relu_keep_nan(v.z + b.z),
                                  relu_keep_nan(v.w + b.w));
      phi[r * cols4 + c] = p;
      const uint2 hc = h_row[c];
      z[r * cols4 + c] = make_uint2(bf16_product2(hc.x, p.x), bf16_product2(hc.y, p.y));
    }
  }
}

// states [rows, SD] F32 -> BF16, a new tensor (the first GEMM's operand).
Tensor cast_states(const Tensor& states, const at::TensorOptions& bf16, cudaStream_t stream) {
  Tensor x = at::empty(states.sizes(), bf16);
  const float* s_ptr = states.data_ptr<float>();
  auto* x_ptr = static_cast<__nv_bfloat16*>(x.data_ptr());
  if (x.numel() % 4 == 0 && aligned16(s_ptr, x_ptr))
    launch(cast_to_bf16_x4_kernel, blocks_for(x.numel() / 4, kThreads), kThreads, 0, stream,
           reinterpret_cast<const float4*>(s_ptr), reinterpret_cast<uint2*>(x_ptr), x.numel() / 4);
  else
    launch(cast_to_bf16_kernel, blocks_for(x.numel(), kThreads), kThreads, 0, stream, s_ptr, x_ptr, x.numel());
  return x;
}

// One network's parameters as the forward reads them: F32 biases, BF16 weights.
struct NetParams {
  const float* p;
  const __nv_bfloat16* w;
};

// The hidden layers [begin, end) of L.hidden of one or two networks on the same BF16 input rows
// x [rows, width of layer begin's input] (the states for begin = 0): per network h_begin+1..h_end,
// BF16 [rows, width] each. Two networks only from the first layer (begin = 0).
// A dense layer is one launch of the dense layer kernel over both networks where it applies.
// Otherwise each layer's GEMMs write F32 pre-activations into one scratch [count, rows, width],
// then one bias + ReLU launch over all its rows makes the layer's [count, rows, width] output: a dense
// layer is one GEMM, a block-diagonal one a GEMM per group of same-shape blocks (block_groups;
// one bias vector at b_off covers all its blocks). With two networks, a group of one block (a
// dense layer among them) is one strided-batched GEMM over both networks (the second network's
// weights are the stride away from the first's: the lower address goes first, so the stride is
// >= 0), a group of several blocks one strided-batched GEMM over its blocks per network. The
// first layer on fewer than kNarrowInputWidth states is one narrow_input_layer_kernel launch
// instead (no GEMM). Every element is computed as in a pass of its own (same
// operands, F32 accumulation, F32 bias, one rounding to BF16).
std::vector<std::vector<Tensor>> hidden_layers(const char* op, const Tensor& x, const std::vector<NetParams>& nets,
                                               const NetLayout& L, const at::TensorOptions& f32,
                                               cudaStream_t stream, size_t begin, size_t end) {
  const int64_t rows = x.size(0), count = static_cast<int64_t>(nets.size());
  TORCH_INTERNAL_ASSERT(begin <= end && end <= L.hidden.size() && (count == 1 || begin == 0));
  if (begin == end) return std::vector<std::vector<Tensor>>(count);
  const bool swap = count == 2 && nets[1].w < nets[0].w;
  // The networks in the order of their slots in each layer's [count, rows, width] buffers.
  const NetParams* slot_net[2] = {&nets[swap ? 1 : 0], &nets[count == 2 && !swap ? 1 : 0]};
  const NetParams& lo = *slot_net[0];
  const NetParams& hi = *slot_net[1];
  const int64_t w_stride = hi.w - lo.w;
  // Whether layer i is the first on fewer than kNarrowInputWidth states, which
  // narrow_input_layer_kernel computes alone (no GEMM, no scratch).
  auto narrow = [&](size_t i) {
    const HiddenLayer& layer = L.hidden[i];
    return i == 0 && layer.in_width < kNarrowInputWidth && layer.blocks.size() == 1 && layer.out_width % 4 == 0 &&
           aligned16(lo.p + layer.b_off, hi.p + layer.b_off);
  };
  // One F32 scratch for the pre-activations of the layers the GEMM + bias_relu path runs
  // (stream-ordered reuse), made at its first use and grown for a wider layer: the dense kernel's
  // and the narrow kernel's layers need none.
  Tensor z;
  auto scratch = [&](int64_t width) {
    if (!z.defined() || z.numel() < count * rows * width) z = at::empty({count * rows * width}, f32);
    return z.data_ptr<float>();
  };
  std::vector<Tensor> outs;  // each layer's [count, rows, width]
  for (size_t i = begin; i < end; ++i) {
    const HiddenLayer& layer = L.hidden[i];
    const int64_t out = layer.out_width;
    const std::string what = hidden_layer_name(L, i);
    const auto* in = static_cast<const __nv_bfloat16*>(i == begin ? x.data_ptr() : outs.back().data_ptr());
    Tensor h = at::empty({count, rows, out}, x.options());
    const float *bias_lo = lo.p + layer.b_off, *bias_hi = hi.p + layer.b_off;
    auto* hp = static_cast<__nv_bfloat16*>(h.data_ptr());
    const int64_t all_rows = count * rows;
    if (narrow(i)) {
      TORCH_INTERNAL_ASSERT(aligned16(hp));  // a fresh tensor: the caching allocator aligns its blocks
      const int64_t w_off = layer.blocks[0].w_off;
      launch(narrow_input_layer_kernel, row_group_blocks(all_rows, out / 4, kThreads), kThreads, 0, stream, in,
             static_cast<int>(layer.in_width), lo.w + w_off, hi.w + w_off, reinterpret_cast<const float4*>(bias_lo),
             reinterpret_cast<const float4*>(bias_hi), rows, reinterpret_cast<uint2*>(hp), all_rows, out / 4);
      outs.push_back(h);
      continue;
    }
    // The first layer reads the same x for both networks (stride 0), the others their own input.
    const int64_t in_net_stride = i == begin ? 0 : rows * layer.in_width;
    if (layer.blocks.size() == 1) {  // a dense layer: one kernel where it can (dense_layer.h)
      const HeadSlice& s = layer.blocks[0];
      TORCH_INTERNAL_ASSERT(s.in_col == 0 && s.in_width == layer.in_width && s.out_col == 0 && s.out_width == out);
      DenseLaunch dense(DenseEpilogue::kHidden);
      for (int64_t n = 0; n < count; ++n) {
        DenseProblem p;
        p.x = in + n * in_net_stride;
        p.x_ld = layer.in_width;
        p.w = slot_net[n]->w + s.w_off;
        p.w_ld = layer.in_width;
        p.bias = slot_net[n]->p + layer.b_off;
        p.out = hp + n * rows * out;
        p.out_ld = out;
        p.rows = rows;
        p.N = out;
        p.K = layer.in_width;
        dense.add(p);
      }
      if (dense_applies(dense)) {
        dense_launch(dense, stream);
        outs.push_back(h);
        continue;
      }
    }
    float* const zp = scratch(out);
    for (const HeadGroup& g : block_groups(layer.blocks)) {
      const HeadSlice& s = g.first;
      if (g.count == 1) {
        gemm_strided_batched(op, what.c_str(), rows, s.out_width, s.in_width,
                             Operand{in + s.in_col, CUDA_R_16BF, layer.in_width, false}, in_net_stride,
                             Operand{lo.w + s.w_off, CUDA_R_16BF, s.in_width, true}, w_stride, zp + s.out_col,
                             CUDA_R_32F, out, rows * out, count, CUBLAS_COMPUTE_32F);
        continue;
      }
      for (int64_t n = 0; n < count; ++n)
        gemm_strided_batched(op, what.c_str(), rows, s.out_width, s.in_width,
                             Operand{in + n * in_net_stride + s.in_col, CUDA_R_16BF, layer.in_width, false},
                             g.in_col_stride, Operand{slot_net[n]->w + s.w_off, CUDA_R_16BF, s.in_width, true},
                             g.w_stride, zp + n * rows * out + s.out_col, CUDA_R_32F, out, g.out_col_stride,
                             g.count, CUBLAS_COMPUTE_32F);
    }
    if (out % 4 == 0 && aligned16(zp, bias_lo, bias_hi, hp))
      launch(bias_relu_bf16_x4_kernel, row_group_blocks(all_rows, out / 4, kThreads), kThreads, 0, stream,
             reinterpret_cast<const float4*>(zp), reinterpret_cast<const float4*>(bias_lo),
             reinterpret_cast<const float4*>(bias_hi), rows, reinterpret_cast<uint2*>(hp), all_rows, out / 4);
    else
      launch(bias_relu_bf16_kernel, row_group_blocks(all_rows, out, kThreads), kThreads, 0, stream, zp, bias_lo,
             bias_hi, rows, hp, all_rows, out);
    outs.push_back(h);
  }
  std::vector<std::vector<Tensor>> acts(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = swap ? count - 1 - i : i;
    for (const Tensor& h : outs) acts[i].push_back(h[slot]);
  }
  return acts;
}

// The output layer of one network on its last hidden activation `in` [rows, head_in_width]
// (contiguous): its GEMM results, no bias, in the padded layout [rows, head_ld].
// Block-diagonal: each head reads its column slice of `in` (with H = 0 all of it: the heads'
// in_col_stride is 0) and writes its column slice of the padded logits, a group of same-shape
// heads (NetLayout's head_groups) as one batch. `logits`: [rows, head_ld] F32, written.
// pad_width rows of W: the padding rows (zero, reserved by the layout) give logits columns no one
// reads, and keep every GEMM size a multiple of 8.
struct OutputLayer {
  const Tensor& in;
  const __nv_bfloat16* w;
  const Tensor& logits;
};

// The output layers of one or two networks: one launch of the dense kernel (kLogits, a problem
// per head group and network) where it applies to both; else a launch for each network it
// applies to, so that a network's logits take the same path here as in a pass of its own (the
// kernel's rule reads each network's rows); else a cuBLAS GEMM per head group, the second
// network's on the side stream (csrc/cuda/side_stream.h).
void output_logits_into(const char* op, const std::vector<OutputLayer>& nets, const NetLayout& L,
                        cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(!nets.empty() && nets.size() <= 2);
  const std::vector<HeadGroup> groups = head_groups(L);
  // Adds a network's head groups to `dense`; false where they do not fit.
  auto add_heads = [&](DenseLaunch& dense, const OutputLayer& net) {
    for (const HeadGroup& g : groups) {
      const HeadSlice& s = g.first;
      DenseProblem p;
      p.x = static_cast<const __nv_bfloat16*>(net.in.data_ptr()) + s.in_col;
      p.x_ld = L.head_in_width;
      p.x_stride = g.in_col_stride;
      p.w = net.w + s.w_off;
      p.w_ld = s.in_width;
      p.w_stride = g.w_stride;
      p.out = net.logits.data_ptr<float>() + s.pad_col;
      p.out_ld = L.head_ld;
      p.out_stride = g.pad_col_stride;
      p.rows = net.in.size(0);
      p.N = s.pad_width;
      p.K = s.in_width;
      p.batch = g.count;
      if (!dense.add(p)) return false;
    }
    return true;
  };
  if (nets.size() == 2) {
    DenseLaunch both(DenseEpilogue::kLogits);
    if (add_heads(both, nets[0]) && add_heads(both, nets[1]) && dense_applies(both)) {
      dense_launch(both, stream);
      return;
    }
  }
  std::vector<const OutputLayer*> gemm_nets;  // the networks the kernel does not take
  for (const OutputLayer& net : nets) {
    DenseLaunch one(DenseEpilogue::kLogits);
    if (add_heads(one, net) && dense_applies(one))
      dense_launch(one, stream);
    else
      gemm_nets.push_back(&net);
  }
  auto gemms = [&](const OutputLayer& net) {
    const auto* in = static_cast<const __nv_bfloat16*>(net.in.data_ptr());
    for (const HeadGroup& g : groups) {
      const HeadSlice& s = g.first;
      gemm_strided_batched(op, "output heads", net.in.size(0), s.pad_width, s.in_width,
                           Operand{in + s.in_col, CUDA_R_16BF, L.head_in_width, false}, g.in_col_stride,
                           Operand{net.w + s.w_off, CUDA_R_16BF, s.in_width, true}, g.w_stride,
                           net.logits.data_ptr<float>() + s.pad_col, CUDA_R_32F, L.head_ld, g.pad_col_stride,
                           g.count, CUBLAS_COMPUTE_32F);
    }
  };
  if (gemm_nets.size() == 1) return gemms(*gemm_nets[0]);
  if (gemm_nets.empty()) return;
  SideStream side(gemm_nets[1]->logits.device());
  side.fork();
  side.run([&] { gemms(*gemm_nets[1]); });
  gemms(*gemm_nets[0]);
  side.join();
}

Tensor output_logits(const char* op, const Tensor& in, const __nv_bfloat16* w, const NetLayout& L,
                     const at::TensorOptions& f32, cudaStream_t stream) {
  Tensor logits = at::empty({in.size(0), L.head_ld}, f32);
  output_logits_into(op, {OutputLayer{in, w, logits}}, L, stream);
  return logits;
}

NetParams net_params(const Tensor& params, const Tensor& params_bf16) {
  return {params.data_ptr<float>(), static_cast<const __nv_bfloat16*>(params_bf16.data_ptr())};
}

// DQN_OPS_DENSE_COSINES (switches.h): "1" has the dense layer kernel form IQN's cosines itself
// where it runs phi's layer (dense_layer.h, fractions), "0" a cosine launch writes them first.
// The same bits. Unset: "0", until an A/B on a GPU has timed it (bench/NOTES.md).
bool cosines_in_dense_kernel() {
  static const bool in_kernel = env_flag("DQN_OPS_DENSE_COSINES", false);
  return in_kernel;
}

// IQN's layer after the trunk (docs/iqn-design.md): from the last trunk layer h [rows, T] and the
// fractions [rows, N], the cosines c [rows * N, n], phi and z = h * phi [rows * N, T], BF16:
// 1 cosine launch, then phi's GEMM with the bias + ReLU + product in its epilogue (the dense
// layer kernel; under DQN_OPS_DENSE_COSINES that launch forms and stores c itself, for n <=
// kDenseFormedXMaxK), or where that kernel does not apply the GEMM and 1 bias + ReLU + product
// launch.
std::vector<Tensor> iqn_embedding(const char* op, const Tensor& h, const Tensor& fractions, const NetParams& net,
                                  const NetLayout& L, const at::TensorOptions& f32, cudaStream_t stream) {
  const int64_t rows = fractions.numel(), n = L.iqn_embedding, T = L.phi.out_width;
  Tensor c = at::empty({rows, n}, h.options());
  auto* c_ptr = static_cast<__nv_bfloat16*>(c.data_ptr());
  auto cosines = [&] {
    // c is a fresh tensor, 16-byte aligned: so are its rows where n % 8 == 0 (the kernel's 8-wide stores).
    launch(iqn_cosines_kernel, row_group_blocks(rows, n % 8 == 0 ? n / 8 : n, kThreads), kThreads, 0, stream,
           fractions.data_ptr<float>(), c_ptr, rows, static_cast<int>(n));
  };
  const HeadSlice& w = L.phi.blocks[0];
  Tensor phi = at::empty({rows, T}, h.options()), z = at::empty({rows, T}, h.options());
  const float* b_ptr = net.p + L.phi.b_off;
  const auto* h_ptr = static_cast<const __nv_bfloat16*>(h.data_ptr());
  auto *phi_ptr = static_cast<__nv_bfloat16*>(phi.data_ptr()), *z_ptr = static_cast<__nv_bfloat16*>(z.data_ptr());
  const int64_t N = fractions.size(fractions.dim() - 1);
  // phi and z in the GEMM's epilogue where the dense layer kernel applies (dense_layer.h).
  DenseLaunch dense(DenseEpilogue::kHidden);
  DenseProblem p;
  p.x = c_ptr;
  p.x_ld = n;
  p.w = net.w + w.w_off;
  p.w_ld = n;
  p.bias = b_ptr;
  p.out = phi_ptr;
  p.out_ld = T;
  p.aux = h_ptr;
  p.out_bf16 = z_ptr;
  p.rows = rows;
  p.N = T;
  p.K = n;
  if (cosines_in_dense_kernel() && n <= kDenseFormedXMaxK) {
    p.fractions = fractions.data_ptr<float>();
    p.x_out = c_ptr;
  }
  dense.add(p);
  dense.scale_group = N;
  if (dense_applies(dense)) {
    if (!p.fractions) cosines();
    dense_launch(dense, stream);
    return {c, phi, z};
  }
  cosines();
  Tensor pre = at::empty({rows, T}, f32);
  gemm(op, "phi", rows, T, n, Operand{c_ptr, CUDA_R_16BF, n, false}, Operand{net.w + w.w_off, CUDA_R_16BF, n, true},
       pre.data_ptr<float>(), CUDA_R_32F, T, CUBLAS_COMPUTE_32F);
  const float* pre_ptr = pre.data_ptr<float>();
  if (T % 4 == 0 && aligned16(pre_ptr, b_ptr, h_ptr, phi_ptr, z_ptr))
    launch(iqn_phi_z_x4_kernel, row_group_blocks(rows, T / 4, kThreads), kThreads, 0, stream,
           reinterpret_cast<const float4*>(pre_ptr), reinterpret_cast<const float4*>(b_ptr),
           reinterpret_cast<const uint2*>(h_ptr), reinterpret_cast<uint2*>(phi_ptr), reinterpret_cast<uint2*>(z_ptr),
           rows, T / 4, N);
  else
    launch(iqn_phi_z_kernel, row_group_blocks(rows, T, kThreads), kThreads, 0, stream, pre_ptr, b_ptr, h_ptr, phi_ptr,
           z_ptr, rows, T, N);
  return {c, phi, z};
}

}  // namespace

Logits forward_to_logits(const char* op, const Tensor& states, const Tensor& params, const Tensor& params_bf16,
                         const NetLayout& L, const c10::optional<Tensor>& fractions) {
  // Kernels and cuBLAS must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(states.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Tensor x = cast_states(states, params_bf16.options(), stream);
  const NetParams net = net_params(params, params_bf16);
  const auto f32 = params.options();
  const size_t trunk = static_cast<size_t>(L.trunk_layers);
  std::vector<Tensor> activations = {x};
  // Appends the outputs of hidden layers [begin, end) on the last activation. The layers' result
  // is held in a local: a range-for over hidden_layers(...)[0] would walk a destroyed temporary.
  auto append_hidden = [&](size_t begin, size_t end) {
    std::vector<std::vector<Tensor>> layers = hidden_layers(op, activations.back(), {net}, L, f32, stream, begin, end);
    for (Tensor& h : layers[0]) activations.push_back(std::move(h));
  };
  append_hidden(0, trunk);
  if (L.iqn())
    for (Tensor& t : iqn_embedding(op, activations.back(), *fractions, net, L, f32, stream))
      activations.push_back(std::move(t));
  append_hidden(trunk, L.hidden.size());
  Tensor logits = output_logits(op, activations.back(), net.w, L, f32, stream);
  return {logits, std::move(activations)};
}

namespace {

std::tuple<Tensor, Tensor, std::vector<Tensor>> dueling_forward_cuda(const Tensor& states, const Tensor& params,
                                                                     const Tensor& params_bf16,
                                                                     c10::IntArrayRef layout,
                                                                     c10::string_view backward_precision,
                                                                     const c10::optional<Tensor>& fractions) {
  const NetLayout L = parse_layout(layout, kForwardOp);
  check_forward_args(states, params, params_bf16, L, std::string(backward_precision));
  const int64_t N = check_fractions(fractions, params, L, kForwardOp, {states.size(0), -1});
  const BranchTable branches = make_branch_table(L, kForwardOp);
  Logits f = forward_to_logits(kForwardOp, states, params, params_bf16, L, fractions);
  const c10::cuda::CUDAGuard guard(states.device());
  const int64_t B = states.size(0);
  Tensor head = at::empty({B * N, L.head_out}, params.options());
  Tensor q = at::empty({B, L.q_rows(), L.iqn() ? N : L.atoms}, params.options());
  launch_head_bias_dueling(f.logits.data_ptr<float>(), params.data_ptr<float>() + L.b_out, head.data_ptr<float>(),
                           q.data_ptr<float>(), B * N, L, branches, at::cuda::getCurrentCUDAStream(), N);
  return {q, head, std::move(f.activations)};
}

// _online_and_target_logits (the trainer's fused path; csrc/dqn_ops.cpp): the online network
// on state_pairs [2B, SD] and the target network on its last B rows (s'), each stopped before
// the aggregation, which the fused loss does as it reads the logits. The same checks and
// kernels as bf16_dueling_forward; s' is cast to BF16 once for both networks. Returns the
// online network's activations on all 2B rows.
std::tuple<Tensor, Tensor, std::vector<Tensor>> online_and_target_logits_cuda(
    const Tensor& state_pairs, const Tensor& params, const Tensor& params_bf16, const Tensor& target_params,
    const Tensor& target_params_bf16, c10::IntArrayRef layout, bool batch_networks) {
  const char* op = kLogitsOp;
  const NetLayout L = parse_layout(layout, op);
  const int64_t B =
      check_online_and_target_args(state_pairs, params, params_bf16, target_params, target_params_bf16, L);

  const c10::cuda::CUDAGuard guard(state_pairs.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto f32 = params.options();
  Tensor x = cast_states(state_pairs, params_bf16.options(), stream);
  const NetParams online = net_params(params, params_bf16), target = net_params(target_params, target_params_bf16);
  std::vector<Tensor> on, tgt;
  if (batch_networks) {  // both on all 2B rows: the target's first B (s) go unused
    std::vector<std::vector<Tensor>> both = hidden_layers(op, x, {online, target}, L, f32, stream, 0, L.hidden.size());
    on = std::move(both[0]);
    tgt = std::move(both[1]);
  } else {
    on = std::move(hidden_layers(op, x, {online}, L, f32, stream, 0, L.hidden.size())[0]);
    tgt = std::move(hidden_layers(op, x.narrow(0, B, B), {target}, L, f32, stream, 0, L.hidden.size())[0]);
  }
  // Both output layers in one launch, or the target's beside the online one's (output_logits_into).
  Tensor logits = at::empty({on.back().size(0), L.head_ld}, f32), logits_next_target = at::empty({B, L.head_ld}, f32);
  const Tensor next_target = tgt.back().narrow(0, tgt.back().size(0) - B, B);
  output_logits_into(
      op, {OutputLayer{on.back(), online.w, logits}, OutputLayer{next_target, target.w, logits_next_target}}, L,
      stream);
  std::vector<Tensor> activations = {x};
  for (Tensor& h : on) activations.push_back(std::move(h));
  return {logits, logits_next_target, std::move(activations)};
}

}  // namespace

namespace {

// The most shared memory the staged rows take: the default limit, no opt-in (IQN's head_ld of 32
// takes 33 KB).
constexpr size_t kMaxStagedBytes = 48 * 1024;

// DQN_OPS_STAGE_HEAD_ROWS (switches.h): "1" stages the rows of one-atom heads in shared memory
// (head_bias_dueling_kernel), "0" each thread reads its row's logits from global memory. The
// same bits. Unset: "0", until an A/B on a GPU has timed it (bench/NOTES.md).
bool staged_dueling_rows() {
  static const bool staged = env_flag("DQN_OPS_STAGE_HEAD_ROWS", false);
  return staged;
}

}  // namespace

void launch_head_bias_dueling(const float* logits, const float* b_out, float* head, float* q, int64_t rows,
                              const NetLayout& L, const BranchTable& branches, cudaStream_t stream, int64_t slots) {
  const unsigned row_blocks = row_group_blocks(rows, L.atoms, kThreads);
  const bool split = split_heads(row_blocks);
  const dim3 grid(row_blocks, split ? static_cast<unsigned>(branches.count) : 1);
  // The rows staged in shared memory (the kernel's comment) where a thread takes a row and walks
  // all its entries (one atom, heads not split) and the block's rows fit kMaxStagedBytes.
  const size_t staged_bytes = size_t(kThreads) * (L.head_ld + 1) * sizeof(float);
  const bool staged = staged_dueling_rows() && L.atoms == 1 && !split && L.head_ld % 4 == 0 && aligned16(logits) &&
                      staged_bytes <= kMaxStagedBytes;
  launch(staged ? head_bias_dueling_kernel<true> : head_bias_dueling_kernel<false>, grid, kThreads,
         staged ? staged_bytes : 0, stream, logits, L.head_ld, b_out, head, q, rows, static_cast<int>(L.atoms),
         L.head_out, static_cast<int>(L.q_rows()), branches, slots, split ? 1 : static_cast<int>(branches.count));
}

bool split_heads(unsigned row_blocks) {
  // DQN_OPS_HEAD_COLUMNS (switches.h): unset or "auto" the rule above, "split" or "whole" one
  // shape for every launch (the A/B switch, and the tests' check that both shapes give the same
  // bits).
  static constexpr SwitchName kNames[] = {{"auto", -1}, {"split", 1}, {"whole", 0}};
  static const int forced = env_switch("DQN_OPS_HEAD_COLUMNS", kNames, -1);
  if (forced >= 0) return forced == 1;
  return row_blocks < static_cast<unsigned>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("bf16_dueling_forward", &cuda::dueling_forward_cuda);
  m.impl("_online_and_target_logits", &cuda::online_and_target_logits_cuda);
}

}  // namespace dqn_ops

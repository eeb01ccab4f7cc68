// bf16_dueling_forward on CUDA: BF16 x BF16 -> F32 GEMMs (COMPUTE_32F) on torch's cuBLAS
// handle, with bias + ReLU + BF16 cast fused into one pass after each hidden GEMM.
//
// Launches: 1 (states -> BF16) + 3 x (GEMM + bias/ReLU) + the output GEMMs (2: the value
// head, then the branch heads as one strided batch when they share a shape; else D + 1)
// + 1 (output bias + dueling aggregation) = 11 for the reference config. The value head's
// and all branches' first layers run as one GEMM over the adjacent rows of W_h1.
// _online_and_target_logits, the trainer's fused path, stops before the last kernel, and runs
// the online network on [s; s'] and the target network on s' together: with batch_networks,
// each hidden layer of both networks is one strided-batched GEMM and one bias + ReLU launch
// (7 launches fewer than two passes; the target then also runs on s, rows it does not need).
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "branch_table.cuh"
#include "dueling.cuh"
#include "elementwise.cuh"
#include "forward.h"
#include "gemm.cuh"
#include "network_args.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;
constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4;  // per thread, in the output-bias + dueling kernel

// states -> BF16; the x4 version takes 4 elements a thread (16-byte loads) where n and both
// pointers allow it.
__global__ void cast_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void cast_to_bf16_x4_kernel(const float4* __restrict__ in, uint2* __restrict__ out, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    out[i] = pack_bf16x4(v.x, v.y, v.z, v.w);
  }
}

// out = bf16(relu(z + bias)), z [rows, cols] row-major, bias = bias_lo for the rows before
// `split` and bias_hi from there (two networks' layers stacked: hidden_layers); the x4 version
// takes 4 consecutive columns a thread (16-byte loads, 8-byte stores). `v < 0 ? 0 : v` keeps a
// NaN a NaN (as torch.relu does) so a non-finite input stays visible downstream.
__device__ __forceinline__ float relu_keep_nan(float v) { return v < 0.f ? 0.f : v; }

__global__ void bias_relu_bf16_kernel(const float* __restrict__ z, const float* __restrict__ bias_lo,
                                      const float* __restrict__ bias_hi, int64_t split,
                                      __nv_bfloat16* __restrict__ out, int64_t rows, int64_t cols) {
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
  const RowGroup g = row_group(cols4);
  if (g.idle) return;
  for (int64_t r = g.first_row; r < rows; r += g.row_stride) {
    const float4* bias = r < split ? bias_lo : bias_hi;
    for (int64_t c = g.col; c < cols4; c += g.width) {
      const float4 v = z[r * cols4 + c], b = bias[c];
      out[r * cols4 + c] = pack_bf16x4(relu_keep_nan(v.x + b.x), relu_keep_nan(v.y + b.y),
                                       relu_keep_nan(v.z + b.z), relu_keep_nan(v.w + b.w));
    }
  }
}

// From the output layer's GEMM results in the padded layout (logits [rows, head_ld], see
// NetLayout::head_ld) writes head = logits + b_out in the compact layout [rows, head_out] and
// the dueling aggregate q[b, action, z] (dueling.cuh). A thread per (row, atom) (row_group); a
// branch's advantages are loaded together (kLoadsInFlight at a time: one memory latency per
// branch, not one per action) and read again, from L1, for q instead of from `head`.
__global__ void head_bias_dueling_kernel(const float* __restrict__ logits, int64_t head_ld,
                                         const float* __restrict__ b_out, float* __restrict__ head,
                                         float* __restrict__ q, int64_t rows, int atoms, int64_t head_out,
                                         int total_actions, BranchTable branches) {
  const RowGroup g = row_group(atoms);
  if (g.idle) return;
  for (int64_t b = g.first_row; b < rows; b += g.row_stride) {
    const float* in = logits + b * head_ld;
    float* row = head + b * head_out;
    float* q_row = q + b * int64_t(total_actions) * atoms;
    for (int z = g.col; z < atoms; z += g.width) {
      const float v = biased_logit(in[z], b_out[z]);
      row[z] = v;
      for (int d = 0; d < branches.count; ++d) {
        const int size = branches.size[d], first = branches.action_offset[d];
        const float* adv = in + branches.pad_col[d] + z;
        const float* bias = b_out + int64_t(atoms) * (1 + first) + z;
        float sum = 0.f;
        for (int k0 = 0; k0 < size; k0 += kLoadsInFlight) {  // the chunk's loads first, then its stores
          float a[kLoadsInFlight];
#pragma unroll
          for (int j = 0; j < kLoadsInFlight; ++j)
            if (k0 + j < size) a[j] = biased_logit(adv[int64_t(k0 + j) * atoms], bias[int64_t(k0 + j) * atoms]);
#pragma unroll
          for (int j = 0; j < kLoadsInFlight; ++j)
            if (k0 + j < size) {
              row[int64_t(atoms) * (1 + first + k0 + j) + z] = a[j];
              sum += a[j];
            }
        }
        const float mean = branch_mean(sum, size);
#pragma unroll 4
        for (int k = 0; k < size; ++k)
          q_row[int64_t(first + k) * atoms + z] =
              dueling_q(v, biased_logit(adv[int64_t(k) * atoms], bias[int64_t(k) * atoms]), mean);
      }
    }
  }
}

// states [rows, SD] F32 -> BF16, a new tensor (the first GEMM's operand).
Tensor cast_states(const Tensor& states, const at::TensorOptions& bf16, cudaStream_t stream) {
  Tensor x = at::empty(states.sizes(), bf16);
  const float* s_ptr = states.data_ptr<float>();
  auto* x_ptr = static_cast<__nv_bfloat16*>(x.data_ptr());
  if (x.numel() % 4 == 0 && aligned16(s_ptr, x_ptr))
    cast_to_bf16_x4_kernel<<<blocks_for(x.numel() / 4, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(s_ptr), reinterpret_cast<uint2*>(x_ptr), x.numel() / 4);
  else
    cast_to_bf16_kernel<<<blocks_for(x.numel(), kThreads), kThreads, 0, stream>>>(s_ptr, x_ptr, x.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return x;
}

// One network's parameters as the forward reads them: F32 biases, BF16 weights.
struct NetParams {
  const float* p;
  const __nv_bfloat16* w;
};

// One network's hidden activations, BF16 [rows, width].
struct HiddenActs {
  Tensor h1, h2, hh;
};

// The three hidden layers of one or two networks on the same BF16 input rows x [rows, SD].
// With two, each layer is one strided-batched GEMM over both (the second network's weights are
// the stride away from the first's: the lower address goes first, so the stride is >= 0) into
// a [2, rows, width] buffer, and one bias + ReLU launch over it. Every element is computed as in
// a pass of its own (same operands, F32 accumulation, F32 bias, one rounding to BF16).
std::vector<HiddenActs> hidden_layers(const char* op, const Tensor& x, const std::vector<NetParams>& nets,
                                      const NetLayout& L, const at::TensorOptions& f32, cudaStream_t stream) {
  const int64_t rows = x.size(0), count = static_cast<int64_t>(nets.size());
  const bool swap = count == 2 && nets[1].w < nets[0].w;
  const NetParams& lo = nets[swap ? 1 : 0];
  const NetParams& hi = nets[count == 2 && !swap ? 1 : 0];
  const int64_t w_stride = hi.w - lo.w;
  // One F32 scratch for the pre-activations of all three layers (stream-ordered reuse).
  Tensor z = at::empty({count * rows * std::max({L.trunk1, L.trunk2, L.head_hidden})}, f32);
  auto layer = [&](const Tensor& in, int64_t in_stride, int64_t in_width, int64_t w_off, int64_t b_off, int64_t out,
                   const char* what) {
    Tensor h = at::empty({count, rows, out}, x.options());
    gemm_strided_batched(op, what, rows, out, in_width, Operand{in.data_ptr(), CUDA_R_16BF, in_width, false},
                         in_stride, Operand{lo.w + w_off, CUDA_R_16BF, in_width, true}, w_stride, z.data_ptr(),
                         CUDA_R_32F, out, rows * out, count, CUBLAS_COMPUTE_32F);
    const float* zp = z.data_ptr<float>();
    const float *bias_lo = lo.p + b_off, *bias_hi = hi.p + b_off;
    auto* hp = static_cast<__nv_bfloat16*>(h.data_ptr());
    const int64_t all_rows = count * rows;
    if (out % 4 == 0 && aligned16(zp, bias_lo, bias_hi, hp))
      bias_relu_bf16_x4_kernel<<<row_group_blocks(all_rows, out / 4, kThreads), kThreads, 0, stream>>>(
          reinterpret_cast<const float4*>(zp), reinterpret_cast<const float4*>(bias_lo),
          reinterpret_cast<const float4*>(bias_hi), rows, reinterpret_cast<uint2*>(hp), all_rows, out / 4);
    else
      bias_relu_bf16_kernel<<<row_group_blocks(all_rows, out, kThreads), kThreads, 0, stream>>>(
          zp, bias_lo, bias_hi, rows, hp, all_rows, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return h;
  };
  // The first layer reads the same x for both networks (stride 0), the others their own input.
  Tensor h1 = layer(x, 0, L.state_dim, L.w_s1, L.b_s1, L.trunk1, "trunk layer 1");
  Tensor h2 = layer(h1, rows * L.trunk1, L.trunk1, L.w_s2, L.b_s2, L.trunk2, "trunk layer 2");
  Tensor hh = layer(h2, rows * L.trunk2, L.trunk2, L.w_h1, L.b_h1, L.head_hidden, "merged head layer 1");
  std::vector<HiddenActs> acts;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t slot = swap ? count - 1 - i : i;
    acts.push_back({h1[slot], h2[slot], hh[slot]});
  }
  return acts;
}

// The output layer of one network on hh [rows, head_hidden] (contiguous): its GEMM results,
// no bias, in the padded layout [rows, head_ld]. Block-diagonal: each head reads its column
// slice of hh and writes its column slice of the padded logits; the branch heads as one
// batched GEMM when they can.
Tensor output_logits(const char* op, const Tensor& hh, const __nv_bfloat16* w, const NetLayout& L,
                     const at::TensorOptions& f32) {
  const int64_t rows = hh.size(0);
  Tensor logits = at::empty({rows, L.head_ld}, f32);
  const auto* hh_ptr = static_cast<const __nv_bfloat16*>(hh.data_ptr());
  for (const HeadGroup& g : head_groups(L)) {
    const HeadSlice& s = g.first;
    // pad_width rows of W: the padding rows (zero, reserved by the layout) give logits
    // columns no one reads, and keep every GEMM size a multiple of 8.
    gemm_strided_batched(op, "output heads", rows, s.pad_width, s.in_width,
                         Operand{hh_ptr + s.in_col, CUDA_R_16BF, L.head_hidden, false}, g.in_col_stride,
                         Operand{w + s.w_off, CUDA_R_16BF, s.in_width, true}, g.w_stride,
                         logits.data_ptr<float>() + s.pad_col, CUDA_R_32F, L.head_ld, g.pad_col_stride, g.count,
                         CUBLAS_COMPUTE_32F);
  }
  return logits;
}

NetParams net_params(const Tensor& params, const Tensor& params_bf16) {
  return {params.data_ptr<float>(), static_cast<const __nv_bfloat16*>(params_bf16.data_ptr())};
}

}  // namespace

Logits forward_to_logits(const char* op, const Tensor& states, const Tensor& params, const Tensor& params_bf16,
                         const NetLayout& L) {
  // Kernels and cuBLAS must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(states.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Tensor x = cast_states(states, params_bf16.options(), stream);
  const NetParams net = net_params(params, params_bf16);
  const HiddenActs a = hidden_layers(op, x, {net}, L, params.options(), stream)[0];
  return {output_logits(op, a.hh, net.w, L, params.options()), x, a.h1, a.h2, a.hh};
}

namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> dueling_forward_cuda(
    const Tensor& states, const Tensor& params, const Tensor& params_bf16, c10::IntArrayRef layout,
    c10::string_view backward_precision) {
  const NetLayout L = parse_layout(layout, kForwardOp);
  check_forward_args(states, params, params_bf16, L, std::string(backward_precision));
  const BranchTable branches = make_branch_table(L, kForwardOp);
  Logits f = forward_to_logits(kForwardOp, states, params, params_bf16, L);
  const c10::cuda::CUDAGuard guard(states.device());
  const int64_t B = states.size(0);
  Tensor head = at::empty({B, L.head_out}, params.options());
  Tensor q = at::empty({B, L.total_actions, L.atoms}, params.options());
  launch_head_bias_dueling(f.logits.data_ptr<float>(), params.data_ptr<float>() + L.b_out, head.data_ptr<float>(),
                           q.data_ptr<float>(), B, L, branches, at::cuda::getCurrentCUDAStream());
  return {q, head, f.x, f.h1, f.h2, f.hh};
}

// _online_and_target_logits (the trainer's fused path; csrc/dqn_ops.cpp): the online network
// on state_pairs [2B, SD] and the target network on its last B rows (s'), each stopped before
// the aggregation, which the fused loss does as it reads the logits. The same checks and
// kernels as bf16_dueling_forward; s' is cast to BF16 once for both networks.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> online_and_target_logits_cuda(
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
  HiddenActs on, tgt;
  if (batch_networks) {  // both on all 2B rows: the target's first B (s) go unused
    const std::vector<HiddenActs> both = hidden_layers(op, x, {online, target}, L, f32, stream);
    on = both[0];
    tgt = both[1];
  } else {
    on = hidden_layers(op, x, {online}, L, f32, stream)[0];
    tgt = hidden_layers(op, x.narrow(0, B, B), {target}, L, f32, stream)[0];
  }
  Tensor logits = output_logits(op, on.hh, online.w, L, f32);
  Tensor logits_next_target = output_logits(op, tgt.hh.narrow(0, tgt.hh.size(0) - B, B), target.w, L, f32);
  return {logits, logits_next_target, x, on.h1, on.h2, on.hh};
}

}  // namespace

void launch_head_bias_dueling(const float* logits, const float* b_out, float* head, float* q, int64_t rows,
                              const NetLayout& L, const BranchTable& branches, cudaStream_t stream) {
  head_bias_dueling_kernel<<<row_group_blocks(rows, L.atoms, kThreads), kThreads, 0, stream>>>(
      logits, L.head_ld, b_out, head, q, rows, static_cast<int>(L.atoms), L.head_out,
      static_cast<int>(L.total_actions), branches);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("bf16_dueling_forward", &cuda::dueling_forward_cuda);
  m.impl("_online_and_target_logits", &cuda::online_and_target_logits_cuda);
}

}  // namespace dqn_ops

// dqn_loss on CUDA: one cooperative launch. A warp per sample (grid-stride) runs, per branch,
// the double-DQN action choice, the target distribution's projection onto the support, the
// cross-entropy and its gradient (C51), or the BDQ target and MSE/Huber (one atom); each block
// sums its warps' losses in warp order, and after a grid barrier block 0 sums the blocks'
// partials in block order: the loss is deterministic and no second launch is needed.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include "branch_table.cuh"
#include "loss_args.h"
#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

namespace cg = cooperative_groups;
using at::Tensor;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
// Per warp the kernel keeps 3 vectors of `atoms` floats in shared memory (target
// probabilities, their positions on the support, the projected distribution).
constexpr int64_t kMaxAtoms = 256;  // 24 KiB of shared memory per block

struct LossParams {
  const float* q;
  const float* q_next_online;
  const float* q_next_target;
  const int64_t* actions;
  const float* rewards;
  const float* dones;
  const float* weights;  // nullptr: all 1
  float* grad_q;
  float* td_error;
  float* loss;
  float* mean_q;
  float* partials;  // [2, gridDim.x]
  int batch, total_actions, atoms;
  float v_min, v_max, dz, gamma;
  LossType type;
};

// Expected value of the softmax of x over the support (every lane gets it). NaN in x gives NaN.
__device__ float expected_q(const float* x, const LossParams& P, int lane) {
  float mx = -INFINITY;
  for (int j = lane; j < P.atoms; j += 32) mx = fmaxf(mx, x[j]);
  mx = warp_max(mx);
  float s = 0.f, sz = 0.f;
  for (int j = lane; j < P.atoms; j += 32) {
    const float e = expf(x[j] - mx);
    s += e;
    sz = fmaf(e, P.v_min + j * P.dz, sz);
  }
  return warp_sum(sz) / warp_sum(s);
}

// The C51 loss of sample b: returns (cross-entropy, expected Q of the taken action), both
// branch means; writes the rows of grad_q of this sample.
__device__ float2 c51_sample(const BranchTable& br, const LossParams& P, int b, float scale, float* smem_warp,
                             int lane) {
  float* pt = smem_warp;             // target probabilities
  float* pos = smem_warp + P.atoms;  // position of r + gamma z_i on the support, in atoms
  float* m = pos + P.atoms;          // projected target distribution
  const int NA = P.atoms;
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  // Clamping onto the support would hide a NaN or Inf reward: such a sample is poisoned instead.
  const bool finite_return = isfinite(r) && isfinite(discount);
  float ce_sum = 0.f, q_sum = 0.f;
  for (int d = 0; d < br.count; ++d) {
    const int off = br.action_offset[d], n = br.size[d];
    const int64_t row0 = int64_t(b) * P.total_actions + off;
    // double DQN: the online network's greedy next action (the first of equal maxima; NaN wins)
    int a_star = 0;
    float best = -INFINITY;
    for (int a = 0; a < n; ++a) {
      const float qv = expected_q(P.q_next_online + (row0 + a) * NA, P, lane);
      if (qv > best || qv != qv) {
        best = qv;
        a_star = a;
        if (qv != qv) break;
      }
    }
    // the target network's distribution at that action, and where each atom's return lands
    const float* xt = P.q_next_target + (row0 + a_star) * NA;
    float mx = -INFINITY;
    for (int j = lane; j < NA; j += 32) mx = fmaxf(mx, xt[j]);
    mx = warp_max(mx);
    float s = 0.f;
    for (int j = lane; j < NA; j += 32) s += (pt[j] = expf(xt[j] - mx));
    s = warp_sum(s);
    for (int j = lane; j < NA; j += 32) {
      pt[j] /= s;
      const float tz = fminf(fmaxf(fmaf(discount, P.v_min + j * P.dz, r), P.v_min), P.v_max);
      pos[j] = fminf(fmaxf((tz - P.v_min) / P.dz, 0.f), float(NA - 1));
    }
    __syncwarp();
    // projection: each lane gathers the mass of its atoms, scanning the sources in order
    for (int j = lane; j < NA; j += 32) {
      float mj = 0.f;
      for (int i = 0; i < NA; ++i) {
        const float bi = pos[i];
        float l = floorf(bi), u = ceilf(bi);
        if (l == u) {  // lands exactly on an atom: all its mass goes there
          if (u > 0.f) l -= 1.f;
          else u += 1.f;
        }
        if (int(l) == j) mj = fmaf(pt[i], u - bi, mj);
        if (int(u) == j) mj = fmaf(pt[i], bi - l, mj);
      }
      m[j] = mj;
    }
    __syncwarp();
    // cross-entropy on the taken action and its gradient (softmax - m); zero for the others
    const int64_t a = P.actions[int64_t(b) * br.count + d];
    const bool valid = a >= 0 && a < n;
    if (!valid || !finite_return) {
      // No host sync can report it: the sample's loss and gradient become NaN, so the
      // optimizer skips the step and the trainer's non-finite check reports it (documented).
      for (int k = 0; k < n; ++k)
        for (int j = lane; j < NA; j += 32) P.grad_q[(row0 + k) * NA + j] = NAN;
      ce_sum = NAN;
      q_sum = NAN;
      __syncwarp();
      continue;
    }
    for (int k = 0; k < n; ++k) {
      if (k == a) continue;
      float* g = P.grad_q + (row0 + k) * NA;
      for (int j = lane; j < NA; j += 32) g[j] = 0.f;
    }
    const float* xc = P.q + (row0 + a) * NA;
    float mc = -INFINITY;
    for (int j = lane; j < NA; j += 32) mc = fmaxf(mc, xc[j]);
    mc = warp_max(mc);
    float sc = 0.f;
    for (int j = lane; j < NA; j += 32) sc += expf(xc[j] - mc);
    const float lse = mc + logf(warp_sum(sc));
    float ce = 0.f, qc = 0.f;
    float* g = P.grad_q + (row0 + a) * NA;
    for (int j = lane; j < NA; j += 32) {
      const float logp = xc[j] - lse;
      const float p = expf(logp);
      ce = fmaf(-m[j], logp, ce);
      qc = fmaf(p, P.v_min + j * P.dz, qc);
      g[j] = (p - m[j]) * scale;
    }
    ce_sum += warp_sum(ce);
    q_sum += warp_sum(qc);
    __syncwarp();  // the next branch reuses pt / pos / m
  }
  return make_float2(ce_sum / br.count, q_sum / br.count);
}

// The MSE / Huber loss of sample b on the BDQ target: returns (loss, |td| mean, Q mean).
__device__ float3 bdq_sample(const BranchTable& br, const LossParams& P, int b, float scale, int lane) {
  const int64_t row = int64_t(b) * P.total_actions;
  float target = 0.f;
  for (int d = 0; d < br.count; ++d) {  // every lane alike: the action counts are small
    const int off = br.action_offset[d], n = br.size[d];
    int a_star = 0;
    float best = -INFINITY;
    for (int a = 0; a < n; ++a) {
      const float qv = P.q_next_online[row + off + a];
      if (qv > best || qv != qv) {
        best = qv;
        a_star = a;
        if (qv != qv) break;
      }
    }
    target += P.q_next_target[row + off + a_star];
  }
  const float y = P.rewards[b] + P.gamma * (1.f - P.dones[b]) * (target / br.count);
  float loss = 0.f, td = 0.f, qsum = 0.f;
  for (int d = lane; d < br.count; d += 32) {
    const int off = br.action_offset[d], n = br.size[d];
    const int64_t a = P.actions[int64_t(b) * br.count + d];
    const bool valid = a >= 0 && a < n;
    if (!valid || !isfinite(y)) {  // poisoned sample: NaN loss and gradient (see c51_sample)
      for (int k = 0; k < n; ++k) P.grad_q[row + off + k] = NAN;
      loss = td = qsum = NAN;
      continue;
    }
    for (int k = 0; k < n; ++k)
      if (k != a) P.grad_q[row + off + k] = 0.f;
    const float qv = P.q[row + off + a];
    const float delta = y - qv;
    float l, dl;
    if (P.type == LossType::kMSE) {
      l = delta * delta;
      dl = -2.f * delta;
    } else {
      const float ad = fabsf(delta);
      l = ad <= 1.f ? 0.5f * delta * delta : ad - 0.5f;
      dl = delta != delta ? delta : -fminf(fmaxf(delta, -1.f), 1.f);  // fminf/fmaxf would drop a NaN
    }
    loss += l;
    td += fabsf(delta);
    qsum += qv;
    P.grad_q[row + off + a] = dl * scale;
  }
  return make_float3(warp_sum(loss) / br.count, warp_sum(td) / br.count, warp_sum(qsum) / br.count);
}

__global__ void __launch_bounds__(kThreads) dqn_loss_kernel(const __grid_constant__ BranchTable br,
                                                            const LossParams P) {
  extern __shared__ float smem[];  // kWarps x 3 x atoms (C51 only)
  __shared__ float block_loss[kWarps], block_q[kWarps];
  cg::grid_group grid = cg::this_grid();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float loss_acc = 0.f, q_acc = 0.f;
  for (int b = blockIdx.x * kWarps + warp; b < P.batch; b += gridDim.x * kWarps) {
    const float w = P.weights ? P.weights[b] : 1.f;
    const float scale = w / (float(P.batch) * br.count);
    float sample_loss, td, q;
    if (P.type == LossType::kC51) {
      const float2 r = c51_sample(br, P, b, scale, smem + warp * 3 * P.atoms, lane);
      sample_loss = td = r.x;
      q = r.y;
    } else {
      const float3 r = bdq_sample(br, P, b, scale, lane);
      sample_loss = r.x;
      td = r.y;
      q = r.z;
    }
    if (lane == 0) P.td_error[b] = td;
    loss_acc = fmaf(w, sample_loss, loss_acc);
    q_acc += q;
  }
  if (lane == 0) {
    block_loss[warp] = loss_acc;
    block_q[warp] = q_acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float l = 0.f, q = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      l += block_loss[w];
      q += block_q[w];
    }
    P.partials[blockIdx.x] = l;
    P.partials[gridDim.x + blockIdx.x] = q;
  }
  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    float l = 0.f, q = 0.f;
    for (unsigned i = 0; i < gridDim.x; ++i) {
      l += P.partials[i];
      q += P.partials[gridDim.x + i];
    }
    P.loss[0] = l / P.batch;
    P.mean_q[0] = q / P.batch;
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dqn_loss_cuda(const Tensor& q, const Tensor& q_next_online,
                                                         const Tensor& q_next_target, const Tensor& actions,
                                                         const Tensor& rewards, const Tensor& dones,
                                                         const c10::optional<Tensor>& weights,
                                                         c10::IntArrayRef branches, double v_min, double v_max,
                                                         double gamma, c10::string_view loss_type) {
  const LossShape S = check_loss_args(q, q_next_online, q_next_target, actions, rewards, dones, weights, branches,
                                      v_min, v_max, gamma, std::string(loss_type));
  DQN_CHECK(S.atoms <= kMaxAtoms, kLossOp, ": the CUDA kernel takes at most ", kMaxAtoms, " atoms, got ", S.atoms);
  DQN_CHECK(S.batch <= INT_MAX / 2 && S.batch * S.total_actions * S.atoms <= (int64_t(1) << 40), kLossOp,
            ": batch too large");
  const BranchTable br = make_branch_table(branches, kLossOp);
  // Kernels must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const size_t smem = S.type == LossType::kC51 ? size_t(kWarps) * 3 * S.atoms * sizeof(float) : 0;
  const int cap = cooperative_block_cap(dqn_loss_kernel, kThreads, smem);
  DQN_CHECK(cap > 0, kLossOp, ": the kernel cannot be resident on this device");
  const int grid = static_cast<int>(std::min<int64_t>((S.batch + kWarps - 1) / kWarps, cap));

  Tensor loss = at::empty({}, q.options());
  Tensor grad_q = at::empty_like(q);
  Tensor td_error = at::empty({S.batch}, q.options());
  Tensor mean_q = at::empty({}, q.options());
  Tensor partials = at::empty({2 * grid}, q.options());

  LossParams P{};
  P.q = q.data_ptr<float>();
  P.q_next_online = q_next_online.data_ptr<float>();
  P.q_next_target = q_next_target.data_ptr<float>();
  P.actions = actions.data_ptr<int64_t>();
  P.rewards = rewards.data_ptr<float>();
  P.dones = dones.data_ptr<float>();
  P.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  P.grad_q = grad_q.data_ptr<float>();
  P.td_error = td_error.data_ptr<float>();
  P.loss = loss.data_ptr<float>();
  P.mean_q = mean_q.data_ptr<float>();
  P.partials = partials.data_ptr<float>();
  P.batch = static_cast<int>(S.batch);
  P.total_actions = static_cast<int>(S.total_actions);
  P.atoms = static_cast<int>(S.atoms);
  P.v_min = static_cast<float>(v_min);
  P.v_max = static_cast<float>(v_max);
  P.dz = S.type == LossType::kC51 ? static_cast<float>((v_max - v_min) / double(S.atoms - 1)) : 0.f;
  P.gamma = static_cast<float>(gamma);
  P.type = S.type;
  void* args[] = {const_cast<BranchTable*>(&br), &P};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(dqn_loss_kernel), dim3(grid), dim3(kThreads), args,
                                             smem, stream));
  return {loss, grad_q, td_error, mean_q};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) { m.impl("dqn_loss", &cuda::dqn_loss_cuda); }

}  // namespace dqn_ops

// The QR-DQN loss of one (sample, branch) (loss.cu's parts: see loss.cu). A warp per branch:
// the double-DQN choice by the mean of the online quantiles (quantiles.cuh), the target
// quantiles T_j = r + gamma (1 - done) theta_target(s', a*)_j staged in the warp's shared
// memory, then the N x N quantile Huber terms: lane l owns the quantiles i = l, l + 32, ...
// of the taken action and loops over every T_j, read from shared memory (a broadcast: every
// lane reads the same T_j).
#pragma once

#include <cstdint>

#include "../branch_table.cuh"
#include "../quantiles.cuh"
#include "../reductions.cuh"
#include "params.cuh"

namespace dqn_ops {
namespace cuda {
namespace {  // see loss/params.cuh

// Floats of shared memory per warp: the target quantiles, padded to whole float4s (the inner
// loop reads them four at a time, so every warp's area must start 16-byte aligned).
__host__ __device__ inline int64_t qr_floats_per_warp(int64_t quantiles) { return (quantiles + 3) / 4 * 4; }

// A poisoned sample's gradient rows in branch d: the taken action's N quantiles NaN, or, when
// the action is out of range (no row is taken), every action's.
__device__ void qr_poison_rows(const BranchTable& br, const LossParams& P, int b, int d, int lane) {
  const int N = P.atoms, n = br.size[d];
  const int64_t row0 = int64_t(b) * P.total_actions + br.action_offset[d];
  const int64_t a = P.actions[int64_t(b) * br.count + d];
  const bool valid = a >= 0 && a < n;
  float* g = P.grad_q + (row0 + (valid ? a : 0)) * N;
  const int count = valid ? N : n * N;
  for (int i = lane; i < count; i += 32) g[i] = NAN;
}

// The quantile Huber sums of kRows quantiles (theta, with fractions tau and 1 - tau) over the
// target quantiles T[0..N), in the order of j: per pair u = T_j - theta,
//   loss += |tau - 1{u < 0}| huber(u),  grad += |tau - 1{u < 0}| clamp(u, -1, 1)
// (huber with kappa 1 as c (|u| - c / 2), c = min(|u|, 1): 0.5 u^2 for |u| <= 1, |u| - 0.5
// beyond, without a branch). A NaN theta gives a NaN loss here but not a NaN grad (fminf drops
// the NaN): the caller sees to that. The pairs are N^2 per branch, so this loop is the kernel's
// work: kRows quantiles share each T read, four T at a time (one 16-byte shared load), and
// each quantile's two sums are independent chains of FMAs.
template <int kRows>
__device__ __forceinline__ void quantile_huber_sums(const float* __restrict__ T, int N, const float (&theta)[kRows],
                                                    const float (&tau)[kRows], const float (&tau_neg)[kRows],
                                                    float (&loss)[kRows], float (&grad)[kRows]) {
  auto pair = [&](float t) {
#pragma unroll
    for (int e = 0; e < kRows; ++e) {
      const float u = t - theta[e];
      const float c = fminf(fabsf(u), 1.f);
      const float w = u < 0.f ? tau_neg[e] : tau[e];
      loss[e] = fmaf(w, c * fmaf(-0.5f, c, fabsf(u)), loss[e]);
      grad[e] = fmaf(w, copysignf(c, u), grad[e]);
    }
  };
  const float4* T4 = reinterpret_cast<const float4*>(T);
  const int quads = N / 4;
  for (int q = 0; q < quads; ++q) {
    const float4 t = T4[q];
    pair(t.x);
    pair(t.y);
    pair(t.z);
    pair(t.w);
  }
  for (int j = 4 * quads; j < N; ++j) pair(T[j]);
}

// Round k of the lane's quantiles and kRows - 1 after it: i = lane + 32 (k + e), those < N.
// Writes their gradient (gscale = -w_b / (B D N)) and adds their loss sums and thetas to the
// lane's sums, in the order of i. A lane without a quantile there runs the loop on theta = 0
// (the warp runs it anyway) and keeps nothing.
template <int kRows>
__device__ __forceinline__ void qr_round(const float* T, const float* theta_row, float* grad_row, int N, int k,
                                         int lane, float gscale, float& loss_sum, float& theta_sum) {
  float theta[kRows], tau[kRows], tau_neg[kRows], loss[kRows], grad[kRows];
#pragma unroll
  for (int e = 0; e < kRows; ++e) {
    const int i = lane + 32 * (k + e);
    theta[e] = i < N ? theta_row[i] : 0.f;
    tau[e] = float(2 * i + 1) / float(2 * N);  // the fraction tau_i = (2i + 1) / 2N
    tau_neg[e] = 1.f - tau[e];                 // |tau_i - 1| (u < 0)
    loss[e] = grad[e] = 0.f;
  }
  quantile_huber_sums<kRows>(T, N, theta, tau, tau_neg, loss, grad);
#pragma unroll
  for (int e = 0; e < kRows; ++e) {
    const int i = lane + 32 * (k + e);
    if (i >= N) break;
    // d(huber)/d(theta) = -clamp(u): NaN for a NaN theta, as torch's huber_loss backward gives
    grad_row[i] = theta[e] != theta[e] ? theta[e] : grad[e] * gscale;
    loss_sum += loss[e];
    theta_sum += theta[e];
  }
}

// The QR loss of branch d of sample b: returns (loss_bd, the mean of the taken action's
// quantiles, 1 when the branch poisons its sample else 0) and writes the branch's rows of
// grad_q. A non-finite target quantile (a NaN/Inf reward or done, a non-finite target network
// output, an overflow) or an out-of-range action poisons the sample: this branch's rows get
// NaN here (qr_poison_rows) and its loss and Q are NaN; the kernel then gives the sample's
// other branches NaN rows too. `stage`: qr_floats_per_warp(N) floats of this warp's.
__device__ float3 qr_branch(const BranchTable& br, const LossParams& P, int b, int d, float scale, float* stage,
                            int lane) {
  const int N = P.atoms, n = br.size[d];
  const int64_t row0 = int64_t(b) * P.total_actions + br.action_offset[d];
  const int64_t a = P.actions[int64_t(b) * br.count + d];
  if (!(a >= 0 && a < n)) {  // no host sync can report it (see c51_branch)
    qr_poison_rows(br, P, b, d, lane);
    return make_float3(NAN, NAN, 1.f);
  }
  for (int k = 0; k < n; ++k)  // the other actions' gradient rows are 0
    if (k != a)
      for (int i = lane; i < N; i += 32) P.grad_q[(row0 + k) * N + i] = 0.f;

  // double DQN: the online network's greedy next action by the quantiles' mean (the first of
  // equal maxima; NaN wins), kQChunk actions' loads and reductions in flight together
  const float* on = P.q_next_online + row0 * N;
  int a_star = 0;
  float best = -INFINITY;
  bool nan_seen = false;
  for (int a0 = 0; a0 < n && !nan_seen; a0 += kQChunk) {
    float s[kQChunk];
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      s[k] = 0.f;
      if (a0 + k < n)
        for (int j = lane; j < N; j += 32) s[k] += on[(a0 + k) * N + j];
    }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      const float qv = quantile_mean(s[k], N);  // every lane, every k: a warp-wide reduction
      if (a0 + k < n && !nan_seen && (qv > best || qv != qv)) {
        best = qv;
        a_star = a0 + k;
        nan_seen = qv != qv;
      }
    }
  }

  // the target quantiles of that action, staged for the whole warp
  const float* tg = P.q_next_target + (row0 + a_star) * N;
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  bool finite = true;
  for (int j = lane; j < N; j += 32) {
    const float t = fmaf(discount, tg[j], r);
    stage[j] = t;
    finite = finite && isfinite(t);
  }
  if (!__all_sync(0xffffffffu, finite)) {
    qr_poison_rows(br, P, b, d, lane);
    __syncwarp();  // the warp's next branch reuses the stage
    return make_float3(NAN, NAN, 1.f);
  }
  __syncwarp();

  // the quantile Huber loss on the taken action: the lane's quantiles two rounds at a time
  const float* theta_row = P.q + (row0 + a) * N;
  float* g = P.grad_q + (row0 + a) * N;
  const float gscale = -scale / N;
  const int rounds = (N + 31) / 32;
  float loss_sum = 0.f, theta_sum = 0.f;
  int k = 0;
  for (; k + 2 <= rounds; k += 2) qr_round<2>(stage, theta_row, g, N, k, lane, gscale, loss_sum, theta_sum);
  if (k < rounds) qr_round<1>(stage, theta_row, g, N, k, lane, gscale, loss_sum, theta_sum);
  __syncwarp();  // the warp's next branch reuses the stage
  return make_float3(warp_sum(loss_sum) / N, quantile_mean(theta_sum, N), 0.f);
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

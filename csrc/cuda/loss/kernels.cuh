// The loss kernel and its per-branch / per-sample bodies (loss.cu's parts: see loss.cu).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "../branch_table.cuh"
#include "../pdl.cuh"
#include "../reductions.cuh"
#include "layout.h"
#include "params.cuh"
#include "projection.cuh"
#include "quantile.cuh"
#include "rows.cuh"

namespace dqn_ops {
namespace cuda {
namespace {  // see loss/params.cuh

// The C51 loss of branch d of sample b: returns (cross-entropy, expected Q of the taken
// action); writes the branch's rows of grad_q.
__device__ float2 c51_branch(const BranchTable& br, const LossParams& P, int b, int d, float scale, float* work,
                             int lane) {
  const int NA = P.atoms, n = br.size[d];
  const int64_t row0 = q_row_of(br, b, P.total_actions, d);
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  const int64_t a = taken_action(br, P.actions, b, d);
  // Clamping onto the support would hide a NaN or Inf reward, and an out-of-range action has
  // no row: no host sync can report either, so the sample's loss and gradient become NaN, the
  // optimizer skips the step and the trainer's non-finite check reports it (documented).
  if (!(a >= 0 && a < n) || !isfinite(r) || !isfinite(discount)) {
    for (int i = lane; i < n * NA; i += 32) P.grad_q[row0 * NA + i] = NAN;
    return make_float2(NAN, NAN);
  }
  const float* on = P.q_next_online + row0 * NA;
  const float* tg = P.q_next_target + row0 * NA;
  const float* xc = P.q + (row0 + a) * NA;
  if (P.staged) {
    stage_rows(work, on, tg, xc, n * NA, NA, lane);
    on = work;
    tg = work + n * NA;
    xc = work + 2 * n * NA;
    work += (2 * P.max_actions + 1) * NA;
  }
  float* pt = work;             // target probabilities
  float* pos = work + NA;       // position of r + gamma z_i on the support, in atoms
  float* m = work + 2 * NA;     // projected target distribution
  for (int k = 0; k < n; ++k) {  // the other actions' gradient rows are 0
    if (k == a) continue;
    for (int j = lane; j < NA; j += 32) P.grad_q[(row0 + k) * NA + j] = 0.f;
  }
  __syncwarp();

  // double DQN: the online network's greedy next action (the first of equal maxima; NaN wins)
  int a_star = 0;
  float best = -INFINITY;
  bool nan_seen = false;
  for (int a0 = 0; a0 < n && !nan_seen; a0 += kQChunk) {
    float mx[kQChunk], s[kQChunk], sz[kQChunk];
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      mx[k] = -INFINITY;
      if (a0 + k < n)
        for (int j = lane; j < NA; j += 32) mx[k] = fmaxf(mx[k], on[(a0 + k) * NA + j]);
    }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) mx[k] = warp_max(mx[k]);
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      s[k] = 0.f;
      sz[k] = 0.f;
      if (a0 + k < n)
        for (int j = lane; j < NA; j += 32) {
          const float e = expf(on[(a0 + k) * NA + j] - mx[k]);
          s[k] += e;
          sz[k] = fmaf(e, P.v_min + j * P.dz, sz[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      s[k] = warp_sum(s[k]);
      sz[k] = warp_sum(sz[k]);
    }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      const float qv = sz[k] / s[k];
      if (a0 + k < n && !nan_seen && (qv > best || qv != qv)) {
        best = qv;
        a_star = a0 + k;
        nan_seen = qv != qv;
      }
    }
  }

  // the target network's distribution at that action, and where each atom's return lands
  const float* xt = tg + a_star * NA;
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
  const bool ascending = pos[NA - 1] >= pos[0];
  for (int j = lane; j < NA; j += 32) m[j] = projected_mass(pt, pos, NA, j, ascending);
  __syncwarp();

  // cross-entropy on the taken action and its gradient (softmax - m)
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
  ce = warp_sum(ce);
  qc = warp_sum(qc);
  __syncwarp();  // the warp's next branch reuses the work area
  return make_float2(ce, qc);
}

// c51_branch for atoms <= kDuelingMaxAtoms: lane owns atoms j0 = lane and j1 = lane + 32, those < atoms.
// The same arithmetic as c51_branch but for the projection's summation order
// (project_by_runs). `work` holds 4 * atoms floats: the target probabilities, the positions
// and the two projected halves.
//
// reads_head(kRows) (the fused loss, _dqn_loss_on_logits): the rows are raw head logits, biased
// and (kHeadDueling) aggregated as they are read (BranchRows), and the gradient is written
// w.r.t. the head logits (write_branch_head_grad; branch_sum, kHeadDueling: this warp's row of
// per-atom sums for the value column).
template <LossRows kRows, bool kRowsInRegisters>
__device__ float2 c51_branch_small(const BranchTable& br, const LossParams& P, int b, int d, float scale,
                                   float* work, float* branch_sum, int lane) {
  const int NA = P.atoms, n = br.size[d];
  const int64_t row0 = q_row_of(br, b, P.total_actions, d);
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  const int64_t a = taken_action(br, P.actions, b, d);
  if (!(a >= 0 && a < n) || !isfinite(r) || !isfinite(discount)) {  // see c51_branch
    if constexpr (reads_head(kRows)) write_branch_head_grad<kRows>(P, br, b, d, -1, NAN, NAN, branch_sum, lane);
    else
      for (int i = lane; i < n * NA; i += 32) P.grad_q[row0 * NA + i] = NAN;
    return make_float2(NAN, NAN);
  }
  const int j0 = lane, j1 = lane + 32;
  const bool has0 = j0 < NA, has1 = j1 < NA;  // has1 implies has0
  const float z0 = P.v_min + j0 * P.dz, z1 = P.v_min + j1 * P.dz;
  // double DQN: the online network's greedy next action (the first of equal maxima; NaN wins),
  // and the target network's logits of that action, loaded beside the online ones. `choose`
  // takes one chunk of `live` actions (warp-uniform): their expected Q reduced together.
  float best = -INFINITY, t0 = 0.f, t1 = 0.f;
  bool nan_seen = false;
  auto choose = [&](int live, const float (&x0)[kQChunk], const float (&x1)[kQChunk], const float (&y0)[kQChunk],
                    const float (&y1)[kQChunk]) {
    float mx[kQChunk], s[kQChunk], sz[kQChunk];
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)
      if (k < live) mx[k] = warp_max(fmaxf(fmaxf(-INFINITY, x0[k]), x1[k]));
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)
      if (k < live) {
        const float e0 = expf(x0[k] - mx[k]), e1 = expf(x1[k] - mx[k]);
        s[k] = warp_sum((0.f + e0) + e1);
        sz[k] = warp_sum(fmaf(e1, z1, fmaf(e0, z0, 0.f)));
      }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      if (k >= live) break;
      const float qv = sz[k] / s[k];
      if (!nan_seen && (qv > best || qv != qv)) {
        best = qv;
        t0 = y0[k];
        t1 = y1[k];
        nan_seen = qv != qv;
      }
    }
  };
  // A missing atom reads as -inf: exp(-inf - max) = 0 adds nothing to any sum; nothing is
  // written for it (atoms < 32 leave lanes without one).
  float xc0 = -INFINITY, xc1 = -INFINITY;  // the taken action's logits
  if constexpr (kRowsInRegisters) {
    BranchQ q;
    branch_q<kRows>(P, br, b, d, j0, j1, has0, has1, q);
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)  // a select, not an index: a register array stays in registers
      if (k == a) {
        xc0 = q.x0[0][k];
        xc1 = q.x1[0][k];
      }
    choose(n, q.x0[1], q.x1[1], q.x0[2], q.x1[2]);
  } else {
    auto load2 = [&](const BranchRows& rows, int k, float& x0, float& x1) {
      x0 = has0 ? q_at<kRows>(rows, int64_t(k) * NA + j0, rows.v0, rows.mean0) : -INFINITY;
      x1 = has1 ? q_at<kRows>(rows, int64_t(k) * NA + j1, rows.v1, rows.mean1) : -INFINITY;
    };
    BranchRows rows[3];
    branch_rows<kRows>(P, br, b, d, j0, j1, has0, has1, rows);
    load2(rows[0], int(a), xc0, xc1);
    for (int a0 = 0; a0 < n && !nan_seen; a0 += kQChunk) {
      float x0[kQChunk], x1[kQChunk], y0[kQChunk], y1[kQChunk];
      const int live = min(kQChunk, n - a0);
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        if (k < live) {
          load2(rows[1], a0 + k, x0[k], x1[k]);
          load2(rows[2], a0 + k, y0[k], y1[k]);
        }
      choose(live, x0, x1, y0, y1);
    }
  }
  if constexpr (kRows == LossRows::kQ)
    for (int k = 0; k < n; ++k)  // the other actions' gradient rows are 0
      if (k != a) {
        if (has0) P.grad_q[(row0 + k) * NA + j0] = 0.f;
        if (has1) P.grad_q[(row0 + k) * NA + j1] = 0.f;
      }

  // the target network's distribution at the chosen action, and where each atom's return lands
  float* pt = work;        // target probabilities
  float* pos = work + NA;  // position of r + gamma z_i on the support, in atoms
  const float mt = warp_max(fmaxf(fmaxf(-INFINITY, t0), t1));
  const float e0 = expf(t0 - mt), e1 = expf(t1 - mt);
  const float st = warp_sum((0.f + e0) + e1);
  auto position = [&](int j) {
    const float tz = fminf(fmaxf(fmaf(discount, P.v_min + j * P.dz, r), P.v_min), P.v_max);
    return fminf(fmaxf((tz - P.v_min) / P.dz, 0.f), float(NA - 1));
  };
  float* lower = work + 2 * NA;  // projected mass by atom, from sources it is the lower atom of
  float* upper = work + 3 * NA;  // from sources whose lower atom is this one, for the atom above
  if (has0) {
    pt[j0] = e0 / st;
    pos[j0] = position(j0);
    lower[j0] = upper[j0] = 0.f;
  }
  if (has1) {
    pt[j1] = e1 / st;
    pos[j1] = position(j1);
    lower[j1] = upper[j1] = 0.f;
  }
  __syncwarp();
  project_by_runs(pt, pos, lower, upper, NA, lane);
  __syncwarp();
  const float m0 = has0 ? lower[j0] + (j0 > 0 ? upper[j0 - 1] : 0.f) : 0.f;
  const float m1 = has1 ? lower[j1] + upper[j1 - 1] : 0.f;

  // cross-entropy on the taken action and its gradient (softmax - m)
  const float mc = warp_max(fmaxf(fmaxf(-INFINITY, xc0), xc1));
  const float lse = mc + logf(warp_sum((0.f + expf(xc0 - mc)) + expf(xc1 - mc)));
  float ce = 0.f, qc = 0.f, g0 = 0.f, g1 = 0.f;
  if (has0) {
    const float logp0 = xc0 - lse, p0 = expf(logp0);
    ce = fmaf(-m0, logp0, ce);
    qc = fmaf(p0, z0, qc);
    g0 = __fmul_rn(p0 - m0, scale);  // see g1
  }
  if (has1) {
    const float logp1 = xc1 - lse, p1 = expf(logp1);
    ce = fmaf(-m1, logp1, ce);
    qc = fmaf(p1, z1, qc);
    // Rounded on its own (__fmul_rn is never contracted into an FMA): the fused path subtracts
    // the branch mean from it next, and must round as the public ops do, which store it first.
    g1 = __fmul_rn(p1 - m1, scale);
  }
  if constexpr (reads_head(kRows)) {
    write_branch_head_grad<kRows>(P, br, b, d, int(a), g0, g1, branch_sum, lane);
  } else {
    float* g = P.grad_q + (row0 + a) * NA;
    if (has0) g[j0] = g0;
    if (has1) g[j1] = g1;
  }
  ce = warp_sum(ce);
  qc = warp_sum(qc);
  __syncwarp();  // the warp's next branch reuses the work area
  return make_float2(ce, qc);
}

// The bootstrap mask of sample b's member of table entry k (1 without masks).
__device__ __forceinline__ float member_mask(const BranchTable& br, const LossParams& P, int b, int k) {
  return P.masks ? P.masks[int64_t(b) * (br.count / br.per_member) + member_of(br, k)] : 1.f;
}

// The MSE / Huber loss of sample b on the BDQ target, per ensemble member from its own rows:
// returns (loss, |td| mean, Q mean) over the (member, branch) entries, the loss masked
// (member_mask), the others not. scale: the gradient's w_b / (B E D), before the mask.
__device__ float3 bdq_sample(const BranchTable& br, const LossParams& P, int b, float scale, int lane) {
  const int D = br.per_member;
  float loss = 0.f, td = 0.f, qsum = 0.f;
  for (int k0 = 0; k0 < br.count; k0 += D) {  // member k0 / D's entries k0 .. k0 + D - 1
    float target = 0.f;
    for (int k = k0; k < k0 + D; ++k) {  // every lane alike: the action counts are small
      const int64_t first = q_row_of(br, b, P.total_actions, k);
      const int n = br.size[k];
      int a_star = 0;
      float best = -INFINITY;
      for (int a = 0; a < n; ++a) {
        const float qv = P.q_next_online[first + a];
        if (qv > best || qv != qv) {
          best = qv;
          a_star = a;
          if (qv != qv) break;
        }
      }
      target += P.q_next_target[first + a_star];
    }
    const float y = P.rewards[b] + P.gamma * (1.f - P.dones[b]) * (target / D);
    const float m = member_mask(br, P, b, k0);
    const float gscale = P.masks ? scale * m : scale;
    float member_loss = 0.f;
    for (int k = k0 + lane; k < k0 + D; k += 32) {
      const int64_t first = q_row_of(br, b, P.total_actions, k);
      const int n = br.size[k];
      const int64_t a = taken_action(br, P.actions, b, k);
      const bool valid = a >= 0 && a < n;
      if (!valid || !isfinite(y)) {  // poisoned sample: NaN loss and gradient (see c51_sample)
        for (int j = 0; j < n; ++j) P.grad_q[first + j] = NAN;
        member_loss = td = qsum = NAN;
        continue;
      }
      for (int j = 0; j < n; ++j)
        if (j != a) P.grad_q[first + j] = 0.f;
      const float qv = P.q[first + a];
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
      member_loss += l;
      td += fabsf(delta);
      qsum += qv;
      P.grad_q[first + a] = dl * gscale;
    }
    loss += P.masks ? m * member_loss : member_loss;
  }
  return make_float3(warp_sum(loss) / br.count, warp_sum(td) / br.count, warp_sum(qsum) / br.count);
}

// kSmallAtoms: C51 with atoms <= 64 (c51_branch_small). kRows: what the rows are (LossRows);
// the fused loss on head logits is C51 with atoms <= 64, a warp per branch (warps_per_sample ==
// branches: the value column's gradient, kHeadDueling, sums the sample's warps' branch sums).
// kSmallAtomsMinBlocks: the <= 64-atom versions are latency-bound, so 3 blocks (24 warps) per
// SM: at most 85 registers. Unbounded, the fused version takes more registers than that and
// fits only 2 blocks per SM, which was slower; with 4 blocks per SM (64 registers) it spills,
// which was slower still.
// kRowsInRegisters: every branch has at most kQChunk actions (BranchQ).
// kQuantiles: QR (qr_branch), a warp per branch as C51's; dqn_loss's rows only (the fused loss
// is C51's). Its inner loops (the direct pairs' FMAs, the sorted version's dependent shared
// loads) are latency-bound, and more warps hide more: 4 blocks (32 warps) per SM, at most 64
// registers, which it fits without spilling (its sorted version's shared memory, 34 KiB a
// block at 200 quantiles, still lets 4 blocks reside).
// kFractions: IQN, kQuantiles' code (qr_branch<true>) with the fractions read per sample and the
// three inputs' own slot counts; its own instantiation, so that QR's, with N = K = N' and the
// midpoints known when it compiles, keeps its registers.
constexpr int kSmallAtomsMinBlocks = 3;
constexpr int kQuantileMinBlocks = 4;

template <bool kSmallAtoms, LossRows kRows, bool kRowsInRegisters, bool kQuantiles = false, bool kFractions = false>
__global__ void __launch_bounds__(kMaxWarps * 32, kSmallAtoms  ? kSmallAtomsMinBlocks
                                                  : kQuantiles ? kQuantileMinBlocks
                                                               : 1)
    dqn_loss_kernel(const __grid_constant__ BranchTable br, const LossParams P) {
  pdl_enter();
  constexpr bool kDueling = kRows == LossRows::kHeadDueling;
  static_assert(!reads_head(kRows) || kSmallAtoms, "the fused loss runs the <= 64-atom version");
  static_assert(!kRowsInRegisters || kSmallAtoms, "rows in registers: the <= 64-atom version");
  static_assert(!kQuantiles || (!kSmallAtoms && kRows == LossRows::kQ), "QR: dqn_loss's rows, its own version");
  static_assert(!kFractions || kQuantiles, "IQN runs QR's version");
  // C51 and QR: P.work_floats per warp. 16-byte aligned, as QR reads its stage as float4s
  // (nvcc already aligns an extern shared array to 16 bytes: this states the requirement).
  extern __shared__ __align__(16) float smem[];
  // Each warp's sums of a round, and (kHeadDueling) its branch sums of dq per atom for the value
  // column's gradient, read by its sample's first warp after the round's barrier. Two buffers,
  // by round parity, so one barrier a round suffices: a round writes the buffer the previous
  // round did not read, and the round before that finished its reads before the last barrier.
  __shared__ float part_a[2][kMaxWarps], part_b[2][kMaxWarps], part_c[2][kMaxWarps], part_d[2][kMaxWarps];
  __shared__ float branch_sums[2][kDueling ? kMaxWarps * kDuelingMaxAtoms : 1];
  __shared__ float slot_loss[kMaxWarps], slot_q[kMaxWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = P.warps_per_sample, S = P.samples_per_block;
  const int slot = warp / W, wi = warp % W;  // this warp's sample in the block, and its share
  // C51 and QR: a warp per (sample, branch), the branch sums averaged per sample.
  const bool per_branch = kQuantiles || P.type == LossType::kC51;
  float* work = smem + warp * P.work_floats;
  float loss_acc = 0.f, q_acc = 0.f;  // kept by each sample slot's first warp
  int buf = 0;                        // this round's buffers
  for (int b0 = blockIdx.x * S; b0 < P.batch; b0 += gridDim.x * S, buf ^= 1) {  // uniform across the block
    const int b = b0 + slot;
    const bool live = slot < S && b < P.batch;
    const float w = live && P.weights ? P.weights[b] : 1.f;
    const float scale = w / (float(P.batch) * br.count);
    // C51 / QR: loss and Q sums over this warp's entries (z, QR: > 0 when one poisons the
    // sample). The loss sum x is unmasked (the TD error's); with masks, lane 0 keeps the masked
    // sum in part_d (shared memory: one more register across the branch calls would spill),
    // and each entry's mask scales its gradient. The fused loss takes no masks.
    float x = 0.f, y = 0.f, z = 0.f;
    const bool masked = !reads_head(kRows) && P.masks != nullptr;
    if (lane == 0) part_d[buf][warp] = 0.f;
    if (live) {
      if constexpr (kQuantiles) {
        for (int d = wi; d < br.count; d += W) {
          const float m = masked ? member_mask(br, P, b, d) : 1.f;
          const float3 r = qr_branch<kFractions>(br, P, b, d, masked ? scale * m : scale, work, lane);
          if (masked && lane == 0) part_d[buf][warp] += m * r.x;
          x += r.x;
          y += r.y;
          z += r.z;
        }
      } else if (per_branch) {
        for (int d = wi; d < br.count; d += W) {
          const float m = masked ? member_mask(br, P, b, d) : 1.f;
          float2 r;
          if constexpr (kSmallAtoms)
            r = c51_branch_small<kRows, kRowsInRegisters>(br, P, b, d, masked ? scale * m : scale, work,
                                                          kDueling ? branch_sums[buf] + warp * kDuelingMaxAtoms : nullptr,
                                                          lane);
          else
            r = c51_branch(br, P, b, d, masked ? scale * m : scale, work, lane);
          if (masked && lane == 0) part_d[buf][warp] += m * r.x;
          x += r.x;
          y += r.y;
        }
      } else if constexpr (kRows == LossRows::kQ) {
        const float3 r = bdq_sample(br, P, b, scale, lane);  // r.x masked
        x = r.x;
        z = r.y;
        y = r.z;
      }
    }
    if (lane == 0) {
      part_a[buf][warp] = x;
      part_b[buf][warp] = y;
      part_c[buf][warp] = z;
    }
    __syncthreads();
    if constexpr (kDueling)  // the sample's warps hold its branches 0 .. W - 1, in order
      if (live && wi == 0) write_value_grad(P, b, branch_sums[buf] + slot * W * kDuelingMaxAtoms, W, lane);
    if constexpr (kQuantiles)  // a branch that poisons its sample poisons every branch's rows
      if (live) {
        bool poisoned = false;
        for (int k = 0; k < W; ++k) poisoned = poisoned || part_c[buf][slot * W + k] > 0.f;
        if (poisoned)
          for (int d = wi; d < br.count; d += W) qr_poison_rows(br, P, b, d, lane);
      }
    if (live && wi == 0 && lane == 0) {
      float sample_loss = 0.f, q = 0.f, td = 0.f, masked_loss = 0.f;
      for (int k = 0; k < W; ++k) {  // branch order (warp k took branches k, k + W, ...)
        sample_loss += part_a[buf][warp + k];
        q += part_b[buf][warp + k];
        td += part_c[buf][warp + k];
        masked_loss += part_d[buf][warp + k];
      }
      if (per_branch) {  // the TD error is the unmasked loss (QR's part_c holds the poison flags)
        sample_loss /= br.count;
        q /= br.count;
        td = sample_loss;
        if (masked) sample_loss = masked_loss / br.count;
      }
      P.td_error[b] = td;
      loss_acc = fmaf(w, sample_loss, loss_acc);
      q_acc += q;
    }
  }
  if (wi == 0 && lane == 0 && slot < S) {
    slot_loss[slot] = loss_acc;
    slot_q[slot] = q_acc;
  }
  __syncthreads();
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    float l = 0.f, q = 0.f;
    for (int k = 0; k < S; ++k) {
      l += slot_loss[k];
      q += slot_q[k];
    }
    P.partials[blockIdx.x] = l;
    P.partials[gridDim.x + blockIdx.x] = q;
    // The last block to finish sums every block's partial (threadFenceReduction, CUDA
    // samples): the fence makes this block's partials visible before its ticket is taken.
    __threadfence();
    last_block = atomicAdd(P.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last_block) {
    // Every other block's partials are visible (their fences came before their tickets).
    // Thread t takes partials t, t + blockDim.x, ... in order, then the warps' sums and
    // theirs in fixed order: the sum does not depend on which block came last.
    __threadfence();
    float l = 0.f, q = 0.f;
    for (unsigned i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
      l += __ldcg(P.partials + i);
      q += __ldcg(P.partials + gridDim.x + i);
    }
    l = warp_sum(l);
    q = warp_sum(q);
    if (lane == 0) {
      part_a[0][warp] = l;
      part_b[0][warp] = q;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float lt = 0.f, qt = 0.f;
      for (unsigned k = 0; k < blockDim.x / 32; ++k) {
        lt += part_a[0][k];
        qt += part_b[0][k];
      }
      P.loss[0] = lt / P.batch;
      P.mean_q[0] = qt / P.batch;
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

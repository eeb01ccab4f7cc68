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

// c51_branch for atoms <= 32 * kSlots (kSlots 2: up to 64 atoms, 4: up to kDuelingMaxAtoms): lane
// owns atoms j_e = lane + 32 e, those < atoms (LaneAtoms). The same arithmetic as c51_branch
// but for the summation orders of the warp's reductions and of the projection
// (project_by_runs). `work` holds 4 * atoms floats: the target probabilities, the positions
// and the two projected halves.
//
// reads_head(kRows) (the fused loss, _dqn_loss_on_logits): the rows are raw head logits, biased
// and (kHeadDueling) aggregated as they are read (BranchRows), and the gradient is written
// w.r.t. the head logits (write_branch_head_grad; branch_sum, kHeadDueling: this entry's row of
// per-atom sums for its member's value column).
template <LossRows kRows, bool kRowsInRegisters, int kSlots>
__device__ float2 c51_branch_small(const BranchTable& br, const LossParams& P, int b, int d, float scale,
                                   float* work, float* branch_sum, int lane) {
  const int NA = P.atoms, n = br.size[d];
  const int64_t row0 = q_row_of(br, b, P.total_actions, d);
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  const int64_t a = taken_action(br, P.actions, b, d);
  if (!(a >= 0 && a < n) || !isfinite(r) || !isfinite(discount)) {  // see c51_branch
    if constexpr (reads_head(kRows)) {
      const float none[kSlots] = {};
      write_branch_head_grad<kRows, kSlots>(P, br, b, d, -1, none, branch_sum, lane);
    } else {
      for (int i = lane; i < n * NA; i += 32) P.grad_q[row0 * NA + i] = NAN;
    }
    return make_float2(NAN, NAN);
  }
  const LaneAtoms<kSlots> at(lane, NA);
  float z[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) z[e] = P.v_min + at.j[e] * P.dz;
  // double DQN: the online network's greedy next action (the first of equal maxima; NaN wins),
  // and the target network's logits of that action, loaded beside the online ones. `choose`
  // takes one chunk of `live` actions (warp-uniform): their expected Q reduced together.
  float best = -INFINITY, t[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) t[e] = 0.f;
  bool nan_seen = false;
  auto choose = [&](int live, const float (&x)[kSlots][kQChunk], const float (&y)[kSlots][kQChunk]) {
    float mx[kQChunk], s[kQChunk], sz[kQChunk];
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)
      if (k < live) {
        float m = -INFINITY;
#pragma unroll
        for (int e = 0; e < kSlots; ++e) m = fmaxf(m, x[e][k]);
        mx[k] = warp_max(m);
      }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)
      if (k < live) {
        float es = 0.f, ez = 0.f;
#pragma unroll
        for (int e = 0; e < kSlots; ++e) {
          const float ex = expf(x[e][k] - mx[k]);
          es = es + ex;
          ez = fmaf(ex, z[e], ez);
        }
        s[k] = warp_sum(es);
        sz[k] = warp_sum(ez);
      }
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      if (k >= live) break;
      const float qv = sz[k] / s[k];
      if (!nan_seen && (qv > best || qv != qv)) {
        best = qv;
#pragma unroll
        for (int e = 0; e < kSlots; ++e) t[e] = y[e][k];
        nan_seen = qv != qv;
      }
    }
  };
  // A missing atom reads as -inf: exp(-inf - max) = 0 adds nothing to any sum; nothing is
  // written for it (atoms < 32 leave lanes without one).
  float xc[kSlots];  // the taken action's logits
#pragma unroll
  for (int e = 0; e < kSlots; ++e) xc[e] = -INFINITY;
  if constexpr (kRowsInRegisters) {
    BranchQ<kSlots> q;
    branch_q<kRows, kSlots>(P, br, b, d, at, q);
    float x[kSlots][kQChunk], y[kSlots][kQChunk];
#pragma unroll
    for (int e = 0; e < kSlots; ++e)
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        if (k == a) xc[e] = q.x[e][0][k];  // a select, not an index: a register array stays in registers
        x[e][k] = q.x[e][1][k];
        y[e][k] = q.x[e][2][k];
      }
    choose(n, x, y);
  } else {
    BranchRows<kSlots> rows[3];
    branch_rows<kRows, kSlots>(P, br, b, d, at, rows);
    auto load = [&](const BranchRows<kSlots>& rw, int k, int e) {
      return at.has[e] ? q_at<kRows>(rw.row, rw.bias, int64_t(k) * NA + at.j[e], rw.v[e], rw.mean[e]) : -INFINITY;
    };
#pragma unroll
    for (int e = 0; e < kSlots; ++e) xc[e] = load(rows[0], int(a), e);
    for (int a0 = 0; a0 < n && !nan_seen; a0 += kQChunk) {
      float x[kSlots][kQChunk], y[kSlots][kQChunk];
      const int live = min(kQChunk, n - a0);
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        if (k < live)
#pragma unroll
          for (int e = 0; e < kSlots; ++e) {
            x[e][k] = load(rows[1], a0 + k, e);
            y[e][k] = load(rows[2], a0 + k, e);
          }
      choose(live, x, y);
    }
  }
  if constexpr (kRows == LossRows::kQ)
    for (int k = 0; k < n; ++k)  // the other actions' gradient rows are 0
      if (k != a)
#pragma unroll
        for (int e = 0; e < kSlots; ++e)
          if (at.has[e]) P.grad_q[(row0 + k) * NA + at.j[e]] = 0.f;

  // the target network's distribution at the chosen action, and where each atom's return lands
  float* pt = work;        // target probabilities
  float* pos = work + NA;  // position of r + gamma z_i on the support, in atoms
  float mt = -INFINITY;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) mt = fmaxf(mt, t[e]);
  mt = warp_max(mt);
  float et[kSlots], st = 0.f;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    et[e] = expf(t[e] - mt);
    st = st + et[e];
  }
  st = warp_sum(st);
  auto position = [&](int j) {
    const float tz = fminf(fmaxf(fmaf(discount, P.v_min + j * P.dz, r), P.v_min), P.v_max);
    return fminf(fmaxf((tz - P.v_min) / P.dz, 0.f), float(NA - 1));
  };
  float* lower = work + 2 * NA;  // projected mass by atom, from sources it is the lower atom of
  float* upper = work + 3 * NA;  // from sources whose lower atom is this one, for the atom above
#pragma unroll
  for (int e = 0; e < kSlots; ++e)
    if (at.has[e]) {
      const int j = at.j[e];
      pt[j] = et[e] / st;
      pos[j] = position(j);
      lower[j] = upper[j] = 0.f;
    }
  __syncwarp();
  project_by_runs<kSlots>(pt, pos, lower, upper, NA, lane);
  __syncwarp();
  float m[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int j = at.j[e];
    m[e] = at.has[e] ? lower[j] + (j > 0 ? upper[j - 1] : 0.f) : 0.f;
  }

  // cross-entropy on the taken action and its gradient (softmax - m)
  float mc = -INFINITY;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) mc = fmaxf(mc, xc[e]);
  mc = warp_max(mc);
  float sc = 0.f;
#pragma unroll
  for (int e = 0; e < kSlots; ++e) sc = sc + expf(xc[e] - mc);
  const float lse = mc + logf(warp_sum(sc));
  float ce = 0.f, qc = 0.f, g[kSlots];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    g[e] = 0.f;
    if (at.has[e]) {
      const float logp = xc[e] - lse, p = expf(logp);
      ce = fmaf(-m[e], logp, ce);
      qc = fmaf(p, z[e], qc);
      // Rounded on its own (__fmul_rn is never contracted into an FMA): the fused path subtracts
      // the branch mean from it next, and must round as the public ops do, which store it first.
      g[e] = __fmul_rn(p - m[e], scale);
    }
  }
  if constexpr (reads_head(kRows)) {
    write_branch_head_grad<kRows, kSlots>(P, br, b, d, int(a), g, branch_sum, lane);
  } else {
    float* gq = P.grad_q + (row0 + a) * NA;
#pragma unroll
    for (int e = 0; e < kSlots; ++e)
      if (at.has[e]) gq[at.j[e]] = g[e];
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

// kSlots: C51's register version (c51_branch_small) with atoms <= 32 * kSlots (2 or 4); 0: the
// general version or QR / MSE. kRows: what the rows are (LossRows); the fused loss on head
// logits is C51's register version or QR's, a warp per (member, branch) entry as dqn_loss's (the
// value columns' gradients, kHeadDueling, sum each member's entries' rows of the round buffers
// after the round's barrier).
// kTwoSlotMinBlocks: the <= 64-atom versions are latency-bound, so 3 blocks (24 warps) per
// SM: at most 85 registers. Unbounded, the fused version takes more registers than that and
// fits only 2 blocks per SM, which was slower; with 4 blocks per SM (64 registers) it spills,
// which was slower still. kFourSlotMinBlocks: the <= 128-atom versions hold twice the values a
// lane, so 2 blocks per SM (128 registers); their dueling instantiations still spill a little
// (ptxas -v on sm_90), the others nothing.
// kRowsInRegisters: every branch has at most kQChunk actions (C51: BranchQ; the fused QR loss:
// qr_branch's kFewActions).
// kQuantiles: QR (qr_branch), a warp per branch as C51's, on dqn_loss's rows or (the fused loss)
// the head logits. Its inner loops (the direct pairs' FMAs, the sorted version's dependent shared
// loads) are latency-bound, and more warps hide more: 4 blocks (32 warps) per SM, at most 64
// registers, which dqn_loss's rows fit without spilling (its sorted version's shared memory, 34
// KiB a block at 200 quantiles, still lets 4 blocks reside). On the head logits (the column
// reads, the head-gradient writes) 64 registers spilled a few hundred bytes a thread with
// dueling, so kFusedQuantileMinBlocks 3 (at most 85 registers: no spill, with dueling or without,
// the sort running in registers and QR's columns read in batches; ptxas -v on sm_90).
// kFractions: IQN, kQuantiles' code (qr_branch<kQ, true, false>) with the fractions read per
// sample and the three inputs' own slot counts; its own instantiation, so that QR's, with
// N = K = N' and the midpoints known when it compiles, keeps its registers.
constexpr int kTwoSlotMinBlocks = 3;
constexpr int kFourSlotMinBlocks = 2;
constexpr int kQuantileMinBlocks = 4;
constexpr int kFusedQuantileMinBlocks = 3;

template <int kSlots, LossRows kRows, bool kRowsInRegisters, bool kQuantiles = false, bool kFractions = false>
__global__ void __launch_bounds__(kMaxWarps * 32, kSlots == 2 ? kTwoSlotMinBlocks
                                                  : kSlots    ? kFourSlotMinBlocks
                                                  : kQuantiles ? (reads_head(kRows) ? kFusedQuantileMinBlocks
                                                                                    : kQuantileMinBlocks)
                                                               : 1)
    dqn_loss_kernel(const __grid_constant__ BranchTable br, const LossParams P) {
  pdl_enter();
  constexpr bool kRegisterVersion = kSlots > 0;
  constexpr bool kDueling = kRows == LossRows::kHeadDueling;
  static_assert(kSlots == 0 || kSlots == 2 || kSlots == 4, "a lane owns 2 or 4 atoms");
  static_assert(32 * 4 >= kDuelingMaxAtoms, "the register versions cover every atom count the fused loss takes");
  static_assert(!reads_head(kRows) || kRegisterVersion || kQuantiles,
                "the fused loss runs C51's register version or QR's");
  static_assert(!kRowsInRegisters || kRegisterVersion || (kQuantiles && reads_head(kRows)),
                "rows in registers: the register version, or the fused QR loss's column batches");
  static_assert(!kQuantiles || !kRegisterVersion, "QR: its own version");
  static_assert(!kFractions || (kQuantiles && kRows == LossRows::kQ), "IQN runs QR's version on dqn_loss's rows");
  // C51 and QR: P.work_floats per warp. 16-byte aligned, as QR reads its stage as float4s
  // (nvcc already aligns an extern shared array to 16 bytes: this states the requirement).
  // The fused loss: then its round buffers (entry_row below).
  extern __shared__ __align__(16) float smem[];
  // Each warp's sums of a round, read by its sample's first warp after the round's barrier. Two
  // buffers, by round parity, so one barrier a round suffices: a round writes the buffer the
  // previous round did not read, and the round before that finished its reads before the last
  // barrier.
  __shared__ float part_a[2][kMaxWarps], part_b[2][kMaxWarps], part_c[2][kMaxWarps], part_d[2][kMaxWarps];
  __shared__ float slot_loss[kMaxWarps], slot_q[kMaxWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = P.warps_per_sample, S = P.samples_per_block;
  const int slot = warp / W, wi = warp % W;  // this warp's sample in the block, and its share
  // C51 and QR: a warp per (sample, branch), the branch sums averaged per sample.
  const bool per_branch = kQuantiles || P.type == LossType::kC51;
  float* work = smem + warp * P.work_floats;
  // The fused loss's round buffers, after the warps' work areas: a row of P.sum_floats floats
  // per (sample slot, table entry), by round parity as part_a..: the entry's sums of dq per atom
  // for its member's value column (kHeadDueling), and QR's theta and its gradient before them
  // (qr_branch's buf). A sample's rows in entry order, so a member's branches are adjacent.
  const int rows_first = (blockDim.x / 32) * P.work_floats;  // in floats of smem
  auto entry_row = [&](int parity, int d) {
    return smem + rows_first + ((parity * S + slot) * br.count + d) * P.sum_floats;
  };
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
    // and each entry's mask scales its gradient.
    float x = 0.f, y = 0.f, z = 0.f;
    const bool masked = P.masks != nullptr;
    if (lane == 0) part_d[buf][warp] = 0.f;
    if (live) {
      if constexpr (kQuantiles) {
        for (int d = wi; d < br.count; d += W) {
          const float m = masked ? member_mask(br, P, b, d) : 1.f;
          const float3 r = qr_branch<kRows, kFractions, kRowsInRegisters>(br, P, b, d, masked ? scale * m : scale, work,
                                                        reads_head(kRows) ? entry_row(buf, d) : nullptr, lane);
          if (masked && lane == 0) part_d[buf][warp] += m * r.x;
          x += r.x;
          y += r.y;
          z += r.z;
        }
      } else if (per_branch) {
        for (int d = wi; d < br.count; d += W) {
          const float m = masked ? member_mask(br, P, b, d) : 1.f;
          float2 r;
          if constexpr (kRegisterVersion)
            r = c51_branch_small<kRows, kRowsInRegisters, kSlots>(
                br, P, b, d, masked ? scale * m : scale, work,
                kDueling ? entry_row(buf, d) : nullptr, lane);
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
    // QR: a branch that poisons its sample poisons every branch's rows (every member's)
    bool poisoned = false;
    if constexpr (kQuantiles)
      for (int k = 0; k < W; ++k) poisoned = poisoned || part_c[buf][slot * W + k] > 0.f;
    if constexpr (kDueling)  // member m's value column by the sample's warp m % W
      if (live)
        for (int m = wi; m < P.value_heads; m += W)
          write_value_grad(P, br, b, m, entry_row(buf, m * br.per_member), P.sum_floats, poisoned, lane);
    if constexpr (kQuantiles)
      if (live && poisoned)
        for (int d = wi; d < br.count; d += W) qr_poison_rows<kRows>(br, P, b, d, nullptr, lane);
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
    // Every block has taken its ticket: the counter is 0 again for the next launch (a caller's
    // counter needs no memset before it; loss.cu's launch_loss).
    if (last_block) *P.counter = 0u;
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

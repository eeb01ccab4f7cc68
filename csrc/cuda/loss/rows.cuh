// Row access of the loss kernels (loss.cu's parts: see loss.cu): the three passes' rows of a
// branch as the loss reads them (dqn_loss: q; the fused loss: raw head logits, biased and,
// with dueling, aggregated as they are read), the fused loss's gradient writes w.r.t. the head
// logits, and the general C51 version's staging of its rows in shared memory.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "../branch_table.cuh"
#include "../dueling.cuh"
#include "layout.h"
#include "params.cuh"

namespace dqn_ops {
namespace cuda {
namespace {  // see loss/params.cuh

// One network pass's rows of branch d of sample b, as the loss reads them. dqn_loss (kQ): q,
// action k's atom j at row[k * atoms + j]. The fused loss: the branch head's raw logits at the
// same place, biased as they are read and (kHeadDueling) aggregated, with dueling.cuh's
// arithmetic (head_bias_dueling_kernel's), so that q is the same bits. kHeadDueling: v (the
// value logit + its bias) and mean are per lane, at its atoms j_e = lane + 32 e (e < kSlots).
template <int kSlots>
struct BranchRows {
  const float* row;
  const float* bias;  // the fused loss only
  float v[kSlots], mean[kSlots];
};

// A lane's atoms of the register version (c51_branch_small): j_e = lane + 32 e, those < atoms.
template <int kSlots>
struct LaneAtoms {
  int j[kSlots];
  bool has[kSlots];  // has[e] implies has[e - 1]
  __device__ LaneAtoms(int lane, int atoms) {
#pragma unroll
    for (int e = 0; e < kSlots; ++e) {
      j[e] = lane + 32 * e;
      has[e] = j[e] < atoms;
    }
  }
};

// The rows of branch d of sample b in the three passes: the online network on s (rows[0])
// and on s' (rows[1]), the target network on s' (rows[2]). kHeadDueling: every pass's loads of
// a chunk of kQChunk actions are issued together (one memory latency per chunk for all three
// passes, not one per load: the loss is latency-bound), then added in action order.
template <LossRows kRows, int kSlots>
__device__ void branch_rows(const LossParams& P, const BranchTable& br, int b, int d, const LaneAtoms<kSlots>& at,
                            BranchRows<kSlots> (&rows)[3]) {
  const float* base[3] = {P.q, P.q_next_online, P.q_next_target};
  const int NA = P.atoms;
  if constexpr (kRows == LossRows::kQ) {
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      rows[p].row = base[p] + q_row_of(br, b, P.total_actions, d) * NA;
      rows[p].bias = nullptr;
#pragma unroll
      for (int e = 0; e < kSlots; ++e) rows[p].v[e] = rows[p].mean[e] = 0.f;
    }
  } else if constexpr (kRows == LossRows::kHeadPlain) {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      rows[p].row = base[p] + int64_t(b) * P.head_ld + br.pad_col[d];
      rows[p].bias = b_out[p] + head_col_of(br, d, value_heads(kRows), NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) rows[p].v[e] = rows[p].mean[e] = 0.f;
    }
  } else {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
    const int n = br.size[d];
    float s[3][kSlots];
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* in = base[p] + int64_t(b) * P.head_ld;  // the value head's logits at column 0
      rows[p].row = in + br.pad_col[d];
      rows[p].bias = b_out[p] + head_col_of(br, d, value_heads(kRows), NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        rows[p].v[e] = at.has[e] ? biased_logit(in[at.j[e]], b_out[p][at.j[e]]) : 0.f;
        s[p][e] = 0.f;
      }
    }
    for (int k0 = 0; k0 < n; k0 += kQChunk) {
      float x[3][kQChunk][kSlots];
#pragma unroll
      for (int p = 0; p < 3; ++p)
#pragma unroll
        for (int k = 0; k < kQChunk; ++k) {
          const int64_t i = int64_t(k0 + k) * NA;
          const bool live = k0 + k < n;
#pragma unroll
          for (int e = 0; e < kSlots; ++e)
            x[p][k][e] = live && at.has[e] ? biased_logit(rows[p].row[i + at.j[e]], rows[p].bias[i + at.j[e]]) : 0.f;
        }
#pragma unroll
      for (int p = 0; p < 3; ++p)
#pragma unroll
        for (int k = 0; k < kQChunk; ++k)
          if (k0 + k < n)
#pragma unroll
            for (int e = 0; e < kSlots; ++e) s[p][e] += x[p][k][e];
    }
#pragma unroll
    for (int p = 0; p < 3; ++p)
#pragma unroll
      for (int e = 0; e < kSlots; ++e) rows[p].mean[e] = branch_mean(s[p][e], n);
  }
}

// q of action k at atom j (i = k * atoms + j), v and mean at that atom (kHeadDueling).
template <LossRows kRows, int kSlots>
__device__ __forceinline__ float q_at(const BranchRows<kSlots>& r, int64_t i, float v, float mean) {
  if constexpr (kRows == LossRows::kHeadDueling) return dueling_q(v, biased_logit(r.row[i], r.bias[i]), mean);
  else if constexpr (kRows == LossRows::kHeadPlain) return biased_logit(r.row[i], r.bias[i]);
  else return r.row[i];
}

// Every branch with at most kQChunk actions (kRowsInRegisters, chosen at launch): a lane's
// values of branch d's rows in the three passes, read once and kept in registers: x[e][p][k]
// at atom j_e, -inf at a missing atom, unused for k >= n. BranchRows re-reads a row after the
// dueling mean, and those reads are a tenth of the fused loss's instructions; registers spare
// them. Same arithmetic as BranchRows and q_at.
template <int kSlots>
struct BranchQ {
  float x[kSlots][3][kQChunk];
};

template <LossRows kRows, int kSlots>
__device__ void branch_q(const LossParams& P, const BranchTable& br, int b, int d, const LaneAtoms<kSlots>& at,
                         BranchQ<kSlots>& q) {
  const float* base[3] = {P.q, P.q_next_online, P.q_next_target};
  const int NA = P.atoms, n = br.size[d];
  if constexpr (kRows == LossRows::kQ) {
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* row = base[p] + q_row_of(br, b, P.total_actions, d) * NA;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        const bool live = k < n;
#pragma unroll
        for (int e = 0; e < kSlots; ++e) q.x[e][p][k] = live && at.has[e] ? row[k * NA + at.j[e]] : -INFINITY;
      }
    }
  } else if constexpr (kRows == LossRows::kHeadPlain) {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* row = base[p] + int64_t(b) * P.head_ld + br.pad_col[d];
      const float* bias = b_out[p] + head_col_of(br, d, value_heads(kRows), NA);
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        const bool live = k < n;
#pragma unroll
        for (int e = 0; e < kSlots; ++e) {
          const int j = at.j[e];
          q.x[e][p][k] = live && at.has[e] ? biased_logit(row[k * NA + j], bias[k * NA + j]) : -INFINITY;
        }
      }
    }
  } else {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
    float v[kSlots][3];
#pragma unroll
    for (int p = 0; p < 3; ++p) {  // every load of the three passes issued before the first add
      const float* in = base[p] + int64_t(b) * P.head_ld;  // the value head's logits at column 0
      const float* row = in + br.pad_col[d];
      const float* bias = b_out[p] + head_col_of(br, d, value_heads(kRows), NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        const int j = at.j[e];
        v[e][p] = at.has[e] ? biased_logit(in[j], b_out[p][j]) : 0.f;
#pragma unroll
        for (int k = 0; k < kQChunk; ++k)
          q.x[e][p][k] = k < n && at.has[e] ? biased_logit(row[k * NA + j], bias[k * NA + j]) : 0.f;
      }
    }
#pragma unroll
    for (int p = 0; p < 3; ++p)
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < kQChunk; ++k)
          if (k < n) s += q.x[e][p][k];
        const float mean = branch_mean(s, n);
#pragma unroll
        for (int k = 0; k < kQChunk; ++k) q.x[e][p][k] = at.has[e] ? dueling_q(v[e][p], q.x[e][p][k], mean) : -INFINITY;
      }
  }
}

// The fused loss's gradient of branch d of sample b w.r.t. the head logits, from dq = g[e] at
// the taken action a (atom j_e) and 0 at the others (a < 0: a poisoned sample, every dq NaN),
// no direct gradient. kHeadDueling: dueling.cuh's backward (dueling_backward_kernel's) on dq,
// leaving the sum per atom in branch_sum, which the value column adds up over the branches
// (write_value_grad); kHeadPlain: dq itself, as (dq - 0) + 0 (q is the biased branch logits;
// branch_sum unused).
// Writes the branch head's columns (F32 compact; BF16 padded, its padding columns 0).
template <LossRows kRows, int kSlots>
__device__ void write_branch_head_grad(const LossParams& P, const BranchTable& br, int b, int d, int a,
                                       const float (&g)[kSlots], float* branch_sum, int lane) {
  static_assert(reads_head(kRows), "the head-logit gradient is the fused loss's");
  const int NA = P.atoms, n = br.size[d];
  float* dh = P.grad_head + int64_t(b) * P.head_out + head_col_of(br, d, value_heads(kRows), NA);
  __nv_bfloat16* low = P.grad_head_bf16 + int64_t(b) * P.head_ld + br.pad_col[d];
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int j = lane + 32 * e;
    if (j >= NA) break;
    const float taken = a < 0 ? NAN : g[e];  // dq at the taken action
    const float other = a < 0 ? NAN : 0.f;   // and at the others
    if constexpr (kRows == LossRows::kHeadDueling) {
      // The sum over the actions in order adds zeros to dq at the taken action, exactly: 0 + taken
      // (not `taken`: that differs for -0), without a loop over the actions.
      const float sum = 0.f + taken;
      const float mean = branch_mean(sum, n);
      for (int k = 0; k < n; ++k) {
        const float x = dueling_advantage_grad(k == a ? taken : other, mean, 0.f);
        dh[k * NA + j] = x;
        low[k * NA + j] = __float2bfloat16_rn(x);
      }
      branch_sum[j] = sum;
    } else {
      // dueling_backward_kernel's expression without dueling (no mean, no direct gradient):
      // (dq - 0) + 0, which turns a -0 into +0 as the composed path and the CPU reference do.
      for (int k = 0; k < n; ++k) {
        const float x = dueling_advantage_grad(k == a ? taken : other, 0.f, 0.f);
        dh[k * NA + j] = x;
        low[k * NA + j] = __float2bfloat16_rn(x);
      }
    }
  }
  const int width = n * NA;
  for (int i = width + lane; i < round_up_to_align(width); i += 32) low[i] = __float2bfloat16_rn(0.f);
}

// The value column of sample b's head-logit gradient (kHeadDueling: the value head is the first
// output head, compact and padded column 0): the branches' sums in branch order (dueling.cuh's
// dv, no direct gradient), then its BF16 copy and padding. branch_sums: one row of `stride`
// floats per branch.
__device__ void write_value_grad(const LossParams& P, int b, const float* branch_sums, int branches, int stride,
                                 int lane) {
  const int NA = P.atoms;
  float* dh = P.grad_head + int64_t(b) * P.head_out;
  __nv_bfloat16* low = P.grad_head_bf16 + int64_t(b) * P.head_ld;
  for (int j = lane; j < NA; j += 32) {
    float dv = 0.f;
    for (int d = 0; d < branches; ++d) dv += branch_sums[d * stride + j];
    dh[j] = dv;
    low[j] = __float2bfloat16_rn(dv);
  }
  for (int64_t j = NA + lane; j < round_up_to_align(NA); j += 32) low[j] = __float2bfloat16_rn(0.f);
}

// Floats of shared memory per warp, C51's general version: [staged online rows | staged target
// rows | staged taken row] when staged, then the target probabilities, positions and projected
// distribution. (The register version: 4 * atoms.)
__host__ __device__ inline int64_t c51_floats_per_warp(int64_t atoms, int64_t max_actions, bool staged) {
  return (staged ? (2 * max_actions + 1) * atoms : 0) + 3 * atoms;
}

// Copies the three row groups into dst back to back, every load of a pass issued before the
// first store (one memory latency per kStageUnroll * 32 floats instead of one per 32).
__device__ void stage_rows(float* dst, const float* __restrict__ on, const float* __restrict__ tg,
                           const float* __restrict__ xc, int n_na, int na, int lane) {
  const int total = 2 * n_na + na;
  for (int base = 0; base < total; base += kStageUnroll * 32) {
    float v[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int i = base + u * 32 + lane;
      v[u] = i < n_na ? on[i] : i < 2 * n_na ? tg[i - n_na] : i < total ? xc[i - 2 * n_na] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int i = base + u * 32 + lane;
      if (i < total) dst[i] = v[u];
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

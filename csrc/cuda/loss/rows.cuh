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

// Member m's value head (kHeadDueling): its first column in a padded logits row (at
// m * round_up_to_align(atoms)) and in the output bias and the compact head (at m * atoms), as
// head_bias_dueling_kernel and dueling_backward_kernel place it.
__device__ __forceinline__ int64_t value_pad_col(int m, int atoms) { return m * round_up_to_align(atoms); }
__device__ __forceinline__ int64_t value_col(int m, int atoms) { return m * int64_t(atoms); }

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
      rows[p].bias = b_out[p] + head_col_of(br, d, P.value_heads, NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) rows[p].v[e] = rows[p].mean[e] = 0.f;
    }
  } else {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
    const int n = br.size[d];
    float s[3][kSlots];
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* in = base[p] + int64_t(b) * P.head_ld;
      const float* value = in + value_pad_col(member_of(br, d), NA);
      const float* value_bias = b_out[p] + value_col(member_of(br, d), NA);
      rows[p].row = in + br.pad_col[d];
      rows[p].bias = b_out[p] + head_col_of(br, d, P.value_heads, NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        rows[p].v[e] = at.has[e] ? biased_logit(value[at.j[e]], value_bias[at.j[e]]) : 0.f;
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

// Element i of a branch's rows as a pass reads it: q itself (kQ), else the head logit with its
// output bias (the fused loss: bias laid out as row).
template <LossRows kRows>
__device__ __forceinline__ float row_value(const float* row, const float* bias, int64_t i) {
  if constexpr (kRows == LossRows::kQ) return row[i];
  else return biased_logit(row[i], bias[i]);
}

// q of action k at atom j (i = k * atoms + j) of a branch's rows (row; the fused loss: bias),
// v and mean at that atom (kHeadDueling).
template <LossRows kRows>
__device__ __forceinline__ float q_at(const float* row, const float* bias, int64_t i, float v, float mean) {
  const float x = row_value<kRows>(row, bias, i);
  if constexpr (kRows == LossRows::kHeadDueling) return dueling_q(v, x, mean);
  else return x;
}

// The QR loss (qr_branch): one network pass's rows of branch d of sample b, read a column (one
// quantile i of every action) at a time: action k's quantile i at row[k * slots + i]. dqn_loss
// (kQ): q itself; the fused loss: the raw head logits, biased and (kHeadDueling) aggregated as
// they are read, with the value logit and the branch mean of column i formed as
// head_bias_dueling_kernel forms them (the advantages summed in action order from 0.f), so q is
// the composed path's bits.
template <LossRows kRows>
struct QuantileRows {
  struct Column {
    float v, mean;  // kHeadDueling
  };
  const float* row;
  const float* bias;   // the fused loss: the branch's output bias, laid out as row
  const float* value;  // kHeadDueling: the value head's logits and bias (column i at i)
  const float* value_bias;
  int n, slots;

  __device__ Column column(int i) const {
    Column c{0.f, 0.f};
    if constexpr (kRows == LossRows::kHeadDueling) {
      c.v = biased_logit(value[i], value_bias[i]);
      float s = 0.f;
      for (int k0 = 0; k0 < n; k0 += kQChunk) {  // a chunk's loads issued together
        float x[kQChunk];
#pragma unroll
        for (int k = 0; k < kQChunk; ++k) {
          const int64_t at = int64_t(k0 + k) * slots + i;
          x[k] = k0 + k < n ? row_value<kRows>(row, bias, at) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < kQChunk; ++k)
          if (k0 + k < n) s += x[k];
      }
      c.mean = branch_mean(s, n);
    }
    return c;
  }
  __device__ __forceinline__ float q(int k, int i, const Column& c) const {
    return q_at<kRows>(row, bias, int64_t(k) * slots + i, c.v, c.mean);
  }

  // Branches of at most kQChunk actions (qr_branch's kFewActions): every action's q at a column,
  // the bits q(k, i, column(i)) gives; `at` selects one (a select, not an index: the array stays
  // in registers).
  struct FullColumn {
    float q[kQChunk];  // action k < n's
    __device__ __forceinline__ float at(int k) const {
      float x = 0.f;
#pragma unroll
      for (int e = 0; e < kQChunk; ++e)
        if (e == k) x = q[e];
      return x;
    }
  };
  // Columns i0, i0 + 32, ..., kBatch of them, those below `count` (the others 0), with every load
  // of the batch issued before any is used: a batch costs one memory latency, where column() and
  // q() a column at a time cost one a column (the fused QR loss is latency-bound). `only` >= 0:
  // the caller reads that action's q alone, so rows without a dueling mean load only its logits
  // (the other q are then 0).
  template <int kBatch>
  __device__ __forceinline__ void full_columns(int i0, int count, FullColumn (&c)[kBatch], int only = -1) const {
    float v[kBatch], x[kBatch][kQChunk];
#pragma unroll
    for (int g = 0; g < kBatch; ++g) {
      const int i = i0 + 32 * g;
      const bool live = i < count;
      v[g] = kRows == LossRows::kHeadDueling && live ? biased_logit(value[i], value_bias[i]) : 0.f;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        const int64_t at = int64_t(k) * slots + i;
        const bool used = k < n && (kRows == LossRows::kHeadDueling || only < 0 || k == only);
        x[g][k] = live && used ? row_value<kRows>(row, bias, at) : 0.f;
      }
    }
#pragma unroll
    for (int g = 0; g < kBatch; ++g) {
      float s = 0.f;  // column()'s sum: in action order from 0.f
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        if (k < n) s += x[g][k];
      const float mean = branch_mean(s, n);
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        c[g].q[k] = kRows == LossRows::kHeadDueling ? dueling_q(v[g], x[g][k], mean) : x[g][k];
    }
  }
};

// Pass p's (0: the online network on s, 1: on s', 2: the target network on s') QuantileRows of
// branch d of sample b (row0: its first q row, q_row_of), `slots` quantiles an action.
template <LossRows kRows>
__device__ QuantileRows<kRows> quantile_rows(const LossParams& P, const BranchTable& br, int p, int b, int d,
                                             int64_t row0, int slots) {
  const float* base = p == 0 ? P.q : p == 1 ? P.q_next_online : P.q_next_target;
  QuantileRows<kRows> r{};
  r.n = br.size[d];
  r.slots = slots;
  if constexpr (kRows == LossRows::kQ) {
    r.row = base + row0 * slots;
  } else {
    const float* b_out = p == 2 ? P.b_target : P.b_online;
    const float* in = base + int64_t(b) * P.head_ld;
    r.value = in + value_pad_col(member_of(br, d), slots);
    r.value_bias = b_out + value_col(member_of(br, d), slots);
    r.row = in + br.pad_col[d];
    r.bias = b_out + head_col_of(br, d, P.value_heads, slots);
  }
  return r;
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
      const float* bias = b_out[p] + head_col_of(br, d, P.value_heads, NA);
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
    // the member's value head: 32-bit column offsets (64-bit pointers per pass cost registers)
    const int m = member_of(br, d), value_pad = int(value_pad_col(m, NA)), value_at = int(value_col(m, NA));
#pragma unroll
    for (int p = 0; p < 3; ++p) {  // every load of the three passes issued before the first add
      const float* in = base[p] + int64_t(b) * P.head_ld;
      const float* row = in + br.pad_col[d];
      const float* bias = b_out[p] + head_col_of(br, d, P.value_heads, NA);
#pragma unroll
      for (int e = 0; e < kSlots; ++e) {
        const int j = at.j[e];
        v[e][p] = at.has[e] ? biased_logit(in[value_pad + j], b_out[p][value_at + j]) : 0.f;
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

// Column j (one atom or quantile, every action) of the fused loss's gradient of branch d w.r.t.
// the head logits, from dq = g at the taken action a and 0 at the others (a < 0: a poisoned
// sample, every dq NaN), no direct gradient. kHeadDueling: dueling.cuh's backward
// (dueling_backward_kernel's) on dq; returns the sum over the actions at j, which the value
// column adds up over the branches (write_value_grad). kHeadPlain: dq itself, as (dq - 0) + 0
// (q is the biased branch logits); returns 0. dh, low: the branch's first column in the F32
// compact and the BF16 padded gradient rows.
template <LossRows kRows>
__device__ __forceinline__ float write_head_grad_column(float* dh, __nv_bfloat16* low, int n, int NA, int a, int j,
                                                        float g) {
  static_assert(reads_head(kRows), "the head-logit gradient is the fused loss's");
  const float taken = a < 0 ? NAN : g;   // dq at the taken action
  const float other = a < 0 ? NAN : 0.f;  // and at the others
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
    return sum;
  } else {
    // dueling_backward_kernel's expression without dueling (no mean, no direct gradient):
    // (dq - 0) + 0, which turns a -0 into +0 as the composed path and the CPU reference do.
    for (int k = 0; k < n; ++k) {
      const float x = dueling_advantage_grad(k == a ? taken : other, 0.f, 0.f);
      dh[k * NA + j] = x;
      low[k * NA + j] = __float2bfloat16_rn(x);
    }
    return 0.f;
  }
}

// Entry d's head-logit gradient rows of sample b: the F32 compact and BF16 padded rows' first
// columns (write_head_grad_column's dh and low).
__device__ __forceinline__ float* head_grad_row(const LossParams& P, const BranchTable& br, int b, int d) {
  return P.grad_head + int64_t(b) * P.head_out + head_col_of(br, d, P.value_heads, P.atoms);
}
__device__ __forceinline__ __nv_bfloat16* head_grad_row_bf16(const LossParams& P, const BranchTable& br, int b, int d) {
  return P.grad_head_bf16 + int64_t(b) * P.head_ld + br.pad_col[d];
}

// C51's gradient of branch d of sample b w.r.t. the head logits (write_head_grad_column at the
// lane's atoms j_e = lane + 32 e, dq = g[e] at the taken action a; kHeadDueling: the sums to
// branch_sum[j]), then the BF16 row's padding columns 0.
template <LossRows kRows, int kSlots>
__device__ void write_branch_head_grad(const LossParams& P, const BranchTable& br, int b, int d, int a,
                                       const float (&g)[kSlots], float* branch_sum, int lane) {
  const int NA = P.atoms, n = br.size[d];
  float* dh = head_grad_row(P, br, b, d);
  __nv_bfloat16* low = head_grad_row_bf16(P, br, b, d);
#pragma unroll
  for (int e = 0; e < kSlots; ++e) {
    const int j = lane + 32 * e;
    if (j >= NA) break;
    const float sum = write_head_grad_column<kRows>(dh, low, n, NA, a, j, g[e]);
    if constexpr (kRows == LossRows::kHeadDueling) branch_sum[j] = sum;
  }
  zero_head_padding(low, n * NA, lane, 32);
}

// Member m's value column of sample b's head-logit gradient (kHeadDueling: value head m is the
// m-th output head, compact column m * atoms, padded m * round_up_to_align(atoms)): its
// branches' sums in branch order (dueling.cuh's dv, no direct gradient; NaN when `poisoned`,
// as a QR sample's every row is), then its BF16 copy and padding. branch_sums: the member's
// branches' rows, `stride` floats apart.
__device__ void write_value_grad(const LossParams& P, const BranchTable& br, int b, int m, const float* branch_sums,
                                 int stride, bool poisoned, int lane) {
  const int NA = P.atoms;
  float* dh = P.grad_head + int64_t(b) * P.head_out + value_col(m, NA);
  __nv_bfloat16* low = P.grad_head_bf16 + int64_t(b) * P.head_ld + value_pad_col(m, NA);
  for (int j = lane; j < NA; j += 32) {
    float dv = 0.f;
    for (int d = 0; d < br.per_member; ++d) dv += branch_sums[d * stride + j];
    if (poisoned) dv = NAN;
    dh[j] = dv;
    low[j] = __float2bfloat16_rn(dv);
  }
  zero_head_padding(low, NA, lane, 32);
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

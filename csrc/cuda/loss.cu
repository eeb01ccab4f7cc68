// dqn_loss on CUDA: one launch (and a 4-byte memset).
//
// C51: a warp per (sample, branch): the double-DQN choice (the expected Q of up to 4 actions
// reduced together), the projection of the target distribution onto the support, the
// cross-entropy and its gradient. Two versions of the branch, chosen at launch (two kernel
// instantiations, so each gets its own register allocation):
//   atoms <= 64 (C51's 51; v4): a lane owns atoms `lane` and `lane + 32`; every row is read
//     straight into registers, the target rows together with the online rows they are chosen
//     by (no dependent load after the argmax); the projection is a segmented scan over the
//     warp (project_by_runs), the same steps for every transition. (v3 ran the general
//     version here: 57.6 µs at B = 4096 and 14.1 at 256 on the H200, v4 34.3 and 7.7;
//     bench/NOTES.md.)
//   general: the warp stages its rows in shared memory (all loads in flight at once), loops
//     over the atoms 32 at a time, and each atom gathers from the sources that can reach it,
//     found by binary search (projected_mass).
// MSE / Huber (one atom): a warp per sample, lanes over the branches.
//
// A block holds whole samples (`warps_per_sample` warps each), so the branch means and the
// per-sample TD error are summed in shared memory in branch order; each block sums its samples
// in order, and the last block to finish sums the blocks' partials in block order: the loss is
// deterministic, with no grid barrier and no second kernel. (v2 used a cooperative launch and a
// grid barrier.) (v1, a warp per sample running the branches
// one after the other and an all-pairs projection: 34 µs at B = 256 on the H200; bench/NOTES.md.)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "branch_table.cuh"
#include "layout.h"
#include "loss_args.h"
#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kMaxWarps = 8;  // per block
constexpr int64_t kMaxAtoms = 256;
constexpr int kQChunk = 4;        // actions whose expected Q reduce together
constexpr int kStageUnroll = 12;  // loads in flight per lane while staging
// Shared memory per block without an opt-in; past it the rows are read from global memory.
constexpr size_t kSmemBudget = 48 * 1024;

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
  float* partials;    // [2, gridDim.x]
  unsigned* counter;  // blocks finished: 0 at launch
  int batch, total_actions, atoms;
  int warps_per_sample, samples_per_block;
  int max_actions;  // the largest branch: sizes the staging area
  bool staged;      // general version: the rows are copied to shared memory first
  int work_floats;  // C51: shared memory per warp
  float v_min, v_max, dz, gamma;
  LossType type;
  // _dqn_loss_on_logits (kDueling): q, q_next_online and q_next_target are the output layer's
  // raw GEMM rows [batch, head_ld] (padded layout, no bias); the biases are b_online / b_target
  // (each network's b_out); the gradient goes to grad_head (F32 [batch, head_out]) and
  // grad_head_bf16 (padded [batch, head_ld]) instead of grad_q.
  const float* b_online;
  const float* b_target;
  float* grad_head;
  __nv_bfloat16* grad_head_bf16;
  int64_t head_ld, head_out;
};

constexpr int kDuelingMaxAtoms = 64;  // the fused path runs the <= 64-atom version only

// One network pass's rows of branch d of sample b, as the loss reads them. dqn_loss: the
// dueling-aggregated rows, action k's atom j at row[k * atoms + j]. The fused loss
// (kDueling): the raw advantage logits at the same place, aggregated as they are read, with
// head_bias_dueling_kernel's arithmetic (dueling_forward.cu) so that q is the same bits:
// q = (v + (a_k + bias_k)) - mean, v = the value logit + its bias, mean = (sum over k in
// order of a_k + bias_k) / n. v and mean are per lane, at its atoms j0 and j1.
struct BranchRows {
  const float* row;
  const float* bias;  // kDueling only
  float v0, v1, mean0, mean1;
};

// The rows of branch d of sample b in the three passes: the online network on s (rows[0])
// and on s' (rows[1]), the target network on s' (rows[2]). kDueling: every pass's loads of a
// chunk of kQChunk actions are issued together (one memory latency per chunk for all three
// passes; one at a time, v6's first version measured the loss 34 -> 98 µs at B = 4096), then
// added in action order.
template <bool kDueling>
__device__ void branch_rows(const LossParams& P, const BranchTable& br, int b, int d, int j0, int j1, bool has0,
                            bool has1, BranchRows (&rows)[3]) {
  const float* base[3] = {P.q, P.q_next_online, P.q_next_target};
  const int NA = P.atoms;
  if constexpr (!kDueling) {
#pragma unroll
    for (int p = 0; p < 3; ++p)
      rows[p] = BranchRows{base[p] + (int64_t(b) * P.total_actions + br.action_offset[d]) * NA, nullptr, 0.f, 0.f,
                           0.f, 0.f};
  } else {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
    const int n = br.size[d];
    float s0[3] = {0.f, 0.f, 0.f}, s1[3] = {0.f, 0.f, 0.f};
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* in = base[p] + int64_t(b) * P.head_ld;
      rows[p].row = in + br.pad_col[d];
      rows[p].bias = b_out[p] + int64_t(NA) * (1 + br.action_offset[d]);
      rows[p].v0 = has0 ? in[j0] + b_out[p][j0] : 0.f;
      rows[p].v1 = has1 ? in[j1] + b_out[p][j1] : 0.f;
    }
    for (int k0 = 0; k0 < n; k0 += kQChunk) {
      float x0[3][kQChunk], x1[3][kQChunk];
#pragma unroll
      for (int p = 0; p < 3; ++p)
#pragma unroll
        for (int k = 0; k < kQChunk; ++k) {
          const int64_t i = int64_t(k0 + k) * NA;
          const bool live = k0 + k < n;
          x0[p][k] = live && has0 ? rows[p].row[i + j0] + rows[p].bias[i + j0] : 0.f;
          x1[p][k] = live && has1 ? rows[p].row[i + j1] + rows[p].bias[i + j1] : 0.f;
        }
#pragma unroll
      for (int p = 0; p < 3; ++p)
#pragma unroll
        for (int k = 0; k < kQChunk; ++k)
          if (k0 + k < n) {
            s0[p] += x0[p][k];
            s1[p] += x1[p][k];
          }
    }
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      rows[p].mean0 = s0[p] / n;
      rows[p].mean1 = s1[p] / n;
    }
  }
}

// q of action k at atom j (i = k * atoms + j), v and mean at that atom.
template <bool kDueling>
__device__ __forceinline__ float q_at(const BranchRows& r, int64_t i, float v, float mean) {
  if constexpr (kDueling) return (v + (r.row[i] + r.bias[i])) - mean;
  else return r.row[i];
}

// Every branch with at most kQChunk actions (kRowsInRegisters, chosen at launch): a lane's
// values of branch d's rows in the three passes, read once and kept in registers: q[p][k] at
// atoms j0 (x0) and j1 (x1), -inf at a missing atom, unused for k >= n. BranchRows re-reads a
// row after the dueling mean: in v6b those reads were ~250 of the fused loss's ~2460
// instructions per warp (Nsight Compute, B = 4096); in registers the fused loss took 47.7 µs
// there instead of 51.3 (v6c). Same arithmetic as BranchRows and q_at.
struct BranchQ {
  float x0[3][kQChunk], x1[3][kQChunk];
};

template <bool kDueling>
__device__ void branch_q(const LossParams& P, const BranchTable& br, int b, int d, int j0, int j1, bool has0,
                         bool has1, BranchQ& q) {
  const float* base[3] = {P.q, P.q_next_online, P.q_next_target};
  const int NA = P.atoms, n = br.size[d];
  if constexpr (!kDueling) {
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      const float* row = base[p] + (int64_t(b) * P.total_actions + br.action_offset[d]) * NA;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        const bool live = k < n;
        q.x0[p][k] = live && has0 ? row[k * NA + j0] : -INFINITY;
        q.x1[p][k] = live && has1 ? row[k * NA + j1] : -INFINITY;
      }
    }
  } else {
    const float* b_out[3] = {P.b_online, P.b_online, P.b_target};
    float v0[3], v1[3];
#pragma unroll
    for (int p = 0; p < 3; ++p) {  // every load of the three passes issued before the first add
      const float* in = base[p] + int64_t(b) * P.head_ld;
      const float* row = in + br.pad_col[d];
      const float* bias = b_out[p] + NA * (1 + br.action_offset[d]);
      v0[p] = has0 ? in[j0] + b_out[p][j0] : 0.f;
      v1[p] = has1 ? in[j1] + b_out[p][j1] : 0.f;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        const bool live = k < n;
        q.x0[p][k] = live && has0 ? row[k * NA + j0] + bias[k * NA + j0] : 0.f;
        q.x1[p][k] = live && has1 ? row[k * NA + j1] + bias[k * NA + j1] : 0.f;
      }
    }
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        if (k < n) {
          s0 += q.x0[p][k];
          s1 += q.x1[p][k];
        }
      const float mean0 = s0 / n, mean1 = s1 / n;
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        q.x0[p][k] = has0 ? (v0[p] + q.x0[p][k]) - mean0 : -INFINITY;
        q.x1[p][k] = has1 ? (v1[p] + q.x1[p][k]) - mean1 : -INFINITY;
      }
    }
  }
}

// The fused loss's gradient of branch d of sample b w.r.t. the head logits:
// dueling_backward_kernel's arithmetic (mixed_backward.cu) on dq = g at the taken action a and
// 0 at the others (a < 0: a poisoned sample, every dq NaN): sum = the sum of dq over the
// actions in order, da_k = (dq_k - sum / n) + 0. Writes the branch's advantage columns (F32
// compact; BF16 padded, its padding columns 0) and leaves sum per atom in branch_sum, which
// the value column adds up over the branches (write_value_grad).
__device__ void write_branch_head_grad(const LossParams& P, const BranchTable& br, int b, int d, int a, float g0,
                                       float g1, float* branch_sum, int lane) {
  const int NA = P.atoms, n = br.size[d];
  float* dh = P.grad_head + int64_t(b) * P.head_out + NA * (1 + br.action_offset[d]);
  __nv_bfloat16* low = P.grad_head_bf16 + int64_t(b) * P.head_ld + br.pad_col[d];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int j = lane + 32 * e;
    if (j >= NA) break;
    const float taken = a < 0 ? NAN : e == 0 ? g0 : g1;  // dq at the taken action
    const float other = a < 0 ? NAN : 0.f;               // and at the others
    // The sum over the actions in order adds zeros to dq at the taken action, exactly: 0 + taken
    // (not `taken`: that differs for -0). Written out, it cost ~90 instructions per warp (v6b).
    const float sum = 0.f + taken;
    const float mean = sum / n;
    for (int k = 0; k < n; ++k) {
      const float x = ((k == a ? taken : other) - mean) + 0.f;
      dh[k * NA + j] = x;
      low[k * NA + j] = __float2bfloat16_rn(x);
    }
    branch_sum[j] = sum;
  }
  const int width = n * NA;
  for (int i = width + lane; i < round_up_to_align(width); i += 32) low[i] = __float2bfloat16_rn(0.f);
}

// The value column of sample b's head-logit gradient: the branches' sums in branch order
// (dueling_backward_kernel's dv), then its BF16 copy and padding. branch_sums: one row of
// kDuelingMaxAtoms per branch.
__device__ void write_value_grad(const LossParams& P, int b, const float* branch_sums, int branches, int lane) {
  const int NA = P.atoms;
  float* dh = P.grad_head + int64_t(b) * P.head_out;
  __nv_bfloat16* low = P.grad_head_bf16 + int64_t(b) * P.head_ld;
  for (int j = lane; j < NA; j += 32) {
    float dv = 0.f;
    for (int d = 0; d < branches; ++d) dv += branch_sums[d * kDuelingMaxAtoms + j];
    dh[j] = dv;
    low[j] = __float2bfloat16_rn(dv);
  }
  for (int64_t j = NA + lane; j < round_up_to_align(NA); j += 32) low[j] = __float2bfloat16_rn(0.f);
}

// Floats of shared memory per warp, C51's general version: [staged online rows | staged target
// rows | staged taken row] when staged, then the target probabilities, positions and projected
// distribution. (The <= 64-atom version: 4 * atoms.)
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

// First index i in [0, n) with pos[i] >= x (ascending pos) or pos[i] <= x (descending).
__device__ int first_reaching(const float* pos, int n, float x, bool ascending) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (ascending ? pos[mid] < x : pos[mid] > x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// The projected target mass of atom j: atom j receives mass only from sources with pos in
// [j - 1, j + 1] (its floor or ceiling is j), a contiguous range since pos is monotone in i
// (increasing, or constant for a terminal transition); the range's sources are added in
// increasing i, as a scan over every source would add them.
__device__ float projected_mass(const float* pt, const float* pos, int NA, int j, bool ascending) {
  float mj = 0.f;
  for (int i = first_reaching(pos, NA, ascending ? j - 1.f : j + 1.f, ascending); i < NA; ++i) {
    const float bi = pos[i];
    if (ascending ? bi > j + 1.f : bi < j - 1.f) break;
    float l = floorf(bi), u = ceilf(bi);
    if (l == u) {  // lands exactly on an atom: all its mass goes there
      if (u > 0.f) l -= 1.f;
      else u += 1.f;
    }
    if (int(l) == j) mj = fmaf(pt[i], u - bi, mj);
    if (int(u) == j) mj = fmaf(pt[i], bi - l, mj);
  }
  return mj;
}

// The C51 loss of branch d of sample b: returns (cross-entropy, expected Q of the taken
// action); writes the branch's rows of grad_q.
__device__ float2 c51_branch(const BranchTable& br, const LossParams& P, int b, int d, float scale, float* work,
                             int lane) {
  const int NA = P.atoms, n = br.size[d];
  const int64_t row0 = int64_t(b) * P.total_actions + br.action_offset[d];
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  const int64_t a = P.actions[int64_t(b) * br.count + d];
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

// The projection for atoms <= 64, by one warp. Source i splits its probability between its
// lower atom l_i and l_i + 1 (pt_i (u - b_i) and pt_i (b_i - l_i); u = l + 1 always, the
// exact-landing case included). l_i is monotone in i, so the sources sharing a lower atom form
// one run: a segmented scan over the warp (lane L holds sources 2L and 2L + 1) sums every run,
// and each run's last source writes its two sums, lower[l] and upper[l] (zeroed before); atom j
// then receives lower[j] + upper[j - 1]. Every lane runs the same few steps however long the
// runs are: the gather (projected_mass) looped over all 51 sources on one lane for a terminal
// transition (one run) and for long runs clipped at v_min / v_max. A fixed tree order:
// deterministic.
__device__ void project_by_runs(const float* pt, const float* pos, float* lower, float* upper, int NA, int lane) {
  constexpr int kNone = INT_MAX;  // no source (past the last atom)
  constexpr unsigned kAll = 0xffffffffu;
  int key[2];
  float cl[2], cu[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = 2 * lane + e;
    key[e] = kNone;
    cl[e] = cu[e] = 0.f;
    if (i < NA) {
      const float bi = pos[i];
      float l = floorf(bi), u = ceilf(bi);
      if (l == u) {  // lands exactly on an atom: all its mass goes there
        if (u > 0.f) l -= 1.f;
        else u += 1.f;
      }
      key[e] = int(l);
      cl[e] = pt[i] * (u - bi);
      cu[e] = pt[i] * (bi - l);
    }
  }
  // The lane's last run: source 1, with source 0 when they share a lower atom.
  const bool joined = key[0] == key[1];
  float vl = joined ? cl[0] + cl[1] : cl[1];
  float vu = joined ? cu[0] + cu[1] : cu[1];
  // Inclusive segmented scan keyed by the lane's last run (equal keys are contiguous).
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const float ul = __shfl_up_sync(kAll, vl, d), uu = __shfl_up_sync(kAll, vu, d);
    const int uk = __shfl_up_sync(kAll, key[1], d);
    if (lane >= d && uk == key[1]) {
      vl += ul;
      vu += uu;
    }
  }
  const float prev_l = __shfl_up_sync(kAll, vl, 1), prev_u = __shfl_up_sync(kAll, vu, 1);
  const int prev_key = __shfl_up_sync(kAll, key[1], 1), next_key = __shfl_down_sync(kAll, key[0], 1);
  if (!joined && key[0] != kNone) {  // source 0 ends its run, which may have begun in earlier lanes
    const bool carry = lane > 0 && prev_key == key[0];
    lower[key[0]] = carry ? prev_l + cl[0] : cl[0];
    upper[key[0]] = carry ? prev_u + cu[0] : cu[0];
  }
  if (key[1] != kNone && (lane == 31 || next_key != key[1])) {  // source 1 ends its run
    lower[key[1]] = vl;
    upper[key[1]] = vu;
  }
}

// c51_branch for atoms <= 64: lane owns atoms j0 = lane and j1 = lane + 32, those < atoms.
// The same arithmetic as c51_branch but for the projection's summation order
// (project_by_runs). `work` holds 4 * atoms floats: the target probabilities, the positions
// and the two projected halves.
//
// kDueling (the fused loss, _dqn_loss_on_logits): the rows are raw head logits, aggregated as
// they are read (BranchRows), and the gradient is written w.r.t. the head logits
// (write_branch_head_grad; branch_sum: this warp's row of per-atom sums for the value column).
template <bool kDueling, bool kRowsInRegisters>
__device__ float2 c51_branch_small(const BranchTable& br, const LossParams& P, int b, int d, float scale,
                                   float* work, float* branch_sum, int lane) {
  const int NA = P.atoms, n = br.size[d];
  const int64_t row0 = int64_t(b) * P.total_actions + br.action_offset[d];
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  const int64_t a = P.actions[int64_t(b) * br.count + d];
  if (!(a >= 0 && a < n) || !isfinite(r) || !isfinite(discount)) {  // see c51_branch
    if constexpr (kDueling) write_branch_head_grad(P, br, b, d, -1, NAN, NAN, branch_sum, lane);
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
    branch_q<kDueling>(P, br, b, d, j0, j1, has0, has1, q);
#pragma unroll
    for (int k = 0; k < kQChunk; ++k)  // a select, not an index: a register array stays in registers
      if (k == a) {
        xc0 = q.x0[0][k];
        xc1 = q.x1[0][k];
      }
    choose(n, q.x0[1], q.x1[1], q.x0[2], q.x1[2]);
  } else {
    auto load2 = [&](const BranchRows& rows, int k, float& x0, float& x1) {
      x0 = has0 ? q_at<kDueling>(rows, int64_t(k) * NA + j0, rows.v0, rows.mean0) : -INFINITY;
      x1 = has1 ? q_at<kDueling>(rows, int64_t(k) * NA + j1, rows.v1, rows.mean1) : -INFINITY;
    };
    BranchRows rows[3];
    branch_rows<kDueling>(P, br, b, d, j0, j1, has0, has1, rows);
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
  if constexpr (!kDueling)
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
  if constexpr (kDueling) {
    write_branch_head_grad(P, br, b, d, int(a), g0, g1, branch_sum, lane);
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

// kSmallAtoms: C51 with atoms <= 64 (c51_branch_small). kDueling: the fused loss on head
// logits (C51, atoms <= 64, a warp per branch: warps_per_sample == branches).
// kSmallAtomsMinBlocks: the <= 64-atom versions are latency-bound, so 3 blocks (24 warps) per
// SM: at most 85 registers. Unbounded, the fused version took 128 (v6's first run, 2 blocks per
// SM: loss 98 µs at B = 4096) and, with its loads batched, 162; capped, it spills 116 bytes
// (ptxas -v: bench/logs/2026-12-02-ptxas-loss.txt); with its rows in registers, 88 (v6c:
// bench/logs/2026-12-02-ptxas-loss-v6c.txt). Capped at 4 blocks per SM (64 registers, more
// spill) the fused loss measured 65.5 µs at B = 4096 against 57.8 (v6b code).
// kRowsInRegisters: every branch has at most kQChunk actions (BranchQ).
constexpr int kSmallAtomsMinBlocks = 3;

template <bool kSmallAtoms, bool kDueling, bool kRowsInRegisters>
__global__ void __launch_bounds__(kMaxWarps * 32, kSmallAtoms ? kSmallAtomsMinBlocks : 1)
    dqn_loss_kernel(const __grid_constant__ BranchTable br, const LossParams P) {
  static_assert(!kDueling || kSmallAtoms, "the fused loss runs the <= 64-atom version");
  static_assert(!kRowsInRegisters || kSmallAtoms, "rows in registers: the <= 64-atom version");
  extern __shared__ float smem[];  // C51: P.work_floats per warp
  // Each warp's sums of a round, and (kDueling) its branch sums of dq per atom for the value
  // column's gradient, read by its sample's first warp after the round's barrier. Two buffers,
  // by round parity, so one barrier a round suffices: a round writes the buffer the previous
  // round did not read, and the round before that finished its reads before the last barrier.
  // (Two barriers a round: the fused loss 47.7 µs at B = 4096 on the H200; one: 46.0.)
  __shared__ float part_a[2][kMaxWarps], part_b[2][kMaxWarps], part_c[2][kMaxWarps];
  __shared__ float branch_sums[2][kDueling ? kMaxWarps * kDuelingMaxAtoms : 1];
  __shared__ float slot_loss[kMaxWarps], slot_q[kMaxWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = P.warps_per_sample, S = P.samples_per_block;
  const int slot = warp / W, wi = warp % W;  // this warp's sample in the block, and its share
  const bool c51 = P.type == LossType::kC51;
  float* work = smem + warp * P.work_floats;
  float loss_acc = 0.f, q_acc = 0.f;  // kept by each sample slot's first warp
  int buf = 0;                        // this round's buffers
  for (int b0 = blockIdx.x * S; b0 < P.batch; b0 += gridDim.x * S, buf ^= 1) {  // uniform across the block
    const int b = b0 + slot;
    const bool live = slot < S && b < P.batch;
    const float w = live && P.weights ? P.weights[b] : 1.f;
    const float scale = w / (float(P.batch) * br.count);
    float x = 0.f, y = 0.f, z = 0.f;  // C51: cross-entropy and Q sums over this warp's branches
    if (live) {
      if (c51) {
        for (int d = wi; d < br.count; d += W) {
          float2 r;
          if constexpr (kSmallAtoms)
            r = c51_branch_small<kDueling, kRowsInRegisters>(
                br, P, b, d, scale, work, kDueling ? branch_sums[buf] + warp * kDuelingMaxAtoms : nullptr, lane);
          else
            r = c51_branch(br, P, b, d, scale, work, lane);
          x += r.x;
          y += r.y;
        }
      } else if constexpr (!kDueling) {
        const float3 r = bdq_sample(br, P, b, scale, lane);
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
    if (live && wi == 0 && lane == 0) {
      float sample_loss = 0.f, q = 0.f, td = 0.f;
      for (int k = 0; k < W; ++k) {  // branch order (warp k took branches k, k + W, ...)
        sample_loss += part_a[buf][warp + k];
        q += part_b[buf][warp + k];
        td += part_c[buf][warp + k];
      }
      if (c51) {
        sample_loss /= br.count;
        q /= br.count;
        td = sample_loss;
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

struct LossResults {
  Tensor loss, td_error, mean_q;
};

// Sizes the launch, allocates the scalar outputs and launches. P arrives with the inputs, the
// gradient outputs, total_actions and the loss constants set.
LossResults launch_loss(const BranchTable& br, LossParams& P, int64_t batch, int64_t atoms, LossType type,
                        bool dueling, const at::TensorOptions& f32) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Block shape: C51 gives each sample min(D, 8) warps (warp k takes branches k, k + 8, ...)
  // and a block as many whole samples as fit in 8 warps; MSE / Huber a warp per sample.
  const bool c51 = type == LossType::kC51;
  const int warps_per_sample = c51 ? static_cast<int>(std::min<int64_t>(br.count, kMaxWarps)) : 1;
  const int samples_per_block = kMaxWarps / warps_per_sample;
  const int threads = 32 * warps_per_sample * samples_per_block;
  int max_actions = 1;
  for (int d = 0; d < br.count; ++d) max_actions = std::max(max_actions, br.size[d]);
  const int warps = threads / 32;
  const bool small_atoms = c51 && atoms <= 64;
  const bool staged = c51 && !small_atoms &&
                      size_t(warps) * c51_floats_per_warp(atoms, max_actions, true) * sizeof(float) <= kSmemBudget;
  const int64_t work_floats = !c51 ? 0 : small_atoms ? 4 * atoms : c51_floats_per_warp(atoms, max_actions, staged);
  const size_t smem = size_t(warps) * work_floats * sizeof(float);
  using Kernel = void (*)(const BranchTable, const LossParams);
  const bool in_registers = small_atoms && max_actions <= kQChunk;
  const Kernel kernel = !small_atoms                 ? dqn_loss_kernel<false, false, false>
                        : dueling && in_registers    ? dqn_loss_kernel<true, true, true>
                        : dueling                    ? dqn_loss_kernel<true, true, false>
                        : in_registers               ? dqn_loss_kernel<true, false, true>
                                                     : dqn_loss_kernel<true, false, false>;
  // A resident grid: as many blocks as fit on the GPU at once (the occupancy API), each looping
  // over sample groups, so the end-of-block work (the fence and ticket, the last block's check)
  // is paid once per resident block. v6b launched a block per group (at most 16 per SM): the
  // barrier before the ticket was ~5% of the fused loss's stall samples (Nsight Compute,
  // B = 4096); the resident grid took the fused loss from 54.5 to 47.7 µs there (v6c, both with
  // the rows in registers; bench/NOTES.md). No grid barrier, so no co-residency is needed for
  // correctness: the last block to finish sums the partials.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, smem));
  const int grid = static_cast<int>(std::min<int64_t>((batch + samples_per_block - 1) / samples_per_block,
                                                      std::max(resident, 1) * sms));

  LossResults out{at::empty({}, f32), at::empty({batch}, f32), at::empty({}, f32)};
  Tensor partials = at::empty({2 * grid + 1}, f32);  // and the counter, zeroed below
  P.td_error = out.td_error.data_ptr<float>();
  P.loss = out.loss.data_ptr<float>();
  P.mean_q = out.mean_q.data_ptr<float>();
  P.partials = partials.data_ptr<float>();
  P.counter = reinterpret_cast<unsigned*>(P.partials + 2 * grid);
  C10_CUDA_CHECK(cudaMemsetAsync(P.counter, 0, sizeof(unsigned), stream));
  P.batch = static_cast<int>(batch);
  P.atoms = static_cast<int>(atoms);
  P.warps_per_sample = warps_per_sample;
  P.samples_per_block = samples_per_block;
  P.max_actions = max_actions;
  P.staged = staged;
  P.work_floats = static_cast<int>(work_floats);
  P.type = type;
  kernel<<<grid, threads, smem, stream>>>(br, P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
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
  Tensor grad_q = at::empty_like(q);
  LossParams P{};
  P.q = q.data_ptr<float>();
  P.q_next_online = q_next_online.data_ptr<float>();
  P.q_next_target = q_next_target.data_ptr<float>();
  P.actions = actions.data_ptr<int64_t>();
  P.rewards = rewards.data_ptr<float>();
  P.dones = dones.data_ptr<float>();
  P.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  P.grad_q = grad_q.data_ptr<float>();
  P.total_actions = static_cast<int>(S.total_actions);
  P.v_min = static_cast<float>(v_min);
  P.v_max = static_cast<float>(v_max);
  P.dz = S.type == LossType::kC51 ? static_cast<float>((v_max - v_min) / double(S.atoms - 1)) : 0.f;
  P.gamma = static_cast<float>(gamma);
  const LossResults r = launch_loss(br, P, S.batch, S.atoms, S.type, false, q.options());
  return {r.loss, grad_q, r.td_error, r.mean_q};
}

// _dqn_loss_on_logits (the trainer's fused path; csrc/dqn_ops.cpp).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> dqn_loss_on_logits_cuda(
    const Tensor& logits, const Tensor& logits_next_online, const Tensor& logits_next_target, const Tensor& params,
    const Tensor& target_params, const Tensor& actions, const Tensor& rewards, const Tensor& dones,
    const c10::optional<Tensor>& weights, c10::IntArrayRef layout, double v_min, double v_max, double gamma) {
  const char* op = kLossOnLogitsOp;
  const NetLayout L = parse_layout(layout, op);
  DQN_CHECK(L.atoms >= 2 && L.atoms <= kDuelingMaxAtoms, op, ": takes C51 with 2 to ", kDuelingMaxAtoms,
            " atoms, got ", L.atoms);
  DQN_CHECK(L.num_branches() <= kMaxWarps, op, ": takes at most ", kMaxWarps, " branches, got ", L.num_branches());
  DQN_CHECK(v_min < v_max, op, ": v_min must be below v_max, got v_min=", std::to_string(v_min), ", v_max=",
            std::to_string(v_max));
  DQN_CHECK(gamma >= 0 && gamma <= 1, op, ": gamma: expected a value in [0, 1], got ", std::to_string(gamma));
  const at::Device dev = logits.device();
  check_tensor(logits, op, "logits", dev, at::kFloat, {-1, L.head_ld});
  const int64_t B = logits.size(0);
  DQN_CHECK(B >= 1 && B <= INT_MAX / 2, op, ": logits: expected 1 to ", INT_MAX / 2, " rows, got ", B);
  check_tensor(logits_next_online, op, "logits_next_online", dev, at::kFloat, {B, L.head_ld});
  check_tensor(logits_next_target, op, "logits_next_target", dev, at::kFloat, {B, L.head_ld});
  check_tensor(params, op, "params", dev, at::kFloat, {L.numel});
  check_tensor(target_params, op, "target_params", dev, at::kFloat, {L.numel});
  check_tensor(actions, op, "actions", dev, at::kLong, {B, L.num_branches()});
  check_tensor(rewards, op, "rewards", dev, at::kFloat, {B});
  check_tensor(dones, op, "dones", dev, at::kFloat, {B});
  if (weights.has_value()) check_tensor(*weights, op, "weights", dev, at::kFloat, {B});
  const BranchTable br = make_branch_table(L, op);
  const c10::cuda::CUDAGuard guard(dev);
  Tensor grad_head = at::empty({B, L.head_out}, params.options());
  Tensor grad_head_bf16 = at::empty({B, L.head_ld}, params.options().dtype(at::kBFloat16));
  LossParams P{};
  P.q = logits.data_ptr<float>();
  P.q_next_online = logits_next_online.data_ptr<float>();
  P.q_next_target = logits_next_target.data_ptr<float>();
  P.b_online = params.data_ptr<float>() + L.b_out;
  P.b_target = target_params.data_ptr<float>() + L.b_out;
  P.actions = actions.data_ptr<int64_t>();
  P.rewards = rewards.data_ptr<float>();
  P.dones = dones.data_ptr<float>();
  P.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  P.grad_head = grad_head.data_ptr<float>();
  P.grad_head_bf16 = static_cast<__nv_bfloat16*>(grad_head_bf16.data_ptr());
  P.head_ld = L.head_ld;
  P.head_out = L.head_out;
  P.total_actions = static_cast<int>(L.total_actions);
  P.v_min = static_cast<float>(v_min);
  P.v_max = static_cast<float>(v_max);
  P.dz = static_cast<float>((v_max - v_min) / double(L.atoms - 1));
  P.gamma = static_cast<float>(gamma);
  const LossResults r = launch_loss(br, P, B, L.atoms, LossType::kC51, true, params.options());
  return {r.loss, grad_head, grad_head_bf16, r.td_error, r.mean_q};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("dqn_loss", &cuda::dqn_loss_cuda);
  m.impl("_dqn_loss_on_logits", &cuda::dqn_loss_on_logits_cuda);
}

}  // namespace dqn_ops

// The QR-DQN and IQN loss of one (sample, branch) (loss.cu's parts: see loss.cu): one code
// path, IQN's fractions tau_i read per sample where QR's are the midpoints (2i + 1) / 2N, and
// its three inputs with their own slot counts (q's N, q_next_online's K, q_next_target's N';
// QR: all N). A warp per branch: the double-DQN choice by the mean of the K online quantiles
// (quantiles.cuh), the N' target quantiles T_j = r + gamma (1 - done) theta_target(s', a*)_j
// staged in the warp's shared memory, then the quantile Huber sums of the taken action's N
// quantiles over every T_j, one of two ways (the same sums; lane l owns the quantiles i = l,
// l + 32, ...):
//   direct (N <= kQrDirectMaxQuantiles): the N x N' pairs, every lane reading the same T_j from
//     shared memory (a broadcast);
//   sorted (larger N): T sorted (in the warp's registers, then kept in shared memory) with its
//     prefix sums, and each quantile's sums in closed form from three binary searches:
//     O((N + N') log N') per branch instead of O(N N').
#pragma once

#include <cstdint>

#include "../branch_table.cuh"
#include "../quantiles.cuh"
#include "../reductions.cuh"
#include "loss_args.h"
#include "params.cuh"
#include "rows.cuh"

namespace dqn_ops {
namespace cuda {
namespace {  // see loss/params.cuh

// The direct N^2 version up to this many quantiles (one round: a lane owns at most one), the
// sorted one beyond. Per lane, in issued instructions (counted in the loops' SASS, sm_90):
//   direct: ~9.5 per pair (u, |u| clamped, the weight's select, the Huber piece's two, the two
//     FMAs, the copysign, the shared loads shared by 4 pairs), N pairs per owned quantile:
//     ~300 at N = 32, ~1,200 at N = 64, ~13,300 at N = 200 (7 rounds x 200 pairs);
//   sorted, n2 the power of two >= N': the sort in registers, log2(n2) (log2(n2) + 1) / 2 steps
//     of 4 compare-exchanges a lane (~2 instructions each within a lane, ~16 a step across
//     lanes: 8 shuffles and selections), the scan's ~100, and per owned quantile ~22 per step of
//     the three interleaved searches (log2(n2) + 1 steps) and ~110 for the closed form: ~850 at
//     N = 64, ~3,000 at N = 200 (sort 21 x 8 + 15 x 16 ~ 400, scan ~100, 7 x (9 x 22 + 110)
//     ~ 2,200 for the quantiles: the searches are most of it).
// The direct loop keeps N <= 32, its one round (~300; the sorted version there ~500). The choice
// goes by N (a lane's quantiles: one round or several) whatever N' (IQN; QR's N' is N): the
// direct version's pairs are N' per lane, the sorted version's sort of N' is paid once per branch.
constexpr int kQrDirectMaxQuantiles = 32;

// The sorted version's sort size: the power of two >= N' (a bitonic network's), at least 4 so
// that the prefix sums after the targets stay 16-byte aligned (IQN's N' may be small).
__host__ __device__ inline int qr_sort_size(int target_quantiles) {
  int n2 = 4;
  while (n2 < target_quantiles) n2 <<= 1;
  return n2;
}

// Floats of shared memory per warp for N quantiles of q and N' targets, every warp's area a
// multiple of 16 bytes (the direct loop reads T as float4s, the sorted version's prefix sums are
// double2s):
//   direct: the target quantiles, padded to whole float4s;
//   sorted: the targets padded with +inf to qr_sort_size(N') (a multiple of 4), then the N' + 1
//   prefix sums (S1, S2) as double2s: 5,136 bytes at N' = 256, 41,088 for kMaxWarps warps, within
//   the 48 KiB a launch may have without an opt-in (the fused loss's round buffers come on top:
//   launch_loss opts in where they pass it).
__host__ __device__ inline int64_t qr_floats_per_warp(int64_t quantiles, int64_t target_quantiles) {
  if (quantiles <= kQrDirectMaxQuantiles) return (target_quantiles + 3) / 4 * 4;
  return qr_sort_size(static_cast<int>(target_quantiles)) + 4 * (target_quantiles + 1);
}

// A poisoned sample's gradient rows in branch d, as the composed path has them: the taken
// action's N quantiles NaN, or, when the action is out of range (no row is taken), every
// action's. The fused loss (reads_head(kRows)): the head-logit gradient of those rows
// (write_head_grad_column on dq NaN at the taken action: with dueling every column of the
// branch NaN, without it the taken action's, or every action's when the action is out of
// range); the branch's sums to branch_sum (nullptr: not kept).
template <LossRows kRows>
__device__ void qr_poison_rows(const BranchTable& br, const LossParams& P, int b, int d, float* branch_sum, int lane) {
  const int N = P.atoms, n = br.size[d];
  const int64_t a = taken_action(br, P.actions, b, d);
  const bool valid = a >= 0 && a < n;
  if constexpr (reads_head(kRows)) {
    float* dh = head_grad_row(P, br, b, d);
    __nv_bfloat16* low = head_grad_row_bf16(P, br, b, d);
    for (int i = lane; i < N; i += 32) {
      const float sum = write_head_grad_column<kRows>(dh, low, n, N, valid ? int(a) : -1, i, NAN);
      if (branch_sum) branch_sum[i] = sum;
    }
    zero_head_padding(low, n * N, lane, 32);
  } else {
    float* g = P.grad_q + (q_row_of(br, b, P.total_actions, d) + (valid ? a : 0)) * N;
    const int count = valid ? N : n * N;
    for (int i = lane; i < count; i += 32) g[i] = NAN;
  }
}

// The quantile Huber sums of kRows quantiles (theta, with fractions tau and 1 - tau) over the
// target quantiles T[0..N2), in the order of j: per pair u = T_j - theta,
//   loss += |tau - 1{u < 0}| huber(u),  grad += |tau - 1{u < 0}| clamp(u, -1, 1)
// (huber with kappa 1 as c (|u| - c / 2), c = min(|u|, 1): 0.5 u^2 for |u| <= 1, |u| - 0.5
// beyond, without a branch). A NaN theta gives a NaN loss here but not a NaN grad (fminf drops
// the NaN): the caller sees to that. The pairs are N N2 per branch, so this loop is the direct
// version's work: kRows quantiles share each T read, four T at a time (one 16-byte shared load), and
// each quantile's two sums are independent chains of FMAs.
template <int kRows>
__device__ __forceinline__ void quantile_huber_sums(const float* __restrict__ T, int N2, const float (&theta)[kRows],
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
  const int quads = N2 / 4;
  for (int q = 0; q < quads; ++q) {
    const float4 t = T4[q];
    pair(t.x);
    pair(t.y);
    pair(t.z);
    pair(t.w);
  }
  for (int j = 4 * quads; j < N2; ++j) pair(T[j]);
}

// The fraction of quantile i of N: IQN's tau_row[i] (the sample's own), or QR's midpoint
// (2i + 1) / 2N (tau_row nullptr), in F32 (the direct version's) or double (the sorted one's;
// half_over_n = 0.5 / N).
__device__ __forceinline__ float quantile_tau(const float* tau_row, int i, int N) {
  return tau_row ? tau_row[i] : float(2 * i + 1) / float(2 * N);
}
__device__ __forceinline__ double quantile_tau_f64(const float* tau_row, int i, double half_over_n) {
  return tau_row ? double(tau_row[i]) : double(2 * i + 1) * half_over_n;
}

// Round k of the lane's quantiles and kRows - 1 after it: i = lane + 32 (k + e), those < N, at
// fractions tau_row (quantile_tau), over the N2 targets T. Writes their gradient (gscale =
// -w_b / (B E D N2)) and adds their loss sums and thetas to the lane's sums, in the order of i.
// grad_row may be theta_row (the fused loss's buffer): quantile i's gradient is written after
// its theta is read, by the lane that read it.
// A lane without a quantile there runs the loop on theta = 0 (the warp runs it anyway) and
// keeps nothing.
template <int kRows>
__device__ __forceinline__ void qr_round(const float* T, int N2, const float* theta_row, const float* tau_row,
                                         float* grad_row, int N, int k, int lane, float gscale, float& loss_sum,
                                         float& theta_sum) {
  float theta[kRows], tau[kRows], tau_neg[kRows], loss[kRows], grad[kRows];
#pragma unroll
  for (int e = 0; e < kRows; ++e) {
    const int i = lane + 32 * (k + e);
    theta[e] = i < N ? theta_row[i] : 0.f;
    tau[e] = i < N ? quantile_tau(tau_row, i, N) : 0.f;
    tau_neg[e] = 1.f - tau[e];  // |tau_i - 1| (u < 0)
    loss[e] = grad[e] = 0.f;
  }
  quantile_huber_sums<kRows>(T, N2, theta, tau, tau_neg, loss, grad);
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

// The sorted version (N > kQrDirectMaxQuantiles). With the targets sorted, the sums of one
// quantile theta over every T_j split into four runs of j by u = T_j - theta:
//   A: u < -1, B: -1 <= u < 0 (weight 1 - tau), C: 0 <= u <= 1, D: u > 1 (weight tau),
// and each run's sum of huber(u) (|u| - 1/2 on A and D, u^2 / 2 on B and C) and of clamp(u)
// (-1, u, u, 1) is a closed form in its count and its sums of T_j and T_j^2: differences of
// prefix sums. At the runs' borders (u = -1, 0, 1) both neighbouring pieces and weights give
// the same term, so which run a border target joins does not matter.

// The sort's values a lane holds in registers: a warp sorts up to 32 x 8 = 256 targets.
constexpr int kQrSortPerLane = 8;
static_assert(32 * kQrSortPerLane >= kLossCudaMaxAtoms, "the register sort holds every target slot");

// Lane l's elements T[8l .. 8l + 8) (first = 8l) as two 16-byte loads (the stage is 16-byte
// aligned) where `load` (only for a lane whose first element lies below n2: the stage's
// n2 + 4 (N2 + 1) floats hold them all), else `fill`.
__device__ __forceinline__ void load_lane_targets(const float* T, int first, bool load, float fill,
                                                  float (&v)[kQrSortPerLane]) {
  static_assert(kQrSortPerLane == 8, "a lane's elements are two float4s");
  float4 lo = make_float4(fill, fill, fill, fill), hi = lo;
  if (load) {
    lo = *reinterpret_cast<const float4*>(T + first);
    hi = *reinterpret_cast<const float4*>(T + first + 4);
  }
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// Sorts the staged targets T[0..n2) ascending in place, n2 a power of two (qr_sort_size):
// T[N2..n2) is taken as +inf. A bitonic network (log2(n2) (log2(n2) + 1) / 2 steps of
// compare-exchanges) on the warp's registers: lane l holds elements 8l .. 8l + 7, so a step of
// distance j >= 8 pairs the same register of lanes l and l ^ j / 8 (one shuffle each), a shorter
// one the lane's own registers. The shared memory is read and written once, each lane its own 8
// elements, so no lane waits on another before the caller's __syncwarp. No NaN reaches it (a
// branch with a non-finite target is poisoned before); equal values are equal bits, or zeros of
// either sign, which no sum or comparison after it tells apart.
__device__ __forceinline__ void qr_sort(float* T, int n2, int N2, int lane) {
  constexpr int R = kQrSortPerLane;
  const int first = lane * R;
  float v[R];
  load_lane_targets(T, first, first < n2, INFINITY, v);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (first + r >= N2) v[r] = INFINITY;
#pragma unroll
  for (int k = 2; k <= 32 * R; k <<= 1) {
    if (k > n2) break;  // warp-uniform: the first n2 elements are sorted, the rest are the +inf padding
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j >= R) {  // pairs across lanes: the pair's direction, (index & k), is the lane's (k > R)
        const int lane_bit = j / R;
        const bool upper = (lane & lane_bit) != 0;
        const bool keep_min = ((first & k) == 0) != upper;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float y = __shfl_xor_sync(0xffffffffu, v[r], lane_bit);
          v[r] = keep_min ? fminf(v[r], y) : fmaxf(v[r], y);
        }
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r)
          if ((r & j) == 0) {
            const int l = r | j;
            const bool up = ((first + r) & k) == 0;  // this pair's block of k sorts ascending
            const float lo = fminf(v[r], v[l]), hi = fmaxf(v[r], v[l]);
            v[r] = up ? lo : hi;
            v[l] = up ? hi : lo;
          }
      }
    }
  }
  // n2 is a multiple of 4: a lane's elements below it are whole float4s
  if (first < n2) *reinterpret_cast<float4*>(T + first) = make_float4(v[0], v[1], v[2], v[3]);
  if (first + 4 < n2) *reinterpret_cast<float4*>(T + first + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

// S[k] = (sum_{j<k} t_j, sum_{j<k} t_j^2) for k = 0..N2, t_j = T_j - c, in double, over the
// sorted targets T[0..N2) as qr_sort's lanes hold them (lane l: T_{8l..8l+7}, read back as two
// float4s rather than kept in registers across the caller's __syncwarp): each lane's sums of its
// own in order, a warp scan of those (a fixed order: deterministic), then each lane's prefix
// sums from the scan of the lanes before it. The shift c (a target) keeps the closed form's
// differences of sums of squares from cancelling away their digits when the targets sit far from
// 0 (a large reward): every term there is a function of T_j - theta, so shifting both changes
// nothing else.
__device__ __forceinline__ void qr_prefix_sums(const float* T, int N2, double c, double2* S, int lane) {
  constexpr int R = kQrSortPerLane;
  const int first = lane * R;
  float v[R];
  load_lane_targets(T, first, first < N2, 0.f, v);
  double s1 = 0.0, s2 = 0.0;
  auto add = [&](int r) {
    const double t = double(v[r]) - c;
    s1 += t;
    s2 += t * t;
  };
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (first + r < N2) add(r);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {  // inclusive scan of the lanes' sums
    const double a1 = __shfl_up_sync(0xffffffffu, s1, o), a2 = __shfl_up_sync(0xffffffffu, s2, o);
    if (lane >= o) {
      s1 += a1;
      s2 += a2;
    }
  }
  // the lanes before this one's: an exclusive scan by one more shift
  s1 = __shfl_up_sync(0xffffffffu, s1, 1);
  s2 = __shfl_up_sync(0xffffffffu, s2, 1);
  if (lane == 0) {
    s1 = s2 = 0.0;
    S[0] = make_double2(0.0, 0.0);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (first + r < N2) {
      add(r);
      S[first + r + 1] = make_double2(s1, s2);
    }
}

// #{T_j < ka}, #{T_j < kb}, #{T_j <= kc} in the sorted T[0..n2), n2 a power of two: three
// branch-free binary searches, interleaved for their loads' latency (before the step of size s
// a count lies in [k, k + 2s], after the last in [k, k + 1], which T[k] decides). The +inf
// padding is below no key, and at most an infinite kc: the caller clamps that count to N'.
__device__ __forceinline__ void qr_counts(const float* T, int n2, float ka, float kb, float kc, int& ca, int& cb,
                                          int& cc) {
  ca = cb = cc = 0;
  for (int s = n2 >> 1; s > 0; s >>= 1) {
    if (T[ca + s - 1] < ka) ca += s;
    if (T[cb + s - 1] < kb) cb += s;
    if (T[cc + s - 1] <= kc) cc += s;
  }
  ca += T[ca] < ka;
  cb += T[cb] < kb;
  cc += T[cc] <= kc;
}

// The lane's quantiles i = lane, lane + 32, ... (< N, at fractions tau_row: quantile_tau_f64)
// over the N2 sorted targets T[0..n2) and their prefix sums S (c: the sums' shift): writes each
// one's gradient (gscale = -w_b / (B E D N2)) and adds its loss sum and theta to the lane's
// sums, in the order of i (the lane's loss sum in double, rounded once; grad_row may be
// theta_row, as in qr_round). A run's terms are
// evaluated only when it has a target: an infinite theta then gives an infinite loss and a
// finite gradient, as the direct sums do, never 0 * inf. A NaN theta finds no target below any
// key (every comparison false): all of them in D, so its loss is NaN; its gradient is set NaN,
// as the direct version does.
__device__ __forceinline__ void qr_sorted_sums(const float* T, const double2* S, int n2, int N2, double c,
                                               const float* theta_row, const float* tau_row, float* grad_row, int N,
                                               int lane, float gscale, float& loss_sum, float& theta_sum) {
  const double2 total = S[N2];
  const double half_over_n = 0.5 / N;  // one division per branch, not per quantile
  double lane_loss = 0.0;
#pragma unroll 1
  for (int i = lane; i < N; i += 32) {
    const float th = theta_row[i];
    // The runs' borders exactly in F32 (T_j and theta are floats): T_j < theta - 1 iff T_j is
    // below theta - 1 rounded up, T_j <= theta + 1 iff T_j <= theta + 1 rounded down.
    int kA, kB, kC;
    qr_counts(T, n2, __fadd_ru(th, -1.f), th, __fadd_rd(th, 1.f), kA, kB, kC);
    kC = min(kC, N2);
    const double t = double(th) - c;  // theta, shifted as the sums are
    const double2 pA = S[kA], pB = S[kB], pC = S[kC];
    const double nA = kA, nB = kB - kA, nC = kC - kB, nD = N2 - kC;
    const double s1B = pB.x - pA.x, s2B = pB.y - pA.y;
    const double s1C = pC.x - pB.x, s2C = pC.y - pB.y;
    const double s1D = total.x - pC.x;
    // huber: A sum(theta - T - 1/2), B sum((T - theta)^2) / 2, C likewise, D sum(T - theta - 1/2)
    const double hA = kA > 0 ? nA * (t - 0.5) - pA.x : 0.0;
    const double hB = kB > kA ? 0.5 * (s2B - t * (2.0 * s1B - nB * t)) : 0.0;
    const double hC = kC > kB ? 0.5 * (s2C - t * (2.0 * s1C - nC * t)) : 0.0;
    const double hD = N2 > kC ? s1D - nD * (t + 0.5) : 0.0;
    // clamp(u): -1 on A, u on B and C, 1 on D
    const double uB = kB > kA ? s1B - nB * t : 0.0;
    const double uC = kC > kB ? s1C - nC * t : 0.0;
    const double tau = quantile_tau_f64(tau_row, i, half_over_n);
    lane_loss += (1.0 - tau) * (hA + hB) + tau * (hC + hD);
    const double gsum = (1.0 - tau) * (uB - nA) + tau * (uC + nD);
    // d(huber)/d(theta) = -clamp(u): NaN for a NaN theta, as torch's huber_loss backward gives
    grad_row[i] = th != th ? th : float(gsum * double(gscale));
    theta_sum += th;
  }
  loss_sum += float(lane_loss);
}

// The QR / IQN loss of branch d of sample b: returns (loss_bd, the mean of the taken action's
// quantiles, 1 when the branch poisons its sample else 0) and writes the branch's gradient
// rows: dqn_loss (kQ) grad_q's; the fused loss (reads_head(kRows), QR) the head-logit gradient
// (write_head_grad_column: the composed path's dueling backward of those grad_q rows) and, with
// dueling, the branch's sums per quantile to buf for the value column. A non-finite target
// quantile (a NaN/Inf reward or done, a non-finite target network output, an overflow), an
// out-of-range action, or (IQN) a fraction of the sample outside [0, 1] or NaN poisons the
// sample: this branch's rows get NaN here (qr_poison_rows) and its loss and Q are NaN; the
// kernel then gives the sample's other branches NaN rows too.
// `stage`: qr_floats_per_warp(N, N') floats of this warp's; `buf` (the fused loss): N floats of
// this warp's, lane-owned (quantile i's entry is lane i % 32's), holding the taken action's
// quantiles theta, then their gradient, then the branch's sums. kIqn: IQN (P.fractions, N, K,
// N' as P has them); else QR (the midpoints, K = N' = N), the same code with those known.
// kFewActions (the fused loss, every branch at most kQChunk actions): each pass reads
// kQrColumnBatch of the lane's columns at a time, every action's q of them from loads issued
// together (QuantileRows::full_columns), so a pass costs ceil(N / (32 kQrColumnBatch)) memory
// latencies instead of one a column; the same q bits, summed in the same order. Two: the
// dueling instantiation (at most 85 registers) holds two columns' loads without spilling; four
// spilled 88 bytes a thread (and ran slower), eight ~300 (ptxas -v, sm_90).
constexpr int kQrColumnBatch = 2;

template <LossRows kRows, bool kIqn, bool kFewActions>
__device__ float3 qr_branch(const BranchTable& br, const LossParams& P, int b, int d, float scale, float* stage,
                            float* buf, int lane) {
  static_assert(!kIqn || kRows == LossRows::kQ, "IQN's loss reads q (its head rows are per fraction)");
  static_assert(!kFewActions || reads_head(kRows), "the batched columns are the fused loss's");
  const int N = P.atoms, K = kIqn ? P.next_atoms : N, N2 = kIqn ? P.target_atoms : N, n = br.size[d];
  const int64_t a = taken_action(br, P.actions, b, d);
  if (!(a >= 0 && a < n)) {  // no host sync can report it (see c51_branch)
    qr_poison_rows<kRows>(br, P, b, d, buf, lane);
    return make_float3(NAN, NAN, 1.f);
  }
  const int64_t row0 = q_row_of(br, b, P.total_actions, d);
  if constexpr (kRows == LossRows::kQ)  // the other actions' gradient rows are 0 (the fused loss writes
    for (int k = 0; k < n; ++k)         // every action's columns at the end)
      if (k != a)
        for (int i = lane; i < N; i += 32) P.grad_q[(row0 + k) * N + i] = 0.f;

  // A pass's columns j < count of the lane's, handed to use(j, ...) in the order of j:
  // kFewActions, every action's q at each (for_each_full_column); for_each_q, one action's.
  using Rows = QuantileRows<kRows>;
  using FullColumn = typename Rows::FullColumn;
  auto for_each_full_column = [&](const Rows& rows, int count, auto&& use, int only = -1) {
    for (int j0 = lane; j0 < count; j0 += 32 * kQrColumnBatch) {
      FullColumn c[kQrColumnBatch];
      rows.template full_columns<kQrColumnBatch>(j0, count, c, only);
#pragma unroll
      for (int g = 0; g < kQrColumnBatch; ++g)
        if (j0 + 32 * g < count) use(j0 + 32 * g, c[g]);
    }
  };
  auto for_each_q = [&](const Rows& rows, int count, int action, auto&& use) {
    if constexpr (kFewActions)
      for_each_full_column(rows, count, [&](int j, const FullColumn& c) { use(j, c.at(action)); }, action);
    else
      for (int j = lane; j < count; j += 32) use(j, rows.q(action, j, rows.column(j)));
  };

  // double DQN: the online network's greedy next action by the quantiles' mean (the first of
  // equal maxima; NaN wins), kQChunk actions' loads and reductions in flight together
  const Rows next = quantile_rows<kRows>(P, br, 1, b, d, row0, K);
  int a_star = 0;
  float best = -INFINITY;
  bool nan_seen = false;
  // s[k]: the lane's sum of action a0 + k's quantiles (0 past n)
  auto choose = [&](int a0, const float (&s)[kQChunk]) {
#pragma unroll
    for (int k = 0; k < kQChunk; ++k) {
      const float qv = quantile_mean(s[k], K);  // every lane, every k: a warp-wide reduction
      if (a0 + k < n && !nan_seen && (qv > best || qv != qv)) {
        best = qv;
        a_star = a0 + k;
        nan_seen = qv != qv;
      }
    }
  };
  if constexpr (kFewActions) {  // one chunk: every action's sums from the same column batches
    float s[kQChunk] = {};
    for_each_full_column(next, K, [&](int, const FullColumn& c) {
#pragma unroll
      for (int k = 0; k < kQChunk; ++k)
        if (k < n) s[k] += c.q[k];
    });
    choose(0, s);
  } else {
    // (The fused loss forms each column's value and mean once, into the lane's entries of the
    // stage and buf, both free until the target is staged and theta read: the actions' loop
    // then reads them back instead of every action re-reading the column.)
    if constexpr (reads_head(kRows))
      for (int j = lane; j < K; j += 32) {
        const auto c = next.column(j);
        stage[j] = c.v;
        buf[j] = c.mean;
      }
    for (int a0 = 0; a0 < n && !nan_seen; a0 += kQChunk) {
      float s[kQChunk];
#pragma unroll
      for (int k = 0; k < kQChunk; ++k) {
        s[k] = 0.f;
        if (a0 + k < n)
          for (int j = lane; j < K; j += 32) {
            typename Rows::Column c{0.f, 0.f};
            if constexpr (reads_head(kRows)) c = {stage[j], buf[j]};
            s[k] += next.q(a0 + k, j, c);
          }
      }
      choose(a0, s);
    }
  }

  // the target quantiles of that action, staged for the whole warp
  const Rows target = quantile_rows<kRows>(P, br, 2, b, d, row0, N2);
  const float discount = P.gamma * (1.f - P.dones[b]);
  const float r = P.rewards[b];
  bool finite = true;
  for_each_q(target, N2, a_star, [&](int j, float q) {
    const float t = fmaf(discount, q, r);
    stage[j] = t;
    finite = finite && isfinite(t);
  });
  // IQN: the sample's fractions are probabilities (NaN fails both comparisons); the CPU kernel
  // raises on one that is not, this one cannot without a host sync
  const float* tau_row = kIqn ? P.fractions + int64_t(b) * N : nullptr;
  if (kIqn)
    for (int i = lane; i < N; i += 32) finite = finite && tau_row[i] >= 0.f && tau_row[i] <= 1.f;
  if (!__all_sync(0xffffffffu, finite)) {
    qr_poison_rows<kRows>(br, P, b, d, buf, lane);
    __syncwarp();  // the warp's next branch reuses the stage
    return make_float3(NAN, NAN, 1.f);
  }
  __syncwarp();

  // the quantile Huber loss on the taken action: its quantiles theta, and where their gradient goes
  const float* theta_row;
  float* g;
  if constexpr (kRows == LossRows::kQ) {
    theta_row = P.q + (row0 + a) * N;
    g = P.grad_q + (row0 + a) * N;
  } else {
    const Rows online = quantile_rows<kRows>(P, br, 0, b, d, row0, N);
    for_each_q(online, N, int(a), [&](int i, float q) { buf[i] = q; });
    theta_row = g = buf;
  }
  const float gscale = -scale / N2;
  float loss_sum = 0.f, theta_sum = 0.f;
  static_assert(kQrDirectMaxQuantiles <= 32, "the direct version runs one round");
  if (N <= kQrDirectMaxQuantiles) {
    qr_round<1>(stage, N2, theta_row, tau_row, g, N, 0, lane, gscale, loss_sum, theta_sum);
  } else {
    const int n2 = qr_sort_size(N2);
    qr_sort(stage, n2, N2, lane);
    __syncwarp();
    const double c = stage[(N2 - 1) / 2];  // the median target: the prefix sums' shift
    double2* S = reinterpret_cast<double2*>(stage + n2);
    qr_prefix_sums(stage, N2, c, S, lane);
    __syncwarp();
    qr_sorted_sums(stage, S, n2, N2, c, theta_row, tau_row, g, N, lane, gscale, loss_sum, theta_sum);
  }
  if constexpr (reads_head(kRows)) {  // dq = g at the taken action, the head-logit gradient from it
    float* dh = head_grad_row(P, br, b, d);
    __nv_bfloat16* low = head_grad_row_bf16(P, br, b, d);
    for (int i = lane; i < N; i += 32) buf[i] = write_head_grad_column<kRows>(dh, low, n, N, int(a), i, buf[i]);
    zero_head_padding(low, n * N, lane, 32);
  }
  __syncwarp();  // the warp's next branch reuses the stage
  return make_float3(warp_sum(loss_sum) / N2, quantile_mean(theta_sum, N), 0.f);
}

}  // namespace
}  // namespace cuda
}  // namespace dqn_ops

// act on CUDA: bf16_dueling_forward's launches up to the output layer (forward.h: the same
// GEMMs, so the same logits), then one epilogue kernel that does the rest of a step of acting
// (output bias, dueling aggregation, expected Q, per-branch argmax, epsilon-greedy), then a
// one-thread kernel that advances the call counter.
//
// Launches: the forward's up to its output layer (dueling_forward.cu: 5 for the reference config
// where the dense layer kernel takes its layers, 9 where cuBLAS's GEMMs and the bias / ReLU
// passes do) + 2. Why the counter gets a launch of its own: every block of the epilogue reads
// rng[1] (the call its draws use), so no block may advance it before all have read it. The
// alternative, the last block to finish (an atomic ticket) advancing it, needs a ticket counter
// that is zero at launch: a memset, one launch too. Stream order makes the one-thread kernel
// race-free with nothing else to reason about. (Fewer launches, e.g. 4 for N <= 1024, would
// need several layers in one launch.)
//
// The epilogue: a warp per row (grid-striding). Lane l owns atoms l, l + 32, ...: the value
// logit v (+ bias) and, branch by branch, the branch's mean advantage at its atoms, both kept
// in shared memory (read back only by the lane that wrote them: no barrier). q of action k
// at atom z is dueling.cuh's dueling_q(v, biased_logit(a, bias), mean) with the mean summed
// in action order from 0.f, exactly as head_bias_dueling_kernel forms bf16_dueling_forward's
// q_logits: the same bits. Without dueling (no value head) q is the branch head's biased
// logit, as there too, and neither v nor a mean is formed. The expected Q is then, C51,
// max-shifted softmax weights times the support, reduced over the warp (butterfly sums,
// loss/kernels.cuh's order of work), or, QR (its own instantiation), the mean of the quantiles
// (quantiles.cuh: the loss's double-DQN choice computes it so too). Either may differ from the
// CPU reference's (double precision) or torch's in the last bits, so a near-tie of two actions
// may break differently; the logits do not differ.
//
// epsilon_greedy (act's exploration alone, over greedy actions any code chose) is here too:
// one kernel, a thread per row, and the counter's launch.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "act_args.h"
#include "branch_table.cuh"
#include "call_counter.cuh"
#include "dueling.cuh"
#include "forward.h"
#include "pdl.cuh"
#include "quantiles.cuh"
#include "reductions.cuh"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

constexpr int kActWarps = 8;                      // warps per block (rows in flight per block)
constexpr int kActChunk = 4;                      // actions whose expected Q reduce together
constexpr int64_t kActSharedBytes = 48 * 1024;    // without opting in to more
constexpr int64_t kActFloatsPerAtom = 2;          // v and the branch mean, per member, per warp
constexpr int64_t kActMaxAtoms = kActSharedBytes / int64_t(kActFloatsPerAtom * sizeof(float));

struct ActParams {
  const float* logits;  // [rows, head_ld]: the output GEMMs' results, no bias (padded layout)
  const float* b_out;   // [head_out]
  const float* epsilon;
  const int64_t* rng;   // (seed, call)
  int64_t* actions;     // [rows, D]
  float* greedy_q;      // [rows, D]
  int64_t rows;
  // Where row b's slot z of an output column lies: the slots are the atoms (adjacent columns)
  // or, IQN, the K fractions (one logits row each, K rows a sample; the bias the same for all).
  int64_t row_ld;    // logits between two samples
  int64_t slot_ld;   // logits between two slots of a column
  int bias_slot;     // b_out between two slots (0: IQN's slots share the column's bias)
  int atom_cols;     // an action's output columns (L.atoms)
  int atoms;         // the slots an expected Q reads: the atoms, or IQN's K fractions
  float v_min, dz;
  float ucb;  // an ensemble's exploration bonus: score = mean + ucb * std over the members
};

// kQuantiles: QR's expected Q (the quantiles' mean); else C51's (or the one atom's q). An
// ensemble (E members, BranchTable's entries member-major): each action's score is the mean
// over the members' expected Q (in member order from member 0's Q itself, as the CPU's), plus,
// with ucb != 0, ucb times their population std (a second pass over the members); greedy_q
// is the chosen action's mean.
template <bool kQuantiles>
__global__ void __launch_bounds__(kActWarps * 32) act_epilogue_kernel(const ActParams P, const BranchTable br) {
  pdl_enter();
  extern __shared__ float shared[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int NA = P.atoms, D = br.per_member, E = br.count / br.per_member;
  float* v = shared + int64_t(warp) * kActFloatsPerAtom * E * NA;  // [E][NA], this lane's atoms only
  float* mean = v + int64_t(E) * NA;                               // [E][NA]: the branch's, per member
  const uint64_t seed = static_cast<uint64_t>(P.rng[0]), call = static_cast<uint64_t>(P.rng[1]);
  const float epsilon = P.epsilon[0];
  const int value_heads = value_heads_of(br);  // E value heads (dueling), their logits first
  const int AC = P.atom_cols;
  const int64_t value_ld = round_up_to_align(AC);
  // Action a's biased logit at slot z, from its column's logits and bias.
  auto logit_at = [&](const float* logits, const float* bias, int a, int z) {
    return biased_logit(logits[int64_t(a) * AC + z * P.slot_ld], bias[int64_t(a) * AC + z * P.bias_slot]);
  };

  for (int64_t b = int64_t(blockIdx.x) * warps + warp; b < P.rows; b += int64_t(gridDim.x) * warps) {
    const float* in = P.logits + b * P.row_ld;
    if (value_heads)
      for (int e = 0; e < E; ++e)
        for (int z = lane; z < NA; z += 32)
          v[e * NA + z] = logit_at(in + e * value_ld, P.b_out + int64_t(e) * AC, 0, z);
    // Lane 0 writes the row's actions: only it needs the draws.
    const bool explore = lane == 0 && act_explores(seed, call, static_cast<uint32_t>(b), epsilon);
    for (int d = 0; d < D; ++d) {
      const int n = br.size[d];
      if (value_heads)
        for (int e = 0; e < E; ++e) {
          const int k = e * D + d;  // member e's entry of branch d
          const float* adv = in + br.pad_col[k];
          const float* bias = P.b_out + head_col_of(br, k, value_heads, AC);
          for (int z = lane; z < NA; z += 32) {
            float sum = 0.f;
            for (int a = 0; a < n; ++a) sum += logit_at(adv, bias, a, z);
            mean[e * NA + z] = branch_mean(sum, n);
          }
        }
      // Member e's expected Q of actions k0 .. k0 + live - 1 (kActChunk at a time: their loads
      // and their reductions' shuffles are independent, in flight together); the same in
      // every lane.
      auto member_q = [&](int e, int k0, int live, float (&qv)[kActChunk]) {
        const int k = e * D + d;
        const float* adv = in + br.pad_col[k];
        const float* bias = P.b_out + head_col_of(br, k, value_heads, AC);
        auto q_at = [&](int a, int z) {
          const float x = logit_at(adv, bias, a, z);
          return value_heads ? dueling_q(v[e * NA + z], x, mean[e * NA + z]) : x;
        };
        if (NA == 1) {
#pragma unroll
          for (int j = 0; j < kActChunk; ++j)
            qv[j] = __shfl_sync(0xffffffffu, lane == 0 && j < live ? q_at(k0 + j, 0) : 0.f, 0);
        } else if constexpr (kQuantiles) {
          float s[kActChunk];
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) s[j] = 0.f;
          for (int z = lane; z < NA; z += 32)
#pragma unroll
            for (int j = 0; j < kActChunk; ++j)
              if (j < live) s[j] += q_at(k0 + j, z);
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) qv[j] = quantile_mean(s[j], NA);
        } else {
          float m[kActChunk], s[kActChunk], sz[kActChunk];
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) m[j] = -INFINITY;  // fmaxf skips a NaN q: expf(NaN - m) is NaN
          for (int z = lane; z < NA; z += 32)
#pragma unroll
            for (int j = 0; j < kActChunk; ++j)
              if (j < live) m[j] = fmaxf(m[j], q_at(k0 + j, z));
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) {
            m[j] = warp_max(m[j]);
            s[j] = sz[j] = 0.f;
          }
          for (int z = lane; z < NA; z += 32) {
            const float support = P.v_min + z * P.dz;
#pragma unroll
            for (int j = 0; j < kActChunk; ++j)
              if (j < live) {
                const float x = expf(q_at(k0 + j, z) - m[j]);
                s[j] += x;
                sz[j] = fmaf(x, support, sz[j]);
              }
          }
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) qv[j] = warp_sum(sz[j]) / warp_sum(s[j]);
        }
      };
      // The first of equal maxima; the first NaN wins (torch.argmax's rule, and the loss's
      // double-DQN choice).
      int arg = 0;
      float best = -INFINITY, best_mean = -INFINITY;
      bool nan_seen = false;
      for (int k0 = 0; k0 < n && !nan_seen; k0 += kActChunk) {
        const int live = min(kActChunk, n - k0);
        float qv[kActChunk], avg[kActChunk], score[kActChunk];
        for (int e = 0; e < E; ++e) {
          member_q(e, k0, live, qv);
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) avg[j] = e == 0 ? qv[j] : avg[j] + qv[j];
        }
#pragma unroll
        for (int j = 0; j < kActChunk; ++j) score[j] = avg[j] = E == 1 ? avg[j] : avg[j] / E;
        if (E > 1 && P.ucb != 0.f) {
          float sq[kActChunk] = {};
          for (int e = 0; e < E; ++e) {
            member_q(e, k0, live, qv);
#pragma unroll
            for (int j = 0; j < kActChunk; ++j) sq[j] = fmaf(qv[j] - avg[j], qv[j] - avg[j], sq[j]);
          }
#pragma unroll
          for (int j = 0; j < kActChunk; ++j) score[j] = fmaf(P.ucb, sqrtf(sq[j] / E), avg[j]);
        }
#pragma unroll
        for (int j = 0; j < kActChunk; ++j)
          if (j < live && !nan_seen && (score[j] > best || score[j] != score[j])) {
            best = score[j];
            best_mean = avg[j];
            arg = k0 + j;
            nan_seen = score[j] != score[j];
          }
      }
      if (lane == 0) {
        P.actions[b * D + d] = explore ? act_random_action(seed, call, static_cast<uint32_t>(b), d, n) : arg;
        P.greedy_q[b * D + d] = best_mean;
      }
    }
  }
}

std::tuple<Tensor, Tensor> act_cuda(const Tensor& states, const Tensor& params, const Tensor& params_bf16,
                                    c10::IntArrayRef layout, double v_min, double v_max, const Tensor& epsilon,
                                    Tensor& rng, c10::string_view loss_type, double ucb,
                                    const c10::optional<Tensor>& fractions) {
  const char* op = kActOp;
  const NetLayout L = parse_layout(layout, op);
  const auto [type, slots] = check_act_args(states, params, params_bf16, L, v_min, v_max, epsilon, rng,
                                            std::string(loss_type), ucb, fractions);
  DQN_CHECK(std::abs(ucb) <= std::numeric_limits<float>::max(), op, ": ucb: the CUDA kernel scores in F32, got ",
            std::to_string(ucb));
  DQN_CHECK(L.members * slots <= kActMaxAtoms, op, ": the CUDA kernel takes at most ", kActMaxAtoms,
            L.iqn() ? " fractions" : " atoms", L.members > 1 ? " over all ensemble members" : "", ", got ",
            L.members * slots);
  const BranchTable branches = make_branch_table(L, op);
  const c10::cuda::CUDAGuard guard(states.device());
  const int64_t N = states.size(0), D = L.num_branches();
  Tensor actions = at::empty({N, D}, states.options().dtype(at::kLong));
  Tensor greedy_q = at::empty({N, D}, params.options());
  if (N == 0) return {actions, greedy_q};  // no launch: rng unchanged

  // IQN: every row at the same K fractions, one logits row per (row, fraction).
  const Logits f = forward_to_logits(
      op, states, params, params_bf16, L,
      L.iqn() ? c10::optional<Tensor>(fractions->expand({N, slots}).contiguous()) : c10::nullopt);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  ActParams P;
  P.logits = f.logits.data_ptr<float>();
  P.b_out = params.data_ptr<float>() + L.b_out;
  P.epsilon = epsilon.data_ptr<float>();
  P.rng = rng.data_ptr<int64_t>();
  P.actions = actions.data_ptr<int64_t>();
  P.greedy_q = greedy_q.data_ptr<float>();
  P.rows = N;
  P.row_ld = L.head_ld * (L.iqn() ? slots : 1);
  P.slot_ld = L.iqn() ? L.head_ld : 1;
  P.bias_slot = L.iqn() ? 0 : 1;
  P.atom_cols = static_cast<int>(L.atoms);
  P.atoms = static_cast<int>(slots);
  P.v_min = static_cast<float>(v_min);
  P.dz = static_cast<float>(support_step(v_min, v_max, L.atoms));
  P.ucb = static_cast<float>(ucb);
  const int64_t floats_per_warp = kActFloatsPerAtom * L.members * slots;
  const int warps = static_cast<int>(
      std::clamp<int64_t>(kActSharedBytes / int64_t(floats_per_warp * sizeof(float)), 1, kActWarps));
  const size_t shared_bytes = size_t(warps) * floats_per_warp * sizeof(float);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((N + warps - 1) / warps, int64_t(1) << 16));
  const bool quantiles = type == LossType::kQR || type == LossType::kIQN;
  const auto epilogue = quantiles ? act_epilogue_kernel<true> : act_epilogue_kernel<false>;
  launch(epilogue, blocks, warps * 32, shared_bytes, stream, P, branches);
  advance_call(rng.data_ptr<int64_t>(), stream);
  return {actions, greedy_q};
}

// epsilon_greedy: a thread per row, explore_row over a copy of the greedy actions (act's
// draws: csrc/act_args.h); the branch sizes by value, in a BranchTable of one member.
__global__ void epsilon_greedy_kernel(const int64_t* __restrict__ greedy, int64_t rows, const float* epsilon,
                                      const int64_t* rng, const BranchTable br, int64_t* __restrict__ actions) {
  pdl_enter();
  const uint64_t seed = static_cast<uint64_t>(rng[0]), call = static_cast<uint64_t>(rng[1]);
  const float eps = *epsilon;
  const int64_t D = br.per_member;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < rows; b += int64_t(gridDim.x) * blockDim.x) {
    int64_t* out = actions + b * D;
    for (int64_t d = 0; d < D; ++d) out[d] = greedy[b * D + d];
    explore_row(seed, call, static_cast<uint32_t>(b), eps, br.size, D, out);
  }
}

static_assert(kEpsilonGreedyMaxBranches <= kMaxBranches, "epsilon_greedy's branches must fit the branch table");

Tensor epsilon_greedy_cuda(const Tensor& greedy, c10::IntArrayRef branches, const Tensor& epsilon, Tensor& rng) {
  const char* op = kEpsilonGreedyOp;
  check_epsilon_greedy_args(greedy, branches, epsilon, rng);
  const BranchTable br = make_branch_table(branches, 1, op);
  const c10::cuda::CUDAGuard guard(greedy.device());
  const int64_t N = greedy.size(0);
  Tensor actions = at::empty_like(greedy);
  if (N == 0) return actions;  // no launch: rng unchanged
  constexpr int kThreads = 128;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((N + kThreads - 1) / kThreads, int64_t(1) << 16));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  launch(epsilon_greedy_kernel, blocks, kThreads, 0, stream, greedy.data_ptr<int64_t>(), N,
         epsilon.data_ptr<float>(), rng.data_ptr<int64_t>(), br, actions.data_ptr<int64_t>());
  advance_call(rng.data_ptr<int64_t>(), stream);
  return actions;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("act", &cuda::act_cuda);
  m.impl("epsilon_greedy", &cuda::epsilon_greedy_cuda);
}

}  // namespace dqn_ops

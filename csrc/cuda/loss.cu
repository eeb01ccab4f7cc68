// dqn_loss and _dqn_loss_on_logits on CUDA: the host side (launch sizing, the op entry points).
// The kernel is in loss/kernels.cuh, built from loss/rows.cuh (how the rows are read),
// loss/projection.cuh (the C51 projection) and loss/quantile.cuh (the QR loss);
// loss/params.cuh has the parameter block.
//
// dqn_loss: one launch (and a 4-byte memset).
// C51: a warp per (sample, branch): the double-DQN choice (the expected Q of up to 4 actions
// reduced together), the projection of the target distribution onto the support, the
// cross-entropy and its gradient. Two versions of the branch, chosen at launch (two kernel
// instantiations, so each gets its own register allocation):
//   atoms <= 128 (C51's 51, CleanRL's 101; the register version): a lane owns atoms `lane` and
//     `lane + 32` (up to 64 atoms), or also `lane + 64` and `lane + 96` (up to 128, a kernel
//     instantiation of its own, so that the 64-atom one keeps its registers); every row is read
//     straight into registers, the target rows together with the online rows
//     they are chosen by (no dependent load after the argmax); the projection is a segmented
//     scan over the warp (project_by_runs), the same steps for every transition.
//   general (staged rows): the warp stages its rows in shared memory (all loads in flight at
//     once), loops over the atoms 32 at a time, and each atom gathers from the sources that can
//     reach it, found by binary search (projected_mass).
// QR (its own instantiation): a warp per (sample, branch): the double-DQN choice by the mean of
//   the online quantiles (quantiles.cuh, act's arithmetic), the target quantiles staged in the
//   warp's shared memory, then the quantile Huber sums of the taken action's quantiles (a lane
//   owns quantiles `lane`, `lane + 32`, ...): up to 32 quantiles the N^2 terms directly (the
//   staged targets read four at a time, broadcast loads), beyond in closed form over the
//   sorted targets and their prefix sums (three binary searches per quantile; the choice and
//   its instruction counts: loss/quantile.cuh). A sample that one branch poisons (a
//   non-finite target quantile, an out-of-range action) gets NaN rows in every branch after
//   the block's barrier.
// IQN: QR's kernel code in an instantiation of its own, the fractions read per sample
//   (LossParams::fractions; a fraction outside [0, 1] poisons the sample) and the three inputs'
//   own slot counts (N, K, N').
// MSE / Huber (one atom): a warp per sample, lanes over the branches.
//
// A block holds whole samples (`warps_per_sample` warps each), so the branch means and the
// per-sample TD error are summed in shared memory in branch order; each block sums its samples
// in order, and the last block to finish sums the blocks' partials in block order: the loss is
// deterministic, with no grid barrier (so no cooperative launch) and no second kernel.
//
// _dqn_loss_on_logits (the trainer's step, csrc/dqn_ops.cpp), two strategies:
//   fused (C51 with atoms <= kFusedLossMaxAtoms, or QR; at most kFusedLossMaxBranches branches
//     over an ensemble's members, masks or not): the same kernel reads the three passes' raw
//     head logits, adding the output bias and (with dueling) aggregating them as it reads them,
//     and writes d(loss)/d(head logits) itself: one launch (and the memset), the logits one trip
//     through memory (LossRows::kHeadDueling, or kHeadPlain for a network without a value
//     head). Each entry's sums for its member's value column wait in shared memory for the
//     round's barrier. QR reads a column (a quantile of every action) at a time (with at most
//     kQChunk actions a branch, kQrColumnBatch columns, their loads issued together), keeps the
//     taken action's quantiles and then their gradient in shared memory, and writes every
//     action's head-gradient column from it (loss/quantile.cuh);
//   composed (every other configuration: more branches, C51 past its atoms, MSE / Huber): the
//     public ops' kernels in sequence: the forward's bias (+ dueling aggregation) of each pass,
//     dqn_loss's kernel, mixed_backward's dueling backward (without dueling: d(head) = grad_q);
//     5 launches (and the memset).
// Both give the public ops' bits for every per-sample output (the TD errors, the gradient): the
// dueling arithmetic has one home (dueling.cuh). The loss and mean-Q scalars sum the blocks'
// partials, and which samples a block sums follows the launch's resident grid (launch_loss), so
// where the fused kernel's occupancy differs from dqn_loss's kernel's (QR's fused version runs
// at most 85 registers, dqn_loss's 64; an ensemble's shared-memory rows) and the batch takes
// more than one round of the grid, those two scalars may differ in their last bits. With a
// caller's counter (the trainer's step passes one) neither has the memset: the kernel's last
// block leaves the counter at 0 for the next launch.
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "branch_table.cuh"
#include "dueling.cuh"
#include "fused_loss_limits.h"
#include "layout.h"
#include "loss/kernels.cuh"
#include "loss/params.cuh"
#include "loss_args.h"
#include "pdl.cuh"
#include "smem_limit.h"

namespace dqn_ops {
namespace cuda {
namespace {

using at::Tensor;

// cudaOccupancyMaxActiveBlocksPerMultiprocessor for one launch shape, queried once per
// (device, kernel, block size, shared memory) and kept: the answer never changes, and the
// query costs host time on every step.
int resident_blocks_per_sm(void (*kernel)(const BranchTable, const LossParams), int threads, size_t smem) {
  using Key = std::tuple<int, const void*, int, size_t>;
  static std::mutex mutex;
  static std::map<Key, int> known;
  const Key key{static_cast<int>(c10::cuda::current_device()), reinterpret_cast<const void*>(kernel), threads, smem};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, smem));
  known.emplace(key, resident);
  return resident;
}

struct LossResults {
  Tensor loss, td_error, mean_q;
};

using Kernel = void (*)(const BranchTable, const LossParams);

// The register (c51_branch_small) version of the kernel for rows kRows: a lane owns 2 atoms up
// to kTwoSlotMaxAtoms atoms, 4 up to kDuelingMaxAtoms.
template <LossRows kRows>
Kernel register_kernel(int64_t atoms, bool in_registers) {
  if (atoms <= kTwoSlotMaxAtoms)
    return in_registers ? dqn_loss_kernel<2, kRows, true> : dqn_loss_kernel<2, kRows, false>;
  return in_registers ? dqn_loss_kernel<4, kRows, true> : dqn_loss_kernel<4, kRows, false>;
}

// Sizes the launch, allocates the scalar outputs and launches. P arrives with the inputs, the
// gradient outputs, total_actions and the loss constants set; `rows` says what its rows are
// (the fused loss's only with C51's register version, atoms <= kDuelingMaxAtoms, or QR, and at
// most kFusedLossMaxBranches entries). `counter`:
// the blocks' counter, 0 at the launch, which the kernel's last block sets back to 0
// (_dqn_loss_on_logits' caller-owned one); nullptr: one of the launch's own, zeroed by a memset.
LossResults launch_loss(const char* op, const BranchTable& br, LossParams& P, int64_t batch, int64_t atoms,
                        LossType type, LossRows rows, const at::TensorOptions& f32, unsigned* counter = nullptr) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Block shape: C51 and QR give each sample min(D, kMaxWarps) warps (warp k takes branches k,
  // k + kMaxWarps, ...) and a block as many whole samples as fit in kMaxWarps warps; MSE /
  // Huber a warp per sample.
  const bool c51 = type == LossType::kC51, iqn = type == LossType::kIQN, qr = type == LossType::kQR || iqn;
  const int warps_per_sample = c51 || qr ? static_cast<int>(std::min<int64_t>(br.count, kMaxWarps)) : 1;
  const int samples_per_block = kMaxWarps / warps_per_sample;
  const int threads = 32 * warps_per_sample * samples_per_block;
  int max_actions = 1;
  for (int d = 0; d < br.count; ++d) max_actions = std::max(max_actions, br.size[d]);
  const int warps = threads / 32;
  const bool register_version = c51 && atoms <= kDuelingMaxAtoms;
  DQN_CHECK(rows == LossRows::kQ || ((register_version || (qr && !iqn)) && br.count <= kFusedLossMaxBranches), op,
            ": the fused loss kernel takes C51 with at most ", kDuelingMaxAtoms, " atoms or QR, and at most ",
            kFusedLossMaxBranches, " branches over all members, got ", atoms, " atoms and ", br.count, " branches");
  const bool few_actions = max_actions <= kQChunk, in_registers = register_version && few_actions;
  const Kernel kernel = iqn ? dqn_loss_kernel<0, LossRows::kQ, false, true, true>
                        : qr && rows == LossRows::kHeadDueling
                            ? (few_actions ? dqn_loss_kernel<0, LossRows::kHeadDueling, true, true>
                                           : dqn_loss_kernel<0, LossRows::kHeadDueling, false, true>)
                        : qr && rows == LossRows::kHeadPlain
                            ? (few_actions ? dqn_loss_kernel<0, LossRows::kHeadPlain, true, true>
                                           : dqn_loss_kernel<0, LossRows::kHeadPlain, false, true>)
                        : qr                             ? dqn_loss_kernel<0, LossRows::kQ, false, true>
                        : !register_version              ? dqn_loss_kernel<0, LossRows::kQ, false>
                        : rows == LossRows::kHeadDueling ? register_kernel<LossRows::kHeadDueling>(atoms, in_registers)
                        : rows == LossRows::kHeadPlain   ? register_kernel<LossRows::kHeadPlain>(atoms, in_registers)
                                                         : register_kernel<LossRows::kQ>(atoms, in_registers);
  // The general version stages the rows where they fit in what the kernel may have without an
  // opt-in above 48 KiB: rows that do not fit are read from global memory instead (the same
  // results), and the launches that fit keep the shape they have always had.
  const size_t budget = dynamic_smem_limit(kernel, SmemLimit::kDefault);
  const bool staged = c51 && !register_version &&
                      size_t(warps) * c51_floats_per_warp(atoms, max_actions, true) * sizeof(float) <= budget;
  const int64_t work_floats = qr                 ? qr_floats_per_warp(atoms, P.target_atoms)
                              : !c51              ? 0
                              : register_version ? 4 * atoms
                                                 : c51_floats_per_warp(atoms, max_actions, staged);
  // The fused loss's round buffers (dqn_loss_kernel's entry_row): two sets of a row of atoms
  // floats per (sample, entry), where the value columns' sums go (with dueling) and QR's theta
  // and its gradient.
  const int64_t sum_floats = rows == LossRows::kHeadDueling || (qr && rows != LossRows::kQ) ? atoms : 0;
  const size_t smem =
      (size_t(warps) * work_floats + size_t(2) * samples_per_block * br.count * sum_floats) * sizeof(float);
  // Without staging a warp needs 3 * atoms floats (12 KiB at 8 warps and 129 atoms, 24 KiB at
  // kLossCudaMaxAtoms), QR's and IQN's at most 5,136 bytes (the sorted targets and their double
  // prefix sums at N' = kLossCudaMaxAtoms: 41,088 bytes at 8 warps): within the default budget of
  // any device these kernels build for. The fused loss's round buffers add up to 2 x
  // kFusedLossMaxBranches rows (C51: 32 KiB at 128 atoms; QR: 64 KiB at 256 quantiles): past the
  // default budget it opts in to more.
  const size_t limit = smem <= budget ? budget : dynamic_smem_limit(kernel, SmemLimit::kOptIn);
  DQN_CHECK(smem <= limit, op, ": the CUDA loss kernel needs ", smem, " bytes of shared memory for ", atoms,
            " atoms, the device allows it ", limit);
  if (smem > budget) opt_in_dynamic_smem(kernel);
  // A resident grid: as many blocks as fit on the GPU at once (the occupancy API), each looping
  // over sample groups, so the end-of-block work (the fence and ticket, the last block's check)
  // is paid once per resident block rather than once per group of samples. No grid barrier, so
  // no co-residency is needed for correctness: the last block to finish sums the partials.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int resident = resident_blocks_per_sm(kernel, threads, smem);
  const int grid = static_cast<int>(std::min<int64_t>((batch + samples_per_block - 1) / samples_per_block,
                                                      std::max(resident, 1) * sms));

  LossResults out{at::empty({}, f32), at::empty({batch}, f32), at::empty({}, f32)};
  Tensor partials = at::empty({2 * grid + (counter ? 0 : 1)}, f32);  // and the launch's own counter
  P.td_error = out.td_error.data_ptr<float>();
  P.loss = out.loss.data_ptr<float>();
  P.mean_q = out.mean_q.data_ptr<float>();
  P.partials = partials.data_ptr<float>();
  P.counter = counter;
  if (!counter) {
    P.counter = reinterpret_cast<unsigned*>(P.partials + 2 * grid);
    C10_CUDA_CHECK(cudaMemsetAsync(P.counter, 0, sizeof(unsigned), stream));
  }
  P.batch = static_cast<int>(batch);
  P.atoms = static_cast<int>(atoms);
  P.warps_per_sample = warps_per_sample;
  P.samples_per_block = samples_per_block;
  P.max_actions = max_actions;
  P.staged = staged;
  P.work_floats = static_cast<int>(work_floats);
  P.sum_floats = static_cast<int>(sum_floats);
  P.value_heads = value_heads_of(br);
  P.type = type;
  launch(kernel, grid, threads, smem, stream, br, P);
  return out;
}

// The fields both ops fill alike: the samples and the loss constants (q_rows: q's rows per
// sample, E * A; the three inputs' slots all `atoms`, which dqn_loss's IQN then overrides).
// The caller sets the logits, the gradient outputs and (the fused loss) the head fields.
LossParams loss_params(const Tensor& actions, const Tensor& rewards, const Tensor& dones,
                       const c10::optional<Tensor>& weights, const c10::optional<Tensor>& masks, int64_t q_rows,
                       int64_t atoms, LossType type, double v_min, double v_max, double gamma) {
  LossParams P{};
  P.actions = actions.data_ptr<int64_t>();
  P.rewards = rewards.data_ptr<float>();
  P.dones = dones.data_ptr<float>();
  P.weights = weights.has_value() ? weights->data_ptr<float>() : nullptr;
  P.masks = masks.has_value() ? masks->data_ptr<float>() : nullptr;
  P.total_actions = static_cast<int>(q_rows);
  P.atoms = P.next_atoms = P.target_atoms = static_cast<int>(atoms);
  P.v_min = static_cast<float>(v_min);
  P.v_max = static_cast<float>(v_max);
  P.dz = type == LossType::kC51 ? static_cast<float>((v_max - v_min) / double(atoms - 1)) : 0.f;
  P.gamma = static_cast<float>(gamma);
  return P;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> dqn_loss_cuda(const Tensor& q, const Tensor& q_next_online,
                                                         const Tensor& q_next_target, const Tensor& actions,
                                                         const Tensor& rewards, const Tensor& dones,
                                                         const c10::optional<Tensor>& weights,
                                                         c10::IntArrayRef branches, double v_min, double v_max,
                                                         double gamma, c10::string_view loss_type,
                                                         const c10::optional<Tensor>& masks,
                                                         const c10::optional<Tensor>& fractions) {
  const LossShape S = check_loss_args(q, q_next_online, q_next_target, actions, rewards, dones, weights, branches,
                                      v_min, v_max, gamma, std::string(loss_type), masks, fractions);
  check_loss_cuda_limits(kLossOp, S);
  const BranchTable br = make_branch_table(branches, S.members, kLossOp);
  // Kernels must run on the tensors' device, whichever device is current.
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor grad_q = at::empty_like(q);
  LossParams P = loss_params(actions, rewards, dones, weights, masks, S.members * S.total_actions, S.atoms, S.type,
                             v_min, v_max, gamma);
  P.q = q.data_ptr<float>();
  P.q_next_online = q_next_online.data_ptr<float>();
  P.q_next_target = q_next_target.data_ptr<float>();
  P.grad_q = grad_q.data_ptr<float>();
  P.next_atoms = static_cast<int>(S.next_atoms);
  P.target_atoms = static_cast<int>(S.target_atoms);
  P.fractions = fractions.has_value() ? fractions->data_ptr<float>() : nullptr;
  const LossResults r = launch_loss(kLossOp, br, P, S.batch, S.atoms, S.type, LossRows::kQ, q.options());
  return {r.loss, grad_q, r.td_error, r.mean_q};
}

// _dqn_loss_on_logits (csrc/dqn_ops.cpp): the fused kernel where it takes the configuration,
// else the public ops' kernels composed (see the top of this file).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> dqn_loss_on_logits_cuda(
    const Tensor& logits, const Tensor& logits_next_online, const Tensor& logits_next_target, const Tensor& params,
    const Tensor& target_params, const Tensor& actions, const Tensor& rewards, const Tensor& dones,
    const c10::optional<Tensor>& weights, c10::IntArrayRef layout, double v_min, double v_max, double gamma,
    c10::string_view loss_type, const c10::optional<Tensor>& masks, const c10::optional<Tensor>& counter) {
  const char* op = kLossOnLogitsOp;
  const NetLayout L = parse_layout(layout, op);
  const LossType type = check_loss_on_logits_args(logits, logits_next_online, logits_next_target, params,
                                                  target_params, actions, rewards, dones, weights, masks, counter, L,
                                                  v_min, v_max, gamma, std::string(loss_type));
  // int32 as torch has no uint32 arithmetic on CUDA; the kernel counts up to its grid size only
  unsigned* blocks_done = counter.has_value() ? reinterpret_cast<unsigned*>(counter->data_ptr<int32_t>()) : nullptr;
  const int64_t B = logits.size(0);
  check_loss_cuda_limits(op, B, L.q_rows(), L.atoms);
  const BranchTable br = make_branch_table(L, op);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto f32 = params.options();
  Tensor grad_head = at::empty({B, L.head_out}, f32);
  Tensor grad_head_bf16 = at::empty({B, L.head_ld}, f32.dtype(at::kBFloat16));
  const float* b_online = params.data_ptr<float>() + L.b_out;
  const float* b_target = target_params.data_ptr<float>() + L.b_out;
  LossParams P = loss_params(actions, rewards, dones, weights, masks, L.q_rows(), L.atoms, type, v_min, v_max, gamma);
  const bool fused = (type == LossType::kQR || (type == LossType::kC51 && L.atoms <= kFusedLossMaxAtoms)) &&
                     L.members * L.num_branches() <= kFusedLossMaxBranches;
  if (fused) {
    P.q = logits.data_ptr<float>();
    P.q_next_online = logits_next_online.data_ptr<float>();
    P.q_next_target = logits_next_target.data_ptr<float>();
    P.b_online = b_online;
    P.b_target = b_target;
    P.grad_head = grad_head.data_ptr<float>();
    P.grad_head_bf16 = static_cast<__nv_bfloat16*>(grad_head_bf16.data_ptr());
    P.head_ld = L.head_ld;
    P.head_out = L.head_out;
    const LossRows rows = L.dueling ? LossRows::kHeadDueling : LossRows::kHeadPlain;
    const LossResults r = launch_loss(op, br, P, B, L.atoms, type, rows, f32, blocks_done);
    return {r.loss, grad_head, grad_head_bf16, r.td_error, r.mean_q};
  }
  // Composed: q of each pass as bf16_dueling_forward forms it (not its compact head: nothing
  // here reads it), dqn_loss's kernel, then mixed_backward's dueling step from grad_q (both
  // kernels follow br.dueling: without a value head, q = the biased logits, d(head) = grad_q).
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Tensor q = at::empty({3, B, L.q_rows(), L.atoms}, f32);
  const Tensor* pass_logits[3] = {&logits, &logits_next_online, &logits_next_target};
  const float* pass_bias[3] = {b_online, b_online, b_target};
  for (int p = 0; p < 3; ++p)
    launch_head_bias_dueling(pass_logits[p]->data_ptr<float>(), pass_bias[p], nullptr, q[p].data_ptr<float>(), B,
                             L, br, stream);
  Tensor grad_q = at::empty({B, L.q_rows(), L.atoms}, f32);
  P.q = q[0].data_ptr<float>();
  P.q_next_online = q[1].data_ptr<float>();
  P.q_next_target = q[2].data_ptr<float>();
  P.grad_q = grad_q.data_ptr<float>();
  const LossResults r = launch_loss(op, br, P, B, L.atoms, type, LossRows::kQ, f32, blocks_done);
  launch_dueling_backward(grad_q.data_ptr<float>(), nullptr, grad_head.data_ptr<float>(),
                          static_cast<__nv_bfloat16*>(grad_head_bf16.data_ptr()), B, L, br, stream);
  return {r.loss, grad_head, grad_head_bf16, r.td_error, r.mean_q};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(dqn_ops, CUDA, m) {
  m.impl("dqn_loss", &cuda::dqn_loss_cuda);
  m.impl("_dqn_loss_on_logits", &cuda::dqn_loss_on_logits_cuda);
}

}  // namespace dqn_ops

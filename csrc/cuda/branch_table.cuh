// The branch sizes of the network, passed to kernels by value (kernel parameters are
// constant-cached and need no host-to-device copy, so the launch stays capturable).
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

#include "layout.h"
#include "network_args.h"

namespace dqn_ops {
namespace cuda {

constexpr int kMaxBranches = 256;  // 3 KiB of kernel parameters

// The table's "branches" are the (member, branch) pairs of an ensemble, member-major: entry
// k = e * D + d is member e's branch d (D = per_member; E = 1: the network's branches). Member
// e's value head (dueling) is head e of the output layer, its branch d's rows of q start at
// e * A + action_offsets[d], and its heads' columns follow the value heads' (NetLayout::heads'
// order), so every kernel that walks the branches walks an ensemble's members too.
struct BranchTable {
  int32_t count;       // E * D entries
  int32_t per_member;  // D: the branches of one member (a sample's actions are [D])
  // The network has a value head per member (at columns e * atoms of the compact head, e *
  // round_up_to_align(atoms) of the padded logits) and q is the dueling aggregate; else q_d =
  // the branch heads' biased logits. 0 in the branch-sizes overload (dqn_loss reads q).
  int32_t dueling;
  int32_t size[kMaxBranches];
  // Entry k's first row of q within a sample (e * A + action_offsets[d]); with dueling its head
  // logits and bias start at column atoms * (E + action_offset[k]) of the compact head, else at
  // atoms * action_offset[k] (value_heads below).
  int32_t action_offset[kMaxBranches];
  // Entry k's first column in the padded logits layout (NetLayout::branch_head(e, d).pad_col);
  // filled only by the NetLayout overload (dqn_loss's table, from branch sizes alone, has none).
  int32_t pad_col[kMaxBranches];
};

// The member of table entry k, and the value heads that precede the branch heads in the
// output layer (E with dueling, else 0).
__host__ __device__ inline int member_of(const BranchTable& t, int k) { return k / t.per_member; }
__host__ __device__ inline int value_heads_of(const BranchTable& t) { return t.dueling ? t.count / t.per_member : 0; }

// Entry k's first row among sample b's rows of q (total_actions = E * A of them).
__host__ __device__ inline int64_t q_row_of(const BranchTable& t, int64_t b, int64_t total_actions, int k) {
  return b * total_actions + t.action_offset[k];
}

// Entry k's first column of the compact head, where its output bias starts too: after the
// `value_heads` value heads (value_heads_of, or a kernel's compile-time count), `atoms` columns
// an action.
__host__ __device__ inline int64_t head_col_of(const BranchTable& t, int k, int value_heads, int64_t atoms) {
  return atoms * (value_heads + t.action_offset[k]);
}

// The action sample b took in entry k's branch: actions is [B, D], shared by the members.
__device__ __forceinline__ int64_t taken_action(const BranchTable& t, const int64_t* actions, int b, int k) {
  return actions[int64_t(b) * t.per_member + k % t.per_member];
}

// E members of branches `sizes` as table entries (dqn_loss's table: q's rows per sample are E
// times the branches' actions; no padded columns).
inline BranchTable make_branch_table(c10::IntArrayRef sizes, int64_t members, const char* op) {
  const int64_t D = static_cast<int64_t>(sizes.size());
  DQN_CHECK(members * D <= kMaxBranches, op, ": the CUDA kernels take at most ", kMaxBranches,
            " branches (over all ensemble members), got ", members, " x ", D);
  BranchTable t{};
  t.count = static_cast<int32_t>(members * D);
  t.per_member = static_cast<int32_t>(D);
  for (int64_t e = 0, k = 0, row = 0; e < members; ++e)
    for (int64_t d = 0; d < D; ++d, ++k) {
      t.size[k] = static_cast<int32_t>(sizes[d]);
      t.action_offset[k] = static_cast<int32_t>(row);
      row += sizes[d];
    }
  return t;
}

inline BranchTable make_branch_table(const NetLayout& L, const char* op) {
  BranchTable t = make_branch_table(L.branch_sizes, L.members, op);
  t.dueling = L.dueling ? 1 : 0;
  for (int64_t e = 0, k = 0; e < L.members; ++e)
    for (int64_t d = 0; d < L.num_branches(); ++d, ++k) t.pad_col[k] = static_cast<int32_t>(L.branch_head(e, d).pad_col);
  return t;
}

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? b : 65535 * 32);  // kernels grid-stride past this
}

}  // namespace cuda
}  // namespace dqn_ops

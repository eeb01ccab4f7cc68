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

struct BranchTable {
  int32_t count;
  // The network has a value head (at column 0 of the logits) and q is the dueling aggregate;
  // else q_d = the branch heads' biased logits. 0 in the branch-sizes overload (dqn_loss reads q).
  int32_t dueling;
  int32_t size[kMaxBranches];
  int32_t action_offset[kMaxBranches];
  // Branch d's first column in the padded logits layout (NetLayout::branch_head(0, d).pad_col);
  // filled only by the NetLayout overload (dqn_loss's table, from branch sizes alone, has none).
  int32_t pad_col[kMaxBranches];
};

inline BranchTable make_branch_table(const NetLayout& L, const char* op) {
  check_cuda_members(L, op);  // one member's heads: the table has no member dimension yet
  DQN_CHECK(L.num_branches() <= kMaxBranches, op, ": the CUDA kernels take at most ", kMaxBranches,
              " branches, got ", L.num_branches());
  BranchTable t{};
  t.count = static_cast<int32_t>(L.num_branches());
  t.dueling = L.dueling ? 1 : 0;
  for (int64_t d = 0; d < L.num_branches(); ++d) {
    t.size[d] = static_cast<int32_t>(L.branch_sizes[d]);
    t.action_offset[d] = static_cast<int32_t>(L.action_offsets[d]);
    t.pad_col[d] = static_cast<int32_t>(L.branch_head(0, d).pad_col);
  }
  return t;
}

inline BranchTable make_branch_table(c10::IntArrayRef sizes, const char* op) {
  DQN_CHECK(static_cast<int64_t>(sizes.size()) <= kMaxBranches, op, ": the CUDA kernels take at most ", kMaxBranches,
            " branches, got ", sizes.size());
  BranchTable t{};
  t.count = static_cast<int32_t>(sizes.size());
  int32_t offset = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    t.size[d] = static_cast<int32_t>(sizes[d]);
    t.action_offset[d] = offset;
    offset += t.size[d];
  }
  return t;
}

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? b : 65535 * 32);  // kernels grid-stride past this
}

}  // namespace cuda
}  // namespace dqn_ops

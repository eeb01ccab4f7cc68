// The network's sizes and flat-parameter offsets, decoded from the ops' `int[] layout`.
//
// dqn_ops/layout.py (ParamLayout.encode) is the one source of truth for the offsets; this
// side only decodes and validates them, so a hand-made or stale layout fails with a clear
// error instead of reading out of bounds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include "checks.h"

namespace dqn_ops {

constexpr int64_t kLayoutAlign = 8;  // elements: 16 bytes of BF16, 32 bytes of F32

C10_HOST_DEVICE inline int64_t round_up_to_align(int64_t n) {
  return (n + kLayoutAlign - 1) / kLayoutAlign * kLayoutAlign;
}

// One output head of the block-diagonal last layer: the value head (j = 0) or branch j-1.
struct HeadSlice {
  int64_t in_col;    // first column of its input in hh [B, head_hidden]
  int64_t in_width;  // VH or AH
  int64_t out_col;   // first column of its logits in head_logits [B, head_out]
  int64_t pad_col;   // first column of its logits in the padded GEMM layout [B, head_ld] (see head_ld)
  int64_t pad_width; // out_width rounded up to kLayoutAlign: its weight's rows, padding included
  int64_t out_width; // NA or n_d * NA
  int64_t w_off;     // offset of its weight [out_width, in_width] in the flat buffer
};

struct NetLayout {
  int64_t state_dim, trunk1, trunk2, value_hidden, adv_hidden, atoms;
  std::vector<int64_t> branch_sizes;    // n_d
  std::vector<int64_t> action_offsets;  // first action index of branch d
  int64_t total_actions;                // sum n_d
  int64_t head_hidden;                  // VH + D*AH
  int64_t head_out;                     // NA * (1 + total_actions)
  // The CUDA kernels keep the output layer's GEMM results in a padded layout: head j's
  // pad_width columns start at pad_col (multiples of kLayoutAlign) and rows are head_ld apart,
  // so every GEMM operand is 16-byte aligned and every GEMM size a multiple of 8 (with
  // head_out = 510, heads at columns 51, 204, ... and 51 or 153 rows, cuBLAS fell back to
  // align-1 SM75 kernels plus split-K reductions, several times slower).
  int64_t head_ld;
  int64_t w_s1, w_s2, w_h1;             // weight offsets
  std::vector<HeadSlice> heads;         // D + 1 output heads, value first
  int64_t b_s1, b_s2, b_h1, b_out;      // bias offsets
  int64_t numel;                        // length of the flat buffer

  int64_t num_branches() const { return static_cast<int64_t>(branch_sizes.size()); }

};

// Output heads that run as one (strided-batched) GEMM: head i of the group is first + i, its
// columns and weights `*_stride` elements after head i - 1's.
struct HeadGroup {
  HeadSlice first;
  int64_t count;
  int64_t in_col_stride, out_col_stride, pad_col_stride, w_stride;
};

// The value head alone, then the branch heads: one group when they have one shape and their
// weights lie an equal distance apart (ParamLayout stores them back to back), else one each.
inline std::vector<HeadGroup> head_groups(const NetLayout& L) {
  std::vector<HeadGroup> groups{{L.heads[0], 1, 0, 0, 0, 0}};
  const int64_t D = L.num_branches();
  bool uniform = D >= 2 && L.heads[2].w_off > L.heads[1].w_off;
  for (int64_t j = 2; uniform && j <= D; ++j)
    uniform = L.heads[j].out_width == L.heads[1].out_width &&
              L.heads[j].w_off - L.heads[j - 1].w_off == L.heads[2].w_off - L.heads[1].w_off;
  if (uniform) {
    const HeadSlice &a = L.heads[1], &b = L.heads[2];
    groups.push_back({a, D, b.in_col - a.in_col, b.out_col - a.out_col, b.pad_col - a.pad_col, b.w_off - a.w_off});
  } else {
    for (int64_t j = 1; j <= D; ++j) groups.push_back({L.heads[j], 1, 0, 0, 0, 0});
  }
  return groups;
}

inline NetLayout parse_layout(c10::IntArrayRef v, const char* op) {
  DQN_CHECK(v.size() >= 8, op, ": layout: expected the int[] from dqn_ops.ParamLayout.encode(), got ",
              v.size(), " entries");
  NetLayout L;
  L.state_dim = v[0];
  L.trunk1 = v[1];
  L.trunk2 = v[2];
  L.value_hidden = v[3];
  L.adv_hidden = v[4];
  L.atoms = v[5];
  const int64_t D = v[6];
  DQN_CHECK(D >= 1, op, ": layout: expected at least 1 branch, got ", D);
  const size_t expected_len = 7 + D + 3 + (D + 1) + 4 + 1;
  DQN_CHECK(v.size() == expected_len, op, ": layout: ", D, " branches need ", expected_len,
              " entries, got ", v.size());
  const char* names[] = {"state_dim", "trunk_hidden[0]", "trunk_hidden[1]", "value_hidden", "adv_hidden", "atoms"};
  for (int i = 0; i < 6; ++i) DQN_CHECK(v[i] >= 1, op, ": layout: ", names[i], " must be >= 1, got ", v[i]);
  size_t p = 7;
  L.total_actions = 0;
  for (int64_t d = 0; d < D; ++d, ++p) {
    DQN_CHECK(v[p] >= 1, op, ": layout: branch ", d, " must have >= 1 action, got ", v[p]);
    L.action_offsets.push_back(L.total_actions);
    L.branch_sizes.push_back(v[p]);
    L.total_actions += v[p];
  }
  L.head_hidden = L.value_hidden + D * L.adv_hidden;
  L.head_out = L.atoms * (1 + L.total_actions);
  L.w_s1 = v[p++];
  L.w_s2 = v[p++];
  L.w_h1 = v[p++];
  L.head_ld = 0;
  for (int64_t j = 0; j <= D; ++j) {
    HeadSlice h;
    h.in_col = j == 0 ? 0 : L.value_hidden + (j - 1) * L.adv_hidden;
    h.in_width = j == 0 ? L.value_hidden : L.adv_hidden;
    h.out_col = j == 0 ? 0 : L.atoms * (1 + L.action_offsets[j - 1]);
    h.out_width = j == 0 ? L.atoms : L.atoms * L.branch_sizes[j - 1];
    h.w_off = v[p++];
    h.pad_col = L.head_ld;
    h.pad_width = round_up_to_align(h.out_width);
    L.head_ld += h.pad_width;
    L.heads.push_back(h);
  }
  L.b_s1 = v[p++];
  L.b_s2 = v[p++];
  L.b_h1 = v[p++];
  L.b_out = v[p++];
  L.numel = v[p++];

  // Every segment aligned, inside the buffer, and disjoint from the others.
  std::vector<std::pair<int64_t, int64_t>> seg = {
      {L.w_s1, L.trunk1 * L.state_dim}, {L.w_s2, L.trunk2 * L.trunk1}, {L.w_h1, L.head_hidden * L.trunk2},
      {L.b_s1, L.trunk1},               {L.b_s2, L.trunk2},            {L.b_h1, L.head_hidden},
      {L.b_out, L.head_out}};
  // An output head's weight segment reserves rows up to a multiple of kLayoutAlign (zero
  // padding, see ParamLayout): the CUDA kernels run its GEMMs on the padded row count.
  for (const auto& h : L.heads) seg.emplace_back(h.w_off, round_up_to_align(h.out_width) * h.in_width);
  for (const auto& s : seg) {
    DQN_CHECK(s.first >= 0 && s.first % kLayoutAlign == 0, op, ": layout: segment offset ", s.first,
                " is not a non-negative multiple of ", kLayoutAlign);
    DQN_CHECK(s.first + s.second <= L.numel, op, ": layout: segment [", s.first, ", ", s.first + s.second,
                ") lies outside the buffer of ", L.numel, " elements");
  }
  std::sort(seg.begin(), seg.end());
  for (size_t i = 1; i < seg.size(); ++i)
    DQN_CHECK(seg[i - 1].first + seg[i - 1].second <= seg[i].first, op, ": layout: segments at ",
                seg[i - 1].first, " and ", seg[i].first, " overlap");
  return L;
}

}  // namespace dqn_ops

// The network's sizes and flat-parameter offsets, decoded from the ops' `int[] layout`.
//
// dqn_ops/layout.py (ParamLayout.encode) is the one source of truth for the offsets; this
// side only decodes and validates them, so a hand-made or stale layout fails with a clear
// error instead of reading out of bounds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
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

// A block of a block-diagonal layer: an output head of the last layer (in head order, see
// NetLayout::heads), or one head's part of a deeper head hidden layer. Hidden-layer blocks and
// dense layers have no padding: pad_col = out_col, pad_width = out_width.
struct HeadSlice {
  int64_t in_col;    // first column of its input in the layer's input activation
  int64_t in_width;  // columns it reads
  int64_t out_col;   // first column of its output (output heads: in head_logits [B, head_out])
  int64_t pad_col;   // output heads: first column of its logits in the padded GEMM layout [B, head_ld]
  int64_t pad_width; // output heads: out_width rounded up to kLayoutAlign: its weight's rows, padding included
  int64_t out_width; // columns it writes (output heads: NA or n_d * NA)
  int64_t w_off;     // offset of its weight [out_width (pad_width for an output head), in_width] in the flat buffer
};

// A hidden layer: out = relu(in W^T + b), in [B, in_width], out [B, out_width], both BF16 on
// CUDA. A trunk layer and the heads' merged first layer are dense (one block: every head's
// first-layer rows are adjacent in W_h1); a deeper head layer has one block per head, head k
// reading its own columns of the previous layer.
struct HiddenLayer {
  int64_t in_width = 0, out_width = 0;
  int64_t b_off = 0;              // bias [out_width]: every block's, side by side
  std::vector<HeadSlice> blocks;  // the dense layer's one block, or one per head (in head order)
};

struct NetLayout {
  int64_t state_dim, atoms;
  bool dueling;                         // a value head and the dueling aggregation; else q = a branch head's output
  int64_t members;                      // E >= 1 ensemble members on the one trunk, each a full head set
  // IQN (docs/iqn-design.md): n > 0 adds the layer phi after the trunk, and the heads run on one
  // row per (sample, fraction): z[b * N + i] = h_L[b] * relu(cos(pi k tau[b, i]) W_phi^T + b_phi).
  int64_t iqn_embedding;                // n >= 0 (0: no IQN)
  HiddenLayer phi;                      // with n > 0: in_width n, out_width T_L, one dense block
  std::vector<int64_t> branch_sizes;    // n_d
  std::vector<int64_t> action_offsets;  // first action index of branch d within a member's rows of q
  int64_t total_actions;                // A = sum n_d: one member's rows of q
  int64_t trunk_layers;                 // L >= 1: hidden[0 .. L)
  int64_t head_layers;                  // H >= 0: hidden[L .. L + H)
  std::vector<HiddenLayer> hidden;      // every hidden layer in forward order: the activations the backward reads
  int64_t head_in_width;                // the output layer's input: the last hidden layer's width
  int64_t head_out;                     // NA * E * (dueling + total_actions)
  // The CUDA kernels keep the output layer's GEMM results in a padded layout: head j's
  // pad_width columns start at pad_col (multiples of kLayoutAlign) and rows are head_ld apart,
  // so every GEMM operand is 16-byte aligned and every GEMM size a multiple of 8 (with
  // head_out = 510, heads at columns 51, 204, ... and 51 or 153 rows, cuBLAS fell back to
  // align-1 SM75 kernels plus split-K reductions, several times slower).
  int64_t head_ld;
  // The output heads in head order: the value heads of members 0..E-1 (with dueling), then
  // member 0's branch heads 0..D-1, member 1's, ... (value_head(e), branch_head(e, d)): the
  // heads of one shape lie adjacent with equal strides, so each kind forms one block group.
  // With H = 0 every head reads all of the last trunk layer (in_col 0): their inputs overlap.
  std::vector<HeadSlice> heads;
  int64_t b_out;                        // every output head's bias [head_out]
  int64_t numel;                        // length of the flat buffer

  int64_t num_branches() const { return static_cast<int64_t>(branch_sizes.size()); }
  bool iqn() const { return iqn_embedding > 0; }
  int64_t value_heads() const { return dueling ? members : 0; }
  int64_t num_heads() const { return members * ((dueling ? 1 : 0) + num_branches()); }
  // Rows of q [B, q_rows(), NA]: member e's branch d at rows e * total_actions + action_offsets[d].
  int64_t q_rows() const { return members * total_actions; }
  const HeadSlice& value_head(int64_t e) const { return heads[e]; }
  const HeadSlice& branch_head(int64_t e, int64_t d) const { return heads[value_heads() + e * num_branches() + d]; }
  // The saved activations: [states, h_1, ..., h_L, (IQN: c, phi, z,) head layer 1, ..., head layer H].
  // With IQN, c [rows * N, n], phi and z [rows * N, T_L] and the head layers lie on one row per
  // (sample, fraction); the others on one row per sample.
  static constexpr size_t kIqnActivations = 3;  // c, phi, z
  size_t num_activations() const { return hidden.size() + 1 + (iqn() ? kIqnActivations : 0); }
  // Index of hidden layer i's output in the saved activations; its input is the one before.
  size_t hidden_activation(size_t i) const {
    return i + 1 + (iqn() && static_cast<int64_t>(i) >= trunk_layers ? kIqnActivations : 0);
  }
  // The IQN activations' indices: the cosines c (phi's input), phi, and z = h_L * phi (the heads' input).
  size_t cos_activation() const { return static_cast<size_t>(trunk_layers) + 1; }
  size_t phi_activation() const { return cos_activation() + 1; }
  size_t z_activation() const { return cos_activation() + 2; }
  // Whether saved activation k is a ReLU's output (a hidden layer's or phi), by which the backward
  // masks its gradient (where it is > 0): not the states, IQN's cosines, nor z = h_L * phi.
  bool relu_output(size_t k) const { return k > 0 && !(iqn() && (k == cos_activation() || k == z_activation())); }
  // Whether saved activation k lies on one row per (sample, fraction).
  bool per_fraction(size_t k) const { return iqn() && k > static_cast<size_t>(trunk_layers); }
  // Width of saved activation k, k = 0 being the states (the saved activations' shapes).
  int64_t activation_width(size_t k) const {
    if (k == 0) return state_dim;
    if (iqn() && k > static_cast<size_t>(trunk_layers)) {
      if (k == cos_activation()) return iqn_embedding;
      if (k <= z_activation()) return phi.out_width;
      return hidden[k - 1 - kIqnActivations].out_width;
    }
    return hidden[k - 1].out_width;
  }

  // Every parameter segment of the flat buffer as (offset, length), unsorted: b_out, each hidden
  // layer's bias and block weights, each output head's weight. padded_heads: an output head's
  // weight with the rows the layout reserves up to pad_width (zero padding, see ParamLayout:
  // the CUDA forward's output GEMMs and the bf16 backward's run on the padded row count), else
  // its out_width rows only.
  std::vector<std::pair<int64_t, int64_t>> segments(bool padded_heads) const {
    std::vector<std::pair<int64_t, int64_t>> seg = {{b_out, head_out}};
    for (const HiddenLayer& h : hidden) {
      seg.emplace_back(h.b_off, h.out_width);
      for (const HeadSlice& b : h.blocks) seg.emplace_back(b.w_off, b.out_width * b.in_width);
    }
    for (const HeadSlice& h : heads) seg.emplace_back(h.w_off, (padded_heads ? h.pad_width : h.out_width) * h.in_width);
    if (iqn()) {
      seg.emplace_back(phi.b_off, phi.out_width);
      seg.emplace_back(phi.blocks[0].w_off, phi.out_width * phi.in_width);
    }
    return seg;
  }
};

// The name of hidden layer i (L.hidden[i]) in error messages: "trunk layer 2", "merged head
// layer 1" (every head's first layer, one matrix W_h1), "head layer 2".
inline std::string hidden_layer_name(const NetLayout& L, size_t i) {
  const int64_t index = static_cast<int64_t>(i);
  if (index < L.trunk_layers) return "trunk layer " + std::to_string(index + 1);
  return index == L.trunk_layers ? "merged head layer 1" : "head layer " + std::to_string(index - L.trunk_layers + 1);
}

// Blocks that run as one (strided-batched) GEMM: block i of the group is first + i, its
// columns and weights `*_stride` elements after block i - 1's.
struct HeadGroup {
  HeadSlice first;
  int64_t count;
  int64_t in_col_stride, out_col_stride, pad_col_stride, w_stride;
};

// Consecutive blocks of one shape whose columns and weights lie equal distances apart form a
// group (ParamLayout stores a layer's per-head weights back to back): the reference network's
// output layer is two groups, the value head and the branch heads (with E members: the E value
// heads, and the E * D branch heads when the branch sizes are equal). An in_col_stride of 0 means
// the group's blocks read the same input (the output heads with H = 0): a backward's dX must
// add their products up, not run them as one batch.
inline std::vector<HeadGroup> block_groups(const std::vector<HeadSlice>& blocks) {
  std::vector<HeadGroup> groups;
  for (const HeadSlice& b : blocks) {
    if (!groups.empty()) {
      HeadGroup& g = groups.back();
      const HeadSlice& f = g.first;
      const bool same_shape = b.in_width == f.in_width && b.out_width == f.out_width && b.pad_width == f.pad_width;
      const int64_t n = g.count;  // b would be block n of the group
      const int64_t in_s = b.in_col - f.in_col, out_s = b.out_col - f.out_col, pad_s = b.pad_col - f.pad_col,
                    w_s = b.w_off - f.w_off;
      const bool fits = n == 1 ? w_s > 0
                               : in_s == n * g.in_col_stride && out_s == n * g.out_col_stride &&
                                     pad_s == n * g.pad_col_stride && w_s == n * g.w_stride;
      if (same_shape && fits) {
        if (n == 1) {
          g.in_col_stride = in_s;
          g.out_col_stride = out_s;
          g.pad_col_stride = pad_s;
          g.w_stride = w_s;
        }
        ++g.count;
        continue;
      }
    }
    groups.push_back({b, 1, 0, 0, 0, 0});
  }
  return groups;
}

inline std::vector<HeadGroup> head_groups(const NetLayout& L) { return block_groups(L.heads); }

// The `int[] layout` format (dqn_ops/layout.py, ParamLayout.encode: LAYOUT_FORMAT and the order).
// kGroupViewFormat: the same entries for one head group of a network with several
// (GROUP_VIEW_FORMAT): the trunk and that group's heads at their offsets in the whole buffer,
// whose length the last entry gives; the other groups' segments are gaps to the kernels.
constexpr int64_t kLayoutFormat = 4;
constexpr int64_t kGroupViewFormat = 5;

inline NetLayout parse_layout(c10::IntArrayRef v, const char* op) {
  const size_t n = v.size();
  size_t p = 0;
  // Reads the next entry; a layout that ends early fails here, never reads past its end.
  auto next = [&](const char* what) {
    DQN_CHECK(p < n, op, ": layout: ended after ", n, " entries, before ", what,
              " (expected the int[] from dqn_ops.ParamLayout.encode())");
    return v[p++];
  };
  DQN_CHECK(n >= 1 && (v[0] == kLayoutFormat || v[0] == kGroupViewFormat), op,
            ": layout: expected the int[] from dqn_ops.ParamLayout.encode() (format ", kLayoutFormat, ", or ",
            kGroupViewFormat, " for a head group, its first entry), got ",
            n == 0 ? std::string("an empty list") : "first entry " + std::to_string(v[0]));
  ++p;
  NetLayout L;
  L.state_dim = next("state_dim");
  L.atoms = next("atoms");
  const int64_t dueling = next("dueling");
  L.members = next("the ensemble size");
  L.iqn_embedding = next("the IQN embedding size");
  const int64_t D = next("the branch count");
  DQN_CHECK(L.state_dim >= 1, op, ": layout: state_dim must be >= 1, got ", L.state_dim);
  DQN_CHECK(L.atoms >= 1, op, ": layout: atoms must be >= 1, got ", L.atoms);
  DQN_CHECK(dueling == 0 || dueling == 1, op, ": layout: dueling must be 0 or 1, got ", dueling);
  DQN_CHECK(L.members >= 1 && L.members <= static_cast<int64_t>(n), op,
            ": layout: expected at least 1 ensemble member, got ", L.members);
  DQN_CHECK(L.iqn_embedding >= 0, op, ": layout: the IQN embedding size must be >= 0, got ", L.iqn_embedding);
  DQN_CHECK(!L.iqn() || L.atoms == 1, op, ": layout: an IQN network (embedding size ", L.iqn_embedding,
            ") has 1 atom, got ", L.atoms);
  DQN_CHECK(D >= 1 && D <= static_cast<int64_t>(n), op, ": layout: expected at least 1 branch, got ", D);
  L.dueling = dueling == 1;
  L.total_actions = 0;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t size = next("a branch size");
    DQN_CHECK(size >= 1, op, ": layout: branch ", d, " must have >= 1 action, got ", size);
    L.action_offsets.push_back(L.total_actions);
    L.branch_sizes.push_back(size);
    L.total_actions += size;
  }
  L.trunk_layers = next("the trunk layer count");
  DQN_CHECK(L.trunk_layers >= 1 && L.trunk_layers <= static_cast<int64_t>(n), op,
            ": layout: expected at least 1 trunk layer, got ", L.trunk_layers);
  std::vector<int64_t> trunk;
  for (int64_t i = 0; i < L.trunk_layers; ++i) trunk.push_back(next("a trunk width"));
  L.head_layers = next("the head layer count");
  DQN_CHECK(L.head_layers >= 0 && L.head_layers <= static_cast<int64_t>(n), op,
            ": layout: expected 0 or more head layers, got ", L.head_layers);
  const int64_t heads = L.num_heads();
  // Every head has an output weight offset: more heads than entries is a malformed layout (and
  // would size the width table below past the layout's own length squared).
  DQN_CHECK(heads <= static_cast<int64_t>(n), op, ": layout: ", heads, " heads (", L.members, " members of ", dueling,
            " + ", D, ") do not fit in ", n, " entries (expected the int[] from dqn_ops.ParamLayout.encode())");
  // Encoded as the value widths V_1..V_H (dueling), then the branch widths A_1..A_H; every value
  // head has the V widths, every branch head the A widths.
  std::vector<int64_t> value_widths, branch_widths;
  for (int64_t j = 0; L.dueling && j < L.head_layers; ++j) value_widths.push_back(next("a head width"));
  for (int64_t j = 0; j < L.head_layers; ++j) branch_widths.push_back(next("a head width"));
  // widths[j][k]: head k's width in head layer j (head order).
  std::vector<std::vector<int64_t>> widths(L.head_layers, std::vector<int64_t>(heads));
  for (int64_t j = 0; j < L.head_layers; ++j)
    for (int64_t k = 0; k < heads; ++k) widths[j][k] = k < L.value_heads() ? value_widths[j] : branch_widths[j];
  for (int64_t i = 0; i < L.trunk_layers; ++i)
    DQN_CHECK(trunk[i] >= 1, op, ": layout: trunk width ", i, " must be >= 1, got ", trunk[i]);
  for (int64_t j = 0; j < L.head_layers; ++j)
    for (int64_t k = 0; k < heads; ++k)
      DQN_CHECK(widths[j][k] >= 1, op, ": layout: head ", k, "'s width in head layer ", j + 1, " must be >= 1, got ",
                widths[j][k]);

  // Hidden layers: the trunk's, the heads' merged first, the heads' block-diagonal deeper ones.
  int64_t in_width = L.state_dim;
  auto dense = [&](int64_t out_width) {
    HiddenLayer h{in_width, out_width, 0, {}};
    const int64_t w = next("a weight offset");
    h.b_off = next("a bias offset");
    h.blocks.push_back({0, in_width, 0, 0, out_width, out_width, w});
    in_width = out_width;
    return h;
  };
  for (int64_t i = 0; i < L.trunk_layers; ++i) L.hidden.push_back(dense(trunk[i]));
  const int64_t trunk_out = in_width;
  if (L.iqn()) {  // phi: n -> T_L; z = h_L * phi keeps the trunk's width, so the heads read it as h_L
    in_width = L.iqn_embedding;
    L.phi = dense(trunk_out);
  }
  for (int64_t j = 0; j < L.head_layers; ++j) {
    int64_t out_width = 0;
    for (int64_t k = 0; k < heads; ++k) out_width += widths[j][k];
    if (j == 0) {
      L.hidden.push_back(dense(out_width));
      continue;
    }
    HiddenLayer h{in_width, out_width, 0, {}};
    int64_t in_col = 0, out_col = 0;
    for (int64_t k = 0; k < heads; ++k) {
      const int64_t w = next("a weight offset");
      h.blocks.push_back({in_col, widths[j - 1][k], out_col, out_col, widths[j][k], widths[j][k], w});
      in_col += widths[j - 1][k];
      out_col += widths[j][k];
    }
    h.b_off = next("a bias offset");
    L.hidden.push_back(h);
    in_width = out_width;
  }
  L.head_in_width = in_width;

  // Output heads.
  L.head_out = L.head_ld = 0;
  int64_t in_col = 0;
  for (int64_t k = 0; k < heads; ++k) {
    HeadSlice h;
    const bool value = k < L.value_heads();
    const int64_t in = L.head_layers == 0 ? trunk_out : widths[L.head_layers - 1][k];
    h.in_col = L.head_layers == 0 ? 0 : in_col;
    h.in_width = in;
    in_col += in;
    h.out_col = L.head_out;
    h.out_width = L.atoms * (value ? 1 : L.branch_sizes[(k - L.value_heads()) % D]);
    h.pad_col = L.head_ld;
    h.pad_width = round_up_to_align(h.out_width);
    h.w_off = next("a weight offset");
    L.head_out += h.out_width;
    L.head_ld += h.pad_width;
    L.heads.push_back(h);
  }
  L.b_out = next("the output bias offset");
  L.numel = next("the buffer length");
  DQN_CHECK(p == n, op, ": layout: ", n - p, " entries past its end (", n,
            " entries; expected the int[] from dqn_ops.ParamLayout.encode())");

  // Every segment aligned, inside the buffer, and disjoint from the others. An output head's
  // weight segment reserves rows up to a multiple of kLayoutAlign (zero padding, see
  // ParamLayout): the CUDA kernels run its GEMMs on the padded row count.
  std::vector<std::pair<int64_t, int64_t>> seg = L.segments(/*padded_heads=*/true);
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

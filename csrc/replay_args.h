// The replay buffer's ops (dqn_ops/rl/replay.py): argument checks shared by the CPU and CUDA
// kernels, and the per-item arithmetic both backends run through the same functions, so that
// they sample the same indices and write the same bits for a seed.
//
// Device state of a buffer (all tensors; nothing a CUDA graph would bake in):
//   storage = [states [C, SD] F32, actions [C, D] int64, rewards [C] F32, next_states [C, SD] F32,
//              dones [C] F32]: the ring, rows [0, size) filled;
//   cursor  = int64 [2]: (the next row written, size);
//   tree    = [] (uniform) or [leaves, sums, mins, max_priority] (prioritized; TreeLayout below);
//   rng     = int64 [2]: (seed, call): sample i of call c draws philox::draw(Stream::kReplay, seed, c, i, 0);
//   counter = int32 per launch that ends in a "last block done" step (zero between calls).
//
// The prioritized structure: a sum tree of fan-out 32 over the F32 leaf priorities (p_i of row
// i, 0 for an unfilled row), its inner sums in F64, each the sum of its 32 children in order
// (a fixed-order reduction, so every rebuild of a node gives the same bits, and F32 sums of 10M
// values would lose the small priorities), beside a min tree of the positive leaves (F32: a
// min is exact; an unfilled leaf counts as +inf). 10M leaves -> 5 inner levels (312500, 9766,
// 306, 10, 1 nodes). A draw descends from the root reading 32 children per level.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/ATen.h>

#include "checks.h"
#include "philox.h"

#if defined(__CUDACC__)
#define DQN_OPS_UNROLL _Pragma("unroll")
#else
#define DQN_OPS_UNROLL
#endif

namespace dqn_ops {

constexpr const char* kReplayAddOp = "dqn_ops._replay_add";
constexpr const char* kReplayAddStepsOp = "dqn_ops._replay_add_steps";
constexpr const char* kReplaySampleOp = "dqn_ops._replay_sample";
constexpr const char* kReplayUpdateOp = "dqn_ops._replay_update_priorities";

// The ring's storage as both backends' kernels address it: [states, actions, rewards,
// next_states, dones], C rows of SD floats and D actions.
struct Storage {
  float* states;
  int64_t* actions;
  float* rewards;
  float* next_states;
  float* dones;
  int64_t C, SD, D;
};

inline Storage storage_refs(at::TensorList s) {
  return Storage{s[0].data_ptr<float>(), s[1].data_ptr<int64_t>(), s[2].data_ptr<float>(), s[3].data_ptr<float>(),
                 s[4].data_ptr<float>(), s[0].size(0), s[0].size(1), s[1].size(1)};
}

constexpr int kTreeFanLog = 5;
constexpr int kTreeFan = 1 << kTreeFanLog;
constexpr int kMaxTreeLevels = 7;  // 32^7 > 2^31 > the largest capacity
constexpr int64_t kMaxReplayCapacity = (int64_t{1} << 31) - 1;  // index_below takes n < 2^32

// Level 0: the leaves (count C, stored count[1] * 32 floats: the last node's padding is 0).
// Level l = 1..levels: count[l] = ceil(count[l-1] / 32) nodes, stored (count[l+1] * 32, or 1 at
// the root) at offset[l] of `sums` (F64) and `mins` (F32). At least one inner level: the root
// is level `levels`, one node. dqn_ops/rl/replay.py's tree_layout() is the Python twin.
struct TreeLayout {
  int levels = 0;
  int64_t count[kMaxTreeLevels + 1] = {};
  int64_t stored[kMaxTreeLevels + 1] = {};
  int64_t offset[kMaxTreeLevels + 1] = {};
  int64_t inner_total = 0;
};

inline TreeLayout tree_layout(int64_t capacity) {
  TreeLayout t;
  t.count[0] = capacity;
  int l = 0;
  do {
    ++l;
    t.count[l] = (t.count[l - 1] + kTreeFan - 1) / kTreeFan;
  } while (t.count[l] > 1);
  t.levels = l;
  for (int k = 0; k < t.levels; ++k) t.stored[k] = t.count[k + 1] * kTreeFan;
  t.stored[t.levels] = 1;
  int64_t off = 0;
  for (int k = 1; k <= t.levels; ++k) {
    t.offset[k] = off;
    off += t.stored[k];
  }
  t.inner_total = off;
  return t;
}

struct TreeRefs {
  float* leaves;
  double* sums;
  float* mins;
  float* max_priority;
  TreeLayout layout;
};

// Loads of values another block of the same kernel wrote (the last-block-done steps): through
// L2, never a stale L1 line.
DQN_OPS_HD float load_fresh(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}
DQN_OPS_HD double load_fresh(const double* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

DQN_OPS_HD float positive_or_inf(float p) { return p > 0.f ? p : std::numeric_limits<float>::infinity(); }

// Node `node` of level l >= 1 from its 32 children: the sum in order, in F64; the min of the
// positive children (leaves) or of the children's mins.
DQN_OPS_HD void recompute_node(const TreeRefs& t, int l, int64_t node) {
  double s = 0.0;
  float m = std::numeric_limits<float>::infinity();
  const int64_t first = node * kTreeFan;
  if (l == 1) {
    for (int j = 0; j < kTreeFan; ++j) {
      const float p = load_fresh(t.leaves + first + j);
      s += static_cast<double>(p);
      m = fminf(m, positive_or_inf(p));
    }
  } else {
    const int64_t base = t.layout.offset[l - 1] + first;
    for (int j = 0; j < kTreeFan; ++j) {
      s += load_fresh(t.sums + base + j);
      m = fminf(m, load_fresh(t.mins + base + j));
    }
  }
  t.sums[t.layout.offset[l] + node] = s;
  t.mins[t.layout.offset[l] + node] = m;
}

DQN_OPS_HD double tree_total(const TreeRefs& t) { return load_fresh(t.sums + t.layout.offset[t.layout.levels]); }
DQN_OPS_HD float tree_min(const TreeRefs& t) { return load_fresh(t.mins + t.layout.offset[t.layout.levels]); }

// The leaf whose prefix interval holds u (0 <= u < total): at each level, the first child j
// with c_j > 0 and u < c_0 + ... + c_j (summed in order), u then taken relative to that child.
// Where rounding leaves u at or past the node's children's sum, the last positive child; an
// all-zero node (an empty tree) gives child 0. The children are read in order, so the CPU and
// CUDA kernels descend the same way.
DQN_OPS_HD int64_t descend(const TreeRefs& t, double u) {
  int64_t node = 0;
  for (int l = t.layout.levels; l >= 1; --l) {
    const int64_t first = node * kTreeFan;
    double c[kTreeFan];
    if (l == 1) {
DQN_OPS_UNROLL
      for (int j = 0; j < kTreeFan; ++j) c[j] = static_cast<double>(load_fresh(t.leaves + first + j));
    } else {
      const int64_t base = t.layout.offset[l - 1] + first;
DQN_OPS_UNROLL
      for (int j = 0; j < kTreeFan; ++j) c[j] = load_fresh(t.sums + base + j);
    }
    double acc = 0.0, pick_base = 0.0, last_base = 0.0;
    int pick = -1, last = -1;
DQN_OPS_UNROLL
    for (int j = 0; j < kTreeFan; ++j) {
      const double next = acc + c[j];
      if (c[j] > 0.0) {
        if (pick < 0 && u < next) {
          pick = j;
          pick_base = acc;
        }
        last = j;
        last_base = acc;
      }
      acc = next;
    }
    if (pick < 0) {
      pick = last < 0 ? 0 : last;
      pick_base = last < 0 ? 0.0 : last_base;
    }
    u -= pick_base;
    if (u < 0.0) u = 0.0;
    node = first + pick;
  }
  return node < t.layout.count[0] ? node : t.layout.count[0] - 1;
}

// Stratified draw i of B (Schaul et al.): u in [i / B, (i + 1) / B) of the total, from 32 random bits.
DQN_OPS_HD double stratified_target(int64_t i, int64_t batch, uint32_t bits, double total) {
  return (static_cast<double>(i) + static_cast<double>(bits) * 0x1p-32) / static_cast<double>(batch) * total;
}

// p = (|td| + eps)^alpha, in F64, stored in F32.
DQN_OPS_HD float priority_of(float td, double eps, double alpha) {
  return static_cast<float>(pow(fabs(static_cast<double>(td)) + eps, alpha));
}

// w_i = (size P(i))^-beta / max_j (size P(j))^-beta = (p_min / p_i)^beta; 0 for a zero-priority
// (unfilled) row, which only an empty buffer can give.
DQN_OPS_HD float importance_weight(float p_min, float p, float beta) {
  if (!(p > 0.f)) return 0.f;
  return static_cast<float>(pow(static_cast<double>(p_min) / static_cast<double>(p), static_cast<double>(beta)));
}

// The n-step return of the window steps j .. len-1 of an env's ring of n steps starting at slot
// `start`: sum_k gamma^k r_{j+k}, by Horner's rule in F64 with explicit fused multiply-adds (the
// same rounding on both backends).
DQN_OPS_HD float nstep_return(const float* rewards, int64_t start, int64_t n, int64_t j, int64_t len, double gamma) {
  double r = static_cast<double>(rewards[(start + len - 1) % n]);
  for (int64_t k = len - 2; k >= j; --k) r = fma(gamma, r, static_cast<double>(rewards[(start + k) % n]));
  return static_cast<float>(r);
}

// The stored `done` of a window of m of n steps: the loss bootstraps with gamma^n (1 - done).
// Terminated: 1 (no bootstrap). A full window: 0. A window cut by a truncation after m < n
// steps bootstraps with gamma^m: done = 1 - gamma^(m - n) (negative; 1 when gamma = 0, where
// gamma^m = 0 too).
DQN_OPS_HD float nstep_done(bool terminated, int64_t m, int64_t n, double gamma) {
  if (terminated) return 1.f;
  if (m >= n) return 0.f;
  if (gamma == 0.0) return 1.f;
  double g = 1.0;
  for (int64_t k = m; k < n; ++k) g *= gamma;
  return static_cast<float>(1.0 - 1.0 / g);
}

// Rows an env emits this step: all its pending windows at an episode end, the full window
// otherwise once it holds n steps. len: the window's steps, this one included.
DQN_OPS_HD int64_t nstep_emits(bool ended, int64_t len, int64_t n) { return ended ? len : (len == n ? 1 : 0); }

// ---------------------------------------------------------------------------------------
// Checks

struct StorageDims {
  int64_t capacity, state_dim, branches;
};

inline StorageDims check_replay_storage(const char* op, at::TensorList storage, const at::Device& dev) {
  DQN_CHECK(storage.size() == 5, op, ": storage: expected 5 tensors (states, actions, rewards, next_states, dones), got ",
            storage.size());
  const at::Tensor& states = storage[0];
  check_tensor(states, op, "storage.states", dev, at::kFloat, {-1, -1});
  const int64_t C = states.size(0), SD = states.size(1);
  DQN_CHECK(C >= 1 && C <= kMaxReplayCapacity, op, ": capacity: expected 1 .. ", kMaxReplayCapacity, " rows, got ", C);
  DQN_CHECK(SD >= 1, op, ": storage.states: expected a state size >= 1, got ", SD);
  check_tensor(storage[1], op, "storage.actions", dev, at::kLong, {C, -1});
  const int64_t D = storage[1].size(1);
  DQN_CHECK(D >= 1, op, ": storage.actions: expected >= 1 branches, got ", D);
  check_tensor(storage[2], op, "storage.rewards", dev, at::kFloat, {C});
  check_tensor(storage[3], op, "storage.next_states", dev, at::kFloat, {C, SD});
  check_tensor(storage[4], op, "storage.dones", dev, at::kFloat, {C});
  return {C, SD, D};
}

inline void check_replay_cursor(const char* op, const at::Tensor& cursor, const at::Device& dev) {
  check_tensor(cursor, op, "cursor", dev, at::kLong, {2});
}

inline void check_replay_counter(const char* op, const at::Tensor& counter, const at::Device& dev, int64_t n) {
  check_tensor(counter, op, "counter", dev, at::kInt, {n});
}

// Empty: a uniform buffer. Else [leaves, sums, mins, max_priority] of tree_layout(capacity).
inline bool check_replay_tree(const char* op, at::TensorList tree, int64_t capacity, const at::Device& dev) {
  if (tree.empty()) return false;
  DQN_CHECK(tree.size() == 4, op, ": tree: expected 0 (uniform) or 4 tensors (leaves, sums, mins, max_priority), got ",
            tree.size());
  const TreeLayout t = tree_layout(capacity);
  check_tensor(tree[0], op, "tree.leaves", dev, at::kFloat, {t.stored[0]});
  check_tensor(tree[1], op, "tree.sums", dev, at::kDouble, {t.inner_total});
  check_tensor(tree[2], op, "tree.mins", dev, at::kFloat, {t.inner_total});
  check_tensor(tree[3], op, "tree.max_priority", dev, at::kFloat, {1});
  return true;
}

inline TreeRefs tree_refs(at::TensorList tree, int64_t capacity) {
  return TreeRefs{tree[0].data_ptr<float>(), tree[1].data_ptr<double>(), tree[2].data_ptr<float>(),
                  tree[3].data_ptr<float>(), tree_layout(capacity)};
}

// Written tensors (a list and single ones) must not share memory with each other nor with `read`.
inline void check_replay_overlaps(const char* op, at::TensorList written, const char* written_name,
                                  at::TensorList read, const char* read_name) {
  for (size_t i = 0; i < written.size(); ++i) {
    const std::string wi = cat(written_name, "[", static_cast<int64_t>(i), "]");
    for (size_t j = i + 1; j < written.size(); ++j) {
      const std::string wj = cat(written_name, "[", static_cast<int64_t>(j), "]");
      check_no_overlap(written[i], wi.c_str(), written[j], wj.c_str(), op);
    }
    for (size_t j = 0; j < read.size(); ++j) {
      const std::string rj = cat(read_name, "[", static_cast<int64_t>(j), "]");
      check_no_overlap(written[i], wi.c_str(), read[j], rj.c_str(), op);
    }
  }
}

// rows = [states [N, SD], actions [N, D], rewards [N], next_states [N, SD], dones [N]], 1 <= N <= C.
inline int64_t check_replay_add_args(at::TensorList storage, const at::Tensor& cursor, at::TensorList tree,
                                     const at::Tensor& counter, at::TensorList rows) {
  const char* op = kReplayAddOp;
  const at::Device dev = storage.empty() ? cursor.device() : storage[0].device();
  const StorageDims s = check_replay_storage(op, storage, dev);
  check_replay_cursor(op, cursor, dev);
  check_replay_tree(op, tree, s.capacity, dev);
  check_replay_counter(op, counter, dev, 1);
  DQN_CHECK(rows.size() == 5, op, ": rows: expected 5 tensors (states, actions, rewards, next_states, dones), got ",
            rows.size());
  check_tensor(rows[0], op, "states", dev, at::kFloat, {-1, s.state_dim});
  const int64_t N = rows[0].size(0);
  DQN_CHECK(N >= 1, op, ": states: expected at least one row, got 0");
  DQN_CHECK(N <= s.capacity, op, ": states: ", N, " rows do not fit a capacity of ", s.capacity);
  check_tensor(rows[1], op, "actions", dev, at::kLong, {N, s.branches});
  check_tensor(rows[2], op, "rewards", dev, at::kFloat, {N});
  check_tensor(rows[3], op, "next_states", dev, at::kFloat, {N, s.state_dim});
  check_tensor(rows[4], op, "dones", dev, at::kFloat, {N});
  std::vector<at::Tensor> written(storage.begin(), storage.end());
  written.push_back(cursor);
  written.insert(written.end(), tree.begin(), tree.end());
  written.push_back(counter);
  check_replay_overlaps(op, written, "state", rows, "rows");
  return N;
}

struct AddStepsDims {
  int64_t envs, n;
  bool prioritized;
};

// window = [obs [E, n, SD] F32, actions [E, n, D] int64, rewards [E, n] F32, pos [E, 2] int64
// (ring start, pending steps), emit [E + 1] int64 (scratch)]; obs, next_obs [E, SD] F32,
// actions [E, D] int64, rewards [E] F32, terminated / truncated [E] bool or F32 (nonzero = true).
inline AddStepsDims check_replay_add_steps_args(at::TensorList storage, const at::Tensor& cursor, at::TensorList tree,
                                                at::TensorList window, const at::Tensor& counter,
                                                const at::Tensor& obs, const at::Tensor& actions,
                                                const at::Tensor& rewards, const at::Tensor& next_obs,
                                                const at::Tensor& terminated, const at::Tensor& truncated,
                                                double gamma) {
  const char* op = kReplayAddStepsOp;
  const at::Device dev = storage.empty() ? cursor.device() : storage[0].device();
  const StorageDims s = check_replay_storage(op, storage, dev);
  check_replay_cursor(op, cursor, dev);
  const bool prioritized = check_replay_tree(op, tree, s.capacity, dev);
  check_replay_counter(op, counter, dev, 2);
  DQN_CHECK(window.size() == 5, op, ": window: expected 5 tensors (obs, actions, rewards, pos, emit), got ",
            window.size());
  check_tensor(window[0], op, "window.obs", dev, at::kFloat, {-1, -1, s.state_dim});
  const int64_t E = window[0].size(0), n = window[0].size(1);
  DQN_CHECK(E >= 1 && n >= 1, op, ": window.obs: expected >= 1 envs and >= 1 steps, got shape ",
            shape_str(window[0].sizes()));
  DQN_CHECK(E * n <= s.capacity, op, ": a step of ", E, " envs may emit ", E * n, " rows (n_step ", n,
            "), more than the capacity ", s.capacity);
  check_tensor(window[1], op, "window.actions", dev, at::kLong, {E, n, s.branches});
  check_tensor(window[2], op, "window.rewards", dev, at::kFloat, {E, n});
  check_tensor(window[3], op, "window.pos", dev, at::kLong, {E, 2});
  check_tensor(window[4], op, "window.emit", dev, at::kLong, {E + 1});
  check_tensor(obs, op, "obs", dev, at::kFloat, {E, s.state_dim});
  check_tensor(actions, op, "actions", dev, at::kLong, {E, s.branches});
  check_tensor(rewards, op, "rewards", dev, at::kFloat, {E});
  check_tensor(next_obs, op, "next_obs", dev, at::kFloat, {E, s.state_dim});
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{terminated, "terminated"},
                                std::pair<const at::Tensor&, const char*>{truncated, "truncated"}}) {
    check_device(t, op, name, dev);
    DQN_CHECK(t.scalar_type() == at::kBool || t.scalar_type() == at::kFloat, op, ": ", name,
              ": expected dtype Bool or Float, got ", t.scalar_type());
    check_shape(t, op, name, {E});
    check_contiguous(t, op, name);
  }
  DQN_CHECK(truncated.scalar_type() == terminated.scalar_type(), op, ": truncated: expected the dtype of terminated (",
            terminated.scalar_type(), "), got ", truncated.scalar_type());
  DQN_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": gamma: expected a value in [0, 1], got ", std::to_string(gamma));
  std::vector<at::Tensor> written(storage.begin(), storage.end());
  written.push_back(cursor);
  written.insert(written.end(), tree.begin(), tree.end());
  written.insert(written.end(), window.begin(), window.end());
  written.push_back(counter);
  check_replay_overlaps(op, written, "state", {obs, actions, rewards, next_obs, terminated, truncated}, "inputs");
  return {E, n, prioritized};
}

// out = [states [B, SD], actions [B, D], rewards [B], next_states [B, SD], dones [B], weights [B]
// F32, indices [B] int64]; beta [1] F32; rng [2] int64.
inline int64_t check_replay_sample_args(at::TensorList storage, const at::Tensor& cursor, at::TensorList tree,
                                        const at::Tensor& beta, const at::Tensor& rng, const at::Tensor& counter,
                                        at::TensorList out) {
  const char* op = kReplaySampleOp;
  const at::Device dev = storage.empty() ? cursor.device() : storage[0].device();
  const StorageDims s = check_replay_storage(op, storage, dev);
  check_replay_cursor(op, cursor, dev);
  check_replay_tree(op, tree, s.capacity, dev);
  check_tensor(beta, op, "beta", dev, at::kFloat, {1});
  check_tensor(rng, op, "rng", dev, at::kLong, {2});
  check_replay_counter(op, counter, dev, 1);
  DQN_CHECK(out.size() == 7, op,
            ": out: expected 7 tensors (states, actions, rewards, next_states, dones, weights, indices), got ",
            out.size());
  check_tensor(out[0], op, "out.states", dev, at::kFloat, {-1, s.state_dim});
  const int64_t B = out[0].size(0);
  DQN_CHECK(B >= 1 && B <= std::numeric_limits<int32_t>::max(), op, ": out.states: expected 1 .. 2^31 - 1 rows, got ",
            B);
  check_tensor(out[1], op, "out.actions", dev, at::kLong, {B, s.branches});
  check_tensor(out[2], op, "out.rewards", dev, at::kFloat, {B});
  check_tensor(out[3], op, "out.next_states", dev, at::kFloat, {B, s.state_dim});
  check_tensor(out[4], op, "out.dones", dev, at::kFloat, {B});
  check_tensor(out[5], op, "out.weights", dev, at::kFloat, {B});
  check_tensor(out[6], op, "out.indices", dev, at::kLong, {B});
  std::vector<at::Tensor> read(storage.begin(), storage.end());
  read.push_back(cursor);
  read.insert(read.end(), tree.begin(), tree.end());
  read.push_back(beta);
  read.push_back(rng);
  read.push_back(counter);
  check_replay_overlaps(op, out, "out", read, "state");
  check_no_overlap(rng, "rng", counter, "counter", op);
  return B;
}

// indices [K] int64, td_error [K] F32 (K >= 0), skipped [1] int64.
inline int64_t check_replay_update_args(at::TensorList tree, const at::Tensor& cursor, const at::Tensor& indices,
                                        const at::Tensor& td_error, const at::Tensor& skipped, double alpha,
                                        double eps) {
  const char* op = kReplayUpdateOp;
  DQN_CHECK(tree.size() == 4, op, ": tree: expected 4 tensors (leaves, sums, mins, max_priority) of a prioritized "
            "buffer, got ", tree.size());
  const at::Device dev = tree[0].device();
  check_replay_cursor(op, cursor, dev);
  check_device(tree[0], op, "tree.leaves", dev);
  check_dtype(tree[0], op, "tree.leaves", at::kFloat);
  DQN_CHECK(tree[0].dim() == 1 && tree[0].size(0) >= kTreeFan && tree[0].size(0) % kTreeFan == 0, op,
            ": tree.leaves: expected a multiple of ", kTreeFan, " elements, got shape ", shape_str(tree[0].sizes()));
  // The capacity is not an argument: any capacity whose layout stores this many leaves has the
  // same inner levels, so the largest one stands for it.
  check_replay_tree(op, tree, tree[0].size(0), dev);
  check_tensor(indices, op, "indices", dev, at::kLong, {-1});
  const int64_t K = indices.size(0);
  check_tensor(td_error, op, "td_error", dev, at::kFloat, {K});
  check_tensor(skipped, op, "skipped", dev, at::kLong, {1});
  DQN_CHECK(std::isfinite(alpha) && alpha >= 0.0, op, ": alpha: expected a finite value >= 0, got ",
            std::to_string(alpha));
  DQN_CHECK(std::isfinite(eps) && eps > 0.0, op, ": eps: expected a finite value > 0, got ", std::to_string(eps));
  std::vector<at::Tensor> written(tree.begin(), tree.end());
  written.push_back(skipped);
  check_replay_overlaps(op, written, "state", {cursor, indices, td_error}, "inputs");
  return K;
}

}  // namespace dqn_ops

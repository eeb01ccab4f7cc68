// CPU kernels of the replay ops: the reference of csrc/cuda/replay.cu. The same arithmetic
// (csrc/replay_args.h), the same order of rows and draws, so both backends store and sample
// the same bits for a seed.
#include <algorithm>
#include <cstring>
#include <vector>

#include <torch/library.h>

#include "replay_args.h"

namespace dqn_ops {
namespace {

using at::Tensor;

// Every node above the leaves [a, a + n) of the ring (wrapping at C), level by level.
void rebuild_range(const TreeRefs& t, int64_t a, int64_t n) {
  const int64_t C = t.layout.count[0];
  const int64_t ranges[2][2] = {{a, std::min(a + n, C)}, {0, std::max<int64_t>(a + n - C, 0)}};
  for (int l = 1; l <= t.layout.levels; ++l)
    for (const auto& r : ranges) {
      if (r[1] <= r[0]) continue;
      const int shift = kTreeFanLog * l;
      for (int64_t node = r[0] >> shift; node <= (r[1] - 1) >> shift; ++node) recompute_node(t, l, node);
    }
}

// Advances the cursor by n written rows.
void advance(int64_t* cursor, int64_t n, int64_t C) {
  cursor[0] = (cursor[0] + n) % C;
  cursor[1] = std::min(cursor[1] + n, C);
}

void replay_add_cpu(at::TensorList storage, Tensor& cursor, at::TensorList tree, Tensor& counter, at::TensorList rows) {
  const int64_t N = check_replay_add_args(storage, cursor, tree, counter, rows);
  const Storage s = storage_refs(storage);
  int64_t* cur = cursor.data_ptr<int64_t>();
  const int64_t w = ((cur[0] % s.C) + s.C) % s.C;  // a foreign cursor wraps, never writes out of bounds
  const float* states = rows[0].data_ptr<float>();
  const int64_t* actions = rows[1].data_ptr<int64_t>();
  const float* rewards = rows[2].data_ptr<float>();
  const float* next_states = rows[3].data_ptr<float>();
  const float* dones = rows[4].data_ptr<float>();
  for (int64_t k = 0; k < N; ++k) {
    const int64_t r = (w + k) % s.C;
    std::memcpy(s.states + r * s.SD, states + k * s.SD, s.SD * sizeof(float));
    std::memcpy(s.next_states + r * s.SD, next_states + k * s.SD, s.SD * sizeof(float));
    std::memcpy(s.actions + r * s.D, actions + k * s.D, s.D * sizeof(int64_t));
    s.rewards[r] = rewards[k];
    s.dones[r] = dones[k];
  }
  if (!tree.empty()) {
    const TreeRefs t = tree_refs(tree, s.C);
    for (int64_t k = 0; k < N; ++k) t.leaves[(w + k) % s.C] = t.max_priority[0];
    rebuild_range(t, w, N);
  }
  cur[0] = w;
  advance(cur, N, s.C);
}

bool flag_at(const Tensor& t, int64_t e) {
  return t.scalar_type() == at::kBool ? t.data_ptr<bool>()[e] : t.data_ptr<float>()[e] != 0.f;
}

void replay_add_steps_cpu(at::TensorList storage, Tensor& cursor, at::TensorList tree, at::TensorList window,
                          Tensor& counter, const Tensor& obs, const Tensor& actions, const Tensor& rewards,
                          const Tensor& next_obs, const Tensor& terminated, const Tensor& truncated, double gamma) {
  const AddStepsDims d = check_replay_add_steps_args(storage, cursor, tree, window, counter, obs, actions, rewards,
                                                     next_obs, terminated, truncated, gamma);
  const Storage s = storage_refs(storage);
  const int64_t E = d.envs, n = d.n;
  float* w_obs = window[0].data_ptr<float>();
  int64_t* w_act = window[1].data_ptr<int64_t>();
  float* w_rew = window[2].data_ptr<float>();
  int64_t* pos = window[3].data_ptr<int64_t>();
  int64_t* emit = window[4].data_ptr<int64_t>();
  const float* o = obs.data_ptr<float>();
  const int64_t* a = actions.data_ptr<int64_t>();
  const float* r = rewards.data_ptr<float>();
  const float* no = next_obs.data_ptr<float>();
  // The step into each env's window ring, and the rows it completes (CUDA: the first launch).
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = pos[2 * e], len = pos[2 * e + 1], slot = (start + len) % n;
    std::memcpy(w_obs + (e * n + slot) * s.SD, o + e * s.SD, s.SD * sizeof(float));
    std::memcpy(w_act + (e * n + slot) * s.D, a + e * s.D, s.D * sizeof(int64_t));
    w_rew[e * n + slot] = r[e];
    emit[e] = nstep_emits(flag_at(terminated, e) || flag_at(truncated, e), len + 1, n);
  }
  int64_t total = 0;  // exclusive scan in env order: each env's first row
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = emit[e];
    emit[e] = total;
    total += c;
  }
  emit[E] = total;
  // The rows, in env order, each env's longest window first (CUDA: the second launch).
  int64_t* cur = cursor.data_ptr<int64_t>();
  const int64_t w = ((cur[0] % s.C) + s.C) % s.C;
  const TreeRefs t = tree.empty() ? TreeRefs{} : tree_refs(tree, s.C);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = pos[2 * e], len = pos[2 * e + 1] + 1;
    const bool term = flag_at(terminated, e), ended = term || flag_at(truncated, e);
    const int64_t rows = emit[e + 1] - emit[e];
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = (w + emit[e] + j) % s.C, slot = (start + j) % n;
      std::memcpy(s.states + row * s.SD, w_obs + (e * n + slot) * s.SD, s.SD * sizeof(float));
      std::memcpy(s.actions + row * s.D, w_act + (e * n + slot) * s.D, s.D * sizeof(int64_t));
      std::memcpy(s.next_states + row * s.SD, no + e * s.SD, s.SD * sizeof(float));
      s.rewards[row] = nstep_return(w_rew + e * n, start, n, j, len, gamma);
      s.dones[row] = nstep_done(term, len - j, n, gamma);
      if (d.prioritized) t.leaves[row] = t.max_priority[0];
    }
    if (ended) {
      pos[2 * e] = 0;
      pos[2 * e + 1] = 0;
    } else if (len == n) {
      pos[2 * e] = (start + 1) % n;
      pos[2 * e + 1] = n - 1;
    } else {
      pos[2 * e + 1] = len;
    }
  }
  if (d.prioritized && total > 0) rebuild_range(t, w, total);
  cur[0] = w;
  advance(cur, total, s.C);
}

void replay_sample_cpu(at::TensorList storage, const Tensor& cursor, at::TensorList tree, const Tensor& beta,
                       Tensor& rng, Tensor& counter, at::TensorList out) {
  const int64_t B = check_replay_sample_args(storage, cursor, tree, beta, rng, counter, out);
  const Storage s = storage_refs(storage);
  const int64_t size = std::clamp<int64_t>(cursor.data_ptr<int64_t>()[1], 0, s.C);
  int64_t* g = rng.data_ptr<int64_t>();
  const uint64_t seed = static_cast<uint64_t>(g[0]), call = static_cast<uint64_t>(g[1]);
  float* o_states = out[0].data_ptr<float>();
  int64_t* o_actions = out[1].data_ptr<int64_t>();
  float* o_rewards = out[2].data_ptr<float>();
  float* o_next = out[3].data_ptr<float>();
  float* o_dones = out[4].data_ptr<float>();
  float* o_weights = out[5].data_ptr<float>();
  int64_t* o_indices = out[6].data_ptr<int64_t>();
  const bool prioritized = !tree.empty();
  const TreeRefs t = prioritized ? tree_refs(tree, s.C) : TreeRefs{};
  const double total = prioritized ? tree_total(t) : 0.0;
  const float p_min = prioritized ? tree_min(t) : 0.f, b = beta.data_ptr<float>()[0];
  for (int64_t i = 0; i < B; ++i) {
    const uint32_t bits = philox::draw(philox::Stream::kReplay, seed, call, static_cast<uint32_t>(i), 0);
    int64_t idx;
    float weight;
    if (prioritized) {
      idx = descend(t, stratified_target(i, B, bits, total));
      weight = importance_weight(p_min, t.leaves[idx], b);
    } else {
      idx = size > 0 ? philox::index_below(bits, static_cast<uint32_t>(size)) : 0;
      weight = size > 0 ? 1.f : 0.f;
    }
    std::memcpy(o_states + i * s.SD, s.states + idx * s.SD, s.SD * sizeof(float));
    std::memcpy(o_next + i * s.SD, s.next_states + idx * s.SD, s.SD * sizeof(float));
    std::memcpy(o_actions + i * s.D, s.actions + idx * s.D, s.D * sizeof(int64_t));
    o_rewards[i] = s.rewards[idx];
    o_dones[i] = s.dones[idx];
    o_weights[i] = weight;
    o_indices[i] = idx;
  }
  g[1] = static_cast<int64_t>(call + 1);
}

void replay_update_priorities_cpu(at::TensorList tree, const Tensor& cursor, const Tensor& indices,
                                  const Tensor& td_error, Tensor& skipped, double alpha, double eps) {
  const int64_t K = check_replay_update_args(tree, cursor, indices, td_error, skipped, alpha, eps);
  const TreeRefs t = tree_refs(tree, tree[0].size(0));
  // A foreign cursor is clamped to the leaves, as sample's is: no write past them.
  const int64_t size = std::clamp<int64_t>(cursor.data_ptr<int64_t>()[1], 0, tree[0].size(0));
  const int64_t* idx = indices.data_ptr<int64_t>();
  const float* td = td_error.data_ptr<float>();
  for (int64_t k = 0; k < K; ++k)  // every index checked before anything is written
    DQN_CHECK(idx[k] >= 0 && idx[k] < size, kReplayUpdateOp, ": indices: expected rows in [0, ", size,
              ") (the filled rows), got ", idx[k], " at position ", k);
  // Duplicates take the largest new priority (the order-free rule the CUDA kernel's atomicMax
  // gives); a non-finite td_error leaves its row as it was and is counted.
  std::vector<int64_t> touched;
  for (int64_t k = 0; k < K; ++k)
    if (std::isfinite(td[k])) t.leaves[idx[k]] = 0.f;
  float most = t.max_priority[0];
  int64_t bad = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (!std::isfinite(td[k])) {
      ++bad;
      continue;
    }
    const float p = priority_of(td[k], eps, alpha);
    t.leaves[idx[k]] = std::max(t.leaves[idx[k]], p);
    most = std::max(most, p);
    touched.push_back(idx[k]);
  }
  t.max_priority[0] = most;
  skipped.data_ptr<int64_t>()[0] += bad;
  for (int l = 1; l <= t.layout.levels; ++l) {
    std::vector<int64_t> nodes;
    for (int64_t i : touched) nodes.push_back(i >> (kTreeFanLog * l));
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    for (int64_t node : nodes) recompute_node(t, l, node);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(dqn_ops, CPU, m) {
  m.impl("_replay_add", &replay_add_cpu);
  m.impl("_replay_add_steps", &replay_add_steps_cpu);
  m.impl("_replay_sample", &replay_sample_cpu);
  m.impl("_replay_update_priorities", &replay_update_priorities_cpu);
}

}  // namespace dqn_ops

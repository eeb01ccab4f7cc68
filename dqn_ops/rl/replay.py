"""Replay on the device: a ring of transitions with uniform or proportional prioritized
sampling and n-step returns, capturable in a CUDA graph.

Everything a call depends on lives in device tensors (the write index and size, the RNG's seed
and call counter, the priorities, the n-step windows, beta), so a captured graph replays
correctly: nothing is baked in. On CUDA: ``add`` is 1 launch, ``add_steps`` 2, ``sample`` (into
preallocated ``out`` buffers, prioritized included) 1, ``update_priorities`` 1; no host syncs.
The same seed gives the same bits, and the CPU and CUDA kernels sample the same indices.

Prioritized replay (Schaul et al., 2016): row i has the priority p_i = (|td_i| + eps)^alpha
(new rows: the running max priority, which starts at 1 and only grows); a batch of B draws
P(i) = p_i / sum p, stratified (draw k takes u in [k / B, (k + 1) / B) of the total), and
importance weights w_i = (size P(i))^-beta / max_j (size P(j))^-beta = (p_min / p_i)^beta over
the stored rows. The structure: a sum tree of fan-out 32 (F32 leaves, F64 inner sums, each
node summed in a fixed order, so deterministic) beside a min tree; a draw descends in
O(log_32 N) reads (10M rows: 6 levels). Uniform: weights 1.

n-step returns (``add_steps``): each env keeps a window of its last n steps on the device. A
step completes the window's oldest transition when the window holds n steps: R = sum_k gamma^k
r_{t+k} (k < n), s' = the last step's next_obs. At a termination or truncation every pending
window of that env is written (the shorter ones too) and the env's window empties.

What ``dones`` means (read this before using n_step > 1): the trainer's loss computes the
target ``R + gamma_loss * (1 - done) * Z(s')`` with ONE scalar ``gamma_loss = gamma ** n_step``
(``TrainerConfig.gamma``; the loss uses ``done`` only through ``gamma_loss * (1 - done)``). So
a stored transition of m <= n steps has
  * ``done = 1`` if its episode terminated within its window (no bootstrap);
  * ``done = 0`` for a full window of n steps (bootstrap with gamma^n);
  * ``done = 1 - gamma^(m - n)`` (NEGATIVE) for a window of m < n steps cut by a truncation,
    so that gamma^n (1 - done) = gamma^m: it bootstraps with the discount of its own length.
``bootstrap_discount(dones)`` returns gamma^n (1 - done), the factor the loss applies. With
n_step = 1, done = terminated (a truncation bootstraps with gamma).
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

from .. import ops

FAN = 32  # the tree's fan-out (csrc/replay_args.h: kTreeFan)
MAX_CAPACITY = 2**31 - 1
BATCH_KEYS = ("states", "actions", "rewards", "next_states", "dones", "weights", "indices")


def tree_layout(capacity: int):
    """(leaves stored, inner nodes stored, levels) of the sum / min tree over `capacity` rows:
    the Python twin of csrc/replay_args.h's tree_layout (the ops check the sizes)."""
    counts = [capacity]
    while True:
        counts.append(-(-counts[-1] // FAN))
        if counts[-1] == 1:
            break
    levels = len(counts) - 1
    stored = [counts[k + 1] * FAN for k in range(levels)] + [1]
    return stored[0], sum(stored[1:]), levels


def bootstrap_discount(dones: Tensor, gamma: float, n_step: int) -> Tensor:
    """gamma^n (1 - done): the discount the loss applies to Z(s') of a stored transition
    (the module docstring says what `done` holds)."""
    return (gamma ** n_step) * (1.0 - dones)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ReplayBuffer:
    """A ring of ``capacity`` transitions on ``device``; see the module docstring.

    Args:
        capacity: rows (1 .. 2^31 - 1); the oldest are overwritten.
        state_dim, num_branches: the shape of a state and of an action (one int64 per branch).
        seed: the sampling stream's seed (Philox, csrc/philox.h).
        prioritized: proportional prioritized sampling (else uniform).
        alpha, beta, priority_eps: p = (|td| + priority_eps)^alpha; weights (p_min / p)^beta.
            beta can change between calls (``set_beta``: a device write, no recapture).
        n_step, gamma: the returns ``add_steps`` writes (``add`` takes complete transitions).
        num_envs: the envs of one ``add_steps`` call (required for it).
    """

    def __init__(self, capacity: int, state_dim: int, num_branches: int, device="cpu", seed: int = 0, *,
                 prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4, priority_eps: float = 1e-6,
                 n_step: int = 1, gamma: float = 0.99, num_envs: Optional[int] = None):
        name = "ReplayBuffer"
        if not _is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"{name}: capacity must be an int in [1, {MAX_CAPACITY}], got {capacity!r}")
        for arg, v in (("state_dim", state_dim), ("num_branches", num_branches), ("n_step", n_step)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}: {arg} must be an int >= 1, got {v!r}")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"{name}: alpha must be finite and >= 0, got {alpha!r}")
        self._check_beta(beta, name)
        if not (isinstance(priority_eps, (int, float)) and math.isfinite(priority_eps) and priority_eps > 0):
            raise ValueError(f"{name}: priority_eps must be finite and > 0, got {priority_eps!r}")
        if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
            raise ValueError(f"{name}: gamma must lie in [0, 1], got {gamma!r}")
        if n_step > 1 and 0.0 < gamma and gamma ** (n_step - 1) < 2.0 ** -100:
            # a truncated window stores done = 1 - gamma^-(n - m) (the module docstring), in F32
            raise ValueError(f"{name}: gamma ** (n_step - 1) = {gamma ** (n_step - 1):.3g} is too small: a window cut "
                             f"short stores 1 - gamma^-(n - m) in float32, which overflows; use a larger gamma or a "
                             f"smaller n_step")
        if not _is_int(seed) or not -(1 << 63) <= seed < (1 << 64):
            raise ValueError(f"{name}: seed must be an int in [-2^63, 2^64) (the Philox key's 64 bits), got {seed!r}")
        if num_envs is not None:
            if not _is_int(num_envs) or num_envs < 1:
                raise ValueError(f"{name}: num_envs must be an int >= 1 or None, got {num_envs!r}")
            if num_envs * n_step > capacity:
                raise ValueError(f"{name}: a step of {num_envs} envs may write {num_envs * n_step} rows (n_step "
                                 f"{n_step}), more than the capacity {capacity}")
        dev = torch.device(device)
        self.capacity, self.state_dim, self.num_branches = capacity, state_dim, num_branches
        self.prioritized, self.alpha, self.priority_eps = bool(prioritized), float(alpha), float(priority_eps)
        self.n_step, self.gamma, self.num_envs = n_step, float(gamma), num_envs
        self.states = torch.zeros(capacity, state_dim, device=dev)
        self.device = self.states.device  # "cuda" -> "cuda:0": the device tensors report, for the checks below
        self.actions = torch.zeros(capacity, num_branches, dtype=torch.long, device=dev)
        self.rewards = torch.zeros(capacity, device=dev)
        self.next_states = torch.zeros(capacity, state_dim, device=dev)
        self.dones = torch.zeros(capacity, device=dev)
        self._storage = [self.states, self.actions, self.rewards, self.next_states, self.dones]
        self.cursor = torch.zeros(2, dtype=torch.long, device=dev)  # (next row written, size)
        self.rng = ops.philox_rng(seed, dev)
        self.beta = torch.full((1,), float(beta), device=dev)
        self._counters = torch.zeros(4, dtype=torch.int32, device=dev)  # last-block-done tickets: add, steps (2), sample
        self.skipped_priority_updates = torch.zeros(1, dtype=torch.long, device=dev)
        if self.prioritized:
            leaves, inner, self.tree_levels = tree_layout(capacity)
            self.leaves = torch.zeros(leaves, device=dev)
            self.sums = torch.zeros(inner, dtype=torch.float64, device=dev)
            self.mins = torch.full((inner,), math.inf, device=dev)
            self.max_priority = torch.ones(1, device=dev)
            self._tree = [self.leaves, self.sums, self.mins, self.max_priority]
        else:
            self._tree = []
        if num_envs is not None:
            E = num_envs
            self._window = [torch.zeros(E, n_step, state_dim, device=dev),
                            torch.zeros(E, n_step, num_branches, dtype=torch.long, device=dev),
                            torch.zeros(E, n_step, device=dev), torch.zeros(E, 2, dtype=torch.long, device=dev),
                            torch.zeros(E + 1, dtype=torch.long, device=dev)]
        self._rows_added = 0  # host-known: rows add() wrote
        self._steps_added = 0  # add_steps() calls (how many rows they wrote is on the device)

    # -- host-side views (each a device read: for tests and logging, not for a hot loop) ----
    @property
    def size(self) -> int:
        """The filled rows (reads the device)."""
        return int(self.cursor[1].item())

    @property
    def rows_at_least(self) -> int:
        """A lower bound on the filled rows from the host's own count of what was added (no
        device read): add()'s rows, and add_steps()' calls less the n - 1 steps each env's
        pending window may hold. Calls captured in a CUDA graph and replayed are not counted."""
        pending = max(0, self._steps_added - (self.n_step - 1))
        return min(self.capacity, self._rows_added + (self.num_envs or 1) * pending)

    @property
    def next(self) -> int:
        """The next row written (reads the device)."""
        return int(self.cursor[0].item())

    @property
    def priorities(self) -> Tensor:
        """The stored priorities p_i of every row (0 for an unfilled row); prioritized only."""
        self._need_prioritized("priorities")
        return self.leaves[:self.capacity]

    @property
    def gamma_loss(self) -> float:
        """gamma ** n_step: the discount the trainer's loss must use for add_steps' transitions."""
        return self.gamma ** self.n_step

    def bootstrap_discount(self, dones: Tensor) -> Tensor:
        """gamma^n (1 - done) for stored dones (the module docstring says why done can be negative)."""
        return bootstrap_discount(dones, self.gamma, self.n_step)

    @staticmethod
    def _check_beta(beta, where):
        if isinstance(beta, bool) or not (isinstance(beta, numbers.Real) and 0.0 <= beta <= 1.0):
            raise ValueError(f"{where}: beta must lie in [0, 1], got {beta!r}")

    def set_beta(self, beta: float):
        """The importance-sampling exponent from the next sample on (a device write: graph-safe)."""
        self._need_prioritized("set_beta")  # a uniform buffer's weights are 1 whatever beta is
        self._check_beta(beta, "ReplayBuffer.set_beta")
        self.beta.fill_(float(beta))

    def _need_prioritized(self, what):
        if not self.prioritized:
            raise ValueError(f"ReplayBuffer.{what}: the buffer is uniform (construct it with prioritized=True)")

    def _check_inputs(self, where: str, given, expected):
        for name, (shape, dtypes) in expected.items():
            t = given[name]
            if not isinstance(t, Tensor):
                raise ValueError(f"ReplayBuffer.{where}: {name}: expected a tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != self.device:
                want = " or ".join(str(d) for d in dtypes)
                raise ValueError(f"ReplayBuffer.{where}: {name}: expected {want} {list(shape)} on {self.device}, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}")

    # -- writing --------------------------------------------------------------------------
    def add(self, states: Tensor, actions: Tensor, rewards: Tensor, next_states: Tensor, dones: Tensor):
        """N complete transitions (one-step, or n-step already: dones as the module docstring
        says) at the write index, wrapping; prioritized: at the running max priority."""
        n = states.shape[0] if isinstance(states, Tensor) and states.dim() >= 1 else 0
        SD, D, f32 = self.state_dim, self.num_branches, (torch.float32,)
        self._check_inputs("add", dict(states=states, actions=actions, rewards=rewards, next_states=next_states,
                                       dones=dones),
                           dict(states=((n, SD), f32), next_states=((n, SD), f32), actions=((n, D), (torch.long,)),
                                rewards=((n,), f32), dones=((n,), f32)))
        if n == 0:
            raise ValueError("ReplayBuffer.add: expected at least one transition, got 0")
        if n > self.capacity:
            raise ValueError(f"ReplayBuffer.add: {n} transitions do not fit a capacity of {self.capacity}")
        ops._replay_add(self._storage, self.cursor, self._tree, self._counters[0:1],
                        [t.contiguous() for t in (states, actions, rewards, next_states, dones)])
        self._rows_added += n

    def add_steps(self, obs: Tensor, actions: Tensor, rewards: Tensor, next_obs: Tensor, terminated: Tensor,
                  truncated: Tensor):
        """One environment step of the ``num_envs`` envs: obs, next_obs [E, SD] float32, actions
        [E, D] int64, rewards [E] float32, terminated / truncated [E] bool (or float32, nonzero
        = true). Writes the n-step transitions this step completes (module docstring)."""
        if self.num_envs is None:
            raise ValueError("ReplayBuffer.add_steps: needs num_envs at construction (the envs of one step)")
        E, SD, D, f32 = self.num_envs, self.state_dim, self.num_branches, (torch.float32,)
        flags = (torch.bool, torch.float32)
        self._check_inputs("add_steps", dict(obs=obs, actions=actions, rewards=rewards, next_obs=next_obs,
                                             terminated=terminated, truncated=truncated),
                           dict(obs=((E, SD), f32), actions=((E, D), (torch.long,)), rewards=((E,), f32),
                                next_obs=((E, SD), f32), terminated=((E,), flags), truncated=((E,), flags)))
        if terminated.dtype != truncated.dtype:
            raise ValueError(f"ReplayBuffer.add_steps: terminated and truncated must have one dtype, got "
                             f"{terminated.dtype} and {truncated.dtype}")
        ops._replay_add_steps(self._storage, self.cursor, self._tree, self._window, self._counters[1:3],
                              *(t.contiguous() for t in (obs, actions, rewards, next_obs, terminated, truncated)),
                              self.gamma)
        self._steps_added += 1

    # -- reading --------------------------------------------------------------------------
    def sample(self, batch_size: int, out: Optional[Mapping[str, Tensor]] = None) -> Dict[str, Tensor]:
        """batch_size draws -> dict(states, actions, rewards, next_states, dones, weights, indices).

        With ``out`` (preallocated tensors under those keys, e.g. a Trainer's ``inputs`` plus an
        int64 ``indices`` [B]) the rows are gathered straight into them (the graphed loop's way
        of feeding the trainer). Raises when nothing was ever added (a host-known fact); a
        buffer whose add_steps calls have not completed a transition yet (known on the device
        only) gives row 0 with weight 0."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"ReplayBuffer.sample: batch_size must be an int >= 1, got {batch_size!r}")
        if self._rows_added == 0 and self._steps_added == 0:
            raise RuntimeError("ReplayBuffer.sample: the buffer is empty (nothing was added)")
        B, dev = batch_size, self.device
        if out is None:
            out = dict(states=torch.empty(B, self.state_dim, device=dev),
                       actions=torch.empty(B, self.num_branches, dtype=torch.long, device=dev),
                       rewards=torch.empty(B, device=dev), next_states=torch.empty(B, self.state_dim, device=dev),
                       dones=torch.empty(B, device=dev), weights=torch.empty(B, device=dev),
                       indices=torch.empty(B, dtype=torch.long, device=dev))
        else:
            missing = [k for k in BATCH_KEYS if k not in out]
            if missing:
                raise ValueError(f"ReplayBuffer.sample: out is missing {missing}; it needs {list(BATCH_KEYS)}")
            for k in BATCH_KEYS:  # the op checks shapes and dtypes; a tensor of another device would not reach it
                if not isinstance(out[k], Tensor) or out[k].device != dev:
                    got = f"one on {out[k].device}" if isinstance(out[k], Tensor) else type(out[k]).__name__
                    raise ValueError(f"ReplayBuffer.sample: out[{k!r}]: expected a tensor on {dev}, got {got}")
            if out["states"].dim() != 2 or out["states"].shape[0] != B:
                raise ValueError(f"ReplayBuffer.sample: out['states']: expected {B} rows (batch_size), got shape "
                                 f"{list(out['states'].shape)}")
        ops._replay_sample(self._storage, self.cursor, self._tree, self.beta, self.rng, self._counters[3:4],
                           [out[k] for k in BATCH_KEYS])
        return {k: out[k] for k in BATCH_KEYS}

    def update_priorities(self, indices: Tensor, td_error: Tensor):
        """p = (|td_error| + priority_eps)^alpha for the sampled rows (indices int64 [K], td_error
        float32 [K]). A row given twice takes the largest. The running max priority (that of new
        rows) grows to the largest p. A non-finite td_error (a step the optimizer skipped) leaves
        its row unchanged and adds 1 to ``skipped_priority_updates`` (a device counter). An index
        outside the filled rows raises on the CPU; on CUDA (no host sync can report it) it is
        skipped and counted in the same counter."""
        self._need_prioritized("update_priorities")
        for name, t in (("indices", indices), ("td_error", td_error)):
            if not isinstance(t, Tensor) or t.device != self.device:
                got = f"one on {t.device}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"ReplayBuffer.update_priorities: {name}: expected a tensor on {self.device}, got {got}")
        ops._replay_update_priorities(self._tree, self.cursor, indices, td_error, self.skipped_priority_updates,
                                      self.alpha, self.priority_eps)

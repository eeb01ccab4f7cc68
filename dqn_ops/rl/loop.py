"""The whole training loop on the device: act -> env.step -> replay.add_steps -> (every
``train_every`` environment steps) sample -> training step -> priority update, with
``iterations_per_graph`` iterations captured in one CUDA graph and replayed without host syncs.

Every piece keeps its state in device tensors that the graph reads and advances: the acting
RNG (``Trainer.act_explore``), the environment's clock and RNG (``FuturesTradingEnv``), the
replay's write index, size and RNG (``ReplayBuffer``), the exploration rate and the
importance-sampling exponent (linear schedules evaluated on the device from an iteration
counter), and the trainer's optimizer state. So one replay of the graph runs the next K
iterations, and the host only launches it and does the readback's bookkeeping (deferred, as
``Trainer.step`` does it). The same loop runs eagerly (CPU, or ``use_cuda_graph=False``) with
the same arithmetic: on CUDA the graphed and the eager loop give the same parameters, bit for bit.

What a checkpoint holds: ``Trainer.state_dict`` (the networks, the optimizer, the acting RNG);
the loop's schedules, the replay's contents and the env's markets are not saved, so a resumed
run starts them afresh. Loading a trainer checkpoint is noticed (the graph is captured again).

    trainer = Trainer(DQNConfig(state_dim=STATE_DIM, branches=BRANCHES), TrainerConfig(readback_interval=300))
    env = FuturesTradingEnv(32, device="cuda", seed=1)
    replay = ReplayBuffer(200_000, STATE_DIM, len(BRANCHES), device="cuda", seed=2, num_envs=32)
    loop = TrainingLoop(trainer, env, replay, LoopConfig(iterations_per_graph=300))
    loop.prefill(32)     # random play, no training
    loop.run(3000)       # one eager warm-up of the 300 iterations, the capture (replayed), 8 more replays
    trainer.readback()

Environments with host-side state (Gymnasium vector envs on the CPU) cannot be captured: drive
``Trainer.act_explore``, the replay and ``Trainer.step`` from a Python loop instead (the
eager path in ``dqn_ops.rl.envs``'s docstring).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..graphed import CapturedStep
from ..layout import check_bool, check_float, check_int


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How the loop runs. Schedules are linear in the loop's iteration count and evaluated on
    the device: epsilon from ``epsilon_start`` to ``epsilon_end`` over
    ``epsilon_decay_iterations``; a prioritized replay's beta from its value at construction to
    ``beta_end`` over ``beta_anneal_iterations`` (0: beta stays)."""

    iterations_per_graph: int = 300   # K: environment steps per CUDA-graph replay
    train_every: int = 1              # environment steps per training step (K must be a multiple)
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    epsilon_decay_iterations: int = 10_000
    beta_end: float = 1.0
    beta_anneal_iterations: int = 0
    use_cuda_graph: bool = True
    warmup_chunks: int = 1            # eager runs of the K iterations before the capture (cuBLAS, the allocator)

    def __post_init__(self):
        """Checks every field once (the config is frozen: a later edit cannot skip the checks)."""
        n = "LoopConfig"
        for field, minimum in (("iterations_per_graph", 1), ("train_every", 1), ("epsilon_decay_iterations", 1),
                               ("beta_anneal_iterations", 0), ("warmup_chunks", 1)):
            object.__setattr__(self, field, check_int(n, field, getattr(self, field), minimum=minimum))
        if self.iterations_per_graph % self.train_every:
            raise ValueError(f"{n}: iterations_per_graph ({self.iterations_per_graph}) must be a multiple of "
                             f"train_every ({self.train_every}): every replay trains the same number of times")
        for field in ("epsilon_start", "epsilon_end", "beta_end"):
            object.__setattr__(self, field, check_float(n, field, getattr(self, field), low=0.0, high=1.0))
        check_bool(n, "use_cuda_graph", self.use_cuda_graph)


class TrainingLoop:
    """Runs a ``Trainer`` on an environment and a replay buffer of its device (see the module
    docstring). ``prefill(n)`` plays n random steps (epsilon 1, no training) into the replay;
    ``run(n)`` runs n iterations: whole replays of the captured K iterations on CUDA (after
    ``warmup_chunks`` eager runs of them the first time), the rest eagerly. The replay must hold a
    batch before the first training iteration (prefill).

    Device tensors a caller may read (no sync until it does): ``epsilon`` (this iteration's
    exploration rate), ``greedy_q`` (the expected Q of the greedy actions, per env and branch),
    ``obs`` (the observations the next iteration acts on). The constructor resets the env.

    The trainer's gamma must discount what the replay stores: ``gamma ** n_step`` of the
    replay's per-step gamma (``replay.gamma_loss``), checked for n_step > 1."""

    def __init__(self, trainer, env, replay, config: Optional[LoopConfig] = None):
        self.trainer, self.env, self.replay = trainer, env, replay
        self.config = cfg = config or LoopConfig()
        dev = _as_tensors_report(trainer.device)  # "cuda" -> "cuda:0"
        for name, thing in (("env", env), ("replay", replay)):
            if _as_tensors_report(thing.device) != dev:
                raise ValueError(f"TrainingLoop: the {name} is on {thing.device}, the trainer on {dev}: "
                                 f"everything the loop drives must live on one device")
        if getattr(replay, "num_envs", None) != env.num_envs:
            raise ValueError(f"TrainingLoop: the replay collects for {getattr(replay, 'num_envs', None)} envs "
                             f"(ReplayBuffer(num_envs=...)), the env has {env.num_envs}")
        net = trainer.net_config
        if env.state_dim != net.state_dim or tuple(env.branches) != tuple(net.branches):
            raise ValueError(f"TrainingLoop: the env's observations ({env.state_dim}) and branches "
                             f"{tuple(env.branches)} do not fit the network's ({net.state_dim}, {tuple(net.branches)})")
        stored = (getattr(replay, "state_dim", net.state_dim), getattr(replay, "num_branches", net.num_branches))
        if stored != (net.state_dim, net.num_branches):
            raise ValueError(f"TrainingLoop: the replay stores states of {stored[0]} and actions of {stored[1]} "
                             f"branch(es), the network takes {net.state_dim} and {net.num_branches}")
        n_step = getattr(replay, "n_step", 1)
        if n_step > 1 and not math.isclose(trainer.config.gamma, replay.gamma_loss, rel_tol=1e-9):
            raise ValueError(f"TrainingLoop: the replay stores {n_step}-step returns discounted by gamma "
                             f"{replay.gamma}, so the trainer must bootstrap with gamma ** {n_step} = "
                             f"{replay.gamma_loss}, got TrainerConfig.gamma={trainer.config.gamma}")
        if cfg.beta_anneal_iterations and not getattr(replay, "prioritized", False):
            raise ValueError("TrainingLoop: LoopConfig.beta_anneal_iterations anneals a prioritized replay's beta; "
                             "this replay is uniform")
        self.trains_per_graph = cfg.iterations_per_graph // cfg.train_every
        if cfg.use_cuda_graph and dev.type == "cuda" and trainer.config.readback_interval < self.trains_per_graph:
            raise ValueError(f"TrainingLoop: a graph replay runs {self.trains_per_graph} training steps, more than "
                             f"the trainer's readback ring holds (TrainerConfig.readback_interval="
                             f"{trainer.config.readback_interval}); make readback_interval >= {self.trains_per_graph}")
        self.device = dev
        B = trainer.config.batch_size
        with trainer._on_device():
            self.obs = env.reset().clone()
            self.schedule_step = torch.zeros(1, dtype=torch.float64, device=dev)  # exact up to 2^53 iterations
            self.epsilon = torch.full((1,), cfg.epsilon_start, device=dev)
            self.greedy_q = torch.zeros(env.num_envs, net.num_branches, device=dev)
            self._random = torch.ones(1, device=dev)  # epsilon of prefill
            # the trainer's own buffer when it reads the rows (an ensemble's bootstrap masks)
            self.indices = trainer.inputs.get("indices")
            if self.indices is None:
                self.indices = torch.zeros(B, dtype=torch.long, device=dev)
        self._sample_out = dict(trainer.inputs, indices=self.indices)
        self._beta_start = float(replay.beta) if getattr(replay, "prioritized", False) else None
        self.iterations = 0  # iterations run (a host count; the schedules read self.schedule_step)
        # the K iterations, captured after warmup_chunks eager runs on the capture stream
        self._runner = CapturedStep(self._chunk, dev, cfg.use_cuda_graph, cfg.warmup_chunks, owner_holds_step=True)
        self._captured_generation = getattr(trainer, "state_generation", 0)
        self._replay_ready = False  # the replay held a batch at some run() (it never shrinks)

    # -- one iteration, on the device --------------------------------------------------
    def _schedules(self):
        cfg = self.config
        _linear(self.schedule_step, cfg.epsilon_start, cfg.epsilon_end, cfg.epsilon_decay_iterations, self.epsilon)
        if self._beta_start is not None and cfg.beta_anneal_iterations:
            _linear(self.schedule_step, self._beta_start, cfg.beta_end, cfg.beta_anneal_iterations, self.replay.beta)
        self.schedule_step.add_(1)

    def _iteration(self, train: bool, epsilon: Optional[Tensor] = None):
        with torch.no_grad():
            if epsilon is None:
                self._schedules()
                epsilon = self.epsilon
            actions, greedy_q = self.trainer.act_explore(self.obs, epsilon)
            self.greedy_q.copy_(greedy_q)
            step = self.env.step(actions)
            self.replay.add_steps(self.obs, actions, step.reward, step.next_obs, step.terminated, step.truncated)
            self.obs.copy_(step.obs)
            if train:
                self.replay.sample(self.trainer.config.batch_size, out=self._sample_out)
        if train:
            self.trainer.device_step()  # a plain-PyTorch learner's step runs autograd
            if getattr(self.replay, "prioritized", False):
                with torch.no_grad():
                    self.replay.update_priorities(self.indices, self.trainer.td_error)

    def _chunk(self):
        """K iterations from a multiple of train_every: the pattern every replay repeats."""
        every = self.config.train_every
        for i in range(self.config.iterations_per_graph):
            self._iteration(train=(i + 1) % every == 0)

    def _eager(self, iterations: int):
        """Iterations one by one, each training step with its own readback bookkeeping; whether
        an iteration trains follows the loop's count, however run() is called."""
        every = self.config.train_every
        for _ in range(iterations):
            train = (self.iterations + 1) % every == 0
            if train:
                self.trainer.before_steps(1)
            self._iteration(train)
            self.iterations += 1
            if train:
                self.trainer.after_steps(1)

    # -- on the host ----------------------------------------------------------------------
    def prefill(self, iterations: int):
        """Plays `iterations` environment steps with random actions (epsilon 1) into the replay,
        without training or advancing the schedules."""
        iterations = check_int("TrainingLoop.prefill", "iterations", iterations, minimum=0)
        with self.trainer._on_device():
            for _ in range(iterations):
                self._iteration(train=False, epsilon=self._random)

    def run(self, iterations: int):
        """Runs `iterations` iterations. Graphed (CUDA, ``use_cuda_graph``): up to the next
        multiple of train_every eagerly, then whole replays of the K captured iterations, then
        the rest eagerly. Otherwise all eagerly. The same iterations either way."""
        iterations = check_int("TrainingLoop.run", "iterations", iterations, minimum=0)
        if iterations and not self._replay_holds_a_batch():
            raise ValueError(f"TrainingLoop.run: the replay holds {self.replay.size} rows, fewer than a batch "
                             f"({self.trainer.config.batch_size}): prefill(n) it first (sampling unfilled rows "
                             f"would train on them)")
        K, every = self.config.iterations_per_graph, self.config.train_every
        with self.trainer._on_device():
            if not self._runner.use_graph:
                self._eager(iterations)
                return
            lead = min(iterations, -self.iterations % every)  # a replay starts in the train_every pattern
            self._eager(lead)
            left = iterations - lead
            while left >= K:
                self._run_chunk()
                left -= K
            self._eager(left)

    def _replay_holds_a_batch(self) -> bool:
        """Whether the replay holds a batch: from the host's count (``rows_at_least``) while it
        proves it, else from the device (a read, so a sync: only until the replay has filled)."""
        if not self._replay_ready:
            B = self.trainer.config.batch_size
            self._replay_ready = getattr(self.replay, "rows_at_least", 0) >= B or self.replay.size >= B
        return self._replay_ready

    def _run_chunk(self):
        generation = getattr(self.trainer, "state_generation", 0)
        if generation != self._captured_generation:  # a checkpoint load replaced the optimizer's tensors
            self._runner.reset()
            self._captured_generation = generation
        n = self.trains_per_graph
        self.trainer.before_steps(n)
        self._runner()  # eager warm-up on the capture stream, then the capture, then replays
        self.iterations += self.config.iterations_per_graph
        self.trainer.after_steps(n)

    def reset(self):
        """Forget the captured graph: the next replays warm up and capture again (needed when
        tensors the graph reads were replaced; a trainer checkpoint load is noticed by itself)."""
        self._runner.reset()

    @property
    def graphed(self) -> bool:
        return self._runner.graphed


def _as_tensors_report(device) -> torch.device:
    """The device as its tensors report it (an index on CUDA: "cuda" means the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _linear(counter: Tensor, start: float, end: float, span: int, out: Tensor):
    """out = start + (end - start) * min(counter / span, 1), on the device (three launches)."""
    torch.mul(counter.clamp(max=float(span)), (end - start) / span, out=out)
    out.add_(start)

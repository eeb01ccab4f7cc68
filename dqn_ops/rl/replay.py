"""A uniform replay buffer on the device: a ring of transitions, sampled without host syncs."""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor


class ReplayBuffer:
    def __init__(self, capacity: int, state_dim: int, num_branches: int, device="cpu", seed: int = 0):
        if capacity < 1:
            raise ValueError(f"ReplayBuffer: capacity must be >= 1, got {capacity}")
        self.capacity, self.device = capacity, torch.device(device)
        self.states = torch.zeros(capacity, state_dim, device=self.device)
        self.next_states = torch.zeros(capacity, state_dim, device=self.device)
        self.actions = torch.zeros(capacity, num_branches, dtype=torch.long, device=self.device)
        self.rewards = torch.zeros(capacity, device=self.device)
        self.dones = torch.zeros(capacity, device=self.device)
        self.device = self.states.device  # "cuda" -> "cuda:0": the device tensors report, for the checks below
        self.size = 0   # host counters: the number of added rows is known without reading the device
        self.next = 0
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def add(self, states: Tensor, actions: Tensor, rewards: Tensor, next_states: Tensor, dones: Tensor):
        n = states.shape[0] if states.dim() >= 1 else 0
        expected = dict(states=((n, self.states.shape[1]), torch.float32), next_states=((n, self.states.shape[1]),
                        torch.float32), actions=((n, self.actions.shape[1]), torch.long), rewards=((n,), torch.float32),
                        dones=((n,), torch.float32))
        given = dict(states=states, next_states=next_states, actions=actions, rewards=rewards, dones=dones)
        for name, (shape, dtype) in expected.items():
            t = given[name]
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != self.device:
                raise ValueError(f"ReplayBuffer.add: {name}: expected {dtype} {list(shape)} on {self.device}, "
                                 f"got {t.dtype} {list(t.shape)} on {t.device}")
        if n == 0:
            raise ValueError("ReplayBuffer.add: expected at least one transition, got 0")
        if n > self.capacity:
            raise ValueError(f"ReplayBuffer.add: {n} transitions do not fit a capacity of {self.capacity}")
        idx = (torch.arange(n, device=self.device) + self.next) % self.capacity
        self.states[idx] = states
        self.next_states[idx] = next_states
        self.actions[idx] = actions
        self.rewards[idx] = rewards
        self.dones[idx] = dones
        self.next = (self.next + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int) -> Dict[str, Tensor]:
        if self.size == 0:
            raise RuntimeError("ReplayBuffer.sample: the buffer is empty")
        idx = torch.randint(0, self.size, (batch_size,), generator=self.gen, device=self.device)
        return dict(states=self.states[idx], actions=self.actions[idx], rewards=self.rewards[idx],
                    next_states=self.next_states[idx], dones=self.dones[idx])

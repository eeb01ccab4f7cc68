"""The same network in plain PyTorch (``nn.Linear`` layers, as ../shared/anchor/torch_step.py
builds it): the baseline the benchmarks compare against and the reference the tests check
the kernels with. Its state-dict names are DuelingBranchQNet's, so weights move both ways."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layout import DQNConfig


class TorchDuelingBranchNet(nn.Module):
    def __init__(self, c: DQNConfig):
        super().__init__()
        self.config = c
        self.s1, self.s2 = nn.Linear(c.state_dim, c.trunk_hidden[0]), nn.Linear(*c.trunk_hidden)
        self.v1, self.v2 = nn.Linear(c.trunk_hidden[1], c.value_hidden), nn.Linear(c.value_hidden, c.atoms)
        self.a1 = nn.ModuleList(nn.Linear(c.trunk_hidden[1], c.adv_hidden) for _ in c.branches)
        self.a2 = nn.ModuleList(nn.Linear(c.adv_hidden, n * c.atoms) for n in c.branches)

    def forward(self, s):
        """Returns (q [B, sum n_d, NA] dueling-aggregated, head [B, NA * (1 + sum n_d)] raw)."""
        na = self.config.atoms
        h = F.relu(self.s2(F.relu(self.s1(s))))
        v = self.v2(F.relu(self.v1(h)))
        heads, qs = [v], []
        for a1, a2, n in zip(self.a1, self.a2, self.config.branches):
            a = a2(F.relu(a1(h)))
            heads.append(a)
            a = a.view(-1, n, na)
            qs.append(v.view(-1, 1, na) + a - a.mean(1, keepdim=True))
        return torch.cat(qs, 1), torch.cat(heads, 1)

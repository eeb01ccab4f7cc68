"""Independent references for the tests: the network as a plain stack of ``nn.Linear``
layers (as the plain-PyTorch anchor step of docs/design.md) and a hand-written float64 backward."""
from __future__ import annotations

import torch

from dqn_ops import DQNConfig
from dqn_ops.rl.baseline import TorchDuelingBranchNet

CONFIGS = {
    "reference": DQNConfig(),
    "odd_widths": DQNConfig(state_dim=37, trunk_hidden=(61, 45), value_hidden=29, adv_hidden=23, atoms=11, branches=(3, 2)),
    "one_branch": DQNConfig(state_dim=16, trunk_hidden=(64, 32), value_hidden=24, adv_hidden=16, atoms=51, branches=(4,)),
    "five_branches": DQNConfig(state_dim=24, trunk_hidden=(64, 64), value_hidden=32, adv_hidden=16, atoms=21,
                               branches=(2, 3, 4, 5, 7)),
    "one_atom": DQNConfig(atoms=1),
}
TINY = DQNConfig(state_dim=5, trunk_hidden=(7, 6), value_hidden=3, adv_hidden=4, atoms=3, branches=(2, 3))


ReferenceNet = TorchDuelingBranchNet  # plain nn.Linear layers, independent of the kernels


def reference_net_like(net, dtype=torch.float64, device="cpu") -> ReferenceNet:
    ref = ReferenceNet(net.config).to(dtype=dtype, device=device)
    ref.load_state_dict({k: v.to(dtype) for k, v in net.state_dict().items()})
    return ref


def dueling_head_grad(c: DQNConfig, grad_q: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(head) for a given d(loss)/d(q), by autograd of the dueling aggregation."""
    B = grad_q.shape[0]
    head = torch.zeros(B, c.head_out, dtype=torch.float64, requires_grad=True)
    v = head[:, :c.atoms].view(B, 1, c.atoms)
    qs, col = [], c.atoms
    for n in c.branches:
        a = head[:, col:col + n * c.atoms].view(B, n, c.atoms)
        qs.append(v + a - a.mean(1, keepdim=True))
        col += n * c.atoms
    torch.cat(qs, 1).backward(grad_q.double().cpu())
    return head.grad


@torch.no_grad()
def reference_backward(net, saved, d_head, dx_weights: str):
    """Hand-written float64 backward of the computed forward.

    saved: (states_bf16, h1, h2, hh) as the forward returned them; ReLU masks are read off
    them and dW uses them, as the kernels do. dx_weights: 'mirror' or 'master' — which
    weights the d(input) products use. Returns (flat grad float64 on CPU, d_states).
    """
    c, L = net.config, net.layout
    x, h1, h2, hh = (t.double().cpu() for t in saved)
    d_head = d_head.double().cpu()
    W = net.layer_views(net.params_bf16.double().cpu() if dx_weights == "mirror" else net.flat_params.detach().double().cpu())
    grad = torch.zeros(L.numel, dtype=torch.float64)
    G = net.layer_views(grad)

    names = [("v1", "v2", 0, c.value_hidden, 0, c.atoms)]
    col_in, col_out = c.value_hidden, c.atoms
    for d, n in enumerate(c.branches):
        names.append((f"a1.{d}", f"a2.{d}", col_in, c.adv_hidden, col_out, n * c.atoms))
        col_in, col_out = col_in + c.adv_hidden, col_out + n * c.atoms
    d_hh = torch.zeros_like(hh)
    for first, second, ci, wi, co, wo in names:
        dy = d_head[:, co:co + wo]
        G[second + ".weight"].copy_(dy.T @ hh[:, ci:ci + wi])
        G[second + ".bias"].copy_(dy.sum(0))
        d_hh[:, ci:ci + wi] = dy @ W[second + ".weight"]
    d_hh = d_hh * (hh > 0)
    d_h2 = torch.zeros_like(h2)
    for first, _, ci, wi, _, _ in names:
        dz = d_hh[:, ci:ci + wi]
        G[first + ".weight"].copy_(dz.T @ h2)
        G[first + ".bias"].copy_(dz.sum(0))
        d_h2 += dz @ W[first + ".weight"]
    dz2 = d_h2 * (h2 > 0)
    G["s2.weight"].copy_(dz2.T @ h1)
    G["s2.bias"].copy_(dz2.sum(0))
    dz1 = (dz2 @ W["s2.weight"]) * (h1 > 0)
    G["s1.weight"].copy_(dz1.T @ x)
    G["s1.bias"].copy_(dz1.sum(0))
    return grad, dz1 @ W["s1.weight"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if a has a NaN)."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def power_iteration_f64(W, u, iterations, eps=1e-12):
    """The reference: v = normalize(W^T u), u = normalize(W v), sigma = u^T W v, in float64."""
    W, u = W.double().cpu(), u.double().cpu()
    for _ in range(iterations):
        v = W.t() @ u
        v = v / max(v.norm().item(), eps)
        u = W @ v
        u = u / max(u.norm().item(), eps)
    return (u @ W @ v).item(), u, v


# ---------------------------------------------------------------------------------------
# Philox4x32-10 and the stream layout of csrc/philox.h, written again in Python from the
# paper (Salmon et al., SC 2011) as the independent reference for the ops' random draws.

_M32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """counter: 4 uint32, key: 2 uint32 -> 4 uint32."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _M32, p1 & _M32, ((p0 >> 32) ^ c3 ^ k1) & _M32, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


# philox::Stream: which op draws
STREAM_ACT, STREAM_REPLAY, STREAM_ENV = 1, 2, 3


def philox_draw(stream: int, seed: int, call: int, row: int, slot: int) -> int:
    """philox::draw of csrc/philox.h: word slot % 4 of the block (row, stream << 16 | slot // 4,
    call) under key seed."""
    seed, call = seed & 0xFFFFFFFFFFFFFFFF, call & 0xFFFFFFFFFFFFFFFF
    out = philox4x32_10((row & _M32, (stream << 16) | (slot // 4), call & _M32, call >> 32),
                        (seed & _M32, seed >> 32))
    return out[slot % 4]


def philox_uniform(bits: int) -> float:
    """philox::uniform: the top 24 bits as a float in [0, 1) (exact in float32)."""
    return (bits >> 8) / 16777216.0


def philox_below(bits: int, n: int) -> int:
    """philox::below: an integer in [0, n), computed in float32 as the kernels do."""
    import numpy as np
    i = int(np.float32(philox_uniform(bits)) * np.float32(n))
    return min(i, n - 1)


def philox_index_below(bits: int, n: int) -> int:
    """philox::index_below: floor(bits * n / 2^32), an integer in [0, n) for 1 <= n < 2^32."""
    assert 1 <= n < 2**32
    return (bits * n) >> 32

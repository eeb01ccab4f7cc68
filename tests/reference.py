"""Independent references for the tests: the network of any shape in plain float64 torch ops on
its named layers (``ReferenceNet``, ``reference_forward``), written from the formulas of
dqn_ops/layout.py's docstring and not from the package's code; a hand-written float64 backward of
the same network; Philox."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dqn_ops import DQNConfig

CONFIGS = {
    "reference": DQNConfig(),
    "odd_widths": DQNConfig(state_dim=37, trunk_hidden=(61, 45), value_hidden=29, adv_hidden=23, atoms=11, branches=(3, 2)),
    "one_branch": DQNConfig(state_dim=16, trunk_hidden=(64, 32), value_hidden=24, adv_hidden=16, atoms=51, branches=(4,)),
    "five_branches": DQNConfig(state_dim=24, trunk_hidden=(64, 64), value_hidden=32, adv_hidden=16, atoms=21,
                               branches=(2, 3, 4, 5, 7)),
    "one_atom": DQNConfig(atoms=1),
}
TINY = DQNConfig(state_dim=5, trunk_hidden=(7, 6), value_hidden=3, adv_hidden=4, atoms=3, branches=(2, 3))

# Network shapes beyond the fixed one: trunk depth 1 and 3, head depth 0, 1 and 2, dueling on and
# off, C51 and one atom, one and several branches of unequal sizes; "cleanrl_c51" is CleanRL
# c51.py's QNetwork (state 4 -> 120 -> 84 -> n * atoms: no dueling, no head layer, one branch).
# Block groups (csrc/layout.h) they exercise: head0_no_dueling's first two output heads read
# the same input (in_col_stride 0); head2_dueling_q's value head has the branches' widths, so
# its deeper head layer runs as one group of all three heads.
SHAPES = {
    "trunk1_head1": DQNConfig(state_dim=9, trunk_hidden=(24,), value_hidden=7, adv_hidden=5, atoms=11, branches=(3, 2)),
    "trunk3_head2": DQNConfig(state_dim=10, trunk_hidden=(32, 24, 16), value_hidden=(12, 6), adv_hidden=(8, 5),
                              atoms=7, branches=(2, 4, 3)),
    "head0_dueling": DQNConfig(state_dim=8, trunk_hidden=(20, 16), value_hidden=(), adv_hidden=(), atoms=5,
                               branches=(3, 1, 4)),
    "head0_no_dueling": DQNConfig(state_dim=8, trunk_hidden=(20, 16), adv_hidden=(), atoms=5, branches=(3, 3, 1),
                                  dueling=False),
    "head2_no_dueling_q": DQNConfig(state_dim=6, trunk_hidden=(16, 12), adv_hidden=(10, 9), atoms=1, branches=(4, 2),
                                    dueling=False),
    "head1_no_dueling_one_branch": DQNConfig(state_dim=7, trunk_hidden=(24, 16), adv_hidden=12, atoms=9, branches=(5,),
                                             dueling=False),
    "head2_dueling_q": DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=(6, 4), adv_hidden=(6, 4), atoms=1,
                                 branches=(2, 5)),
    "cleanrl_c51": DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=51, branches=(2,),
                             dueling=False),
}


# ---------------------------------------------------------------------------------------
# The network, from layout.py's docstring:
#   trunk   h_i = relu(h_{i-1} W_si^T + b_si), i = 1..L, h_0 = s
#   head k  x = h_L; x = relu(x W_{k,j}^T + b_{k,j}) for j = 1..H; out_k = x W_{k,H+1}^T + b_{k,H+1}
#           (the saved head activation j is every head's x side by side, the value head first)
#   q_d = v + a_d - mean_k a_d with dueling, else q_d = a_d.
# Layer names are nn.Linear's: s<i>; the value head v<j>; branch d's head a<j>.<d> (dueling)
# or q<j>.<d> (no dueling); j = H + 1 is the output layer.
# An ensemble (E = c.members > 1): E such head sets on the one trunk, member m's layers named
# e<m>.<name>; heads listed value heads of every member first, then member 0's branches, member
# 1's, ...; q holds member e's q_d at rows e * sum(n) + off_d, each with its own value head.

def head_widths(c: DQNConfig) -> List[Tuple[str, Tuple[int, ...], int]]:
    """Per output head, in head order: (name stem and suffix as a format 'v{}' / 'a{}.0' /
    'e1.a{}.0', hidden widths, output width)."""
    E = c.members
    member = [f"e{m}." if E > 1 else "" for m in range(E)]
    heads = [(member[m] + "v{}", tuple(c.value_hidden), c.atoms) for m in range(E)] if c.dueling else []
    stream = "a" if c.dueling else "q"
    return heads + [(member[m] + stream + "{}." + str(d), tuple(c.adv_hidden), n * c.atoms)
                    for m in range(E) for d, n in enumerate(c.branches)]


def layer_shapes(c: DQNConfig) -> Dict[str, Tuple[int, int]]:
    """Every nn.Linear layer's (out, in), by name, in forward order (trunk, IQN's phi, then head
    by head; then each aux head group's phi and heads, named g<g>.<name>)."""
    shapes, width = {}, c.state_dim
    for i, w in enumerate(c.trunk_hidden):
        shapes[f"s{i + 1}"] = (w, width)
        width = w
    for g in range(1 + len(c.aux)):
        gc, prefix = group_config(c, g), f"g{g}." if g else ""
        if gc.iqn_embedding > 0:  # IQN: phi embeds n cosines to the trunk's width
            shapes[prefix + "phi"] = (width, gc.iqn_embedding)
        for stem, hidden, out in head_widths(gc):
            w_in = width
            for j, w in enumerate(hidden + (out,)):
                shapes[prefix + stem.format(j + 1)] = (w, w_in)
                w_in = w
    return shapes


# The ops' activations are those of the network the buffer stores (DQNConfig.aligned, layout.py's
# docstring): every hidden width rounded up to a multiple of 8, the extra units' weights zero, so
# their activations are zero; the states and IQN's cosines keep their widths. Per activation of c
# (states, trunk layers, IQN's c, phi and z, head layers): where c's units sit in the stored one
# ((column, width) per head, side by side, each head's block rounded up) and the stored width.

def _up8(n: int) -> int:
    return (n + 7) // 8 * 8


def activation_columns(c: DQNConfig) -> List[Tuple[List[Tuple[int, int]], int]]:
    """Per activation of the one-group network c: ([(stored column, width), ...], stored width)."""
    cols = [([(0, c.state_dim)], c.state_dim)] + [([(0, w)], _up8(w)) for w in c.trunk_hidden]
    if c.iqn_embedding > 0:
        T = c.trunk_hidden[-1]
        cols += [([(0, c.iqn_embedding)], c.iqn_embedding), ([(0, T)], _up8(T)), ([(0, T)], _up8(T))]
    for j in range(len(c.adv_hidden)):
        segments, at = [], 0
        for _, hidden, _ in head_widths(c):
            segments.append((at, hidden[j]))
            at += _up8(hidden[j])
        cols.append((segments, at))
    return cols


def logical_activations(c: DQNConfig, acts: Sequence[Tensor]) -> List[Tensor]:
    """The ops' activations (the stored network's) as c's own, each c's units' columns; asserts
    that every extra unit's column is exactly zero."""
    out = []
    layout = activation_columns(c)
    assert len(acts) == len(layout), f"{len(acts)} activations, c has {len(layout)}"
    for k, (t, (segments, width)) in enumerate(zip(acts, layout)):
        assert t.shape[-1] == width, f"activation {k}: width {t.shape[-1]}, the stored network's is {width}"
        extra = torch.ones(width, dtype=torch.bool, device=t.device)
        for a, w in segments:
            extra[a:a + w] = False
        assert bool((t[..., extra] == 0).all()), f"activation {k}: an extra unit's column is not zero"
        out.append(torch.cat([t[..., a:a + w] for a, w in segments], -1))
    return out


def padding_mask(layout, device) -> Tensor:
    """True at the flat buffer's elements outside every layer view of a ParamLayout: alignment
    gaps, reserved rows, the stored network's extra units (its views are strided where a stored
    input width was rounded up)."""
    pad = torch.ones(layout.numel, dtype=torch.bool, device=device)
    for view in layout.views(pad).values():
        view.fill_(False)
    return pad


def stored_activations(c: DQNConfig, acts: Sequence[Tensor]) -> List[Tensor]:
    """c's own activations as the ops take them: each placed at its units' columns of the stored
    network's width, zero elsewhere (the inverse of logical_activations)."""
    out = []
    for t, (segments, width) in zip(acts, activation_columns(c), strict=True):
        stored = t.new_zeros(*t.shape[:-1], width)
        at = 0
        for a, w in segments:
            stored[..., a:a + w] = t[..., at:at + w]
            at += w
        out.append(stored)
    return out


# Head groups (docs/combination-design.md): a trunk and G head sets; group 0 the config's own
# head set, group g >= 1 the HeadGroup c.aux[g - 1]: its kind's atoms, its members, dueling and
# head widths, the config's branches, IQN's phi with its own embedding; its layers named as the
# one-group network's with the prefix g<g>. Each group reads h_L and computes what the network
# of the trunk and that head set alone computes.

def group_config(c: DQNConfig, g: int) -> DQNConfig:
    """Group g's one-group network, from the HeadGroup's fields (g = 0: c without its groups)."""
    if g == 0:
        return dataclasses.replace(c, aux=())
    group = c.aux[g - 1]
    return DQNConfig(state_dim=c.state_dim, trunk_hidden=c.trunk_hidden, value_hidden=group.value_hidden,
                     adv_hidden=group.adv_hidden, atoms=group.atoms, branches=c.branches, dueling=group.dueling,
                     ensemble=group.members, iqn_embedding=group.iqn_embedding)


def group_layers(layers: Dict[str, Tuple[Tensor, Tensor]], g: int) -> Dict[str, Tuple[Tensor, Tensor]]:
    """Group g's layers under the one-group network's names (the trunk's included)."""
    if g == 0:
        return {k: v for k, v in layers.items() if not (k[:1] == "g" and k.split(".")[0][1:].isdigit())}
    prefix = f"g{g}."
    return {**{k: v for k, v in layers.items() if k[:1] == "s" and k[1:].isdigit()},
            **{k[len(prefix):]: v for k, v in layers.items() if k.startswith(prefix)}}


def reference_forward(c: DQNConfig, layers: Dict[str, Tuple[Tensor, Tensor]], s: Tensor,
                      round_to: Optional[torch.dtype] = None):
    """The network on s with layers {name: (weight, bias)}: (q [B, A, NA], head [B, head_out],
    activations [s, h_1, ..., h_L, head layer 1, ..., head layer H]). round_to: a dtype every
    activation (the states included) is rounded to after its ReLU, as the kernels store them."""
    if c.iqn_embedding > 0:
        raise ValueError("reference_forward: an IQN network takes fractions: reference_iqn_forward")
    if c.aux:
        raise ValueError("reference_forward: a network with head groups: reference_groups_forward")
    rounded = _rounding(round_to)
    x = rounded(s)
    acts = [x] + _trunk(c, layers, x, rounded)
    q, head, head_acts = _head_set(c, layers, acts[-1], None, rounded, round_to)
    return q, head, acts + head_acts


def _rounding(round_to: Optional[torch.dtype], straight_through: bool = False):
    """x rounded to `round_to` (None: x itself); straight_through: with the gradient passed
    unchanged, as the kernels' backward treats their rounded activations."""
    if round_to is None:
        return lambda x: x
    if straight_through:
        return lambda x: x + (x.to(round_to).to(x.dtype) - x).detach()
    return lambda x: x.to(round_to).to(x.dtype)


def _trunk(c: DQNConfig, layers, x: Tensor, rounded) -> List[Tensor]:
    """[h_1, ..., h_L] on the (rounded) states x."""
    acts = []
    for i in range(len(c.trunk_hidden)):
        x = rounded(F.relu(F.linear(x, *layers[f"s{i + 1}"])))
        acts.append(x)
    return acts


def _heads(c: DQNConfig, layers, x: Tensor, rounded) -> Tuple[List[Tensor], List[Tensor]]:
    """Every head on its input x (h_L, or IQN's z): (the output heads' logits in head order, the
    head layers' activations [every head's layer j side by side] for j = 1..H)."""
    per_head: List[List[Tensor]] = []
    outs = []
    for stem, hidden, _ in head_widths(c):
        y, ys = x, []
        for j in range(len(hidden)):
            y = rounded(F.relu(F.linear(y, *layers[stem.format(j + 1)])))
            ys.append(y)
        per_head.append(ys)
        outs.append(F.linear(y, *layers[stem.format(len(hidden) + 1)]))
    return outs, [torch.cat([ys[j] for ys in per_head], 1) for j in range(len(c.adv_hidden))]


# IQN (Dabney et al. 2018, "Implicit Quantile Networks for Distributional Reinforcement
# Learning", eq. 4 and sec. 3.1), written from the paper and docs/iqn-design.md:
#   h = trunk(s) [B, T];  c[b, i, k] = cos(pi k tau[b, i]), k = 0..n-1 (n = iqn_embedding)
#   phi[b, i] = relu(sum_k c[b, i, k] W_phi[:, k] + b_phi)   [B, N, T]
#   z[b, i] = h[b] * phi[b, i]   -> the heads (and the dueling aggregation) on the B * N rows z
#   q[b, a, i] = the value of action a on row (b, i)   [B, E * A, N]

def reference_iqn_forward(c: DQNConfig, layers: Dict[str, Tuple[Tensor, Tensor]], s: Tensor, tau: Tensor,
                          round_to: Optional[torch.dtype] = None, straight_through: bool = False):
    """The IQN network on s [B, SD] at fractions tau [B, N]: (q [B, E * A, N], head [B * N,
    head_out] with row (b, i) at b * N + i, activations [s, h_1, ..., h_L, c, phi, z, head layer
    1, ..., head layer H], each IQN one [B * N, width]). round_to: a dtype every activation (the
    states and the cosines included) is rounded to, as the BF16 kernels store them, and then the
    cosines' argument k * tau is formed in F32, as the kernels form it; straight_through:
    autograd passes the gradient through those roundings (the kernels' backward)."""
    assert c.iqn_embedding > 0 and c.atoms == 1
    if c.aux:
        raise ValueError("reference_iqn_forward: a network with head groups: reference_groups_forward")
    rounded = _rounding(round_to, straight_through)
    x = rounded(s)
    acts = [x] + _trunk(c, layers, x, rounded)
    q, head, group_acts = _head_set(c, layers, acts[-1], tau, rounded, round_to)
    return q, head, acts + group_acts


def _head_set(c: DQNConfig, layers, h: Tensor, tau: Optional[Tensor], rounded, round_to):
    """One head set (a one-group network's heads, IQN's with its phi at fractions tau [B, N]) on
    the trunk's output h: (q, head, its activations: [c, phi, z] (IQN), head layer 1, ..., H)."""
    if tau is None:
        outs, head_acts = _heads(c, layers, h, rounded)
        return aggregate(c, outs), torch.cat(outs, 1), head_acts
    B, N = tau.shape
    argument_dtype = torch.float64 if round_to is None else torch.float32
    k = torch.arange(c.iqn_embedding, dtype=argument_dtype)
    angle = (tau.to(argument_dtype).reshape(B * N, 1) * k).to(torch.float64)
    cos = rounded(torch.cos(torch.pi * angle).to(h.dtype))                                      # [B*N, n]
    phi = rounded(F.relu(F.linear(cos, *layers["phi"])))                                        # [B*N, T]
    z = rounded(h.repeat_interleave(N, 0) * phi)                                                # row b*N + i
    outs, head_acts = _heads(c, layers, z, rounded)
    q_rows = aggregate(c, outs)                                                                 # [B*N, E*A, 1]
    q = q_rows[..., 0].reshape(B, N, -1).transpose(1, 2)
    return q, torch.cat(outs, 1), [cos, phi, z] + head_acts


def reference_groups_forward(c: DQNConfig, layers: Dict[str, Tuple[Tensor, Tensor]], s: Tensor,
                             fractions_per_group: Sequence[Optional[Tensor]], round_to: Optional[torch.dtype] = None,
                             straight_through: bool = False):
    """The network of head groups on s [B, SD]: the trunk once, then each group's head set on
    h_L, an IQN group's at its fractions (fractions_per_group: one entry per group, [B, N_g] for
    an IQN group, None for any other). Returns (outputs: per group (q, head) as reference_forward
    / reference_iqn_forward give them for the group's one-group network, the trunk's activations
    [s, h_1, ..., h_L], per group its activations ([c, phi, z] (IQN), head layer 1, ..., H)).
    round_to / straight_through: as reference_iqn_forward's."""
    G = 1 + len(c.aux)
    assert len(fractions_per_group) == G, f"{G} groups, {len(fractions_per_group)} entries of fractions"
    rounded = _rounding(round_to, straight_through)
    x = rounded(s)
    trunk = [x] + _trunk(c, layers, x, rounded)
    outputs, group_acts = [], []
    for g in range(G):
        gc, tau = group_config(c, g), fractions_per_group[g]
        assert (gc.iqn_embedding > 0) == (tau is not None), f"group {g}: fractions for IQN groups only"
        q, head, acts = _head_set(gc, group_layers(layers, g), trunk[-1], tau, rounded, round_to)
        outputs.append((q, head))
        group_acts.append(acts)
    return outputs, trunk, group_acts


def aggregate(c: DQNConfig, outs: Sequence[Tensor]) -> Tensor:
    """q [B, E * sum n, NA] from the output heads' logits (head order), member after member."""
    E, D, NA = c.members, c.num_branches, c.atoms
    values = E if c.dueling else 0
    qs = []
    for e in range(E):
        for a, n in zip(outs[values + e * D:values + (e + 1) * D], c.branches):
            a = a.reshape(-1, n, NA)
            qs.append(outs[e].reshape(-1, 1, NA) + a - a.mean(1, keepdim=True) if c.dueling else a)
    return torch.cat(qs, 1)


class ReferenceNet(nn.Module):
    """The network as plain nn.Linear layers named as DuelingBranchQNet's state dict names them
    (``s1``, ``v2``, ``a1.0``, ``q2.1`` ...), built from the config alone: its state dict loads
    into and from DuelingBranchQNet's key for key. forward(s) -> (q, head logits)."""

    def __init__(self, c: DQNConfig):
        super().__init__()
        self.config = c
        for name, (out, inp) in layer_shapes(c).items():
            *path, last = name.split(".")  # 'e1.a2.0': ModuleDicts 'e1' and 'a2', layer '0'
            parent = self
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.ModuleDict())
                parent = parent._modules[part]
            parent.add_module(last, nn.Linear(inp, out))

    def linear(self, name: str) -> nn.Linear:
        return self.get_submodule(name)

    def layers(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        return {name: (self.linear(name).weight, self.linear(name).bias) for name in layer_shapes(self.config)}

    def forward(self, s, tau=None, group_fractions=None):
        """(q, head); with head groups a list of G (q, head) pairs, group 0's at tau, the aux
        groups' at group_fractions (one entry per aux group: [B, N_g] or None), as TorchQNet."""
        if self.config.aux:
            fractions = [tau] + list(group_fractions or [None] * len(self.config.aux))
            return reference_groups_forward(self.config, self.layers(), s, fractions)[0]
        if self.config.iqn_embedding > 0:
            q, head, _ = reference_iqn_forward(self.config, self.layers(), s, tau)
        else:
            q, head, _ = reference_forward(self.config, self.layers(), s)
        return q, head


def reference_net_like(net, dtype=torch.float64, device="cpu") -> ReferenceNet:
    """A ReferenceNet holding `net`'s master weights (in `dtype`, on `device`)."""
    ref = ReferenceNet(net.config).to(dtype=dtype, device=device)
    ref.load_state_dict({k: v.to(dtype) for k, v in net.state_dict().items()})
    return ref


def mirror_layers(net) -> Dict[str, Tuple[Tensor, Tensor]]:
    """`net`'s layers as its forward GEMMs read them, in float64 on the CPU: the weights of the
    mirror (BF16 values), the biases of the master."""
    mirror = net.layer_views(net.params_bf16.detach().double().cpu())
    master = net.layer_views(net.flat_params.detach().double().cpu())
    return {name: (mirror[name + ".weight"], master[name + ".bias"]) for name in layer_shapes(net.config)}


@torch.no_grad()
def reference_forward_emulated(net, s: Tensor):
    """bf16_dueling_forward's arithmetic in float64: BF16 mirror weights, the states and every
    hidden activation rounded to the mirror's dtype; only the summation (float64 here, F32 in
    the kernels) differs. (q, head, activations), on the CPU."""
    round_to = net.params_bf16.dtype if net.params_bf16.dtype != torch.float64 else None
    return reference_forward(net.config, mirror_layers(net), s.double().cpu(), round_to)


def dueling_head_grad(c: DQNConfig, grad_q: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(head) for a given d(loss)/d(q), by autograd of the aggregation (dueling or not)."""
    B = grad_q.shape[0]
    head = torch.zeros(B, c.head_out, dtype=torch.float64, requires_grad=True)
    aggregate(c, head.split([out for _, _, out in head_widths(c)], 1)).backward(grad_q.double().cpu())
    return head.grad


@torch.no_grad()
def reference_backward(net, saved: Sequence[Tensor], d_head, dx_weights: str):
    """Hand-written float64 backward of the computed forward, for any shape.

    saved: the activation list as the forward returned it (states, trunk layers, head layers;
    the stored network's: logical_activations gives c's own); ReLU masks are read off it and dW
    uses it, as the kernels do. dx_weights: 'mirror' or
    'master' — which weights the d(input) products use. Returns (flat grad float64 on CPU,
    d_states).
    """
    c = net.config
    acts = [t.double().cpu() for t in logical_activations(c, saved)]
    d_head = d_head.double().cpu()
    W = net.layer_views(net.params_bf16.double().cpu() if dx_weights == "mirror"
                        else net.flat_params.detach().double().cpu())
    grad = torch.zeros(net.layout.numel, dtype=torch.float64)
    G = net.layer_views(grad)
    L, H = len(c.trunk_hidden), len(c.adv_hidden)
    trunk_out = acts[L]

    def linear_backward(name, dy, x):
        G[name + ".weight"].copy_(dy.T @ x)
        G[name + ".bias"].copy_(dy.sum(0))
        return dy @ W[name + ".weight"]

    # Heads: each its own chain from its output columns back to the trunk output.
    d_trunk = torch.zeros_like(trunk_out)
    out_col, hid_cols = 0, [0] * H
    for stem, hidden, out in head_widths(c):
        cols = []  # this head's columns of each head layer
        for j, w in enumerate(hidden):
            cols.append((hid_cols[j], w))
            hid_cols[j] += w
        xs = [trunk_out] + [acts[L + 1 + j][:, a:a + w] for j, (a, w) in enumerate(cols)]
        dy = d_head[:, out_col:out_col + out]
        out_col += out
        d = linear_backward(stem.format(H + 1), dy, xs[H])
        for j in range(H, 0, -1):
            d = linear_backward(stem.format(j), d * (xs[j] > 0), xs[j - 1])
        d_trunk += d
    d = d_trunk
    for i in range(L, 0, -1):
        d = linear_backward(f"s{i}", d * (acts[i] > 0), acts[i - 1])
    return grad, d


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (inf if a has a NaN)."""
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

def branch_columns(width, branches):
    """The (first, size) row ranges of every (member, branch) of a [B, width, ...] q tensor."""
    A = sum(branches)
    return [(e * A + sum(branches[:d]), n) for e in range(width // A) for d, n in enumerate(branches)]


def assert_no_near_ties(values, branches, bar=1e-4):
    """Every (sample, member, branch)'s best next-state value is more than `bar` ahead of the
    second, so F32 and float64 pick the same next action. values: [B, rows] expected Q values, or
    [B, rows, N] quantile values (their means are compared)."""
    v = values.detach().double()
    if v.dim() == 3:
        v = v.mean(-1)
    for first, n in branch_columns(v.shape[1], branches):
        if n > 1:
            top = v[:, first:first + n].topk(2, dim=1).values
            assert (top[:, 0] - top[:, 1]).min() > bar, "test data with a near tie of the next action: change the data"



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
STREAM_ACT, STREAM_REPLAY, STREAM_ENV, STREAM_BOOTSTRAP, STREAM_IQN_FRACTIONS = 1, 2, 3, 4, 5


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


# ---------------------------------------------------------------------------------------
# QR-DQN (Dabney et al. 2017, "Distributional Reinforcement Learning with Quantile Regression",
# eq. 10 with kappa = 1), written from the paper's formula in float64 (the next action one
# (sample, branch) at a time, the loss on [B, D, N, N] tensors of u_ij), independently of
# dqn_ops/rl/baseline.py's torch_dqn_loss. The gradient comes from torch.autograd on this
# float64 loss.

def quantile_fractions(N: int) -> Tensor:
    """tau_i = (2i + 1) / 2N, the midpoints of N equal quantile intervals (float64)."""
    return torch.tensor([(2 * i + 1) / (2 * N) for i in range(N)], dtype=torch.float64)


def huber1(u: Tensor) -> Tensor:
    """Huber with kappa 1: u^2 / 2 where |u| <= 1, |u| - 1/2 beyond."""
    return torch.where(u.abs() <= 1, 0.5 * u * u, u.abs() - 0.5)


def qr_targets(q_next_online, q_next_target, rewards, dones, branches, gamma):
    """Per sample b and branch d: a* = the first argmax over the branch's actions of the mean of
    the online next-state quantiles, and the target quantiles T_j = r_b + gamma (1 - done_b)
    q_next_target[b, off_d + a*, j]; float64 on the CPU. Returns (T [B, D, N], a* [B, D], the
    gap between the best and second-best mean per (b, d): +inf for one action)."""
    qo, qt = q_next_online.detach().double().cpu(), q_next_target.detach().double().cpu()
    r, done = rewards.detach().double().cpu(), dones.detach().double().cpu()
    B, _, N = qo.shape
    T = torch.empty(B, len(branches), N, dtype=torch.float64)
    a_star = torch.empty(B, len(branches), dtype=torch.long)
    gap = torch.full((B, len(branches)), float("inf"), dtype=torch.float64)
    for b in range(B):
        off = 0
        for d, n in enumerate(branches):
            means = [qo[b, off + a].sum().item() / N for a in range(n)]
            best = 0
            for a in range(1, n):
                if means[a] > means[best]:  # strictly: the first of equal maxima
                    best = a
            if n > 1:
                gap[b, d] = means[best] - max(m for a, m in enumerate(means) if a != best)
            a_star[b, d] = best
            T[b, d] = r[b] + gamma * (1.0 - done[b]) * qt[b, off + best]
            off += n
    return T, a_star, gap


def reference_qr(q, q_next_online, q_next_target, actions, rewards, dones, branches, gamma, weights=None):
    """The QR-DQN loss of dqn_ops.dqn_loss(loss_type='qr') in float64:
        theta_i = q[b, off_d + actions[b, d], i], u_ij = T_j - theta_i,
        rho_i(u) = |tau_i - 1{u < 0}| huber1(u),
        loss_bd = sum_i (1/N) sum_j rho_i(u_ij), L_b = mean_d loss_bd,
        loss = mean_b w_b L_b, td[b] = L_b, mean_q = mean_{b,d} mean_i theta_i.
    Returns (loss, grad_q = d loss / d q by autograd, td [B], mean_q), float64 on the CPU."""
    B, _, N = q.shape
    D = len(branches)
    q = q.detach().double().cpu().requires_grad_()
    a = actions.cpu()
    w = torch.ones(B, dtype=torch.float64) if weights is None else weights.detach().double().cpu()
    T, _, _ = qr_targets(q_next_online, q_next_target, rewards, dones, branches, gamma)   # [B, D, N] (j)
    tau = quantile_fractions(N)
    offsets = torch.tensor([sum(branches[:d]) for d in range(D)])
    theta = q[torch.arange(B)[:, None], offsets[None, :] + a]                              # [B, D, N] (i)
    u = T[:, :, None, :] - theta[:, :, :, None]                                           # [B, D, N (i), N (j)]
    below = (u.detach() < 0).double()                                                     # 1{u_ij < 0}
    rho = (tau[:, None] - below).abs() * huber1(u)
    loss_bd = (rho.sum(-1) / N).sum(-1)                                                   # sum_i (1/N) sum_j
    L = loss_bd.sum(1) / D
    loss = (w * L).sum() / B
    loss.backward()
    mean_q = theta.detach().sum() / (B * D * N)
    return loss.detach(), q.grad, L.detach(), mean_q


# ---------------------------------------------------------------------------------------
# The IQN loss (Dabney et al. 2018, eq. 3 with kappa = 1; docs/iqn-design.md), written from
# the paper's formula in float64, independently of reference_qr above and of dqn_ops's code
# (the next action one (sample, member, branch) at a time, the sum over (i, j) written as a
# [B, N, N'] tensor per (member, branch)). The gradient comes from torch.autograd.

def reference_iqn_loss(q, q_next_online, q_next_target, actions, rewards, dones, branches, gamma, tau,
                       weights=None, masks=None):
    """The IQN loss in float64, for E >= 1 members (read off q's width, as dqn_loss does):
        q [B, E * A, N]: member e's action a at fraction tau[b, i] in slot i (row e * A + off_d + a);
        q_next_online [B, E * A, K], q_next_target [B, E * A, N'] (N, K, N' may differ);
        a*_bed = the first argmax over branch d's actions of (1/K) sum_k q_next_online[b, row, k];
        T_j = r_b + gamma (1 - done_b) q_next_target[b, e * A + off_d + a*_bed, j];
        theta_i = q[b, e * A + off_d + actions[b, d], i];
        L_bed = sum_i (1/N') sum_j |tau_bi - 1{T_j < theta_i}| huber1(T_j - theta_i);
        loss = (1/B) sum_b w_b (1/(E D)) sum_e m_be sum_d L_bed;  td[b] = (1/(E D)) sum_{e,d} L_bed;
        mean_q = the mean of theta over (b, e, d, i).
    Returns (loss, grad_q = d loss / d q by autograd, td [B], mean_q), float64 on the CPU."""
    B, width, N = q.shape
    A, D = sum(branches), len(branches)
    E = width // A
    K, N2 = q_next_online.shape[2], q_next_target.shape[2]
    x = q.detach().double().cpu().requires_grad_()
    qo, qt = q_next_online.detach().double().cpu(), q_next_target.detach().double().cpu()
    r, done = rewards.detach().double().cpu(), dones.detach().double().cpu()
    fractions = tau.detach().double().cpu()                                          # [B, N]
    act = actions.cpu()
    w = torch.ones(B, dtype=torch.float64) if weights is None else weights.detach().double().cpu()
    m = torch.ones(B, E, dtype=torch.float64) if masks is None else masks.detach().double().cpu()
    L = torch.zeros(B, E, D, dtype=torch.float64)
    thetas = []
    for e in range(E):
        off = e * A
        for d, n in enumerate(branches):
            rows = []                                                                # per sample: a*'s target row
            for b in range(B):
                means = [qo[b, off + a].sum().item() / K for a in range(n)]
                best = max(range(n), key=lambda a: (means[a], -a))                   # the first of equal maxima
                rows.append(qt[b, off + best])
            T = r[:, None] + gamma * (1.0 - done[:, None]) * torch.stack(rows)       # [B, N'] (j)
            theta = x[torch.arange(B), off + act[:, d]]                              # [B, N] (i)
            below = (T[:, None, :] < theta.detach()[:, :, None]).double()            # 1{T_j < theta_i}
            rho = (fractions[:, :, None] - below).abs() * huber1(T[:, None, :] - theta[:, :, None])
            L[:, e, d] = rho.sum((1, 2)) / N2
            thetas.append(theta.detach())
            off += n
    loss = (w * (m * L.sum(2)).sum(1) / (E * D)).sum() / B
    loss.backward()
    mean_q = torch.stack(thetas).mean()
    return loss.detach(), x.grad, L.detach().sum((1, 2)) / (E * D), mean_q


# ---------------------------------------------------------------------------------------
# The loss of head groups (docs/combination-design.md): L = sum_g w_g L_g on one batch, w_0 = 1
# and w_g = c.aux[g - 1].loss_weight, each L_g the float64 reference of its group's loss type:
# tests/test_ensemble_loss.py's (C51, QR, MSE, Huber; E >= 1 members, bootstrap masks) or
# reference_iqn_loss above (IQN, members and masks too). The TD error and mean Q are group 0's.

def reference_groups_loss(c: DQNConfig, loss_types, qs, qs_next_online, qs_next_target, actions, rewards, dones,
                          gamma, v_min=-10.0, v_max=10.0, weights=None, masks=None, fractions=None):
    """sum_g w_g L_g in float64. Per group, one entry each: loss_types, qs / qs_next_online /
    qs_next_target (as the group's reference takes them), masks ([B, E_g] or None; None: none
    anywhere), fractions (an IQN group's online fractions [B, N_g], else None). Returns (loss,
    grad_qs: per group w_g d L_g / d q_g (autograd of L_g), td [B] and mean_q of group 0, the
    groups' losses L_g [G]), float64 on the CPU."""
    from test_ensemble_loss import reference as reference_ensemble_loss  # a test module: imported when used
    G = 1 + len(c.aux)
    masks = [None] * G if masks is None else list(masks)
    fractions = [None] * G if fractions is None else list(fractions)
    assert all(len(x) == G for x in (loss_types, qs, qs_next_online, qs_next_target, masks, fractions))
    loss_weights = [1.0] + [group.loss_weight for group in c.aux]
    total, grads, losses = torch.zeros((), dtype=torch.float64), [], []
    for g in range(G):
        args = (qs[g], qs_next_online[g], qs_next_target[g], actions, rewards, dones, c.branches)
        if loss_types[g] == "iqn":
            loss, grad, td, mean_q = reference_iqn_loss(*args, gamma, fractions[g], weights, masks[g])
        else:
            assert fractions[g] is None
            loss, grad, td, mean_q = reference_ensemble_loss(*args, loss_types[g], weights, masks[g], gamma=gamma,
                                                             v_min=v_min, v_max=v_max)
        total = total + loss_weights[g] * loss
        grads.append(loss_weights[g] * grad)
        losses.append(loss)
        if g == 0:
            td0, mean_q0 = td, mean_q
    return total, grads, td0, mean_q0, torch.stack(losses)

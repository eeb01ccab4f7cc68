"""Network configuration and the flat parameter layout every op of the package shares.

The network (docs/design.md), for L >= 1 trunk layers and H >= 0 hidden layers per head:

    trunk   h_i = relu(h_{i-1} W_si^T + b_si)     i = 1..L, h_0 = s        [B, T_i]
    heads   head layer 1: every head's first hidden layer as ONE matrix W_h1 on h_L
                (the value head's rows first, then each branch's);   [B, sum of the heads' widths]
            head layers 2..H: block-diagonal, head k reads its columns of the previous one;
    outputs v   = (value head's last columns) W_v^T + b_v                      [B, NA]
            a_d = (branch d's last columns) W_ad^T + b_ad                      [B, n_d*NA]
            (with H = 0 every output head reads h_L itself)
    dueling q_d[b, k, :] = v[b, :] + a_d[b, k, :] - mean_k a_d[b, k, :]
    without dueling (no value head) q_d = a_d.

An ensemble (``ensemble`` = E > 1) is E members on the one trunk, each a full head set (its
value head with dueling, one head per branch): every head list above runs over the E members'
heads, the value heads of members 0..E-1 first, then member 0's branch heads, member 1's, ...;
member e's dueling uses its own value head, and q holds member e's branches at rows e*A + off_d
(A = sum n_d). E = 1 is the network above, offsets and names included.

An IQN network (``iqn_embedding`` = n > 0; Dabney et al. 2018; docs/iqn-design.md) adds one layer
``phi`` (weight [T, n], bias [T], T = T_L) after the trunk and runs the heads on B * N rows, one
per (sample, fraction tau):

    c[b, i, k] = cos(pi k tau[b, i]), k = 0..n-1;   phi = relu(c W_phi^T + b_phi)   [B, N, T]
    z[b, i] = h_L[b] * phi[b, i] (elementwise)                                        [B * N, T]

and the head formulas above with z in place of h_L, one atom: q [B, E * A, N] holds action a's
value at fraction tau[b, i] in slot i.

Head groups (``DQNConfig(aux=(HeadGroup(...), ...))``; docs/combination-design.md; the ops run
one group at a time through ``ParamLayout.encode(group=g)``, the trunk-once kernels are not
built): G >= 1 head sets on the one trunk, group 0 the config's own, each aux group g = 1..G-1 a
full head set of its own kind (C51 / QR atoms, one-atom Q, or IQN with its own phi), members,
dueling and head depth, on the same branches. Each group reads h_L and gives its own q and head
logits, exactly as the one-group network of the trunk and that head set would
(``DQNConfig.group_config(g)``); the training loss is sum_g w_g L_g.

All parameters live in one flat buffer (F32 master, same offsets in the BF16 mirror, the
gradient and the Adam moments). It stores ``config.aligned()``: every hidden width rounded up to a
multiple of ``ALIGN``, the extra units zero (the same function); the ops see that network, so
their saved activations have its widths, and a weight view whose input width was rounded up is
strided (``ParamLayout.row_strides``). Each segment starts at a multiple of ``ALIGN`` elements, so
every weight matrix is 16-byte aligned in the BF16 mirror and 32-byte aligned in F32. The
heads' first-layer weights are adjacent rows of one matrix W_h1, each deeper head layer keeps
one bias vector for all heads, and all output biases are one vector b_out, so the CUDA path
runs them as one GEMM / one pass.

The per-layer names (``s1.weight``, ``v1.bias``, ``a1.0.weight``, ``a2.2.bias`` ...; ``q<j>.<d>``
for a branch head without dueling; member m's head layers prefixed ``e<m>.`` when E > 1:
``e0.v1.weight``, ``e2.a1.1.bias``; aux group g's layers prefixed ``g<g>.``: ``g1.phi.weight``,
``g2.e3.a2.1.bias``) are those of a plain ``nn.Linear`` network (``dqn_ops.rl.baseline.TorchQNet``),
so state dicts move between the two.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

ALIGN = 8  # elements; 16 bytes of BF16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _aligned(widths: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(_align(w) for w in widths)


# -- validation of the configs' fields (DQNConfig here, TrainerConfig in trainer.py) ----------
# Every error says "<Config>: <field> must be <what was expected>, got <what came>".

def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(config: str, field: str, value, minimum: Optional[int] = None) -> int:
    """An integer field: an int (or numpy integer; not a bool, not a float such as 2.0 or 2.5)
    of at least `minimum`. Returns it as an int."""
    bound = f" >= {minimum}" if minimum is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{config}: {field} must be an int{bound}, got {_got(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{config}: {field} must be{bound} (an int), got {value}")
    return value


def check_seed(config: str, seed) -> int:
    """A seed: an int whose low 64 bits key the Philox streams and seed torch.Generator, in
    [-2^63, 2^64) (torch.Generator's range). Returns it as an int."""
    seed = check_int(config, "seed", seed)
    if not -(1 << 63) <= seed < (1 << 64):
        raise ValueError(f"{config}: seed must be an int in [-2^63, 2^64) (a 64-bit key), got {seed}")
    return seed


def check_betas(config: str, betas) -> Tuple[float, float]:
    """Adam's (beta1, beta2), each in [0, 1), as a tuple of floats."""
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__iter__") or len(tuple(betas)) != 2:
        raise (ValueError if hasattr(betas, "__iter__") else TypeError)(
            f"{config}: betas must be a pair (beta1, beta2) of numbers in [0, 1), got {betas!r}")
    return tuple(check_float(config, f"betas[{i}]", b, low=0.0, high=1.0, high_open=True) for i, b in enumerate(betas))


def check_int_tuple(config: str, field: str, value, minimum: int, expected: str,
                    length: Optional[int] = None) -> Tuple[int, ...]:
    """A non-empty sequence of ints >= `minimum` (of `length` entries when given), as a tuple."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{config}: {field} must be {expected}, got {_got(value)}")
    items = tuple(value)
    if not items or (length is not None and len(items) != length):
        raise ValueError(f"{config}: {field} must be {expected}, got {items}")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{config}: {field} must be {expected}, got {items} (an entry {_got(x)})")
        if int(x) < minimum:
            raise ValueError(f"{config}: {field} must be {expected}, got {items}")
    return tuple(int(x) for x in items)


def check_float(config: str, field: str, value, low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False, high_open: bool = False, finite: bool = True) -> float:
    """A real-number field (int or float, not a bool), finite unless `finite` is False, within
    [low, high] (an open end where `low_open` / `high_open`). Returns it as a float."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    what = ("a finite number" if finite else "a number") + (" " + " and ".join(parts) if parts else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{config}: {field} must be {what}, got {_got(value)}")
    v = float(value)
    bad = math.isnan(v) or (finite and math.isinf(v))
    bad = bad or (low is not None and (v <= low if low_open else v < low))
    bad = bad or (high is not None and (v >= high if high_open else v > high))
    if bad:
        raise ValueError(f"{config}: {field} must be {what}, got {value!r}")
    return v


def check_bool(config: str, field: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{config}: {field} must be a bool (True or False), got {_got(value)}")
    return value


def check_choice(config: str, field: str, value, choices: Sequence, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or value not in choices:
        opts = " or ".join(repr(c) for c in choices) + (" or None" if allow_none else "")
        raise ValueError(f"{config}: {field} must be {opts}, got {value!r}")
    return value


# A head group's kind: the outputs its heads give and the loss types (dqn_loss's loss_type) that
# read them. 'q' is one atom per action (BDQ's MSE or Huber loss); 'iqn' one value per action at
# each quantile fraction the forward is given (its own phi layer).
HEAD_GROUP_KINDS = {"c51": ("c51",), "qr": ("qr",), "q": ("mse", "huber"), "iqn": ("iqn",)}


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """An extra head set on a network's trunk (``DQNConfig.aux``; docs/combination-design.md).

    Every head group reads the trunk's last layer h_L and is a full head set as ``DQNConfig``
    describes one (its members' value heads with dueling, one head per branch of the config's
    ``branches``, each with the hidden layers ``value_hidden`` / ``adv_hidden``); its outputs and
    its loss are its own, and the trunk's gradient is the sum of the groups' weighted ones.

    Args:
        kind: 'c51' (C51 atoms), 'qr' (QR-DQN quantiles), 'q' (one value per action: the MSE or
            Huber loss) or 'iqn' (an IQN head set: its own layer ``phi`` on the fractions it is
            given; Dabney et al. 2018).
        members: E >= 1 members (an ensemble of head sets within the group, as ``DQNConfig.ensemble``).
        atoms: the outputs per action: >= 2 for 'c51', >= 1 for 'qr', 1 for 'q' and 'iqn'.
            None: 51 for 'c51' and 'qr' (DQNConfig's default), 1 for 'q' and 'iqn'.
        dueling, value_hidden, adv_hidden: as ``DQNConfig``'s (value_hidden None: adv_hidden's
            widths with dueling, none without).
        iqn_embedding: the cosines phi embeds, >= 1 with kind 'iqn' (the paper's: 64), 0 with
            any other kind.
        loss_weight: w_g >= 0 (finite) of the group's loss in sum_g w_g L_g (group 0's weight
            is 1). 0 leaves the trunk to the other groups and the group's own heads without a
            gradient.

    After construction ``atoms`` and ``value_hidden`` hold the resolved values and
    ``loss_weight`` a float, so groups compare equal however they were written.
    """

    kind: str
    members: int = 1
    atoms: Optional[int] = None
    dueling: bool = True
    value_hidden: Optional[Tuple[int, ...]] = None
    adv_hidden: Tuple[int, ...] = (128,)
    iqn_embedding: int = 0
    loss_weight: float = 1.0

    def __post_init__(self):
        name = "HeadGroup"
        kind = check_choice(name, "kind", self.kind, tuple(HEAD_GROUP_KINDS))
        members = check_int(name, "members", self.members, minimum=1)
        one_atom = kind in ("q", "iqn")
        atoms = (1 if one_atom else 51) if self.atoms is None else check_int(name, "atoms", self.atoms, minimum=1)
        if one_atom and atoms != 1:
            raise ValueError(f"{name}: atoms must be 1 (or None) with kind {kind!r} (one value per action"
                             f"{' at each quantile fraction' if kind == 'iqn' else ''}), got {atoms}")
        if kind == "c51" and atoms < 2:
            raise ValueError(f"{name}: atoms must be >= 2 with kind 'c51' (the support's two ends at least), "
                             f"got {atoms}")
        iqn = check_int(name, "iqn_embedding", self.iqn_embedding, minimum=0)
        if kind == "iqn" and iqn < 1:
            raise ValueError(f"{name}: iqn_embedding must be >= 1 with kind 'iqn' (the cosines its phi layer embeds; "
                             f"the paper's: 64), got {iqn}")
        if kind != "iqn" and iqn != 0:
            raise ValueError(f"{name}: iqn_embedding must be 0 with kind {kind!r} (only an 'iqn' group has a phi "
                             f"layer), got {iqn}")
        dueling = check_bool(name, "dueling", self.dueling)
        value, adv = _head_stack(name, dueling, self.value_hidden, self.adv_hidden)
        weight = check_float(name, "loss_weight", self.loss_weight, low=0.0)
        for field, value_ in (("kind", kind), ("members", members), ("atoms", atoms), ("iqn_embedding", iqn),
                              ("dueling", dueling), ("value_hidden", value), ("adv_hidden", adv),
                              ("loss_weight", weight)):
            object.__setattr__(self, field, value_)

    def aligned(self) -> "HeadGroup":
        """This group with its hidden widths rounded up to a multiple of ALIGN (``DQNConfig.aligned``)."""
        return dataclasses.replace(self, value_hidden=_aligned(self.value_hidden), adv_hidden=_aligned(self.adv_hidden))

    @property
    def loss_types(self) -> Tuple[str, ...]:
        """The loss types (dqn_loss's loss_type) that fit this group's outputs."""
        return HEAD_GROUP_KINDS[self.kind]

    def check_loss_type(self, owner: str, field: str, loss_type: str, g: int) -> None:
        """A ValueError "<owner>: <field> must be ... (group g is a '<kind>' group), got ..." unless
        ``loss_type`` is one of ``loss_types`` (this group is head group g)."""
        if loss_type not in self.loss_types:
            raise ValueError(f"{owner}: {field} must be " + " or ".join(map(repr, self.loss_types)) +
                             f" (group {g} is a {self.kind!r} group), got {loss_type!r}")


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """Sizes of a branching, distributional Q-network, dueling or not.

    The defaults are the reference configuration of docs/design.md (287,998 parameters).

    Args:
        state_dim: width of an observation.
        trunk_hidden: the shared trunk's layer widths (one or more layers).
        value_hidden: the value head's hidden widths (zero or more layers; an int is one layer).
            None: the same widths as ``adv_hidden`` with dueling, none without. The value and
            branch heads have the same number of layers (the kernels run them side by side).
        adv_hidden: each branch head's hidden widths (zero or more layers; an int is one layer):
            the advantage stream with dueling, the Q head without.
        atoms: support size of the return distribution (C51); 1 gives plain Q-values.
        branches: the action count of each action branch.
        dueling: a value head plus per-branch advantages (BDQ's local-mean aggregation), or
            (False) one Q head per branch and no value head.
        ensemble: E >= 1 members sharing the trunk, each with its own heads (value head and
            branch heads); q holds the members' Q logits one after the other ([B, E * sum n_d, NA]).
            1: the plain network.
        iqn_embedding: n >= 0; n > 0 makes an IQN network (Implicit Quantile Networks): a layer
            ``phi`` [T_L, n] embeds the cosines cos(pi k tau), k = 0..n-1, of each quantile
            fraction tau, and the heads run on h_L * phi(tau) (the module docstring). Each
            (sample, fraction) gives one value per action, so atoms must be 1. The paper's n: 64.
            0: no IQN.
        aux: extra head groups on the same trunk (``HeadGroup``s; docs/combination-design.md):
            group 0 is this config's own head set (the fields above; acting, the TD error and
            mean Q are its), groups 1..G-1 the entries of ``aux``, each reading h_L with heads,
            outputs and a loss of its own. Each group runs through its own layout view
            (``ParamLayout.encode(group=g)``); ``Trainer`` and ``TorchTrainer`` train such
            networks. (): the one-group network, unchanged.

    The sizes below (``num_heads``, ``q_rows``, ``head_out``, ``hidden_widths`` ...) are group 0's,
    what the ops' one-group layout describes; ``group_config(g)`` is group g's network alone, and
    ``num_parameters`` counts every group's.

    After construction ``value_hidden`` holds the resolved widths (a tuple), so configs compare
    equal however they were written. ``dataclasses.replace`` keeps them: pass
    ``value_hidden=None`` with a new ``adv_hidden`` or ``dueling`` to derive them again.
    """

    state_dim: int = 96
    trunk_hidden: Tuple[int, ...] = (256, 256)
    value_hidden: Optional[Tuple[int, ...]] = None
    adv_hidden: Tuple[int, ...] = (128,)
    atoms: int = 51
    branches: Tuple[int, ...] = (3, 3, 3)
    dueling: bool = True
    ensemble: int = 1
    iqn_embedding: int = 0
    aux: Tuple[HeadGroup, ...] = ()

    def __post_init__(self):
        name = "DQNConfig"
        for field in ("state_dim", "atoms", "ensemble"):
            object.__setattr__(self, field, check_int(name, field, getattr(self, field), minimum=1))
        iqn = check_int(name, "iqn_embedding", self.iqn_embedding, minimum=0)
        if iqn > 0 and self.atoms != 1:
            # IQN's distribution lies in the fractions a forward is given, not in output atoms.
            raise ValueError(f"{name}: atoms must be 1 with iqn_embedding={iqn} (an IQN network gives one value per "
                             f"action at each quantile fraction it is given), got {self.atoms}")
        object.__setattr__(self, "iqn_embedding", iqn)
        dueling = check_bool(name, "dueling", self.dueling)
        trunk = check_int_tuple(name, "trunk_hidden", self.trunk_hidden, minimum=1,
                                expected="one or more widths >= 1 (a tuple of ints)")
        value, adv = _head_stack(name, dueling, self.value_hidden, self.adv_hidden)
        branches = check_int_tuple(name, "branches", self.branches, minimum=1,
                                   expected="a non-empty tuple of action counts >= 1 (ints)")
        expected = "a tuple of dqn_ops.HeadGroup (possibly empty)"
        if isinstance(self.aux, (str, bytes, HeadGroup)) or not hasattr(self.aux, "__iter__"):
            raise TypeError(f"{name}: aux must be {expected}, got {_got(self.aux)}")
        aux = tuple(self.aux)
        for k, group in enumerate(aux):
            if not isinstance(group, HeadGroup):
                raise TypeError(f"{name}: aux must be {expected}, got an entry {k} {_got(group)}")
        for field, value_ in (("trunk_hidden", trunk), ("value_hidden", value), ("adv_hidden", adv),
                              ("branches", branches), ("dueling", dueling), ("aux", aux)):
            object.__setattr__(self, field, value_)

    @classmethod
    def from_dict(cls, d: dict) -> "DQNConfig":
        """The config ``dataclasses.asdict(config)`` made ``d`` from (a checkpoint's
        ``net_config``): its ``aux`` entries, dicts there, become ``HeadGroup``s again."""
        d = dict(d)
        d["aux"] = tuple(HeadGroup(**g) if isinstance(g, dict) else g for g in d.get("aux", ()))
        return cls(**d)

    def aligned(self) -> "DQNConfig":
        """The network the flat buffer stores and the kernels run: this one with every hidden
        width (the trunk's, every head layer's, every head group's) rounded up to a multiple of
        ALIGN. Its extra units have zero weights in and out and a zero bias: their activation is
        relu(0) = 0 and their gradients are zero (the ReLU's at 0 included), so training keeps
        them zero and the network computes this one's function on finite inputs (an infinite
        state makes an extra unit's 0 * inf a NaN). The point: every weight row that reads a
        hidden layer and every hidden activation row is then a multiple of 16 bytes in BF16,
        which cuBLAS's Hopper kernels need (widths such as CleanRL's 84 sent it to slower Ampere
        kernels). The states and the IQN cosines keep their widths (so do the first layer's and
        phi's weight rows). A config whose widths are multiples of ALIGN is its own."""
        return dataclasses.replace(self, trunk_hidden=_aligned(self.trunk_hidden),
                                   value_hidden=_aligned(self.value_hidden), adv_hidden=_aligned(self.adv_hidden),
                                   aux=tuple(group.aligned() for group in self.aux))

    @property
    def num_branches(self) -> int:
        return len(self.branches)

    @property
    def total_actions(self) -> int:
        return sum(self.branches)

    @property
    def members(self) -> int:
        """Ensemble members (E): each a value head (with dueling) and one head per branch."""
        return self.ensemble

    @property
    def q_rows(self) -> int:
        """Rows of the Q logits: E * sum n_d (member e's branches at rows e * A + off_d)."""
        return self.members * self.total_actions

    @property
    def iqn(self) -> bool:
        """Whether this is an IQN network (iqn_embedding > 0: the phi layer after the trunk)."""
        return self.iqn_embedding > 0

    @property
    def num_groups(self) -> int:
        """Head groups (G): group 0 (this config's own head set) and the ``aux`` groups."""
        return 1 + len(self.aux)

    @property
    def loss_weights(self) -> Tuple[float, ...]:
        """Each group's weight w_g in the loss sum_g w_g L_g: 1 for group 0, then the aux groups'."""
        return (1.0,) + tuple(group.loss_weight for group in self.aux)

    def check_group(self, where: str, group) -> int:
        """``group`` as the index of one of this config's head groups, or a ValueError naming
        ``where`` (the forward's and the steps' ``group`` arguments)."""
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise ValueError(f"{where}: group must be an int in [0, {self.num_groups}) (the head groups), "
                             f"got {group!r}")
        return group

    def group_config(self, g: int) -> "DQNConfig":
        """Group g's network alone: the trunk with that group's head set and nothing else (g = 0:
        this config without ``aux``). Group g of the network computes exactly what this one-group
        network computes on the same trunk and head weights."""
        check_int("DQNConfig.group_config", "g", g, minimum=0)
        if g >= self.num_groups:
            raise ValueError(f"DQNConfig.group_config: g must be < {self.num_groups} (the head groups), got {g}")
        if g == 0:
            return dataclasses.replace(self, aux=())
        group = self.aux[g - 1]
        return DQNConfig(state_dim=self.state_dim, trunk_hidden=self.trunk_hidden, value_hidden=group.value_hidden,
                         adv_hidden=group.adv_hidden, atoms=group.atoms, branches=self.branches,
                         dueling=group.dueling, ensemble=group.members, iqn_embedding=group.iqn_embedding)

    @property
    def num_heads(self) -> int:
        """Output heads, in head order: the E value heads (with dueling), then member 0's branch
        heads, member 1's, ..."""
        return self.members * (int(self.dueling) + self.num_branches)

    @property
    def head_depth(self) -> int:
        """Hidden layers of each head (H)."""
        return len(self.adv_hidden)

    def head_widths(self, j: int) -> Tuple[int, ...]:
        """Width of each head's j-th hidden layer (j = 0 .. H-1), in head order."""
        E = self.members
        return ((self.value_hidden[j],) * E if self.dueling else ()) + (self.adv_hidden[j],) * (E * self.num_branches)

    def head_out_widths(self) -> Tuple[int, ...]:
        """Width of each output head's logits, in head order: NA per value head, then n_d * NA
        per branch head."""
        E = self.members
        return ((self.atoms,) * E if self.dueling else ()) + tuple(n * self.atoms for n in self.branches) * E

    @property
    def hidden_widths(self) -> Tuple[int, ...]:
        """Width of every hidden activation, in forward order: the trunk layers, then each head
        layer (all heads side by side). The activations the ops save for the backward are the
        states and these."""
        return self.trunk_hidden + tuple(sum(self.head_widths(j)) for j in range(self.head_depth))

    @property
    def head_out(self) -> int:
        """Width of the raw output logits: per member, NA value logits (with dueling) + n_d*NA per branch."""
        return sum(self.head_out_widths())

    @property
    def head_ld(self) -> int:
        """Row length of the CUDA kernels' padded output logits (csrc/layout.h, NetLayout::head_ld):
        each head's logits start at a multiple of ALIGN columns."""
        return sum(_align(w) for w in self.head_out_widths())

    @property
    def num_parameters(self) -> int:
        """Every parameter of the network, every head group's included."""
        return sum(shape_numel(s) for _, s, _ in ParamLayout(self).tensors)


def _head_stack(config: str, dueling: bool, value_hidden, adv_hidden) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """A head set's (value_hidden, adv_hidden), checked: value_hidden None is adv_hidden's widths
    with dueling and () without; with dueling both have the same depth."""
    adv = _head_widths(config, "adv_hidden", adv_hidden)
    if value_hidden is None:
        return (adv if dueling else ()), adv
    value = _head_widths(config, "value_hidden", value_hidden)
    if not dueling and value:
        raise ValueError(f"{config}: value_hidden must be None or () with dueling=False (no value head), "
                         f"got {value}")
    if dueling and len(value) != len(adv):
        raise ValueError(f"{config}: value_hidden and adv_hidden must have the same number of layers "
                         f"(the kernels run the heads' layers side by side), got {value} and {adv}")
    return value, adv


def _head_widths(config: str, field: str, value) -> Tuple[int, ...]:
    """A head's hidden widths: an int (one layer) or a possibly empty sequence of ints >= 1."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (check_int(config, field, value, minimum=1),)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{config}: {field} must be an int >= 1 or a tuple of widths >= 1 (possibly empty), "
                        f"got {_got(value)}")
    items = tuple(value)
    if not items:
        return ()
    return check_int_tuple(config, field, items, minimum=1,
                           expected="an int >= 1 or a tuple of widths >= 1 (possibly empty)")


def shape_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# The first entry of ParamLayout.encode(): a layout of another format (a stale one, or one
# written by hand) fails csrc/layout.h's check with a clear error instead of being misread.
LAYOUT_FORMAT = 4
# The first entry of ParamLayout.encode(group=g) for a network with head groups: the same entries
# as LAYOUT_FORMAT's for the trunk and group g's heads, at their offsets in the whole buffer.
GROUP_VIEW_FORMAT = 5


class ParamLayout:
    """Offsets of every segment of the flat parameter buffer.

    Segments, in buffer order: each trunk layer's weight W_s<i>; the heads' first layer W_h1
    (rows in head order); for each deeper head layer j, one weight W_h<j>.<k> per head k; one
    output weight W_out<k> per head; then the biases b_s<i>, b_h<j> (all heads of layer j in one
    vector) and b_out (every head's output bias). Head order (``DQNConfig.num_heads`` heads): the
    value heads of members 0..E-1 (with dueling), then member 0's branch heads 0..D-1, member
    1's, ... (same-shape heads adjacent with equal strides, so each kind runs as one batched
    GEMM: csrc/layout.h, block_groups). An IQN network (``iqn_embedding`` > 0) has W_phi
    [T_L, n] right after the trunk's weights and b_phi right after the trunk's biases (view
    ``phi``, after ``s<L>`` in every list of layers).

    Head groups (``DQNConfig.aux``): everything above is group 0's, at the offsets the config
    without ``aux`` has; then each aux group g = 1..G-1 in turn: its W_phi (IQN), head-layer and
    output weights, then its b_phi, b_h<j> and b_out, each segment as the one-group network
    ``config.aligned().group_config(g)`` has it, named with the prefix ``g<g>.`` (``g1.W_h1``,
    ``g2.W_out3``), as are its views (``g1.phi.weight``, ``g2.e3.a2.1.bias``; listed after group
    0's in ``tensors``, ``layers()`` and ``weight_matrices()``).

    ``encode()`` gives the ``int[] layout`` argument of the ops:

        [LAYOUT_FORMAT, state_dim, atoms, dueling, E, n (iqn_embedding, 0: none), D, n_1..n_D,
         L, T_1..T_L, H, (value widths V_1..V_H with dueling), branch widths A_1..A_H,
         per trunk layer: W_s<i>, b_s<i>;  with n > 0: W_phi, b_phi;  with H >= 1: W_h1, b_h1;
         per head layer j = 2..H: W_h<j>.<k> for each head k, b_h<j>;
         W_out<k> for each head k, b_out;  numel]

    A network with head groups has one such list per group, ``encode(group=g)``: the same entries
    for the trunk and group g's heads (the network ``config.group_config(g)``) under the first entry
    ``GROUP_VIEW_FORMAT``, with their offsets in the whole buffer and its length.

    The C++ side validates it (csrc/layout.h) rather than recomputing it, so this class is the
    one source of truth.
    """

    def __init__(self, config: DQNConfig):
        self.config = c = config
        # Each group's one-group network (group_configs[0]: the config without aux): a group's
        # views are that network's head part.
        self.group_configs: List[DQNConfig] = [c.group_config(g) for g in range(c.num_groups)]
        # The network the buffer stores (config.aligned(): every hidden width rounded up to ALIGN,
        # the extra units zero): the segments, their offsets and encode() are its; the views are
        # this config's layers inside them.
        s = c.aligned()
        self._stored_groups: List[DQNConfig] = [s.group_config(g) for g in range(s.num_groups)]
        trunk_in = (s.state_dim,) + s.trunk_hidden
        weights, biases = _head_segments(self._stored_groups[0], "")
        segments = [(f"W_s{i + 1}", (s.trunk_hidden[i], trunk_in[i])) for i in range(len(s.trunk_hidden))]
        segments += weights
        segments += [(f"b_s{i + 1}", (w,)) for i, w in enumerate(s.trunk_hidden)]
        segments += biases
        for g in range(1, s.num_groups):  # after all of group 0: its offsets are the one-group network's
            weights, biases = _head_segments(self._stored_groups[g], group_prefix(g))
            segments += weights + biases
        self.segments: Dict[str, Tuple[int, Tuple[int, ...]]] = {}
        off = 0
        for name, shape in segments:
            self.segments[name] = (off, shape)
            # An output head's weight gets rows up to a multiple of 8 (zero, outside every
            # view): the CUDA kernels run its GEMMs on the padded sizes, which keeps cuBLAS on
            # aligned tensor-core kernels (51 or 153 rows sent it to align-1 kernels, 2-10x
            # slower; bench/NOTES.md). csrc/layout.h checks the reservation.
            bare = name.split(".", 1)[1] if name.startswith("g") else name  # without an aux group's 'g<g>.'
            rows = _align(shape[0]) if bare.startswith("W_out") else shape[0]
            off = _align(off + rows * shape_numel(shape[1:]))
        self.numel = off
        stored = {name: (offset, shape) for name, shape, offset in self._views(s, self._stored_groups)}
        self.tensors: List[Tuple[str, Tuple[int, ...], int]] = [
            (name, shape, stored[name][0]) for name, shape, _ in self._views(c, self.group_configs)]
        # Each weight's row stride in the buffer: its stored input width (its own unless rounded up).
        self.row_strides: Dict[str, int] = {name: stored[name][1][1] for name, shape, _ in self.tensors
                                            if len(shape) == 2}

    def __setstate__(self, state: dict):
        self.__dict__.update(state)
        if "row_strides" not in state:
            # Pickled before the buffer stored the aligned network: its buffer stores the config
            # itself, every view contiguous (the offsets and encode() it was made with).
            self._stored_groups = list(self.group_configs)
            self.row_strides = {name: shape[1] for name, shape, _ in self.tensors if len(shape) == 2}

    def views(self, flat) -> Dict[str, "torch.Tensor"]:
        """Each layer's weight and bias as a view of ``flat`` (``numel`` elements laid out as this
        layout says), keyed like nn.Linear's: a weight [out, in] with row stride
        ``row_strides[name]`` (in itself unless the stored width was rounded up), a bias [out]."""
        views = {}
        for name, shape, off in self.tensors:
            if len(shape) == 1:
                views[name] = flat[off:off + shape[0]]
            else:
                rows, cols = shape
                ld = self.row_strides[name]
                views[name] = flat[off:off + rows * ld].view(rows, ld)[:, :cols]
        return views

    def head_names(self, group: int = 0) -> List[str]:
        """Each head's name prefix in a group, in head order: 'v', then 'a.<d>' (dueling) or
        'q.<d>'; with E > 1 each prefixed by its member: 'e0.v', 'e1.v', ..., 'e0.a.0', 'e0.a.1',
        'e1.a.0', ...; an aux group's prefixed 'g<group>.': 'g1.v', 'g2.e0.q.1'."""
        c, prefix = self.group_configs[group], group_prefix(group)
        stream = "a" if c.dueling else "q"
        member = (lambda m: f"e{m}.") if c.members > 1 else (lambda m: "")
        values = [f"{member(m)}v" for m in range(c.members)] if c.dueling else []
        return [prefix + head for head in
                values + [f"{member(m)}{stream}.{d}" for m in range(c.members) for d in range(c.num_branches)]]

    @staticmethod
    def head_layer_name(head: str, layer: int) -> str:
        """The nn.Linear name of a head's layer (1-based; the output layer is H + 1): 'v2', 'a1.0',
        'e1.a2.0', 'g1.e1.a2.0'."""
        parts = head.split(".")
        i = 0  # the group and member prefixes ('g1', 'e0') come before the stream
        while parts[i][:1] in ("e", "g") and parts[i][1:].isdigit():
            i += 1
        return ".".join(parts[:i] + [f"{parts[i]}{layer}"] + parts[i + 1:])

    def _views(self, c: DQNConfig, groups: List[DQNConfig]) -> List[Tuple[str, Tuple[int, ...], int]]:
        """Per-layer views of network `c` (the config or the stored one; `groups` its group
        configs), named as in a plain nn.Linear network: (name, shape, offset); the offsets are
        the stored network's segments' (the config's own shapes sit at the same offsets)."""
        seg = self.segments
        t: List[Tuple[str, Tuple[int, ...], int]] = []
        trunk_in = (c.state_dim,) + c.trunk_hidden
        for i, width in enumerate(c.trunk_hidden):
            t += [(f"s{i + 1}.weight", (width, trunk_in[i]), seg[f"W_s{i + 1}"][0]),
                  (f"s{i + 1}.bias", (width,), seg[f"b_s{i + 1}"][0])]
        for g in range(c.num_groups):
            t += self._group_views(groups[g], g)
        return t

    def _group_views(self, c: DQNConfig, group: int) -> List[Tuple[str, Tuple[int, ...], int]]:
        """Group `group`'s views (`c` its one-group network): its phi (IQN), then head by head its layers."""
        p, seg = group_prefix(group), self.segments
        t: List[Tuple[str, Tuple[int, ...], int]] = []
        if c.iqn:
            shape = (c.trunk_hidden[-1], c.iqn_embedding)
            t += [(p + "phi.weight", shape, seg[p + "W_phi"][0]), (p + "phi.bias", shape[:1], seg[p + "b_phi"][0])]
        H = c.head_depth
        # Head k's layer j: its rows of the layer's weight (W_h1's rows after the heads before
        # it; a segment of its own deeper down) and its columns of the layer's bias.
        for k, head in enumerate(self.head_names(group)):
            for j in range(H):
                widths = c.head_widths(j)
                inputs = c.head_widths(j - 1) if j else (c.trunk_hidden[-1],) * c.num_heads
                row = sum(widths[:k])
                w = seg[p + "W_h1"][0] + row * inputs[k] if j == 0 else seg[f"{p}W_h{j + 1}.{k}"][0]
                name = self.head_layer_name(head, j + 1)
                t += [(f"{name}.weight", (widths[k], inputs[k]), w),
                      (f"{name}.bias", (widths[k],), seg[f"{p}b_h{j + 1}"][0] + row)]
            last = c.head_widths(H - 1)[k] if H else c.trunk_hidden[-1]
            out = c.head_out_widths()
            name = self.head_layer_name(head, H + 1)
            t += [(f"{name}.weight", (out[k], last), seg[f"{p}W_out{k}"][0]),
                  (f"{name}.bias", (out[k],), seg[p + "b_out"][0] + sum(out[:k]))]
        return t

    def layers(self) -> List[Tuple[str, Tuple[int, int]]]:
        """Each nn.Linear layer's name and weight shape (out, in), in the order of weight_matrices():
        ('s1', (256, 96)), ..., ('a2.2', (153, 128))."""
        return [(name[:-len(".weight")], shape) for name, shape, _ in self.weight_matrices()]

    def weight_matrices(self) -> List[Tuple[str, Tuple[int, int], int]]:
        """The per-layer weight matrices (10 for the reference config): (name, shape, offset)."""
        return [(n, s, o) for n, s, o in self.tensors if n.endswith(".weight")]

    def encode(self, group: Optional[int] = None) -> List[int]:
        """The ops' ``int[] layout``. A network with head groups (``DQNConfig.aux``) has one per
        group: ``encode(group=g)`` (format ``GROUP_VIEW_FORMAT``) describes the trunk and group g's
        heads at their offsets in the whole buffer, the network ``config.group_config(g)`` is; the
        ops run that group alone, and their gradient is zero on the other groups' parameters (the
        training step adds the groups' weighted gradients: ``dqn_ops.step.GroupsStep``)."""
        c = self.config
        if group is None:
            if c.aux:
                raise ValueError(
                    f"ParamLayout.encode: a network with head groups (DQNConfig.aux: {len(c.aux)} beside group 0) has "
                    f"one layout per group: encode(group=g) for g in range({c.num_groups}) (each the trunk and that "
                    f"group's heads)")
            group = 0
        group = check_int("ParamLayout.encode", "group", group, minimum=0)
        if group >= c.num_groups:
            raise ValueError(f"ParamLayout.encode: group must be < {c.num_groups} (the head groups), got {group}")
        g, p, seg = self._stored_groups[group], group_prefix(group), self.segments
        H = g.head_depth
        sizes = [GROUP_VIEW_FORMAT if c.aux else LAYOUT_FORMAT, g.state_dim, g.atoms, int(g.dueling), g.members,
                 g.iqn_embedding, g.num_branches, *g.branches,
                 len(g.trunk_hidden), *g.trunk_hidden, H, *(g.value_hidden if g.dueling else ()), *g.adv_hidden]
        offsets: List[int] = []
        for i in range(len(g.trunk_hidden)):
            offsets += [seg[f"W_s{i + 1}"][0], seg[f"b_s{i + 1}"][0]]
        if g.iqn:
            offsets += [seg[p + "W_phi"][0], seg[p + "b_phi"][0]]
        if H >= 1:
            offsets += [seg[p + "W_h1"][0], seg[p + "b_h1"][0]]
        for j in range(1, H):
            offsets += [seg[f"{p}W_h{j + 1}.{k}"][0] for k in range(g.num_heads)] + [seg[f"{p}b_h{j + 1}"][0]]
        offsets += [seg[f"{p}W_out{k}"][0] for k in range(g.num_heads)] + [seg[p + "b_out"][0]]
        return sizes + offsets + [self.numel]


def group_prefix(g: int) -> str:
    """The prefix of head group g's segment and layer names: '' for group 0, 'g<g>.' for an aux group."""
    return f"g{g}." if g else ""


def _head_segments(c: DQNConfig, prefix: str) -> Tuple[List[Tuple[str, Tuple[int, ...]]],
                                                       List[Tuple[str, Tuple[int, ...]]]]:
    """The head part of a one-group network's segments, (weights, biases) in buffer order, named
    with `prefix`: W_phi (IQN), W_h1, W_h<j>.<k>, W_out<k>; b_phi, b_h<j>, b_out."""
    heads, H = c.num_heads, c.head_depth
    head_in = c.trunk_hidden[-1]
    weights: List[Tuple[str, Tuple[int, ...]]] = []
    if c.iqn:  # phi's output z = h_L * phi has h_L's width: the heads read it as they read h_L
        weights.append(("W_phi", (head_in, c.iqn_embedding)))
    if H >= 1:
        weights.append(("W_h1", (sum(c.head_widths(0)), head_in)))
    for j in range(1, H):
        weights += [(f"W_h{j + 1}.{k}", (c.head_widths(j)[k], c.head_widths(j - 1)[k])) for k in range(heads)]
    last = c.head_widths(H - 1) if H >= 1 else (head_in,) * heads
    weights += [(f"W_out{k}", (w, last[k])) for k, w in enumerate(c.head_out_widths())]
    biases = [("b_phi", (head_in,))] if c.iqn else []
    biases += [(f"b_h{j + 1}", (sum(c.head_widths(j)),)) for j in range(H)]
    biases.append(("b_out", (c.head_out,)))
    return [(prefix + n, s) for n, s in weights], [(prefix + n, s) for n, s in biases]


def decode_config(layout: Sequence[int]) -> DQNConfig:
    """The DQNConfig whose ``ParamLayout(...).encode()`` is this layout: its sizes, and then its
    offsets and length as ParamLayout places them (the fake kernels' check; csrc/layout.h checks
    that the offsets it reads are aligned, inside the buffer and disjoint)."""
    v = [int(x) for x in layout]

    def fail(why: str):
        raise ValueError(f"layout: expected the int[] from dqn_ops.ParamLayout.encode() (format {LAYOUT_FORMAT}), "
                         f"{why}")

    if len(v) < 7 or v[0] not in (LAYOUT_FORMAT, GROUP_VIEW_FORMAT):
        fail(f"got {v[:5]}{'...' if len(v) > 5 else ''}")
    p = 1
    state_dim, atoms, dueling, E, iqn, D = v[p:p + 6]
    p += 6
    if dueling not in (0, 1) or E < 1 or iqn < 0 or D < 1 or len(v) < p + D + 1:
        fail(f"got dueling={dueling}, {E} members, IQN embedding {iqn}, {D} branches in {len(v)} entries")
    branches = tuple(v[p:p + D])
    p += D
    L = v[p]
    trunk = tuple(v[p + 1:p + 1 + L])
    p += 1 + L
    if L < 1 or len(v) < p + 1:
        fail(f"got {L} trunk layers in {len(v)} entries")
    H = v[p]
    p += 1
    value = tuple(v[p:p + H]) if dueling else ()
    p += H if dueling else 0
    adv = tuple(v[p:p + H])
    if H < 0 or len(v) < p + H:
        fail(f"got {H} head layers in {len(v)} entries")
    config = DQNConfig(state_dim=state_dim, trunk_hidden=trunk, value_hidden=value, adv_hidden=adv, atoms=atoms,
                       branches=branches, dueling=bool(dueling), ensemble=E, iqn_embedding=iqn)
    # The offsets csrc/layout.h reads after the sizes: ParamLayout, the one place that computes
    # them, gives the only ones the ops are documented to take.
    one_group = ParamLayout(config)
    expected = one_group.encode()
    if len(v) != len(expected):
        fail(f"{len(expected)} entries for these sizes, got {len(v)}")
    if v[0] == GROUP_VIEW_FORMAT:
        # A head group of a larger buffer: its offsets are the whole network's, which this list
        # does not describe; checked as csrc/layout.h checks them (aligned, inside, disjoint).
        _check_group_view_offsets(one_group, expected, v[p + H:-1], v[-1], fail)
        return config
    if v != expected:
        i = next(i for i, (a, b) in enumerate(zip(v, expected)) if a != b)
        what = "the buffer length" if i == len(v) - 1 else "an offset" if i >= p + H else "a size"
        fail(f"entry {i} ({what}) {expected[i]} for these sizes, got {v[i]}")
    return config


def _check_group_view_offsets(one_group: "ParamLayout", placed: Sequence[int], offsets: Sequence[int], numel: int,
                              fail) -> None:
    """A group view's offsets (in the order encode() writes them, which is the order of the
    offsets in ``placed``, ``one_group.encode()``: the one-group network of the same sizes) against
    its buffer length: each segment aligned, inside the buffer and disjoint from the others, an
    output head's weight with its rows padded to a multiple of 8, as csrc/layout.h checks every
    layout."""
    by_offset = {off: (name, shape) for name, (off, shape) in one_group.segments.items()}
    extents = []
    for got, at in zip(offsets, placed[len(placed) - 1 - len(offsets):-1]):
        name, shape = by_offset[at]
        rows = _align(shape[0]) if name.startswith("W_out") else shape[0]
        length = rows * shape_numel(shape[1:])
        if got < 0 or got % ALIGN != 0:
            fail(f"segment {name}'s offset {got} is not a non-negative multiple of {ALIGN}")
        if got + length > numel:
            fail(f"segment {name} [{got}, {got + length}) lies outside the buffer of {numel} elements")
        extents.append((got, got + length, name))
    extents.sort()
    for (a0, a1, a), (b0, _, b) in zip(extents, extents[1:]):
        if a1 > b0:
            fail(f"segments {a} at {a0} and {b} at {b0} overlap")

"""Network configuration and the flat parameter layout every op of the package shares.

The network (docs/design.md):

    trunk   h1 = relu(s  W_s1^T + b_s1)          [B, SH1]
            h2 = relu(h1 W_s2^T + b_s2)          [B, SH2]
    heads   hh = relu(h2 W_h1^T + b_h1)          [B, VH + D*AH]    value and every branch's
                                                                  first layer as ONE matrix
    outputs v  = hh[:, value] W_v2^T + b_v2      [B, NA]
            a_d = hh[:, branch d] W_a2d^T + b_a2d [B, n_d*NA]
    dueling q_d[b, k, :] = v[b, :] + a_d[b, k, :] - mean_k a_d[b, k, :]

All parameters live in one flat buffer (F32 master, same offsets in the BF16 mirror, the
gradient and the Adam moments). Each segment starts at a multiple of ``ALIGN`` elements, so
every weight matrix is 16-byte aligned in the BF16 mirror and 32-byte aligned in F32. The
value head's and the branches' first-layer weights are adjacent rows of one matrix W_h1, and
all output biases are one vector b_out, so the CUDA path runs them as one GEMM / one pass.

The per-layer names (``s1.weight``, ``v1.bias``, ``a1.0.weight``, ``a2.2.bias`` ...) are
those of a plain ``nn.Linear`` network (the anchor step of docs/design.md), so state dicts move
between the two.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple

ALIGN = 8  # elements; 16 bytes of BF16


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


@dataclasses.dataclass(frozen=True)
class DQNConfig:
    """Sizes of a dueling, branching, distributional Q-network.

    The defaults are the reference configuration of docs/design.md (287,998 parameters).
    ``atoms=1`` gives plain (non-distributional) Q-values.
    """

    state_dim: int = 96
    trunk_hidden: Tuple[int, int] = (256, 256)
    value_hidden: int = 128
    adv_hidden: int = 128
    atoms: int = 51
    branches: Tuple[int, ...] = (3, 3, 3)

    def __post_init__(self):
        name = "DQNConfig"
        for field in ("state_dim", "value_hidden", "adv_hidden", "atoms"):
            object.__setattr__(self, field, check_int(name, field, getattr(self, field), minimum=1))
        trunk = check_int_tuple(name, "trunk_hidden", self.trunk_hidden, minimum=1, length=2,
                                expected="2 widths >= 1 (a tuple of 2 ints)")
        branches = check_int_tuple(name, "branches", self.branches, minimum=1,
                                   expected="a non-empty tuple of action counts >= 1 (ints)")
        object.__setattr__(self, "trunk_hidden", trunk)
        object.__setattr__(self, "branches", branches)

    @property
    def num_branches(self) -> int:
        return len(self.branches)

    @property
    def total_actions(self) -> int:
        return sum(self.branches)

    @property
    def head_hidden(self) -> int:
        """Width of the merged first head layer: value hidden + every branch's hidden."""
        return self.value_hidden + self.num_branches * self.adv_hidden

    @property
    def head_out(self) -> int:
        """Width of the raw output logits: NA value logits + n_d*NA per branch."""
        return self.atoms * (1 + self.total_actions)

    @property
    def head_ld(self) -> int:
        """Row length of the CUDA kernels' padded output logits (csrc/layout.h, NetLayout::head_ld):
        each head's logits start at a multiple of ALIGN columns."""
        return _align(self.atoms) + sum(_align(self.atoms * n) for n in self.branches)

    @property
    def num_parameters(self) -> int:
        return sum(shape_numel(s) for _, s, _ in ParamLayout(self).tensors)


def shape_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class ParamLayout:
    """Offsets of every segment of the flat parameter buffer.

    ``encode()`` gives the ``int[] layout`` argument of the ops: the sizes, then the segment
    offsets, then the buffer length. The C++ side validates it (csrc/layout.h) rather than
    recomputing it, so this class is the one source of truth.
    """

    def __init__(self, config: DQNConfig):
        self.config = c = config
        sd, (sh1, sh2), vh, ah, na = c.state_dim, c.trunk_hidden, c.value_hidden, c.adv_hidden, c.atoms
        segments = [("W_s1", (sh1, sd)), ("W_s2", (sh2, sh1)), ("W_h1", (c.head_hidden, sh2)),
                    ("W_out0", (na, vh))]
        segments += [(f"W_out{d + 1}", (n * na, ah)) for d, n in enumerate(c.branches)]
        segments += [("b_s1", (sh1,)), ("b_s2", (sh2,)), ("b_h1", (c.head_hidden,)), ("b_out", (c.head_out,))]
        self.segments: Dict[str, Tuple[int, Tuple[int, ...]]] = {}
        off = 0
        for name, shape in segments:
            self.segments[name] = (off, shape)
            # An output head's weight gets rows up to a multiple of 8 (zero, outside every
            # view): the CUDA kernels run its GEMMs on the padded sizes, which keeps cuBLAS on
            # aligned tensor-core kernels (51 or 153 rows sent it to align-1 kernels, 2-10x
            # slower; bench/NOTES.md). csrc/layout.h checks the reservation.
            rows = _align(shape[0]) if name.startswith("W_out") else shape[0]
            off = _align(off + rows * shape_numel(shape[1:]))
        self.numel = off

        # Per-layer views, named as in a plain nn.Linear network: (name, shape, offset).
        t: List[Tuple[str, Tuple[int, ...], int]] = []
        w_s1, b_s1 = self.segments["W_s1"][0], self.segments["b_s1"][0]
        w_s2, b_s2 = self.segments["W_s2"][0], self.segments["b_s2"][0]
        w_h1, b_h1 = self.segments["W_h1"][0], self.segments["b_h1"][0]
        b_out = self.segments["b_out"][0]
        t += [("s1.weight", (sh1, sd), w_s1), ("s1.bias", (sh1,), b_s1)]
        t += [("s2.weight", (sh2, sh1), w_s2), ("s2.bias", (sh2,), b_s2)]
        t += [("v1.weight", (vh, sh2), w_h1), ("v1.bias", (vh,), b_h1)]
        t += [("v2.weight", (na, vh), self.segments["W_out0"][0]), ("v2.bias", (na,), b_out)]
        action_off = 0
        for d, n in enumerate(c.branches):
            row = vh + d * ah
            t += [(f"a1.{d}.weight", (ah, sh2), w_h1 + row * sh2), (f"a1.{d}.bias", (ah,), b_h1 + row)]
            t += [(f"a2.{d}.weight", (n * na, ah), self.segments[f"W_out{d + 1}"][0]),
                  (f"a2.{d}.bias", (n * na,), b_out + na * (1 + action_off))]
            action_off += n
        self.tensors = t

    def weight_matrices(self) -> List[Tuple[str, Tuple[int, int], int]]:
        """The per-layer weight matrices (10 for the reference config): (name, shape, offset)."""
        return [(n, s, o) for n, s, o in self.tensors if n.endswith(".weight")]

    def encode(self) -> List[int]:
        c = self.config
        sizes = [c.state_dim, *c.trunk_hidden, c.value_hidden, c.adv_hidden, c.atoms, c.num_branches, *c.branches]
        offsets = [self.segments["W_s1"][0], self.segments["W_s2"][0], self.segments["W_h1"][0]]
        offsets += [self.segments[f"W_out{j}"][0] for j in range(c.num_branches + 1)]
        offsets += [self.segments[k][0] for k in ("b_s1", "b_s2", "b_h1", "b_out")]
        return sizes + offsets + [self.numel]


def decode_config(layout: List[int]) -> DQNConfig:
    """The DQNConfig whose ``ParamLayout(...).encode()`` starts with these sizes."""
    if len(layout) < 8:
        raise ValueError(f"layout: expected at least 8 entries, got {len(layout)}")
    d = int(layout[6])
    return DQNConfig(state_dim=int(layout[0]), trunk_hidden=(int(layout[1]), int(layout[2])),
                     value_hidden=int(layout[3]), adv_hidden=int(layout[4]), atoms=int(layout[5]),
                     branches=tuple(int(x) for x in layout[7:7 + d]))

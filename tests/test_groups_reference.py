"""Head groups' configuration and references (docs/combination-design.md; the ops' side:
tests/test_groups_ops.py): HeadGroup and DQNConfig(aux=...) with their errors; ParamLayout's group
segments (a config without aux keeps every offset; each aux group's segments after all of group
0's, as its one-group network has them, named g<g>.); from_torch carrying them; the float64 references of
tests/reference.py (reference_groups_forward, reference_groups_loss) on hand-computed cases and
against the one-group references; the plain-PyTorch baseline (TorchQNet's groups,
torch_groups_loss) against those references, forward, loss and every parameter's gradient by
autograd.

Tolerances: float64 against float64 runs the same formulas in another order: 1e-10 relative (a
group against its one-group network in the references: the same operations, so the same bits).
F32 against float64 (the losses' inputs exact in both): the QR / IQN targets and their
differences round to ~6e-8 relative on values of size ~20 and a loss sums N N' positive terms
(tests/test_qr.py's reasoning): rtol 1e-4 for losses, with an absolute bar of 1e-5 of the largest
gradient element (an element can cancel to ~0). The F32 network's forward against float64 on the
same (F32) weights: a few roundings of 6e-8 per layer, 1e-6 relative (norm-wise); its parameter
gradients through the whole step (the next actions checked clear of ties): 1e-4 relative
(norm-wise) per parameter.
"""
import copy
import dataclasses
import math

import pytest
import torch

import dqn_ops
from dqn_ops import DQNConfig, HeadGroup, ParamLayout, from_torch
from dqn_ops.layout import ALIGN, HEAD_GROUP_KINDS
from dqn_ops.rl.baseline import TorchQNet, torch_dqn_loss, torch_groups_loss
from reference import (CONFIGS, SHAPES, ReferenceNet, assert_no_near_ties, group_config, group_layers, layer_shapes,
                       padding_mask, quantile_fractions, reference_forward, reference_groups_forward,
                       reference_groups_loss, reference_iqn_forward, reference_iqn_loss, rel_err)
from test_ensemble_loss import expected_q as expected_q_f64
from test_ensemble_loss import reference as reference_ensemble_loss

GAMMA, V_MIN, V_MAX = 0.9, -6.0, 6.0  # not test_ensemble_loss's: reference_groups_loss passes them on

# Networks of head groups: the seed's combination (C51 main head, an IQN group, a C51 ensemble);
# QR main head with a one-atom group of no head layer and an IQN ensemble of two head layers; an
# IQN main head (an ensemble) with C51 and QR groups; a one-atom main head with a degenerate IQN
# group (n = 1) and a one-atom ensemble. Each group's loss type (group 0's first) in LOSS_TYPES.
NETS = {
    "seed": DQNConfig(state_dim=6, trunk_hidden=(12, 10), value_hidden=7, adv_hidden=6, atoms=11, branches=(2, 3),
                      aux=(HeadGroup("iqn", iqn_embedding=8, adv_hidden=5),
                           HeadGroup("c51", members=3, atoms=11, adv_hidden=4))),
    "qr_main": DQNConfig(state_dim=5, trunk_hidden=(16, 12), adv_hidden=(8, 6), atoms=7, branches=(3, 1, 4),
                         dueling=False,
                         aux=(HeadGroup("q", dueling=False, adv_hidden=(), loss_weight=0.25),
                              HeadGroup("iqn", members=2, iqn_embedding=5, value_hidden=(4, 3), adv_hidden=(6, 5),
                                        loss_weight=2.0))),
    "iqn_main": DQNConfig(state_dim=7, trunk_hidden=(14,), value_hidden=5, adv_hidden=6, atoms=1, branches=(2, 2),
                          ensemble=2, iqn_embedding=6,
                          aux=(HeadGroup("c51", atoms=5, adv_hidden=()),
                               HeadGroup("qr", members=2, atoms=3, dueling=False, adv_hidden=3, loss_weight=0.5))),
    "q_main": DQNConfig(state_dim=4, trunk_hidden=(10, 8), value_hidden=(), adv_hidden=(), atoms=1, branches=(4,),
                        aux=(HeadGroup("iqn", iqn_embedding=1, dueling=False, adv_hidden=5, loss_weight=1.5),
                             HeadGroup("q", members=3, adv_hidden=4, loss_weight=0.75))),
}
LOSS_TYPES = {"seed": ("c51", "iqn", "c51"), "qr_main": ("qr", "huber", "iqn"), "iqn_main": ("iqn", "c51", "qr"),
              "q_main": ("mse", "iqn", "huber")}


def layers_of(module) -> dict:
    """{name: (weight, bias)} of a TorchQNet / ReferenceNet (the references' argument)."""
    return {name: (module.get_submodule(name).weight, module.get_submodule(name).bias)
            for name in layer_shapes(module.config)}


def leaf_layers(layers) -> dict:
    """Fresh float64 leaves of the same values, each requiring its gradient."""
    return {k: tuple(t.detach().double().clone().requires_grad_() for t in wb) for k, wb in layers.items()}


def seeded_net(c: DQNConfig, seed: int, dtype=torch.float64) -> TorchQNet:
    torch.manual_seed(seed)
    return TorchQNet(c).to(dtype)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def group_fractions(c: DQNConfig, B: int, N: int, seed: int):
    """Per group: uniform fractions [B, N + g] for an IQN group (each its own count), None for any other."""
    g_ = gen(seed)
    return [torch.rand(B, N + g, generator=g_, dtype=torch.float64) if c.group_config(g).iqn else None
            for g in range(c.num_groups)]


def group_midpoints(c: DQNConfig, B: int, K: int):
    """Per group: the K midpoints (2k + 1) / 2K for an IQN group (the next action's fractions), None else."""
    return [quantile_fractions(K).expand(B, K) if c.group_config(g).iqn else None for g in range(c.num_groups)]


def group_masks(c: DQNConfig, B: int, seed: int):
    """Per group: random 0/1 bootstrap masks [B, E_g] for an ensemble group (sample 0's all 0,
    sample 1's all 1), None for a group of one member."""
    out = []
    for g in range(c.num_groups):
        E = c.group_config(g).members
        if E == 1:
            out.append(None)
            continue
        m = (torch.rand(B, E, generator=gen(seed + g)) < 0.5).double()
        m[0], m[1] = 0, 1
        out.append(m)
    return out


def assert_no_near_ties_per_group(qs_next_online, loss_types, c: DQNConfig, bar=1e-4):
    """Every group's (sample, member, branch) best expected next-state Q (the loss type's) is more
    than `bar` ahead of the second: F32 and float64 pick the same next actions."""
    for qo, loss_type in zip(qs_next_online, loss_types):
        assert_no_near_ties(expected_q_f64(qo.detach().double(), "qr" if loss_type == "iqn" else loss_type, V_MIN,
                                           V_MAX), c.branches, bar)


# ----------------------------------------------------------------------------------------
# HeadGroup

def test_head_group_defaults_and_normalisation():
    assert HeadGroup("c51").atoms == 51 and HeadGroup("qr").atoms == 51
    assert HeadGroup("q").atoms == 1 and HeadGroup("iqn", iqn_embedding=64).atoms == 1
    g = HeadGroup("c51")
    assert (g.members, g.dueling, g.value_hidden, g.adv_hidden, g.iqn_embedding, g.loss_weight) == (
        1, True, (128,), (128,), 0, 1.0)
    assert HeadGroup("q", dueling=False).value_hidden == ()
    # written differently, equal (and hashed alike: a DQNConfig holding it stays hashable)
    a = HeadGroup("qr", members=2, atoms=7, value_hidden=None, adv_hidden=32, loss_weight=1)
    b = HeadGroup("qr", members=2, atoms=7, value_hidden=(32,), adv_hidden=[32], loss_weight=1.0)
    assert a == b and hash(a) == hash(b) and type(a.loss_weight) is float and a.adv_hidden == (32,)
    assert HeadGroup("q", atoms=1) == HeadGroup("q") and HeadGroup("qr", atoms=51) == HeadGroup("qr")
    for kind, losses in HEAD_GROUP_KINDS.items():
        group = HeadGroup(kind, iqn_embedding=4 if kind == "iqn" else 0)
        assert group.loss_types == losses
    assert HeadGroup("q").loss_types == ("mse", "huber") and HeadGroup("qr", atoms=1).atoms == 1
    assert HeadGroup("c51", loss_weight=0).loss_weight == 0.0


@pytest.mark.parametrize("kw,exc,match", [
    (dict(kind="dqn"), ValueError, r"^HeadGroup: kind must be 'c51' or 'qr' or 'q' or 'iqn', got 'dqn'$"),
    (dict(kind=None), ValueError, r"^HeadGroup: kind must be 'c51' or 'qr' or 'q' or 'iqn', got None$"),
    (dict(kind="c51", members=0), ValueError, r"^HeadGroup: members must be >= 1 \(an int\), got 0$"),
    (dict(kind="c51", members=2.0), TypeError, r"^HeadGroup: members must be an int >= 1, got 2\.0 \(float\)$"),
    (dict(kind="c51", members=True), TypeError, r"^HeadGroup: members must be an int >= 1, got True \(bool\)$"),
    (dict(kind="c51", atoms=0), ValueError, r"^HeadGroup: atoms must be >= 1 \(an int\), got 0$"),
    (dict(kind="c51", atoms="51"), TypeError, r"^HeadGroup: atoms must be an int >= 1, got '51' \(str\)$"),
    (dict(kind="c51", atoms=1), ValueError,
     r"^HeadGroup: atoms must be >= 2 with kind 'c51' \(the support's two ends at least\), got 1$"),
    (dict(kind="q", atoms=51), ValueError,
     r"^HeadGroup: atoms must be 1 \(or None\) with kind 'q' \(one value per action\), got 51$"),
    (dict(kind="iqn", atoms=2, iqn_embedding=8), ValueError,
     r"^HeadGroup: atoms must be 1 \(or None\) with kind 'iqn' \(one value per action at each quantile fraction\), "
     r"got 2$"),
    (dict(kind="iqn"), ValueError,
     r"^HeadGroup: iqn_embedding must be >= 1 with kind 'iqn' \(the cosines its phi layer embeds; the paper's: 64\), "
     r"got 0$"),
    (dict(kind="qr", iqn_embedding=64), ValueError,
     r"^HeadGroup: iqn_embedding must be 0 with kind 'qr' \(only an 'iqn' group has a phi layer\), got 64$"),
    (dict(kind="iqn", iqn_embedding=-1), ValueError, r"^HeadGroup: iqn_embedding must be >= 0 \(an int\), got -1$"),
    (dict(kind="iqn", iqn_embedding=8.0), TypeError,
     r"^HeadGroup: iqn_embedding must be an int >= 0, got 8\.0 \(float\)$"),
    (dict(kind="c51", dueling=1), TypeError, r"^HeadGroup: dueling must be a bool \(True or False\), got 1 \(int\)$"),
    (dict(kind="c51", dueling=False, value_hidden=8), ValueError,
     r"^HeadGroup: value_hidden must be None or \(\) with dueling=False \(no value head\), got \(8,\)$"),
    (dict(kind="c51", value_hidden=(8, 8)), ValueError,
     r"^HeadGroup: value_hidden and adv_hidden must have the same number of layers \(the kernels run the heads' "
     r"layers side by side\), got \(8, 8\) and \(128,\)$"),
    (dict(kind="c51", adv_hidden=(16, 0)), ValueError,
     r"^HeadGroup: adv_hidden must be an int >= 1 or a tuple of widths >= 1 \(possibly empty\), got \(16, 0\)$"),
    (dict(kind="c51", adv_hidden=None), TypeError, r"^HeadGroup: adv_hidden must be an int >= 1 or a tuple .*, got "
                                                   r"None \(NoneType\)$"),
    (dict(kind="c51", loss_weight=-0.5), ValueError,
     r"^HeadGroup: loss_weight must be a finite number >= 0, got -0\.5$"),
    (dict(kind="c51", loss_weight=math.inf), ValueError,
     r"^HeadGroup: loss_weight must be a finite number >= 0, got inf$"),
    (dict(kind="c51", loss_weight=math.nan), ValueError,
     r"^HeadGroup: loss_weight must be a finite number >= 0, got nan$"),
    (dict(kind="c51", loss_weight=True), TypeError,
     r"^HeadGroup: loss_weight must be a finite number >= 0, got True \(bool\)$"),
    (dict(kind="c51", loss_weight="1"), TypeError,
     r"^HeadGroup: loss_weight must be a finite number >= 0, got '1' \(str\)$"),
])
def test_head_group_rejects_nonsense_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        HeadGroup(**kw)


# ----------------------------------------------------------------------------------------
# DQNConfig.aux

def test_config_aux_field_and_errors():
    plain = DQNConfig()
    assert plain.aux == () and plain.num_groups == 1 and plain.loss_weights == (1.0,)
    assert DQNConfig(aux=()) == plain and hash(DQNConfig(aux=[])) == hash(plain)
    iqn, ens = HeadGroup("iqn", iqn_embedding=64, loss_weight=0.5), HeadGroup("c51", members=5, atoms=51)
    c = DQNConfig(aux=[iqn, ens])  # the design's seed combination, aux written as a list
    assert c.aux == (iqn, ens) and c == DQNConfig(aux=(iqn, ens)) and c != plain and hash(c) == hash(DQNConfig(
        aux=(iqn, ens)))
    assert c.num_groups == 3 and c.loss_weights == (1.0, 0.5, 1.0)
    assert dataclasses.replace(c, aux=()) == plain
    expected = r"a tuple of dqn_ops\.HeadGroup \(possibly empty\)"
    with pytest.raises(TypeError, match=rf"^DQNConfig: aux must be {expected}, got HeadGroup\(kind='iqn'.* "
                                        rf"\(HeadGroup\)$"):
        DQNConfig(aux=iqn)
    with pytest.raises(TypeError, match=rf"^DQNConfig: aux must be {expected}, got 'iqn' \(str\)$"):
        DQNConfig(aux="iqn")
    with pytest.raises(TypeError, match=rf"^DQNConfig: aux must be {expected}, got None \(NoneType\)$"):
        DQNConfig(aux=None)
    with pytest.raises(TypeError, match=rf"^DQNConfig: aux must be {expected}, got an entry 1 \{{'kind': 'c51'\}} "
                                        rf"\(dict\)$"):
        DQNConfig(aux=(iqn, {"kind": "c51"}))


@pytest.mark.parametrize("name", list(NETS))
def test_group_config_is_the_groups_one_group_network(name):
    """DQNConfig.group_config(g): the trunk and group g's head set (group 0: the config without
    aux), as tests/reference.py's group_config builds it from the HeadGroup's fields; the sizes
    of the config are group 0's; num_parameters counts every group once and the trunk once."""
    c = NETS[name]
    trunk = sum(w * i + w for w, i in zip(c.trunk_hidden, (c.state_dim,) + c.trunk_hidden))
    total = trunk
    for g in range(c.num_groups):
        gc = c.group_config(g)
        assert gc == group_config(c, g) and not gc.aux
        assert (gc.state_dim, gc.trunk_hidden, gc.branches) == (c.state_dim, c.trunk_hidden, c.branches)
        if g:
            group = c.aux[g - 1]
            assert (gc.members, gc.atoms, gc.dueling, gc.value_hidden, gc.adv_hidden, gc.iqn_embedding) == (
                group.members, group.atoms, group.dueling, group.value_hidden, group.adv_hidden, group.iqn_embedding)
        total += gc.num_parameters - trunk
    assert c.group_config(0) == dataclasses.replace(c, aux=())
    assert (c.num_heads, c.q_rows, c.head_out, c.hidden_widths) == (
        c.group_config(0).num_heads, c.group_config(0).q_rows, c.group_config(0).head_out,
        c.group_config(0).hidden_widths)
    assert c.num_parameters == total
    with pytest.raises(ValueError, match=r"^DQNConfig\.group_config: g must be < 3 \(the head groups\), got 3$"):
        c.group_config(3)
    with pytest.raises(ValueError, match=r"^DQNConfig\.group_config: g must be >= 0 \(an int\), got -1$"):
        c.group_config(-1)


# ----------------------------------------------------------------------------------------
# ParamLayout: the groups after everything of group 0

SMALL = DQNConfig(state_dim=4, trunk_hidden=(6,), adv_hidden=(), atoms=3, branches=(2,), dueling=False,
                  aux=(HeadGroup("iqn", iqn_embedding=4, dueling=False, adv_hidden=()),
                       HeadGroup("q", members=2, value_hidden=(), adv_hidden=())))


def test_layout_of_a_small_combination_written_out():
    """The offsets by hand. The buffer stores the trunk width 6 as 8 (DQNConfig.aligned): every
    weight reading the trunk is stored [rows, 8], its view [rows, 6] with row stride 8. Group 0
    (no dueling, H = 0, 3 atoms): W_s1 [8, 4] at 0 (32), q1.0's weight W_out0 [6, 8] at 32 (8 rows
    reserved: 64), b_s1 (8) at 96, b_out (6 -> 8) at 104: 112 elements, as without aux. Group 1
    (IQN, n = 4, one Q head): W_phi [8, 4] at 112 (32), W_out0 [2, 8] at 144 (8 rows: 64), b_phi
    (8) at 208, b_out (2 -> 8) at 216. Group 2 (one atom, two members, dueling, H = 0: heads e0.v,
    e1.v, e0.a.0, e1.a.0): W_out0..3 ([1, 8], [1, 8], [2, 8], [2, 8], each 8 rows: 64) at 224,
    288, 352, 416, b_out (1 + 1 + 2 + 2 -> 8) at 480; 488 in all."""
    layout = ParamLayout(SMALL)
    assert layout.segments == {
        "W_s1": (0, (8, 4)), "W_out0": (32, (6, 8)), "b_s1": (96, (8,)), "b_out": (104, (6,)),
        "g1.W_phi": (112, (8, 4)), "g1.W_out0": (144, (2, 8)), "g1.b_phi": (208, (8,)), "g1.b_out": (216, (2,)),
        "g2.W_out0": (224, (1, 8)), "g2.W_out1": (288, (1, 8)), "g2.W_out2": (352, (2, 8)),
        "g2.W_out3": (416, (2, 8)), "g2.b_out": (480, (6,))}
    assert layout.numel == 488
    assert layout.tensors == [
        ("s1.weight", (6, 4), 0), ("s1.bias", (6,), 96), ("q1.0.weight", (6, 6), 32), ("q1.0.bias", (6,), 104),
        ("g1.phi.weight", (6, 4), 112), ("g1.phi.bias", (6,), 208),
        ("g1.q1.0.weight", (2, 6), 144), ("g1.q1.0.bias", (2,), 216),
        ("g2.e0.v1.weight", (1, 6), 224), ("g2.e0.v1.bias", (1,), 480),
        ("g2.e1.v1.weight", (1, 6), 288), ("g2.e1.v1.bias", (1,), 481),
        ("g2.e0.a1.0.weight", (2, 6), 352), ("g2.e0.a1.0.bias", (2,), 482),
        ("g2.e1.a1.0.weight", (2, 6), 416), ("g2.e1.a1.0.bias", (2,), 484)]
    assert layout.row_strides == {
        "s1.weight": 4, "q1.0.weight": 8, "g1.phi.weight": 4, "g1.q1.0.weight": 8, "g2.e0.v1.weight": 8,
        "g2.e1.v1.weight": 8, "g2.e0.a1.0.weight": 8, "g2.e1.a1.0.weight": 8}
    # the views read those elements: a weight's row i at offset + i * row stride
    views = layout.views(torch.arange(layout.numel))
    assert torch.equal(views["q1.0.weight"], torch.tensor([[32 + 8 * i + j for j in range(6)] for i in range(6)]))
    assert torch.equal(views["g1.phi.weight"], torch.tensor([[112 + 4 * i + j for j in range(4)] for i in range(6)]))
    assert torch.equal(views["g2.e1.a1.0.weight"], torch.tensor([[416 + 8 * i + j for j in range(6)]
                                                                 for i in range(2)]))
    assert torch.equal(views["g2.e1.a1.0.bias"], torch.tensor([484, 485]))
    assert [n for n, _ in layout.layers()] == ["s1", "q1.0", "g1.phi", "g1.q1.0", "g2.e0.v1", "g2.e1.v1", "g2.e0.a1.0",
                                               "g2.e1.a1.0"]
    assert SMALL.num_parameters == (24 + 6) + (36 + 6) + (24 + 6) + (12 + 2) + 2 * (6 + 1) + 2 * (12 + 2)
    assert layout.head_names(0) == ["q.0"] and layout.head_names(1) == ["g1.q.0"]
    assert layout.head_names(2) == ["g2.e0.v", "g2.e1.v", "g2.e0.a.0", "g2.e1.a.0"]


def with_aux(c: DQNConfig) -> DQNConfig:
    """c with three head groups of other shapes (IQN, a C51 ensemble of two head layers, a
    one-atom group without dueling or head layer)."""
    return dataclasses.replace(c, aux=(HeadGroup("iqn", iqn_embedding=5, adv_hidden=7, value_hidden=3),
                                       HeadGroup("c51", members=2, atoms=5, adv_hidden=(6, 4)),
                                       HeadGroup("q", dueling=False, adv_hidden=())))


LAYOUT_CASES = {**{f"net_{k}": v for k, v in NETS.items()},
                **{f"aux_{k}": with_aux(v) for k, v in {**CONFIGS, **SHAPES}.items()}}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_group_0_keeps_every_offset_and_each_group_is_its_networks_heads(name):
    """Group 0's segments and views are those of the config without aux, offset for offset,
    first in every list (a config without aux keeps its layout); each aux group's segments follow
    in turn, every one aligned, inside the buffer and disjoint, named g<g>. + the one-group
    network's head segments (weights, then biases) with their shapes; and every view of the group
    reads what the one-group network's view of the same name reads when each segment's contents
    are copied over."""
    c = LAYOUT_CASES[name]
    plain, layout = ParamLayout(dataclasses.replace(c, aux=())), ParamLayout(c)
    order = list(layout.segments)
    assert order[:len(plain.segments)] == list(plain.segments)
    assert {k: layout.segments[k] for k in plain.segments} == plain.segments
    assert layout.tensors[:len(plain.tensors)] == plain.tensors
    assert layout.layers()[:len(plain.layers())] == plain.layers()
    assert plain.encode() == ParamLayout(c.group_config(0)).encode()  # no aux: the one-group encoding
    # placement: in order, each at the aligned end of the previous one (output weights' rows padded)
    end = 0
    for seg in order:
        off, shape = layout.segments[seg]
        assert off == end and off % ALIGN == 0, seg
        bare = seg.split(".", 1)[1] if seg.startswith("g") else seg
        rows = -(-shape[0] // ALIGN) * ALIGN if bare.startswith("W_out") else shape[0]
        end = -(-(off + rows * math.prod(shape[1:])) // ALIGN) * ALIGN
    assert end == layout.numel
    buffer = torch.arange(layout.numel, dtype=torch.float64)
    views = layout.views(buffer)
    prefix_order = [seg.split(".", 1)[0] for seg in order[len(plain.segments):]]
    assert prefix_order == sorted(prefix_order, key=lambda p: int(p[1:]))  # group after group
    for g in range(1, c.num_groups):
        p, alone = f"g{g}.", ParamLayout(c.group_config(g))
        heads = [seg for seg in alone.segments if not seg.startswith(("W_s", "b_s"))]
        heads = [s for s in heads if s.startswith("W_")] + [s for s in heads if s.startswith("b_")]
        assert [seg for seg in order if seg.startswith(p)] == [p + seg for seg in heads]
        assert all(layout.segments[p + seg][1] == alone.segments[seg][1] for seg in heads)
        copied = torch.full((alone.numel,), math.nan, dtype=torch.float64)
        for seg in heads:
            (src, shape), (dst, _) = layout.segments[p + seg], alone.segments[seg]
            rows = -(-shape[0] // ALIGN) * ALIGN if seg.startswith("W_out") else shape[0]
            n = rows * math.prod(shape[1:])
            copied[dst:dst + n] = buffer[src:src + n]
        group_views = [(n, s) for n, s, _ in alone.tensors if not n.startswith("s")]
        assert [(n, s) for n, s, _ in layout.tensors if n.startswith(p)] == [(p + n, s) for n, s in group_views]
        for n, view in alone.views(copied).items():
            if not n.startswith("s"):
                assert torch.equal(views[p + n], view), p + n
    # every element belongs to at most one view
    covered = torch.cat([v.reshape(-1) for v in views.values()])
    assert covered.unique().numel() == covered.numel() == c.num_parameters


def test_the_group_names_of_the_design():
    """g1.phi.weight, g1.v1.weight, g2.e3.a2.1.weight: an IQN group with dueling and a five-member
    group with two head layers; weight_matrices and layers list them after group 0's, in the
    order of the layers (SpectralNorm's matrices and from_torch's matching by order)."""
    c = DQNConfig(state_dim=4, trunk_hidden=(8,), adv_hidden=6, atoms=5, branches=(2, 3),
                  aux=(HeadGroup("iqn", iqn_embedding=4, adv_hidden=5),
                       HeadGroup("qr", members=5, atoms=3, adv_hidden=(4, 3))))
    layout = ParamLayout(c)
    names = [n for n, _, _ in layout.tensors]
    for expected in ("g1.phi.weight", "g1.v1.weight", "g1.v2.bias", "g1.a1.1.weight", "g2.e3.a2.1.weight",
                     "g2.e4.v3.bias", "g2.e0.a3.0.weight"):
        assert expected in names, expected
    layers = [n for n, _ in layout.layers()]
    assert layers == [n[:-len(".weight")] for n, _, _ in layout.weight_matrices()]
    assert layers[:7] == ["s1", "v1", "v2", "a1.0", "a2.0", "a1.1", "a2.1"]
    assert layers[7:14] == ["g1.phi", "g1.v1", "g1.v2", "g1.a1.0", "g1.a2.0", "g1.a1.1", "g1.a2.1"]
    assert layers[14:17] == ["g2.e0.v1", "g2.e0.v2", "g2.e0.v3"] and layers[-1] == "g2.e4.a3.1"
    assert len(layers) == 7 + 7 + 5 * 3 * 3
    assert dict(layout.layers())["g1.phi"] == (8, 4) and dict(layout.layers())["g2.e3.a2.1"] == (3, 4)
    assert ParamLayout.head_layer_name("g2.e3.a.1", 2) == "g2.e3.a2.1"
    assert ParamLayout.head_layer_name("g1.v", 1) == "g1.v1" and ParamLayout.head_layer_name("e1.q.0", 3) == "e1.q3.0"
    assert list(layer_shapes(c)) == layers  # the reference's names, in the same order


# ----------------------------------------------------------------------------------------
# The ops' side (more in tests/test_groups_ops.py): from_torch carries the groups

def test_from_torch_carries_the_groups():
    c = NETS["seed"]
    torch.manual_seed(0)
    module = TorchQNet(c)
    net = from_torch(module, c)
    views = net.layer_views()
    for name, tensor in module.state_dict().items():
        assert torch.equal(views[name], tensor), name
    # group 0 alone is a one-group network: encoded in format 4
    assert ParamLayout(c.group_config(0)).encode()[0] == dqn_ops.layout.LAYOUT_FORMAT


# ----------------------------------------------------------------------------------------
# reference_groups_forward

def test_reference_groups_forward_on_a_hand_computed_network():
    """state 1 -> trunk 2 (h = (2.5, 1) at s = 2); group 0: one Q head of 2 actions; group 1: IQN
    (n = 2 cosines: (1, cos(pi tau))) with a Q head; group 2: C51 of 2 atoms with dueling, one
    branch of 2 actions, no head layer."""
    c = DQNConfig(state_dim=1, trunk_hidden=(2,), adv_hidden=(), atoms=1, branches=(2,), dueling=False,
                  aux=(HeadGroup("iqn", iqn_embedding=2, dueling=False, adv_hidden=()),
                       HeadGroup("c51", atoms=2, value_hidden=(), adv_hidden=())))
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    layers = {"s1": (t([1.0], [-0.5]), t(0.5, 2.0)),
              "q1.0": (t([1.0, 3.0], [-2.0, 1.0]), t(0.25, -0.5)),
              "g1.phi": (t([2.0, -2.0], [0.0, 1.0]), t(0.0, 1.0)),
              "g1.q1.0": (t([1.0, 1.0], [0.0, 2.0]), t(0.0, 1.0)),
              "g2.v1": (t([1.0, 0.0], [0.0, 1.0]), t(0.0, 0.0)),
              "g2.a1.0": (t([1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [1.0, 1.0]), t(0.0, 0.0, 0.0, -1.0))}
    assert {k: (w.shape[0], w.shape[1]) for k, (w, _) in layers.items()} == layer_shapes(c)
    tau = t([1 / 3, 1.0])
    outputs, trunk, acts = reference_groups_forward(c, layers, t([2.0]), [None, tau, None])
    h = [2.5, 1.0]
    torch.testing.assert_close(trunk[1], t(h), rtol=0, atol=0)
    # group 0: q = W h + b
    torch.testing.assert_close(outputs[0][0], t([[5.75], [-4.5]]), rtol=0, atol=1e-15)
    # group 1: at tau = 1/3 c = (1, 1/2), phi = (relu(2 - 1), relu(1/2 + 1)) = (1, 3/2), z = (2.5, 1.5),
    # q = (4, 4); at tau = 1 c = (1, -1), phi = (4, relu(-1 + 1) = 0), z = (10, 0), q = (10, 1)
    torch.testing.assert_close(outputs[1][0], t([[4.0, 10.0], [4.0, 1.0]]), rtol=0, atol=1e-14)
    torch.testing.assert_close(outputs[1][1], t([4.0, 4.0], [10.0, 1.0]), rtol=0, atol=1e-14)
    torch.testing.assert_close(acts[1][1], t([1.0, 1.5], [4.0, 0.0]), rtol=0, atol=1e-14)  # phi
    # group 2: v = (2.5, 1); a: action 0 (2.5, 0), action 1 (2, 2.5), their mean (2.25, 1.25);
    # q = v + a - mean: action 0 (2.75, -0.25), action 1 (2.25, 2.25)
    torch.testing.assert_close(outputs[2][0], t([[2.75, -0.25], [2.25, 2.25]]), rtol=0, atol=1e-15)
    torch.testing.assert_close(outputs[2][1], t([2.5, 1.0, 2.5, 0.0, 2.0, 2.5]), rtol=0, atol=1e-15)
    assert [len(a) for a in acts] == [0, 3, 0]


@pytest.mark.parametrize("round_to", [None, torch.bfloat16], ids=["exact", "bf16_emulated"])
@pytest.mark.parametrize("name", list(NETS))
def test_each_group_is_its_one_group_network(name, round_to):
    """Group g's outputs and activations are, bit for bit, those of reference_forward /
    reference_iqn_forward on its one-group network (the trunk and its head layers), the trunk's
    activations theirs too; other fractions of one group change no other group's outputs."""
    c = NETS[name]
    ref = ReferenceNet(c).double()
    B = 5
    s = torch.randn(B, c.state_dim, dtype=torch.float64, generator=gen(1))
    fractions = group_fractions(c, B, 4, seed=2)
    outputs, trunk, acts = reference_groups_forward(c, layers_of(ref), s, fractions, round_to)
    for g in range(c.num_groups):
        gc, layers = group_config(c, g), group_layers(layers_of(ref), g)
        assert sorted(layers) == sorted(layer_shapes(gc))
        if gc.iqn:
            q, head, alone = reference_iqn_forward(gc, layers, s, fractions[g], round_to)
        else:
            q, head, alone = reference_forward(gc, layers, s, round_to)
        assert torch.equal(outputs[g][0], q) and torch.equal(outputs[g][1], head), g
        L = len(c.trunk_hidden) + 1
        assert all(torch.equal(a, b) for a, b in zip(trunk + acts[g], alone)) and len(trunk + acts[g]) == len(alone)
        assert q.shape == ((B, gc.q_rows, fractions[g].shape[1]) if gc.iqn else (B, gc.q_rows, gc.atoms)), g
        assert all(torch.equal(a, b) for a, b in zip(trunk, alone[:L]))
    for g in range(c.num_groups):
        if fractions[g] is not None and group_config(c, g).iqn_embedding > 1:  # n = 1: the same at every fraction
            other = list(fractions)
            other[g] = torch.rand(fractions[g].shape, generator=gen(9), dtype=torch.float64)
            again, _, _ = reference_groups_forward(c, layers_of(ref), s, other, round_to)
            for k in range(c.num_groups):
                assert torch.equal(again[k][0], outputs[k][0]) == (k != g), (g, k)


# ----------------------------------------------------------------------------------------
# reference_groups_loss

def test_reference_groups_loss_on_a_hand_computed_sample():
    """One sample (r = 1, not done, gamma 1/2), one branch of 2 actions, action 1 taken; BDQ's
    targets y = r + gamma Q_target(s', argmax_a Q_online(s', a)):
    group 0 (MSE): Q = 3, y = 1 + 2/2 = 2: L_0 = 1, dL/dQ = 2;
    group 1 (Huber, weight 1/2): Q = -1, y = 1 + 3/2 = 2.5: L_1 = 3.5 - 0.5 = 3, dL/dQ = -1;
    group 2 (MSE, two members, masks (1, 0), weight 2): member 0 Q = 1.5, y = 1 - 1/2: its term 1;
    member 1 Q = 7, y = 2.5: masked; L_2 = (1 + 0) / 2, dL/dQ_0 = 2 (1.5 - 0.5) / 2 = 1.
    loss = 1 + 3/2 + 2 * 1/2 = 3.5; the TD error and mean Q are group 0's: 1 and 3."""
    c = DQNConfig(state_dim=1, trunk_hidden=(1,), adv_hidden=(), atoms=1, branches=(2,), dueling=False,
                  aux=(HeadGroup("q", dueling=False, adv_hidden=(), loss_weight=0.5),
                       HeadGroup("q", members=2, dueling=False, adv_hidden=(), loss_weight=2.0)))
    t = lambda *x: torch.tensor(x, dtype=torch.float64)[None, :, None]  # noqa: E731   [1, rows, 1]
    qs = [t(1.0, 3.0), t(0.0, -1.0), t(0.5, 1.5, 7.0, 7.0)]
    qo = [t(0.2, 0.7), t(1.0, 0.0), t(0.0, 1.0, 2.0, 1.0)]
    qt = [t(4.0, 2.0), t(3.0, 9.0), t(10.0, -1.0, 3.0, 5.0)]
    masks = [None, None, torch.tensor([[1.0, 0.0]], dtype=torch.float64)]
    actions, rewards, dones = torch.tensor([[1]]), t(1.0)[0, 0], t(0.0)[0, 0]
    loss, grads, td, mean_q, losses = reference_groups_loss(c, ("mse", "huber", "mse"), qs, qo, qt, actions, rewards,
                                                            dones, 0.5, masks=masks)
    assert loss.item() == pytest.approx(3.5, rel=1e-12)
    assert losses.tolist() == pytest.approx([1.0, 3.0, 0.5], rel=1e-12)
    assert td.tolist() == pytest.approx([1.0], rel=1e-12) and mean_q.item() == pytest.approx(3.0, rel=1e-12)
    assert grads[0].flatten().tolist() == pytest.approx([0.0, 2.0], rel=1e-12)
    assert grads[1].flatten().tolist() == pytest.approx([0.0, -0.5], rel=1e-12)   # w_1 * (-1)
    assert grads[2].flatten().tolist() == pytest.approx([0.0, 2.0, 0.0, 0.0], rel=1e-12)  # w_2 * 1


def loss_batch(c: DQNConfig, loss_types, B, seed, N=5, K=4, N2=3):
    """Per group its (q, q_next_online, q_next_target) at random (C51 logits ~ N(0, 1); quantiles
    and Q values ~ N(0, 2^2); an IQN group's [B, rows, N + g], [B, rows, K], [B, rows, N2 + g]),
    its masks and fractions; the shared actions, rewards (uniform on [-4, 4]), dones (25 %) and
    weights ([0.5, 1.5))."""
    g_ = gen(seed)
    qs, qo, qt, fractions = [], [], [], []
    for g in range(c.num_groups):
        gc = c.group_config(g)
        sizes = (N + g, K, N2 + g) if gc.iqn else (gc.atoms,) * 3
        scale = 1.0 if loss_types[g] == "c51" else 2.0
        q, o, t = (torch.randn(B, gc.q_rows, n, generator=g_, dtype=torch.float64) * scale for n in sizes)
        qs.append(q), qo.append(o), qt.append(t)
        fractions.append(torch.rand(B, N + g, generator=g_, dtype=torch.float64) if gc.iqn else None)
    actions = torch.stack([torch.randint(0, n, (B,), generator=g_) for n in c.branches], 1)
    rewards = (torch.rand(B, generator=g_, dtype=torch.float64) * 2 - 1) * 4
    dones = (torch.rand(B, generator=g_) < 0.25).double()
    weights = torch.rand(B, generator=g_, dtype=torch.float64) + 0.5
    return qs, qo, qt, actions, rewards, dones, weights, group_masks(c, B, seed), fractions


@pytest.mark.parametrize("name", list(NETS))
def test_reference_groups_loss_is_the_weighted_sum_of_each_groups_reference(name):
    """Each group's loss, gradient, TD error and mean Q are its own reference's on its outputs
    (tests/test_ensemble_loss.py's for C51 / QR / MSE / Huber, reference_iqn_loss for IQN, with
    the group's masks); the loss is sum_g w_g L_g, each gradient w_g dL_g/dq_g; TD error and mean
    Q group 0's."""
    c, loss_types = NETS[name], LOSS_TYPES[name]
    qs, qo, qt, actions, rewards, dones, weights, masks, fractions = loss_batch(c, loss_types, 16, seed=3)
    loss, grads, td, mean_q, losses = reference_groups_loss(c, loss_types, qs, qo, qt, actions, rewards, dones,
                                                            GAMMA, V_MIN, V_MAX, weights, masks, fractions)
    total = 0.0
    for g, w in enumerate(c.loss_weights):
        args = (qs[g], qo[g], qt[g], actions, rewards, dones, c.branches)
        alone = (reference_iqn_loss(*args, GAMMA, fractions[g], weights, masks[g]) if loss_types[g] == "iqn" else
                 reference_ensemble_loss(*args, loss_types[g], weights, masks[g], gamma=GAMMA, v_min=V_MIN,
                                         v_max=V_MAX))
        assert torch.equal(losses[g], alone[0]) and torch.equal(grads[g], w * alone[1]), g
        assert alone[1].abs().max() > 0
        total += w * alone[0].item()
        if g == 0:
            assert torch.equal(td, alone[2]) and torch.equal(mean_q, alone[3])
    assert loss.item() == pytest.approx(total, rel=1e-14)


# ----------------------------------------------------------------------------------------
# Gradients: the trunk's is the sum of the groups'

def step_inputs(c: DQNConfig, B, seed):
    g_ = gen(seed)
    s, s2 = (torch.randn(B, c.state_dim, generator=g_, dtype=torch.float64) for _ in range(2))
    actions = torch.stack([torch.randint(0, n, (B,), generator=g_) for n in c.branches], 1)
    rewards = torch.randn(B, generator=g_, dtype=torch.float64) * 3
    dones = (torch.rand(B, generator=g_) < 0.25).double()
    weights = torch.rand(B, generator=g_, dtype=torch.float64) + 0.5
    return s, s2, actions, rewards, dones, weights


def reference_step(c: DQNConfig, loss_types, online_layers, target_layers, inputs, tau, tau_hat, tau2, masks):
    """The references' training loss: the online network at s (the groups' fractions tau) and at
    s' (the midpoints tau_hat), the target at s' (tau2); reference_groups_loss on them and its
    gradients pushed through the online forward at s by autograd (into online_layers' leaves).
    Returns reference_groups_loss's outputs."""
    s, s2, actions, rewards, dones, weights = inputs
    with torch.no_grad():
        qo = [q for q, _ in reference_groups_forward(c, online_layers, s2, tau_hat)[0]]
        qt = [q for q, _ in reference_groups_forward(c, target_layers, s2, tau2)[0]]
    qs = [q for q, _ in reference_groups_forward(c, online_layers, s, tau)[0]]
    out = reference_groups_loss(c, loss_types, qs, qo, qt, actions, rewards, dones, GAMMA, V_MIN, V_MAX, weights,
                                masks, tau)
    torch.autograd.backward(qs, out[1])
    return out


def groups_step_data(c: DQNConfig, B=10, seed=0):
    """Online and target ReferenceNets (nn.Linear's initialisation, seeded), step_inputs, the
    fractions (tau, the midpoints, tau') and masks of every group."""
    torch.manual_seed(seed)
    online, target = ReferenceNet(c).double(), ReferenceNet(c).double()
    inputs = step_inputs(c, B, seed + 1)
    tau, tau2 = group_fractions(c, B, 5, seed + 2), group_fractions(c, B, 3, seed + 3)
    return online, target, inputs, tau, group_midpoints(c, B, 4), tau2, group_masks(c, B, seed + 4)


@pytest.mark.parametrize("name", list(NETS))
def test_trunk_gradient_is_the_sum_of_the_groups_gradients(name):
    """Autograd of sum_g w_g L_g through reference_groups_forward: the trunk's gradient is the
    sum over the groups of w_g times the trunk's gradient of L_g in the group's one-group network
    (reference_forward / reference_iqn_forward on the same trunk and heads, its loss alone), and
    each group's head gradients are its one-group network's (scaled by w_g)."""
    c, loss_types = NETS[name], LOSS_TYPES[name]
    online, target, inputs, tau, tau_hat, tau2, masks = groups_step_data(c, seed=12)
    layers = leaf_layers(layers_of(online))
    out = reference_step(c, loss_types, layers, layers_of(target), inputs, tau, tau_hat, tau2, masks)
    trunk = [k for k in layers if k.startswith("s")]
    summed = {k: [torch.zeros_like(t) for t in layers[k]] for k in trunk}
    for g in range(c.num_groups):
        gc = group_config(c, g)
        alone_layers = leaf_layers(group_layers(layers_of(online), g))
        # the group alone: its one-group network's forwards and its loss, weighted
        s, s2, actions, rewards, dones, weights = inputs

        def forward(lay, x, fr):
            return (reference_iqn_forward(gc, lay, x, fr) if gc.iqn else reference_forward(gc, lay, x))[0]

        with torch.no_grad():
            qo = forward(alone_layers, s2, tau_hat[g])
            qt = forward(group_layers(layers_of(target), g), s2, tau2[g])
        q = forward(alone_layers, s, tau[g])
        args = (q, qo, qt, actions, rewards, dones, c.branches)
        _, grad, _, _ = (reference_iqn_loss(*args, GAMMA, tau[g], weights, masks[g]) if gc.iqn else
                         reference_ensemble_loss(*args, loss_types[g], weights, masks[g], gamma=GAMMA, v_min=V_MIN,
                                                 v_max=V_MAX))
        q.backward(c.loss_weights[g] * grad)
        torch.testing.assert_close(c.loss_weights[g] * grad, out[1][g], rtol=1e-12, atol=1e-15)
        for k, (w, b) in alone_layers.items():
            if k in summed:
                summed[k][0] += w.grad
                summed[k][1] += b.grad
            else:  # the group's own layers: the same gradient in the network of groups
                full = (f"g{g}." if g else "") + k
                torch.testing.assert_close(layers[full][0].grad, w.grad, rtol=1e-10, atol=1e-13)
                torch.testing.assert_close(layers[full][1].grad, b.grad, rtol=1e-10, atol=1e-13)
    for k in trunk:
        for got, want in zip((layers[k][0].grad, layers[k][1].grad), summed[k]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    assert layers["s1"][0].grad.abs().max() > 0


def without_group(c: DQNConfig, k: int) -> DQNConfig:
    return dataclasses.replace(c, aux=c.aux[:k - 1] + c.aux[k:])


def renamed_without_group(layers, k: int) -> dict:
    """The layers of the network without aux group k: its layers dropped, the later groups' renumbered."""
    out = {}
    for name, v in layers.items():
        head, _, rest = name.partition(".")
        if head[:1] == "g" and head[1:].isdigit():
            g = int(head[1:])
            if g == k:
                continue
            name = f"g{g - 1}.{rest}" if g > k else name
        out[name] = v
    return out


@pytest.mark.parametrize("name,k", [("seed", 1), ("seed", 2), ("qr_main", 2), ("q_main", 1)])
def test_a_group_of_weight_zero_changes_nothing_but_its_own_gradient(name, k):
    """Aux group k at loss weight 0: its head parameters' gradients are 0 exactly, and the loss,
    the TD error, mean Q and every other parameter's gradient are those of the network without
    group k (references and the plain-PyTorch baseline alike)."""
    c0, loss_types = NETS[name], LOSS_TYPES[name]
    c = dataclasses.replace(c0, aux=tuple(dataclasses.replace(g, loss_weight=0.0) if i == k - 1 else g
                                          for i, g in enumerate(c0.aux)))
    reduced, reduced_types = without_group(c, k), loss_types[:k] + loss_types[k + 1:]
    online, target, inputs, tau, tau_hat, tau2, masks = groups_step_data(c, seed=20)
    drop = lambda x: x[:k] + x[k + 1:]  # noqa: E731
    layers = leaf_layers(layers_of(online))
    out = reference_step(c, loss_types, layers, layers_of(target), inputs, tau, tau_hat, tau2, masks)
    reduced_layers = leaf_layers(renamed_without_group(layers_of(online), k))
    want = reference_step(reduced, reduced_types, reduced_layers, renamed_without_group(layers_of(target), k), inputs,
                          drop(tau), drop(tau_hat), drop(tau2), drop(masks))
    assert out[4][k] > 0  # the group's loss is there, weighted by 0
    for a, b in zip(out[:1] + out[2:4], want[:1] + want[2:4]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for name_, (w, b) in layers.items():
        if name_.startswith(f"g{k}."):
            assert torch.count_nonzero(w.grad) == 0 and torch.count_nonzero(b.grad) == 0, name_
    for name_, (w, b) in renamed_without_group(layers, k).items():
        torch.testing.assert_close(w.grad, reduced_layers[name_][0].grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(b.grad, reduced_layers[name_][1].grad, rtol=1e-10, atol=1e-13)
    # the baseline: TorchQNet and torch_groups_loss
    net = TorchQNet(c).double()
    net.load_state_dict(online.state_dict())
    tnet = TorchQNet(c).double()
    tnet.load_state_dict(target.state_dict())
    loss, _, _ = baseline_loss(c, loss_types, net, tnet, inputs, tau, tau_hat, tau2, masks)
    loss.backward()
    kept = {f"{old}.{p}": t for new, old in renamed_without_group({n: n for n in layers}, k).items()
            for p, t in zip(("weight", "bias"), reduced_layers[new])}  # by the name in the network of groups
    for name_, p in net.named_parameters():
        if name_.startswith(f"g{k}."):
            assert torch.count_nonzero(p.grad) == 0, name_
        else:
            torch.testing.assert_close(p.grad, kept[name_].grad, rtol=1e-10, atol=1e-13, msg=name_)


# ----------------------------------------------------------------------------------------
# The plain-PyTorch baseline: TorchQNet's groups and torch_groups_loss

@pytest.mark.parametrize("name", list(NETS))
def test_torch_qnet_carries_the_layouts_names_and_state_dicts_move_both_ways(name):
    """TorchQNet's (and ReferenceNet's) state dict has ParamLayout's names, every group's; the
    aux groups are submodules g<g>; a flat buffer's views load into it and come back unchanged."""
    c = NETS[name]
    layout = ParamLayout(c)
    names = [n for n, _, _ in layout.tensors]
    net = TorchQNet(c).double()
    assert sorted(net.state_dict()) == sorted(names) == sorted(ReferenceNet(c).state_dict())
    for g in range(1, c.num_groups):
        assert isinstance(getattr(net, f"g{g}"), torch.nn.Module)
        assert (f"g{g}.phi.weight" in names) == c.group_config(g).iqn
    flat = torch.randn(layout.numel, dtype=torch.float64, generator=gen(3))
    net.load_state_dict(layout.views(flat))
    back = torch.zeros_like(flat)
    for n, view in layout.views(back).items():
        view.copy_(net.state_dict()[n])
    covered = ~padding_mask(layout, "cpu")
    assert torch.equal(back[covered], flat[covered])
    ref = ReferenceNet(c).double()
    ref.load_state_dict(net.state_dict())
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize("name", list(NETS))
def test_torch_qnet_matches_reference_groups_forward(name):
    """forward(s, tau, group_fractions) gives every group's (q, head): in float64 the reference's;
    each group its one-group TorchQNet's on the same weights (a group alone is a one-group network);
    in F32 the float64 reference on the F32 weights within 1e-6 (module docstring)."""
    c = NETS[name]
    net = seeded_net(c, 4, torch.float32)
    net64 = copy.deepcopy(net).double()
    B = 6
    s = torch.randn(B, c.state_dim, dtype=torch.float64, generator=gen(5))
    fractions = group_fractions(c, B, 4, seed=6)
    want, _, _ = reference_groups_forward(c, layers_of(net64), s, fractions)
    got = net64(s, fractions[0], fractions[1:])
    assert isinstance(got, list) and len(got) == c.num_groups
    for g, ((q, head), (rq, rhead)) in enumerate(zip(got, want)):
        torch.testing.assert_close(q, rq, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(head, rhead, rtol=1e-10, atol=1e-12)
        gc = c.group_config(g)
        alone = TorchQNet(gc).double()
        alone.load_state_dict({k: v for k, v in group_layers_state(net64.state_dict(), g).items()})
        q_alone, head_alone = alone(s, fractions[g]) if gc.iqn else alone(s)
        assert torch.equal(q_alone, q) and torch.equal(head_alone, head), g
    f32 = [None if f is None else f.float() for f in fractions]
    got32 = net(s.float(), f32[0], f32[1:])
    for (q, head), (rq, rhead) in zip(got32, want):
        assert q.dtype == torch.float32
        assert rel_err(q, rq) < 1e-6 and rel_err(head, rhead) < 1e-6


def group_layers_state(state: dict, g: int) -> dict:
    """Group g's one-group network's state dict out of the network of groups' state dict."""
    layers = {k.rsplit(".", 1)[0]: None for k in state}
    kept = group_layers({k: k for k in layers}, g)   # one-group name -> full name
    return {f"{short}.{p}": state[f"{full}.{p}"] for short, full in kept.items() for p in ("weight", "bias")}


def test_torch_qnet_group_argument_errors():
    c = NETS["seed"]
    net, plain = TorchQNet(c), TorchQNet(c.group_config(0))
    s, tau = torch.randn(3, c.state_dim), torch.rand(3, 4)
    with pytest.raises(ValueError, match=r"^TorchQNet: group_fractions are the fractions of DQNConfig\.aux's head "
                                         r"groups; this network has none$"):
        plain(s, None, [tau])
    with pytest.raises(ValueError, match=r"^TorchQNet: group_fractions must have one entry per aux head group \(2\), "
                                         r"got 1$"):
        net(s, None, [tau])
    with pytest.raises(ValueError, match=r"^TorchQNet: an IQN head group takes its fractions \[B, N\] "
                                         r"\(group_fractions\[0\] for group 1\), any other None; group 1 has "
                                         r"iqn_embedding=8 and was not given fractions$"):
        net(s)
    with pytest.raises(ValueError, match=r"group 2 has iqn_embedding=0 and was given fractions$"):
        net(s, None, [tau, tau])
    with pytest.raises(ValueError, match=r"^TorchQNet: an IQN network \(iqn_embedding > 0\) takes the fractions tau "
                                         r"\[B, N\], any other none; this one has iqn_embedding=0 and was given tau$"):
        net(s, tau, [tau, None])
    with pytest.raises(ValueError, match=r"^TorchQNet: group 1's fractions \(group_fractions\[0\]\) must be \[B, N\] "
                                         r"with B = 3 \(the states' rows\), got \[2, 4\]$"):
        net(s, None, [tau[:2], None])
    iqn_main = TorchQNet(NETS["iqn_main"])
    with pytest.raises(ValueError, match=r"this one has iqn_embedding=6 and was not given tau$"):
        iqn_main(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"^TorchQNet: tau must be \[B, N\] with B = 3 \(the states' rows\), got "
                                         r"\[3\]$"):
        iqn_main(torch.randn(3, 7), torch.rand(3))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(NETS))
def test_torch_groups_loss_matches_reference(name, masked):
    """torch_groups_loss: in float64 reference_groups_loss to float64 rounding, each group's
    gradient by autograd; in F32 within the F32 tolerances (module docstring); the sum of the
    groups' torch_dqn_loss with c.loss_weights."""
    c, loss_types = NETS[name], LOSS_TYPES[name]
    B = 24
    qs, qo, qt, actions, rewards, dones, weights, masks, fractions = loss_batch(c, loss_types, B, seed=7)
    qs, qo, qt = ([x.float().double() for x in xs] for xs in (qs, qo, qt))  # exact in F32
    rewards, weights = rewards.float().double(), weights.float().double()
    fractions = [None if f is None else f.float().double() for f in fractions]
    masks = masks if masked else None
    assert_no_near_ties_per_group(qo, loss_types, c)
    ref = reference_groups_loss(c, loss_types, qs, qo, qt, actions, rewards, dones, GAMMA, V_MIN, V_MAX, weights,
                                masks, fractions)
    for dtype in (torch.float64, torch.float32):
        cast = lambda xs: [None if x is None else x.to(dtype) for x in xs]  # noqa: E731
        x = [q.detach().to(dtype).clone().requires_grad_() for q in qs]
        loss, td, mean_q = torch_groups_loss(c, x, cast(qo), cast(qt), actions, rewards.to(dtype), dones.to(dtype),
                                             V_MIN, V_MAX, GAMMA, loss_types, weights.to(dtype),
                                             None if masks is None else cast(masks), cast(fractions))
        loss.backward()
        rtol, atol = (1e-10, 1e-12) if dtype == torch.float64 else (1e-4, 1e-6)
        torch.testing.assert_close(loss.detach().double(), ref[0], rtol=rtol, atol=atol)
        torch.testing.assert_close(td.double(), ref[2], rtol=rtol, atol=atol)
        torch.testing.assert_close(mean_q.double(), ref[3], rtol=max(rtol, 1e-6), atol=atol)
        for g in range(c.num_groups):
            bar = max(atol, (0 if dtype == torch.float64 else 1e-5) * ref[1][g].abs().max().item())
            torch.testing.assert_close(x[g].grad.double(), ref[1][g], rtol=rtol, atol=bar)
    # the weighted sum of the groups' own torch_dqn_loss
    total = sum(w * torch_dqn_loss(qs[g], qo[g], qt[g], actions, rewards, dones, c.branches, V_MIN, V_MAX, GAMMA,
                                   loss_types[g], weights, None if masks is None else masks[g], fractions[g])[0]
                for g, w in enumerate(c.loss_weights))
    torch.testing.assert_close(torch_groups_loss(c, qs, qo, qt, actions, rewards, dones, V_MIN, V_MAX, GAMMA,
                                                 loss_types, weights, masks, fractions)[0], total, rtol=0, atol=0)


def test_torch_groups_loss_argument_errors():
    c, loss_types = NETS["seed"], LOSS_TYPES["seed"]
    qs, qo, qt, actions, rewards, dones, weights, masks, fractions = loss_batch(c, loss_types, 4, seed=8)
    args = (actions, rewards, dones, V_MIN, V_MAX, GAMMA)
    with pytest.raises(ValueError, match=r"^torch_groups_loss: qs must have one entry per head group \(3\), got 2$"):
        torch_groups_loss(c, qs[:2], qo, qt, *args, loss_types, fractions=fractions)
    with pytest.raises(ValueError, match=r"^torch_groups_loss: fractions must have one entry per head group \(3\), "
                                         r"got 2$"):
        torch_groups_loss(c, qs, qo, qt, *args, loss_types, fractions=fractions[:2])
    with pytest.raises(ValueError, match=r"^torch_groups_loss: loss_types\[2\] must be 'c51' \(group 2 is a 'c51' "
                                         r"group\), got 'qr'$"):
        torch_groups_loss(c, qs, qo, qt, *args, ("c51", "iqn", "qr"), fractions=fractions)
    q_main = NETS["q_main"]
    qs, qo, qt, actions, rewards, dones, weights, masks, fractions = loss_batch(q_main, LOSS_TYPES["q_main"], 4, 9)
    with pytest.raises(ValueError, match=r"^torch_groups_loss: loss_types\[2\] must be 'mse' or 'huber' \(group 2 is "
                                         r"a 'q' group\), got 'c51'$"):
        torch_groups_loss(q_main, qs, qo, qt, actions, rewards, dones, V_MIN, V_MAX, GAMMA, ("mse", "iqn", "c51"),
                          fractions=fractions)


def baseline_loss(c, loss_types, online, target, inputs, tau, tau_hat, tau2, masks, dtype=torch.float64):
    """The baseline's training loss: TorchQNet forwards (online at s and tau, at s' and the
    midpoints; target at s' and tau2) and torch_groups_loss, in `dtype`."""
    s, s2, actions, rewards, dones, weights = inputs
    cast = lambda xs: [None if x is None else x.to(dtype) for x in xs]  # noqa: E731
    at = lambda fr: (cast(fr)[0], cast(fr)[1:])  # noqa: E731
    with torch.no_grad():
        qo = [q for q, _ in online(s2.to(dtype), *at(tau_hat))]
        qt = [q for q, _ in target(s2.to(dtype), *at(tau2))]
    qs = [q for q, _ in online(s.to(dtype), *at(tau))]
    return torch_groups_loss(c, qs, qo, qt, actions, rewards.to(dtype), dones.to(dtype), V_MIN, V_MAX, GAMMA,
                             loss_types, weights.to(dtype), cast(masks), cast(tau))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "f32"])
@pytest.mark.parametrize("name", list(NETS))
def test_torch_baseline_step_gradients_match_the_float64_references(name, dtype):
    """The training loss of an online and a target TorchQNet of head groups (online at s and each
    IQN group's tau, at s' and K midpoints; target at s' and tau'), torch_groups_loss with the
    ensemble groups' masks: loss, TD error, mean Q and every parameter's gradient equal those of
    reference_groups_forward + reference_groups_loss on the same weights, the reference's
    parameter gradients by autograd through reference_groups_forward. float64: 1e-10; F32: the
    tolerances of the module docstring, the inputs exact in F32."""
    c, loss_types = NETS[name], LOSS_TYPES[name]
    online, target = seeded_net(c, 30, dtype), seeded_net(c, 31, dtype)
    online64, target64 = copy.deepcopy(online).double(), copy.deepcopy(target).double()
    B = 12
    s, s2, actions, rewards, dones, weights = step_inputs(c, B, 32)
    inputs = (s.float().double(), s2.float().double(), actions, rewards.float().double(), dones,
              weights.float().double())
    tau, tau2 = group_fractions(c, B, 5, 33), group_fractions(c, B, 3, 34)
    tau, tau2 = ([None if f is None else f.float().double() for f in fr] for fr in (tau, tau2))
    tau_hat, masks = group_midpoints(c, B, 4), group_masks(c, B, 35)
    layers = leaf_layers(layers_of(online64))
    with torch.no_grad():
        assert_no_near_ties_per_group([q for q, _ in reference_groups_forward(c, layers, inputs[1], tau_hat)[0]],
                                      loss_types, c)
    ref = reference_step(c, loss_types, layers, layers_of(target64), inputs, tau, tau_hat, tau2, masks)
    loss, td, mean_q = baseline_loss(c, loss_types, online, target, inputs, tau, tau_hat, tau2, masks, dtype)
    loss.backward()
    if dtype == torch.float64:
        torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(td, ref[2], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mean_q, ref[3], rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(loss.detach().double(), ref[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(td.double(), ref[2], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mean_q.double(), ref[3], rtol=1e-4, atol=1e-6)
    for layer, (w, b) in layers.items():
        mod = online.get_submodule(layer)
        for got, want, what in ((mod.weight.grad, w.grad, "weight"), (mod.bias.grad, b.grad, "bias")):
            if dtype == torch.float64:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{layer}.{what}: {m}")
            elif want.abs().max() == 0:  # a branch of one action under dueling, ReLUs dead on the batch
                assert got.abs().max() == 0, f"{layer}.{what}"
            else:
                assert rel_err(got, want) < 1e-4, (layer, what, rel_err(got, want))
    for g in range(c.num_groups):  # every group's heads and phi learn
        prefix = f"g{g}." if g else ""
        own = [k for k in layers if (k.startswith(prefix) if g else not (k[0] in "gs" and k[1].isdigit()))]
        assert own and max(layers[k][0].grad.abs().max() for k in own) > 0, g
    assert layers["s1"][0].grad.abs().max() > 0

"""dqn_ops.from_torch / to_torch, and the plain network dqn_ops.rl.baseline.TorchQNet for any config: CleanRL's
c51 QNetwork as the test case (by registration order), round trips, mappings and every mismatch's error."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dqn_ops
from dqn_ops import DQNConfig, DuelingBranchQNet, ParamLayout, TrainerConfig, from_torch, to_torch
from dqn_ops.layout import shape_numel
from dqn_ops.rl.baseline import TorchQNet, TorchTrainer


# CleanRL's QNetwork, as cleanrl/c51.py has it (https://github.com/vwxyzjn/cleanrl, MIT license).
class QNetwork(nn.Module):
    def __init__(self, env, n_atoms=101, v_min=-100, v_max=100):
        super().__init__()
        self.env = env
        self.n_atoms = n_atoms
        self.register_buffer("atoms", torch.linspace(v_min, v_max, steps=n_atoms))
        self.n = env.single_action_space.n
        self.network = nn.Sequential(
            nn.Linear(np.array(env.single_observation_space.shape).prod(), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, self.n * n_atoms),
        )

    def get_action(self, x, action=None):
        logits = self.network(x)
        # probability mass function for each action
        pmfs = torch.softmax(logits.view(len(x), self.n, self.n_atoms), dim=2)
        q_values = (pmfs * self.atoms).sum(2)
        if action is None:
            action = torch.argmax(q_values, 1)
        return action, pmfs[torch.arange(len(x)), action]


def cleanrl_env(obs_dim=4, actions=2):
    """What QNetwork reads of a gym vector env (CartPole's sizes by default)."""
    return SimpleNamespace(single_observation_space=SimpleNamespace(shape=(obs_dim,)),
                           single_action_space=SimpleNamespace(n=actions))


# CleanRL's network in our terms: two trunk layers, no head layers (H = 0), no dueling, one branch.
CLEANRL = DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=101, branches=(2,), dueling=False)
CONFIGS = {
    "reference": DQNConfig(),
    "cleanrl": CLEANRL,
    "deep_dueling": DQNConfig(state_dim=9, trunk_hidden=(16, 12, 10), value_hidden=(8, 6), adv_hidden=(7, 5), atoms=5,
                              branches=(3, 2)),
    "dueling_h0": DQNConfig(state_dim=6, trunk_hidden=(10,), adv_hidden=(), atoms=3, branches=(2, 3)),
    "q_heads_one_atom": DQNConfig(state_dim=6, trunk_hidden=(10, 8), adv_hidden=(6, 4), atoms=1, branches=(3, 2, 2),
                                  dueling=False),
}
DEEP = CONFIGS["deep_dueling"]


def random_net(c, seed=0):
    return DuelingBranchQNet(c, generator=torch.Generator().manual_seed(seed))


def layout_forward(c, flat, s):
    """The formulas of dqn_ops/layout.py on the flat buffer's segments, grouped as the kernels group them: one
    matrix W_h1 for every head's first layer, block-diagonal deeper layers and output layer (with H = 0 every
    output head reads the last trunk layer). Returns (q, head logits)."""
    L = ParamLayout(c)

    def seg(name):
        off, shape = L.segments[name]
        return flat[off:off + shape_numel(shape)].view(shape)

    h = s
    for i in range(len(c.trunk_hidden)):
        h = F.relu(h @ seg(f"W_s{i + 1}").T + seg(f"b_s{i + 1}"))
    K, H = c.num_heads, c.head_depth
    if H:
        h = F.relu(h @ seg("W_h1").T + seg("b_h1"))
        for j in range(2, H + 1):
            h = F.relu(h @ torch.block_diag(*(seg(f"W_h{j}.{k}") for k in range(K))).T + seg(f"b_h{j}"))
        w_out = torch.block_diag(*(seg(f"W_out{k}") for k in range(K)))
    else:
        w_out = torch.cat([seg(f"W_out{k}") for k in range(K)])
    head = h @ w_out.T + seg("b_out")
    parts = head.split(list(c.head_out_widths()), 1)
    qs = [a.view(-1, n, c.atoms) for a, n in zip(parts[int(c.dueling):], c.branches)]
    if c.dueling:
        v = parts[0].view(-1, 1, c.atoms)
        qs = [v + a - a.mean(1, keepdim=True) for a in qs]
    return torch.cat(qs, 1), head


# Our layer names -> CleanRL's module paths (ParamLayout's order is CleanRL's registration order).
CLEANRL_MAPPING = {"s1": "network.0", "s2": "network.2", "q1.0": "network.4"}


# ----------------------------------------------------------------------------------------
# TorchQNet: the plain network of any config

@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_qnet_has_param_layouts_names_and_shapes(name):
    c = CONFIGS[name]
    sd = TorchQNet(c).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {n: s for n, s, _ in ParamLayout(c).tensors}
    assert sd.keys() == random_net(c).state_dict().keys()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_qnet_computes_the_layout_formulas(name):
    c = CONFIGS[name]
    net = random_net(c).double()
    plain = TorchQNet(c).double()
    plain.load_state_dict(net.state_dict())
    s = torch.randn(17, c.state_dim, dtype=torch.float64)
    q, head = plain(s)
    q_ref, head_ref = layout_forward(c, net.flat_params.detach(), s)
    assert q.shape == (17, c.total_actions, c.atoms) and head.shape == (17, c.head_out)
    torch.testing.assert_close(q, q_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(head, head_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["cleanrl", "deep_dueling", "q_heads_one_atom"])
def test_torch_trainer_learns_a_fixed_batch_with_any_config(name):
    c = CONFIGS[name]
    t = TorchTrainer(c, TrainerConfig(batch_size=32, lr=1e-2, sigma_max=None, tau=0.0, readback_interval=4,
                                      v_min=-100.0 if name == "cleanrl" else -10.0,
                                      v_max=100.0 if name == "cleanrl" else 10.0), device="cpu", seed=3)
    g = torch.Generator().manual_seed(0)
    b = dict(states=torch.randn(32, c.state_dim, generator=g), next_states=torch.randn(32, c.state_dim, generator=g),
             actions=torch.stack([torch.randint(0, n, (32,), generator=g) for n in c.branches], 1),
             rewards=torch.randn(32, generator=g), dones=(torch.rand(32, generator=g) < 0.2).float())
    for _ in range(40):
        t.step(b)
    t.readback()
    rows = t.stats.rows
    assert sum(r["loss"] for r in rows[-5:]) < 0.9 * sum(r["loss"] for r in rows[:5])
    actions = t.act(b["states"])
    assert actions.shape == (32, c.num_branches)
    assert all(0 <= int(actions[:, d].min()) and int(actions[:, d].max()) < n for d, n in enumerate(c.branches))


def test_torch_trainer_spectral_norm_and_target_update_with_any_config():
    t = TorchTrainer(DEEP, TrainerConfig(batch_size=8, sigma_max=0.3, n_power_iterations=100, tau=0.5,
                                         readback_interval=1), device="cpu", seed=1)
    weights = {name: w for name, w in t.online.named_parameters() if name.endswith(".weight")}
    assert len(weights) == 3 + 3 * DEEP.num_heads
    assert all(torch.linalg.matrix_norm(w.detach(), 2) > 0.4 for w in weights.values())  # all will be clamped
    before = {k: v.clone() for k, v in t.target.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    t.step(dict(states=torch.randn(8, 9, generator=g), next_states=torch.randn(8, 9, generator=g),
                actions=torch.stack([torch.randint(0, n, (8,), generator=g) for n in DEEP.branches], 1),
                rewards=torch.randn(8, generator=g), dones=torch.zeros(8)))
    for name, w in weights.items():  # clamped to sigma_max (100 power iterations: the estimate has converged)
        torch.testing.assert_close(torch.linalg.matrix_norm(w.detach(), 2), torch.tensor(0.3), rtol=1e-4, atol=0,
                                   msg=name)
    after = t.target.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every layer of the target moved


# ----------------------------------------------------------------------------------------
# CleanRL's c51 QNetwork, by registration order

def test_cleanrl_qnetwork_converts_by_registration_order():
    m = QNetwork(cleanrl_env())
    net = from_torch(m, CLEANRL)
    ours = net.state_dict()
    for our, their in CLEANRL_MAPPING.items():
        layer = m.get_submodule(their)
        assert torch.equal(ours[f"{our}.weight"], layer.weight.detach())
        assert torch.equal(ours[f"{our}.bias"], layer.bias.detach())
    assert net.flat_params.dtype == torch.float32 and net.params_bf16.dtype == torch.bfloat16
    # the same layers by an explicit mapping
    mapped = from_torch(m, CLEANRL, mapping=CLEANRL_MAPPING)
    assert torch.equal(mapped.flat_params, net.flat_params)


def test_cleanrl_qnetwork_and_the_plain_network_compute_the_same_logits_and_actions():
    m = QNetwork(cleanrl_env()).double()
    plain = to_torch(from_torch(m, CLEANRL))
    x = torch.randn(64, 4, dtype=torch.float64) * 3
    q, head = plain(x)
    torch.testing.assert_close(head, m.network(x), rtol=1e-12, atol=1e-12)
    pmfs = q.softmax(-1)
    assert torch.equal((pmfs * m.atoms).sum(-1).argmax(1), m.get_action(x)[0])


def test_cleanrl_forward_on_the_float64_path_equals_cleanrl():
    """The dqn_ops forward (CPU, float64 path: parameters and mirror float64, nothing rounded) of the converted
    network gives CleanRL's logits and picks CleanRL's actions."""
    m = QNetwork(cleanrl_env()).double()
    net = from_torch(m, CLEANRL)
    assert net.flat_params.dtype == torch.float64 and net.params_bf16.dtype == torch.float64
    x = torch.randn(64, 4, dtype=torch.float64) * 3
    out = net.forward_full(x)
    logits = m.network(x)
    torch.testing.assert_close(out.head_logits, logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.q_logits, logits.view(64, m.n, m.n_atoms), rtol=1e-12, atol=1e-12)
    expected = m.get_action(x)[0]
    assert torch.equal(dqn_ops.greedy_actions(net, x, v_min=-100.0, v_max=100.0)[:, 0], expected)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_torch_forward_on_the_float64_path_equals_the_plain_network(name):
    c = CONFIGS[name]
    plain = TorchQNet(c).double()
    net = from_torch(plain, c)
    s = torch.randn(23, c.state_dim, dtype=torch.float64)
    out = net.forward_full(s)
    q, head = plain(s)
    torch.testing.assert_close(out.q_logits, q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.head_logits, head, rtol=1e-12, atol=1e-12)


def test_cleanrl_network_on_branches_splits_its_output_rows():
    """CleanRL's network on a branching action space (its last layer Linear(84, sum n_d * atoms)) is our H = 0
    network without dueling, its last layer's rows cut per branch (docs/networks.md)."""
    c = DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=11, branches=(3, 2), dueling=False)
    m = QNetwork(cleanrl_env(actions=5), n_atoms=11, v_min=-10, v_max=10).double()
    with pytest.raises(ValueError, match=r"registers 3 nn.Linear layers .* the config has 4"):
        from_torch(m, c)
    out = m.network[4]
    net = DuelingBranchQNet(c).double()
    state = {"s1.weight": m.network[0].weight, "s1.bias": m.network[0].bias,
             "s2.weight": m.network[2].weight, "s2.bias": m.network[2].bias}
    for d, (w, b) in enumerate(zip(out.weight.split([n * c.atoms for n in c.branches]),
                                   out.bias.split([n * c.atoms for n in c.branches]))):
        state[f"q1.{d}.weight"], state[f"q1.{d}.bias"] = w, b
    net.load_state_dict({k: v.detach() for k, v in state.items()})
    x = torch.randn(16, 4, dtype=torch.float64)
    _, head = to_torch(net)(x)
    torch.testing.assert_close(head, m.network(x), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------
# Round trips

def test_cleanrl_round_trip_gives_an_identical_state_dict():
    m = QNetwork(cleanrl_env())
    fresh = QNetwork(cleanrl_env())
    back = to_torch(from_torch(m, CLEANRL), fresh)
    assert back is fresh
    sd, sd_back = m.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys() and all(torch.equal(sd[k], sd_back[k]) for k in sd)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trips_give_identical_state_dicts(name):
    c = CONFIGS[name]
    net = random_net(c, seed=5)
    plain = to_torch(net)
    assert isinstance(plain, TorchQNet) and plain.s1.weight.dtype == torch.float32
    other = random_net(c, seed=6)
    pairs = ((net, from_torch(plain, c)), (plain, to_torch(from_torch(plain, c))), (net, from_torch(net, c)),
             (net, to_torch(net, other)))
    for a, b in pairs:
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the padding of the output weights' segments stays zero (outside every view)
    again = from_torch(plain, c)
    torch.testing.assert_close(again.flat_params, net.flat_params, rtol=0, atol=0)


class HandWrittenDueling(nn.Module):
    """DEEP's network written by hand, registering its heads before its trunk under other names: converts by
    a mapping only."""

    def __init__(self):
        super().__init__()
        self.value = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5))
        self.adv = nn.ModuleList(nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(),
                                               nn.Linear(5, n * 5)) for n in (3, 2))
        self.trunk = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 10),
                                   nn.ReLU())

    def forward(self, x):
        h = self.trunk(x)
        v = self.value(h).view(-1, 1, 5)
        qs = [a(h).view(-1, n, 5) for a, n in zip(self.adv, (3, 2))]
        return torch.cat([v + a - a.mean(1, keepdim=True) for a in qs], 1)

    mapping = {"s1": "trunk.0", "s2": "trunk.2", "s3": "trunk.4", "v1": "value.0", "v2": "value.2", "v3": "value.4",
               "a1.0": "adv.0.0", "a2.0": "adv.0.2", "a3.0": "adv.0.4", "a1.1": "adv.1.0", "a2.1": "adv.1.2",
               "a3.1": "adv.1.4"}


def test_a_dueling_deep_network_converts_by_mapping_and_back():
    m = HandWrittenDueling().double()
    with pytest.raises(ValueError, match=r"our layer 's1' \(weight \[16, 9\], bias \[16\]\) was matched by "
                                         r"registration order with their 'value.0' \(weight \[8, 10\]"):
        from_torch(m, DEEP)
    net = from_torch(m, DEEP, mapping=HandWrittenDueling.mapping)
    x = torch.randn(11, 9, dtype=torch.float64)
    q, _ = to_torch(net)(x)
    torch.testing.assert_close(q, m(x), rtol=1e-12, atol=1e-12)
    fresh = HandWrittenDueling().double()
    to_torch(net, fresh, mapping=HandWrittenDueling.mapping)
    sd, sd_back = m.state_dict(), fresh.state_dict()
    assert all(torch.equal(sd[k], sd_back[k]) for k in sd)


def test_conversions_leave_the_global_rng_alone():
    m = QNetwork(cleanrl_env())
    state = torch.get_rng_state()
    to_torch(from_torch(m, CLEANRL))
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------------------
# Mismatches: each error names both sides

def test_layer_count_mismatch_names_both_sides():
    two_branches = DQNConfig(state_dim=4, trunk_hidden=(120, 84), adv_hidden=(), atoms=101, branches=(1, 1),
                             dueling=False)
    with pytest.raises(ValueError, match=r"from_torch: the module registers 3 nn.Linear layers \('network.0' "
                                         r"\[120, 4\], 'network.2' \[84, 120\], 'network.4' \[202, 84\]\), the "
                                         r"config has 4 \('s1' \[120, 4\], 's2' \[84, 120\], 'q1.0' \[101, 84\], "
                                         r"'q1.1' \[101, 84\]"):
        from_torch(QNetwork(cleanrl_env()), two_branches)


def test_shape_mismatch_names_both_sides():
    m = QNetwork(cleanrl_env(), n_atoms=100)
    with pytest.raises(ValueError, match=r"our layer 'q1.0' \(weight \[202, 84\], bias \[202\]\) was matched by "
                                         r"registration order with their 'network.4' \(weight \[200, 84\], bias "
                                         r"\[200\]\): the shapes differ"):
        from_torch(m, CLEANRL)
    with pytest.raises(ValueError, match=r"our layer 's1' .* matched by the mapping with their 'network.2' "
                                         r"\(weight \[84, 120\]"):
        from_torch(m, CLEANRL, mapping={"s1": "network.2", "s2": "network.0", "q1.0": "network.4"})


def test_mapping_errors():
    m = QNetwork(cleanrl_env())
    with pytest.raises(ValueError, match=r"mapping has no entry for our layer\(s\) \['q1.0'\]"):
        from_torch(m, CLEANRL, mapping={"s1": "network.0", "s2": "network.2"})
    with pytest.raises(ValueError, match=r"mapping has keys that are not layers of the config: \['a1.0'\]; the "
                                         r"config's layers: 's1' \[120, 4\]"):
        from_torch(m, CLEANRL, mapping={**CLEANRL_MAPPING, "a1.0": "network.4"})
    with pytest.raises(ValueError, match=r"mapping\['q1.0'\] = 'network.5' is not a submodule of the module; its "
                                         r"nn.Linear layers: 'network.0' \[120, 4\]"):
        from_torch(m, CLEANRL, mapping={**CLEANRL_MAPPING, "q1.0": "network.5"})
    with pytest.raises(ValueError, match=r"mapping gives their layer\(s\) \['network.0'\] to more than one"):
        from_torch(m, CLEANRL, mapping={**CLEANRL_MAPPING, "s2": "network.0"})
    with pytest.raises(ValueError, match=r"our layer 's2' .* matched by the mapping with their 'network.1', which "
                                         r"has no weight tensor"):
        from_torch(m, CLEANRL, mapping={**CLEANRL_MAPPING, "s2": "network.1"})
    with pytest.raises(TypeError, match=r"from_torch: mapping must be a dict"):
        from_torch(m, CLEANRL, mapping=[("s1", "network.0")])
    with pytest.raises(ValueError, match=r"to_torch: mapping applies to a given module"):
        to_torch(from_torch(m, CLEANRL), mapping=CLEANRL_MAPPING)


def test_a_layer_without_bias_is_refused():
    m = QNetwork(cleanrl_env())
    m.network[2] = nn.Linear(120, 84, bias=False)
    with pytest.raises(ValueError, match=r"our layer 's2' \(weight \[84, 120\], bias \[84\]\) was matched by "
                                         r"registration order with their 'network.2', which has no bias tensor"):
        from_torch(m, CLEANRL)


def test_parameters_outside_the_matched_layers_are_refused():
    m = QNetwork(cleanrl_env())
    m.network[1] = nn.LayerNorm(120)
    with pytest.raises(ValueError, match=r"parameters outside its nn.Linear layers \(\['network.1.weight', "
                                         r"'network.1.bias'\]\)"):
        from_torch(m, CLEANRL)
    from_torch(m, CLEANRL, mapping=CLEANRL_MAPPING)  # a mapping takes the layers it names
    c = CONFIGS["dueling_h0"]
    plain = TorchQNet(c)
    plain.extra = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"has every layer of the config by name and also \['extra.weight', "
                                         r"'extra.bias'\]"):
        from_torch(plain, c)


def test_partial_names_are_reported_with_the_count_mismatch():
    c = CONFIGS["dueling_h0"]
    plain = TorchQNet(c)
    del plain.v1
    with pytest.raises(ValueError, match=r"its state dict has some of our names, \['s1', 'a1.0', 'a1.1'\], but not "
                                         r"all"):
        from_torch(plain, c)


def test_a_parametrized_target_layer_is_reported():
    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    fresh = QNetwork(cleanrl_env())
    torch.nn.utils.parametrize.register_parametrization(fresh.network[0], "weight", Doubled())
    with pytest.raises(ValueError, match=r"to_torch: their 'network.0.weight' did not take our 's1.weight'"):
        to_torch(from_torch(QNetwork(cleanrl_env()), CLEANRL), fresh)


def test_bad_argument_types():
    with pytest.raises(TypeError, match=r"from_torch: module must be an nn.Module, got dict"):
        from_torch({}, CLEANRL)
    with pytest.raises(TypeError, match=r"from_torch: config must be a dqn_ops.DQNConfig, got tuple"):
        from_torch(QNetwork(cleanrl_env()), (120, 84))
    with pytest.raises(TypeError, match=r"to_torch: net must be a dqn_ops.DuelingBranchQNet, got QNetwork"):
        to_torch(QNetwork(cleanrl_env()))
    m = QNetwork(cleanrl_env())
    m.ints = nn.Module()
    m.ints.register_buffer("weight", torch.zeros(120, 4, dtype=torch.int32))
    m.ints.register_buffer("bias", torch.zeros(120, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"their 'ints' \(matched by the mapping with our 's1'\) must hold "
                                        r"floating-point tensors, got torch.int32"):
        from_torch(m, CLEANRL, mapping={**CLEANRL_MAPPING, "s1": "ints"})

"""The trainer's fused CUDA path (dqn_ops/fused.py) against the public ops it replaces.

The fused ops do the same arithmetic in the same order as bf16_dueling_forward -> dqn_loss ->
mixed_backward, so the comparison is for equal bits (NaN where NaN): the loss, TD errors, mean
Q and the flat gradient, on random networks and batches with terminal transitions, rewards that
clip at the support's ends, a NaN reward and an out-of-range action. The public ops themselves
are checked against float64 references in test_loss.py and test_network.py.
"""
import pytest
import torch

from conftest import requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig, fused
from poison import poison_cuda_cache

V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97

CASES = {  # branches, atoms
    "reference": ((3, 3, 3), 51),
    "two_branches_11_atoms": ((2, 5), 11),
    "one_action_two_atoms": ((1,), 2),
    "lanes_with_one_or_two_atoms": ((6, 2), 33),
    "64_atoms": ((3, 5), 64),
    "eight_uneven_branches": ((2, 3, 1, 4, 3, 2, 5, 2), 7),
}


def _config(branches, atoms):
    return DQNConfig(state_dim=24, trunk_hidden=(64, 48), value_hidden=32, adv_hidden=24, atoms=atoms,
                     branches=branches)


def _net(config, seed):
    return DuelingBranchQNet(config, generator=torch.Generator().manual_seed(seed)).cuda()


def _batch(config, B, seed, poison_samples=True):
    g = torch.Generator().manual_seed(seed)
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in config.branches], 1)
    # rewards up to 1.5x the support: r + gamma z clips at v_min / v_max for many atoms
    rewards = (torch.rand(B, generator=g) * 2 - 1) * 1.5 * V_MAX
    dones = (torch.rand(B, generator=g) < 0.2).float()
    if poison_samples and B > 3:
        rewards[1] = float("nan")  # a poisoned sample: NaN loss and gradient rows
        actions[2, -1] = config.branches[-1]  # out of range: the same on CUDA
    b = dict(states=torch.randn(2 * B, config.state_dim, generator=g), actions=actions, rewards=rewards,
             dones=dones, weights=torch.rand(B, generator=g) + 0.5)
    return {k: v.cuda() for k, v in b.items()}


@torch.no_grad()
def _public_step(online, target, b, precision):
    """The unfused path, as Trainer runs it with the public ops."""
    B, layout = b["actions"].shape[0], online._layout_ints
    out = torch.ops.dqn_ops.bf16_dueling_forward.default(b["states"], online.flat_params, online.params_bf16,
                                                         layout, precision)
    q_target = torch.ops.dqn_ops.bf16_dueling_forward.default(b["states"][B:], target.flat_params,
                                                              target.params_bf16, layout, precision)[0]
    loss, grad_q, td, mean_q = torch.ops.dqn_ops.dqn_loss.default(
        out[0][:B], out[0][B:], q_target, b["actions"], b["rewards"], b["dones"], b["weights"],
        list(online.config.branches), V_MIN, V_MAX, GAMMA, "c51")
    grad, _ = torch.ops.dqn_ops.mixed_backward.default(grad_q, None, *[t[:B] for t in out[2:6]], online.flat_params,
                                                       online.params_bf16, layout, precision, False)
    return dict(loss=loss, td_error=td, mean_q=mean_q, grad=grad, grad_q=grad_q, acts=[t[:B] for t in out[2:6]])


def _logits(online, target, states, batch_networks):
    return fused.online_and_target_logits(states, online.flat_params, online.params_bf16, target.flat_params,
                                          target.params_bf16, online._layout_ints, batch_networks)


@torch.no_grad()
def _fused_step(online, target, b, precision, batch_networks=False):
    B, layout = b["actions"].shape[0], online._layout_ints
    f = _logits(online, target, b["states"], batch_networks)
    r = fused.dqn_loss_on_logits(f.logits[:B], f.logits[B:], f.logits_next_target, online.flat_params,
                                 target.flat_params, b["actions"], b["rewards"], b["dones"], b["weights"], layout,
                                 V_MIN, V_MAX, GAMMA)
    acts = [t[:B] for t in f[2:]]
    grad = fused.mixed_backward_from_head(r.grad_head, r.grad_head_bf16, acts, online.flat_params,
                                          online.params_bf16, layout, precision)
    return dict(loss=r.loss, td_error=r.td_error, mean_q=r.mean_q, grad=grad, grad_head=r.grad_head,
                grad_head_bf16=r.grad_head_bf16, acts=acts)


def _same_bits(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@requires_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("batch_networks", [False, True], ids=["two_passes", "networks_batched"])
def test_fused_path_gives_the_public_ops_bits(case, precision, batch_networks):
    config = _config(*CASES[case])
    online, target = _net(config, 1), _net(config, 2)
    b = _batch(config, 37, seed=3)
    poison_cuda_cache()
    want = _public_step(online, target, b, precision)
    poison_cuda_cache()
    got = _fused_step(online, target, b, precision, batch_networks)
    for i, (x, y) in enumerate(zip(got["acts"], want["acts"])):
        _same_bits(x, y, f"saved activation {i}")
    for k in ("loss", "td_error", "mean_q", "grad"):
        _same_bits(got[k], want[k], k)
    assert torch.isnan(got["loss"]) and torch.isnan(got["td_error"][1:3]).all()  # the poisoned samples
    assert torch.isfinite(got["td_error"][3:]).all()


@requires_cuda
@pytest.mark.parametrize("case", ["reference", "eight_uneven_branches", "lanes_with_one_or_two_atoms"])
def test_head_gradient_is_the_dueling_backward_of_grad_q(case):
    """grad_head against the dueling aggregate's backward written out in PyTorch: value column
    = sum over every action of d(q); a branch's advantage columns = d(q) minus its mean over the
    branch's actions. And grad_head_bf16 is its BF16 copy in the padded layout, padding 0."""
    config = _config(*CASES[case])
    online, target = _net(config, 4), _net(config, 5)
    b = _batch(config, 64, seed=6, poison_samples=False)
    want = _public_step(online, target, b, "bf16")
    got = _fused_step(online, target, b, "bf16")
    grad_q, atoms = want["grad_q"].double(), config.atoms
    cols, first = [grad_q.sum(1)], 0
    for n in config.branches:
        dq = grad_q[:, first:first + n]
        cols.append((dq - dq.mean(1, keepdim=True)).flatten(1))
        first += n
    ref = torch.cat(cols, 1)
    torch.testing.assert_close(got["grad_head"].double(), ref, rtol=1e-5, atol=1e-9)
    padded = got["grad_head_bf16"]
    assert padded.shape == (64, config.head_ld)
    out_col = col = 0
    for j, width in enumerate([atoms] + [atoms * n for n in config.branches]):
        _same_bits(padded[:, col:col + width], got["grad_head"][:, out_col:out_col + width].to(torch.bfloat16),
                   f"head {j}")
        pad = -(-width // 8) * 8
        assert (padded[:, col + width:col + pad] == 0).all(), f"head {j}: padding not 0"
        out_col, col = out_col + width, col + pad
    assert col == config.head_ld


@requires_cuda
@pytest.mark.parametrize("B", [1, 8, 300])
def test_batched_networks_give_the_two_passes_bits_in_either_memory_order(B):
    """The batched hidden layers stride from the lower-addressed network's weights to the
    other's: each network as the online one in turn covers both orders, and the same network
    as both (stride 0)."""
    config = _config((3, 3, 3), 51)
    a, b = _net(config, 1), _net(config, 2)
    states = torch.randn(2 * B, config.state_dim, generator=torch.Generator().manual_seed(B)).cuda()
    for online, target in [(a, b), (b, a), (a, a)]:
        poison_cuda_cache()
        want = _logits(online, target, states, False)
        poison_cuda_cache()
        got = _logits(online, target, states, True)
        for name, x, y in zip(fused.Logits._fields, got, want):
            assert x.shape == y.shape, name
            _same_bits(x, y, name)
        assert want.logits_next_target.shape == (B, config.head_ld)


@requires_cuda
def test_trainer_steps_equal_with_and_without_the_fused_path():
    config = _config((3, 3, 3), 51)
    cfg = TrainerConfig(batch_size=128, use_cuda_graph=True, readback_interval=4, on_non_finite="flag")
    a, b = Trainer(config, cfg, device="cuda", seed=7), Trainer(config, cfg, device="cuda", seed=7)
    assert a.uses_fused_path
    b.uses_fused_path = False  # before the first step, so its graph captures the public ops
    for i in range(8):
        batch = _batch(config, 128, seed=10 + i, poison_samples=False)
        batch["next_states"] = batch["states"][128:]
        batch["states"] = batch["states"][:128]
        a.step(batch)
        b.step(batch)
    torch.cuda.synchronize()
    assert a.graphed and b.graphed
    _same_bits(a.online.flat_params, b.online.flat_params, "online params")
    _same_bits(a.target.flat_params, b.target.flat_params, "target params")
    _same_bits(a.td_error, b.td_error, "td_error")
    assert a.readback() == b.readback()


@requires_cuda
def test_opcheck():
    config = _config((2, 5), 11)
    online, target = _net(config, 1), _net(config, 2)
    b = _batch(config, 16, seed=3, poison_samples=False)
    layout, B = online._layout_ints, 16
    p, p_lp, p_target = online.flat_params.detach(), online.params_bf16, target.flat_params.detach()
    p_target_lp = target.params_bf16
    f = fused.online_and_target_logits(b["states"], p, p_lp, p_target, p_target_lp, layout, False)
    logits = [f.logits[:B].contiguous(), f.logits[B:].contiguous()]
    r = fused.dqn_loss_on_logits(logits[0], logits[1], logits[1], p, p_target, b["actions"], b["rewards"], b["dones"],
                                 b["weights"], layout, V_MIN, V_MAX, GAMMA)
    acts = [t[:B].contiguous() for t in f[2:]]
    for batch_networks in (False, True):
        torch.library.opcheck(torch.ops.dqn_ops._online_and_target_logits.default,
                              (b["states"], p, p_lp, p_target, p_target_lp, layout, batch_networks))
    for weights in (None, b["weights"]):
        torch.library.opcheck(torch.ops.dqn_ops._dqn_loss_on_logits.default,
                              (logits[0], logits[1], logits[1], p, p_target, b["actions"], b["rewards"], b["dones"],
                               weights, layout, V_MIN, V_MAX, GAMMA))
    for precision in ("bf16", "tf32"):
        torch.library.opcheck(torch.ops.dqn_ops._mixed_backward_from_head.default,
                              (r.grad_head, r.grad_head_bf16, *acts, p, p_lp, layout, precision))


@requires_cuda
@pytest.mark.parametrize("what,match", [
    ("odd_rows", r"state_pairs: expected \[s; s'\], an even number of rows, got 15"),
    ("state_width", r"state_pairs: expected shape \[\*, 24\]"),
    ("target_dtype", "target_params: expected dtype Float"),
    ("target_mirror", r"target_params_bf16: expected shape \["),
    ("target_device", "target_params: expected a tensor on cuda"),
])
def test_online_and_target_logits_rejects_bad_input(what, match):
    config = _config((2, 5), 11)
    online, target = _net(config, 1), _net(config, 2)
    args = dict(state_pairs=torch.zeros(16, config.state_dim, device="cuda"), params=online.flat_params.detach(),
                params_bf16=online.params_bf16, target_params=target.flat_params.detach(),
                target_params_bf16=target.params_bf16)
    if what == "odd_rows":
        args["state_pairs"] = args["state_pairs"][:15]
    if what == "state_width":
        args["state_pairs"] = torch.zeros(16, config.state_dim + 1, device="cuda")
    if what == "target_dtype":
        args["target_params"] = args["target_params"].double()
    if what == "target_mirror":
        args["target_params_bf16"] = args["target_params_bf16"][1:]
    if what == "target_device":
        args["target_params"] = args["target_params"].cpu()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.dqn_ops._online_and_target_logits.default(*args.values(), online._layout_ints, True)


@requires_cuda
@pytest.mark.parametrize("what,match", [
    ("atoms", "takes C51 with 2 to 64 atoms"),
    ("branches", "takes at most 8 branches"),
    ("logits", r"logits: expected shape \[\*, "),
    ("target_params", "target_params: expected dtype Float"),
    ("actions", r"actions: expected shape \[16, 2\]"),
])
def test_loss_on_logits_rejects_bad_input(what, match):
    config = _config((2, 5), 11)
    if what == "atoms":
        config = _config((2, 5), 65)
    if what == "branches":
        config = _config((2,) * 9, 11)
    online = _net(config, 1)
    B, layout = 16, online._layout_ints
    logits = torch.zeros(B, config.head_ld, device="cuda")
    p = online.flat_params.detach()
    args = dict(logits=logits, logits_next_online=logits, logits_next_target=logits, params=p,
                target_params=p, actions=torch.zeros(B, config.num_branches, dtype=torch.long,
                                                                      device="cuda"),
                rewards=torch.zeros(B, device="cuda"), dones=torch.zeros(B, device="cuda"), weights=None)
    if what == "logits":
        args["logits"] = torch.zeros(B, config.head_ld + 1, device="cuda")
    if what == "target_params":
        args["target_params"] = p.double()
    if what == "actions":
        args["actions"] = torch.zeros(B, 3, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match=match):
        torch.ops.dqn_ops._dqn_loss_on_logits.default(*args.values(), layout, V_MIN, V_MAX, GAMMA)


def test_fused_path_runs_only_where_it_is_built_for():
    ref = DQNConfig()
    assert ref.head_ld == 56 + 3 * 160  # 51 atoms -> 56 columns; 3 x 51 = 153 -> 160 (csrc/layout.h)
    assert fused.supported(ref, "c51", torch.device("cuda"))
    assert not fused.supported(ref, "c51", torch.device("cpu"))
    assert not fused.supported(_config((3,), 65), "c51", torch.device("cuda"))
    assert not fused.supported(_config((2,) * 9, 11), "c51", torch.device("cuda"))
    assert not fused.supported(DQNConfig(atoms=1), "huber", torch.device("cuda"))
    assert not Trainer(_config((2, 5), 11), TrainerConfig(batch_size=8), device="cpu").uses_fused_path


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors")
def test_fake_kernels_give_the_fused_step_its_shapes():
    """The fake kernels (torch.compile / FakeTensor tracing) on fake CUDA tensors: runs on a
    machine without a GPU; on the GPU, test_opcheck checks them against the real kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = _config((2, 3, 1, 4), 33)
    layout = DuelingBranchQNet(c)._layout_ints
    B, n = 8, layout[-1]
    with FakeTensorMode():
        p, p_lp = torch.empty(n, device="cuda"), torch.empty(n, device="cuda", dtype=torch.bfloat16)
        f = fused.online_and_target_logits(torch.empty(2 * B, c.state_dim, device="cuda"), p, p_lp, p, p_lp, layout,
                                           True)
        assert f.logits.shape == (2 * B, c.head_ld) and f.logits.dtype == torch.float32
        assert f.logits_next_target.shape == (B, c.head_ld) and f.logits_next_target.dtype == torch.float32
        assert [t.shape for t in f[2:]] == [(2 * B, c.state_dim), (2 * B, 64), (2 * B, 48), (2 * B, c.head_hidden)]
        assert all(t.dtype == torch.bfloat16 for t in f[2:])
        r = fused.dqn_loss_on_logits(f.logits[:B], f.logits[B:], f.logits_next_target, p, p,
                                     torch.empty(B, c.num_branches, dtype=torch.long, device="cuda"),
                                     torch.empty(B, device="cuda"), torch.empty(B, device="cuda"), None, layout,
                                     V_MIN, V_MAX, GAMMA)
        assert r.loss.shape == () and r.td_error.shape == (B,) and r.mean_q.shape == ()
        assert r.grad_head.shape == (B, c.head_out) and r.grad_head_bf16.shape == (B, c.head_ld)
        assert r.grad_head_bf16.dtype == torch.bfloat16
        grad = fused.mixed_backward_from_head(r.grad_head, r.grad_head_bf16, [t[:B] for t in f[2:]], p, p_lp, layout)
        assert grad.shape == (n,) and grad.dtype == torch.float32

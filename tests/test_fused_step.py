"""The trainer's step (dqn_ops.step.InternalOpsStep: _online_and_target_logits ->
_dqn_loss_on_logits -> _mixed_backward_from_head) against the same step on the public ops
(dqn_ops.step.PublicOpsStep: bf16_dueling_forward -> dqn_loss -> mixed_backward).

The internal ops do the same arithmetic in the same order as the public ones, on the CPU and
on CUDA, fused loss kernel or not, so the comparison is for equal bits (NaN where NaN): the
loss, TD errors, mean Q, the saved activations and the flat gradient, on random networks and
batches with terminal transitions and rewards that clip at the support's ends, and with a NaN
reward (and, on CUDA, an out-of-range action). The public ops themselves are checked against
float64 references in test_loss.py and test_network.py. On the CPU the internal ops run the
same helpers as the public ones (csrc/network_cpu.cpp, csrc/loss_cpu.cpp; batch_networks
changes nothing there), so the CPU cases check the plumbing (arguments, the [s; s'] split, the
outputs' layout) and the CUDA cases the kernels.
"""
from typing import NamedTuple

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, Trainer, TrainerConfig, ops
from dqn_ops.step import InternalOpsStep, PublicOpsStep, default_batch_networks, fused_loss_supported
from poison import poison_cuda_cache
from step_check import check_trainer_step_is_the_public_ops_step, same_bits

V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97

CASES = {  # branches, atoms, loss type (and dueling=False: no value head; then an ensemble's members)
    "reference": ((3, 3, 3), 51, "c51"),
    "two_branches_11_atoms": ((2, 5), 11, "c51"),
    "one_action_two_atoms": ((1,), 2, "c51"),
    "lanes_with_one_or_two_atoms": ((6, 2), 33, "c51"),
    "64_atoms": ((3, 5), 64, "c51"),
    "eight_uneven_branches": ((2, 3, 1, 4, 3, 2, 5, 2), 7, "c51"),
    "nine_branches": ((2, 3, 1, 2, 4, 2, 3, 1, 2), 5, "c51"),  # more branches than a block's warps
    # the fused kernel's version with 3 or 4 atoms a lane: rows in registers (<= 4 actions) or not
    "65_atoms": ((3, 2), 65, "c51"),
    "128_atoms_five_actions": ((5, 2), 128, "c51"),
    "cleanrl_like_101_atoms_no_dueling": ((2,), 101, "c51", False),
    "no_dueling_51_atoms": ((3, 2), 51, "c51", False),
    # QR's fused kernel: the sorted version (N > 32) and the direct one, more actions than a
    # chunk of loads (the columns one at a time; up to a chunk, in batches), a warp per branch of
    # a full block, no value head (with and without more actions than a chunk), 8 warps of 256
    # quantiles (its shared memory past the default 48 KiB), more branches than a block's warps
    "qr_200_quantiles": ((3, 3, 3), 200, "qr"),
    "qr_32_quantiles": ((2, 5), 32, "qr"),
    "qr_six_actions_33_quantiles": ((6, 2), 33, "qr"),
    "qr_eight_uneven_branches": ((2, 3, 1, 4, 3, 2, 5, 2), 7, "qr"),
    "qr_no_dueling_50_quantiles": ((3, 2), 50, "qr", False),
    "qr_no_dueling_five_actions": ((5, 2), 40, "qr", False),
    "qr_one_branch_256_quantiles": ((3,), 256, "qr"),
    "qr_nine_branches": ((2, 3, 1, 2, 4, 2, 3, 1, 2), 9, "qr"),
    # ensembles, with bootstrap masks (_batch): more entries than a block's warps, the most
    # entries, QR, no value head
    "ensemble_3_reference": ((3, 3, 3), 51, "c51", True, 3),
    "ensemble_4_eight_branches": ((2,) * 8, 5, "c51", True, 4),
    "ensemble_5_qr_33_quantiles": ((2, 3), 33, "qr", True, 5),
    "ensemble_2_no_dueling": ((3, 2), 21, "c51", False, 2),
    # beyond the fused loss kernel: on CUDA the internal loss op composes the public kernels
    "129_atoms": ((3, 2), 129, "c51"),
    "33_branches": ((2, 1, 3) * 11, 5, "c51"),
    "ensemble_9_four_branches": ((2, 3, 1, 2), 5, "c51", True, 9),  # 36 entries
    "one_atom_mse": ((3, 3, 3), 1, "mse"),
    "one_atom_huber": ((2, 4), 1, "huber"),
}


def _config(branches, atoms, dueling=True, ensemble=1):
    return DQNConfig(state_dim=24, trunk_hidden=(64, 48), value_hidden=32 if dueling else (), adv_hidden=24,
                     atoms=atoms, branches=branches, dueling=dueling, ensemble=ensemble)


def _net(config, seed, device):
    return DuelingBranchQNet(config, generator=torch.Generator().manual_seed(seed)).to(device)


def _batch(config, B, seed, device, poison_samples=False):
    """state_pairs [2B, SD] = [s; s'], actions, rewards, dones, weights, and an ensemble's
    bootstrap masks [B, E] (sample 0 masked out of every member, sample 1 of none)."""
    g = torch.Generator().manual_seed(seed)
    actions = torch.stack([torch.randint(0, n, (B,), generator=g) for n in config.branches], 1)
    # rewards up to 1.5x the support: r + gamma z clips at v_min / v_max for many atoms
    rewards = (torch.rand(B, generator=g) * 2 - 1) * 1.5 * V_MAX
    dones = (torch.rand(B, generator=g) < 0.2).float()
    if poison_samples:
        rewards[1] = float("nan")  # NaN loss and gradient rows
        if torch.device(device).type == "cuda":
            actions[2, -1] = config.branches[-1]  # out of range: NaN too on CUDA (the CPU raises)
    b = dict(state_pairs=torch.randn(2 * B, config.state_dim, generator=g), actions=actions, rewards=rewards,
             dones=dones, weights=torch.rand(B, generator=g) + 0.5)
    if config.members > 1:
        masks = (torch.rand(B, config.members, generator=g) < 0.5).float()
        masks[0], masks[1] = 0.0, 1.0
        b["masks"] = masks
    return {k: v.to(device) for k, v in b.items()}


class Sample(NamedTuple):
    config: DQNConfig
    loss_type: str
    online: DuelingBranchQNet  # F32 parameters with their BF16 mirror
    target: DuelingBranchQNet
    batch: dict


def sample_inputs(case, device, B=37, seed=3, poison_samples=False) -> Sample:
    """The inputs of the step family: a case's networks (online and target differ) and a batch."""
    branches, atoms, loss_type, *shape = CASES[case]
    config = _config(branches, atoms, *shape)
    return Sample(config, loss_type, _net(config, 1, device), _net(config, 2, device),
                  _batch(config, B, seed, device, poison_samples))


def _steps(s: Sample, precision="bf16", batch_networks=False):
    kw = dict(loss_type=s.loss_type, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA, precision=precision)
    return (InternalOpsStep(s.online, s.target, batch_networks=batch_networks, **kw),
            PublicOpsStep(s.online, s.target, **kw))


def _run(step, batch, poison):
    if poison:
        poison_cuda_cache()
    return step(**batch)


def _assert_same_step(got, want, outputs=("loss", "td_error", "mean_q", "grad")):
    for i, (x, y) in enumerate(zip(got.saved, want.saved)):
        same_bits(x, y, f"saved activation {i}")
    for k in outputs:
        same_bits(getattr(got, k), getattr(want, k), k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("batch_networks", [False, True], ids=["two_passes", "networks_batched"])
def test_internal_ops_give_the_public_ops_bits(device, case, precision, batch_networks):
    s = sample_inputs(case, device)
    internal, public = _steps(s, precision, batch_networks)
    cuda = device == "cuda"
    want, got = _run(public, s.batch, cuda), _run(internal, s.batch, cuda)
    _assert_same_step(got, want)
    assert torch.isfinite(got.grad).all() and torch.isfinite(got.td_error).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["reference", "eight_uneven_branches", "nine_branches", "one_atom_huber",
                                  "qr_200_quantiles", "qr_32_quantiles", "qr_no_dueling_50_quantiles",
                                  "qr_no_dueling_five_actions", "qr_nine_branches", "ensemble_3_reference",
                                  "ensemble_5_qr_33_quantiles", "33_branches"])
def test_non_finite_samples_give_the_public_ops_bits(device, case):
    s = sample_inputs(case, device, poison_samples=True)
    internal, public = _steps(s)
    cuda = device == "cuda"
    want, got = _run(public, s.batch, cuda), _run(internal, s.batch, cuda)
    _assert_same_step(got, want)
    poisoned = torch.zeros(got.td_error.shape[0], dtype=torch.bool, device=got.td_error.device)
    poisoned[1:3 if cuda else 2] = True  # the NaN reward's sample (and on CUDA the bad action's)
    assert torch.isnan(got.loss) and torch.isnan(got.td_error[poisoned]).all()
    assert torch.isfinite(got.td_error[~poisoned]).all()


@requires_cuda
@pytest.mark.parametrize("case", ["reference", "qr_200_quantiles", "qr_no_dueling_50_quantiles",
                                  "ensemble_3_reference", "ensemble_5_qr_33_quantiles"])
def test_many_rounds_of_the_loss_kernels_grid_keep_the_public_ops_bits(case):
    """At B = 3000 each block of the loss kernel's resident grid takes several rounds of samples,
    so its round buffers alternate (the value columns' sums, QR's theta and gradient): the
    per-sample outputs and the gradient are the public ops' bits (no poisoned sample, whose NaN
    would reach every weight's gradient). The loss and mean-Q scalars sum per-block partials over
    the launch's grid, which follows each kernel's occupancy (csrc/cuda/loss.cu): to rounding."""
    s = sample_inputs(case, "cuda", B=3000, seed=11)
    internal, public = _steps(s)
    want, got = _run(public, s.batch, True), _run(internal, s.batch, True)
    _assert_same_step(got, want, outputs=("td_error", "grad"))
    for k in ("loss", "mean_q"):
        torch.testing.assert_close(getattr(got, k), getattr(want, k), rtol=1e-6, atol=1e-9, msg=k)
    assert torch.isfinite(got.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["reference", "eight_uneven_branches", "lanes_with_one_or_two_atoms", "65_atoms",
                                  "128_atoms_five_actions", "nine_branches", "one_atom_mse", "qr_200_quantiles",
                                  "qr_six_actions_33_quantiles", "qr_one_branch_256_quantiles"])
def test_head_gradient_is_the_dueling_backward_of_grad_q(device, case):
    """grad_head against the dueling aggregate's backward written out in PyTorch: value column
    = sum over every action of d(q); a branch's advantage columns = d(q) minus its mean over the
    branch's actions. And grad_head_bf16 is its BF16 copy in the padded layout, padding 0."""
    s = sample_inputs(case, device, B=64, seed=6)
    config, atoms = s.config, s.config.atoms
    internal, public = _steps(s)
    grad_q = public(**s.batch).loss_out.grad_q.double()
    got = internal(**s.batch).loss_out
    cols, first = [grad_q.sum(1)], 0
    for n in config.branches:
        dq = grad_q[:, first:first + n]
        cols.append((dq - dq.mean(1, keepdim=True)).flatten(1))
        first += n
    ref = torch.cat(cols, 1)
    torch.testing.assert_close(got.grad_head.double(), ref, rtol=1e-5, atol=1e-9)
    padded = got.grad_head_bf16
    assert padded.shape == (64, config.head_ld)
    out_col = col = 0
    for j, width in enumerate([atoms] + [atoms * n for n in config.branches]):
        same_bits(padded[:, col:col + width], got.grad_head[:, out_col:out_col + width].to(torch.bfloat16),
                   f"head {j}")
        pad = -(-width // 8) * 8
        assert (padded[:, col + width:col + pad] == 0).all(), f"head {j}: padding not 0"
        out_col, col = out_col + width, col + pad
    assert col == config.head_ld


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B", [1, 8, 300])
def test_batched_networks_give_the_two_passes_bits_in_either_memory_order(device, B):
    """The batched hidden layers stride from the lower-addressed network's weights to the
    other's: each network as the online one in turn covers both orders, and the same network
    as both (stride 0)."""
    s = sample_inputs("reference", device, B=B, seed=B)
    a, b = s.online, s.target
    for online, target in [(a, b), (b, a), (a, a)]:
        two_passes = InternalOpsStep(online, target, batch_networks=False)
        batched = InternalOpsStep(online, target, batch_networks=True)
        want = _run(two_passes.forward, dict(state_pairs=s.batch["state_pairs"]), device == "cuda")
        got = _run(batched.forward, dict(state_pairs=s.batch["state_pairs"]), device == "cuda")
        named = [("logits", got.logits, want.logits),
                 ("logits_next_target", got.logits_next_target, want.logits_next_target)]
        assert len(got.activations) == len(want.activations) == 1 + len(s.config.hidden_widths)
        named += [(f"activations[{i}]", x, y) for i, (x, y) in enumerate(zip(got.activations, want.activations))]
        for name, x, y in named:
            assert x.shape == y.shape, name
            same_bits(x, y, name)
        assert want.logits_next_target.shape == (B, s.config.head_ld)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["reference", "two_branches_11_atoms", "65_atoms",
                                  "cleanrl_like_101_atoms_no_dueling", "129_atoms", "nine_branches", "one_atom_mse",
                                  "one_atom_huber", "qr_200_quantiles", "qr_no_dueling_50_quantiles"])
def test_trainer_step_is_the_public_ops_step(device, case):
    """The trainer's one path (graphed on CUDA) against PublicOpsStep on copies of its networks
    taken before the step: the same gradient, TD errors, loss and mean Q, bit for bit."""
    branches, atoms, loss_type, *dueling = CASES[case]
    config, B = _config(branches, atoms, *dueling), 64
    cfg = TrainerConfig(batch_size=B, loss_type=loss_type, gamma=GAMMA, v_min=V_MIN, v_max=V_MAX, readback_interval=1,
                        on_non_finite="flag")
    t = Trainer(config, cfg, device=device, seed=7)
    assert t.batch_networks == default_batch_networks(B)
    batches = [_batch(config, B, seed=10 + i, device=device) for i in range(5)]
    for b in batches:
        b.update(states=b["state_pairs"][:B], next_states=b["state_pairs"][B:])
    # on CUDA: 3 warm-up steps, then the capture
    check_trainer_step_is_the_public_ops_step(t, batches, V_MIN, V_MAX, GAMMA)


def _internal_op_args(s: Sample):
    """Each internal op's arguments, from one run of the step before it (contiguous copies:
    opcheck wants its own tensors)."""
    internal, _ = _steps(s)
    b, B = s.batch, s.batch["actions"].shape[0]
    p, p_lp = s.online.flat_params.detach(), s.online.params_bf16
    tp, tp_lp, layout = s.target.flat_params.detach(), s.target.params_bf16, s.online._layout_ints
    out = internal(**b)
    f, head = out.forward_out, out.loss_out
    logits = [f.logits[:B].contiguous(), f.logits[B:].contiguous()]
    saved = [t.contiguous() for t in out.saved]
    return {
        "_online_and_target_logits": [(b["state_pairs"], p, p_lp, tp, tp_lp, layout, batch_networks)
                                      for batch_networks in (False, True)],
        "_dqn_loss_on_logits": [(logits[0], logits[1], f.logits_next_target, p, tp, b["actions"], b["rewards"],
                                 b["dones"], weights, layout, V_MIN, V_MAX, GAMMA, s.loss_type, None, counter)
                                for weights, counter in ((None, None), (b["weights"], None),
                                                         (b["weights"], ops.new_loss_counter(p.device)))],
        "_mixed_backward_from_head": [(head.grad_head, head.grad_head_bf16, saved, p, p_lp, layout, precision)
                                      for precision in ("bf16", "tf32")],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["two_branches_11_atoms", "nine_branches", "one_atom_huber", "qr_32_quantiles"])
def test_opcheck(device, case):
    s = sample_inputs(case, device, B=16)
    for name, arg_sets in _internal_op_args(s).items():
        for args in arg_sets:
            torch.library.opcheck(getattr(torch.ops.dqn_ops, name).default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what,match", [
    ("odd_rows", r"state_pairs: expected \[s; s'\], an even number of rows, got 15"),
    ("state_width", r"state_pairs: expected shape \[\*, 24\]"),
    ("target_dtype", "target_params: (expected dtype Float|a BFloat16 mirror needs Float params)"),  # CUDA | CPU
    ("target_mirror", r"target_params_bf16: expected shape \["),
    pytest.param("target_device", "target_params: expected a tensor on cuda", marks=requires_cuda),
])
def test_online_and_target_logits_rejects_bad_input(device, what, match):
    if what == "target_device" and device == "cpu":
        pytest.skip("one device here")
    s = sample_inputs("two_branches_11_atoms", device, B=8)
    args = dict(state_pairs=s.batch["state_pairs"], params=s.online.flat_params.detach(),
                params_bf16=s.online.params_bf16, target_params=s.target.flat_params.detach(),
                target_params_bf16=s.target.params_bf16)
    if what == "odd_rows":
        args["state_pairs"] = args["state_pairs"][:15]
    if what == "state_width":
        args["state_pairs"] = torch.zeros(16, s.config.state_dim + 1, device=device)
    if what == "target_dtype":
        args["target_params"] = args["target_params"].double()
    if what == "target_mirror":
        args["target_params_bf16"] = args["target_params_bf16"][1:]
    if what == "target_device":
        args["target_params"] = args["target_params"].cpu()
    with pytest.raises(RuntimeError, match=match):
        ops._online_and_target_logits(*args.values(), s.online._layout_ints, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what,match", [
    ("logits", r"logits: expected shape \[\*, "),
    ("target_params", "target_params: expected dtype Float"),
    ("actions", r"actions: expected shape \[16, 2\]"),
    ("counter_dtype", "counter: expected dtype Int, got Long"),
    ("counter_shape", r"counter: expected shape \[1\], got \[2\]"),
    pytest.param("counter_device", "counter: expected a tensor on cuda", marks=requires_cuda),
])
def test_loss_on_logits_rejects_bad_input(device, what, match):
    if what == "counter_device" and device == "cpu":
        pytest.skip("one device here")
    s = sample_inputs("two_branches_11_atoms", device, B=16)
    B, config = 16, s.config
    logits = torch.zeros(B, config.head_ld, device=device)
    p = s.online.flat_params.detach()
    args = dict(logits=logits, logits_next_online=logits, logits_next_target=logits, params=p, target_params=p,
                actions=s.batch["actions"], rewards=s.batch["rewards"], dones=s.batch["dones"], weights=None)
    if what == "logits":
        args["logits"] = torch.zeros(B, config.head_ld + 1, device=device)
    if what == "target_params":
        args["target_params"] = p.double()
    if what == "actions":
        args["actions"] = torch.zeros(B, 3, dtype=torch.long, device=device)
    counter = {"counter_dtype": torch.zeros(1, dtype=torch.long, device=device),
               "counter_shape": torch.zeros(2, dtype=torch.int32, device=device),
               "counter_device": torch.zeros(1, dtype=torch.int32)}.get(what)
    with pytest.raises(RuntimeError, match=match):
        ops._dqn_loss_on_logits(*args.values(), s.online._layout_ints, V_MIN, V_MAX, GAMMA, counter=counter)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_on_logits_refuses_an_iqn_layout(device):
    """An IQN network's head rows are per (sample, fraction): its step runs the public ops."""
    c = DQNConfig(state_dim=6, trunk_hidden=(16,), adv_hidden=(8,), atoms=1, branches=(2, 3), iqn_embedding=4)
    net = DuelingBranchQNet(c).to(device)
    B = 4
    logits = torch.zeros(B, c.head_ld, device=device)
    p = net.flat_params.detach()
    actions = torch.zeros(B, 2, dtype=torch.long, device=device)
    zeros = torch.zeros(B, device=device)
    with pytest.raises(RuntimeError, match="_dqn_loss_on_logits: takes no IQN network"):
        ops._dqn_loss_on_logits(logits, logits, logits, p, p, actions, zeros, zeros, None, net._layout_ints, V_MIN,
                                V_MAX, GAMMA, "qr")


def test_fused_loss_runs_only_where_it_is_built_for():
    ref = DQNConfig()
    assert ref.head_ld == 56 + 3 * 160  # 51 atoms -> 56 columns; 3 x 51 = 153 -> 160 (csrc/layout.h)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    max_atoms, max_branches = ops.FUSED_LOSS_MAX_ATOMS, ops.FUSED_LOSS_MAX_BRANCHES
    assert isinstance(max_atoms, int) and isinstance(max_branches, int) and max_atoms >= 51 and max_branches >= 3
    assert fused_loss_supported(ref, "c51", cuda)
    assert not fused_loss_supported(ref, "c51", cpu)
    assert fused_loss_supported(_config((3,), max_atoms), "c51", cuda)
    assert not fused_loss_supported(_config((3,), max_atoms + 1), "c51", cuda)
    assert fused_loss_supported(_config((2,) * max_branches, 11), "c51", cuda)
    assert not fused_loss_supported(_config((2,) * (max_branches + 1), 11), "c51", cuda)
    assert not fused_loss_supported(DQNConfig(atoms=1), "huber", cuda)
    # QR: any quantile count the CUDA loss takes, the same branch limit, one member without masks
    assert fused_loss_supported(DQNConfig(atoms=200), "qr", cuda)
    assert not fused_loss_supported(DQNConfig(atoms=200), "qr", cpu)
    assert fused_loss_supported(_config((3,), ops.LOSS_CUDA_MAX_ATOMS), "qr", cuda)
    assert not fused_loss_supported(_config((3,), ops.LOSS_CUDA_MAX_ATOMS + 1), "qr", cuda)  # the CUDA loss refuses it
    assert fused_loss_supported(_config((2,) * max_branches, 11), "qr", cuda)
    assert not fused_loss_supported(_config((2,) * (max_branches + 1), 11), "qr", cuda)
    # an ensemble's branches count over its members
    assert fused_loss_supported(DQNConfig(atoms=200, ensemble=2), "qr", cuda)
    assert fused_loss_supported(_config((2,) * 4, 11, True, max_branches // 4), "c51", cuda)
    assert not fused_loss_supported(_config((2,) * 4, 11, True, max_branches // 4 + 1), "c51", cuda)
    t = Trainer(_config((2, 5), 11), TrainerConfig(batch_size=8), device="cpu")
    assert not t.uses_fused_path
    with pytest.raises(AttributeError):
        t.uses_fused_path = True  # a report of what runs, not a switch


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch build makes no fake CUDA tensors")
def test_fake_kernels_give_the_internal_ops_their_shapes():
    """The fake kernels (torch.compile / FakeTensor tracing) on fake CUDA tensors: runs on a
    machine without a GPU; test_opcheck checks them against the real kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = _config((2, 3, 1, 4), 33)
    layout = DuelingBranchQNet(c)._layout_ints
    B, n = 8, layout[-1]
    with FakeTensorMode():
        p, p_lp = torch.empty(n, device="cuda"), torch.empty(n, device="cuda", dtype=torch.bfloat16)
        f = ops._online_and_target_logits(torch.empty(2 * B, c.state_dim, device="cuda"), p, p_lp, p, p_lp, layout,
                                          True)
        assert f.logits.shape == (2 * B, c.head_ld) and f.logits.dtype == torch.float32
        assert f.logits_next_target.shape == (B, c.head_ld) and f.logits_next_target.dtype == torch.float32
        assert [t.shape for t in f.activations] == [(2 * B, c.state_dim), (2 * B, 64), (2 * B, 48),
                                                    (2 * B, 32 + 4 * 24)]
        assert all(t.dtype == torch.bfloat16 for t in f.activations)
        loss_args = (f.logits[:B], f.logits[B:], f.logits_next_target, p, p,
                     torch.empty(B, c.num_branches, dtype=torch.long, device="cuda"), torch.empty(B, device="cuda"),
                     torch.empty(B, device="cuda"), None, layout, V_MIN, V_MAX, GAMMA)
        r = ops._dqn_loss_on_logits(*loss_args)
        assert r.loss.shape == () and r.td_error.shape == (B,) and r.mean_q.shape == ()
        assert r.grad_head.shape == (B, c.head_out) and r.grad_head_bf16.shape == (B, c.head_ld)
        assert r.grad_head_bf16.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match=r"dqn_ops._dqn_loss_on_logits: loss_type: expected one of "
                                               r"\('c51', 'qr', 'mse', 'huber'\), got 'l1'"):
            ops._dqn_loss_on_logits(*loss_args, loss_type="l1")
        r = ops._dqn_loss_on_logits(*loss_args, counter=torch.empty(1, dtype=torch.int32, device="cuda"))
        assert r.grad_head.shape == (B, c.head_out)
        for bad, match in ((torch.empty(1, dtype=torch.long, device="cuda"), "counter: expected dtype Int, got "),
                           (torch.empty(2, dtype=torch.int32, device="cuda"),
                            r"counter: expected shape \[1\], got \[2\]")):
            with pytest.raises(RuntimeError, match=match):
                ops._dqn_loss_on_logits(*loss_args, counter=bad)
        grad = ops._mixed_backward_from_head(r.grad_head, r.grad_head_bf16, [t[:B] for t in f.activations], p, p_lp,
                                             layout)
        assert grad.shape == (n,) and grad.dtype == torch.float32

"""_adam_spectral_norm_ema: fused_adam_bf16, batched_spectral_norm on the updated params, then
ema_update toward the clamped params, as one op (FusedAdamBF16.step_clamp_ema; the trainer's
tail under DQN_OPS_OPTIMIZER_TAIL=fused). Its results are the three ops' bit for bit, on CUDA
in the fused launches (the norm partials, then Adam, the power iteration, the clamp and the EMA
in the cluster kernel: a matrix's rows through shared memory, the elements between and after the
matrices beside) and in each case that runs the three ops instead (a matrix too large for a
cluster, the cooperative strategy, more matrices than one launch holds)."""
import pytest
import torch

from conftest import DEVICES, requires_cuda
import dqn_ops
from dqn_ops import _C, ops, optim
from dqn_ops.network import DQNConfig, DuelingBranchQNet
from dqn_ops.spectral import SpectralNorm
from test_dense_layer import _kernel_counts
from test_trainer import TINY_C51, batch_for, make

HUGE = 1e30  # a sigma_max no matrix reaches

# Adam's settings: (lr, max_grad_norm, weight_decay, decoupled); the clip bound is below the
# gradients' norm, so "clip" clips.
ADAM = {"plain": (1e-2, None, 0.0, False), "clip_l2": (1e-2, 0.5, 0.01, False), "adamw": (3e-2, None, 0.1, True)}
NAMES = ["params", "grads", "exp_avg", "exp_avg_sq", "params_bf16", "step", "lr", "grad_norm", "found_inf", "u", "v",
         "sigma", "target", "target_bf16"]


def _case(shapes, order, device, seed=0, gap=3):
    """Matrices of `shapes` in a flat buffer, placed in params in the order `order` (a
    permutation of their indices) with gaps of about `gap` elements before, between and after
    them (gap 0: none, the first matrix at offset 0 and nothing after the last), listed in the
    op's argument in shapes' order; Adam's state after a few steps (moments, step count 3); u, v
    unit vectors in the matrices' order; a random target and mirrors; the outputs poisoned."""
    g = torch.Generator().manual_seed(seed)
    offsets, off = [0] * len(shapes), gap + 2 if gap else 0
    for i in order:
        offsets[i] = off
        off += shapes[i][0] * shapes[i][1] + (gap + i if gap else 0)
    n = off + gap + 4 if gap else off
    params = torch.randn(n, generator=g)
    u = torch.cat([torch.nn.functional.normalize(torch.randn(r, generator=g), dim=0) for r, _ in shapes])
    v = torch.cat([torch.nn.functional.normalize(torch.randn(c, generator=g), dim=0) for _, c in shapes])
    target = torch.randn(n, generator=g)
    nan1 = torch.full((1,), float("nan"))
    bufs = [params, torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g) * 0.01,
            torch.rand(n, generator=g) * 1e-3, params.to(torch.bfloat16), torch.full((1,), 3.0), torch.zeros(1),
            nan1.clone(), nan1.clone(), u, v, torch.full((len(shapes),), float("nan")), target,
            target.to(torch.bfloat16)]
    matrices = [x for i, (r, c) in enumerate(shapes) for x in (offsets[i], r, c)]
    return [t.to(device) for t in bufs], matrices


def _sigma_max(shapes):
    """Every other matrix clamped (sigma of a randn matrix is well above 0.5), the rest not."""
    return [0.5 if i % 2 == 0 else HUGE for i in range(len(shapes))]


def _args(bufs, matrices, sigma_max, adam, iterations, tau):
    p, g, m, v2, pb, step, lr, norm, inf, u, v, sigma, target, target_b = bufs
    lr_value, max_grad_norm, weight_decay, decoupled = adam
    lr.fill_(lr_value)
    return (p, g, m, v2, pb, step, lr, 0.9, 0.999, 1e-8, weight_decay, decoupled, max_grad_norm, norm, inf, u, v, sigma,
            matrices, sigma_max, iterations, 1e-12, target, target_b, tau)


def _fused_and_separate(shapes, order, device, iterations=1, tau=0.05, gap=3, adam=ADAM["plain"], poison=None):
    """The op and the three ops on copies of one case; `poison(bufs)` edits the case first."""
    bufs, matrices = _case(shapes, order, device, gap=gap)
    if poison is not None:
        poison(bufs)
    copy = [t.clone() for t in bufs]
    sigma_max = _sigma_max(shapes)
    ops._adam_spectral_norm_ema(*_args(bufs, matrices, sigma_max, adam, iterations, tau))
    (p, g, m, v2, pb, step, lr, b1, b2, eps, wd, dec, mgn, norm, inf, u, v, sigma, _, _, _, seps, target,
     target_b, tau) = _args(copy, matrices, sigma_max, adam, iterations, tau)
    ops.fused_adam_bf16(p, g, m, v2, pb, step, lr, b1, b2, eps, wd, dec, mgn, norm, inf)
    ops.batched_spectral_norm(p, pb, u, v, sigma, matrices, sigma_max, iterations, seps)
    ops.ema_update(target, target_b, p, tau)
    return bufs, copy, matrices


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _assert_same(fused, separate, context=""):
    """The same bits (NaNs included: a skipped step's gradient holds one)."""
    for a, b, name in zip(fused, separate, NAMES):
        assert torch.equal(_bits(a), _bits(b)), (context, name)


SMALL = [(64, 64), (3, 5), (256, 96), (51, 128), (1, 7), (300, 1)]  # every one fits a cluster
MANY = [(17 + i % 30, 9 + 3 * (i % 20)) for i in range(48)]  # one launch's descriptors, no more
# Wider than a thread's pass over columns (256), and 8 slices of 16 x 1024 with their target rows
# near a cluster block's shared memory (the fused launch's 160 KiB on Hopper).
WIDE = [(40, 300), (3, 5), (128, 1024), (1, 7)]
# The fused launch's layouts: small gaps; gaps and a tail of thousands of elements (each block
# loops over its share); the most matrices one launch takes; matrices back to back from offset 0
# with nothing after the last; wide matrices.
LAYOUTS = {"small_gaps": (SMALL, 3), "large_gaps": (SMALL, 5000), "48_matrices": (MANY, 3), "packed": (SMALL, 0),
           "wide": (WIDE, 3)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("tau", [0.05, 0.7])  # lerp's two formulas (weight below and above 1/2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("adam", list(ADAM))
def test_equals_adam_then_spectral_norm_then_ema_bitwise(device, iterations, tau, layout, adam):
    shapes, gap = LAYOUTS[layout]
    order = list(range(1, len(shapes), 2)) + list(range(0, len(shapes), 2))  # params' order is not the list's
    fused, separate, _ = _fused_and_separate(shapes, order, device, iterations, tau, gap, ADAM[adam])
    _assert_same(fused, separate)
    before = _case(shapes, order, "cpu", gap=gap)[0]
    assert fused[8].item() == 0.0 and fused[5].item() == 4.0, "the step must have run"
    assert fused[7].item() > 0.5 or ADAM[adam][1] is None, "the case must exercise the clipping"
    assert not torch.equal(fused[2].cpu(), before[2]), "the moments must have moved"
    assert (fused[11] > 0.5)[0::2].all(), "the test must exercise the clamp"
    assert not torch.equal(fused[12].cpu(), before[12]), "the EMA must have run"


def _nan_gradient(bufs):
    bufs[1][7] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["small_gaps", "large_gaps"])
def test_a_skipped_step_still_clamps_and_averages(device, layout):
    """A non-finite gradient: Adam writes nothing but its norm and flag; the spectral norm and
    the EMA still run, on the parameters as they were."""
    shapes, gap = LAYOUTS[layout]
    fused, separate, _ = _fused_and_separate(shapes, list(range(len(shapes))), device, gap=gap, poison=_nan_gradient)
    _assert_same(fused, separate)
    before = _case(shapes, list(range(len(shapes))), "cpu", gap=gap)[0]
    assert fused[8].item() == 1.0 and fused[5].item() == 3.0, "the step must have been skipped"
    assert torch.equal(fused[2].cpu(), before[2]) and torch.equal(fused[3].cpu(), before[3])
    assert (fused[11] > 0.5)[0::2].all() and not torch.equal(fused[12].cpu(), before[12])


@pytest.mark.parametrize("device", DEVICES)
def test_a_negative_lr_skips_the_step(device):
    adam = (-1e-3, None, 0.0, False)
    fused, separate, _ = _fused_and_separate(SMALL, list(range(len(SMALL))), device, adam=adam)
    _assert_same(fused, separate)
    assert fused[8].item() == 1.0 and fused[5].item() == 3.0


@requires_cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_fuses_adam_and_the_ema_into_the_cluster_launch(layout):
    shapes, gap = LAYOUTS[layout]
    bufs, matrices = _case(shapes, list(range(len(shapes))), "cuda", gap=gap)
    args = _args(bufs, matrices, _sigma_max(shapes), ADAM["plain"], 1, 0.05)
    run = lambda: ops._adam_spectral_norm_ema(*args)  # noqa: E731
    run()  # the first call probes the device outside the profiled region
    kernels = [k for k in _kernel_counts(run) if "kernel" in k]
    if not any("spectral_norm" in k for k in kernels):
        pytest.skip("the profiler recorded no kernels on this machine")
    archs = (dqn_ops.build_info()["cuda_arch_list"] or "").replace("+PTX", "").split(";")
    if not (torch.cuda.get_device_capability()[0] == 9 and "9.0" in archs):
        pytest.skip("the cluster strategy runs on Hopper with sm_90 machine code")
    assert any("spectral_norm_cluster_kernel" in k for k in kernels), kernels
    assert any("sq_norm_partials_kernel" in k for k in kernels), kernels
    assert not any("adam_update_kernel" in k or "ema_kernel" in k for k in kernels), kernels


@requires_cuda
@pytest.mark.parametrize("case", ["large_matrix", "no_room_for_the_target", "cooperative", "many_matrices"])
def test_cuda_cases_without_the_fused_launch_give_the_same_bits(case):
    shapes, before = SMALL, None
    if case == "large_matrix":  # too large for a cluster's shared memory: the cooperative strategy
        shapes = SMALL + [(1024, 4096)]
    elif case == "no_room_for_the_target":  # a cluster's 8 slices of 32 x 1024 fit, with the target's rows not
        shapes = SMALL + [(256, 1024)]
    elif case == "many_matrices":  # more than one launch's descriptors
        shapes = MANY + [(5, 5)]
    else:
        before = _C._set_spectral_strategy("cooperative")
    try:
        order = list(reversed(range(len(shapes))))
        fused, separate, _ = _fused_and_separate(shapes, order, "cuda", adam=ADAM["clip_l2"])
    finally:
        if before is not None:
            _C._set_spectral_strategy(before)
    _assert_same(fused, separate, case)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    bufs, matrices = _case(SMALL, [1, 0, 2, 3, 4, 5], device)
    args = _args(bufs, matrices, _sigma_max(SMALL), ADAM["clip_l2"], 1, 0.05)
    torch.library.opcheck(torch.ops.dqn_ops._adam_spectral_norm_ema.default, args)


def test_buffers_of_different_parts_may_not_share_memory():
    bufs, matrices = _case(SMALL, list(range(len(SMALL))), "cpu")
    args = list(_args(bufs, matrices, _sigma_max(SMALL), ADAM["plain"], 1, 0.05))
    n = bufs[0].numel()
    op = "dqn_ops._adam_spectral_norm_ema"
    # the EMA's target over the spectral norm's u
    long_u = torch.zeros(n)
    long_u[:bufs[9].numel()].copy_(bufs[9])
    bad = list(args)
    bad[15], bad[22] = long_u[:bufs[9].numel()], long_u
    with pytest.raises(RuntimeError, match=f"{op}: target and u must not share memory"):
        ops._adam_spectral_norm_ema(*bad)
    # Adam's second moment as the EMA's target
    bad = list(args)
    bad[22] = bad[3]
    with pytest.raises(RuntimeError, match=f"{op}: exp_avg_sq and target must not share memory"):
        ops._adam_spectral_norm_ema(*bad)
    # Adam's flag inside sigma
    bad = list(args)
    bad[14] = bad[17][:1]
    with pytest.raises(RuntimeError, match=f"{op}: found_inf and sigma must not share memory"):
        ops._adam_spectral_norm_ema(*bad)
    # each op's own checks still run
    bad = list(args)
    bad[24] = 1.5
    with pytest.raises(RuntimeError, match=r"dqn_ops.ema_update: tau: expected a value in \[0, 1\]"):
        ops._adam_spectral_norm_ema(*bad)
    bad = list(args)
    bad[9] = -1.0
    with pytest.raises(RuntimeError, match=r"dqn_ops.fused_adam_bf16: eps: expected a positive value"):
        ops._adam_spectral_norm_ema(*bad)


def _net_state(net, sn, opt, target):
    state = opt.state[net.flat_params]
    return [net.flat_params.detach().clone(), net.params_bf16.clone(), state["exp_avg"].clone(),
            state["exp_avg_sq"].clone(), state["step"].clone(), opt.grad_norm.clone(), opt.found_inf.clone(),
            sn.u.clone(), sn.v.clone(), sn.sigma.clone(), target.flat_params.detach().clone(),
            target.params_bf16.clone()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("own_mirror", [False, True])
def test_step_clamp_ema_equals_the_three_calls(device, own_mirror):
    """FusedAdamBF16.step_clamp_ema against step(), the SpectralNorm call and ema_update_, three
    steps; an optimizer with its own mirror (not the network's) takes the three calls itself."""
    states = []
    for fused in (True, False):
        torch.manual_seed(0)
        net = DuelingBranchQNet(DQNConfig(), device=device)
        target = DuelingBranchQNet(DQNConfig(), device=device)
        if own_mirror:
            opt = optim.FusedAdamBF16([net.flat_params], lr=1e-3, max_grad_norm=1.0)
        else:
            opt = optim.FusedAdamBF16.for_network(net, lr=1e-3, max_grad_norm=1.0)
        sn = SpectralNorm(net, sigma_max=0.5, generator=torch.Generator().manual_seed(1)).to(device)
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            net.flat_params.grad = torch.randn(net.flat_params.numel(), generator=g).to(device)
            if fused:
                opt.step_clamp_ema(sn, target, 0.05)
            else:
                opt.step()
                sn()
                optim.ema_update_(target, net, 0.05)
        states.append(_net_state(net, sn, opt, target))
    for a, b, name in zip(*states, ["params", "params_bf16", "exp_avg", "exp_avg_sq", "step", "grad_norm", "found_inf",
                                    "u", "v", "sigma", "target", "target_bf16"]):
        assert torch.equal(a, b), name


def test_step_clamp_ema_checks_the_target():
    net = DuelingBranchQNet(DQNConfig())
    other = DuelingBranchQNet(DQNConfig(trunk_hidden=(64,)))
    opt = optim.FusedAdamBF16.for_network(net)
    net.flat_params.grad = torch.zeros_like(net.flat_params)
    with pytest.raises(ValueError, match="FusedAdamBF16.step_clamp_ema: target and online networks differ"):
        opt.step_clamp_ema(SpectralNorm(net), other, 0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_steps_are_the_same_with_the_fused_tail(device):
    """A few steps (graphed on CUDA) with the optimizer tail fused and separate: the same online
    and target weights, mirrors, moments and readback rows."""
    batches = [batch_for(TINY_C51, 32, device, seed=i) for i in range(6)]
    states = []
    for fused in (True, False):
        before = optim.set_fused_tail(fused)
        try:
            t = make(device=device, sigma_max=0.5)  # every matrix clamped at the first step
            for b in batches:
                t.step(b)
            state = t.optimizer.state[t.online.flat_params]
            states.append([t.online.flat_params.detach().clone(), t.online.params_bf16.clone(),
                           t.target.flat_params.detach().clone(), t.target.params_bf16.clone(),
                           t.spectral.sigma.clone(), state["exp_avg"].clone(), state["step"].clone(),
                           t.stats.ring.clone()])
        finally:
            optim.set_fused_tail(before)
    for a, b, name in zip(*states, ["online", "online_bf16", "target", "target_bf16", "sigma", "exp_avg", "step",
                                    "readback"]):
        assert torch.equal(a, b), name


def test_the_switch_reads_its_environment_once_and_checks_it(monkeypatch):
    before = optim._fused_tail
    try:
        optim._fused_tail = None
        monkeypatch.setenv("DQN_OPS_OPTIMIZER_TAIL", "fast")
        with pytest.raises(ValueError, match="DQN_OPS_OPTIMIZER_TAIL: expected 'fused' or 'separate', got 'fast'"):
            optim.fused_tail()
        monkeypatch.setenv("DQN_OPS_OPTIMIZER_TAIL", "fused")
        assert optim.fused_tail()
        monkeypatch.setenv("DQN_OPS_OPTIMIZER_TAIL", "separate")
        assert optim.fused_tail(), "read once"
        assert optim.set_fused_tail(False) is True and not optim.fused_tail()
    finally:
        optim._fused_tail = before

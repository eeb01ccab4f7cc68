"""fused_adam_bf16 / FusedAdamBF16 and ema_update against torch.optim and torch.lerp."""
import copy

import pytest
import torch

import dqn_ops
from conftest import DEVICES, requires_cuda
from dqn_ops import FusedAdamBF16
from reference import TINY

# Over 1000 steps the two implementations round differently (F32 FMA contraction on the GPU,
# powf vs Python's double pow for the bias corrections); each step's difference is a few ulp
# of the update, and the updates do not compound it (Adam normalises every step), so the
# parameters agree to ~1e-6 relative. 2e-5 leaves room over that and still catches any
# formula difference (a wrong bias correction or eps placement is >1e-3 within 10 steps).
ADAM_RTOL, ADAM_ATOL = 2e-5, 1e-6


def _pair(n, device, **kw):
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(n, device=device))
    p_ours = torch.nn.Parameter(p_ref.detach().clone())
    return p_ref, p_ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["adam", "adam_l2", "adamw", "adam_clip"])
def test_matches_torch_adam_over_1000_steps(device, variant):
    n = 10_007  # not a multiple of 4: the vector body and the scalar tail both run
    p_ref, p_ours = _pair(n, device)
    kw = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    clip = None
    if variant == "adam":
        ref = torch.optim.Adam([p_ref], **kw, foreach=False)
    elif variant == "adam_l2":
        kw["weight_decay"] = 0.01
        ref = torch.optim.Adam([p_ref], **kw, foreach=False)
    elif variant == "adamw":
        kw["weight_decay"] = 0.01
        ref = torch.optim.AdamW([p_ref], **kw, foreach=False)
    else:
        clip = 5.0
        ref = torch.optim.Adam([p_ref], **kw, foreach=False)
    ours = FusedAdamBF16([p_ours], **kw, decoupled_weight_decay=variant == "adamw", max_grad_norm=clip)
    for step in range(1000):
        g = torch.randn(n, device=device) * (1 + step % 7)
        p_ref.grad, p_ours.grad = g.clone(), g.clone()
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_([p_ref], clip)
        ref.step()
        ours.step()
        if clip is not None and step % 100 == 0:
            torch.testing.assert_close(ours.grad_norm[0], norm_ref, rtol=1e-5, atol=0)
        if step % 250 == 0:  # the mirror is the rounding of the master, bit for bit
            assert torch.equal(ours.mirror(p_ours), p_ours.detach().to(torch.bfloat16))
    torch.testing.assert_close(p_ours.detach(), p_ref.detach(), rtol=ADAM_RTOL, atol=ADAM_ATOL)
    st = ours.state[p_ours]
    torch.testing.assert_close(st["exp_avg"], ref.state[p_ref]["exp_avg"], rtol=ADAM_RTOL, atol=ADAM_ATOL)
    torch.testing.assert_close(st["exp_avg_sq"], ref.state[p_ref]["exp_avg_sq"], rtol=ADAM_RTOL, atol=ADAM_ATOL)
    assert st["step"].item() == 1000
    assert ours.found_inf.item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_gradient_skips_the_step_and_sets_the_flag(device):
    p = torch.nn.Parameter(torch.randn(1000, device=device))
    opt = FusedAdamBF16([p], lr=1e-2, max_grad_norm=1.0)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    p_before, mirror_before = p.detach().clone(), opt.mirror(p).clone()
    for bad in (float("inf"), float("nan")):
        p.grad = torch.randn_like(p)
        p.grad[123] = bad
        opt.step()
        assert opt.found_inf.item() == 1
        assert not torch.isfinite(opt.grad_norm).all()
        assert torch.equal(p.detach(), p_before) and torch.equal(opt.mirror(p), mirror_before)
        for k, v in opt.state[p].items():
            assert torch.equal(v, before[k]), k
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.found_inf.item() == 0 and opt.state[p]["step"].item() == 2
    assert not torch.equal(p.detach(), p_before)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_continues_identically(device):
    net = dqn_ops.DuelingBranchQNet(TINY).to(device)
    opt = FusedAdamBF16.for_network(net, lr=3e-3, max_grad_norm=10.0)
    s = torch.randn(16, TINY.state_dim, device=device)

    def train(n, model, o):
        for _ in range(n):
            o.zero_grad()
            model(s).square().mean().backward()
            o.step()

    train(5, net, opt)
    # state dicts alias the live tensors (as torch's do): copy them, as torch.save would
    saved_net, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    train(5, net, opt)
    net2 = dqn_ops.DuelingBranchQNet(TINY).to(device)
    net2.load_state_dict(saved_net)
    opt2 = FusedAdamBF16.for_network(net2, lr=3e-3, max_grad_norm=10.0)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[net2.flat_params]["step"].device == net2.flat_params.device
    train(5, net2, opt2)
    assert torch.equal(net2.flat_params, net.flat_params)
    assert torch.equal(net2.params_bf16, net.params_bf16)
    assert net.sync_mirror is False and torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))


def test_param_groups_with_their_own_lr_match_torch():
    a_ref, b_ref = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(33))
    a, b = torch.nn.Parameter(a_ref.detach().clone()), torch.nn.Parameter(b_ref.detach().clone())
    ref = torch.optim.Adam([{"params": [a_ref]}, {"params": [b_ref], "lr": 1e-1}], lr=1e-3, foreach=False)
    ours = FusedAdamBF16([{"params": [a]}, {"params": [b], "lr": 1e-1}], lr=1e-3)
    for _ in range(20):
        for x, y in ((a_ref, a), (b_ref, b)):
            g = torch.randn_like(x)
            x.grad, y.grad = g, g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(a, a_ref, rtol=ADAM_RTOL, atol=ADAM_ATOL)
    torch.testing.assert_close(b, b_ref, rtol=ADAM_RTOL, atol=ADAM_ATOL)
    ours.zero_grad()
    assert a.grad is None and b.grad is None


@pytest.mark.parametrize("device", DEVICES)
def test_ema_update_equals_torch_lerp_and_writes_the_mirror(device):
    n = 4099
    target, online = torch.randn(n, device=device), torch.randn(n, device=device)
    expected = torch.lerp(target, online, 0.005)
    mirror = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
    dqn_ops.ema_update(target, mirror, online, 0.005)
    torch.testing.assert_close(target, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(mirror, target.to(torch.bfloat16))


def test_ema_update_of_networks():
    online, target = dqn_ops.DuelingBranchQNet(TINY), dqn_ops.DuelingBranchQNet(TINY)
    expected = torch.lerp(target.flat_params.detach(), online.flat_params.detach(), 0.5)
    dqn_ops.ema_update_(target, online, 0.5)
    torch.testing.assert_close(target.flat_params.detach(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(target.params_bf16, target.flat_params.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="target and online networks differ"):
        dqn_ops.ema_update_(dqn_ops.DuelingBranchQNet(), online, 0.5)


def _adam_args(device, n=100):
    f = lambda: torch.randn(n, device=device)  # noqa: E731
    return [f(), f(), torch.zeros(n, device=device), torch.zeros(n, device=device),
            torch.zeros(n, device=device, dtype=torch.bfloat16), torch.zeros(1, device=device),
            torch.full((1,), 1e-3, device=device), 0.9, 0.999, 1e-8, 0.0, False, 1.0,
            torch.zeros(1, device=device), torch.zeros(1, device=device)]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(torch.ops.dqn_ops.fused_adam_bf16.default, _adam_args(device))
    n = 50
    torch.library.opcheck(torch.ops.dqn_ops.ema_update.default,
                          (torch.randn(n, device=device), torch.zeros(n, device=device, dtype=torch.bfloat16),
                           torch.randn(n, device=device), 0.01))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index,value,match", [
    (1, lambda a: a[1][:-1], r"grads: expected shape \[100\], got \[99\]"),
    (2, lambda a: a[2].double(), "exp_avg: expected dtype Float, got Double"),
    (4, lambda a: a[4].half(), r"params_bf16: expected dtype BFloat16 \(or Float on the CPU\), got Half"),
    (3, lambda a: a[0], "params and exp_avg_sq must not share memory"),
    (5, lambda a: torch.zeros(2, device=a[0].device), r"step: expected a one-element tensor, got shape \[2\]"),
    (7, lambda a: 1.0, r"beta1: expected a value in \[0, 1\)"),
    (12, lambda a: -1.0, "max_grad_norm: expected None or a positive value"),
    (1, lambda a: torch.randn(200, device=a[0].device)[::2], "grads: expected a contiguous tensor"),
])
def test_adam_bad_input(device, index, value, match):
    a = _adam_args(device)
    a[index] = value(a)
    with pytest.raises(RuntimeError, match="dqn_ops.fused_adam_bf16: " + match):
        torch.ops.dqn_ops.fused_adam_bf16.default(*a)


@requires_cuda
def test_adam_rejects_mixed_devices():
    a = _adam_args("cuda")
    a[1] = a[1].cpu()
    with pytest.raises(RuntimeError, match="grads: expected a tensor on cuda:0, got one on cpu"):
        torch.ops.dqn_ops.fused_adam_bf16.default(*a)


def test_optimizer_bad_construction():
    p = torch.nn.Parameter(torch.randn(10))
    # (several tensors are fine: one global norm and skip, tests/test_robustness.py)
    with pytest.raises(ValueError, match="max_grad_norm must be None or > 0"):
        FusedAdamBF16([p, torch.nn.Parameter(torch.randn(3))], max_grad_norm=0.0)
    with pytest.raises(ValueError, match="must be a contiguous float32 tensor"):
        FusedAdamBF16([torch.nn.Parameter(torch.randn(10, dtype=torch.float64))])
    with pytest.raises(ValueError, match=r"mirror 0 must be a bfloat16 tensor \(or float32 on the CPU\)"):
        FusedAdamBF16([p], mirrors=[torch.zeros(10, dtype=torch.float16)])
    with pytest.raises(ValueError, match="mirror 0 must be a bfloat16 tensor"):
        FusedAdamBF16([p], mirrors=[torch.zeros(9)])


@requires_cuda
def test_cuda_graph_replay_with_changing_lr_equals_eager_and_never_syncs():
    n = 300_001
    p_graph = torch.nn.Parameter(torch.randn(n, device="cuda"))
    p_eager = torch.nn.Parameter(p_graph.detach().clone())
    lr = torch.full((1,), 1e-3, device="cuda")
    opt_graph = FusedAdamBF16([p_graph], lr=lr, max_grad_norm=50.0)
    opt_eager = FusedAdamBF16([p_eager], lr=1e-3, max_grad_norm=50.0)
    static_grad = torch.randn(n, device="cuda")
    p_graph.grad = static_grad
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt_graph.step()  # warm-up creates the state; it counts as step 1
    torch.cuda.current_stream().wait_stream(side)
    p_eager.grad = static_grad.clone()
    opt_eager.step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        opt_graph.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(5):
            new_lr = 1e-3 * (i + 2)
            lr.fill_(new_lr)
            static_grad.copy_(torch.randn(n, device="cuda"))
            g.replay()
            opt_eager.param_groups[0]["lr"] = new_lr
            p_eager.grad.copy_(static_grad)
            opt_eager.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(p_graph, p_eager)
    assert torch.equal(opt_graph.mirror(p_graph), opt_eager.mirror(p_eager))
    assert opt_graph.state[p_graph]["step"].item() == 6


@pytest.mark.parametrize("device", DEVICES)
def test_a_network_trained_without_for_network_reads_its_updated_weights(device):
    """FusedAdamBF16(net.parameters()) writes a mirror of its own, not the network's: the step
    bumps the parameters' version (as a torch in-place op), so the network refreshes its own
    mirror at the next forward instead of running on the initial weights."""
    net = dqn_ops.DuelingBranchQNet(TINY).to(device)
    opt = FusedAdamBF16(net.parameters(), lr=1e-2)
    s = torch.randn(32, TINY.state_dim, device=device)
    for _ in range(3):
        opt.zero_grad()
        net(s).logsumexp(-1).mean().backward()
        opt.step()
    fresh = dqn_ops.DuelingBranchQNet(TINY).to(device)
    fresh.load_state_dict(net.state_dict())  # its mirror made from the updated weights
    assert torch.equal(net(s), fresh(s))
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(net.params_bf16.dtype))


def test_a_backward_through_a_forward_taken_before_the_step_is_refused():
    net = dqn_ops.DuelingBranchQNet(TINY)
    opt = FusedAdamBF16(net.parameters(), lr=1e-2)
    s = torch.randn(8, TINY.state_dim)
    stale = net(s).logsumexp(-1).mean()
    net(s).logsumexp(-1).mean().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


def test_hyper_parameters_are_checked_at_construction():
    p = [torch.zeros(4, requires_grad=True)]
    with pytest.raises(ValueError, match=r"FusedAdamBF16: betas\[0\] must be a finite number >= 0 and < 1, got 1.5"):
        FusedAdamBF16(p, betas=(1.5, 0.9))
    with pytest.raises(ValueError, match=r"FusedAdamBF16: betas must be a pair"):
        FusedAdamBF16(p, betas=(0.9,))
    with pytest.raises(ValueError, match=r"FusedAdamBF16: eps must be a finite number >= 0"):
        FusedAdamBF16(p, eps=-1.0)
    with pytest.raises(ValueError, match=r"FusedAdamBF16: weight_decay must be a finite number >= 0"):
        FusedAdamBF16(p, weight_decay=float("nan"))

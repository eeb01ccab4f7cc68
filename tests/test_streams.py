"""Every op runs on torch's current stream (a side stream included) and on the tensors' device."""
import pytest
import torch

import dqn_ops
from conftest import SLEEP_CYCLES, behind_a_sleep, requires_cuda, warm_side_stream


def _on_busy_side_stream(side, prepare, run):
    """On `side`: sleep, then `prepare()` writes the inputs, then `run()`. An op that launched on
    any other stream would run at once, on the inputs before prepare(). `run`'s ops must have run
    on `side` once before (`warm_side_stream`), so that the host enqueues them within the sleep."""
    torch.cuda.synchronize()
    with torch.cuda.stream(side), behind_a_sleep():
        prepare()
        out = run()
    torch.cuda.synchronize()
    return out


@requires_cuda
def test_dqn_loss_on_a_side_stream():
    B, br, NA = 64, (3, 3), 11
    q, qn = torch.zeros(B, 6, NA, device="cuda"), torch.randn(B, 6, NA, device="cuda")
    fresh = torch.randn(B, 6, NA, device="cuda")
    a = torch.randint(0, 3, (B, 2), device="cuda")
    r, d = torch.randn(B, device="cuda"), torch.zeros(B, device="cuda")
    side, expected = warm_side_stream(lambda: dqn_ops.dqn_loss(fresh, qn, qn, a, r, d, br))
    out = _on_busy_side_stream(side, lambda: q.copy_(fresh), lambda: dqn_ops.dqn_loss(q, qn, qn, a, r, d, br))
    for x, y in zip(out, expected):
        assert torch.equal(x, y)


@requires_cuda
def test_optimizer_ema_and_spectral_norm_on_a_side_stream():
    net = dqn_ops.DuelingBranchQNet().cuda()
    twin = dqn_ops.DuelingBranchQNet().cuda()
    twin.load_state_dict(net.state_dict())
    grads = torch.randn_like(net.flat_params)
    opt = dqn_ops.FusedAdamBF16.for_network(net, lr=1e-2, max_grad_norm=1.0)
    opt_twin = dqn_ops.FusedAdamBF16.for_network(twin, lr=1e-2, max_grad_norm=1.0)
    sn, sn_twin = dqn_ops.SpectralNorm(net, 0.5), dqn_ops.SpectralNorm(twin, 0.5)
    sn_twin.load_state_dict(sn.state_dict())
    target, target_twin = dqn_ops.DuelingBranchQNet().cuda(), dqn_ops.DuelingBranchQNet().cuda()
    target_twin.load_state_dict(target.state_dict())

    def run_twin():
        twin.flat_params.grad = grads.clone()
        opt_twin.step()
        sn_twin()
        dqn_ops.ema_update_(target_twin, twin, 0.3)

    side, _ = warm_side_stream(run_twin)

    net.flat_params.grad = torch.zeros_like(grads)

    def run():
        opt.step()
        sn()
        dqn_ops.ema_update_(target, net, 0.3)

    _on_busy_side_stream(side, lambda: net.flat_params.grad.copy_(grads), run)
    for x, y in [(net.flat_params, twin.flat_params), (net.params_bf16, twin.params_bf16), (sn.u, sn_twin.u),
                 (target.flat_params, target_twin.flat_params), (target.params_bf16, target_twin.params_bf16)]:
        assert torch.equal(x, y)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_ops_follow_the_tensors_device_not_the_current_one():
    net = dqn_ops.DuelingBranchQNet().to("cuda:1")
    s = torch.randn(32, 96, device="cuda:1")
    expected = net(s)
    with torch.cuda.device(0):
        assert torch.equal(net(s), expected)
        sigma = dqn_ops.spectral_norm_(net, 1.0)
    assert sigma.device == torch.device("cuda:1")


# -- the Trainer on a caller's side stream, and on a device that is not the current one ----

def _trainer_config(**kw):
    from dqn_ops import DQNConfig, TrainerConfig
    c = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))
    kw.setdefault("readback_interval", 4)
    return c, TrainerConfig(batch_size=32, **kw)


def _trainer_batches(c, device, n):
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        b = dict(states=torch.randn(32, c.state_dim, generator=g), next_states=torch.randn(32, c.state_dim, generator=g),
                 actions=torch.stack([torch.randint(0, k, (32,), generator=g) for k in c.branches], 1),
                 rewards=torch.randn(32, generator=g), dones=(torch.rand(32, generator=g) < 0.2).float())
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def _assert_same_training(a, b):
    for x, y in [(a.online.flat_params, b.online.flat_params), (a.online.params_bf16, b.online.params_bf16),
                 (a.target.flat_params, b.target.flat_params)]:
        torch.testing.assert_close(x.detach().cpu(), y.detach().cpu(), rtol=1e-5, atol=1e-6)
    ma, mb = a.readback(), b.readback()
    assert ma["steps"] == mb["steps"] == a.steps
    for k in ("loss", "loss_last", "grad_norm_mean", "grad_norm_max", "mean_q"):
        assert abs(ma[k] - mb[k]) <= 1e-4 * abs(mb[k]) + 1e-6, (k, ma[k], mb[k])
    assert ma["skipped"] == mb["skipped"] == 0


@requires_cuda
@pytest.mark.parametrize("use_cuda_graph", [True, False], ids=["graphed", "eager"])
def test_trainer_stepped_on_a_busy_side_stream_equals_the_default_stream(use_cuda_graph):
    """Every step (warm-up, capture, replays) queued behind a sleep on the caller's side
    stream: anything launched on another stream would run before the batch copy in front of
    it, or read the pinned readback buffers before their copies land."""
    from dqn_ops import Trainer
    c, cfg = _trainer_config(use_cuda_graph=use_cuda_graph)
    batches = _trainer_batches(c, "cuda", 10)
    ref, ours = Trainer(c, cfg, device="cuda", seed=2), Trainer(c, cfg, device="cuda", seed=2)
    for b in batches:
        ref.step(b)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in batches:
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            ours.step(b)
        assert ours.graphed == use_cuda_graph
        m = ours.readback()  # on the side stream too
        assert m["steps"] == 10
    torch.cuda.synchronize()
    _assert_same_training(ours, ref)


@requires_cuda
def test_trainer_on_a_side_stream_notices_a_non_finite_step():
    from dqn_ops import NonFiniteError, Trainer
    c, cfg = _trainer_config()
    t = Trainer(c, cfg, device="cuda", seed=2)
    good = _trainer_batches(c, "cuda", 1)[0]
    bad = dict(good, rewards=good["rewards"].clone())
    bad["rewards"][1] = float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):  # warm-up, capture, a replay
            t.step(good)
        with pytest.raises(NonFiniteError):
            for _ in range(4):
                torch.cuda._sleep(SLEEP_CYCLES // 4)
                t.step(bad)
            t.readback()
    assert t.non_finite_steps[0] == 5


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("use_cuda_graph", [True, False], ids=["graphed", "eager"])
def test_trainers_on_two_gpus_in_one_process_with_cuda0_current(use_cuda_graph):
    """A trainer on cuda:1 stepped while cuda:0 is current, beside one on cuda:0 (whose capture
    comes first, so torch.cuda.graph's process-wide capture stream would be cuda:0's): both
    train as a trainer alone on cuda:1 with cuda:1 current."""
    from dqn_ops import Trainer
    c, cfg = _trainer_config(use_cuda_graph=use_cuda_graph)
    b0, b1 = _trainer_batches(c, "cuda:0", 10), _trainer_batches(c, "cuda:1", 10)
    with torch.cuda.device(1):
        alone = Trainer(c, cfg, device="cuda:1", seed=2)
        for b in b1:
            alone.step(b)
        torch.cuda.synchronize()
    with torch.cuda.device(0):
        t0, t1 = Trainer(c, cfg, device="cuda:0", seed=2), Trainer(c, cfg, device="cuda:1", seed=2)
        for x, y in zip(b0, b1):
            t0.step(x)
            t1.step(y)
            assert torch.cuda.current_device() == 0
        assert t0.graphed == t1.graphed == use_cuda_graph
        _assert_same_training(t1, alone)
        _assert_same_training(t0, alone)
        a = t1.act(b1[0]["states"])
        assert a.device == torch.device("cuda:1") and torch.equal(a, alone.act(b1[0]["states"]))

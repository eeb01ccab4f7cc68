"""Every op runs on torch's current stream (a side stream included) and on the tensors' device."""
import pytest
import torch

import dqn_ops
from conftest import requires_cuda

SLEEP_CYCLES = 20_000_000  # ~10 ms: long enough for a kernel on another stream to run first


def _on_busy_side_stream(prepare, run):
    """On a side stream: sleep, then `prepare()` writes the inputs, then `run()`. An op that
    launched on any other stream would run at once, on the inputs before prepare()."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
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
    expected = dqn_ops.dqn_loss(fresh, qn, qn, a, r, d, br)
    out = _on_busy_side_stream(lambda: q.copy_(fresh), lambda: dqn_ops.dqn_loss(q, qn, qn, a, r, d, br))
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

    twin.flat_params.grad = grads.clone()
    opt_twin.step()
    sn_twin()
    dqn_ops.ema_update_(target_twin, twin, 0.3)

    net.flat_params.grad = torch.zeros_like(grads)

    def run():
        opt.step()
        sn()
        dqn_ops.ema_update_(target, net, 0.3)

    _on_busy_side_stream(lambda: net.flat_params.grad.copy_(grads), run)
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

"""batched_spectral_norm / SpectralNorm / spectral_norm_ against a float64 power iteration,
torch.linalg.matrix_norm, and the same kernel launched once per matrix."""
import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, SpectralNorm, batched_spectral_norm, spectral_norm_
from poison import poison_cuda_cache
from reference import power_iteration_f64

HUGE = 1e30  # a sigma_max no matrix reaches: the clamp is a no-op


def _buffers(shapes, device, scale=1.0, gap=8):
    """A flat F32 buffer holding random matrices of `shapes` (with gaps between them), its BF16
    mirror, unit u / v vectors and the (offset, rows, cols) list."""
    matrices, off = [], gap
    for r, c in shapes:
        matrices += [off, r, c]
        off += r * c + gap
    params = torch.randn(off, device=device) * scale
    mirror = params.to(torch.bfloat16)
    u = torch.cat([torch.nn.functional.normalize(torch.randn(r, device=device), dim=0) for r, _ in shapes])
    v = torch.cat([torch.nn.functional.normalize(torch.randn(c, device=device), dim=0) for _, c in shapes])
    sigma = torch.full((len(shapes),), float("nan"), device=device)
    return params, mirror, u, v, sigma, matrices


def _views(flat, matrices):
    return [flat[o:o + r * c].view(r, c) for o, r, c in zip(matrices[0::3], matrices[1::3], matrices[2::3])]


SHAPES = [(1024, 4096), (3, 5), (256, 96), (51, 128), (1, 7), (300, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("iterations", [1, 3])
def test_matches_float64_power_iteration(device, iterations):
    params, mirror, u, v, sigma, matrices = _buffers(SHAPES, device)
    W0 = [w.clone() for w in _views(params, matrices)]
    u0 = torch.split(u.clone(), [r for r, _ in SHAPES])
    batched_spectral_norm(params, mirror, u, v, sigma, matrices, [HUGE] * len(SHAPES), iterations)
    us, vs = torch.split(u, [r for r, _ in SHAPES]), torch.split(v, [c for _, c in SHAPES])
    for m, (W, u_start) in enumerate(zip(W0, u0)):
        s_ref, u_ref, v_ref = power_iteration_f64(W, u_start, iterations)
        assert abs(sigma[m].item() - s_ref) <= 1e-5 * s_ref, (SHAPES[m], sigma[m].item(), s_ref)
        torch.testing.assert_close(us[m].double().cpu(), u_ref, rtol=1e-4, atol=2e-6)
        torch.testing.assert_close(vs[m].double().cpu(), v_ref, rtol=1e-4, atol=2e-6)
    # sigma_max is out of reach: the weights and their mirror are untouched
    for W, W_before in zip(_views(params, matrices), W0):
        assert torch.equal(W, W_before)
    assert torch.equal(mirror, params.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_one_launch_per_matrix_bitwise(device):
    # 50 matrices: more than one launch's worth of descriptors on CUDA (48), large and tiny ones
    shapes = SHAPES + [(17 + i, 9 + 3 * i) for i in range(44)]
    a = _buffers(shapes, device, scale=0.5)
    b = [t.clone() for t in a[:5]] + [a[5]]
    sigma_max = [0.5 + 0.1 * i for i in range(len(shapes))]
    for _ in range(3):
        batched_spectral_norm(*a, sigma_max, 2)
        batched_spectral_norm(*b, sigma_max, 2, one_launch_per_matrix=True)
    for x, y, name in zip(a[:5], b[:5], ["params", "params_bf16", "u", "v", "sigma"]):
        assert torch.equal(x, y), name
    assert (a[4] > torch.tensor(sigma_max, device=device)).any(), "the test must exercise the clamp"


def _spectrum_matrix(rows, cols, top, device):
    """W = U diag(s) V^T with singular values top, top/2, ... (a clear gap: fast convergence)."""
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64))
    s = top / 2.0 ** torch.arange(k, dtype=torch.float64)
    return (U * s) @ V.t()


@pytest.mark.parametrize("device", DEVICES)
def test_sigma_converges_to_matrix_2_norm_and_clamp(device):
    shapes = [(64, 48), (3, 5), (200, 130)]
    params, mirror, u, v, sigma, matrices = _buffers(shapes, device)
    for W, (r, c), top in zip(_views(params, matrices), shapes, [3.0, 0.25, 1.7]):
        W.copy_(_spectrum_matrix(r, c, top, device))
    mirror.copy_(params)
    W0 = [w.clone() for w in _views(params, matrices)]
    true = [torch.linalg.matrix_norm(w.double(), 2).item() for w in W0]
    batched_spectral_norm(params, mirror, u, v, sigma, matrices, [HUGE] * 3, n_power_iterations=60)
    for m in range(3):
        assert abs(sigma[m].item() - true[m]) <= 1e-5 * true[m]
    # Now clamp to 1: the matrices above 1 end with 2-norm 1, the one below is untouched
    batched_spectral_norm(params, mirror, u, v, sigma, matrices, [1.0] * 3, n_power_iterations=5)
    after = _views(params, matrices)
    assert abs(torch.linalg.matrix_norm(after[0].double(), 2).item() - 1) < 1e-5
    assert abs(torch.linalg.matrix_norm(after[2].double(), 2).item() - 1) < 1e-5
    torch.testing.assert_close(after[0], W0[0] / sigma[0], rtol=1e-6, atol=0)
    assert torch.equal(after[1], W0[1])  # sigma 0.25 <= 1: a no-op, to the bit
    assert torch.equal(mirror, params.to(torch.bfloat16))  # rescaled rows rewritten in the mirror


@pytest.mark.parametrize("device", DEVICES)
def test_vectors_persist_across_calls(device):
    a = _buffers(SHAPES[1:], device)
    b = [t.clone() for t in a[:5]] + [a[5]]
    for _ in range(4):
        batched_spectral_norm(*a, [HUGE] * 5, 1)
    batched_spectral_norm(*b, [HUGE] * 5, 4)
    for x, y in zip(a[:5], b[:5]):  # 4 calls of 1 iteration == 1 call of 4: u and v carry over
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_spectral_norm_module_on_network(device):
    net = DuelingBranchQNet(DQNConfig(), device=device)
    with torch.no_grad():
        net.flat_params.mul_(8)  # push some matrices above sigma_max
    net.refresh_mirror()
    keys = set(net.state_dict())
    before = {n: w.clone() for n, w in net.weight_matrices().items()}
    sigma = spectral_norm_(net, sigma_max=1.0, n_power_iterations=30)
    assert sigma.shape == (10,) and sigma.device.type == device
    assert set(net.state_dict()) == keys  # the power-iteration state is not in the network's state dict
    for (name, W), s in zip(net.weight_matrices().items(), sigma.tolist()):
        true = torch.linalg.matrix_norm(before[name].double(), 2).item()
        # power iteration approaches sigma from below: 30 iterations come within ~3% on such matrices
        assert 0.95 * true <= s <= true * (1 + 1e-5), name
        torch.testing.assert_close(W, before[name] * min(1.0, 1.0 / s), rtol=1e-6, atol=0)
    assert (sigma > 1).any()
    assert torch.equal(net.params_bf16, net.flat_params.detach().to(torch.bfloat16))
    sn = net._spectral_norm
    assert sn.names == [n for n, _, _ in net.layout.weight_matrices()]
    # a second SpectralNorm loaded from the first's state dict continues identically
    twin_net = DuelingBranchQNet(DQNConfig(), device=device)
    twin_net.load_state_dict(net.state_dict())
    twin = SpectralNorm(twin_net, 1.0, 30)
    twin.load_state_dict(sn.state_dict())
    assert set(sn.state_dict()) == {"u", "v"}
    spectral_norm_(net, sigma_max=1.0, n_power_iterations=30)
    twin()
    assert torch.equal(net.flat_params, twin_net.flat_params) and torch.equal(twin.sigma, sn.sigma)


def _op_args(device):
    params, mirror, u, v, sigma, matrices = _buffers([(6, 4), (3, 5)], device, scale=2.0)
    return (params, mirror, u, v, sigma, matrices, [1.0, 0.5], 2, 1e-12, False)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(torch.ops.dqn_ops.batched_spectral_norm.default, _op_args(device))


def _bad(index, value):
    args = list(_op_args("cpu"))
    args[index] = value(args[index]) if callable(value) else value
    return args


BAD = [
    (0, lambda t: t.double(), "params: expected dtype Float, got Double"),
    (1, lambda t: t.half(), r"params_bf16: expected dtype BFloat16 \(or Float on the CPU\), got Half"),
    (2, lambda t: t[:-1], r"u \(the left vectors of every matrix, one after the other\): expected shape \[9\], got \[8\]"),
    (3, lambda t: t.repeat(2)[::2], "v: expected a contiguous tensor"),
    (4, lambda t: t.double(), "sigma: expected dtype Float, got Double"),
    (5, [8, 6, 4, 40, 0, 5], r"matrices: matrix 1 has shape \[0, 5\]; a zero-size matrix has no spectral norm"),
    (5, [8, 6, 4, 40, 3], r"matrices: expected \(offset, rows, cols\) for each matrix, a non-empty list whose length is a multiple of 3, got 5 entries"),
    (5, [8, 6, 4, 10, 3, 5], "matrices: the matrices at offsets 8 and 10 overlap"),
    (5, [8, 6, 4, 60, 3, 5], r"matrices: matrix 1 occupies \[60, 75\) of params, which has 63 elements"),
    (6, [1.0], r"sigma_max: expected one value per matrix \(2\), got 1"),
    (6, [1.0, 0.0], "sigma_max: expected positive values"),
    (7, 0, "n_power_iterations: expected >= 1, got 0"),
    (8, 0.0, "eps: expected a positive value"),
]


@pytest.mark.parametrize("index,value,match", BAD)
def test_bad_input(index, value, match):
    with pytest.raises(RuntimeError, match="dqn_ops.batched_spectral_norm: " + match):
        torch.ops.dqn_ops.batched_spectral_norm.default(*_bad(index, value))


def test_aliasing_buffers_rejected():
    args = list(_op_args("cpu"))
    args[3] = args[0][:args[3].numel()]  # v inside params
    with pytest.raises(RuntimeError, match="params and v must not share memory"):
        torch.ops.dqn_ops.batched_spectral_norm.default(*args)


def test_module_bad_construction():
    net = DuelingBranchQNet(DQNConfig(state_dim=5, trunk_hidden=(7, 6), value_hidden=3, adv_hidden=4, atoms=3,
                                      branches=(2, 3)))
    with pytest.raises(ValueError, match="sigma_max must be a positive float or 8 positive floats"):
        SpectralNorm(net, [1.0, 2.0])
    with pytest.raises(ValueError, match="n_power_iterations must be >= 1"):
        SpectralNorm(net, 1.0, 0)
    with pytest.raises(TypeError, match="float32 parameters with a bfloat16 mirror"):
        SpectralNorm(net.double(), 1.0)()


@requires_cuda
def test_rejects_mixed_devices():
    args = list(_op_args("cuda"))
    args[2] = args[2].cpu()
    with pytest.raises(RuntimeError, match="dqn_ops.batched_spectral_norm: u: expected a tensor on cuda:0, got one on cpu"):
        torch.ops.dqn_ops.batched_spectral_norm.default(*args)


@requires_cuda
def test_cuda_graph_replay_equals_eager_and_never_syncs():
    shapes = [(256, 96), (256, 256), (1024, 4096), (3, 5)]
    poison_cuda_cache()
    a = _buffers(shapes, "cuda", scale=0.5)
    b = [t.clone() for t in a[:5]] + [a[5]]
    sigma_max = [1.0, 2.0, 20.0, 0.1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, counted as call 1 on both
        batched_spectral_norm(*a, sigma_max, 1)
    torch.cuda.current_stream().wait_stream(side)
    batched_spectral_norm(*b, sigma_max, 1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        batched_spectral_norm(*a, sigma_max, 1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            g.replay()
            batched_spectral_norm(*b, sigma_max, 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for x, y in zip(a[:5], b[:5]):
        assert torch.equal(x, y)
    assert torch.isfinite(a[4]).all()


def test_compile_fullgraph_matches_eager():
    a = _buffers([(6, 4), (3, 5)], "cpu", scale=2.0)
    b = [t.clone() for t in a[:5]] + [a[5]]

    def step(params, mirror, u, v, sigma):
        batched_spectral_norm(params, mirror, u, v, sigma, a[5], [1.0, 0.5], 2)
        return sigma * 2

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(*a[:5]), step(*b[:5]))
    for x, y in zip(a[:5], b[:5]):  # the in-place updates happened under compile too
        torch.testing.assert_close(x, y)

"""_spectral_norm_ema: batched_spectral_norm, then ema_update toward the clamped params, as one op
(SpectralNorm.clamp_then_ema; the trainer's tail under DQN_OPS_SPECTRAL_EMA=fused). Its results
are the two ops' bit for bit, on CUDA in the cluster kernel's fused launch (the EMA of a matrix's
rows from the clamped values, of the elements between and after the matrices beside) and in each
case that runs the two ops instead (a matrix too large for a cluster, the cooperative strategy,
more matrices than one launch holds)."""
import pytest
import torch

from conftest import DEVICES, requires_cuda
import dqn_ops
from dqn_ops import _C, ops, spectral
from test_dense_layer import _kernel_counts
from test_trainer import TINY_C51, batch_for, make

HUGE = 1e30  # a sigma_max no matrix reaches


def _case(shapes, order, device, seed=0, gap=3):
    """Matrices of `shapes` in a flat buffer, placed in params in the order `order` (a
    permutation of their indices) with gaps of about `gap` elements before, between and after
    them, listed in the op's argument in shapes' order; u, v unit vectors in that order; a random
    target and mirrors."""
    g = torch.Generator().manual_seed(seed)
    offsets, off = [0] * len(shapes), gap + 2
    for i in order:
        offsets[i] = off
        off += shapes[i][0] * shapes[i][1] + gap + i
    n = off + gap + 4
    params = torch.randn(n, generator=g)
    u = torch.cat([torch.nn.functional.normalize(torch.randn(r, generator=g), dim=0) for r, _ in shapes])
    v = torch.cat([torch.nn.functional.normalize(torch.randn(c, generator=g), dim=0) for _, c in shapes])
    target = torch.randn(n, generator=g)
    bufs = [params, params.to(torch.bfloat16), u, v, torch.full((len(shapes),), float("nan")), target,
            target.to(torch.bfloat16)]
    matrices = [x for i, (r, c) in enumerate(shapes) for x in (offsets[i], r, c)]
    return [t.to(device) for t in bufs], matrices


def _sigma_max(shapes):
    """Every other matrix clamped (sigma of a randn matrix is well above 0.5), the rest not."""
    return [0.5 if i % 2 == 0 else HUGE for i in range(len(shapes))]


def _fused_and_separate(shapes, order, device, iterations, tau, gap=3):
    bufs, matrices = _case(shapes, order, device, gap=gap)
    copy = [t.clone() for t in bufs]
    sigma_max = _sigma_max(shapes)
    p, pb, u, v, sigma, target, target_b = bufs
    ops._spectral_norm_ema(p, pb, u, v, sigma, matrices, sigma_max, iterations, 1e-12, target, target_b, tau)
    p, pb, u, v, sigma, target, target_b = copy
    ops.batched_spectral_norm(p, pb, u, v, sigma, matrices, sigma_max, iterations)
    ops.ema_update(target, target_b, p, tau)
    return bufs, copy, matrices


NAMES = ["params", "params_bf16", "u", "v", "sigma", "target", "target_bf16"]
SMALL = [(64, 64), (3, 5), (256, 96), (51, 128), (1, 7), (300, 1)]  # every one fits a cluster
MANY = [(17 + i % 30, 9 + 3 * (i % 20)) for i in range(48)]  # one launch's descriptors, no more
# The fused launch's layouts: small gaps; gaps and a tail of thousands of elements (each block
# loops over its share); the most matrices one launch takes.
LAYOUTS = {"small_gaps": (SMALL, 3), "large_gaps": (SMALL, 5000), "48_matrices": (MANY, 3)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("tau", [0.05, 0.7])  # lerp's two formulas (weight below and above 1/2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_spectral_norm_then_ema_bitwise(device, iterations, tau, layout):
    shapes, gap = LAYOUTS[layout]
    order = list(range(1, len(shapes), 2)) + list(range(0, len(shapes), 2))  # params' order is not the list's
    fused, separate, _ = _fused_and_separate(shapes, order, device, iterations, tau, gap)
    for a, b, name in zip(fused, separate, NAMES):
        assert torch.equal(a, b), name
    assert (fused[4] > 0.5)[0::2].all(), "the test must exercise the clamp"
    assert not torch.equal(fused[5], _case(shapes, order, "cpu", gap=gap)[0][5].to(device)), "the EMA must have run"


@requires_cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_fuses_the_ema_into_the_cluster_launch(layout):
    shapes, gap = LAYOUTS[layout]
    bufs, matrices = _case(shapes, list(range(len(shapes))), "cuda", gap=gap)
    p, pb, u, v, sigma, target, target_b = bufs
    run = lambda: ops._spectral_norm_ema(p, pb, u, v, sigma, matrices, _sigma_max(shapes), 1, 1e-12,  # noqa: E731
                                         target, target_b, 0.05)
    run()  # the first call probes the device outside the profiled region
    kernels = [k for k in _kernel_counts(run) if "kernel" in k]
    if not any("spectral_norm" in k for k in kernels):
        pytest.skip("the profiler recorded no kernels on this machine")
    archs = (dqn_ops.build_info()["cuda_arch_list"] or "").replace("+PTX", "").split(";")
    if not (torch.cuda.get_device_capability()[0] == 9 and "9.0" in archs):
        pytest.skip("the cluster strategy runs on Hopper with sm_90 machine code")
    assert any("spectral_norm_cluster_kernel" in k for k in kernels), kernels
    assert not any("ema_kernel" in k for k in kernels), kernels


@requires_cuda
@pytest.mark.parametrize("case", ["large_matrix", "cooperative", "many_matrices"])
def test_cuda_cases_without_the_fused_launch_give_the_same_bits(case):
    shapes, before = SMALL, None
    if case == "large_matrix":  # too large for a cluster's shared memory: the cooperative strategy
        shapes = SMALL + [(1024, 4096)]
    elif case == "many_matrices":  # more than one launch's descriptors
        shapes = MANY + [(5, 5)]
    else:
        before = _C._set_spectral_strategy("cooperative")
    try:
        order = list(reversed(range(len(shapes))))
        fused, separate, _ = _fused_and_separate(shapes, order, "cuda", 1, 0.05)
    finally:
        if before is not None:
            _C._set_spectral_strategy(before)
    for a, b, name in zip(fused, separate, NAMES):
        assert torch.equal(a, b), (case, name)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    bufs, matrices = _case(SMALL, [1, 0, 2, 3, 4, 5], device)
    p, pb, u, v, sigma, target, target_b = bufs
    torch.library.opcheck(torch.ops.dqn_ops._spectral_norm_ema.default,
                          (p, pb, u, v, sigma, matrices, _sigma_max(SMALL), 1, 1e-12, target, target_b, 0.05))


def test_the_ema_may_not_write_the_spectral_norms_buffers():
    bufs, matrices = _case(SMALL, list(range(len(SMALL))), "cpu")
    p, pb, u, v, sigma, target, target_b = bufs
    long_u = torch.zeros(p.numel())
    u_inside = long_u[:u.numel()]
    u_inside.copy_(u)
    with pytest.raises(RuntimeError, match="dqn_ops._spectral_norm_ema: target and u must not share memory"):
        ops._spectral_norm_ema(p, pb, u_inside, v, sigma, matrices, _sigma_max(SMALL), 1, 1e-12, long_u, target_b,
                               0.05)
    with pytest.raises(RuntimeError, match=r"dqn_ops.ema_update: tau: expected a value in \[0, 1\]"):
        ops._spectral_norm_ema(p, pb, u, v, sigma, matrices, _sigma_max(SMALL), 1, 1e-12, target, target_b, 1.5)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_steps_are_the_same_with_the_fused_tail(device):
    """A few steps (graphed on CUDA) with spectral norm and the EMA fused and separate: the same
    online and target weights, mirrors included."""
    batches = [batch_for(TINY_C51, 32, device, seed=i) for i in range(6)]
    states = []
    for fused in (True, False):
        before = spectral.set_fused_ema(fused)
        try:
            t = make(device=device, sigma_max=0.5)  # every matrix clamped at the first step
            for b in batches:
                t.step(b)
            states.append([t.online.flat_params.detach().clone(), t.online.params_bf16.clone(),
                           t.target.flat_params.detach().clone(), t.target.params_bf16.clone(),
                           t.spectral.sigma.clone()])
        finally:
            spectral.set_fused_ema(before)
    for a, b, name in zip(*states, ["online", "online_bf16", "target", "target_bf16", "sigma"]):
        assert torch.equal(a, b), name


def test_the_switch_reads_its_environment_once_and_checks_it(monkeypatch):
    before = spectral._fused_ema
    try:
        spectral._fused_ema = None
        monkeypatch.setenv("DQN_OPS_SPECTRAL_EMA", "fast")
        with pytest.raises(ValueError, match="DQN_OPS_SPECTRAL_EMA: expected 'fused' or 'separate', got 'fast'"):
            spectral.fused_ema()
        monkeypatch.setenv("DQN_OPS_SPECTRAL_EMA", "fused")
        assert spectral.fused_ema()
        monkeypatch.setenv("DQN_OPS_SPECTRAL_EMA", "separate")
        assert spectral.fused_ema(), "read once"
        assert spectral.set_fused_ema(False) is True and not spectral.fused_ema()
    finally:
        spectral._fused_ema = before

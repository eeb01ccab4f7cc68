"""CUDA paths chosen by the device, the binary and the kernels' own attributes:

- batched_spectral_norm: the cooperative strategy forced through the test hook
  (dqn_ops._C._set_spectral_strategy) against the default (cluster where it can) and a float64
  power iteration;
- dqn_loss: C51 with staging areas at the edge of the loss kernel's shared-memory budget (48 KiB
  less the kernel's static shared memory) against a float64 reference and the CPU kernel;
- fused_adam_bf16: huge but finite gradients (the norm summed in double on both backends), a bad
  lr skipping the step on the device, the overlap checks; ema_update's overlap check.

Every test here needs a GPU (conftest.requires_cuda); the CPU side is test_robust_op_checks.py."""
import contextlib

import pytest
import torch

import dqn_ops  # noqa: F401 (loads the ops)
import dqn_ops._C as _C
from conftest import requires_cuda
from poison import poison_cuda_cache
from reference import power_iteration_f64
from test_loss import reference_c51, sample_batch

pytestmark = requires_cuda

HUGE = 1e30  # a sigma_max no matrix reaches


def spectral_norm_op(params, mirror, u, v, sigma, matrices, sigma_max, iterations, one_launch_per_matrix=False):
    """The op itself (its schema is csrc's), not a Python wrapper that may change."""
    torch.ops.dqn_ops.batched_spectral_norm.default(params, mirror, u, v, sigma, list(matrices), list(sigma_max),
                                                    iterations, 1e-12, one_launch_per_matrix)


@contextlib.contextmanager
def spectral_strategy(name):
    previous = _C._set_spectral_strategy(name)
    try:
        yield
    finally:
        _C._set_spectral_strategy(previous)


# ---------------------------------------------------------------------------------------------
# batched_spectral_norm: cooperative (forced) == cluster (default) to float rounding == float64

# Cluster-sized matrices on an H100/H200 (a block's slice fits in 160 KiB), among them (96, 1200)
# at 67 KiB (past the 48 KiB without opt-in) and (200, 1000) at 107 KiB (past a 99 KiB opt-in
# limit: the cooperative kernel on such a device), and one too large for clusters anywhere
# (cooperative under both settings).
SHAPES = [(3, 5), (256, 96), (51, 128), (1, 7), (300, 1), (64, 512), (96, 1200), (200, 1000), (1024, 4096)]


def _buffers(shapes, scale=0.5, gap=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    matrices, off = [], gap
    for r, c in shapes:
        matrices += [off, r, c]
        off += r * c + gap
    params = torch.randn(off, generator=g) * scale
    u = torch.cat([torch.nn.functional.normalize(torch.randn(r, generator=g), dim=0) for r, _ in shapes])
    v = torch.cat([torch.nn.functional.normalize(torch.randn(c, generator=g), dim=0) for _, c in shapes])
    cuda = lambda t: t.cuda()  # noqa: E731
    return [cuda(params), cuda(params.to(torch.bfloat16)), cuda(u), cuda(v),
            torch.full((len(shapes),), float("nan"), device="cuda")], matrices


def _views(flat, matrices):
    return [flat[o:o + r * c].view(r, c) for o, r, c in zip(matrices[0::3], matrices[1::3], matrices[2::3])]


@pytest.mark.parametrize("iterations", [1, 3])
def test_spectral_cooperative_equals_default_and_float64(iterations):
    poison_cuda_cache()
    a, matrices = _buffers(SHAPES)
    b = [t.clone() for t in a]
    W0 = [w.clone() for w in _views(a[0], matrices)]
    u0 = [x.clone() for x in torch.split(a[2], [r for r, _ in SHAPES])]
    # sigma_max below some matrices' norms: the rescale of W and its mirror runs too
    sigma_max = [HUGE, 1.0, HUGE, 0.3, HUGE, 2.0, HUGE, 3.0, 5.0]
    with spectral_strategy("auto"):
        spectral_norm_op(*a, matrices, sigma_max, iterations)
    with spectral_strategy("cooperative"):
        spectral_norm_op(*b, matrices, sigma_max, iterations)
    torch.cuda.synchronize()
    params_a, mirror_a, u_a, v_a, sigma_a = a
    params_b, mirror_b, u_b, v_b, sigma_b = b
    # the two strategies sum in different orders: equal to float rounding
    torch.testing.assert_close(sigma_b, sigma_a, rtol=1e-5, atol=0)
    torch.testing.assert_close(u_b, u_a, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(v_b, v_a, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(params_b, params_a, rtol=1e-5, atol=1e-7)
    for params, mirror in ((params_a, mirror_a), (params_b, mirror_b)):
        assert torch.equal(mirror, params.to(torch.bfloat16))  # every rescaled row rewritten
    rescaled = 0
    for m, (W, u_start) in enumerate(zip(W0, u0)):
        s_ref, u_ref, v_ref = power_iteration_f64(W, u_start, iterations)
        for sigma, u, v, params in ((sigma_a, u_a, v_a, params_a), (sigma_b, u_b, v_b, params_b)):
            us, vs = torch.split(u, [r for r, _ in SHAPES]), torch.split(v, [c for _, c in SHAPES])
            assert abs(sigma[m].item() - s_ref) <= 1e-5 * s_ref, (SHAPES[m], sigma[m].item(), s_ref)
            torch.testing.assert_close(us[m].double().cpu(), u_ref, rtol=1e-4, atol=2e-6)
            torch.testing.assert_close(vs[m].double().cpu(), v_ref, rtol=1e-4, atol=2e-6)
            W_after = _views(params, matrices)[m].double().cpu()
            scale = min(1.0, sigma_max[m] / s_ref)
            torch.testing.assert_close(W_after, W.double().cpu() * scale, rtol=2e-5, atol=1e-7)
        rescaled += s_ref > sigma_max[m]
    assert rescaled >= 2, "the test must exercise the rescale"


def test_spectral_cooperative_forced_is_deterministic_per_matrix():
    # The cooperative strategy's own invariant holds when it takes every matrix: batched equals
    # one launch per matrix, bit for bit.
    shapes = SHAPES + [(17 + i, 9 + 3 * i) for i in range(44)]  # more than one launch's descriptors (48)
    a, matrices = _buffers(shapes, seed=1)
    b = [t.clone() for t in a]
    sigma_max = [0.5 + 0.1 * i for i in range(len(shapes))]
    with spectral_strategy("cooperative"):
        for _ in range(2):
            spectral_norm_op(*a, matrices, sigma_max, 2)
            spectral_norm_op(*b, matrices, sigma_max, 2, one_launch_per_matrix=True)
    for x, y, name in zip(a, b, ["params", "params_bf16", "u", "v", "sigma"]):
        assert torch.equal(x, y), name


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


def test_spectral_hook_selects_the_kernels():
    a, matrices = _buffers(SHAPES[:3])
    run = lambda: spectral_norm_op(*a, matrices, [HUGE] * 3, 1)  # noqa: E731
    run()  # the first call probes the device outside the profiled region
    with spectral_strategy("cooperative"):
        names = _kernel_names(run)
    if not any("spectral_norm" in n for n in names):
        pytest.skip("the profiler recorded no kernels on this machine")
    assert not any("spectral_norm_cluster_kernel" in n for n in names), names
    assert any("spectral_norm_kernel" in n for n in names), names
    archs = (dqn_ops.build_info()["cuda_arch_list"] or "").replace("+PTX", "").split(";")
    if torch.cuda.get_device_capability()[0] == 9 and "9.0" in archs:  # Hopper, with sm_90 machine code
        with spectral_strategy("auto"):
            names = _kernel_names(run)
        assert any("spectral_norm_cluster_kernel" in n for n in names), names


def test_spectral_graph_capture_under_forced_cooperative():
    # The forced strategy is captured like the default one, and never syncs.
    a, matrices = _buffers(SHAPES[:4])
    b = [t.clone() for t in a]
    sigma_max = [1.0, 0.5, 2.0, 0.1]
    with spectral_strategy("cooperative"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            spectral_norm_op(*a, matrices, sigma_max, 1)
        torch.cuda.current_stream().wait_stream(side)
        spectral_norm_op(*b, matrices, sigma_max, 1)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            spectral_norm_op(*a, matrices, sigma_max, 1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                g.replay()
                spectral_norm_op(*b, matrices, sigma_max, 1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# dqn_loss at the shared-memory budget's edge


# (branches, atoms): the general (staged) version's staging area per block is
# warps * 4 * (2 * max_actions + 4) * atoms bytes; the comment gives it for each case. The kernel
# has a few hundred bytes of static shared memory, so 48,881-49,152 bytes of staging do not fit
# beside it in 48 KiB: those read their rows from global memory, the cases below them stage.
LOSS_EDGE_CASES = [
    ((3,), 152),      # 8 warps, 48,640 B: staged
    ((3,), 153),      # 48,960 B: global rows
    ((4,), 129),      # 8 warps, 49,536 B: global rows (4 actions stage up to 48 KiB at 128 atoms, the
                      # register version's)
    ((3, 3, 3), 203),  # 6 warps, 48,720 B: staged
    ((3, 3, 3), 204),  # 48,960 B: global rows
    ((3, 3, 3), 205),  # 49,200 B
    ((2, 2), 190),    # 8 warps, 48,640 B
    ((2, 2), 191),    # 48,896 B: global rows
    ((2, 2), 192),    # 49,152 B: global rows
]


@pytest.mark.parametrize("branches,atoms", LOSS_EDGE_CASES)
def test_loss_at_the_shared_memory_edge_matches_float64_and_cpu(branches, atoms):
    poison_cuda_cache()
    v_min, v_max, gamma = -10.0, 10.0, 0.97
    batch = sample_batch(300, branches, atoms, "cpu", v_max, seed=300 + 13 * atoms + len(branches))
    q, qo, qt, actions, rewards, dones, weights = (t.cuda() for t in batch)
    out = torch.ops.dqn_ops.dqn_loss.default(q, qo, qt, actions, rewards, dones, weights, list(branches), v_min,
                                             v_max, gamma, "c51")
    loss, grad_q, td, mean_q = (t.double().cpu() for t in out)
    ref_loss, ref_grad, ref_td, ref_mean_q = reference_c51(q, qo, qt, actions, rewards, dones, branches, v_min,
                                                               v_max, gamma, weights)
    assert torch.isfinite(grad_q).all() and torch.isfinite(td).all()  # every element written (poisoned first)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-5, atol=1e-6)
    # test_loss.py's atol of 1e-8 holds up to 64 atoms; at 127-205 atoms the F32 projection runs on
    # a 2-4x finer support and a few gradient elements (of ~1e-4) land up to ~3e-8 from float64 (seen
    # on the H200). A wrong staging of the rows would be off by the gradient's own size.
    torch.testing.assert_close(grad_q, ref_grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(td, ref_td, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mean_q, ref_mean_q, rtol=1e-5, atol=1e-5)
    cpu = torch.ops.dqn_ops.dqn_loss.default(*batch[:6], batch[6], list(branches), v_min, v_max, gamma, "c51")
    for x, y in zip(out, cpu):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# fused_adam_bf16 and ema_update

ADAM = torch.ops.dqn_ops.fused_adam_bf16.default
NAMES = ["params", "grads", "exp_avg", "exp_avg_sq", "params_bf16", "step", "lr", "beta1", "beta2", "eps",
         "weight_decay", "decoupled_weight_decay", "max_grad_norm", "grad_norm", "found_inf"]


def _adam_state(n, grads, lr=1e-3, max_grad_norm=1.0, seed=3):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    return dict(params=p, grads=grads, exp_avg=torch.randn(n, generator=g) * 0.1,
                exp_avg_sq=torch.rand(n, generator=g), params_bf16=p.to(torch.bfloat16), step=torch.full((1,), 3.0),
                lr=torch.full((1,), lr), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                decoupled_weight_decay=True, max_grad_norm=max_grad_norm, grad_norm=torch.full((1,), float("nan")),
                found_inf=torch.full((1,), float("nan")))


def _to(state, device):
    return {k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _call(a):
    ADAM(*[a[k] for k in NAMES])


def _huge_gradients(n, scale):
    g = torch.Generator().manual_seed(11)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return signs * scale * (1 + torch.rand(n, generator=g) * 0.5)


# n: more than one block of the norm's partial sums (256 elements each), not a multiple of 4
@pytest.mark.parametrize("n", [1003, 300_001])
@pytest.mark.parametrize("max_grad_norm", [1.0, None])
@pytest.mark.parametrize("scale", [1.0, 1e20, 2e38])
def test_adam_cpu_and_cuda_agree_on_huge_gradients(n, max_grad_norm, scale):
    # scale 1e20: every square overflows F32, the norm is finite: both backends take the step.
    # scale 2e38 (elements up to 3e38, finite): the norm itself exceeds F32: both skip the step.
    # scale 1: the ordinary case.
    state = _adam_state(n, _huge_gradients(n, scale), max_grad_norm=max_grad_norm)
    cpu, gpu = _to(state, "cpu"), _to(state, "cuda")
    _call(cpu)
    _call(gpu)
    norm64 = state["grads"].double().norm().item()
    skipped = scale == 2e38
    for a in (cpu, gpu):
        assert a["found_inf"].item() == (1.0 if skipped else 0.0)
        assert a["step"].item() == (3.0 if skipped else 4.0)
        if not skipped:
            assert a["grad_norm"].item() == pytest.approx(norm64, rel=1e-6)
    # one rule (double sums, differently ordered): the same F32 norm to within its last bit
    torch.testing.assert_close(gpu["grad_norm"].cpu(), cpu["grad_norm"], rtol=2.4e-7, atol=0)
    # F32 element updates, contracted differently by the two compilers: equal to a few ulp (the
    # mirrors are compared each to its own master: an ulp can move a BF16 rounding)
    for k in ("params", "exp_avg", "exp_avg_sq", "step", "found_inf"):
        torch.testing.assert_close(gpu[k].cpu(), cpu[k], rtol=1e-6, atol=1e-7, msg=k)
    for a in (cpu, gpu):
        assert torch.equal(a["params_bf16"], a["params"].to(torch.bfloat16))
    if skipped:
        for k in ("params", "exp_avg", "exp_avg_sq", "params_bf16", "step"):
            assert torch.equal(gpu[k].cpu(), state[k]), k


@pytest.mark.parametrize("bad_lr", [float("nan"), float("inf"), -1e-3])
def test_adam_bad_lr_skips_on_the_device_without_a_sync(bad_lr):
    n = 10_007
    state = _adam_state(n, torch.randn(n), lr=bad_lr)
    gpu = _to(state, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(gpu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for k in ("params", "exp_avg", "exp_avg_sq", "params_bf16", "step"):
        assert torch.equal(gpu[k].cpu(), state[k]), k
    assert gpu["found_inf"].item() == 1.0
    assert gpu["grad_norm"].item() == pytest.approx(state["grads"].double().norm().item(), rel=1e-6)
    cpu = _to(state, "cpu")
    _call(cpu)
    for k in ("params", "step", "found_inf"):
        assert torch.equal(gpu[k].cpu(), cpu[k]), k
    torch.testing.assert_close(gpu["grad_norm"].cpu(), cpu["grad_norm"], rtol=2.4e-7, atol=0)
    gpu["lr"].fill_(1e-3)  # a good lr on the same state: the step runs
    _call(gpu)
    assert gpu["found_inf"].item() == 0.0 and gpu["step"].item() == 4.0


@pytest.mark.parametrize("scalar,other", [("step", "params"), ("lr", "grads"), ("grad_norm", "exp_avg_sq"),
                                          ("found_inf", "grad_norm"), ("lr", "step")])
def test_adam_overlap_checks_on_cuda(scalar, other):
    a = _to(_adam_state(64, torch.randn(64)), "cuda")
    a[scalar] = a[other][:1] if a[other].numel() > 1 else a[other]
    order = ["params", "grads", "exp_avg", "exp_avg_sq", "params_bf16", "step", "lr", "grad_norm", "found_inf"]
    first, second = sorted([scalar, other], key=order.index)
    with pytest.raises(RuntimeError, match=f"dqn_ops.fused_adam_bf16: {first} and {second} must not share memory"):
        _call(a)


def test_ema_overlap_check_on_cuda():
    n = 64
    online = torch.randn(n, device="cuda")
    with pytest.raises(RuntimeError, match="dqn_ops.ema_update: target_bf16 and online must not share memory"):
        torch.ops.dqn_ops.ema_update.default(torch.randn(n, device="cuda"), online.view(torch.bfloat16)[:n], online,
                                             0.1)

"""CPU tests of the checks and device-side decisions the ops share with their CUDA kernels:
fused_adam_bf16's overlap checks of every argument (scalars included), its skip on a NaN,
infinite or negative lr, its gradient norm summed in double (huge but finite gradients);
ema_update's overlap check of target_bf16 against online; the spectral-strategy test hook.
The CUDA side of each is in test_robust_cuda_paths.py."""
import math

import pytest
import torch

import dqn_ops  # noqa: F401 (loads the ops)
import dqn_ops._C as _C

ADAM = torch.ops.dqn_ops.fused_adam_bf16.default
EMA = torch.ops.dqn_ops.ema_update.default
N = 100


def spectral_norm_op(params, mirror, u, v, sigma, matrices, sigma_max, iterations, one_launch_per_matrix=False):
    """The op itself (its schema is csrc's), not a Python wrapper that may change."""
    torch.ops.dqn_ops.batched_spectral_norm.default(params, mirror, u, v, sigma, list(matrices), list(sigma_max),
                                                    iterations, 1e-12, one_launch_per_matrix)

# The op's argument order; the scalars are one-element F32 tensors.
NAMES = ["params", "grads", "exp_avg", "exp_avg_sq", "params_bf16", "step", "lr", "beta1", "beta2", "eps",
         "weight_decay", "decoupled_weight_decay", "max_grad_norm", "grad_norm", "found_inf"]
TENSORS = ["params", "grads", "exp_avg", "exp_avg_sq", "params_bf16", "step", "lr", "grad_norm", "found_inf"]
SCALARS = ["step", "lr", "grad_norm", "found_inf"]


def adam_args(device="cpu", n=N, lr=1e-3, max_grad_norm=1.0, grads=None):
    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g)
    return dict(params=p.to(device), grads=(torch.randn(n, generator=g) if grads is None else grads).to(device),
                exp_avg=(torch.randn(n, generator=g) * 0.1).to(device),
                exp_avg_sq=torch.rand(n, generator=g).to(device), params_bf16=p.to(torch.bfloat16).to(device),
                step=torch.full((1,), 3.0, device=device), lr=torch.full((1,), lr, device=device), beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, max_grad_norm=max_grad_norm,
                grad_norm=torch.full((1,), float("nan"), device=device),
                found_inf=torch.full((1,), float("nan"), device=device))


def call(a):
    ADAM(*[a[k] for k in NAMES])


def _alias(a, name, other):
    """Makes a[name] a view into a[other]'s memory with a[name]'s dtype and shape."""
    host = a[other]
    want = a[name]
    flat = host.view(want.dtype) if host.element_size() == want.element_size() else host.view(torch.uint8).view(want.dtype)
    a[name] = flat[1:1 + want.numel()] if want.numel() < flat.numel() else flat[:want.numel()]


# Every scalar against every other argument: each pair is rejected, naming the op and both arguments
# in the op's order.
OVERLAP_PAIRS = [(s, o) for s in SCALARS for o in TENSORS if o != s and not (o in SCALARS and TENSORS.index(o) < TENSORS.index(s))]


@pytest.mark.parametrize("scalar,other", OVERLAP_PAIRS)
def test_adam_rejects_a_scalar_sharing_memory(scalar, other):
    a = adam_args()
    _alias(a, scalar, other)
    first, second = sorted([scalar, other], key=TENSORS.index)
    with pytest.raises(RuntimeError, match=f"dqn_ops.fused_adam_bf16: {first} and {second} must not share memory"):
        call(a)


def test_adam_rejects_two_scalars_in_one_tensor_even_disjoint_views_pass():
    a = adam_args()
    scalars = torch.zeros(4)
    a["step"], a["grad_norm"], a["found_inf"] = scalars[0:1], scalars[1:2], scalars[2:3]
    a["lr"] = torch.full((1,), 1e-3)
    call(a)  # disjoint elements of one tensor: allowed
    assert scalars[0].item() == 1.0 and scalars[2].item() == 0.0
    a["found_inf"] = scalars[1:2]
    with pytest.raises(RuntimeError, match="dqn_ops.fused_adam_bf16: grad_norm and found_inf must not share memory"):
        call(a)


def test_ema_rejects_target_bf16_sharing_online():
    n = 64
    buf = torch.randn(n)
    online = buf
    target_bf16 = buf.view(torch.bfloat16)[:n]  # same bytes, the mirror's dtype and shape
    with pytest.raises(RuntimeError, match="dqn_ops.ema_update: target_bf16 and online must not share memory"):
        EMA(torch.randn(n), target_bf16, online, 0.1)
    # and the checks that were there stay
    with pytest.raises(RuntimeError, match="dqn_ops.ema_update: target and online must not share memory"):
        EMA(buf, torch.zeros(n, dtype=torch.bfloat16), buf, 0.1)
    with pytest.raises(RuntimeError, match=r"dqn_ops.ema_update: target_bf16: expected shape \[64\], got \[63\]"):
        EMA(torch.randn(n), torch.zeros(n - 1, dtype=torch.bfloat16), torch.randn(n), 0.1)
    with pytest.raises(RuntimeError, match=r"dqn_ops.ema_update: target_bf16: expected dtype BFloat16 \(or Float on the "
                                           r"CPU\), got Half"):
        EMA(torch.randn(n), torch.zeros(n, dtype=torch.float16), torch.randn(n), 0.1)


def _snapshot(a):
    return {k: a[k].clone() for k in ["params", "exp_avg", "exp_avg_sq", "params_bf16", "step"]}


def _unchanged(a, before):
    for k, v in before.items():
        assert torch.equal(a[k], v), k


@pytest.mark.parametrize("bad_lr", [float("nan"), float("inf"), -float("inf"), -1e-3, -1e-30])
def test_adam_skips_the_step_on_a_bad_lr(bad_lr):
    a = adam_args(lr=bad_lr)
    before = _snapshot(a)
    call(a)
    _unchanged(a, before)
    assert a["found_inf"].item() == 1.0
    # the norm is still reported (that of the gradient, which is fine)
    expected = a["grads"].double().norm().item()
    assert a["grad_norm"].item() == pytest.approx(expected, rel=1e-6)
    # the same state with a good lr takes the step
    a["lr"].fill_(1e-3)
    call(a)
    assert a["found_inf"].item() == 0.0 and a["step"].item() == before["step"].item() + 1
    assert not torch.equal(a["params"], before["params"])
    assert torch.equal(a["params_bf16"], a["params"].to(torch.bfloat16))


def test_adam_zero_lr_is_a_step():
    a = adam_args(lr=0.0)
    before = _snapshot(a)
    call(a)
    assert a["found_inf"].item() == 0.0 and a["step"].item() == before["step"].item() + 1
    assert torch.equal(a["params"], before["params"])  # lr 0: the weights stay, the moments move
    assert not torch.equal(a["exp_avg"], before["exp_avg"])


def _f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def _adam_reference_f64(a, grads, max_grad_norm, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8):
    """One step of Adam in float64 from the state in `a` (before the call), clipping as
    clip_grad_norm_ does (coefficient max / (norm + 1e-6), at most 1). The op takes its constants
    in F32: the reference uses the same values (1 - float32(0.999) is 1.3e-5 off 1e-3)."""
    lr, beta1, beta2, eps = _f32(lr), _f32(beta1), _f32(beta2), _f32(eps)
    g = grads.double()
    norm = g.norm().item()
    if max_grad_norm is not None:
        g = g * min(1.0, max_grad_norm / (norm + 1e-6))
    t = a["step"].item() + 1
    m = a["exp_avg"].double() * beta1 + (1 - beta1) * g
    v = a["exp_avg_sq"].double() * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2 ** t) + eps
    p = a["params"].double() - lr / (1 - beta1 ** t) * m / denom
    return norm, p, m, v


def huge_gradients(n, scale=1e20):
    """Finite F32 gradients whose squares overflow F32 (1e40 > 3.4e38): an F32 sum of squares is
    inf, the norm (about scale * sqrt(n)) is not."""
    g = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return signs * scale * (1 + torch.rand(n, generator=g) * 0.5)


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_adam_huge_finite_gradients_take_the_step(max_grad_norm):
    # The documented rule: the sum of squares is accumulated in double, so the norm of a finite
    # gradient is finite whenever it fits in F32; the step runs (clipped when max_grad_norm is set).
    n = 1003
    grads = huge_gradients(n)
    assert torch.isinf((grads * grads).sum()), "the F32 sum of squares must overflow here"
    a = adam_args(n=n, grads=grads, max_grad_norm=max_grad_norm)
    state = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    call(a)
    norm, p, m, v = _adam_reference_f64(state, grads, max_grad_norm)
    assert math.isfinite(norm)
    assert a["found_inf"].item() == 0.0 and a["step"].item() == 4.0
    assert a["grad_norm"].item() == pytest.approx(norm, rel=1e-6)
    torch.testing.assert_close(a["params"].double(), p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-6)
    assert torch.equal(a["params_bf16"], a["params"].to(torch.bfloat16))


def test_adam_norm_beyond_f32_skips():
    # Every element finite, the norm itself above F32's largest value: the norm rounds to inf in
    # F32 and the step is skipped, as for a non-finite gradient.
    n = 16
    a = adam_args(n=n, grads=torch.full((n,), 3e38))
    before = _snapshot(a)
    call(a)
    _unchanged(a, before)
    assert a["found_inf"].item() == 1.0 and math.isinf(a["grad_norm"].item())


def test_spectral_strategy_hook():
    # The hook exists in every build; the CPU kernel has one strategy, so both settings give the same bits.
    assert _C._set_spectral_strategy("cooperative") in ("auto", "cooperative")
    try:
        with pytest.raises(ValueError, match="expected auto or cooperative, got 'cluster_please'"):
            _C._set_spectral_strategy("cluster_please")
        assert _C._set_spectral_strategy("cooperative") == "cooperative"
        W = torch.randn(6 * 4 + 3 * 5)
        args = lambda: (W.clone(), W.to(torch.bfloat16), torch.nn.functional.normalize(torch.ones(9), dim=0),  # noqa: E731
                        torch.nn.functional.normalize(torch.ones(9), dim=0), torch.zeros(2))
        a = args()
        spectral_norm_op(*a, [0, 6, 4, 24, 3, 5], [1.0, 0.5], 2)
        assert _C._set_spectral_strategy("auto") == "cooperative"
        b = args()
        spectral_norm_op(*b, [0, 6, 4, 24, 3, 5], [1.0, 0.5], 2)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    finally:
        _C._set_spectral_strategy("auto")

"""The unrounded CPU path: an F32 mirror beside F32 parameters (``DuelingBranchQNet(mirror_dtype=
torch.float32)``, ``TrainerConfig(mirror="f32")``). The same kernels then round nothing, so the
trainer's step is plain PyTorch's F32 step (``dqn_ops.rl.baseline.TorchTrainer``) up to the
order of F32 sums: the reference that tells BF16's effects on training from the formulas'."""
import dataclasses

import pytest
import torch

from conftest import requires_cuda
from dqn_ops import DQNConfig, DuelingBranchQNet, HeadGroup, Trainer, TrainerConfig, ops, to_torch
from dqn_ops.rl.baseline import TorchTrainer
from test_optim import _adam_args
from test_spectral_norm import _op_args as _spectral_args
from test_trainer import TINY_C51, TINY_Q, batch_for

# network, trainer settings: the fused-loss path's C51 (also with weight decay), the composed path's QR (with clipping
# and the spectral clamp binding), one-atom Huber, an ensemble without dueling, IQN, head groups
CASES = {
    "c51": (TINY_C51, {}),
    # weight decay both ways: Adam's L2 term in the gradient, AdamW's decoupled shrink
    "c51_l2": (TINY_C51, dict(weight_decay=0.5)),
    "c51_adamw": (TINY_C51, dict(weight_decay=0.5, decoupled_weight_decay=True)),
    "qr": (dataclasses.replace(TINY_C51, atoms=16), dict(loss_type="qr", max_grad_norm=0.5, sigma_max=0.8)),
    "huber": (TINY_Q, {}),
    "ensemble": (DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=(), adv_hidden=(8,), atoms=11,
                           branches=(2, 3), dueling=False, ensemble=3), dict(sigma_max=None)),
    # both trainers draw the same fractions (TorchTrainer(fractions="philox"): ops.iqn_fractions),
    # an IQN network's, and each IQN head group's in group order
    "iqn": (dataclasses.replace(TINY_C51, atoms=1, iqn_embedding=8), dict(loss_type="iqn", iqn_fractions=6)),
    "groups": (dataclasses.replace(TINY_C51, aux=(HeadGroup("iqn", iqn_embedding=8),
                                                  HeadGroup("iqn", iqn_embedding=4))), dict(iqn_fractions=5)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_f32_mirror_trainer_steps_as_plain_pytorch_in_f32(name):
    """Eight steps on fresh batches from one start: the same losses, TD errors, gradient norms and
    mean Q to F32 rounding, step after step (with a BF16 mirror they differ in the third digit:
    tests/test_trainer.py), and the same first gradient."""
    c, extra = CASES[name]
    cfg = TrainerConfig(batch_size=64, readback_interval=1, lr=1e-3, use_cuda_graph=False, **extra)
    ours = Trainer(c, dataclasses.replace(cfg, mirror="f32"), device="cpu", seed=0)
    ref = TorchTrainer(c, cfg, device="cpu", seed=0)
    assert ours.online.params_bf16.dtype == ours.target.params_bf16.dtype == torch.float32
    for i in range(8):
        b = batch_for(c, 64, "cpu", seed=100 + i)
        ours.step(b)
        ref.step(b)
        if i == 0 and cfg.max_grad_norm == 10.0:  # unclipped: the torch step's .grad is the gradient itself
            ref_params = dict(ref.online.named_parameters())
            for n, g in ours.online.layer_views(ours.online.flat_params.grad).items():
                torch.testing.assert_close(g, ref_params[n].grad, rtol=1e-4, atol=1e-6, msg=n)
        m, r = ours.readback(), ref.readback()
        for k in ("loss_last", "grad_norm_max", "mean_q"):
            assert m[k] == pytest.approx(r[k], rel=1e-5, abs=1e-6), (i, k, m[k], r[k])
        torch.testing.assert_close(ours.td_error, ref.td_error, rtol=1e-4, atol=1e-5)
    assert m["steps"] == 8 and m["skipped"] == 0


def test_an_f32_mirror_network_is_its_plain_pytorch_copy():
    net = DuelingBranchQNet(TINY_C51, mirror_dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    assert net.params_bf16.dtype == torch.float32 and torch.equal(net.params_bf16, net.flat_params.detach())
    x = torch.randn(33, TINY_C51.state_dim)
    torch.testing.assert_close(net(x), to_torch(net)(x)[0], rtol=1e-5, atol=1e-6)
    bf16 = DuelingBranchQNet(TINY_C51, generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(bf16(x), net(x), rtol=1e-5, atol=1e-6)  # the BF16 mirror does round
    # .double() is the float64 path, .float() brings the requested F32 mirror back
    assert net.double().params_bf16.dtype == torch.float64
    assert net.float().params_bf16.dtype == torch.float32


def test_the_optimizer_side_ops_write_an_f32_mirror_unrounded():
    a = _adam_args("cpu")
    a[4] = torch.zeros(100)
    torch.ops.dqn_ops.fused_adam_bf16.default(*a)
    assert a[0].abs().sum() > 0 and torch.equal(a[4], a[0])
    target, online = torch.randn(50), torch.randn(50)
    mirror = torch.zeros(50)
    ops.ema_update(target, mirror, online, 0.3)
    assert torch.equal(mirror, target)
    s = list(_spectral_args("cpu"))
    s[1] = torch.zeros_like(s[0])
    before = s[0].clone()
    torch.ops.dqn_ops.batched_spectral_norm.default(*s)
    clamped = s[0] != before
    assert clamped.any() and torch.equal(s[1][clamped], s[0][clamped])  # the clamp wrote the mirror unrounded


def test_an_f32_mirror_is_refused_off_the_cpu_and_other_dtypes_anywhere():
    with pytest.raises(ValueError, match=r"mirror_dtype must be torch.bfloat16 or torch.float32 \(CPU only\)"):
        DuelingBranchQNet(TINY_C51, mirror_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"TrainerConfig.mirror='f32' is the CPU's unrounded reference path"):
        Trainer(TINY_C51, TrainerConfig(mirror="f32"), device="cuda")
    with pytest.raises(ValueError, match=r"TrainerConfig: mirror must be 'bf16' or 'f32', got 'f64'"):
        TrainerConfig(mirror="f64")
    with pytest.raises(ValueError, match=r"TorchTrainer: TrainerConfig.mirror is dqn_ops.Trainer's"):
        TorchTrainer(TINY_C51, TrainerConfig(mirror="f32"), device="cpu")


@requires_cuda
def test_a_cuda_network_and_ops_refuse_an_f32_mirror():
    net = DuelingBranchQNet(TINY_C51, mirror_dtype=torch.float32)
    with pytest.raises(ValueError, match="an F32 mirror .* is the CPU's unrounded reference path"):
        net.to("cuda")
    assert net.flat_params.device.type == "cpu" and net.params_bf16.device.type == "cpu"  # the move changed nothing
    with pytest.raises(ValueError, match="an F32 mirror"):
        DuelingBranchQNet(TINY_C51, mirror_dtype=torch.float32, device="cuda")
    a = _adam_args("cuda")
    a[4] = torch.zeros(100, device="cuda")
    with pytest.raises(RuntimeError, match=r"params_bf16: expected dtype BFloat16 \(or Float on the CPU\), got Float"):
        torch.ops.dqn_ops.fused_adam_bf16.default(*a)
    with pytest.raises(RuntimeError, match=r"target_bf16: expected dtype BFloat16 \(or Float on the CPU\), got Float"):
        ops.ema_update(torch.randn(64, device="cuda"), torch.zeros(64, device="cuda"), torch.randn(64, device="cuda"),
                       0.1)
    s = list(_spectral_args("cuda"))
    s[1] = torch.zeros_like(s[0])
    with pytest.raises(RuntimeError, match=r"params_bf16: expected dtype BFloat16 \(or Float on the CPU\), got Float"):
        torch.ops.dqn_ops.batched_spectral_norm.default(*s)

"""Every config checked at construction (types, ranges, v_min < v_max ...), the errors naming the
config, the field, what was expected and what came; the trainer's batch dtype rule (the
network's); and the dqn_ops error for an op without a kernel on the tensors' device."""
import math

import pytest
import torch

import dqn_ops
from dqn_ops import DQNConfig, Trainer, TrainerConfig
from dqn_ops.ops import MissingKernelError, _raise_missing_kernel
from dqn_ops.trainer import load_batch

TINY = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))


# -- DQNConfig ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,exc,match", [
    (dict(atoms=2.5), TypeError, r"DQNConfig: atoms must be an int >= 1, got 2\.5 \(float\)"),
    (dict(atoms=2.0), TypeError, r"DQNConfig: atoms must be an int >= 1, got 2\.0 \(float\)"),
    (dict(atoms=0), ValueError, r"DQNConfig: atoms must be >= 1 \(an int\), got 0"),
    (dict(state_dim=-3), ValueError, r"DQNConfig: state_dim must be >= 1 \(an int\), got -3"),
    (dict(state_dim="96"), TypeError, r"DQNConfig: state_dim must be an int >= 1, got '96' \(str\)"),
    (dict(value_hidden=True), TypeError,
     r"DQNConfig: value_hidden must be an int >= 1 or a tuple of widths >= 1 \(possibly empty\), got True \(bool\)"),
    (dict(adv_hidden=None), TypeError,
     r"DQNConfig: adv_hidden must be an int >= 1 or a tuple .*, got None \(NoneType\)"),
    (dict(adv_hidden=(16, 0)), ValueError, r"DQNConfig: adv_hidden must be an int >= 1 or a tuple .*, got \(16, 0\)"),
    (dict(value_hidden=(0,)), ValueError, r"DQNConfig: value_hidden must be an int >= 1 or a tuple .*, got \(0,\)"),
    (dict(value_hidden=(64, 64)), ValueError,
     r"DQNConfig: value_hidden and adv_hidden must have the same number of layers .*, got \(64, 64\) and \(128,\)"),
    (dict(value_hidden=(64,), adv_hidden=()), ValueError,
     r"DQNConfig: value_hidden and adv_hidden must have the same number of layers .*, got \(64,\) and \(\)"),
    (dict(dueling=False, value_hidden=(64,)), ValueError,
     r"DQNConfig: value_hidden must be None or \(\) with dueling=False \(no value head\), got \(64,\)"),
    (dict(dueling=1), TypeError, r"DQNConfig: dueling must be a bool \(True or False\), got 1 \(int\)"),
    (dict(dueling="yes"), TypeError, r"DQNConfig: dueling must be a bool \(True or False\), got 'yes' \(str\)"),
    (dict(trunk_hidden=()), ValueError, r"DQNConfig: trunk_hidden must be one or more widths >= 1 .*, got \(\)"),
    (dict(trunk_hidden=(256, 0)), ValueError,
     r"DQNConfig: trunk_hidden must be one or more widths >= 1 .*, got \(256, 0\)"),
    (dict(trunk_hidden=(256, 12.5)), TypeError, r"DQNConfig: trunk_hidden must be .*an entry 12\.5 \(float\)"),
    (dict(trunk_hidden=256), TypeError, r"DQNConfig: trunk_hidden must be .*, got 256 \(int\)"),
    (dict(branches=()), ValueError, r"DQNConfig: branches must be a non-empty tuple of action counts >= 1"),
    (dict(branches=(3, 0)), ValueError, r"DQNConfig: branches must be .*, got \(3, 0\)"),
    (dict(branches=3), TypeError, r"DQNConfig: branches must be .*, got 3 \(int\)"),
    (dict(branches="33"), TypeError, r"DQNConfig: branches must be .*, got '33' \(str\)"),
])
def test_dqn_config_rejects_nonsense_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        DQNConfig(**kw)


def test_dqn_config_normalises_what_it_accepts():
    import numpy as np
    c = DQNConfig(state_dim=np.int64(6), trunk_hidden=[16, 16], value_hidden=8, adv_hidden=8, atoms=11,
                  branches=[2, 3])
    assert c == TINY and type(c.state_dim) is int and c.branches == (2, 3) and c.trunk_hidden == (16, 16)
    # Head widths: an int is one layer, equal to the tuple form; value_hidden None follows
    # adv_hidden with dueling and is () without.
    assert c.value_hidden == (8,) and c.adv_hidden == (8,)
    assert DQNConfig(value_hidden=64, adv_hidden=32) == DQNConfig(value_hidden=(64,), adv_hidden=(32,))
    assert DQNConfig(value_hidden=None, adv_hidden=[32, 16]).value_hidden == (32, 16)
    assert DQNConfig(dueling=False).value_hidden == () and DQNConfig(dueling=False, value_hidden=()) == DQNConfig(
        dueling=False)
    assert DQNConfig(trunk_hidden=[np.int64(5)], adv_hidden=()).hidden_widths == (5,)
    shallow = DQNConfig(trunk_hidden=(32, 16, 8), value_hidden=(4, 2), adv_hidden=(6, 3), branches=(2, 3))
    assert shallow.hidden_widths == (32, 16, 8, 4 + 2 * 6, 2 + 2 * 3) and shallow.head_depth == 2
    assert shallow.num_heads == 3 and DQNConfig(dueling=False, branches=(2, 3)).num_heads == 2


# -- TrainerConfig ------------------------------------------------------------------------

@pytest.mark.parametrize("kw,exc,match", [
    (dict(lr=-1.0), ValueError, r"TrainerConfig: lr must be a finite number > 0, got -1\.0"),
    (dict(lr=0.0), ValueError, r"TrainerConfig: lr must be a finite number > 0, got 0\.0"),
    (dict(lr=float("nan")), ValueError, r"TrainerConfig: lr must be a finite number > 0, got nan"),
    (dict(lr="1e-4"), TypeError, r"TrainerConfig: lr must be a finite number > 0, got '1e-4' \(str\)"),
    (dict(gamma=1.5), ValueError, r"TrainerConfig: gamma must be a finite number >= 0 and <= 1, got 1\.5"),
    (dict(gamma=-0.1), ValueError, r"TrainerConfig: gamma must be a finite number >= 0 and <= 1, got -0\.1"),
    (dict(v_min=5.0, v_max=-5.0), ValueError,
     r"TrainerConfig: v_min must be below v_max .*, got v_min=5\.0, v_max=-5\.0"),
    (dict(v_min=1.0, v_max=1.0), ValueError, r"TrainerConfig: v_min must be below v_max"),
    (dict(v_max=float("inf")), ValueError, r"TrainerConfig: v_max must be a finite number, got inf"),
    (dict(tau=1.5), ValueError, r"TrainerConfig: tau must be a finite number >= 0 and <= 1, got 1\.5"),
    (dict(batch_size=0), ValueError, r"TrainerConfig: batch_size must be >= 1 \(an int\), got 0"),
    (dict(batch_size=32.0), TypeError, r"TrainerConfig: batch_size must be an int >= 1, got 32\.0 \(float\)"),
    (dict(betas=(0.9,)), ValueError, r"TrainerConfig: betas must be a pair \(beta1, beta2\) of numbers in \[0, 1\)"),
    (dict(betas=0.9), TypeError, r"TrainerConfig: betas must be a pair"),
    (dict(betas=(0.9, 1.0)), ValueError, r"TrainerConfig: betas\[1\] must be a finite number >= 0 and < 1, got 1\.0"),
    (dict(adam_eps=-1e-8), ValueError, r"TrainerConfig: adam_eps must be a finite number >= 0, got -1e-08"),
    (dict(weight_decay=-0.1), ValueError, r"TrainerConfig: weight_decay must be a finite number >= 0"),
    (dict(decoupled_weight_decay=1), TypeError,
     r"TrainerConfig: decoupled_weight_decay must be a bool \(True or False\), got 1 \(int\)"),
    (dict(max_grad_norm=0.0), ValueError, r"TrainerConfig: max_grad_norm must be a number > 0, got 0\.0"),
    (dict(sigma_max=-1.0), ValueError, r"TrainerConfig: sigma_max must be a finite number > 0, got -1\.0"),
    (dict(sigma_max=[1.0, 0.0]), ValueError, r"TrainerConfig: sigma_max\[1\] must be a finite number > 0"),
    (dict(n_power_iterations=0), ValueError, r"TrainerConfig: n_power_iterations must be >= 1"),
    (dict(loss_type="quantile"), ValueError,
     r"TrainerConfig: loss_type must be 'c51' or 'qr' or 'mse' or 'huber' or 'iqn' or None, got 'quantile'"),
    (dict(backward_precision="fp16"), ValueError,
     r"TrainerConfig: backward_precision must be 'tf32' or 'bf16' or 'fp32', got 'fp16'"),
    (dict(use_cuda_graph="yes"), TypeError, r"TrainerConfig: use_cuda_graph must be a bool"),
    (dict(warmup_steps=0), ValueError, r"TrainerConfig: warmup_steps must be >= 1 \(cuBLAS must be warm"),
    (dict(readback_interval=0), ValueError, r"TrainerConfig: readback_interval must be >= 1 \(an int\), got 0"),
    (dict(on_non_finite="ignore"), ValueError, r"TrainerConfig: on_non_finite must be 'raise' or 'flag', got 'ignore'"),
])
def test_trainer_config_rejects_nonsense_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        TrainerConfig(**kw)


def test_trainer_config_accepts_and_normalises_valid_values():
    c = TrainerConfig(lr=1, gamma=1, v_min=-1, v_max=1, betas=[0.5, 0.9], max_grad_norm=None, sigma_max=None,
                      tau=0.0, loss_type=None)
    assert c.lr == 1.0 and type(c.lr) is float and c.betas == (0.5, 0.9) and c.gamma == 1.0
    assert TrainerConfig(max_grad_norm=math.inf).max_grad_norm == math.inf  # norm computed, nothing clipped
    assert TrainerConfig(sigma_max=(1.0, 2.0)).sigma_max == (1.0, 2.0)
    assert TrainerConfig(gamma=0.0).gamma == 0.0


# -- the batch dtype rule -----------------------------------------------------------------

def _batch(B, c, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return dict(states=torch.randn(B, c.state_dim, generator=g, dtype=dtype),
                actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
                rewards=torch.randn(B, generator=g, dtype=dtype),
                next_states=torch.randn(B, c.state_dim, generator=g, dtype=dtype),
                dones=torch.zeros(B, dtype=dtype))


def test_trainer_step_rejects_a_float64_batch_as_the_network_does():
    t = Trainer(TINY, TrainerConfig(batch_size=8, readback_interval=1), device="cpu")
    b = _batch(8, TINY, torch.float64)
    # the network's rule (its forward op): float64 states on the F32 path are an error
    with pytest.raises(RuntimeError, match="states: expected dtype Float, got Double"):
        t.online(b["states"])
    with pytest.raises(TypeError, match=r"Trainer.step: batch\['states'\]: expected dtype torch.float32, got "
                                        r"torch.float64: convert it first"):
        t.step(b)
    assert t.steps == 0  # nothing ran
    with pytest.raises(TypeError, match=r"batch\['rewards'\]: expected dtype torch.float32, got torch.float16"):
        t.step(dict(_batch(8, TINY), rewards=b["rewards"].half()))
    t.step(_batch(8, TINY))  # float32: fine
    assert t.steps == 1
    # load_batch on its own (a low-level copy) still converts floating dtypes unless told not to
    load_batch(t.inputs, b, t._ones)
    assert torch.equal(t.inputs["states"], b["states"].float())
    with pytest.raises(TypeError, match="expected dtype torch.float32, got torch.float64"):
        load_batch(t.inputs, b, t._ones, exact_dtypes=True)


# -- an op without a kernel on the tensors' device ----------------------------------------

def test_an_op_without_a_kernel_for_the_backend_raises_a_short_dqn_ops_error():
    # A sparse CPU tensor dispatches to SparseCPU, for which dqn_ops has no kernel.
    t = torch.zeros(8)
    with pytest.raises(MissingKernelError, match=r"^dqn_ops\.ema_update has no kernel for SparseCPU tensors") as ei:
        dqn_ops.ema_update(t.to_sparse(), t.to(torch.bfloat16), t, 0.5)
    assert isinstance(ei.value, NotImplementedError)  # still what the dispatcher raised
    assert "Could not run 'dqn_ops::ema_update'" in str(ei.value.__cause__)  # the original, kept
    assert len(str(ei.value).splitlines()) == 1


@pytest.mark.parametrize("backend,match", [
    ("CUDA", r"^dqn_ops\.dqn_loss has no CUDA kernel: this build of dqn_ops has no CUDA kernels .*Rebuild with a "
             r"CUDA toolkit .*see the README"),
    ("MPS", r"^dqn_ops\.dqn_loss has no kernel for the 'MPS' backend \(device 'mps'\): dqn_ops has CPU and CUDA "
            r"kernels only"),
    ("Meta", r"^dqn_ops\.dqn_loss has no kernel for the 'Meta' backend"),
])
def test_the_missing_kernel_error_names_the_op_the_device_and_what_to_do(backend, match):
    original = NotImplementedError(f"Could not run 'dqn_ops::dqn_loss' with arguments from the '{backend}' backend. "
                                   "This could be because the operator doesn't exist for this backend, or ...\n" * 20)
    with pytest.raises(MissingKernelError, match=match) as ei:
        _raise_missing_kernel("dqn_loss", original)
    assert ei.value.__cause__ is original


def test_other_not_implemented_errors_pass_through_unchanged():
    assert _raise_missing_kernel("dqn_loss", NotImplementedError("something else")) is None


@pytest.mark.skipif(not torch.cuda.is_available() or dqn_ops.cuda_kernels_built(),
                    reason="needs a CUDA device and a build of dqn_ops without CUDA kernels")
def test_a_cpu_only_build_given_cuda_tensors():
    t = torch.zeros(8, device="cuda")
    with pytest.raises(MissingKernelError, match="this build of dqn_ops has no CUDA kernels"):
        dqn_ops.ema_update(t, t.to(torch.bfloat16), t, 0.5)

"""IQN in the trainers (docs/iqn-design.md, "Fractions in the trainer", "Acting"): TrainerConfig's
iqn_fractions and the loss type; Trainer's step (the public ops' step at the fractions it draws
from its fraction_rng: tau for s, the midpoints for s', tau' for the target) against PublicOpsStep
bit for bit, graphed against eager on CUDA; acting at the K midpoints; checkpoints carrying the
fractions' stream; TorchTrainer's plain-PyTorch IQN step.
"""
import dataclasses
import io

import pytest
import torch

from conftest import requires_cuda
from dqn_ops import DQNConfig, Trainer, TrainerConfig, ops
from dqn_ops.rl.baseline import TorchTrainer
from dqn_ops.step import PublicOpsStep, quantile_midpoints
from dqn_ops.trainer import expected_q, greedy_actions, greedy_from_logits, resolve_loss_type
from step_check import check_graphed_trainer_equals_eager, check_trainer_step_is_the_public_ops_step, same_bits

V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97
TINY_IQN = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=1, branches=(2, 3),
                     iqn_embedding=8)
TINY_IQN_ENS = DQNConfig(state_dim=6, trunk_hidden=(16,), adv_hidden=(), atoms=1, branches=(3,), dueling=False,
                         ensemble=2, iqn_embedding=5)


def batch(c, B, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    s, s2 = torch.randn(B, c.state_dim, generator=g), torch.randn(B, c.state_dim, generator=g)
    b = dict(states=s, next_states=s2, state_pairs=torch.cat([s, s2]),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=(torch.rand(B, generator=g) * 2 - 1) * 4, dones=(torch.rand(B, generator=g) < 0.2).float(),
             weights=torch.rand(B, generator=g) + 0.5)
    return {k: v.to(device) for k, v in b.items()}


def step_batch(b):
    return {k: v for k, v in b.items() if k != "state_pairs"}


def make(c=TINY_IQN, device="cpu", B=16, N=4, **kw):
    kw.setdefault("readback_interval", 1)
    return Trainer(c, TrainerConfig(batch_size=B, gamma=GAMMA, iqn_fractions=N, **kw), device=device, seed=3)


def test_config_and_loss_type():
    assert TrainerConfig().iqn_fractions == 32
    with pytest.raises(ValueError, match="TrainerConfig: iqn_fractions must be"):
        TrainerConfig(iqn_fractions=0)
    assert resolve_loss_type(None, 1, "x", iqn=True) == "iqn"
    with pytest.raises(ValueError, match=r"x: loss_type 'qr' does not fit an IQN network"):
        resolve_loss_type("qr", 1, "x", iqn=True)
    with pytest.raises(ValueError, match=r"x: loss_type 'iqn' needs an IQN network"):
        resolve_loss_type("iqn", 1, "x", iqn=False)
    with pytest.raises(ValueError, match=r"Trainer: loss_type 'huber' does not fit an IQN network"):
        make(loss_type="huber")
    t = make()
    assert t.loss_type == "iqn" and not t.uses_fused_path and not t.batch_networks
    with pytest.raises(ValueError, match="an IQN network's step runs the two networks apart"):
        t.batch_networks = True


@pytest.mark.parametrize("c", [TINY_IQN, TINY_IQN_ENS], ids=["dueling", "ensemble"])
def test_trainer_step_is_the_public_ops_step_at_its_fractions(c):
    """The trainer's IQN step is a PublicOpsStep, so this checks the trainer's wiring (its draws
    of tau and tau', the readback, the optimizer tail) around it; the step's arithmetic is
    checked against float64 references in test_iqn_reference.py and test_f32_mirror.py."""
    t = make(c)
    check_trainer_step_is_the_public_ops_step(t, [batch(c, 16, seed=i) for i in range(3)], V_MIN, V_MAX, GAMMA)
    assert t.fraction_rng[1].item() == 3  # one draw per step


def test_the_step_draws_new_fractions_each_step_and_learns():
    """Two trainers of one seed draw the same fractions (the same parameters after three steps);
    every layer, phi included, gets a gradient."""
    a, b = make(), make()
    for i in range(3):
        a.step(step_batch(batch(TINY_IQN, 16, seed=i)))
        b.step(step_batch(batch(TINY_IQN, 16, seed=i)))
    same_bits(a.online.flat_params, b.online.flat_params, "same seed")
    grads = a.online.layer_views(a.online.flat_params.grad)
    for name, g in grads.items():
        assert (g != 0).any(), name
    assert a.fraction_rng[1].item() == 3  # one draw a step: new fractions each step
    tau1 = ops.iqn_fractions(torch.tensor([a.fraction_rng[0].item(), 0]), 16, 4, 4)[0]
    tau2 = ops.iqn_fractions(torch.tensor([a.fraction_rng[0].item(), 1]), 16, 4, 4)[0]
    assert not torch.equal(tau1, tau2)
    # and the step reads them: a trainer whose stream starts one draw later takes another step
    c = make()
    c.fraction_rng[1] = 1
    c.step(step_batch(batch(TINY_IQN, 16, seed=0)))
    d = make()
    d.step(step_batch(batch(TINY_IQN, 16, seed=0)))
    assert not torch.equal(c.online.flat_params, d.online.flat_params)


def test_acting_is_the_mean_over_the_midpoints():
    t = make(TINY_IQN_ENS)
    s = torch.randn(40, TINY_IQN_ENS.state_dim)
    K = t.config.iqn_fractions
    q = t.online(s, quantile_midpoints(K, s).expand(40, -1).contiguous())
    assert q.shape == (40, TINY_IQN_ENS.q_rows, K)
    want = greedy_from_logits(q, TINY_IQN_ENS.branches, V_MIN, V_MAX, "iqn")
    same_bits(t.act(s), want, "greedy")
    actions, greedy_q = t.act_explore(s, torch.zeros(1))
    same_bits(actions, want, "act_explore at epsilon 0")
    same_bits(greedy_actions(t.online, s, loss_type="iqn", fractions=quantile_midpoints(K, s)), want, "greedy_actions")
    mean = expected_q(q.double(), V_MIN, V_MAX, "iqn").view(40, 2, -1).mean(1)
    torch.testing.assert_close(greedy_q.double(), mean.gather(1, want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_public_step_runs_s_prime_at_the_midpoints_of_each_calls_shape(device):
    """PublicOpsStep keeps the [B, N] midpoints of its last call: a call of another batch or
    fraction count forms them anew. Each call's online outputs are the forward's on [s; s'] at
    [tau; the midpoints formed here apart]."""
    t = make(device=device)
    step = PublicOpsStep(t.online, t.target, loss_type="iqn", v_min=V_MIN, v_max=V_MAX, gamma=GAMMA)
    p, p_lp, layout = t.online.flat_params.detach(), t.online.params_bf16, t.online._layout_ints
    rng = ops.philox_rng(7, device)
    for B, N in ((3, 4), (5, 4), (5, 6), (3, 4)):
        b = batch(TINY_IQN, B, device, seed=B + N)
        tau, tau_target = ops.iqn_fractions(rng, B, N, N)
        got = step.forward(b["state_pairs"], (tau, tau_target)).online.q_logits
        mid = torch.tensor([(2 * k + 1) / (2 * N) for k in range(N)], device=device).expand(B, N).contiguous()
        want = ops.bf16_dueling_forward(b["state_pairs"], p, p_lp, layout, "bf16", torch.cat([tau, mid])).q_logits
        same_bits(got, want, f"B={B} N={N}")


def test_act_op_errors():
    t = make()
    s = torch.randn(3, TINY_IQN.state_dim)
    p, p_lp, layout = t.online.flat_params.detach(), t.online.params_bf16, t.online._layout_ints
    eps, rng = torch.zeros(1), torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"dqn_ops.act: loss_type 'qr': an IQN network .* acts with loss_type 'iqn'"):
        ops.act(s, p, p_lp, layout, V_MIN, V_MAX, eps, rng, "qr", fractions=torch.rand(4))
    with pytest.raises(RuntimeError, match=r"dqn_ops.act: fractions: an IQN network .* needs the quantile fractions"):
        ops.act(s, p, p_lp, layout, V_MIN, V_MAX, eps, rng, "iqn")
    with pytest.raises(RuntimeError, match=r"dqn_ops.act: fractions: expected shape \[\*\], got \[3, 4\]"):
        ops.act(s, p, p_lp, layout, V_MIN, V_MAX, eps, rng, "iqn", fractions=torch.rand(3, 4))
    plain = Trainer(dataclasses.replace(TINY_IQN, iqn_embedding=0), TrainerConfig(batch_size=4), device="cpu")
    with pytest.raises(RuntimeError, match=r"dqn_ops.act: loss_type 'iqn': 'iqn' needs an IQN network"):
        plain.online.act(s, eps, rng, loss_type="iqn", fractions=torch.rand(4))


def test_checkpoint_continues_the_fraction_stream():
    a = make()
    for i in range(2):
        a.step(step_batch(batch(TINY_IQN, 16, seed=i)))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make()
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    same_bits(b.fraction_rng, a.fraction_rng, "fraction_rng")
    for t in (a, b):
        t.step(step_batch(batch(TINY_IQN, 16, seed=5)))
    same_bits(a.online.flat_params, b.online.flat_params, "after the checkpoint")


def test_torch_trainer_runs_iqn():
    t = TorchTrainer(TINY_IQN, TrainerConfig(batch_size=16, iqn_fractions=4, gamma=GAMMA, readback_interval=1),
                     device="cpu", seed=3)
    before = t.online.phi.weight.detach().clone()
    for i in range(3):
        t.step(step_batch(batch(TINY_IQN, 16, seed=i)))
    assert not torch.equal(t.online.phi.weight, before)
    assert t.loss_type == "iqn" and t.act(torch.randn(5, TINY_IQN.state_dim)).shape == (5, 2)
    actions, greedy_q = t.act_explore(torch.randn(5, TINY_IQN.state_dim), torch.zeros(1))
    assert actions.shape == greedy_q.shape == (5, 2)


def test_torch_trainer_iqn_loss_compiles_with_dynamic_shapes():
    """With dynamic shapes dynamo traces the config's ints as symbols (bench_networks.py's
    compiles of earlier networks made them dynamic): TorchQNet's fractions check must not compare
    a symbolic bool with a bool, which dynamo cannot evaluate."""
    t = TorchTrainer(TINY_IQN, TrainerConfig(batch_size=8, iqn_fractions=3, gamma=GAMMA, readback_interval=1),
                     device="cpu", seed=3)
    t._loss_part = torch.compile(t._loss_part, dynamic=True, fullgraph=True)
    t.step(step_batch(batch(TINY_IQN, 8)))
    assert torch.isfinite(t.td_error).all()


@requires_cuda
@pytest.mark.parametrize("c", [TINY_IQN, TINY_IQN_ENS], ids=["dueling", "ensemble"])
def test_cuda_graphed_trainer_step_is_the_public_ops_step(c):
    t = make(c, "cuda", B=64, N=32)
    check_trainer_step_is_the_public_ops_step(t, [batch(c, 64, "cuda", seed=i) for i in range(6)], V_MIN, V_MAX,
                                              GAMMA)


@requires_cuda
def test_cuda_graphed_trainer_equals_eager():
    check_graphed_trainer_equals_eager(TINY_IQN, [step_batch(batch(TINY_IQN, 64, "cuda", seed=i)) for i in range(8)],
                                       batch_size=64, iqn_fractions=8, gamma=GAMMA)


@requires_cuda
def test_cuda_act_is_the_greedy_choice_of_the_forwards_q():
    t = make(TINY_IQN_ENS, "cuda", B=8, N=32)
    s = torch.randn(300, TINY_IQN_ENS.state_dim, device="cuda")
    gpu = t.act(s)
    K = t.config.iqn_fractions
    q = t.online(s, quantile_midpoints(K, s).expand(300, -1).contiguous())
    want = greedy_from_logits(q, TINY_IQN_ENS.branches, V_MIN, V_MAX, "iqn")
    assert (gpu == want).float().mean() > 0.99  # near-ties may break apart in F32

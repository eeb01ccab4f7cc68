"""Trainer: the whole step eager on the CPU (and on CUDA), graph replay vs eager, no host
sync, deferred readback, non-finite handling, checkpoints; against the plain-PyTorch step."""
import dataclasses
import io
import math

import pytest
import torch

from conftest import DEVICES, requires_cuda
from step_check import check_graphed_trainer_equals_eager
from dqn_ops import DQNConfig, NonFiniteError, Trainer, TrainerConfig
from dqn_ops.trainer import load_batch
from dqn_ops.rl.baseline import TorchTrainer

TINY_C51 = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))
TINY_Q = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=1, branches=(3, 3, 3))


def batch_for(c, B, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = dict(states=torch.randn(B, c.state_dim, generator=g), next_states=torch.randn(B, c.state_dim, generator=g),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=torch.randn(B, generator=g), dones=(torch.rand(B, generator=g) < 0.2).float())
    return {k: v.to(device) for k, v in b.items()}


def make(c=TINY_C51, device="cpu", B=32, **kw):
    kw.setdefault("readback_interval", 4)
    return Trainer(c, TrainerConfig(batch_size=B, **kw), device=device, seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", [TINY_C51, TINY_Q], ids=["c51", "huber"])
def test_learns_a_fixed_batch(device, c):
    t = make(c, device, use_cuda_graph=False, lr=1e-2, sigma_max=None, tau=0.0)
    b = batch_for(c, 32, device)
    for _ in range(60):
        t.step(b)
    t.readback()
    rows = t.stats.rows
    assert len(rows) == 60
    # (C51's cross-entropy cannot fall below the entropy of the fixed target distribution)
    assert sum(r["loss"] for r in rows[-5:]) < 0.9 * sum(r["loss"] for r in rows[:5])
    assert all(r["skipped"] == 0 for r in rows)


@pytest.mark.parametrize("c", [TINY_C51, TINY_Q], ids=["c51", "huber"])
def test_one_step_matches_the_plain_pytorch_step(c):
    """Same weights, same batch: loss, grad norm and mean Q of the first step agree with the
    plain-PyTorch F32 step to BF16 forward precision, and the weights move the same way."""
    cfg = dict(batch_size=64, sigma_max=None, readback_interval=1, lr=1e-3)  # (random spectral u differ)
    ours = Trainer(c, TrainerConfig(**cfg), device="cpu", seed=0)
    ref = TorchTrainer(c, TrainerConfig(**cfg), device="cpu", seed=0)  # the same seed: the same initial weights
    assert all(torch.equal(v, ref.online.state_dict()[k]) for k, v in ours.online.state_dict().items())
    before = ours.online.flat_params.detach().clone()
    b = batch_for(c, 64, "cpu")
    ours.step(b)
    ref.step(b)
    m, r = ours.readback(), ref.readback()
    for k in ("loss", "grad_norm_mean", "mean_q"):
        assert abs(m[k] - r[k]) <= 2e-2 * abs(r[k]) + 1e-3, (k, m[k], r[k])
    names = list(ours.online.layer_views())
    ref_sd, ours_sd, before_sd = ref.online.state_dict(), ours.online.state_dict(), ours.online.layer_views(before)
    ref_after, ours_after, ref_before = (torch.cat([sd[n].detach().flatten() for n in names])
                                         for sd in (ref_sd, ours_sd, before_sd))
    d_ours, d_ref = ours_after - ref_before, ref_after - ref_before
    # Adam's first step is ~lr * sign(g): the two updates point the same way almost everywhere
    cos = torch.nn.functional.cosine_similarity(d_ours, d_ref, dim=0)
    assert cos > 0.95, cos


def test_deferred_readback_reads_every_interval_and_on_demand():
    t = make(readback_interval=4)
    b = batch_for(TINY_C51, 32, "cpu")
    for i in range(3):
        t.step(b)
    assert t.metrics()["steps"] == 0  # nothing read yet: the host has not asked
    t.step(b)
    assert t.metrics()["steps"] == 4
    t.step(b)
    assert t.metrics()["steps"] == 4
    m = t.readback()  # forced (epoch end)
    assert m["steps"] == 5 and len(t.stats.rows) == 5
    assert "sigma_max_seen" in m


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_reward_raises_and_leaves_parameters(device):
    # (spectral norm off: its clamp still applies on a skipped step, as a constraint does)
    t = make(device=device, use_cuda_graph=False, sigma_max=None)
    b = batch_for(TINY_C51, 32, device)
    t.step(b)
    before = t.online.flat_params.detach().clone()
    bad = dict(b, rewards=b["rewards"].clone())
    bad["rewards"][3] = float("nan")
    with pytest.raises(NonFiniteError, match="step 1 was non-finite"):
        for _ in range(4):  # noticed within a step or two (a pinned copy of a device flag)
            t.step(bad)
        t.readback()
    assert t.non_finite_steps[0] == 1
    if device == "cpu":
        assert t.stats.steps_recorded == 2  # on the CPU the flag is read at once
    # every non-finite step was skipped by the optimizer
    assert torch.equal(t.online.flat_params.detach(), before)


def test_non_finite_flag_mode_counts_and_continues():
    t = make(on_non_finite="flag")
    b = batch_for(TINY_C51, 32, "cpu")
    bad = dict(b, states=b["states"].clone())
    bad["states"][0, 0] = float("inf")
    for batch in (b, bad, b, bad, b):
        t.step(batch)
    t.readback()
    assert t.non_finite_steps == [1, 3]
    assert t.metrics()["skipped"] == 2


def test_bad_batches():
    t = make()
    b = batch_for(TINY_C51, 32, "cpu")
    with pytest.raises(KeyError, match="missing \\['dones'\\]"):
        t.step({k: v for k, v in b.items() if k != "dones"})
    with pytest.raises(ValueError, match=r"batch\['states'\]: expected shape \[32, 6\], got \[31, 6\]"):
        t.step(dict(b, states=b["states"][:31]))
    with pytest.raises(TypeError, match=r"batch\['actions'\]: expected dtype torch.int64, got torch.float32"):
        t.step(dict(b, actions=b["actions"].float()))
    with pytest.raises(RuntimeError, match="actions: sample .* takes action 5 in branch 0"):
        t.step(dict(b, actions=torch.full_like(b["actions"], 5)))
    with pytest.raises(ValueError, match="on_non_finite must be 'raise' or 'flag'"):
        TrainerConfig(on_non_finite="ignore")
    with pytest.raises(ValueError, match=r"Trainer: loss_type 'c51' needs atoms > 1, got a network of 1 atom\(s\)"):
        Trainer(TINY_Q, TrainerConfig(loss_type="c51"), device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_load_batch_copies_every_buffer_and_resets_the_weights(device):
    """The batch lands in the static inputs (dqn_ops._load_batch where it can); a batch without
    weights after one with them gets weights 1; a float64 batch is converted."""
    t = make(device=device)
    for k, v in t.inputs.items():  # poison: every buffer must be written
        v.fill_(-7 if v.dtype == torch.long else float("nan"))
    b = batch_for(TINY_C51, 32, device, seed=5)
    w = torch.rand(32, device=device) + 0.5
    load_batch(t.inputs, dict(b, weights=w), t._ones)
    for k in b:
        assert torch.equal(t.inputs[k], b[k]), k
    assert torch.equal(t.inputs["weights"], w)
    b2 = batch_for(TINY_C51, 32, device, seed=6)
    load_batch(t.inputs, dict(b2, states=b2["states"].double()), t._ones)
    assert torch.equal(t.inputs["weights"], torch.ones(32, device=device))
    assert torch.equal(t.inputs["states"], b2["states"]) and torch.equal(t.inputs["rewards"], b2["rewards"])
    t.inputs["weights"].fill_(3.0)
    load_batch(t.inputs, b2)  # no `ones`: filled
    assert torch.equal(t.inputs["weights"], torch.ones(32, device=device))
    before = {k: v.clone() for k, v in t.inputs.items()}
    load_batch(t.inputs, t.inputs, t._ones)  # its own buffers: nothing to copy
    for k, v in t.inputs.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_load_batch_op_copies_checks_and_passes_opcheck(device):
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(4099, 5, generator=g),  # 16-byte copies and a tail
           torch.randint(0, 9, (37, 3), generator=g),
           torch.randn(37, generator=g)[1:]]  # at an odd offset: the byte-wise copy on CUDA
    src = [s.to(device) for s in src]
    dst = [torch.full_like(s, -1) for s in src]
    torch.ops.dqn_ops._load_batch(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s)
    torch.library.opcheck(torch.ops.dqn_ops._load_batch.default, ([torch.empty_like(s) for s in src], src))
    a, b = torch.zeros(8, device=device), torch.zeros(8, device=device)
    with pytest.raises(RuntimeError, match=r"src\[0\]: expected dtype Float, got Long"):
        torch.ops.dqn_ops._load_batch([a], [b.long()])
    with pytest.raises(RuntimeError, match=r"src\[0\]: expected 8 elements \(as dst\[0\]\), got 7"):
        torch.ops.dqn_ops._load_batch([a], [b[:7]])
    with pytest.raises(RuntimeError, match="expected as many sources as destinations, got 1 and 2"):
        torch.ops.dqn_ops._load_batch([a, b], [b])
    with pytest.raises(RuntimeError, match=r"src\[0\]: expected a contiguous tensor"):
        torch.ops.dqn_ops._load_batch([a[:4]], [b.view(4, 2).t()[0]])
    with pytest.raises(RuntimeError, match=r"dst\[0\] and src\[0\] must not share memory"):
        torch.ops.dqn_ops._load_batch([a[:4]], [a[2:6]])
    with pytest.raises(RuntimeError, match="at most 8 tensors, got 9"):
        torch.ops.dqn_ops._load_batch([torch.zeros(1, device=device) for _ in range(9)],
                                      [torch.zeros(1, device=device) for _ in range(9)])


def resume_and_compare(a, b, batches, saved_at: int, eps):
    """Steps `a` (exploring) over batches[:saved_at], saves its checkpoint, goes on over the rest;
    then loads the checkpoint into `b` and checks that `b` explores over the rest exactly as `a`
    did (the exploration stream continues too)."""
    for batch in batches[:saved_at]:
        a.step(batch)
        a.act_explore(batch["states"], eps)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    acted = []
    for batch in batches[saved_at:]:
        a.step(batch)
        acted.append(a.act_explore(batch["states"], eps)[0])
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert b.steps == saved_at
    for batch, act in zip(batches[saved_at:], acted):
        b.step(batch)
        assert torch.equal(b.act_explore(batch["states"], eps)[0], act)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_round_trip_continues_identically(device):
    batches = [batch_for(TINY_C51, 32, device, seed=i) for i in range(12)]
    a, c = make(device=device, use_cuda_graph=False), make(device=device, use_cuda_graph=False)
    resume_and_compare(a, c, batches, 6, torch.full((1,), 0.5, device=device))
    for x, y in [(a.online.flat_params, c.online.flat_params), (a.target.flat_params, c.target.flat_params),
                 (a.online.params_bf16, c.online.params_bf16), (a.spectral.u, c.spectral.u)]:
        assert torch.equal(x, y)
    sa, sc = a.optimizer.state[a.online.flat_params], c.optimizer.state[c.online.flat_params]
    assert all(torch.equal(sa[k], sc[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_torch_trainer_checkpoint_round_trip_continues_identically(device, graphed, decoupled):
    """The plain-PyTorch baseline checkpoints as Trainer does: a trainer loaded from another's
    checkpoint (another seed: other weights, streams and mask key; another learning rate and
    kind of weight decay) then trains and explores exactly as the saved one goes on to."""
    if graphed and device == "cpu":
        pytest.skip("CUDA graphs are CUDA's")
    c = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3),
                  ensemble=2)
    cfg = TrainerConfig(batch_size=32, readback_interval=4, use_cuda_graph=graphed, warmup_steps=2,
                        bootstrap_p=0.5, lr=3e-3, weight_decay=0.05, decoupled_weight_decay=decoupled)
    batches = [dict(batch_for(c, 32, device, seed=i), indices=torch.arange(32, device=device) + i)
               for i in range(10)]
    a = TorchTrainer(c, cfg, device=device, seed=3)
    b = TorchTrainer(c, dataclasses.replace(cfg, lr=1e-4, decoupled_weight_decay=not decoupled), device=device,
                     seed=11)
    resume_and_compare(a, b, batches, 5, torch.full((1,), 0.5, device=device))
    # the optimizer's settings came with its state
    assert (b.config.lr, b.config.decoupled_weight_decay) == (cfg.lr, decoupled)
    assert isinstance(b.optimizer, torch.optim.AdamW) == decoupled
    # Bit for bit on the CPU. On CUDA plain PyTorch's scatter_add_ (the target's projection, the
    # backward of the taken action's gather) sums with atomics in no fixed order, so two runs of
    # the same step may differ in the last bits.
    tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(list(a.online.parameters()) + list(a.target.parameters()) + a.us,
                    list(b.online.parameters()) + list(b.target.parameters()) + b.us):
        torch.testing.assert_close(x, y, **tol)
    assert a.readback()["steps"] == b.readback()["steps"] == 10


def test_a_checkpoint_loads_only_into_its_own_kind_of_trainer():
    trainer, baseline = make(), TorchTrainer(TINY_C51, TrainerConfig(batch_size=32), device="cpu")
    with pytest.raises(ValueError, match=r"^TorchTrainer.load_state_dict: the checkpoint is a Trainer's"):
        baseline.load_state_dict(trainer.state_dict())
    with pytest.raises(ValueError, match=r"^Trainer.load_state_dict: the checkpoint is a TorchTrainer's"):
        trainer.load_state_dict(baseline.state_dict())
    other = TorchTrainer(TINY_Q, TrainerConfig(batch_size=32), device="cpu")
    with pytest.raises(ValueError, match=r"^TorchTrainer.load_state_dict: the checkpoint's network"):
        baseline.load_state_dict(other.state_dict())


@pytest.mark.parametrize("stepped", [True, False], ids=["moments", "no_moments"])
def test_a_checkpoint_of_another_buffer_length_is_refused_before_anything_loads(stepped):
    """A checkpoint of a network whose widths are not multiples of 8, written before the buffer
    stored them rounded up (DQNConfig.aligned), has Adam moments of the old buffer's length and a
    spectral norm v of the old matrices' widths (a checkpoint before any step: no moments)."""
    c = DQNConfig(state_dim=5, trunk_hidden=(12,), value_hidden=6, adv_hidden=6, atoms=3, branches=(2,))
    trainer = make(c, use_cuda_graph=False)
    if stepped:
        trainer.step(batch_for(c, 32, "cpu"))
    state = trainer.state_dict()
    for moments in state["optimizer"]["state"].values():
        moments["exp_avg"] = moments["exp_avg"][:c.num_parameters].clone()
    state["spectral"]["v"] = state["spectral"]["v"][:-4].clone()
    fresh = make(c, use_cuda_graph=False)
    before = fresh.online.flat_params.detach().clone()
    what = r"its Adam exp_avg has \d+ elements" if stepped else r"its spectral norm's v has \d+ elements"
    with pytest.raises(ValueError, match=r"^Trainer.load_state_dict: the checkpoint does not fit: " + what):
        fresh.load_state_dict(state)
    assert torch.equal(fresh.online.flat_params, before) and fresh.steps == 0


@requires_cuda
@pytest.mark.parametrize("c", [DQNConfig(), TINY_Q], ids=["reference", "huber"])
def test_graph_replay_equals_eager_and_no_host_sync(c):
    B = 256
    batches = [batch_for(c, B, "cuda", seed=i) for i in range(10)]
    check_graphed_trainer_equals_eager(c, batches, batch_size=B, readback_interval=4)


@requires_cuda
def test_out_of_range_action_on_cuda_is_reported_as_non_finite():
    t = make(device="cuda")
    b = batch_for(TINY_C51, 32, "cuda")
    for _ in range(4):
        t.step(b)  # warm-up + capture
    bad = dict(b, actions=b["actions"].clone())
    bad["actions"][0, 1] = 7
    with pytest.raises(NonFiniteError):
        for _ in range(3):
            t.step(bad)
        t.readback()


def test_torch_trainer_refuses_an_out_of_range_action_on_cpu():
    t = TorchTrainer(TINY_C51, TrainerConfig(batch_size=32, use_cuda_graph=False), device="cpu")
    b = batch_for(TINY_C51, 32, "cpu")
    b["actions"][4, 1] = 7
    with pytest.raises(ValueError, match=r"torch_dqn_loss: actions: sample 4 takes action 7 in branch 1"):
        t.step(b)


def _torch_trainer_state(t):
    """The parameters and the Adam state a skipped step leaves as they were (with sigma_max=None:
    the spectral-norm clamp, which still runs, may rescale the weights)."""
    opt = [v.clone() for st in t.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in t.online.parameters()] + opt


def test_compiled_torch_trainer_poisons_an_out_of_range_action():
    """Under torch.compile the CPU check (a data-dependent branch) is left out: the sample is
    poisoned as on CUDA, and the step is skipped and counted."""
    t = TorchTrainer(TINY_C51, TrainerConfig(batch_size=32, use_cuda_graph=False, readback_interval=1,
                                             on_non_finite="flag", sigma_max=None), device="cpu")
    t.compile_parts()
    b = batch_for(TINY_C51, 32, "cpu")
    t.step(b)
    before = _torch_trainer_state(t)
    b["actions"][4, 1] = 7
    t.step(b)
    m = t.readback()
    assert m["skipped"] == 1 and math.isnan(m["loss_last"]) and t.non_finite_steps == [1]
    assert all(torch.equal(x, y) for x, y in zip(_torch_trainer_state(t), before))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("on_non_finite", ["raise", "flag"])
def test_torch_trainer_skips_and_reports_a_non_finite_step_as_trainer_does(device, on_non_finite):
    """A NaN reward (on CUDA also an out-of-range action, no device-side assert): the update is
    skipped (the parameters, the Adam moments and its step count unchanged; on CUDA inside the
    captured graph), the step raises NonFiniteError or is counted in non_finite_steps, and the
    next finite step trains on."""
    cfg = TrainerConfig(batch_size=32, readback_interval=4, warmup_steps=2, on_non_finite=on_non_finite,
                        sigma_max=None)
    t = TorchTrainer(TINY_C51, cfg, device=device)
    b = batch_for(TINY_C51, 32, device)
    for _ in range(3):
        t.step(b)  # on CUDA: warm-up and capture
    t.readback()
    before = _torch_trainer_state(t)
    bad = dict(b, rewards=b["rewards"].clone(), actions=b["actions"].clone())
    bad["rewards"][3] = float("nan")
    if device == "cuda":
        bad["actions"][0, 1] = 7
    if on_non_finite == "raise":
        with pytest.raises(NonFiniteError, match=r"^TorchTrainer: step 3 was non-finite .* The optimizer skipped it"):
            t.step(bad)
            t.readback()
    else:
        t.step(bad)
        m = t.readback()
        assert m["skipped"] == 1 and t.non_finite_steps == [3]
    assert all(torch.equal(x, y) for x, y in zip(_torch_trainer_state(t), before))
    t.step(b)
    t.readback()
    assert not all(torch.equal(x, y) for x, y in zip(_torch_trainer_state(t), before))


@requires_cuda
def test_a_host_batch_for_a_cuda_trainer_is_refused():
    t = make(device="cuda")
    with pytest.raises(ValueError, match=r"batch\['states'\] is on cpu, the trainer on cuda:0: move the batch first"):
        t.step(batch_for(TINY_C51, 32, "cpu"))


# ----------------------------------------------------------------------------------------
# What a user porting a PyTorch DQN trips on: clear errors, no silent no-ops

def test_misspelt_and_non_tensor_batch_entries_are_refused():
    t = make()
    b = batch_for(TINY_C51, 32, "cpu")
    with pytest.raises(KeyError, match=r"unknown keys \['weight'\]"):  # would train without the weights
        t.step(dict(b, weight=torch.ones(32)))
    with pytest.raises(TypeError, match=r"batch\['rewards'\] must be a torch.Tensor, got ndarray"):
        t.step(dict(b, rewards=b["rewards"].numpy()))
    assert t.steps == 0


def test_inputs_cannot_be_rebound():
    """The step reads the input buffers' addresses: a new tensor bound to a key would be ignored."""
    t = make()
    with pytest.raises(TypeError):
        t.inputs["states"] = torch.zeros(32, 6)
    t.inputs["states"].copy_(torch.ones(32, 6))  # writing into them is the way
    assert torch.equal(t.inputs["states"], torch.ones(32, 6))


def test_trainer_arguments_are_checked():
    with pytest.raises(TypeError, match=r"net_config must be a dqn_ops.DQNConfig .* \(the TrainerConfig goes second"):
        Trainer(TrainerConfig(batch_size=4), device="cpu")
    with pytest.raises(TypeError, match="config must be a dqn_ops.TrainerConfig .*, got dict"):
        Trainer(TINY_C51, dict(batch_size=4), device="cpu")
    with pytest.raises(ValueError, match=r"seed must be an int in \[-2\^63, 2\^64\)"):
        Trainer(TINY_C51, TrainerConfig(batch_size=4), device="cpu", seed=2 ** 64)
    with pytest.raises(TypeError, match="seed must be"):
        Trainer(TINY_C51, TrainerConfig(batch_size=4), device="cpu", seed=1.5)
    for trainer in (Trainer, TorchTrainer):
        t = trainer(TINY_C51, TrainerConfig(batch_size=4), device="cpu")
        with pytest.raises(TypeError, match=r"act_explore: epsilon must be a one-element float32 tensor"):
            t.act_explore(torch.randn(3, 6), 0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a torch without a CUDA device")
def test_a_cuda_trainer_without_cuda_says_so():
    for trainer in (Trainer, TorchTrainer):
        with pytest.raises(RuntimeError, match="no CUDA device .* pass device='cpu'"):
            trainer(TINY_C51, TrainerConfig(batch_size=4))  # the default device is "cuda"


def test_trainer_config_is_frozen_and_set_lr_checks():
    cfg = TrainerConfig(batch_size=4)
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        cfg.batch_size = -3
    t = Trainer(TINY_C51, cfg, device="cpu")
    t.set_lr(0.0)  # a schedule's end
    with pytest.raises(ValueError, match=r"Trainer.set_lr: lr must be a finite number >= 0"):
        t.set_lr(float("nan"))
    with pytest.raises(ValueError, match=r"Trainer.set_lr: lr must be a finite number >= 0"):
        t.set_lr(-1e-3)
    assert t.lr.item() == 0.0


def test_load_state_dict_takes_the_checkpoints_optimizer_settings_and_says_so():
    saved = make(lr=3e-3, betas=(0.8, 0.95), adam_eps=1e-6, weight_decay=0.01)
    saved.step(batch_for(TINY_C51, 32, "cpu"))
    t = make(lr=1e-2, betas=(0.5, 0.6), adam_eps=1e-3, weight_decay=0.1)
    t.load_state_dict(saved.state_dict())
    group = t.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.01)
    assert t.lr.item() == pytest.approx(3e-3)
    c = t.config
    assert (c.lr, c.betas, c.adam_eps, c.weight_decay) == (pytest.approx(3e-3), (0.8, 0.95), 1e-6, 0.01)
    t.step(batch_for(TINY_C51, 32, "cpu"))
    assert t.readback()["steps"] == 2  # the checkpoint's step and this one


def test_a_head_group_trainers_checkpoint_loads_and_continues_identically():
    from dqn_ops import HeadGroup
    c = DQNConfig(state_dim=6, trunk_hidden=(16,), adv_hidden=(8,), atoms=5, branches=(3, 2),
                  aux=(HeadGroup("c51", members=2, atoms=5, adv_hidden=(8,)),))
    a = Trainer(c, TrainerConfig(batch_size=8, readback_interval=2), device="cpu", seed=1)
    batches = [batch_for(c, 8, "cpu", seed=i) for i in range(4)]
    a.step(batches[0])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = Trainer(c, TrainerConfig(batch_size=8, readback_interval=2), device="cpu", seed=7)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for batch in batches[1:]:
        a.step(batch)
        b.step(batch)
    assert torch.equal(a.online.flat_params, b.online.flat_params)
    assert torch.equal(a.target.flat_params, b.target.flat_params)


def test_one_skipped_step_leaves_the_running_aggregates_finite():
    t = make(on_non_finite="flag")
    b = batch_for(TINY_C51, 32, "cpu")
    bad = dict(b, rewards=b["rewards"].clone())
    bad["rewards"][0] = float("nan")
    for batch in [b, bad] + [b] * 6:
        t.step(batch)
    m = t.readback()
    rows = t.stats.rows
    assert t.non_finite_steps == [1] and m["skipped"] == 1 and math.isnan(rows[1]["loss"])
    good = [r for i, r in enumerate(rows) if i != 1]
    assert m["loss"] == pytest.approx(sum(r["loss"] for r in good) / len(good))
    assert m["grad_norm_max"] == max(r["grad_norm"] for r in rows if math.isfinite(r["grad_norm"]))
    assert math.isfinite(m["mean_q"]) and t.metrics(last=3)["loss"] == pytest.approx(
        sum(r["loss"] for r in rows[-3:]) / 3)


def test_both_trainers_refuse_a_float64_batch_in_their_own_name():
    b = batch_for(TINY_C51, 32, "cpu")
    b64 = dict(b, states=b["states"].double())
    for trainer, name in ((Trainer, "Trainer.step"), (TorchTrainer, "TorchTrainer.step")):
        t = trainer(TINY_C51, TrainerConfig(batch_size=32), device="cpu")
        with pytest.raises(TypeError, match=rf"{name}: batch\['states'\]: expected dtype torch.float32, got torch.float64"):
            t.step(b64)

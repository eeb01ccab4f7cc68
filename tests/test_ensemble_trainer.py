"""Ensembles in the trainer: the bootstrap_masks op, TrainerConfig's bootstrap_p and act_ucb,
Trainer / TorchTrainer with E members, checkpoints, the training loop and scripts/train.py.

bootstrap_masks against the independent Python Philox of tests/reference.py (masks[b, e] = 1 iff
uniform(draw(stream 4, seed, call = indices[b], row = e, slot 0)) < p), CPU against CUDA bit for
bit, its statistics (each mask is 1 with probability p, the members independent), opcheck. The
trainer's step with masks against the public ops' step with the same masks, bit for bit
(tests/step_check.py); a member masked out of every sample gets no gradient in its heads.
"""
import dataclasses
import io
import math
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dqn_ops
from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, Trainer, TrainerConfig, ops
from dqn_ops.rl.baseline import TorchTrainer
from dqn_ops.step import fused_loss_supported
from dqn_ops.trainer import ensemble_score, greedy_from_logits
from reference import STREAM_ACT, STREAM_BOOTSTRAP, STREAM_ENV, STREAM_REPLAY, philox_draw, philox_uniform
from step_check import check_graphed_trainer_equals_eager, check_trainer_step_is_the_public_ops_step, same_bits

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

MASKS_OP = torch.ops.dqn_ops.bootstrap_masks.default
V_MIN, V_MAX, GAMMA = -10.0, 10.0, 0.97
E = 3
TINY_ENS = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3),
                     ensemble=E)
TINY_ENS_Q = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=1, branches=(3, 2),
                       ensemble=E)
SEED = 3  # the trainers' seed: the masks' key


def reference_masks(indices, seed, members, p):
    """masks[b, e] from tests/reference.py's Python Philox (float64 comparison, as the kernels)."""
    seed = int(seed) & (2 ** 64 - 1)
    return torch.tensor([[1.0 if philox_uniform(philox_draw(STREAM_BOOTSTRAP, seed, int(i), e, 0)) < p else 0.0
                          for e in range(members)] for i in indices.tolist()], dtype=torch.float32).view(-1, members)


def trainer_batch(c, B, device, seed=0, indices=None):
    """A batch with state_pairs = [s; s'] (for the public-ops step) and the replay rows `indices`
    (distinct random rows of a 10^6-row replay by default)."""
    g = torch.Generator().manual_seed(seed)
    s, s2 = torch.randn(B, c.state_dim, generator=g), torch.randn(B, c.state_dim, generator=g)
    b = dict(states=s, next_states=s2, state_pairs=torch.cat([s, s2]),
             actions=torch.stack([torch.randint(0, n, (B,), generator=g) for n in c.branches], 1),
             rewards=(torch.rand(B, generator=g) * 2 - 1) * 4, dones=(torch.rand(B, generator=g) < 0.2).float(),
             weights=torch.rand(B, generator=g) + 0.5,
             indices=torch.randperm(10 ** 6, generator=g)[:B] if indices is None else indices)
    return {k: v.to(device) for k, v in b.items()}


def step_batch(b):
    return {k: v for k, v in b.items() if k != "state_pairs"}


def make(c=TINY_ENS, device="cpu", B=32, seed=SEED, **kw):
    kw.setdefault("readback_interval", 1)
    kw.setdefault("gamma", GAMMA)
    return Trainer(c, TrainerConfig(batch_size=B, **kw), device=device, seed=seed)


# ----------------------------------------------------------------------------------------
# bootstrap_masks

@pytest.mark.parametrize("seed", [0, 5, 2 ** 63 + 11, -7])
@pytest.mark.parametrize("members,p", [(1, 0.5), (3, 0.3), (7, 0.9), (2, 1.0)])
def test_masks_are_the_python_philox(seed, members, p):
    g = torch.Generator().manual_seed(members)
    indices = torch.cat([torch.tensor([0, 1, 2 ** 32 + 5, 2 ** 63 - 1, -1, -(2 ** 63)]),
                         torch.randint(0, 2 ** 40, (40,), generator=g)])
    got = dqn_ops.bootstrap_masks(indices, seed, members, p)
    assert got.dtype == torch.float32 and got.shape == (len(indices), members)
    same_bits(got, reference_masks(indices, seed, members, p), "masks")


def test_masks_of_a_strided_or_empty_index_tensor():
    base = torch.arange(100, dtype=torch.long) * 977
    strided = base[::3]
    assert not strided.is_contiguous()
    same_bits(dqn_ops.bootstrap_masks(strided, 4, 5, 0.5), dqn_ops.bootstrap_masks(strided.contiguous(), 4, 5, 0.5),
              "strided")
    same_bits(dqn_ops.bootstrap_masks(base[:1].expand(4), 4, 5, 0.5),
              dqn_ops.bootstrap_masks(base[:1], 4, 5, 0.5).expand(4, 5), "expanded")
    empty = dqn_ops.bootstrap_masks(torch.empty(0, dtype=torch.long), 4, 5, 0.5)
    assert empty.shape == (0, 5) and empty.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_a_transition_keeps_its_masks(device):
    """The masks are a function of (seed, index, member): the same rows in another order, in
    another batch or another call give the same rows of masks; another seed, other masks."""
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 10 ** 7, (500,), generator=g).to(device)
    m = dqn_ops.bootstrap_masks(indices, 9, E, 0.5)
    perm = torch.randperm(500, generator=g).to(device)
    same_bits(dqn_ops.bootstrap_masks(indices[perm], 9, E, 0.5), m[perm], "permuted")
    same_bits(dqn_ops.bootstrap_masks(indices[:17], 9, E, 0.5), m[:17], "a sub-batch")
    same_bits(dqn_ops.bootstrap_masks(indices, 9, E, 0.5), m, "again")
    # more members: the first E columns are the same (member e's draw does not depend on E)
    same_bits(dqn_ops.bootstrap_masks(indices, 9, E + 2, 0.5)[:, :E], m, "more members")
    assert not torch.equal(dqn_ops.bootstrap_masks(indices, 10, E, 0.5), m)
    assert not torch.equal(m[:, 0], m[:, 1])  # the members draw independently


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_mask_frequencies(p):
    """Over 2*10^5 rows each member's mask is 1 with frequency p, two members both 1 with p^2
    (independent), within 5 standard deviations; p = 1 gives every mask 1."""
    n, members = 200_000, 4
    m = dqn_ops.bootstrap_masks(torch.arange(n, dtype=torch.long) * 3 + 11, 21, members, p).double()
    assert set(m.unique().tolist()) == {0.0, 1.0}
    for e in range(members):
        assert abs(m[:, e].mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n), e
    both = (m[:, 0] * m[:, 1]).mean().item()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    ones = dqn_ops.bootstrap_masks(torch.arange(n, dtype=torch.long), 21, members, 1.0)
    assert torch.equal(ones, torch.ones(n, members))


def test_mask_threshold_is_compared_in_double():
    """A draw u = k / 2^24 is 1 iff u < p exactly: at p = u the mask is 0, at the next double it is 1."""
    indices = torch.arange(64, dtype=torch.long)
    u = [philox_uniform(philox_draw(STREAM_BOOTSTRAP, 2, i, 0, 0)) for i in range(64)]
    k = next(i for i in range(64) if u[i] > 0)
    at = dqn_ops.bootstrap_masks(indices, 2, 1, u[k])[k, 0].item()
    above = dqn_ops.bootstrap_masks(indices, 2, 1, math.nextafter(u[k], 2.0))[k, 0].item()
    assert (at, above) == (0.0, 1.0)


def test_bootstrap_stream_is_its_own():
    draws = {s: [philox_draw(s, 3, 0, row, 0) for row in range(16)]
             for s in (STREAM_ACT, STREAM_REPLAY, STREAM_ENV, STREAM_BOOTSTRAP)}
    assert len({tuple(d) for d in draws.values()}) == 4


@requires_cuda
def test_cuda_masks_are_the_cpu_bits_and_capture_in_a_graph():
    g = torch.Generator().manual_seed(3)
    indices = torch.cat([torch.randint(-(2 ** 62), 2 ** 62, (70_000,), generator=g), torch.arange(5000)])
    for members, p in ((1, 0.5), (5, 0.37), (300, 0.9)):
        same_bits(dqn_ops.bootstrap_masks(indices.cuda(), 2 ** 64 - 3, members, p).cpu(),
                  dqn_ops.bootstrap_masks(indices, 2 ** 64 - 3, members, p), f"E={members}, p={p}")
    same_bits(dqn_ops.bootstrap_masks(indices.cuda()[::7], 1, 4, 0.5).cpu(),
              dqn_ops.bootstrap_masks(indices[::7], 1, 4, 0.5), "strided")
    # captured: a replay reads the indices then in the buffer
    buf = indices[:256].cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dqn_ops.bootstrap_masks(buf, 8, E, 0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dqn_ops.bootstrap_masks(buf, 8, E, 0.5)
    for lo in (1000, 2000):
        buf.copy_(indices[lo:lo + 256])
        graph.replay()
        torch.cuda.synchronize()
        same_bits(out.cpu(), dqn_ops.bootstrap_masks(indices[lo:lo + 256], 8, E, 0.5), f"replay from {lo}")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bootstrap_masks(device):
    indices = torch.randint(0, 10 ** 6, (37,)).to(device)
    for members, p in ((1, 1.0), (4, 0.5)):
        torch.library.opcheck(MASKS_OP, (indices, 12, members, p))
    torch.library.opcheck(MASKS_OP, (torch.empty(0, dtype=torch.long, device=device), 0, 3, 0.25))


def test_bootstrap_masks_compile_fullgraph():
    f = torch.compile(lambda i: dqn_ops.bootstrap_masks(i, 5, E, 0.5) * 2, fullgraph=True)
    indices = torch.arange(20, dtype=torch.long)
    same_bits(f(indices), dqn_ops.bootstrap_masks(indices, 5, E, 0.5) * 2, "compiled")


BAD_MASK_ARGS = [
    ((torch.zeros(4), 1, 2, 0.5), r"dqn_ops.bootstrap_masks: indices: expected dtype Long, got (Float|torch.float32)"),
    ((torch.zeros(2, 3, dtype=torch.long), 1, 2, 0.5),
     r"dqn_ops.bootstrap_masks: indices: expected a 1-D tensor \[B\] \(the replay rows of the batch\), got shape "
     r"\[2, 3\]"),
    ((torch.zeros(4, dtype=torch.long), 1, 0, 0.5),
     r"dqn_ops.bootstrap_masks: members: expected 1 <= members <= 4294967296 \(philox's row is 32 bits\), got 0"),
    ((torch.zeros(4, dtype=torch.long), 1, 2 ** 32 + 1, 0.5), r"members: expected 1 <= members <= 4294967296"),
    ((torch.zeros(4, dtype=torch.long), 1, 2, 0.0),
     r"dqn_ops.bootstrap_masks: p: expected 0 < p <= 1 \(the probability that a member learns from a transition\), "
     r"got 0"),
    ((torch.zeros(4, dtype=torch.long), 1, 2, 1.5), r"p: expected 0 < p <= 1 .*got 1.5"),
    ((torch.zeros(4, dtype=torch.long), 1, 2, float("nan")), r"p: expected 0 < p <= 1 .*got nan"),
]


@pytest.mark.parametrize("args,match", BAD_MASK_ARGS)
def test_bad_mask_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        MASKS_OP(*args)
    with FakeTensorMode():  # the fake kernel says the same
        fake = [torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(RuntimeError, match=match):
            MASKS_OP(*fake)


# ----------------------------------------------------------------------------------------
# TrainerConfig

@pytest.mark.parametrize("kw,err,match", [
    (dict(bootstrap_p=0.0), ValueError, r"TrainerConfig: bootstrap_p must be a finite number > 0 and <= 1, got 0.0"),
    (dict(bootstrap_p=1.01), ValueError, r"bootstrap_p must be a finite number > 0 and <= 1, got 1.01"),
    (dict(bootstrap_p=float("nan")), ValueError, r"bootstrap_p must be .*got nan"),
    (dict(bootstrap_p="0.5"), TypeError, r"bootstrap_p must be a finite number"),
    (dict(act_ucb=float("inf")), ValueError, r"TrainerConfig: act_ucb must be a finite number, got inf"),
    (dict(act_ucb=True), TypeError, r"act_ucb must be a finite number"),
])
def test_config_checks(kw, err, match):
    with pytest.raises(err, match=match):
        TrainerConfig(**kw)


def test_config_defaults_and_values():
    cfg = TrainerConfig()
    assert cfg.bootstrap_p == 1.0 and cfg.act_ucb == 0.0 and not cfg.uses_masks
    cfg = TrainerConfig(bootstrap_p=1, act_ucb=-2)  # ints become floats; a negative ucb is a lower bound
    assert isinstance(cfg.bootstrap_p, float) and cfg.act_ucb == -2.0 and not cfg.uses_masks
    assert TrainerConfig(bootstrap_p=0.5).uses_masks


def test_fused_loss_path_takes_ensembles_and_masks():
    one = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3))
    many = DQNConfig(state_dim=6, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=11, branches=(2, 3),
                     ensemble=ops.FUSED_LOSS_MAX_BRANCHES // 2 + 1)  # its branches over the members past the limit
    assert fused_loss_supported(one, "c51", torch.device("cuda"))
    assert fused_loss_supported(TINY_ENS, "c51", torch.device("cuda"))
    assert not fused_loss_supported(many, "c51", torch.device("cuda"))
    # the trainer says so for its own config, with bootstrap masks or not
    for config, p, fused in ((one, 1.0, True), (one, 0.5, True), (TINY_ENS, 0.5, True), (many, 0.5, False)):
        t = make(config, bootstrap_p=p)
        t.device = torch.device("cuda")  # the predicate reads the device only (no CUDA needed here)
        assert t.uses_fused_path == fused


# ----------------------------------------------------------------------------------------
# Trainer with an ensemble

def _masks_with_zeros(indices, p):
    m = ops.bootstrap_masks(indices, SEED, E, p)
    assert (m == 0).any() and (m == 1).any(), "masks of one value: the test would not see them"
    return m


@pytest.mark.parametrize("c", [TINY_ENS, TINY_ENS_Q], ids=["c51", "huber"])
@pytest.mark.parametrize("p", [0.5, 1.0])
def test_trainer_step_is_the_public_ops_step_with_the_masks(c, p):
    """Two steps on the CPU; the second against PublicOpsStep given bootstrap_masks(indices,
    seed, E, p) (None for p = 1): gradient, TD errors, loss and mean Q, bit for bit."""
    t = make(c, bootstrap_p=p)
    assert ("indices" in t.inputs) == (p < 1)
    batches = [trainer_batch(c, 32, "cpu", seed=i) for i in range(2)]
    masks = _masks_with_zeros(batches[-1]["indices"], p) if p < 1 else None
    check_trainer_step_is_the_public_ops_step(t, batches, V_MIN, V_MAX, GAMMA, masks=masks)
    if p < 1:
        assert torch.equal(t.inputs["indices"], batches[-1]["indices"])
        assert torch.equal(t.bootstrap_masks(batches[-1]["indices"]), masks)


def test_masks_change_the_step():
    """The same trainer and batches with p = 0.5 and p = 1: other losses and gradients (the
    masks reach the loss); p = 1 and a batch with indices ignores them."""
    b = trainer_batch(TINY_ENS, 32, "cpu", seed=4)
    _masks_with_zeros(b["indices"], 0.5)
    a, ones, ones_no_indices = make(bootstrap_p=0.5), make(), make()
    a.step(step_batch(b))
    ones.step(step_batch(b))
    ones_no_indices.step({k: v for k, v in step_batch(b).items() if k != "indices"})
    assert not torch.equal(a.online.flat_params.grad, ones.online.flat_params.grad)
    assert a.readback()["loss"] != ones.readback()["loss"]
    same_bits(ones.online.flat_params.grad, ones_no_indices.online.flat_params.grad, "p = 1 ignores indices")


def _rows_masking_out(member, p, B, want_others=True):
    """B replay rows whose masks are 0 for `member` and, among them, 1 for each other member somewhere."""
    rows = torch.arange(20 * B, dtype=torch.long) * 7 + 100
    m = ops.bootstrap_masks(rows, SEED, E, p)
    chosen = rows[m[:, member] == 0][:B]
    assert len(chosen) == B
    mc = ops.bootstrap_masks(chosen, SEED, E, p)
    assert (mc[:, member] == 0).all()
    if want_others:
        assert all((mc[:, e] == 1).any() for e in range(E) if e != member)
    return chosen


def _head_grads(grad_views, member):
    return {k: v for k, v in grad_views.items() if k.startswith(f"e{member}.")}


@pytest.mark.parametrize("backend", ["dqn_ops", "torch"])
def test_a_member_masked_out_of_every_sample_gets_no_head_gradient(backend):
    """Member 1's mask is 0 on every sample of the batch: its heads' gradient is exactly 0, the
    other members' heads and the trunk learn; with p = 1 (no masks) member 1's heads learn too."""
    member, p = 1, 0.5
    b = step_batch(trainer_batch(TINY_ENS, 32, "cpu", seed=6, indices=_rows_masking_out(member, p, 32)))
    for bp in (p, 1.0):
        cfg = TrainerConfig(batch_size=32, bootstrap_p=bp, sigma_max=None)
        if backend == "dqn_ops":
            t = Trainer(TINY_ENS, cfg, device="cpu", seed=SEED)
            t.step(b)
            grads = t.online.layer_views(t.online.flat_params.grad)
        else:
            t = TorchTrainer(TINY_ENS, cfg, device="cpu", seed=SEED)
            t.step(b)
            grads = {k: v.grad for k, v in t.online.named_parameters()}
        masked = _head_grads(grads, member)
        assert masked and len(masked) == len(_head_grads(grads, 0))
        if bp < 1:
            assert all(torch.equal(g, torch.zeros_like(g)) for g in masked.values()), \
                [k for k, g in masked.items() if (g != 0).any()]
        else:
            assert any((g != 0).any() for g in masked.values())
        for e in (0, 2):
            assert any((g != 0).any() for g in _head_grads(grads, e).values()), e
        assert (grads["s1.weight"] != 0).any()


def test_batch_without_indices_is_refused_when_masks_are_drawn():
    t = make(bootstrap_p=0.5)
    b = step_batch(trainer_batch(TINY_ENS, 32, "cpu"))
    match = r"Trainer.step: batch is missing 'indices': the bootstrap masks .*replay's indices, int64 \[B\]"
    for trainer in (t, TorchTrainer(TINY_ENS, TrainerConfig(batch_size=32, bootstrap_p=0.5), device="cpu")):
        with pytest.raises(KeyError, match=match):
            trainer.step({k: v for k, v in b.items() if k != "indices"})
    with pytest.raises(TypeError, match=r"batch\['indices'\]: expected dtype torch.int64, got torch.int32"):
        t.step(dict(b, indices=b["indices"].int()))
    with pytest.raises(ValueError, match=r"batch\['indices'\]: expected shape \[32\], got \[31\]"):
        t.step(dict(b, indices=b["indices"][:31]))


def test_one_step_matches_the_plain_pytorch_step_with_masks():
    """Trainer and TorchTrainer (the same seed: the same weights and masks) on one batch with
    p = 0.5: loss, grad norm and mean Q agree to BF16 forward precision."""
    cfg = dict(batch_size=64, sigma_max=None, readback_interval=1, lr=1e-3, bootstrap_p=0.5)
    ours = Trainer(TINY_ENS, TrainerConfig(**cfg), device="cpu", seed=0)
    ref = TorchTrainer(TINY_ENS, TrainerConfig(**cfg), device="cpu", seed=0)
    b = step_batch(trainer_batch(TINY_ENS, 64, "cpu", seed=8))
    ours.step(b)
    ref.step(b)
    m, r = ours.readback(), ref.readback()
    for k in ("loss", "grad_norm_mean", "mean_q"):
        assert abs(m[k] - r[k]) <= 2e-2 * abs(r[k]) + 1e-3, (k, m[k], r[k])
    # the masks matter at this tolerance: without them the plain step's loss is elsewhere
    plain = TorchTrainer(TINY_ENS, TrainerConfig(**dict(cfg, bootstrap_p=1.0)), device="cpu", seed=0)
    plain.step(b)
    assert abs(plain.readback()["loss"] - r["loss"]) > 2e-2 * abs(r["loss"]) + 1e-3


# ----------------------------------------------------------------------------------------
# acting

def test_ensemble_score_is_mean_plus_ucb_times_population_std():
    q = torch.tensor([[1.0, 0.0, 4.0], [1.0, 1.5, -2.0]]).reshape(1, 6)  # 2 members x 3 actions
    for ucb in (0.0, 0.5, -1.0):
        score, mean = ensemble_score(q, 2, ucb)
        want_mean = torch.tensor([[1.0, 0.75, 1.0]])
        want = want_mean + ucb * torch.tensor([[0.0, 0.75, 3.0]])
        torch.testing.assert_close(mean, want_mean, rtol=0, atol=0)
        torch.testing.assert_close(score, want, rtol=0, atol=0)
    one = torch.randn(4, 5)
    assert torch.equal(ensemble_score(one, 1, 3.0)[0], one)


@pytest.mark.parametrize("ucb", [0.0, 1.5, -1.5])
def test_trainer_acts_with_its_ucb(ucb):
    """Trainer.act_explore is ops.act with the config's ucb on the online network (bit for bit),
    Trainer.act (evaluation) ops.act with the members' mean (ucb 0); the choices are those of mean + ucb * std over the members in float64 wherever the
    scores are apart (the op scores in double: 1e-9; greedy_from_logits, TorchTrainer's scoring,
    in F32: 1e-4); greedy_q is the mean; ucb != 0 changes some choices."""
    t = make(act_ucb=ucb)
    net = t.online
    s = torch.randn(300, TINY_ENS.state_dim)
    args = (s, net.flat_params.detach(), net.params_bf16, net._layout_ints, V_MIN, V_MAX, torch.zeros(1))
    want = ops.act(*args, torch.tensor([0, 0]), "c51", ucb)
    same_bits(t.act(s), ops.act(*args, torch.tensor([0, 0]), "c51", 0.0).actions, "act")
    eps0 = torch.zeros(1)
    actions, greedy_q = t.act_explore(s, eps0)
    same_bits(actions, want.actions, "act_explore")
    same_bits(greedy_q, want.greedy_q, "greedy_q")
    q = ops.bf16_dueling_forward(s, net.flat_params.detach(), net.params_bf16, net._layout_ints).q_logits
    z = torch.linspace(V_MIN, V_MAX, TINY_ENS.atoms, dtype=torch.float64)
    Q = (q.double().softmax(-1) * z).sum(-1).view(300, E, -1)  # [N, E, A] in float64
    mean, score = Q.mean(1), Q.mean(1) + ucb * Q.std(1, correction=0)
    off, decided = 0, 0
    for d, n in enumerate(TINY_ENS.branches):
        sc = score[:, off:off + n]
        top2 = sc.topk(2, dim=1).values
        apart = (top2[:, 0] - top2[:, 1]) > 1e-9
        assert torch.equal(want.actions[apart, d], sc.argmax(1)[apart])
        got_mean = mean[:, off:off + n].gather(1, want.actions[:, d:d + 1])[:, 0]
        torch.testing.assert_close(want.greedy_q[:, d].double(), got_mean, rtol=1e-6, atol=1e-7)
        # torch's F32 scoring (TorchTrainer's) makes the same choices where they are decided in F32
        apart32 = (top2[:, 0] - top2[:, 1]) > 1e-4
        assert torch.equal(greedy_from_logits(q, TINY_ENS.branches, V_MIN, V_MAX, ucb=ucb)[apart32, d],
                           sc.argmax(1)[apart32])
        decided += int(apart32.sum())
        off += n
    assert decided > 0.9 * 300 * TINY_ENS.num_branches
    if ucb != 0:
        assert not torch.equal(want.actions, ops.act(*args, torch.tensor([0, 0]), "c51", 0.0).actions)


def test_torch_trainer_acts_with_its_ucb():
    cfg = TrainerConfig(batch_size=8, act_ucb=2.0)
    t = TorchTrainer(TINY_ENS, cfg, device="cpu", seed=0)
    s = torch.randn(200, TINY_ENS.state_dim)
    with torch.no_grad():
        q = t.online(s)[0]
    want = greedy_from_logits(q, TINY_ENS.branches, V_MIN, V_MAX, ucb=2.0)
    assert torch.equal(t.act(s), greedy_from_logits(q, TINY_ENS.branches, V_MIN, V_MAX))
    assert not torch.equal(t.act(s), want)
    actions, greedy_q = t.act_explore(s, torch.zeros(1))
    assert torch.equal(actions, want)
    Q = (q.softmax(-1) * torch.linspace(V_MIN, V_MAX, TINY_ENS.atoms)).sum(-1).view(200, E, -1).mean(1)
    offsets = torch.tensor([0, TINY_ENS.branches[0]])
    torch.testing.assert_close(greedy_q, Q.gather(1, want + offsets), rtol=0, atol=0)
    assert not torch.equal(want, greedy_from_logits(q, TINY_ENS.branches, V_MIN, V_MAX))


# ----------------------------------------------------------------------------------------
# checkpoints

def test_checkpoint_round_trip_with_masks_continues_identically():
    batches = [step_batch(trainer_batch(TINY_ENS, 32, "cpu", seed=i)) for i in range(8)]
    a = make(bootstrap_p=0.5, act_ucb=1.0)
    for b in batches[:4]:
        a.step(b)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    for b in batches[4:]:
        a.step(b)
    # a trainer of another seed continues the same: the replay rows keep the checkpoint's masks
    for seed in (SEED, SEED + 1):
        c = make(bootstrap_p=0.5, act_ucb=1.0, seed=seed)
        c.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        for b in batches[4:]:
            c.step(b)
        same_bits(c.online.flat_params.detach(), a.online.flat_params.detach(), f"online, seed {seed}")
        same_bits(c.target.flat_params, a.target.flat_params, f"target, seed {seed}")


def test_checkpoint_of_another_ensemble_size_is_refused():
    three = make()
    for other in (dict(ensemble=2), dict(ensemble=1)):
        t = make(dataclasses.replace(TINY_ENS, **other))
        with pytest.raises(ValueError, match=rf"Trainer.load_state_dict: the checkpoint's network is an ensemble of 3 "
                                             rf"member\(s\), this trainer's of {other['ensemble']} "
                                             rf"\(DQNConfig.ensemble\)"):
            t.load_state_dict(three.state_dict())
        with pytest.raises(ValueError, match=rf"an ensemble of {other['ensemble']} member\(s\), this trainer's of 3"):
            three.load_state_dict(t.state_dict())
    # a checkpoint written before ensembles existed (no 'ensemble' in its network) is one member's
    one = make(dataclasses.replace(TINY_ENS, ensemble=1))
    state = one.state_dict()
    del state["net_config"]["ensemble"]
    make(dataclasses.replace(TINY_ENS, ensemble=1)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"an ensemble of 1 member\(s\), this trainer's of 3"):
        three.load_state_dict(state)


# ----------------------------------------------------------------------------------------
# the training loop and scripts/train.py

def test_loop_samples_into_the_trainers_indices():
    """With masks the loop's sampled rows land in the trainer's own indices buffer (the masks
    read the rows of the batch being trained on, not a stale copy)."""
    from dqn_ops.rl.envs import BRANCHES, STATE_DIM, FuturesTradingEnv
    from dqn_ops.rl.loop import LoopConfig, TrainingLoop
    from dqn_ops.rl.replay import ReplayBuffer
    net = DQNConfig(state_dim=STATE_DIM, trunk_hidden=(16,), value_hidden=8, adv_hidden=8, atoms=11,
                    branches=BRANCHES, ensemble=E)
    t = Trainer(net, TrainerConfig(batch_size=16, bootstrap_p=0.5, act_ucb=0.5, readback_interval=8), device="cpu")
    replay = ReplayBuffer(1000, STATE_DIM, len(BRANCHES), device="cpu", seed=2, num_envs=8)
    loop = TrainingLoop(t, FuturesTradingEnv(8, device="cpu", seed=1), replay, LoopConfig(iterations_per_graph=8))
    assert loop.indices is t.inputs["indices"]
    loop.prefill(4)
    loop.run(8)
    sampled = t.inputs["indices"].clone()
    assert (sampled > 0).any() and (sampled < replay.size).all()
    assert t.readback()["steps"] == 8


@pytest.mark.parametrize("backend", ["dqn_ops", "torch"])
def test_train_script_with_an_ensemble(tmp_path, backend):
    import train
    args = train.parse_args(["--device", "cpu", "--tiny", "--epochs", "2", "--steps", "4", "--batch", "16",
                             "--num-envs", "8", "--eval-envs", "4", "--quiet", "--out", str(tmp_path),
                             "--backend", backend, "--ensemble", "3", "--bootstrap-p", "0.5", "--act-ucb", "0.5"])
    summary = train.train(args)
    assert (summary["ensemble"], summary["bootstrap_p"], summary["act_ucb"]) == (3, 0.5, 0.5)
    assert summary["epochs"] == 2 and not summary["non_finite"]
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    if backend == "dqn_ops":
        assert ckpt["net_config"]["ensemble"] == 3 and ckpt["steps"] == 8
        assert ckpt["config"]["bootstrap_p"] == 0.5 and ckpt["config"]["act_ucb"] == 0.5
        t = train.make_trainer(args)
        t.load_state_dict(ckpt)
        assert t.net_config.members == 3
    else:
        assert any(k.startswith("e2.") for k in ckpt["online"])


# ----------------------------------------------------------------------------------------
# CUDA (the ensemble kernels on the device)

@requires_cuda
@pytest.mark.parametrize("p", [0.5, 1.0])
def test_cuda_trainer_step_is_the_public_ops_step_with_the_masks(p):
    t = make(device="cuda", bootstrap_p=p, on_non_finite="flag")
    n = t.config.warmup_steps + 2
    batches = [trainer_batch(TINY_ENS, 32, "cuda", seed=10 + i) for i in range(n)]
    masks = ops.bootstrap_masks(batches[-1]["indices"], SEED, E, p) if p < 1 else None
    check_trainer_step_is_the_public_ops_step(t, batches, V_MIN, V_MAX, GAMMA, masks=masks)


@requires_cuda
def test_cuda_graph_replay_with_masks_equals_eager_and_no_host_sync():
    B = 64
    batches = [step_batch(trainer_batch(TINY_ENS, B, "cuda", seed=i)) for i in range(10)]
    check_graphed_trainer_equals_eager(TINY_ENS, batches, batch_size=B, readback_interval=4, bootstrap_p=0.5,
                                       act_ucb=1.0)


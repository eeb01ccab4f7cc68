"""The trainer's step against the public ops' step, bit for bit: the check the fused-step tests
(tests/test_fused_step.py), the network-shape tests (tests/test_network_shapes.py) and the QR
tests (tests/test_qr.py) make; and the graphed trainer against the eager one (tests/test_trainer.py,
tests/test_qr.py)."""
import math

import torch

from dqn_ops import DuelingBranchQNet, Trainer, TrainerConfig, ops
from dqn_ops.step import PublicOpsStep


def same_bits(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def snapshot(net):
    """A copy of `net` (master and mirror) on its device."""
    copy = DuelingBranchQNet(net.config).to(net.flat_params.device)
    copy.flat_params.data.copy_(net.flat_params)
    copy.params_bf16.copy_(net.params_bf16)
    return copy


def check_trainer_step_is_the_public_ops_step(t, batches, v_min, v_max, gamma, masks=None):
    """Steps the trainer `t` (readback_interval 1) on each batch (dicts with state_pairs = [s; s'],
    states, next_states, actions, rewards, dones, weights; on CUDA the first ones warm up and
    capture its graph), the last against PublicOpsStep on copies of its networks taken before
    that step, given `masks` (an ensemble's bootstrap masks of the last batch, or None): the same
    gradient, TD errors, loss and mean Q, bit for bit. An IQN trainer's step draws its fractions
    from its fraction_rng: the public step gets the same draws (ops.iqn_fractions of a copy)."""
    for b in batches[:-1]:
        t.step({k: v for k, v in b.items() if k != "state_pairs"})
    online, target = snapshot(t.online), snapshot(t.target)
    fractions = None
    if t.net_config.iqn:
        N = t.config.iqn_fractions
        fractions = ops.iqn_fractions(t.fraction_rng.clone(), t.config.batch_size, N, N)
    t.step({k: v for k, v in batches[-1].items() if k != "state_pairs"})
    assert t.graphed == (t.device.type == "cuda")
    want = PublicOpsStep(online, target, loss_type=t.loss_type, v_min=v_min, v_max=v_max, gamma=gamma,
                         precision=t.config.backward_precision)(
        *(batches[-1][k] for k in ("state_pairs", "actions", "rewards", "dones", "weights")), masks, fractions)
    same_bits(t.online.flat_params.grad, want.grad, "grad")
    same_bits(t.td_error, want.td_error, "td_error")
    t.readback()
    row = t.stats.rows[-1]
    assert row["loss"] == want.loss.item() and row["mean_q"] == want.mean_q.item()


def check_graphed_trainer_equals_eager(c, batches, **config):
    """A graphed Trainer and an eager one (TrainerConfig(**config), seed 1) step through the same
    CUDA batches: 3 warm-up steps, the capture, then the rest under set_sync_debug_mode("error")
    (no host sync in a replay). They agree to F32 rounding (the graphed step itself is checked bit
    for bit against the eager public ops by check_trainer_step_is_the_public_ops_step)."""
    graphed = Trainer(c, TrainerConfig(**config), device="cuda", seed=1)
    eager = Trainer(c, TrainerConfig(**config, use_cuda_graph=False), device="cuda", seed=1)
    for b in batches[:4]:  # 3 warm-up steps (eager on a side stream), then the capture
        graphed.step(b)
        eager.step(b)
    assert graphed.graphed and not eager.graphed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[4:]:
            graphed.step(b)
            eager.step(b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(graphed.online.flat_params, eager.online.flat_params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed.target.flat_params, eager.target.flat_params, rtol=1e-5, atol=1e-6)
    mg, me = graphed.readback(), eager.readback()
    assert mg["steps"] == me["steps"] == len(batches)
    for k in ("loss", "grad_norm_mean", "mean_q"):
        assert math.isfinite(me[k]) and abs(mg[k] - me[k]) <= 1e-4 * abs(me[k]) + 1e-6


def check_compile_fullgraph_equals_eager(loss_fn, q):
    """loss_fn(q) -> (loss, td, mean_q): torch.compile(fullgraph=True) of it gives eager's bits,
    its backward (the op's registered autograd) too, and that gradient is not all zero."""
    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(loss_fn, fullgraph=True), loss_fn):
        x = q.clone().requires_grad_()
        loss, td, mean_q = fn(x)
        loss.backward()
        results.append((loss.detach(), td, mean_q, x.grad))
    for name, a, b in zip(("loss", "td", "mean_q", "grad"), *results):
        same_bits(a, b, name)
    assert (results[0][3] != 0).any()

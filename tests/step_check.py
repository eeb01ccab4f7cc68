"""The trainer's step against the public ops' step, bit for bit: the check the fused-step tests
(tests/test_fused_step.py) and the network-shape tests (tests/test_network_shapes.py) both make."""
import torch

from dqn_ops import DuelingBranchQNet
from dqn_ops.step import PublicOpsStep


def same_bits(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def snapshot(net):
    """A copy of `net` (master and mirror) on its device."""
    copy = DuelingBranchQNet(net.config).to(net.flat_params.device)
    copy.flat_params.data.copy_(net.flat_params)
    copy.params_bf16.copy_(net.params_bf16)
    return copy


def check_trainer_step_is_the_public_ops_step(t, batches, v_min, v_max, gamma):
    """Steps the trainer `t` (readback_interval 1) on each batch (dicts with state_pairs = [s; s'],
    states, next_states, actions, rewards, dones, weights; on CUDA the first ones warm up and
    capture its graph), the last against PublicOpsStep on copies of its networks taken before
    that step: the same gradient, TD errors, loss and mean Q, bit for bit."""
    for b in batches[:-1]:
        t.step({k: v for k, v in b.items() if k != "state_pairs"})
    online, target = snapshot(t.online), snapshot(t.target)
    t.step({k: v for k, v in batches[-1].items() if k != "state_pairs"})
    assert t.graphed == (t.device.type == "cuda")
    want = PublicOpsStep(online, target, loss_type=t.loss_type, v_min=v_min, v_max=v_max, gamma=gamma,
                         precision=t.config.backward_precision)(
        *(batches[-1][k] for k in ("state_pairs", "actions", "rewards", "dones", "weights")))
    same_bits(t.online.flat_params.grad, want.grad, "grad")
    same_bits(t.td_error, want.td_error, "td_error")
    t.readback()
    row = t.stats.rows[-1]
    assert row["loss"] == want.loss.item() and row["mean_q"] == want.mean_q.item()

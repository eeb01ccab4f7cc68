"""The CUDA output-bias + dueling kernel and the dueling backward in their two launch shapes
(csrc/cuda/dueling.cuh split_heads: a grid column per head, or one column walking a row's
heads) give the same bits: every network shape's q, head and gradient, run once with
DQN_OPS_HEAD_COLUMNS=split and once with =whole (read once per process: a subprocess each)."""
import textwrap

import torch

from conftest import first_forward_error, requires_cuda, saved_with_env

ENV = "DQN_OPS_HEAD_COLUMNS"

# Each case: a network, its batch, and the backward's inputs (grad_q, grad_head: present or
# None) and precision (bf16 writes the BF16 copy of d(head), fp32 does not).
RUN = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests")
    from dqn_ops import DQNConfig, DuelingBranchQNet, ops
    from reference import CONFIGS, SHAPES
    nets = dict(CONFIGS)
    nets.update({k: SHAPES[k] for k in ("trunk1_head1", "trunk3_head2")})
    nets["no_dueling"] = DQNConfig(state_dim=8, trunk_hidden=(32,), adv_hidden=(16,), atoms=11, branches=(3, 2),
                                   dueling=False)
    nets["ensemble_3"] = DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=11,
                                   branches=(3, 2), ensemble=3)
    nets["iqn"] = DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                            branches=(3, 2), iqn_embedding=16)
    out = {}
    for name, c in nets.items():
        g = torch.Generator().manual_seed(0)
        net = DuelingBranchQNet(c, generator=g).to("cuda")
        B, N = 70, 5
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, N, generator=g).cuda() if c.iqn else None
        fwd = net.forward_full(s, tau)
        gq = torch.randn(fwd.q_logits.shape, generator=g).cuda()
        gh = (torch.randn(fwd.head_logits.shape, generator=g) * 0.1).cuda()
        out[name, "q"], out[name, "head"] = fwd.q_logits.cpu(), fwd.head_logits.cpu()
        for precision in ("bf16", "fp32"):
            for which, (a, b) in {"both": (gq, gh), "grad_q": (gq, None), "grad_head": (None, gh)}.items():
                grad, gs = ops.mixed_backward(a, b, fwd, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                              precision, need_grad_states=True)
                out[name, precision, which] = torch.cat([grad.cpu(), gs.cpu().flatten()])
    torch.save(out, sys.argv[1])
""")


@requires_cuda
def test_both_launch_shapes_give_the_same_bits(tmp_path):
    split = saved_with_env(RUN, ENV, "split", str(tmp_path / "split.pt"))
    whole = saved_with_env(RUN, ENV, "whole", str(tmp_path / "whole.pt"))
    assert split.keys() == whole.keys() and len(split) == 10 * 8  # 10 networks, 8 outputs each
    for key in split:
        assert torch.isfinite(split[key]).all(), key
        assert torch.equal(split[key], whole[key]), key


@requires_cuda
def test_a_bad_setting_is_refused_by_name():
    err = first_forward_error(ENV, "yes")
    assert "dqn_ops: DQN_OPS_HEAD_COLUMNS: expected auto, split or whole, got 'yes'" in err, err[-2000:]

"""The output-bias + dueling kernel's rows staged in shared memory (DQN_OPS_STAGE_HEAD_ROWS=1,
csrc/cuda/dueling_forward.cu head_bias_dueling_kernel<true>): for heads of one atom, where a
thread takes a row and walks its heads (rows enough to fill the SMs), the block copies its rows'
logits to shared memory first. The same bits as each thread reading its row from global memory
(=0), for dueling and plain heads, an ensemble and IQN, at rows with a partial last block; the
staged kernel runs only under =1 (and only where a block's rows fit 48 KB: head_ld <= 44). The
row counts make more blocks than an H100's or H200's 132 SMs (a GPU of more than 145 would split
IQN's heads by column instead). Read once per process: a subprocess each."""
import textwrap

import pytest
import torch

from conftest import assert_same_bits, first_forward_error, requires_cuda, saved_with_env

ENV = "DQN_OPS_STAGE_HEAD_ROWS"

RUN = textwrap.dedent("""
    import sys, torch
    from dqn_ops import DQNConfig, DuelingBranchQNet
    nets = {
        "dueling": (DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                              branches=(2, 3, 5)), 40_000, 0),
        "no_dueling": (DQNConfig(state_dim=8, trunk_hidden=(32,), adv_hidden=(16,), atoms=1, branches=(4, 2),
                                 dueling=False), 40_000, 0),
        # two members of one branch: head_ld 32, within the staged rows' shared memory
        "ensemble_2": (DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                                 branches=(3,), ensemble=2), 40_000, 0),
        "iqn": (DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=(16,), adv_hidden=(16,), atoms=1,
                          branches=(3, 2), iqn_embedding=16), 1_000, 37),
    }
    out, staged = {}, {}
    for name, (c, B, fractions) in nets.items():
        g = torch.Generator().manual_seed(0)
        net = DuelingBranchQNet(c, generator=g).to("cuda")
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, fractions, generator=g).cuda() if fractions else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s, tau)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "head_bias_dueling_kernel" in e.name]
        staged[name] = (sum("<true>" in n for n in names), len(names))
        out[name] = [fwd.q_logits.cpu(), fwd.head_logits.cpu()]
    torch.save(dict(out=out, staged=staged), sys.argv[1])
""")


@requires_cuda
def test_staged_rows_give_the_same_bits(tmp_path):
    on, off = (saved_with_env(RUN, ENV, v, str(tmp_path / f"{v}.pt")) for v in ("1", "0"))
    if not any(total for _, total in on["staged"].values()):
        pytest.skip("the profiler recorded no kernels here")
    for name in on["staged"]:
        # 40,000 rows of one atom: 157 blocks of 256, more than any GPU's SMs, so one launch walks
        # every head of a row (not split) and takes the staged kernel under =1 alone.
        assert on["staged"][name] == (1, 1), (name, on["staged"][name])
        assert off["staged"][name] == (0, 1), (name, off["staged"][name])
    assert_same_bits(on["out"], off["out"], "staged vs global rows")
    assert torch.isfinite(on["out"]["iqn"][0]).all() and on["out"]["iqn"][0].shape[-1] == 37


@requires_cuda
def test_a_bad_setting_is_refused_by_name():
    err = first_forward_error(ENV, "yes")
    assert "dqn_ops: DQN_OPS_STAGE_HEAD_ROWS: expected 0 or 1, got 'yes'" in err, err[-2000:]

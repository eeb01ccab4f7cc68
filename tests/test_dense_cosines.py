"""IQN's cosines formed by the dense layer kernel where it runs phi's layer (DQN_OPS_DENSE_COSINES=1,
csrc/cuda/dense_layer.h fractions; csrc/cuda/dueling_forward.cu iqn_embedding): the cosine launch
before phi's layer is gone, and the cosines (stored for the backward), phi, z, the head logits
and q are the same bits as under =0, where iqn_cosines_kernel writes the cosines first. Under each
forced tile shape, for an embedding of one whole K tile (64 cosines) and of a partial one (16),
at fraction rows with tails in every tile shape; and where the dense kernel does not run phi's
layer (mode off) the cosine launch still runs under =1, with =0's bits. Read once per process: a
subprocess each."""
import textwrap

import pytest

from conftest import assert_same_bits, python_with_env, requires_cuda, saved_with_env

ENV = "DQN_OPS_DENSE_COSINES"
TILES = ("128x128", "64x64", "32x64")

RUN = textwrap.dedent("""
    import os, sys, torch
    os.environ["DQN_OPS_DENSE_TILE"] = sys.argv[2]  # read at the kernel's first launch
    from dqn_ops import DQNConfig, DuelingBranchQNet, dense_kernel
    dense_kernel.set_mode(sys.argv[3])
    nets = {
        "cosines_64": (DQNConfig(state_dim=40, trunk_hidden=(130, 96), value_hidden=24, adv_hidden=16, atoms=1,
                                 branches=(2, 3), iqn_embedding=64), 1000, 7),
        "cosines_16": (DQNConfig(state_dim=12, trunk_hidden=(40,), value_hidden=16, adv_hidden=8, atoms=1,
                                 branches=(3,), iqn_embedding=16), 37, 5),
    }
    out, launches = {}, {}
    for name, (c, B, N) in nets.items():
        g = torch.Generator().manual_seed(0)
        net = DuelingBranchQNet(c, generator=g).to("cuda")
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, N, generator=g).cuda()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s, tau)
            torch.cuda.synchronize()
        launches[name] = (sum("iqn_cosines_kernel" in e.name for e in prof.events()),
                          sum("dense_layer_kernel" in e.name for e in prof.events()))
        out[name] = [t.cpu() for t in fwd.activations] + [fwd.head_logits.cpu(), fwd.q_logits.cpu()]
    torch.save(dict(out=out, launches=launches), sys.argv[1])
""")


@requires_cuda
@pytest.mark.parametrize("tile", TILES)
def test_cosines_formed_in_the_dense_kernel_are_the_cosine_kernels_bits(tmp_path, tile):
    on, off = (saved_with_env(RUN, ENV, v, str(tmp_path / f"{v}.pt"), tile, "on") for v in ("1", "0"))
    if not any(dense for _, dense in off["launches"].values()):
        pytest.skip("the profiler recorded no kernels here")
    for name in on["launches"]:
        # Under =1 no cosine launch; under =0 one, before phi's dense launch. The dense launches
        # are the same ones.
        assert on["launches"][name][0] == 0 and off["launches"][name][0] == 1, (name, on["launches"], off["launches"])
        assert on["launches"][name][1] == off["launches"][name][1], (name, on["launches"], off["launches"])
    assert_same_bits(on["out"], off["out"], (tile, "cosines in the dense kernel vs the cosine kernel's"))


@requires_cuda
def test_the_cosine_launch_runs_where_the_dense_kernel_does_not(tmp_path):
    on, off = (saved_with_env(RUN, ENV, v, str(tmp_path / f"{v}.pt"), "auto", "off") for v in ("1", "0"))
    if not any(cos for cos, _ in off["launches"].values()):
        pytest.skip("the profiler recorded no kernels here")
    for name in on["launches"]:
        assert on["launches"][name] == off["launches"][name] == (1, 0), (name, on["launches"], off["launches"])
    assert_same_bits(on["out"], off["out"], "mode off: the cosine launch under either setting")


@requires_cuda
def test_a_bad_setting_is_refused_by_name():
    code = textwrap.dedent("""
        import torch
        from dqn_ops import DQNConfig, DuelingBranchQNet
        c = DQNConfig(state_dim=8, trunk_hidden=(32,), value_hidden=16, adv_hidden=16, atoms=1, branches=(3,),
                      iqn_embedding=16)
        net = DuelingBranchQNet(c).to("cuda")
        net.forward_full(torch.randn(4, 8, device="cuda"), torch.rand(4, 3, device="cuda"))
        torch.cuda.synchronize()
    """)
    r = python_with_env(code, ENV, "yes", timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "dqn_ops: DQN_OPS_DENSE_COSINES: expected 0 or 1, got 'yes'" in r.stderr, r.stderr[-2000:]

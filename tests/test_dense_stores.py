"""The dense layer kernel's two ways of storing a hidden layer's outputs (csrc/cuda/dense_layer.cu,
DQN_OPS_DENSE_STORES=direct|staged: from the fragments, or through shared memory in 16-byte
stores) give the same bits, under every tile shape, for the hidden layers of networks with tails
in every tile dimension and for IQN's phi layer with its scaled output z. Each setting is read
once per process: a subprocess each, the tile forced by DQN_OPS_DENSE_TILE set before the first
launch."""
import textwrap

import pytest
import torch

from conftest import python_with_env, requires_cuda, saved_with_env

ENV = "DQN_OPS_DENSE_STORES"
TILES = ("128x128", "64x64", "32x64")

RUN = textwrap.dedent("""
    import os, sys, torch
    os.environ["DQN_OPS_DENSE_TILE"] = sys.argv[2]  # read at the kernel's first launch
    sys.path.insert(0, "tests")
    from dqn_ops import DQNConfig, dense_kernel
    from test_dense_layer import DEEP_HEADS, SHAPE
    from test_network_shapes import make_net
    dense_kernel.set_mode("on")
    iqn = DQNConfig(state_dim=40, trunk_hidden=(130, 100), value_hidden=24, adv_hidden=16, atoms=1, branches=(2, 3),
                    iqn_embedding=64)
    out = {}
    for name, c in (("shape", SHAPE), ("deep_heads", DEEP_HEADS), ("iqn", iqn)):
        g = torch.Generator().manual_seed(0)
        net = make_net(c, "cuda", seed=5)
        B = 1000
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, 7, generator=g).cuda() if c.iqn else None
        fwd = net.forward_full(s, tau)
        torch.cuda.synchronize()
        out[name] = [t.cpu() for t in fwd.activations] + [fwd.head_logits.cpu()]
    torch.save(out, sys.argv[1])
""")


@requires_cuda
@pytest.mark.parametrize("tile", TILES)
def test_both_store_paths_give_the_same_bits(tmp_path, tile):
    direct = saved_with_env(RUN, ENV, "direct", str(tmp_path / "direct.pt"), tile)
    staged = saved_with_env(RUN, ENV, "staged", str(tmp_path / "staged.pt"), tile)
    assert direct.keys() == staged.keys() == {"shape", "deep_heads", "iqn"}
    for name in direct:
        assert len(direct[name]) == len(staged[name])
        for i, (a, b) in enumerate(zip(direct[name], staged[name])):
            assert torch.isfinite(a.float()).all(), (tile, name, i)
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits)), (tile, name, i)


@requires_cuda
def test_a_bad_store_setting_is_refused_by_name():
    code = textwrap.dedent("""
        import torch
        from dqn_ops import DQNConfig, DuelingBranchQNet, dense_kernel
        dense_kernel.set_mode("on")
        net = DuelingBranchQNet(DQNConfig()).to("cuda")
        net.forward_full(torch.randn(4, 96, device="cuda"))
    """)
    r = python_with_env(code, ENV, "vector", timeout=300)
    assert r.returncode != 0 and "dqn_ops: DQN_OPS_DENSE_STORES: expected direct or staged, got 'vector'" in r.stderr, \
        r.stderr[-2000:]

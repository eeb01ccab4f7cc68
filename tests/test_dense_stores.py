"""The dense layer kernel's two ways of storing a hidden layer's outputs (csrc/cuda/dense_layer.cu,
DQN_OPS_DENSE_STORES=direct|staged: from the fragments, or through shared memory in 16-byte
stores) give the same bits, under every tile shape, for the hidden layers of networks with row
and tile tails and for IQN's phi layer with its scaled output z; the profiler's kernel names say
that every hidden layer ran the kernel with the forced tile and the setting's store path. Each
setting is read once per process: a subprocess each, the tile forced by DQN_OPS_DENSE_TILE set
before the first launch. (The networks' widths are stored as multiples of 8, so every launch
here has rows of whole 16-byte chunks, which the staged path needs.)"""
import re
import textwrap

import pytest

from conftest import assert_same_bits, first_forward_error, requires_cuda, saved_with_env

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
    out, kernels = {}, set()
    for name, c in (("shape", SHAPE), ("deep_heads", DEEP_HEADS), ("iqn", iqn)):
        g = torch.Generator().manual_seed(0)
        net = make_net(c, "cuda", seed=5)
        B = 1000
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, 7, generator=g).cuda() if c.iqn else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s, tau)
            torch.cuda.synchronize()
        kernels |= {e.name for e in prof.events() if "dense_layer_kernel" in e.name}
        out[name] = [t.cpu() for t in fwd.activations] + [fwd.head_logits.cpu()]
    torch.save(dict(out=out, kernels=sorted(kernels)), sys.argv[1])
""")
# A dense launch's tile rows, epilogue (0: a hidden layer) and store path, by the kernel's name.
KERNEL = re.compile(r"dense_layer_kernel<(\d+), \d+, \d+, \d+, \(dqn_ops::cuda::DenseEpilogue\)(\d), (true|false)>")


def hidden_launches(kernels):
    """(tile rows, staged) of every hidden-layer launch among the kernel names."""
    found = [KERNEL.search(k) for k in kernels]
    assert all(found), kernels
    return {(int(m.group(1)), m.group(3) == "true") for m in found if m.group(2) == "0"}


@requires_cuda
@pytest.mark.parametrize("tile", TILES)
def test_both_store_paths_give_the_same_bits(tmp_path, tile):
    runs = {setting: saved_with_env(RUN, ENV, setting, str(tmp_path / f"{setting}.pt"), tile)
            for setting in ("direct", "staged")}
    rows = int(tile.split("x")[0])
    for setting, r in runs.items():
        assert hidden_launches(r["kernels"]) == {(rows, setting == "staged")}, (setting, r["kernels"])
    assert runs["direct"]["out"].keys() == {"shape", "deep_heads", "iqn"}
    assert_same_bits(runs["direct"]["out"], runs["staged"]["out"], tile)


@requires_cuda
def test_a_bad_store_setting_is_refused_by_name():
    err = first_forward_error(ENV, "vector")
    assert "dqn_ops: DQN_OPS_DENSE_STORES: expected direct or staged, got 'vector'" in err, err[-2000:]

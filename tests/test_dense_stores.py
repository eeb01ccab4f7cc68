"""The dense layer kernel's two ways of storing a hidden layer's outputs and an input gradient,
through shared memory in 16-byte stores or from the fragments (csrc/cuda/dense_layer.cu,
DQN_OPS_DENSE_STORES=hidden|all|direct: the hidden layers' staged, both kinds' or neither's), give
the same bits, under every tile shape, for the forward and the backward of networks with row and
tile tails and of IQN (its phi layer's scaled output z); the profiler's kernel names say that every
hidden layer and every input gradient ran the kernel with the forced tile and the setting's store
path. Each setting is read once per process: a subprocess each, the tile forced by
DQN_OPS_DENSE_TILE set before the first launch. (The networks' widths are stored as multiples of 8,
so every launch here has rows of whole 16-byte chunks, which the staged path needs.)"""
import re
import textwrap

import pytest

from conftest import assert_same_bits, first_forward_error, requires_cuda, saved_with_env

ENV = "DQN_OPS_DENSE_STORES"
# Whether a setting stages the hidden layers' stores, and the input gradients'.
SETTINGS = {"direct": (False, False), "hidden": (True, False), "all": (True, True)}
TILES = ("128x128", "64x64", "32x64")

RUN = textwrap.dedent("""
    import os, sys, torch
    os.environ["DQN_OPS_DENSE_TILE"] = sys.argv[2]  # read at the kernel's first launch
    sys.path.insert(0, "tests")
    from dqn_ops import DQNConfig, dense_kernel, ops
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
        gq = torch.randn(B, c.q_rows, 7 if c.iqn else c.atoms, generator=g).cuda()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s, tau)
            grad, gs = ops.mixed_backward(gq, None, fwd, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                          "bf16", need_grad_states=True)
            torch.cuda.synchronize()
        kernels |= {e.name for e in prof.events() if "dense_layer_kernel" in e.name}
        out[name] = [t.cpu() for t in fwd.activations] + [fwd.head_logits.cpu(), grad.cpu(), gs.cpu()]
    torch.save(dict(out=out, kernels=sorted(kernels)), sys.argv[1])
""")
# A dense launch's tile rows, epilogue (0: a hidden layer, 1: logits, 2: an input gradient) and
# store path, by the kernel's name.
KERNEL = re.compile(r"dense_layer_kernel<(\d+), \d+, \d+, \d+, \(dqn_ops::cuda::DenseEpilogue\)(\d), (true|false)>")


def staged_launches(kernels):
    """(epilogue, tile rows, staged) of every hidden-layer and input-gradient launch among the
    kernel names."""
    found = [KERNEL.search(k) for k in kernels]
    assert all(found), kernels
    return {(int(m.group(2)), int(m.group(1)), m.group(3) == "true") for m in found if m.group(2) != "1"}


@requires_cuda
@pytest.mark.parametrize("tile", TILES)
def test_every_store_setting_gives_the_same_bits(tmp_path, tile):
    runs = {setting: saved_with_env(RUN, ENV, setting, str(tmp_path / f"{setting}.pt"), tile) for setting in SETTINGS}
    rows = int(tile.split("x")[0])
    for setting, (hidden, grad) in SETTINGS.items():
        kernels = runs[setting]["kernels"]
        assert staged_launches(kernels) == {(0, rows, hidden), (2, rows, grad)}, (setting, kernels)
    assert runs["direct"]["out"].keys() == {"shape", "deep_heads", "iqn"}
    for setting in ("hidden", "all"):
        assert_same_bits(runs["direct"]["out"], runs[setting]["out"], (tile, setting))


@requires_cuda
def test_a_bad_store_setting_is_refused_by_name():
    err = first_forward_error(ENV, "vector")
    assert "dqn_ops: DQN_OPS_DENSE_STORES: expected direct, hidden or all, got 'vector'" in err, err[-2000:]

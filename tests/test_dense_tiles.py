"""The dense layer kernel's tile shapes forced by DQN_OPS_DENSE_TILE (csrc/cuda/dense_layer.cu,
pick_tile; the switch of scripts/bench_dense_tiles.py): each shape runs every launch and gives
the same bits as the others, for the forward and the backward with the kernel on every layer it
can run; and the narrow tile that mode auto's rule gives an output layer of narrow heads, with
the square tiles' bits. Read once per process: a subprocess each."""
import textwrap

import pytest
import torch

from conftest import assert_same_bits, first_forward_error, requires_cuda, saved_with_env

ENV = "DQN_OPS_DENSE_TILE"
SHAPES = ("128x128", "64x64", "32x64")

# test_dense_layer.py's SHAPE (tails in every tile dimension) and DEEP_HEADS (a problem of batch
# 2), at rows that are no multiple of any tile; every dense launch's tile as the profiler names it.
RUN = textwrap.dedent("""
    import re, sys, torch
    sys.path.insert(0, "tests")
    from dqn_ops import dense_kernel, ops
    from test_dense_layer import DEEP_HEADS, SHAPE
    from test_network_shapes import make_net
    dense_kernel.set_mode("on")
    out, tiles = {}, set()
    for name, c in (("shape", SHAPE), ("deep_heads", DEEP_HEADS)):
        g = torch.Generator().manual_seed(0)
        net = make_net(c, "cuda", seed=5)
        B = 1000
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        gq = torch.randn(B, c.q_rows, c.atoms, generator=g).cuda()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s)
            grad, gs = ops.mixed_backward(gq, None, fwd, net.flat_params.detach(), net.params_bf16, net._layout_ints,
                                          "bf16", need_grad_states=True)
            torch.cuda.synchronize()
        tiles |= {m.group(1) for e in prof.events() for m in [re.search(r"dense_layer_kernel<(\\d+, \\d+),", e.name)]
                  if m}
        out[name] = [t.cpu() for t in fwd.activations] + [fwd.head_logits.cpu(), grad.cpu(), gs.cpu()]
    torch.save(dict(out=out, tiles=sorted(tiles)), sys.argv[1])
""")


@requires_cuda
def test_every_forced_tile_runs_every_launch_and_gives_the_same_bits(tmp_path):
    results = {s: saved_with_env(RUN, ENV, s, str(tmp_path / f"{s}.pt")) for s in SHAPES}
    for s, r in results.items():
        assert r["tiles"] == [s.replace("x", ", ")], (s, r["tiles"])
    for s in SHAPES[1:]:
        assert_same_bits(results[SHAPES[0]]["out"], results[s]["out"], s)


@requires_cuda
def test_a_bad_tile_is_refused_by_name():
    err = first_forward_error(ENV, "256x256")
    assert "dqn_ops: DQN_OPS_DENSE_TILE: expected auto, 128x128, 64x64 or 32x64, got '256x256'" in err, err[-2000:]


# Heads of one atom, each at most 16 columns wide once padded: an MSE network of three unequal
# branches (four head problems) and an IQN network (fraction rows), at rows past kLogitsMaxRows
# whose grid of narrow tiles covers the SMs. sys.argv[2]: the dense kernel's mode; sys.argv[3]:
# DQN_OPS_NARROW_LOGITS.
NARROW_RUN = textwrap.dedent("""
    import os, re, sys, torch
    os.environ["DQN_OPS_NARROW_LOGITS"] = sys.argv[3]  # read at the kernel's first launch
    sys.path.insert(0, "tests")
    from dqn_ops import DQNConfig, dense_kernel
    from test_network_shapes import make_net
    dense_kernel.set_mode(sys.argv[2])
    mse = DQNConfig(state_dim=40, trunk_hidden=(130, 64), value_hidden=24, adv_hidden=16, atoms=1, branches=(2, 3, 5))
    iqn = DQNConfig(state_dim=40, trunk_hidden=(130, 64), value_hidden=24, adv_hidden=16, atoms=1, branches=(2, 3),
                    iqn_embedding=64)
    out, tiles = {}, {}
    for name, c, B, fractions in (("mse", mse, 9000, 0), ("iqn", iqn, 700, 13)):
        g = torch.Generator().manual_seed(0)
        net = make_net(c, "cuda", seed=5)
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, fractions, generator=g).cuda() if fractions else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd = net.forward_full(s, tau)
            torch.cuda.synchronize()
        tiles[name] = sorted({m.group(1) for e in prof.events()
                              for m in [re.search(r"dense_layer_kernel<(\\d+, \\d+),", e.name)] if m})
        out[name] = [fwd.head_logits.cpu(), fwd.q_logits.cpu()]
    torch.save(dict(out=out, tiles=tiles), sys.argv[1])
""")


@requires_cuda
def test_narrow_heads_take_the_narrow_tile_with_the_other_tiles_bits(tmp_path):
    """Under mode auto with DQN_OPS_NARROW_LOGITS=1 the output layer of heads at most 16 columns
    wide runs the 128 x 16 tile (pick_tile), at rows where it ran cuBLAS's GEMMs before (as it
    still does under =0); its logits and q are the same bits as every launch forced to the 128 x
    128 tile gives (the same layers on the kernel: mode auto both), and equal to cuBLAS's output
    layer (=0, every other layer the same) to F32 rounding (another summation order)."""
    narrow = saved_with_env(NARROW_RUN, ENV, "auto", str(tmp_path / "narrow.pt"), "auto", "1")
    if not any(narrow["tiles"].values()):
        pytest.skip("the profiler recorded no kernels here")
    for name, tiles in narrow["tiles"].items():
        assert "128, 16" in tiles, (name, tiles)
    without = saved_with_env(NARROW_RUN, ENV, "auto", str(tmp_path / "without.pt"), "auto", "0")
    for name, tiles in without["tiles"].items():
        assert "128, 16" not in tiles, (name, tiles)
    square = saved_with_env(NARROW_RUN, ENV, "128x128", str(tmp_path / "square.pt"), "auto", "1")
    for name, tiles in square["tiles"].items():
        assert tiles == ["128, 128"], (name, tiles)
    assert_same_bits(narrow["out"], square["out"], "narrow vs 128 x 128")
    for name, tensors in narrow["out"].items():
        for got, want in zip(tensors, without["out"][name]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                       msg=lambda m: f"{name}: {m}")


@requires_cuda
def test_a_bad_narrow_logits_setting_is_refused_by_name():
    err = first_forward_error("DQN_OPS_NARROW_LOGITS", "yes")
    assert "dqn_ops: DQN_OPS_NARROW_LOGITS: expected 0 or 1, got 'yes'" in err, err[-2000:]

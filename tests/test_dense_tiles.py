"""The dense layer kernel's tile shapes forced by DQN_OPS_DENSE_TILE (csrc/cuda/dense_layer.cu,
pick_tile; the switch of scripts/bench_dense_tiles.py): each shape runs every launch and gives
the same bits as the others, for the forward and the backward with the kernel on every layer it
can run. Read once per process: a subprocess each."""
import textwrap

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

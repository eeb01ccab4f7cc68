"""The bias gradients' column sums begun where the gradient is formed
(DQN_OPS_EPILOGUE_COLUMN_SUMS=off|auto|on, csrc/cuda/mixed_backward.cu epilogue_column_sums;
dense_layer.h col_sums): a bf16 backward's masked input gradients (each hidden layer's dZ) keep
their F32 values' column sums by halves of each row tile of the dense kernel, IQN's phi gradient
dP its sums by sample from iqn_backward_kernel; the column-sum kernel finishes them, and the F32
gradient itself is not stored. Against the path that stores it (off), under every tile shape,
for networks with row and tile tails and for IQN: every weight gradient and the states' gradient
the same bits (the BF16 copy they are computed from is the same), every bias gradient equal to
rounding (another summation order), the same bits run to run, and the profiler shows the
column-sum kernel's extra launches for the partial sums' row counts. "auto" takes the path from
32,768 rows alone. Each setting is read once per process: a subprocess each."""
import textwrap

import pytest
import torch

from conftest import assert_same_bits, python_with_env, requires_cuda, saved_with_env

ENV = "DQN_OPS_EPILOGUE_COLUMN_SUMS"
TILES = ("128x128", "64x64", "32x64")

RUN = textwrap.dedent("""
    import os, sys, torch
    os.environ["DQN_OPS_DENSE_TILE"] = sys.argv[2]  # read at the kernel's first launch
    os.environ["DQN_OPS_DENSE_STORES"] = "all"  # the sums read the staged tile
    fractions = int(sys.argv[3])
    sys.path.insert(0, "tests")
    from dqn_ops import DQNConfig, dense_kernel, ops
    from test_dense_layer import DEEP_HEADS, SHAPE
    from test_network_shapes import make_net
    dense_kernel.set_mode("on")
    iqn = DQNConfig(state_dim=40, trunk_hidden=(130, 100), value_hidden=24, adv_hidden=16, atoms=1, branches=(2, 3),
                    iqn_embedding=64)
    out, launches = {}, {}
    for name, c in (("shape", SHAPE), ("deep_heads", DEEP_HEADS), ("iqn", iqn)):
        g = torch.Generator().manual_seed(0)
        net = make_net(c, "cuda", seed=5)
        B = 1000
        s = torch.randn(B, c.state_dim, generator=g).cuda()
        tau = torch.rand(B, fractions, generator=g).cuda() if c.iqn else None
        gq = torch.randn(B, c.q_rows, fractions if c.iqn else c.atoms, generator=g).cuda()
        runs = []
        for run in range(2):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fwd = net.forward_full(s, tau)
                grad, gs = ops.mixed_backward(gq, None, fwd, net.flat_params.detach(), net.params_bf16,
                                              net._layout_ints, "bf16", need_grad_states=True)
                torch.cuda.synchronize()
            runs.append([grad.cpu(), gs.cpu()])
        launches[name] = sum(1 for e in prof.events() if "column_sum_kernel(" in e.name)
        views = net.layer_views(runs[0][0])
        out[name] = dict(runs=runs, weights={k: v for k, v in views.items() if v.dim() == 2},
                         biases={k: v for k, v in views.items() if v.dim() == 1})
    torch.save(dict(out=out, launches=launches), sys.argv[1])
""")


def compare(off, other, what, extra_launches):
    """`other`'s gradients against `off`'s, network by network: weights and the states' gradient
    the same bits, every gradient finite and the same bits run to run; where the network's
    backward took the epilogue's sums, the biases to rounding and the column-sum kernel's extra
    launches for the partial sums' row counts (`extra_launches`), else every bit and the same
    launches."""
    assert off["out"].keys() == other["out"].keys() == extra_launches.keys() == {"shape", "deep_heads", "iqn"}
    if not any(off["launches"].values()):
        pytest.skip("the profiler recorded no kernels here")
    for name, o in other["out"].items():
        ref = off["out"][name]
        assert_same_bits({name: o["runs"][0]}, {name: o["runs"][1]}, (what, "run to run"))
        assert_same_bits({name: o["runs"][0][1:]}, {name: ref["runs"][0][1:]}, (what, "the states' gradient"))
        by_layer = lambda views: {k: [v] for k, v in views.items()}  # noqa: E731
        assert_same_bits(by_layer(o["weights"]), by_layer(ref["weights"]), (what, name))
        if extra_launches[name]:
            for k, b in o["biases"].items():
                want = ref["biases"][k]
                torch.testing.assert_close(b, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()),
                                           msg=lambda m: f"{what} {name} {k}: {m}")
        else:
            assert_same_bits(by_layer(o["biases"]), by_layer(ref["biases"]), (what, name))
        extra = other["launches"][name] - off["launches"][name]
        assert extra == extra_launches[name], (what, name, other["launches"], off["launches"])


@requires_cuda
@pytest.mark.parametrize("tile", TILES)
def test_the_epilogue_column_sums_give_the_stored_gradients_sums(tmp_path, tile):
    off, on = (saved_with_env(RUN, ENV, setting, str(tmp_path / f"{setting}.pt"), tile, "7")
               for setting in ("off", "on"))
    # The layouts store every hidden width as a multiple of 8, so each hidden layer's masked dX
    # runs the dense kernel's staged path. The 1000-row networks' masked dZs all take the sums,
    # which share a row count: one launch more. IQN's heads (7000 fraction rows) and its first
    # trunk layer (1000) give two row counts of tile sums; its dP's sums by sample have the
    # samples' 1000 rows, as its second trunk layer's dZ (stored whole: iqn_backward_kernel's dh,
    # then relu_backward) has, so they share that launch: two more.
    compare(off, on, (tile, "on"), dict(shape=1, deep_heads=1, iqn=2))


@requires_cuda
def test_auto_takes_the_epilogue_column_sums_from_32768_rows(tmp_path):
    """IQN's heads and dP at 1000 x 40 = 40,000 fraction rows take the sums under "auto" (the
    heads' tile sums a launch of their own, dP's by-sample sums in the 1000-row launch); at 1000 x
    7 = 7,000, and every network's 1000-row layers, do not (every bit off's). The variable unset
    is "auto": the same bits."""
    for fractions in ("40", "7"):
        off, auto, unset = (saved_with_env(RUN, ENV, setting, str(tmp_path / f"{setting}-{fractions}.pt"), "auto",
                                           fractions) for setting in ("off", "auto", None))
        compare(off, auto, ("auto", fractions), dict(shape=0, deep_heads=0, iqn=1 if fractions == "40" else 0))
        assert_same_bits({k: v["runs"][0] for k, v in unset["out"].items()},
                         {k: v["runs"][0] for k, v in auto["out"].items()}, ("unset", fractions))


@requires_cuda
def test_a_bad_column_sums_setting_is_refused_by_name():
    code = textwrap.dedent("""
        import torch
        from dqn_ops import DQNConfig, DuelingBranchQNet, ops
        c = DQNConfig()
        net = DuelingBranchQNet(c).to("cuda")
        fwd = net.forward_full(torch.randn(4, c.state_dim, device="cuda"))
        gq = torch.randn(4, c.q_rows, c.atoms, device="cuda")
        ops.mixed_backward(gq, None, fwd, net.flat_params.detach(), net.params_bf16, net._layout_ints, "bf16")
        torch.cuda.synchronize()
    """)
    r = python_with_env(code, ENV, "sometimes", timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "DQN_OPS_EPILOGUE_COLUMN_SUMS: expected off, auto or on, got 'sometimes'" in r.stderr, r.stderr[-2000:]

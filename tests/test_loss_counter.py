"""The loss kernel's block counter under CUDA graphs (csrc/cuda/loss.cu, captured_counter): a
captured launch owns a counter that the kernel resets itself, with no memset in the graph, so
every replay must find it at 0 again, and no two launches that can run at the same time may
share one. Each case compares replays with eager calls (which zero their own counter): the
same bits, and no replay that skipped writing the loss (outputs are poisoned before each)."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dqn_ops
from conftest import requires_cuda
from dqn_ops import dqn_loss
from test_loss import sample_batch

BRANCHES = (3, 3, 3)


def _loss(args, loss_type="c51"):
    q, qo, qt, actions, rewards, dones, weights = args
    return dqn_loss(q, qo, qt, actions, rewards, dones, BRANCHES, weights=weights, loss_type=loss_type)


def _batch(B, atoms=51, seed=0):
    return sample_batch(B, BRANCHES, atoms, "cuda", seed=seed)


def _poison(out):
    for t in out:
        t.fill_(math.nan)


def _assert_same(replayed, eager, what):
    for x, y in zip(replayed, eager):
        assert torch.equal(x, y), what


def _warm_up(*fns):
    """Eager calls on a side stream before a capture (the counters' symbol is resolved eagerly)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)


@requires_cuda
@pytest.mark.parametrize("B", [3, 1000, 20000])  # one block; several; more than are resident at once
@pytest.mark.parametrize("loss_type", ["c51", "mse"])
def test_many_replays_equal_eager_calls(B, loss_type):
    args = _batch(B, 51 if loss_type == "c51" else 1)
    _warm_up(lambda: _loss(args, loss_type))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = _loss(args, loss_type)
    for i in range(20):
        args[0].normal_()
        args[4].uniform_(-12, 12)
        _poison(static)
        g.replay()
        _assert_same(static, _loss(args, loss_type), f"replay {i}")


@requires_cuda
def test_two_graphs_replayed_side_by_side_on_two_streams():
    a, b = _batch(4000, seed=1), _batch(3000, seed=2)
    _warm_up(lambda: _loss(a), lambda: _loss(b))
    want_a, want_b = _loss(a), _loss(b)
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga):
        static_a = _loss(a)
    with torch.cuda.graph(gb):
        static_b = _loss(b)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    got = ([], [])
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(30):  # no synchronisation between the two streams: the replays overlap
        for s, g, static, out in zip(streams, (ga, gb), (static_a, static_b), got):
            with torch.cuda.stream(s):
                _poison(static)
                g.replay()
                out.append([t.clone() for t in static])
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for i, (x, y) in enumerate(zip(*got)):
        _assert_same(x, want_a, f"graph a, replay {i}")
        _assert_same(y, want_b, f"graph b, replay {i}")


@requires_cuda
def test_two_losses_on_two_streams_in_one_graph():
    a, b = _batch(4000, seed=3), _batch(2000, seed=4)
    _warm_up(lambda: _loss(a), lambda: _loss(b))
    want_a, want_b = _loss(a), _loss(b)
    g, fork = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(g):
        fork.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(fork):
            static_b = _loss(b)
        static_a = _loss(a)
        torch.cuda.current_stream().wait_stream(fork)
    for i in range(20):
        _poison(static_a)
        _poison(static_b)
        g.replay()
        _assert_same(static_a, want_a, f"main stream, replay {i}")
        _assert_same(static_b, want_b, f"forked stream, replay {i}")


def _dump(g, tmp_path, name):
    path = tmp_path / name
    g.debug_dump(str(path))
    assert path.exists(), "CUDAGraph.debug_dump wrote no file"
    return path.read_text()


@requires_cuda
def test_a_captured_loss_has_no_memset_node(tmp_path):
    pytest.importorskip("cuda.bindings", reason="CUDAGraph.debug_dump needs the cuda-bindings package")
    args = _batch(1000, seed=6)
    _warm_up(lambda: _loss(args))
    g = torch.cuda.CUDAGraph(keep_graph=True)  # kept for debug_dump (test_side_stream.py says why)
    g.enable_debug_mode()
    with torch.cuda.graph(g):
        _loss(args)
    dot = _dump(g, tmp_path, "loss.dot")
    assert "KERNEL" in dot and "MEMSET" not in dot, dot


# Run in a process of its own: it takes every counter of the process it runs in (or, "recycle",
# more than there are, over graphs it destroys).
_SCRIPT = textwrap.dedent("""
    import math, sys, time
    import torch
    from dqn_ops import dqn_loss
    mode, dump = sys.argv[1], sys.argv[2]
    g0 = torch.Generator().manual_seed(0)
    q, qo, qt = (torch.randn(8, 9, 51, generator=g0).cuda() for _ in range(3))
    actions = torch.randint(0, 3, (8, 3), generator=g0).cuda()
    rewards, dones, weights = torch.randn(8).cuda(), torch.zeros(8).cuda(), torch.ones(8).cuda()
    run = lambda: dqn_loss(q, qo, qt, actions, rewards, dones, (3, 3, 3), weights=weights)
    want = run()  # eager: resolves the counters
    torch.cuda.synchronize()
    def capture(n, keep=False):
        g = torch.cuda.CUDAGraph(keep_graph=keep)
        if keep and dump:
            g.enable_debug_mode()
        with torch.cuda.graph(g):
            outs = [run() for _ in range(n)]
        return g, outs
    def check(g, outs):
        for _ in range(2):
            for out in outs:
                for t in out:
                    t.fill_(math.nan)
            g.replay()
            for i, out in enumerate(outs):
                assert all(torch.equal(x, y) for x, y in zip(out, want)), i
    if mode == "exhaust":
        kept = capture(4200)  # past kCapturedCounters (4096): the last launches zero their own
        check(*kept)
    else:
        for _ in range(4):  # 6000 counters in all, each graph destroyed before the next
            g, outs = capture(1500)
            check(g, outs)
            del g, outs
            torch.cuda.synchronize()
        time.sleep(1)  # CUDA's destructor thread gives the counters back
    g, outs = capture(1, keep=True)
    if dump:
        g.debug_dump(dump)
    check(g, outs)
    print("ok")
""")


def _run_script(mode, tmp_path):
    """The script's graph dump of one more captured loss after `mode` (None without
    cuda-bindings)."""
    try:
        import cuda.bindings  # noqa: F401
        dump = str(tmp_path / f"{mode}.dot")
    except ImportError:
        dump = ""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(dqn_ops.__file__)))  # where this process found dqn_ops
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-c", _SCRIPT, mode, dump], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    return open(dump).read() if dump else None


@requires_cuda
def test_captures_past_the_last_counter_fall_back_to_the_memset(tmp_path):
    # More captured launches alive than the extension has counters: the later ones zero a
    # counter of their own in the graph (a memset node, which the dump shows: the control of
    # test_a_captured_loss_has_no_memset_node); every launch stays right.
    dot = _run_script("exhaust", tmp_path)
    assert dot is None or "MEMSET" in dot


@requires_cuda
def test_a_destroyed_graph_gives_its_counters_back(tmp_path):
    # More captured launches over a process's life than there are counters, in graphs destroyed
    # one after another: a later capture still gets a counter (no memset node).
    dot = _run_script("recycle", tmp_path)
    assert dot is None or "MEMSET" not in dot

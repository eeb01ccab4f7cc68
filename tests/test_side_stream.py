"""Side streams (dqn_ops.side_stream, csrc/side_streams.h, csrc/cuda/side_stream.h): the switch and
its environment variable, Branch and its lanes, and the claim that the side streams change where
work runs, not what it computes: the ops, the steps and the graphed trainer give the same bits
with the switch on and off, and a captured graph is one chain with it off and forks and joins
with it on."""
import contextlib
import re

import pytest
import torch

import dqn_ops
from conftest import behind_a_sleep, requires_cuda, switch_at_first_use
from dqn_ops import DQNConfig, Trainer, TrainerConfig, _C, dense_kernel, ops, side_stream
from dqn_ops.side_stream import LANE_GROUPS, LANE_STEP, Branch, group_lane
from dqn_ops.step import GroupsStep, PublicOpsStep
from poison import poison_cuda_cache
from reference import SHAPES
from test_ensemble_network import CUDA_CASES
from test_fused_step import _net
from test_groups_ops import on, trainer_batch
from test_groups_reference import LOSS_TYPES, NETS
from test_iqn_trainer import TINY_IQN
from test_iqn_trainer import batch as iqn_batch
from test_trainer import TINY_C51

ENV = "DQN_OPS_SIDE_STREAM"


@pytest.fixture(autouse=True)
def _restore_switch():
    # the switch is process-wide: a test that leaves it on would run every later test with it
    before = side_stream.enabled()
    yield
    side_stream.set_enabled(before)


# ----------------------------------------------------------------------------------------
# The switch, Branch and the lanes (CPU)

def test_set_enabled_returns_the_previous_setting_and_the_hooks_agree():
    start = side_stream.enabled()
    assert side_stream.set_enabled(False) is start
    assert side_stream.enabled() is False and _C._side_streams_enabled() is False
    assert side_stream.set_enabled(True) is False
    assert side_stream.enabled() is True and _C._side_streams_enabled() is True
    assert side_stream.set_enabled(True) is True
    assert _C._set_side_streams(False) is True
    assert side_stream.enabled() is False


@pytest.mark.parametrize("value,want", [(None, True), ("0", False), ("1", True), ("yes", None)],
                         ids=["unset", "0", "1", "yes"])
def test_the_environment_variable_sets_the_switch_at_its_first_use(value, want):
    lines = switch_at_first_use(ENV, value, "side_stream", "side_stream.enabled, side_stream.enabled, "
                                "lambda: side_stream.set_enabled(True), side_stream.enabled")
    if want is None:  # every use raises again: the setting never initialises from a bad value
        assert len(lines) == 4, lines
        for line in lines:
            assert line.startswith("RuntimeError: ") and ENV in line and "'yes'" in line, line
    else:
        assert lines == [repr(want), repr(want), repr(want), "True"]


@pytest.mark.parametrize("switch", [False, True], ids=["off", "on"])
def test_a_branch_off_cuda_runs_its_body_in_place_and_the_lanes_are_checked(switch):
    side_stream.set_enabled(switch)
    ran = []
    branch = Branch("cpu", LANE_STEP)
    assert branch.active is False
    with branch:
        ran.append(True)
    branch.join()
    branch.join()
    assert ran == [True]
    for lane in (0, -1, 1.5, "1", None, True):
        with pytest.raises(ValueError, match=r"^Branch: lane must be an int >= 1"):
            Branch("cpu", lane)
    assert group_lane(1) == LANE_GROUPS and group_lane(3) == LANE_GROUPS + 2
    assert LANE_STEP >= 1 and LANE_STEP not in (group_lane(1), group_lane(2), group_lane(3))
    for g in (0, -1):
        with pytest.raises(ValueError, match=r"^group_lane: group must be an int >= 1"):
            group_lane(g)


def test_a_branch_is_inactive_in_a_build_without_the_cuda_kernels():
    """There the ops refuse CUDA tensors with their own error; a Branch must not fail first
    asking the C++ registry for a stream it cannot make."""
    if dqn_ops.cuda_kernels_built():
        pytest.skip("this build has its CUDA kernels: there a Branch on a CUDA device forks")
    previous = side_stream.set_enabled(True)
    try:
        branch = Branch("cuda", LANE_STEP)
        with branch:
            pass
        branch.join()
        assert not branch.active
    finally:
        side_stream.set_enabled(previous)


def test_the_side_stream_hook_refuses_lane_0_and_needs_the_cuda_kernels():
    for lane in (0, -1):
        with pytest.raises(ValueError, match=r"lane must be >= 1"):
            _C._side_stream(0, 0, lane)
    if dqn_ops.cuda_kernels_built():
        pytest.skip("this build has its CUDA kernels: there _side_stream makes a stream")
    with pytest.raises(RuntimeError, match=r"built without its CUDA kernels"):
        _C._side_stream(0, 0, 1)


# ----------------------------------------------------------------------------------------
# Same bits with the switch on and off

def _tensors(x):
    """Copies of every tensor in a nested result (tuples, lists, NamedTuples), made on the current
    stream at once: a branch not joined before the op returned would be read before it ran."""
    if isinstance(x, torch.Tensor):
        return [x.detach().clone()]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _assert_same_bits(off, on_, what=""):
    """Equal bits (NaN payloads and the sign of 0 included), output by output."""
    assert len(off) == len(on_) > 0
    for i, (a, b) in enumerate(zip(off, on_)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype, a.shape, b.shape)
        ia, ib = (t.view(_BITS[t.dtype]) if t.dtype in _BITS else t for t in (a, b))
        assert torch.equal(ia, ib), f"{what} output {i}: {(ia != ib).sum().item()} of {a.numel()} elements differ"


def _off_then_on(run):
    """run()'s outputs with the switch off, then on, each on a NaN-poisoned cache (an element a
    branch left unwritten shows)."""
    outs = []
    for switch in (False, True):
        side_stream.set_enabled(switch)
        poison_cuda_cache()
        outs.append(_tensors(run()))
    return outs


def _train(c, switch, device, B, steps, **config):
    """A Trainer built and stepped with the switch set from the start (a graph keeps the streams
    in force at its capture): whether it graphed, its metrics, its read-back rows and its state."""
    side_stream.set_enabled(switch)
    t = Trainer(c, TrainerConfig(batch_size=B, readback_interval=4, **config), device=device, seed=5)
    td = []
    for i in range(steps):
        t.step(on(device, trainer_batch(c, B, 40 + i)))
        td.append(t.td_error.detach().clone())
    metrics = t.readback()
    opt = t.optimizer.state[t.online.flat_params]
    state = [t.online.flat_params, t.online.params_bf16, t.target.flat_params, t.target.params_bf16,
             opt["exp_avg"], opt["exp_avg_sq"], opt["step"], t.fraction_rng, *td]
    if t.spectral is not None:
        state.append(t.spectral.u)
    return t.graphed, metrics, [dict(r) for r in t.stats.rows], [x.detach().clone() for x in state]


def _assert_same_training(c, device, B, steps, **config):
    off, on_ = (_train(c, switch, device, B, steps, **config) for switch in (False, True))
    assert off[0] == on_[0] == (device == "cuda")
    assert off[1] == on_[1] and off[1]["steps"] == steps
    assert off[2] == on_[2] and len(off[2]) == steps
    _assert_same_bits(off[3], on_[3], "trainer state")


# network, trainer settings: the internal ops' step, IQN's public-ops step, the head groups' step
TRAINERS = {"c51": (TINY_C51, {}), "iqn": (TINY_IQN, dict(iqn_fractions=8)),
            "seed": (NETS["seed"], dict(iqn_fractions=3, bootstrap_p=0.5))}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_cpu_trainer_steps_are_the_same_with_the_switch_on(name):
    """The CPU path ignores the switch: a guard that the branches' wiring left the step alone."""
    c, config = TRAINERS[name]
    _assert_same_training(c, "cpu", 16, 3, **config)


# ----------------------------------------------------------------------------------------
# CUDA

@requires_cuda
def test_a_branch_on_cuda_has_a_stream_per_current_stream_and_lane():
    side_stream.set_enabled(True)
    main = torch.cuda.current_stream()

    def side_of(lane):
        branch = Branch("cuda", lane)
        try:
            with branch:
                return branch.active, torch.cuda.current_stream().cuda_stream
        finally:
            branch.join()
            branch.join()

    active, s1 = side_of(LANE_STEP)
    assert active and s1 != main.cuda_stream
    assert torch.cuda.current_stream() == main  # the body's stream is current only inside it
    assert side_of(LANE_STEP)[1] == s1 == _C._side_stream(torch.cuda.current_device(), main.cuda_stream, LANE_STEP)
    lanes = {side_of(lane)[1] for lane in (LANE_STEP, group_lane(1), group_lane(2))}
    assert len(lanes) == 3 and main.cuda_stream not in lanes
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        s_other = side_of(LANE_STEP)[1]
    assert s_other not in (s1, other.cuda_stream, main.cuda_stream)
    side_stream.set_enabled(False)
    branch = Branch("cuda", LANE_STEP)
    with branch:
        assert torch.cuda.current_stream() == main
    branch.join()
    assert not branch.active


@requires_cuda
def test_a_branch_forks_after_and_joins_before_the_current_streams_work():
    side_stream.set_enabled(True)
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.zeros_like(x)

    def fork_copy_join(sleep):
        branch = Branch(x.device, LANE_STEP)
        try:
            with branch, sleep():
                y.copy_(x).add_(1)  # behind a sleep on the side stream: the read below must wait for it
        finally:
            branch.join()

    fork_copy_join(contextlib.nullcontext)  # the lane's first fork makes its stream and events: longer than a sleep
    torch.cuda.synchronize()
    x.zero_()
    y.zero_()
    with behind_a_sleep():
        x.fill_(1)  # behind a sleep: a branch that did not wait for it copies the zeros
        fork_copy_join(behind_a_sleep)
    assert torch.equal(y.clone(), torch.full_like(x, 2))


NETWORKS = {"reference": DQNConfig(), "no_dueling": SHAPES["head0_no_dueling"], "trunk3": SHAPES["trunk3_head2"],
            "ensemble": CUDA_CASES["e5_51atoms"], "iqn": TINY_IQN}


def _backward_run(c, B, precision):
    """run(): a network's forward at fresh states (and fractions, IQN) and the backward of a
    random grad_q, without and with d(states)."""
    net = _net(c, 1, "cuda")
    p, p_bf16, layout = net.flat_params.detach(), net.params_bf16, net._layout_ints
    states = torch.randn(B, c.state_dim, device="cuda")
    fractions = torch.rand(B, 16, device="cuda") if c.iqn else None
    forward = lambda: ops.bf16_dueling_forward(states, p, p_bf16, layout, precision, fractions)  # noqa: E731
    grad_q = torch.randn_like(forward().q_logits)

    def run():  # the forward just before: a fork that did not wait would read its outputs unwritten
        fwd = forward()
        return [ops.mixed_backward(grad_q, None, fwd, p, p_bf16, layout, precision, need)
                for need in (False, True)]
    return run


@requires_cuda
@pytest.mark.parametrize("name", list(NETWORKS))
@pytest.mark.parametrize("precision", ops.BACKWARD_PRECISIONS)
def test_mixed_backward_gives_the_same_bits_with_the_switch_on(name, precision):
    _assert_same_bits(*_off_then_on(_backward_run(NETWORKS[name], 300, precision)), f"{name} {precision}")


def _logits_run(c, B, batch_networks):
    online, target = _net(c, 1, "cuda"), _net(c, 2, "cuda")
    state_pairs = torch.randn(2 * B, c.state_dim, device="cuda")
    return lambda: ops._online_and_target_logits(  # noqa: E731
        state_pairs, online.flat_params.detach(), online.params_bf16, target.flat_params.detach(),
        target.params_bf16, online._layout_ints, batch_networks)


@requires_cuda
@pytest.mark.parametrize("name", ["reference", "ensemble"])
@pytest.mark.parametrize("batch_networks", [False, True], ids=["two_passes", "networks_batched"])
def test_online_and_target_logits_give_the_same_bits_with_the_switch_on(name, batch_networks):
    _assert_same_bits(*_off_then_on(_logits_run(NETWORKS[name], 300, batch_networks)), name)


@requires_cuda
@pytest.mark.parametrize("name", ["iqn", "seed"])
def test_public_and_groups_steps_give_the_same_bits_with_the_switch_on(name):
    """PublicOpsStep's target pass in a branch (IQN), GroupsStep's groups in branches of their own
    (the seed's combination: C51, IQN and an ensemble group, each group's target pass nested)."""
    c, B, N = (TINY_IQN if name == "iqn" else NETS["seed"]), 64, 8
    online, target = _net(c, 1, "cuda"), _net(c, 2, "cuda")
    b = iqn_batch(c, B, "cuda", seed=3)
    inputs = [b[k] for k in ("state_pairs", "actions", "rewards", "dones", "weights")]
    draw = lambda: (torch.rand(B, N, device="cuda"), torch.rand(B, N + 1, device="cuda"))  # noqa: E731
    if name == "iqn":
        step = PublicOpsStep(online, target, loss_type="iqn")
        extra = (None, draw())
    else:
        step = GroupsStep(online, target, loss_types=LOSS_TYPES[name])
        groups = [c.group_config(g) for g in range(c.num_groups)]
        assert any(gc.iqn for gc in groups) and any(gc.members > 1 for gc in groups)
        extra = ([(torch.rand(B, gc.members, device="cuda") < 0.5).float() if gc.members > 1 else None
                  for gc in groups], [draw() if gc.iqn else None for gc in groups])
    _assert_same_bits(*_off_then_on(lambda: step(*inputs, *extra)), name)


@requires_cuda
@pytest.mark.parametrize("name,B", [("reference", 64), ("reference", 4096), ("iqn", 64), ("seed", 64)])
def test_graphed_trainer_gives_the_same_bits_with_the_switch_on(name, B):
    """3 warm-up steps, the capture, 3 replays, each trainer from the same seed and batches."""
    c, config = (DQNConfig(), {}) if name == "reference" else TRAINERS[name]
    _assert_same_training(c, "cuda", B, 7, **config)


# -- the captured graph's shape ----------------------------------------------------------

_DOT_NODE = re.compile(r'^"([^"]+)"\s*\[', re.M)
_DOT_EDGE = re.compile(r'^"([^"]+)"(?:\s*:\s*\w+)?\s*->\s*"([^"]+)"', re.M)


def parse_dot(text):
    """{node: (successors, predecessors)} of a DOT dump of a CUDA graph (cudaGraphDebugDotPrint's
    format: a statement per node, `"graph_1_node_0"[...label="{KERNEL ...}"];`, a line per edge,
    `"graph_1_node_0" -> "graph_1_node_1" [...];`)."""
    nodes, edges = set(_DOT_NODE.findall(text)), _DOT_EDGE.findall(text)
    assert nodes and edges, "no nodes or no edges found in the dump: the format changed?"
    assert {n for e in edges for n in e} <= nodes, "an edge between nodes the dump does not declare"
    topology = {n: (set(), set()) for n in nodes}
    for a, b in edges:
        topology[a][0].add(b)
        topology[b][1].add(a)
    return topology


def _graph_cases(name):
    """run() for a graph: the public backward, _online_and_target_logits, and IQN's public-ops
    forward (the target's pass in a Python branch), each on fresh inputs."""
    B = 64
    if name == "mixed_backward":
        return _backward_run(DQNConfig(), B, "bf16")
    if name == "online_and_target_logits":  # the cuBLAS path: the dense kernel's one launch has no fork
        return _logits_run(DQNConfig(), B, False)
    step = PublicOpsStep(_net(TINY_IQN, 1, "cuda"), _net(TINY_IQN, 2, "cuda"), loss_type="iqn")
    state_pairs = torch.randn(2 * B, TINY_IQN.state_dim, device="cuda")
    fractions = (torch.rand(B, 8, device="cuda"), torch.rand(B, 8, device="cuda"))
    return lambda: step.forward(state_pairs, fractions)  # noqa: E731


@requires_cuda
@pytest.mark.parametrize("name", ["mixed_backward", "online_and_target_logits", "public_forward"])
@pytest.mark.parametrize("switch", [False, True], ids=["off", "on"])
def test_the_captured_graph_is_a_chain_off_and_forks_and_joins_on(name, switch, tmp_path):
    pytest.importorskip("cuda.bindings", reason="CUDAGraph.debug_dump needs the cuda-bindings package")
    side_stream.set_enabled(switch)  # before the capture: a graph keeps the streams in force at its capture
    # The dense kernel runs both networks' output layers in one launch, with nothing to fork; the
    # cuBLAS path forks the target's GEMMs (with the switch off, either path is a chain).
    cublas = name == "online_and_target_logits" and switch
    dense_mode = dense_kernel.set_mode("off" if cublas else dense_kernel.mode())
    try:
        _check_the_captured_graph(name, switch, tmp_path)
    finally:
        dense_kernel.set_mode(dense_mode)


def _check_the_captured_graph(name, switch, tmp_path):
    run = _graph_cases(name)
    want = _tensors(run())
    stream, marker = torch.cuda.Stream(), torch.zeros(1, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warm-up: cuBLAS's lazy state and the side streams, outside the capture
        run()
    torch.cuda.current_stream().wait_stream(stream)
    # keep_graph: the captured graph stays for debug_dump (instantiated at the first replay); a
    # graph instantiated at capture_end is freed there, and debug_dump then writes nothing
    g = torch.cuda.CUDAGraph(keep_graph=True)
    g.enable_debug_mode()
    with torch.cuda.graph(g, stream=stream):
        out = run()
        marker.add_(1)  # after the op's joins: a join shows as a node with two predecessors
    path = tmp_path / "graph.dot"
    g.debug_dump(str(path))
    assert path.exists(), "CUDAGraph.debug_dump wrote no file"
    g.replay()
    torch.cuda.synchronize()
    _assert_same_bits(want, _tensors(out), f"{name} replayed")
    topology = parse_dot(path.read_text())
    forks = [n for n, (succ, _) in topology.items() if len(succ) >= 2]
    joins = [n for n, (_, pred) in topology.items() if len(pred) >= 2]
    if switch:
        assert forks and joins, (len(forks), len(joins))
    else:
        roots = [n for n, (_, pred) in topology.items() if not pred]
        assert not forks and not joins and len(roots) == 1, (forks, joins, roots)

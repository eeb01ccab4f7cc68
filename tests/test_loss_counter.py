"""The loss kernel's caller-owned block counter (``_dqn_loss_on_logits(..., counter=)``,
csrc/cuda/loss.cu): the kernel's last block leaves it at 0, so the launch needs no memset and
the trainer's captured step has no memset node for its loss. The CUDA cases compare with calls
that zero a counter of their own: the same bits, and the counter at 0 after the calls, with
launches back to back (no host sync between them: the programmatic launch edges) and several
launches sharing one counter in one graph (as the device loop's graph does)."""
import math

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import ops
from dqn_ops.step import InternalOpsStep
from test_fused_step import V_MAX, V_MIN, GAMMA, sample_inputs


def _loss_args(case, device, B, seed=3):
    """_dqn_loss_on_logits's arguments for a case of test_fused_step (logits of its networks)."""
    s = sample_inputs(case, device, B=B, seed=seed)
    b, p, tp = s.batch, s.online.flat_params.detach(), s.target.flat_params.detach()
    f = ops._online_and_target_logits(b["state_pairs"], p, s.online.params_bf16, tp, s.target.params_bf16,
                                      s.online._layout_ints, False)
    return (f.logits[:B], f.logits[B:], f.logits_next_target, p, tp, b["actions"], b["rewards"], b["dones"],
            b["weights"], s.online._layout_ints, V_MIN, V_MAX, GAMMA, s.loss_type)


def _same(x, y, what):
    for i, (a, b) in enumerate(zip(x, y)):
        assert torch.equal(a, b), f"{what}: output {i}"


def _poison(out):
    for t in out:
        t.fill_(math.nan)


@pytest.mark.parametrize("device", DEVICES)
def test_a_counter_changes_no_result_and_is_left_at_zero(device):
    # on the CPU: the argument is taken and checked, and the CPU kernel leaves it alone
    args = _loss_args("reference", device, B=37)
    want = ops._dqn_loss_on_logits(*args)
    counter = ops.new_loss_counter(device)
    for i in range(3):
        _same(ops._dqn_loss_on_logits(*args, counter=counter), want, f"call {i}")
        assert counter.item() == 0


# the fused kernel with one block (2 samples of 3 branches fill one block of 8 warps), several,
# more than are resident at once; the composed path (more branches than the fused kernel takes,
# one atom)
@requires_cuda
@pytest.mark.parametrize("case,B", [("reference", 2), ("reference", 1000), ("reference", 20000),
                                    ("nine_branches", 1000), ("one_atom_huber", 1000)])
def test_cuda_calls_with_a_counter_equal_calls_without(case, B):
    args = _loss_args(case, "cuda", B)
    want = ops._dqn_loss_on_logits(*args)
    counter = ops.new_loss_counter("cuda")
    outs = [ops._dqn_loss_on_logits(*args, counter=counter) for _ in range(6)]  # back to back, no sync
    for i, got in enumerate(outs):
        _same(got, want, f"call {i}")
    assert counter.item() == 0


@requires_cuda
def test_graph_replays_of_losses_sharing_a_counter_equal_eager_calls():
    args = list(_loss_args("reference", "cuda", B=2000))
    counter = ops.new_loss_counter("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before the capture
        ops._dqn_loss_on_logits(*args, counter=counter)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # three launches in a row on one counter, as a graph of several steps has
        static = [ops._dqn_loss_on_logits(*args, counter=counter) for _ in range(3)]
    for i in range(20):
        args[0].normal_()  # fresh logits for the same captured addresses
        args[6].uniform_(-12, 12)
        for out in static:
            _poison(out)
        g.replay()
        want = ops._dqn_loss_on_logits(*args)
        for k, out in enumerate(static):
            _same(out, want, f"replay {i}, launch {k}")
        assert counter.item() == 0


def _captured_dot(tmp_path, name, fn):
    """The DOT dump of a CUDA graph capturing fn() (after an eager warm-up call)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)  # kept for debug_dump (test_side_stream.py says why)
    g.enable_debug_mode()
    with torch.cuda.graph(g):
        fn()
    path = tmp_path / f"{name}.dot"
    g.debug_dump(str(path))
    return path.read_text()


@requires_cuda
@pytest.mark.parametrize("case", ["reference", "nine_branches"])  # the fused kernel; the composed path
def test_a_captured_loss_with_a_counter_has_no_memset_node(case, tmp_path):
    pytest.importorskip("cuda.bindings", reason="CUDAGraph.debug_dump needs the cuda-bindings package")
    args = _loss_args(case, "cuda", B=1000)
    counter = ops.new_loss_counter("cuda")
    with_counter = _captured_dot(tmp_path, "with", lambda: ops._dqn_loss_on_logits(*args, counter=counter))
    without = _captured_dot(tmp_path, "without", lambda: ops._dqn_loss_on_logits(*args))  # the control
    assert "KERNEL" in with_counter and "MEMSET" not in with_counter, with_counter
    assert "MEMSET" in without, without


@requires_cuda
def test_the_trainers_loss_stage_has_no_memset_node(tmp_path):
    """InternalOpsStep (the trainer's step) passes its own counter, made when the step is."""
    pytest.importorskip("cuda.bindings", reason="CUDAGraph.debug_dump needs the cuda-bindings package")
    s = sample_inputs("reference", "cuda", B=64)
    step = InternalOpsStep(s.online, s.target, loss_type=s.loss_type, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA)
    fwd = step.forward(s.batch["state_pairs"])
    b = s.batch
    dot = _captured_dot(tmp_path, "step", lambda: step.loss(fwd, b["actions"], b["rewards"], b["dones"], b["weights"]))
    assert "KERNEL" in dot and "MEMSET" not in dot, dot


@requires_cuda
def test_a_step_first_run_inside_a_capture_on_a_new_device_uses_the_memset():
    """A counter made inside a capture would be zeroed by every replay: the step makes none there."""
    s = sample_inputs("reference", "cuda", B=64)
    step = InternalOpsStep(s.online, s.target, loss_type=s.loss_type, v_min=V_MIN, v_max=V_MAX, gamma=GAMMA)
    step._loss_counters.clear()  # as if the networks had moved to a device this step has not met
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert step._loss_counter(torch.device("cuda", torch.cuda.current_device())) is None
    assert not step._loss_counters


def test_compiles_with_a_counter_fullgraph():
    """A mutable counter under torch.compile(fullgraph=True) (auto-functionalised): eager's bits."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = _loss_args("reference", device, B=16)
    counter = ops.new_loss_counter(device)
    fn = torch.compile(lambda *a: ops._dqn_loss_on_logits(*a, counter=counter), fullgraph=True)
    _same(fn(*args), ops._dqn_loss_on_logits(*args), "compiled")
    assert counter.item() == 0

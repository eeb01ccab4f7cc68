"""The loss kernel's caller-owned block counter (``_dqn_loss_on_logits(..., counter=)``,
csrc/cuda/loss.cu): the kernel's last block leaves it at 0, so the launch needs no memset and
the trainer's captured step has no memset node for its loss. Each CUDA case compares with the
calls that zero a counter of their own: the same bits, and the counter at 0 after every call
(outputs poisoned before each)."""
import math

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import ops
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


@pytest.mark.parametrize("device", DEVICES)
def test_a_counter_changes_no_result_and_is_left_at_zero(device):
    args = _loss_args("reference", device, B=37)
    want = ops._dqn_loss_on_logits(*args)
    counter = ops.new_loss_counter(device)
    for i in range(3):
        _same(ops._dqn_loss_on_logits(*args, counter=counter), want, f"call {i}")
        assert counter.item() == 0


# the fused kernel (one block; several; more than are resident at once) and the composed path
@requires_cuda
@pytest.mark.parametrize("case,B", [("reference", 3), ("reference", 1000), ("reference", 20000),
                                    ("nine_branches", 1000), ("one_atom_huber", 1000)])
def test_cuda_calls_with_a_counter_equal_calls_without(case, B):
    args = _loss_args(case, "cuda", B)
    want = ops._dqn_loss_on_logits(*args)
    counter = ops.new_loss_counter("cuda")
    for i in range(5):
        got = ops._dqn_loss_on_logits(*args, counter=counter)
        _same(got, want, f"call {i}")
        assert counter.item() == 0, f"call {i} left the counter at {counter.item()}"


@requires_cuda
def test_graph_replays_with_a_counter_equal_eager_calls():
    args = list(_loss_args("reference", "cuda", B=2000))
    counter = ops.new_loss_counter("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before the capture
        ops._dqn_loss_on_logits(*args, counter=counter)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = ops._dqn_loss_on_logits(*args, counter=counter)
    for i in range(20):
        args[0].normal_()  # fresh logits for the same captured addresses
        args[6].uniform_(-12, 12)
        for t in static:
            t.fill_(math.nan)
        g.replay()
        _same(static, ops._dqn_loss_on_logits(*args), f"replay {i}")
        assert counter.item() == 0


@requires_cuda
def test_a_captured_loss_with_a_counter_has_no_memset_node(tmp_path):
    pytest.importorskip("cuda.bindings", reason="CUDAGraph.debug_dump needs the cuda-bindings package")
    args = _loss_args("reference", "cuda", B=1000)
    counter = ops.new_loss_counter("cuda")
    ops._dqn_loss_on_logits(*args, counter=counter)
    torch.cuda.synchronize()
    dots = []
    for c in (counter, None):  # None: the control, the launch's own counter and its memset
        g = torch.cuda.CUDAGraph(keep_graph=True)  # kept for debug_dump (test_side_stream.py says why)
        g.enable_debug_mode()
        with torch.cuda.graph(g):
            ops._dqn_loss_on_logits(*args, counter=c)
        path = tmp_path / f"loss-{c is None}.dot"
        g.debug_dump(str(path))
        dots.append(path.read_text())
    assert "KERNEL" in dots[0] and "MEMSET" not in dots[0], dots[0]
    assert "MEMSET" in dots[1], dots[1]


def test_compiles_with_a_counter_fullgraph():
    """A mutable counter under torch.compile(fullgraph=True) (auto-functionalised): eager's bits."""
    args = _loss_args("reference", "cpu", B=16)
    counter = ops.new_loss_counter("cpu")
    fn = torch.compile(lambda *a: ops._dqn_loss_on_logits(*a, counter=counter), fullgraph=True)
    _same(fn(*args), ops._dqn_loss_on_logits(*args), "compiled")
    assert counter.item() == 0

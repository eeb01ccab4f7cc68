"""record_step (the deferred-readback ring's one kernel) against the same bookkeeping in plain
PyTorch, and DeferredReadback's rows after many steps."""
import math

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops.readback import DeferredReadback

record_step = torch.ops.dqn_ops.record_step.default


def reference_record(ring, slot, flag, values, non_finite):
    """The torch version record_step replaced."""
    row = torch.stack([v.reshape(()) for v in values])
    ring.index_copy_(0, slot, row[None])
    slot.add_(1).remainder_(ring.shape[0])
    torch.maximum(flag, non_finite.reshape(1), out=flag)


def _state(device, rows=5, cols=4):
    return (torch.full((rows, cols), -7.0, device=device), torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_bookkeeping_over_wraps(device):
    ours, ref = _state(device), _state(device)
    for step in range(13):  # wraps the 5-row ring twice
        values = [torch.randn((), device=device) for _ in range(4)]
        bad = torch.tensor([1.0 if step == 7 else 0.0], device=device)
        record_step(*ours, values, bad)
        reference_record(*ref, values, bad)
        for a, b in zip(ours, ref):
            assert torch.equal(a, b), step
    assert ours[2].item() == 1.0  # sticky after step 7
    assert ours[1].item() == 13 % 5


@pytest.mark.parametrize("device", DEVICES)
def test_nan_non_finite_propagates_like_torch_maximum(device):
    ring, slot, flag = _state(device, cols=1)
    record_step(ring, slot, flag, [torch.ones((), device=device)], torch.tensor([math.nan], device=device))
    assert torch.isnan(flag).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_foreign_slot_wraps_instead_of_writing_out_of_bounds(device):
    ring, slot, flag = _state(device, rows=3, cols=1)
    slot.fill_(-4)
    record_step(ring, slot, flag, [torch.full((), 5.0, device=device)], torch.zeros(1, device=device))
    assert ring[2, 0].item() == 5.0 and slot.item() == 0  # -4 mod 3 = 2


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ring, slot, flag = _state(device)
    torch.library.opcheck(record_step, (ring, slot, flag, [torch.randn(1, device=device) for _ in range(4)],
                                        torch.zeros(1, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_are_clear_errors(device):
    ring, slot, flag = _state(device, cols=2)
    v = [torch.zeros(1, device=device)] * 2
    nf = torch.zeros(1, device=device)
    with pytest.raises(RuntimeError, match="values: expected 2 tensors"):
        record_step(ring, slot, flag, v[:1], nf)
    with pytest.raises(RuntimeError, match="values\\[i\\]: expected one element"):
        record_step(ring, slot, flag, [torch.zeros(2, device=device)] * 2, nf)
    with pytest.raises(RuntimeError, match="values\\[i\\]: expected dtype Float"):
        record_step(ring, slot, flag, [torch.zeros(1, device=device, dtype=torch.float64)] * 2, nf)
    with pytest.raises(RuntimeError, match="slot: expected dtype Long"):
        record_step(ring, slot.float(), flag, v, nf)
    with pytest.raises(RuntimeError, match="ring: expected shape"):
        record_step(ring[0], slot, flag, v, nf)
    with pytest.raises(RuntimeError, match="ring: expected a contiguous tensor"):
        record_step(ring.t().contiguous().t(), slot, flag, v, nf)
    with pytest.raises(RuntimeError, match="ring and flag must not share memory"):
        record_step(ring, slot, ring.view(-1)[:1], v, nf)


@requires_cuda
def test_cuda_mixed_devices_rejected():
    ring, slot, flag = _state("cuda", cols=1)
    with pytest.raises(RuntimeError, match="values\\[i\\]: expected a tensor on cuda"):
        record_step(ring, slot, flag, [torch.zeros(1)], torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_host_flag_receives_the_new_flag(device):
    """host_flag (pinned for CUDA) gets the flag the kernel wrote, NaN included, every call."""
    ring, slot, flag = _state(device, cols=1)
    host = torch.full((1,), -3.0, pin_memory=device == "cuda")
    for non_finite in (0.0, 1.0, 0.0, math.nan, 0.0):
        record_step(ring, slot, flag, [torch.ones((), device=device)], torch.tensor([non_finite], device=device), host)
        if device == "cuda":
            torch.cuda.synchronize()
        torch.testing.assert_close(host, flag.cpu(), rtol=0, atol=0, equal_nan=True)
    assert math.isnan(host.item())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_host_flag(device):
    if device == "cuda":
        from torch._dynamo.utils import clone_input
        if not clone_input(torch.zeros(1, pin_memory=True)).is_pinned():
            pytest.skip("this torch's opcheck copies a pinned input into pageable memory (torch 2.14's keeps "
                        "it pinned), which record_step rightly refuses as a host flag")
    ring, slot, flag = _state(device)
    torch.library.opcheck(record_step, (ring, slot, flag, [torch.randn(1, device=device) for _ in range(4)],
                                        torch.ones(1, device=device), torch.zeros(1, pin_memory=device == "cuda")))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_host_flags_are_clear_errors(device):
    ring, slot, flag = _state(device, cols=1)
    v, nf = [torch.zeros(1, device=device)], torch.zeros(1, device=device)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="host_flag: expected a tensor on cpu"):
            record_step(ring, slot, flag, v, nf, torch.zeros(1, device=device))
    with pytest.raises(RuntimeError, match="host_flag: expected shape \\[1\\]"):
        record_step(ring, slot, flag, v, nf, torch.zeros(2, pin_memory=device == "cuda"))
    with pytest.raises(RuntimeError, match="host_flag: expected dtype Float"):
        record_step(ring, slot, flag, v, nf, torch.zeros(1, dtype=torch.float64, pin_memory=device == "cuda"))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="host_flag: expected pinned memory"):
            record_step(ring, slot, flag, v, nf, torch.zeros(1))
    else:
        with pytest.raises(RuntimeError, match="host_flag and flag must not share memory"):
            record_step(ring, slot, flag, v, nf, flag)


@requires_cuda
def test_host_flag_is_written_by_a_graph_replay():
    """Captured: each replay's kernel stores the flag into the pinned host memory itself (no copy
    node), so the host sees a replay's non-finite step after it completes."""
    ring, slot, flag = _state("cuda", cols=1)
    host = torch.zeros(1, pin_memory=True)
    value, bad = torch.ones((), device="cuda"), torch.zeros(1, device="cuda")
    record_step(ring, slot, flag, [value], bad, host)  # warm (module load) outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        record_step(ring, slot, flag, [value], bad, host)
    g.replay()
    torch.cuda.synchronize()
    assert host.item() == 0.0
    bad.fill_(1.0)
    g.replay()
    torch.cuda.synchronize()
    assert host.item() == 1.0 and flag.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_readback_reads_every_step_in_order(device):
    rb = DeferredReadback(["a", "b"], interval=4, device=device)
    for step in range(11):
        rb.record([torch.tensor(float(step), device=device), torch.tensor(-float(step), device=device)],
                  torch.zeros((), device=device))
        assert not rb.after_step()
    rb.readback()
    assert [r["a"] for r in rb.rows] == [float(s) for s in range(11)]
    assert [r["b"] for r in rb.rows] == [-float(s) for s in range(11)]


@pytest.mark.parametrize("device", DEVICES)
def test_several_steps_per_enqueue_lose_no_row(device):
    # A loop's CUDA graph records `count` steps per replay: make_room before, after_step(count) after.
    rb = DeferredReadback(["a", "b"], interval=7, device=device)
    expected, step = [], 0
    for count in (3, 5, 7, 1, 6, 4, 7, 2):
        rb.make_room(count)
        for _ in range(count):
            v = [torch.tensor(float(step), device=device), torch.tensor(-float(step), device=device)]
            rb.record(v, torch.zeros(1, device=device))
            expected.append(dict(a=float(step), b=-float(step)))
            step += 1
        rb.after_step(count)
    rb.readback()
    assert rb.rows == expected and rb.steps_read == step


def test_several_steps_misuse_is_a_clear_error():
    rb = DeferredReadback(["a"], interval=4, device="cpu")
    with pytest.raises(ValueError, match="do not fit the ring of 4 rows"):
        rb.make_room(5)
    rb.after_step(3)
    with pytest.raises(RuntimeError, match="make_room"):
        rb.after_step(2)  # 5 rows not copied: two of them were overwritten


@pytest.mark.parametrize("device", DEVICES)
def test_values_sharing_memory_with_what_the_kernel_writes_are_refused(device):
    """The kernel writes the ring row before it reads the later values: an alias would make the
    row depend on the order."""
    ring, slot, flag = _state(device, rows=3, cols=2)
    nf = torch.zeros(1, device=device)
    with pytest.raises(RuntimeError, match=r"ring and values\[i\] must not share memory"):
        record_step(ring, slot, flag, [torch.zeros(1, device=device), ring.view(-1)[5:6]], nf)
    with pytest.raises(RuntimeError, match="flag and non_finite must not share memory"):
        record_step(ring, slot, flag, [torch.zeros(1, device=device)] * 2, flag)

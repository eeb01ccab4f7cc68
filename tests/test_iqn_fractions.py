"""iqn_fractions (IQN's quantile fractions drawn on the device; docs/iqn-design.md, "Fractions in
the trainer") against the independent Python Philox of tests/reference.py:
tau[b, i] = uniform(draw(stream 5, seed, call, row_offset + b, i)) and tau_target[b, j] the same
at slot 2^17 + j. The call counter, the range and independence of the draws, the argument checks
(the kernels' and the fake kernel's), opcheck, torch.compile; on a GPU: the CPU's bits, a CUDA
graph whose replays draw the next calls' fractions, no host sync."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dqn_ops
from conftest import DEVICES, requires_cuda
from reference import (STREAM_ACT, STREAM_BOOTSTRAP, STREAM_ENV, STREAM_IQN_FRACTIONS, STREAM_REPLAY, philox_draw,
                       philox_uniform)
from step_check import same_bits

FRACTIONS_OP = torch.ops.dqn_ops.iqn_fractions.default
TARGET_SLOT = 2 ** 17  # tau_target's first slot
MAX_ROWS = 2 ** 32     # philox's row is 32 bits


def int64_of(u: int) -> int:
    u &= (1 << 64) - 1
    return u - (1 << 64) if u >= 1 << 63 else u


def rng_of(seed: int, call: int, device="cpu") -> torch.Tensor:
    return torch.tensor([int64_of(seed), int64_of(call)], dtype=torch.int64, device=device)


def reference_fractions(seed, call, batch, n, n_target, row_offset=0):
    """(tau, tau_target) from the Python Philox, as float32 (the draws are exact in it)."""
    def row(b, slots):
        return [philox_uniform(philox_draw(STREAM_IQN_FRACTIONS, seed, call, row_offset + b, s)) for s in slots]
    tau = torch.tensor([row(b, range(n)) for b in range(batch)], dtype=torch.float64)
    target = torch.tensor([row(b, range(TARGET_SLOT, TARGET_SLOT + n_target)) for b in range(batch)],
                          dtype=torch.float64)
    return tau.float(), target.float()


def fresh_u64() -> int:
    return int(torch.randint(0, 2 ** 62, ())) * 4 + int(torch.randint(0, 4, ()))


# ----------------------------------------------------------------------------------------
# Values

@pytest.mark.parametrize("seed", [0, 5, 2 ** 63 + 11, 2 ** 64 - 1, None], ids=["0", "5", "2^63+11", "2^64-1", "fresh"])
@pytest.mark.parametrize("call", [0, 3, 2 ** 32 + 7, None], ids=["0", "3", "2^32+7", "fresh"])
def test_values_are_the_python_philox(seed, call):
    seed = fresh_u64() if seed is None else seed
    call = fresh_u64() if call is None else call
    batch, n, n_target = (int(torch.randint(1, 7, ())), int(torch.randint(1, 11, ())), int(torch.randint(1, 11, ())))
    for row_offset in (0, int(torch.randint(1, 10 ** 6, ())), MAX_ROWS - batch):
        rng = rng_of(seed, call)
        tau, target = dqn_ops.iqn_fractions(rng, batch, n, n_target, row_offset)
        assert tau.dtype == target.dtype == torch.float32
        assert tau.shape == (batch, n) and target.shape == (batch, n_target)
        ref_tau, ref_target = reference_fractions(seed, call, batch, n, n_target, row_offset)
        same_bits(tau, ref_tau, f"tau (row_offset {row_offset})")
        same_bits(target, ref_target, f"tau_target (row_offset {row_offset})")
        assert rng.tolist() == [int64_of(seed), int64_of(call + 1)]


def test_slots_up_to_the_limits_are_the_python_philox():
    """The largest n and n_target: the last slots 2^17 - 2 and 2^18 - 2 (the counter's slot / 4
    word at its top), compared where they lie."""
    n = dqn_ops.ops.IQN_MAX_FRACTIONS
    assert n == 2 ** 17 - 1
    seed, call, row_offset = fresh_u64(), fresh_u64(), int(torch.randint(0, 2 ** 31, ()))
    tau, target = dqn_ops.iqn_fractions(rng_of(seed, call), 2, n, n, row_offset)
    cols = [0, 1, 2, 3, 4, n - 5, n - 4, n - 3, n - 2, n - 1]
    for b in range(2):
        for i in cols:
            row = row_offset + b
            assert tau[b, i].item() == philox_uniform(philox_draw(STREAM_IQN_FRACTIONS, seed, call, row, i)), (b, i)
            assert target[b, i].item() == philox_uniform(
                philox_draw(STREAM_IQN_FRACTIONS, seed, call, row, TARGET_SLOT + i)), (b, i)


@pytest.mark.parametrize("device", DEVICES)
def test_the_call_counter_advances_by_one_per_call_and_wraps(device):
    seed = fresh_u64()
    rng = rng_of(seed, 0, device)
    outs = [dqn_ops.iqn_fractions(rng, 4, 5, 6) for _ in range(3)]
    assert rng.tolist() == [int64_of(seed), 3]
    for call, (tau, target) in enumerate(outs):
        ref_tau, ref_target = reference_fractions(seed, call, 4, 5, 6)
        same_bits(tau.cpu(), ref_tau, f"tau of call {call}")
        same_bits(target.cpu(), ref_target, f"tau_target of call {call}")
    for before, after in (((1 << 64) - 1, 0), ((1 << 63) - 1, 1 << 63)):  # -1 -> 0; int64's largest -> 2^63
        rng = rng_of(seed, before, device)
        tau, _ = dqn_ops.iqn_fractions(rng, 2, 3, 3)
        assert rng.tolist() == [int64_of(seed), int64_of(after)]
        same_bits(tau.cpu(), reference_fractions(seed, before, 2, 3, 3)[0], f"call {before}")


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_live_on_rngs_device(device):
    rng = rng_of(1, 2, device)
    tau, target = dqn_ops.iqn_fractions(rng, 3, 4, 5)
    assert tau.device == rng.device and target.device == rng.device
    assert tau.is_contiguous() and target.is_contiguous()


def test_values_lie_in_0_1_on_the_24_bit_grid_and_are_uniform():
    """Over 2^20 fractions of each set: every one k / 2^24 with 0 <= k < 2^24; the mean and a
    16-bin histogram within 5 standard deviations of the uniform's."""
    tau, target = dqn_ops.iqn_fractions(rng_of(fresh_u64(), fresh_u64()), 2 ** 14, 64, 64, 12345)
    for name, x in (("tau", tau), ("tau_target", target)):
        x = x.double().flatten()
        k = x * 2 ** 24
        assert (x >= 0).all() and (x <= 1 - 2 ** -24).all(), name
        assert torch.equal(k, k.floor()), f"{name}: off the 24-bit grid"
        count = x.numel()
        assert abs(x.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / count), name
        hist = torch.histc(x, bins=16, min=0.0, max=1.0)
        p = 1 / 16
        assert ((hist - count * p).abs() < 5 * math.sqrt(count * p * (1 - p))).all(), (name, hist)
        assert len(x.unique()) > 0.95 * count, f"{name}: repeats (2^20 draws from 2^24 values)"


def test_calls_rows_slots_and_sets_draw_differently():
    seed = fresh_u64()
    rng = rng_of(seed, 9)
    tau0, target0 = dqn_ops.iqn_fractions(rng, 64, 32, 32)
    tau1, target1 = dqn_ops.iqn_fractions(rng, 64, 32, 32)
    other_seed = dqn_ops.iqn_fractions(rng_of(seed + 1, 9), 64, 32, 32)
    for name, x, others in (("tau", tau0, (tau1, target0, other_seed.tau)),
                            ("tau_target", target0, (target1, other_seed.tau_target))):
        for y in others:  # no element in place equal but by the chance of 64 * 32 draws from 2^24 values
            assert (x == y).sum().item() <= 2, name
        assert (x[1:] != x[:-1]).float().mean().item() > 0.99, f"{name}: rows repeat"
        assert (x[:, 1:] != x[:, :-1]).float().mean().item() > 0.99, f"{name}: slots repeat"
    # the same call again: the same numbers
    same_bits(dqn_ops.iqn_fractions(rng_of(seed, 9), 64, 32, 32).tau, tau0, "the same call")


def test_each_set_is_independent_of_the_others_size_and_rows_of_the_batch():
    """tau_target does not depend on n, nor tau on n_target; a row's fractions are those of its
    global row, whatever the batch it is drawn in (row_offset: data-parallel ranks)."""
    seed, call = fresh_u64(), fresh_u64()
    tau, target = dqn_ops.iqn_fractions(rng_of(seed, call), 12, 8, 16)
    for n in (1, 3, 8, 40):
        t, tt = dqn_ops.iqn_fractions(rng_of(seed, call), 12, n, 16)
        same_bits(tt, target, f"tau_target with n = {n}")
        m = min(n, 8)
        same_bits(t[:, :m], tau[:, :m], f"tau's first slots with n = {n}")
    for n_target in (1, 5, 33):
        t, tt = dqn_ops.iqn_fractions(rng_of(seed, call), 12, 8, n_target)
        same_bits(t, tau, f"tau with n_target = {n_target}")
        m = min(n_target, 16)
        same_bits(tt[:, :m], target[:, :m], f"tau_target's first slots with n_target = {n_target}")
    for rank in range(3):  # 3 ranks of 4 rows each: the 12 rows of one batch
        t, tt = dqn_ops.iqn_fractions(rng_of(seed, call), 4, 8, 16, 4 * rank)
        same_bits(t, tau[4 * rank:4 * rank + 4], f"rank {rank}'s tau")
        same_bits(tt, target[4 * rank:4 * rank + 4], f"rank {rank}'s tau_target")
    assert not torch.equal(dqn_ops.iqn_fractions(rng_of(seed, call), 4, 8, 16, 1).tau, tau[:4])


def test_iqn_stream_is_its_own():
    draws = {s: tuple(philox_draw(s, 3, 0, row, slot) for row in range(8) for slot in range(4))
             for s in (STREAM_ACT, STREAM_REPLAY, STREAM_ENV, STREAM_BOOTSTRAP, STREAM_IQN_FRACTIONS)}
    assert len(set(draws.values())) == 5
    tau, _ = dqn_ops.iqn_fractions(rng_of(3, 0), 8, 4, 1)
    same_bits(tau, torch.tensor([philox_uniform(d) for d in draws[STREAM_IQN_FRACTIONS]]).view(8, 4),
              "stream 5's draws")


# ----------------------------------------------------------------------------------------
# Checks

def bad_args():
    return dict(rng=rng_of(7, 2), batch=4, n=8, n_target=8, row_offset=0)


BAD_ARGS = [
    (lambda a: a.update(rng=a["rng"].int()), r"rng: expected dtype Long, got (Int|torch.int32)", True),
    (lambda a: a.update(rng=torch.zeros(3, dtype=torch.long)), r"rng: expected shape \[2\], got \[3\]", True),
    (lambda a: a.update(rng=torch.zeros(1, 2, dtype=torch.long)), r"rng: expected shape \[2\], got \[1, 2\]", True),
    (lambda a: a.update(rng=torch.zeros(2, 2, dtype=torch.long)[:, 0]), r"rng: expected a contiguous tensor", False),
    (lambda a: a.update(batch=0), r"batch: expected at least 1 row, got 0", True),
    (lambda a: a.update(batch=-3), r"batch: expected at least 1 row, got -3", True),
    (lambda a: a.update(n=0), r"n: expected 1 <= n <= 131071 \(the fractions of a row draw at philox slots below "
                              r"2\^17\), got 0", True),
    (lambda a: a.update(n=2 ** 17), r"n: expected 1 <= n <= 131071 .*got 131072", True),
    (lambda a: a.update(n_target=0), r"n_target: expected 1 <= n_target <= 131071 \(the target fractions of a row "
                                     r"draw at philox slots 2\^17 \+ j, below 2\^18\), got 0", True),
    (lambda a: a.update(n_target=2 ** 17), r"n_target: expected 1 <= n_target <= 131071 .*got 131072", True),
    (lambda a: a.update(row_offset=-1), r"row_offset: expected 0 <= row_offset < 4294967296 \(philox's row is 32 "
                                        r"bits\), got -1", True),
    (lambda a: a.update(row_offset=2 ** 32), r"row_offset: expected 0 <= row_offset < 4294967296 .*got 4294967296",
     True),
    (lambda a: a.update(row_offset=2 ** 32 - 3), r"batch: rows row_offset \.\. row_offset \+ batch - 1 must be below "
                                                 r"4294967296 \(philox's row is 32 bits\), got row_offset 4294967293 "
                                                 r"and batch 4", True),
    (lambda a: a.update(row_offset=2 ** 63 - 1), r"row_offset: expected 0 <= row_offset < 4294967296", True),
    (lambda a: a.update(batch=2 ** 63 - 1), r"batch: rows row_offset .. row_offset \+ batch - 1 must be below", True),
]


def _call(a):
    return FRACTIONS_OP(a["rng"], a["batch"], a["n"], a["n_target"], a["row_offset"])


@pytest.mark.parametrize("mutate,match,fake_too", BAD_ARGS, ids=[m for _, m, _ in BAD_ARGS])
def test_bad_arguments_name_op_and_argument(mutate, match, fake_too):
    a = bad_args()
    mutate(a)
    before = a["rng"].clone()
    with pytest.raises(RuntimeError, match="dqn_ops.iqn_fractions: " + match):
        _call(a)
    assert torch.equal(a["rng"], before), "a refused call advanced rng"
    if fake_too:  # the fake kernel says the same (it checks what the shapes depend on)
        with FakeTensorMode():
            fake = dict(a, rng=torch.empty(a["rng"].shape, dtype=a["rng"].dtype))
            with pytest.raises(RuntimeError, match="dqn_ops.iqn_fractions: " + match):
                _call(fake)


def test_the_last_row_is_allowed():
    seed = fresh_u64()
    tau, target = dqn_ops.iqn_fractions(rng_of(seed, 1), 1, 2, 2, MAX_ROWS - 1)
    ref = reference_fractions(seed, 1, 1, 2, 2, MAX_ROWS - 1)
    same_bits(tau, ref[0], "tau of row 2^32 - 1")
    same_bits(target, ref[1], "tau_target of row 2^32 - 1")


def test_wrapper_defaults_and_export():
    assert dqn_ops.iqn_fractions is dqn_ops.ops.iqn_fractions and "iqn_fractions" in dqn_ops.__all__
    seed = fresh_u64()
    out = dqn_ops.iqn_fractions(rng_of(seed, 4), 3, 2, 5)  # row_offset 0
    assert isinstance(out, dqn_ops.ops.IqnFractions)
    same_bits(out.tau, reference_fractions(seed, 4, 3, 2, 5)[0], "row_offset defaults to 0")


# ----------------------------------------------------------------------------------------
# Registration: opcheck, fake tensors, torch.compile

@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for batch, n, n_target, row_offset in ((1, 1, 1, 0), (5, 32, 32, 0), (7, 3, 40, 2 ** 32 - 7)):
        torch.library.opcheck(FRACTIONS_OP, (rng_of(fresh_u64(), fresh_u64(), device), batch, n, n_target,
                                             row_offset))


def test_fake_kernel_shapes():
    with FakeTensorMode():
        tau, target = FRACTIONS_OP(torch.empty(2, dtype=torch.int64), 6, 4, 9, 10)
    assert tau.shape == (6, 4) and target.shape == (6, 9)
    assert tau.dtype == target.dtype == torch.float32


def test_compile_fullgraph_matches_eager():
    def f(rng):
        tau, target = dqn_ops.iqn_fractions(rng, 6, 8, 5, 3)
        return tau * 2, target + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    seed = fresh_u64()
    rng_c, rng_e = rng_of(seed, 0), rng_of(seed, 0)
    for _ in range(3):  # the mutation of rng is part of the compiled graph
        got, want = compiled(rng_c), f(rng_e)
        same_bits(got[0], want[0], "tau * 2")
        same_bits(got[1], want[1], "tau_target + 1")
        assert torch.equal(rng_c, rng_e)
    assert rng_c.tolist() == [int64_of(seed), 3]


# ----------------------------------------------------------------------------------------
# CUDA: the CPU's bits, graphs, syncs

@requires_cuda
@pytest.mark.parametrize("batch,n,n_target,row_offset", [
    (1, 1, 1, 0), (256, 32, 32, 0), (257, 33, 31, 2 ** 32 - 257), (3, 2 ** 17 - 1, 2 ** 17 - 1, 99),
    (66_000, 200, 60, 12_345),  # more elements than a grid of 65535 blocks of 256 threads: the threads loop
])
def test_cuda_is_the_cpu_bits(batch, n, n_target, row_offset):
    seed, call = fresh_u64(), fresh_u64()
    rng_g, rng_c = rng_of(seed, call, "cuda"), rng_of(seed, call)
    g = dqn_ops.iqn_fractions(rng_g, batch, n, n_target, row_offset)
    c = dqn_ops.iqn_fractions(rng_c, batch, n, n_target, row_offset)
    assert g.tau.is_cuda and g.tau_target.is_cuda
    same_bits(g.tau.cpu(), c.tau, "tau")
    same_bits(g.tau_target.cpu(), c.tau_target, "tau_target")
    assert rng_g.tolist() == rng_c.tolist() == [int64_of(seed), int64_of(call + 1)]


@requires_cuda
def test_cuda_kernel_checks_its_arguments():
    """On CUDA the kernel's own checks run (the same header as the CPU's)."""
    rng = rng_of(1, 2, "cuda")
    with pytest.raises(RuntimeError, match=r"dqn_ops.iqn_fractions: rng: expected dtype Long, got Int"):
        FRACTIONS_OP(rng.int(), 2, 3, 3, 0)
    with pytest.raises(RuntimeError, match=r"dqn_ops.iqn_fractions: batch: rows row_offset"):
        FRACTIONS_OP(rng, 2, 3, 3, 2 ** 32 - 1)
    assert rng.tolist() == [1, 2]


@requires_cuda
def test_cuda_graph_replays_draw_the_next_calls():
    seed, batch, n, n_target, row_offset = fresh_u64(), 256, 32, 24, 512
    rng = rng_of(seed, 0, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dqn_ops.iqn_fractions(rng, batch, n, n_target, row_offset)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    rng.copy_(rng_of(seed, 5, "cuda"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # (entering it synchronises: the check starts inside)
        torch.cuda.set_sync_debug_mode("error")
        try:
            static = dqn_ops.iqn_fractions(rng, batch, n, n_target, row_offset)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert rng.tolist() == [int64_of(seed), 5]  # capturing ran nothing
    for call in range(5, 9):
        torch.cuda.set_sync_debug_mode("error")
        try:
            static.tau.fill_(float("nan"))
            static.tau_target.fill_(float("nan"))
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = dqn_ops.iqn_fractions(rng_of(seed, call), batch, n, n_target, row_offset)
        same_bits(static.tau.cpu(), want.tau, f"tau of replay {call}")
        same_bits(static.tau_target.cpu(), want.tau_target, f"tau_target of replay {call}")
        assert rng.tolist() == [int64_of(seed), call + 1]


@requires_cuda
def test_no_host_sync_eager():
    rng = rng_of(fresh_u64(), 0, "cuda")
    dqn_ops.iqn_fractions(rng, 64, 32, 32)  # warm-up outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [dqn_ops.iqn_fractions(rng, 64, 32, 32, 64) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rng[1].item() == 4
    assert not torch.equal(outs[0].tau, outs[1].tau)

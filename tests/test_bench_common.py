"""scripts/bench_common.py's helpers that the benchmarks time with."""
import gc
import os
import sys
import weakref

import torch

from conftest import requires_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from bench_common import code_path_switches, graphed, switches_note  # noqa: E402


def doubling():
    """fn: y = 2 x, x held by fn's closure only; y; a weak reference to x."""
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")  # a segment of its own
    y = torch.empty_like(x)

    def fn():
        y.copy_(x * 2)

    return fn, y, weakref.ref(x)


@requires_cuda
def test_a_graphed_replay_keeps_what_it_reads_alive():
    """The replay graphed() returns holds the captured function, and so the tensors it closes
    over: a caller that keeps only the replay must not have the graph's inputs freed under it."""
    fn, y, x_alive = doubling()
    replay = graphed(fn)
    del fn
    gc.collect()
    torch.cuda.empty_cache()
    assert x_alive() is not None, "the graph's input was freed while its replay was still held"
    y.zero_()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 2)
    del replay
    gc.collect()
    assert x_alive() is None, "the replay, once dropped, should let its input go"


def test_the_switches_note_names_what_is_not_the_default(monkeypatch):
    """A result file's note names the dense tile only where it is forced, the dense stores and
    the epilogue's column sums where the file records them; code_path_switches reads them from the
    environment, "auto" where the column sums' variable is unset."""
    base = dict(side_streams=True, pdl=True, dense_kernel="auto", dense_tile="auto", dense_stores="all",
                epilogue_column_sums="auto", narrow_logits=False, staged_head_rows=False, dense_cosines=False)
    assert switches_note(base) == ("side streams on, PDL on, dense kernel auto, dense stores all, epilogue column "
                                   "sums auto, narrow logits off, staged head rows off, dense cosines off")
    assert switches_note(dict(base, dense_tile="64x64", epilogue_column_sums="off", narrow_logits=True,
                              staged_head_rows=True, dense_cosines=True)) == (
        "side streams on, PDL on, dense kernel auto, dense tile 64x64, dense stores all, epilogue column sums off, "
        "narrow logits on, staged head rows on, dense cosines on")
    # a file written before those three switches
    no_narrow = {k: v for k, v in base.items() if k not in ("narrow_logits", "staged_head_rows", "dense_cosines")}
    assert switches_note(no_narrow) == (
        "side streams on, PDL on, dense kernel auto, dense stores all, epilogue column sums auto")
    old = dict(side_streams=False, pdl=True)  # a file written before the dense kernel's switches
    assert switches_note(old) == "side streams off, PDL on"
    monkeypatch.delenv("DQN_OPS_EPILOGUE_COLUMN_SUMS", raising=False)
    assert code_path_switches()["epilogue_column_sums"] == "auto"
    monkeypatch.setenv("DQN_OPS_EPILOGUE_COLUMN_SUMS", "off")
    assert code_path_switches()["epilogue_column_sums"] == "off"
    monkeypatch.delenv("DQN_OPS_NARROW_LOGITS", raising=False)
    assert code_path_switches()["narrow_logits"] is False
    monkeypatch.setenv("DQN_OPS_NARROW_LOGITS", "1")
    assert code_path_switches()["narrow_logits"] is True
    monkeypatch.delenv("DQN_OPS_STAGE_HEAD_ROWS", raising=False)
    assert code_path_switches()["staged_head_rows"] is False
    monkeypatch.setenv("DQN_OPS_STAGE_HEAD_ROWS", "1")
    assert code_path_switches()["staged_head_rows"] is True
    monkeypatch.delenv("DQN_OPS_DENSE_COSINES", raising=False)
    assert code_path_switches()["dense_cosines"] is False
    monkeypatch.setenv("DQN_OPS_DENSE_COSINES", "1")
    assert code_path_switches()["dense_cosines"] is True

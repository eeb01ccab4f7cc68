"""CapturedStep (dqn_ops/graphed.py) and garbage collection: a CUDA graph left in a dead
reference cycle is destroyed whenever a collection reaches it, and inside another capture CUDA
refuses that destruction and invalidates the capture. The objects that own a CapturedStep are
freed without a collection, and a CapturedStep's capture runs with the collector paused."""
import gc
import weakref

import pytest
import torch

from conftest import DEVICES, requires_cuda
from dqn_ops import DQNConfig, Trainer, TrainerConfig
from dqn_ops.graphed import CapturedStep, collector_paused
from dqn_ops.rl.baseline import TorchTrainer
from test_loop import make

NET = DQNConfig(state_dim=6, trunk_hidden=(16, 16), value_hidden=8, adv_hidden=8, atoms=5, branches=(2, 3))


def freed_without_a_collection(make_objects):
    """Whether the objects make_objects() returns are all freed once dropped, the collector off
    throughout (reference counts alone: no cycle through them). Made once before, collected:
    a first trainer in a process imports parts of torch (its optimizer's), whose import frames
    form cycles that hold the caller's frames, the trainer's constructor included."""
    make_objects()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        refs = [weakref.ref(o) for o in make_objects()]
        return [r() is None for r in refs]
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [Trainer, TorchTrainer])
def test_a_dropped_trainer_is_freed_without_a_collection(device, cls):
    def trained():
        t = cls(NET, TrainerConfig(batch_size=8, warmup_steps=1), device=device, seed=0)
        for _ in range(3):  # on its zeroed inputs; on CUDA: the warm-up, the capture and a replay
            t.step()
        assert t._runner.graphed == (device == "cuda")
        return [t, t._runner]  # the step holds the graph
    assert freed_without_a_collection(trained) == [True, True]


@pytest.mark.parametrize("device", DEVICES)
def test_a_dropped_training_loop_is_freed_without_a_collection(device):
    def ran():
        t, env, rb, loop = make(device, graph=True, K=2, warmup_chunks=1)
        loop.prefill(4)
        loop.run(6)  # on CUDA: the warm-up chunk, the capture and a replay
        assert loop._runner.graphed == (device == "cuda")
        return [loop, loop._runner, t]
    assert freed_without_a_collection(ran) == [True, True, True]


def test_collector_paused_collects_first_and_restores_the_collectors_state():
    class Cycle:
        def __init__(self):
            self.me = self
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            dead = weakref.ref(Cycle())
            with collector_paused():
                assert dead() is None  # collected on entry
                assert not gc.isenabled()
            assert gc.isenabled() == enabled
            with pytest.raises(ZeroDivisionError), collector_paused():
                1 / 0
            assert gc.isenabled() == enabled
        finally:
            gc.enable()


class Owner:
    """An object holding a step of one of its own methods, as a trainer does."""
    def __init__(self, device):
        self.x = torch.zeros(4, device=device)
        self.step = CapturedStep(self.run, torch.device(device), warmup_steps=1, owner_holds_step=True)

    def run(self):
        self.x.add_(1)


def test_a_step_whose_owner_is_gone_says_so():
    o = Owner("cpu")
    step = o.step
    step()
    del o
    with pytest.raises(RuntimeError, match="no longer exists"):
        step()
    with pytest.raises(TypeError, match="needs a bound method"):
        CapturedStep(lambda: None, torch.device("cpu"), owner_holds_step=True)
    # Without owner_holds_step the body is held as given: a method of an object nothing else holds.
    calls = []

    class Helper:
        def run(self):
            calls.append(1)
    step = CapturedStep(Helper().run, torch.device("cpu"))
    gc.collect()
    step()
    assert calls == [1]


@requires_cuda
def test_a_replay_whose_owner_is_gone_says_so():
    o = Owner("cuda")
    step = o.step
    step()  # the warm-up
    step()  # the capture and its first replay
    assert step.graphed and torch.equal(o.x, torch.full((4,), 2.0, device="cuda"))
    del o  # its tensors go with it: the graph must not replay into them
    with pytest.raises(RuntimeError, match="no longer exists"):
        step()


@requires_cuda
def test_a_dead_graph_in_a_cycle_does_not_invalidate_a_later_capture(monkeypatch):
    # The stale graph is made after the step's warm-up and before its capture, with no automatic
    # collection in between (nor torch's optional one before a capture), and the body collects
    # garbage inside the capture (as an allocation may start a collection): the capture holds
    # only if the stale graph was destroyed before it began.
    monkeypatch.setattr(torch.compiler.config, "force_cudagraph_gc", False)
    x = torch.zeros(4, device="cuda")

    def body():
        x.add_(1)
        gc.collect()
    step = CapturedStep(body, torch.device("cuda"), warmup_steps=1)
    step()  # the warm-up

    class Holder:
        pass
    gc.disable()
    try:
        stale = Holder()
        stale.me = stale
        stale.input = torch.ones(4, device="cuda")
        stale.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(stale.graph):
            stale.input.mul_(2)
        dead = weakref.ref(stale)
        del stale
        assert dead() is not None  # only a collection frees it
        step()  # the capture, then its first replay
    finally:
        gc.enable()
    step()  # a replay
    torch.cuda.synchronize()
    assert step.graphed and dead() is None
    assert torch.equal(x, torch.full((4,), 3.0, device="cuda"))

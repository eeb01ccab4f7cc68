"""``CapturedStep``: run a step function eagerly for a few warm-up calls, then capture it into
one CUDA graph and replay that graph on every later call."""
from __future__ import annotations

import contextlib
import gc
import inspect
import weakref
from typing import Callable, Optional

import torch


def on_device(device: torch.device):
    """A context with `device` current on CUDA (whose current stream is then the one work goes
    on, whichever device the caller had current); nothing on other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def collector_paused():
    """A full garbage collection now, then none until the block ends (the collector's state
    restored after). For a CUDA graph capture: a graph left in a dead reference cycle is
    destroyed when a collection reaches it, and inside a capture CUDA refuses that destruction
    (torch only warns, "operation not permitted when stream is capturing (function reset)") and
    invalidates the capture, which then fails at a later, unrelated call. torch no longer
    collects before a capture by default (``torch.compiler.config.force_cudagraph_gc``), and a
    collection may start at any allocation."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CapturedStep:
    """Calls `body` eagerly `warmup_steps` times, then captures it once into a CUDA graph and
    replays it. On the CPU, or with `use_graph=False`, every call runs `body` eagerly.

    CUDA-graph capture wants its warm-up on a side stream (lazy cuBLAS state, allocator pools);
    all warm-up calls use one side stream, since torch gives every new stream its own cuBLAS
    workspace. `body` must keep its inputs and outputs in tensors whose addresses do not change
    (the graph replays the same addresses); `reset()` forgets the graph (e.g. after the tensors
    were replaced by a checkpoint load), and the next calls warm up and capture again.

    Device and streams: every call runs with `device` current, whichever device the caller
    has current. Warm-up and capture use this object's side stream of `device` (never
    ``torch.cuda.graph``'s process-wide default capture stream, which belongs to whichever
    device was current at the first capture in the process); the warm-up joins the caller's
    current stream of `device` before and after, and replays are launched on that stream (a
    side stream the caller made current included), so the step is ordered with the caller's
    work.

    ``owner_holds_step``: `body` is a bound method of the object that holds this step (a
    trainer's, a loop's). The object is then held weakly: a strong hold would make a reference
    cycle, which keeps the object and its graph alive until a garbage collection, and that may
    come during another capture (``collector_paused``, which guards this step's own capture,
    says why). A call once the object is gone raises, a replay included (its graph reads and
    writes the object's tensors).
    """

    def __init__(self, body: Callable[[], None], device: torch.device, use_graph: bool = True, warmup_steps: int = 3,
                 *, owner_holds_step: bool = False):
        if warmup_steps < 1:
            raise ValueError(f"CapturedStep: warmup_steps must be >= 1 (cuBLAS must be warm before a capture), "
                             f"got {warmup_steps}")
        if owner_holds_step and not inspect.ismethod(body):
            raise TypeError(f"CapturedStep: owner_holds_step needs a bound method as body, got {type(body).__name__}")
        # The owner held weakly and its function apart: a replay checks the owner with one
        # weakref call on the host's path, without binding the method again.
        self._owner = weakref.ref(body.__self__) if owner_holds_step else None
        self._func = body.__func__ if owner_holds_step else body
        self.device = torch.device(device)
        self.use_graph = bool(use_graph) and self.device.type == "cuda"
        self.warmup_steps = warmup_steps
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._eager_calls = 0
        self._side_stream = None

    def _live_owner(self):
        """The body's owner (None without owner_holds_step); raises once the owner is gone."""
        if self._owner is None:
            return None
        owner = self._owner()
        if owner is None:
            raise RuntimeError("CapturedStep: the object whose method is this step's body no longer exists")
        return owner

    def body(self):
        """Runs the step's body once (eagerly, or into the capture)."""
        owner = self._live_owner()
        if owner is None:
            self._func()
        else:
            self._func(owner)

    @property
    def graphed(self) -> bool:
        return self.graph is not None

    def reset(self):
        self.graph = None
        self._eager_calls = 0

    def __call__(self):
        with on_device(self.device):
            self.run_with_device_current()

    def run_with_device_current(self):
        """``self()`` for a caller that has made ``self.device`` current (``on_device``): one
        device switch fewer on the host's path per call."""
        if self.graph is not None:
            self._live_owner()  # the graph's tensors are its owner's
            self.graph.replay()  # on the current stream of self.device
        elif not self.use_graph:
            self.body()
            self._eager_calls += 1
        else:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            current = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(current)
            if self._eager_calls >= self.warmup_steps:
                g = torch.cuda.CUDAGraph()
                # (torch.cuda.graph synchronises the device before it begins the capture)
                with collector_paused(), torch.cuda.graph(g, stream=self._side_stream):
                    self.body()
                self.graph = g
                g.replay()
            else:
                with torch.cuda.stream(self._side_stream):
                    self.body()
                current.wait_stream(self._side_stream)
                self._eager_calls += 1

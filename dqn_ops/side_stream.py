"""Side streams: a step's independent passes beside each other on the GPU.

At small batches each kernel of the training step fills a few of the GPU's SMs, and one
stream runs them one after the other even where one pass does not read another's output. The
CUDA ops fork such work themselves (the backward's dW GEMMs, the target's output layer where
the dense kernel does not run both networks' in one launch: ``csrc/cuda/side_stream.h``); the steps fork whole passes with a ``Branch``: the public-ops
step's target pass beside the online one (IQN's step), a head-group network's groups beside
each other (``dqn_ops.step.GroupsStep``), the trainer's TD-error copy and readback row beside
spectral norm and the EMA. Inside a CUDA-graph capture the fork and the join become edges of
the graph. The results are the same bits with the side streams on or off.

On by default (the step is faster with them, ``bench/NOTES.md``): ``DQN_OPS_SIDE_STREAM=0`` in
the environment (read once) or ``set_enabled(False)`` turns them off for the process; set it
before a trainer's first step (its graph keeps the streams in force when it was captured, and the side
streams are best made before a capture: torch gives each stream a GEMM runs on a cuBLAS
workspace of its own).

The streams are the extension's own, one per (device, current stream, lane, host thread), kept
for the process, never one of torch's pool streams (which a caller could be using as its current
stream). A tensor allocated in a branch returns, when freed, to its side stream's pool, which the
side stream reuses only after a later fork of the same lane, ordered after everything the
current stream did before that fork. So the current stream must be done with such a tensor before
the lane's next fork, or keep it alive until that branch's join; the steps here do (a branch's
outputs are read before the next fork of its lane, and freed after its join).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import _C

LANE_STEP = 1    # a step's own branch (the public-ops step's target pass, the trainer's tail)
LANE_GROUPS = 2  # head group g >= 1 of GroupsStep runs on lane LANE_GROUPS + g - 1

def enabled() -> bool:
    """Whether the side streams are on (the process-wide switch; CUDA devices only)."""
    return _C._side_streams_enabled()


def set_enabled(on: bool) -> bool:
    """Turns the side streams on or off for the process; returns the previous setting."""
    return _C._set_side_streams(bool(on))


def group_lane(group: int) -> int:
    """The lane of head group ``group`` of a ``GroupsStep`` (group 0 stays on the current stream)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group_lane: group must be an int >= 1 (group 0 runs on the current stream), got {group!r}")
    return LANE_GROUPS + group - 1


@functools.lru_cache(maxsize=None)
def _cuda_kernels_built() -> bool:
    """dqn_ops.cuda_kernels_built(), asked once (a Branch is made on every step's host path)."""
    from . import cuda_kernels_built  # (the package imports this module)

    return cuda_kernels_built()


def _side_stream(device: torch.device, lane: int) -> torch.cuda.ExternalStream:
    """The extension's side stream of (device, current stream, lane, this thread), made and kept
    by the C++ registry (csrc/cuda/side_stream.h), wrapped for torch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index).cuda_stream
    return torch.cuda.ExternalStream(_C._side_stream(index, current, lane), device=torch.device("cuda", index))


class Branch:
    """Work beside the current stream of ``device``: constructing it forks (the side stream of
    ``lane`` waits for everything enqueued so far), ``with branch:`` makes the side stream
    current for its body, ``join()`` makes the current stream wait for the side stream's work.
    Join before anything reads what the branch wrote; ``join()`` may be called more than once.
    Inactive (the body runs on the current stream, fork and join do nothing) when the switch is
    off, ``device`` is not a CUDA device or the extension was built without its CUDA kernels
    (whose ops then raise their own clear error)::

        branch = Branch(device, LANE_STEP)
        try:
            with branch:
                target_out = ...   # on the side stream
            online_out = ...       # on the current stream, meanwhile
        finally:
            branch.join()
    """

    def __init__(self, device, lane: int):
        if isinstance(lane, bool) or not isinstance(lane, int) or lane < 1:
            raise ValueError(f"Branch: lane must be an int >= 1 (lane 0 is the CUDA ops' own), got {lane!r}")
        device = torch.device(device)
        self.active = device.type == "cuda" and enabled() and _cuda_kernels_built()
        self._main: Optional[torch.cuda.Stream] = None
        self._side: Optional[torch.cuda.ExternalStream] = None
        self._open = False
        self._ctx = None
        if self.active:
            self._main = torch.cuda.current_stream(device)
            self._side = _side_stream(device, lane)
            self._side.wait_stream(self._main)
            self._open = True

    def __enter__(self):
        if self.active:
            if not self._open:
                raise RuntimeError("Branch: joined already; make a new Branch to fork again")
            self._ctx = torch.cuda.stream(self._side)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(*exc)
        return False

    def join(self):
        if self._open:
            self._open = False
            self._main.wait_stream(self._side)

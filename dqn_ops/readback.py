"""Deferred readback of per-step scalars.

The training step writes its scalars into a ring of ``interval`` rows on the device. Every
``interval`` steps (or before a graph that records several steps at once would overwrite rows
not yet copied: ``make_room``) the host enqueues an asynchronous copy of the ring into pinned
memory, in stream order, so the copy sees exactly the steps before it whatever the host has
queued since; the host reads a copy once its event says it has landed (an event query, not a
sync). A sticky device flag, which the step's ``record_step`` kernel also stores into pinned
host memory (on CUDA through the allocation's device mapping: no copy, no event, no CUDA call
on the host's side), tells the host that a step was non-finite an enqueue or two after the GPU
ran it (the
host may have enqueued more steps by then: graph replays are one launch each, so a host ahead
of the GPU is up to the CUDA launch queue ahead, and those steps are skipped by the optimizer
too); the caller then forces an immediate, synchronising readback.

Memory is bounded: the rows read back feed running aggregates over all steps (O(1) per row)
and a window of the most recent rows (``rows``: at least the last ``window`` of them, at most
twice that; ``summary(last=N)`` for N up to ``window``). Rows that are non-finite or flagged
(``bad_field``) are kept apart with their step numbers (``take_bad_rows``) until the owner
takes them. Step numbers: row k of the readback is step ``k + offset``, where the owner moves
the offset with ``set_next_step`` (e.g. after a checkpoint restored its step count).

On CUDA every copy and event goes on the current stream of the readback's device (the
caller's stream, a side stream included), whichever device is current.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .ops import record_step


DEFAULT_WINDOW = 10_000  # recent rows kept for summary(last=N) (a few MB at most)


class DeferredReadback:
    def __init__(self, fields: Sequence[str], interval: int, device, window: int = DEFAULT_WINDOW,
                 bad_field: Optional[str] = None):
        if int(interval) < 1:
            raise ValueError(f"readback_interval must be >= 1, got {interval}")
        if int(window) < 1:
            raise ValueError(f"DeferredReadback: window must be >= 1, got {window}")
        self.fields = tuple(fields)
        self.interval = int(interval)
        self.window = int(window)
        self.bad_field = bad_field
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self.ring = torch.zeros(self.interval, len(self.fields), device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # next ring row, on the device
        self.flag = torch.zeros(1, device=self.device)  # sticky: 1 once a step was non-finite
        # CUDA: the flag as record_step's kernel stores it into pinned host memory (None on the CPU,
        # where the host reads `flag` itself)
        self._host_flag = torch.zeros(1, pin_memory=True) if self._pin else None
        self._extra: Dict[str, Tensor] = {}  # small device tensors copied with each readback
        # (event, first row, count, step number of the first row, host_ring, host_extra), in stream order
        self._pending = deque()
        self._free = []          # host buffers to reuse
        self.steps_recorded = 0  # steps the host has enqueued
        self.steps_copied = 0    # steps covered by copies enqueued so far
        self._step_offset = 0    # step number of row k: k + offset
        self._steps_read = 0
        # the most recent rows read back, in step order (at least `window` of them, at most 2 x window)
        self.rows: List[Dict[str, float]] = []
        self.last_step_read: Optional[int] = None  # step number of rows[-1]
        # running aggregates of each field's finite values
        self._sum = {f: 0.0 for f in self.fields}
        self._count = {f: 0 for f in self.fields}
        self._max = {f: None for f in self.fields}
        self._bad: List[Tuple[int, Dict[str, float]]] = []  # (step number, row) not taken yet
        self.extra: Dict[str, list] = {}         # latest read-back value of each watched tensor

    def watch(self, name: str, t: Tensor):
        """Also copy the device tensor `t` at each readback; its latest value lands in self.extra[name]."""
        self._extra[name] = t

    @property
    def steps_read(self) -> int:
        return self._steps_read

    def set_next_step(self, step: int):
        """The next recorded step is step number `step` (what was recorded before keeps its
        numbers: its copy is enqueued now, no sync)."""
        if self.steps_recorded > self.steps_copied:
            self._enqueue_copy()
        self._step_offset = int(step) - self.steps_recorded

    def take_bad_rows(self) -> List[Tuple[int, Dict[str, float]]]:
        """(step number, row) of every row read back since the last call that was non-finite or
        had ``bad_field`` > 0."""
        bad, self._bad = self._bad, []
        return bad

    # -- inside the step, on the device (capturable, no sync) ---------------------------
    def record(self, values: Sequence[Tensor], non_finite: Tensor):
        """Writes this step's scalars into the ring; `non_finite` (one element, 1.0 = bad) sets the flag."""
        # One kernel (dqn_ops.record_step) instead of five torch ones: stack, index_copy, add,
        # remainder, maximum.
        record_step(self.ring, self.slot, self.flag, [v.reshape(1).to(self.ring.dtype) for v in values],
                    non_finite.reshape(1).to(self.flag.dtype), self._host_flag)

    # -- on the host, after each step -------------------------------------------------
    def make_room(self, count: int):
        """Before enqueueing `count` steps at once (a CUDA graph that records several steps per
        replay): enqueues the copy of the rows not yet copied if those steps would overwrite
        them. ``count`` must fit the ring (``count <= interval``)."""
        if not 1 <= count <= self.interval:
            raise ValueError(f"DeferredReadback: {count} steps at once do not fit the ring of {self.interval} rows "
                             f"(readback_interval): the earliest rows would be overwritten before their copy")
        if self.steps_recorded - self.steps_copied + count > self.interval:
            self._enqueue_copy()

    def after_step(self, count: int = 1) -> bool:
        """Bookkeeping after `count` steps were enqueued (more than one: call ``make_room(count)``
        before enqueueing them). Returns True once the non-finite flag has been seen (then call
        readback() to get the values)."""
        if self.steps_recorded - self.steps_copied + count > self.interval:
            raise RuntimeError(f"DeferredReadback: {count} steps were enqueued over rows not yet copied (call "
                               f"make_room({count}) before enqueueing several steps at once)")
        self.steps_recorded += count
        if self.steps_recorded - self.steps_copied >= self.interval:
            self._enqueue_copy()
        self._collect(block=False)
        if self._host_flag is None:
            return self.flag.item() > 0
        # The flag as the last step the GPU has finished stored it: no sync, no CUDA call. It only
        # rises until reset_flag, so reading it a step late misses nothing. (.item(), not an
        # indexing and a comparison: two tensor ops on every step's host path.)
        return self._host_flag.item() > 0

    def readback(self):
        """Reads every recorded step's values now (synchronises with the device)."""
        if self.steps_recorded > self.steps_copied:
            self._enqueue_copy()
        self._collect(block=True)

    def summary(self, last=None) -> Dict[str, float]:
        """Aggregates of the rows read back so far (no sync), over the last `last` or all:
        steps (the step count as of the last step read back: its number + 1, so a loaded
        checkpoint's steps count), loss (mean), loss_last, grad_norm_mean, grad_norm_max, mean_q,
        skipped. The means and the max are over the finite values (a skipped step's NaN loss would make
        every later aggregate NaN; such steps are counted in ``skipped`` and kept apart by
        ``take_bad_rows``); NaN when there are none."""
        out: Dict[str, float] = dict(steps=0.0 if self.last_step_read is None else float(self.last_step_read + 1))
        if not self._steps_read:
            return out
        if last and last < self._steps_read:
            if last > self.window:
                raise ValueError(f"DeferredReadback.summary: last={last} is more than the {self.window} recent rows "
                                 f"kept (the window); leave last=None for aggregates over all steps")
            finite = {f: [r[f] for r in self.rows[-last:] if math.isfinite(r[f])]
                      for f in ("loss", "grad_norm", "mean_q", "skipped")}
            total, count = {f: sum(v) for f, v in finite.items()}, {f: len(v) for f, v in finite.items()}
            gmax = max(finite["grad_norm"], default=None)
        else:  # all steps: the running aggregates
            total, count, gmax = self._sum, self._count, self._max["grad_norm"]

        def mean(f):
            return total[f] / count[f] if count[f] else math.nan

        out.update(loss=mean("loss"), loss_last=self.rows[-1]["loss"], grad_norm_mean=mean("grad_norm"),
                   grad_norm_max=math.nan if gmax is None else gmax, mean_q=mean("mean_q"), skipped=total["skipped"])
        return out

    def reset_flag(self):
        self.flag.zero_()
        if self._host_flag is not None:
            # A step still in flight would store the old flag after the host's zero: wait for
            # every step enqueued so far (the device's zero included) first.
            torch.cuda.current_stream(self.device).synchronize()
            self._host_flag.zero_()

    def _enqueue_copy(self):
        first, count = self.steps_copied, self.steps_recorded - self.steps_copied
        host_ring, host_extra = self._free.pop() if self._free else (
            torch.empty(self.ring.shape, pin_memory=self._pin), {})
        host_ring.copy_(self.ring, non_blocking=True)
        for name, t in self._extra.items():
            if name not in host_extra or host_extra[name].shape != t.shape:
                host_extra[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
            host_extra[name].copy_(t, non_blocking=True)
        event = None
        if self._pin:  # on the stream the copies went on: the device's current one (not the current device's)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._pending.append((event, first, count, first + self._step_offset, host_ring, host_extra))
        self.steps_copied = self.steps_recorded

    def _collect(self, block: bool):
        while self._pending:
            event, first, count, first_step, host_ring, host_extra = self._pending[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()
            self._pending.popleft()
            ring = host_ring.tolist()
            for k in range(count):
                self._add_row(dict(zip(self.fields, ring[(first + k) % self.interval])), first_step + k)
            if len(self.rows) > 2 * self.window:  # amortised O(1) per row
                del self.rows[:len(self.rows) - self.window]
            for name, t in host_extra.items():
                self.extra[name] = t.tolist()
            self._free.append((host_ring, host_extra))

    def _add_row(self, row: Dict[str, float], step: int):
        self.rows.append(row)
        self.last_step_read = step
        self._steps_read += 1
        for f, v in row.items():
            if not math.isfinite(v):
                continue
            self._sum[f] += v
            self._count[f] += 1
            m = self._max[f]
            if m is None or v > m:  # as max() over the sequence
                self._max[f] = v
        if (self.bad_field is not None and row.get(self.bad_field, 0) > 0) or \
                not all(math.isfinite(v) for v in row.values()):
            self._bad.append((step, row))

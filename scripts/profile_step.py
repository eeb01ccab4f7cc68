#!/usr/bin/env python3
"""Kernel-level profile of one dqn_ops training step: every GPU kernel of the step, in order,
with its duration, for the eager step and for a replay of the captured graph (torch profiler /
CUPTI). This is where the launch counts and per-kernel times of bench/NOTES.md come from. For
the graph it also gives the host's own time per step (enqueued while the GPU sleeps): the floor
a step timed back to back cannot go under, whatever its kernels take.

    python3 scripts/profile_step.py --batches 256 4096 --out bench/results
    python3 scripts/profile_step.py --network cleanrl_c51 --batches 256   # a network of bench_networks.py
    python3 scripts/profile_step.py --batches 256 --graph-dot gpu_out     # also the graph's nodes and edges

Writes <out>/profile.txt (every batch; profile-<network>.txt for another network than the
reference) and prints a summary. --graph-dot DIR also writes DIR/graph-<network>-B<batch>.dot:
the step's graph as CUDA describes it (cudaGraphDebugDotPrint: every node with its parameters,
every edge with its type, a programmatic dependent launch's included).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dqn_ops import Trainer, TrainerConfig  # noqa: E402

from bench import random_batch  # noqa: E402
from bench_networks import NETWORKS, describe  # noqa: E402
from bench_common import result_path, run_meta, time_us  # noqa: E402


def kernel_trace(fn, repeats: int = 5):
    """[(name, start µs, µs)] of the GPU activity of the last of `repeats` calls of fn, in start
    order, each start from the first one's (kernels on the side streams, and under PDL a kernel
    waiting for its predecessor, overlap: a duration alone overstates a kernel's cost)."""
    for _ in range(repeats - 1):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    span = (events[-1].time_range.end - events[0].time_range.start) if events else 0.0
    t0 = events[0].time_range.start if events else 0.0
    return [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in events], span


def host_us(fn, calls: int = 200, sleep_ms: float = 100.0) -> float:
    """Wall-clock µs the host takes to enqueue one call of fn while the GPU is held busy (a sleep
    kernel ahead of the calls), so that no call waits for the device: the host's own cost per
    step, which bounds a step timed back to back from below however fast its kernels get."""
    fn()
    torch.cuda.synchronize()
    # the rated SM clock in kHz (torch builds without the field: 2 GHz, the H200's ~1.98)
    clock_khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(sleep_ms * clock_khz))  # cycles at the rated clock: at least sleep_ms
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    if host * calls > 0.8e3 * sleep_ms:
        print(f"host_us: {calls} calls took {host * calls / 1e3:.1f} ms, near the GPU's {sleep_ms} ms sleep: "
              "some calls may have waited for the device", flush=True)
    return host


def dump_graph(c, trainer_kw, B: int, path: str):
    """The trainer's step body captured as CapturedStep captures it (warmed up on the capture's
    side stream first), in a graph in debug mode, written as a DOT file."""
    cfg = TrainerConfig(batch_size=B, use_cuda_graph=False, readback_interval=100, on_non_finite="flag",
                        **trainer_kw)
    t = Trainer(c, cfg, device="cuda", seed=0)
    t.step(random_batch(c, B, torch.device("cuda")))  # the batch into the trainer's inputs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            t._step_body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    with torch.cuda.graph(g, stream=side):
        t._step_body()
    g.debug_dump(path)


def middle_of_three(trace):
    """The middle third of a trace of three identical calls, its starts from its own first (by
    start order; [] when the kernels do not split into three equal runs)."""
    n = len(trace) // 3
    if n == 0 or 3 * n != len(trace) or [k for k, _, _ in trace[:n]] != [k for k, _, _ in trace[n:2 * n]]:
        return []
    t0 = trace[n][1]
    return [(name, start - t0, us) for name, start, us in trace[n:2 * n]]


def short(name: str, width: int = 110) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def section(head: str, trace):
    """The file's lines for one trace: its heading, then a kernel a line."""
    return [head, "", "   start       µs  kernel"] + [f"{start:8.2f} {us:8.2f}  {short(name)}"
                                                   for name, start, us in trace] + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--network", default="reference", choices=list(NETWORKS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    ap.add_argument("--graph-dot", metavar="DIR", help="also write each batch's step graph as a DOT file here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA device")
    meta = run_meta()
    c, trainer_kw = NETWORKS[args.network]
    lines = ["# dqn_ops training step, kernel traces (per kernel, in start order: its start from the first's, "
             "its µs)", f"# {meta}", f"# network {args.network}: {describe(args.network)}", ""]
    for B in args.batches:
        lines += [f"# B = {B}", ""]
        for graph in (False, True):
            cfg = TrainerConfig(batch_size=B, use_cuda_graph=graph, readback_interval=100, on_non_finite="flag",
                                **trainer_kw)
            t = Trainer(c, cfg, device="cuda", seed=0)
            batch = random_batch(c, B, torch.device("cuda"))
            trace, span = kernel_trace(lambda: t.step(batch))
            busy = sum(us for _, _, us in trace)
            head = (f"## B = {B}, {'graph replay' if graph else 'eager'}: {len(trace)} kernels, sum of kernel times "
                    f"{busy:.1f} µs, first start to last end {span:.1f} µs")
            print(head[3:], flush=True)
            lines += section(head, trace)
            if graph:
                # The replay alone (no batch copy): its span is the GPU's time for the step's kernels
                # and the gaps between them; timed back to back, what a step costs once the host
                # keeps ahead.
                replay, span = kernel_trace(t._runner)
                busy = sum(us for _, _, us in replay)
                back_to_back = time_us(t._runner, 300, 3)
                step_back_to_back = time_us(t.step, 300, 3)
                note = (f"B = {B}, graph replay alone: {len(replay)} kernels, sum {busy:.1f} µs, first start to last "
                        f"end {span:.1f} µs (gaps {span - busy:.1f}); replays back to back {back_to_back:.1f} µs each; "
                        f"Trainer.step() back to back {step_back_to_back:.1f} µs; host time to enqueue one step with "
                        f"the GPU busy: Trainer.step() {host_us(t.step):.1f} µs, the replay alone "
                        f"{host_us(t._runner):.1f} µs")
                print(note, flush=True)
                lines += section(f"## {note}", replay)
                # The same replay in steady state: the second of three enqueued back to back, so
                # that the host has submitted every node before the GPU reaches it (a replay
                # traced from an idle GPU may wait on the host's submission of its next nodes).
                middle = middle_of_three(kernel_trace(lambda: [t._runner() for _ in range(3)])[0])
                if middle:
                    busy, span = sum(us for _, _, us in middle), max(start + us for _, start, us in middle)
                    note = (f"B = {B}, the second of three graph replays back to back: {len(middle)} kernels, sum "
                            f"{busy:.1f} µs, its first start to its last end {span:.1f} µs")
                    print(note, flush=True)
                    lines += section(f"## {note}", middle)
        if args.graph_dot:
            os.makedirs(args.graph_dot, exist_ok=True)
            dot = os.path.join(args.graph_dot, f"graph-{args.network}-B{B}.dot")
            dump_graph(c, trainer_kw, B, dot)
            print("wrote", dot, flush=True)
    name = "profile.txt" if args.network == "reference" else f"profile-{args.network}.txt"
    path = result_path(args.out, meta, name)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("wrote", path)


if __name__ == "__main__":
    main()

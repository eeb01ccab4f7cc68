"""Timing helpers shared by the benchmark scripts."""
import statistics

import torch


def time_us(fn, iters, repeats, warmup=5):
    """Median over `repeats` of the mean µs per call of `iters` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) * 1000 / iters)
    return statistics.median(samples)


def graphed(fn):
    """fn captured once in a CUDA graph (after warm-up on a side stream, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay

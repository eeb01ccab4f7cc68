"""Benchmark: one optimizer + target update step, dqn_ops vs the PyTorch sequence.

dqn_ops:  fused_adam_bf16 (norm, then clip + Adam + BF16 mirror) + ema_update (+ target mirror)
PyTorch:  clip_grad_norm_(foreach) + Adam(fused=True, capturable) + mirror.copy_(params)
          + torch._foreach_lerp_(target, online, tau) + target mirror copy

At 288K (the reference network), 10M and 100M parameters; eager and in a CUDA graph; kernels
per step from the torch profiler; achieved bytes/s against a measured device copy.
Writes <out>/optim.{json,md}.
"""
from __future__ import annotations

import argparse
import os

import torch

import dqn_ops
from bench_common import graphed, kernels_per_call, run_meta, time_us, write_results

# Bytes dqn_ops must move per parameter: norm pass reads g (4); Adam reads p, g, m, v (16),
# writes p, m, v (12) and the BF16 mirror (2); EMA reads target and online (8), writes the
# target (4) and its mirror (2).
BYTES_PER_PARAM = 4 + 16 + 12 + 2 + 8 + 4 + 2


def copy_bandwidth():
    n = 1 << 30  # 4 GiB of float32... read + write counted
    a = torch.empty(n // 4, device="cuda")
    b = torch.empty_like(a)
    us = time_us(lambda: b.copy_(a), 10, 3)
    return 2 * a.numel() * 4 / (us * 1e-6)


def make_cases(n, tau=0.005, max_norm=10.0):
    dev = "cuda"
    p = torch.nn.Parameter(torch.randn(n, device=dev) * 0.01)
    p.grad = torch.randn(n, device=dev)
    target = p.detach().clone()
    ours = dqn_ops.FusedAdamBF16([p], lr=1e-4, max_grad_norm=max_norm)
    t_mirror = target.to(torch.bfloat16)

    def ours_step():
        ours.step()
        dqn_ops.ema_update(target, t_mirror, p.detach(), tau)

    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    q_target = q.detach().clone()
    q_mirror, qt_mirror = q.detach().to(torch.bfloat16), q_target.to(torch.bfloat16)
    ref = torch.optim.Adam([q], lr=1e-4, fused=True, capturable=True)

    def torch_step():
        torch.nn.utils.clip_grad_norm_([q], max_norm, foreach=True)
        ref.step()
        q_mirror.copy_(q.detach())
        torch._foreach_lerp_([q_target], [q.detach()], tau)
        qt_mirror.copy_(q_target)

    return [("dqn_ops fused_adam_bf16 + ema_update", ours_step), ("PyTorch clip + Adam(fused) + copies + lerp", torch_step)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[287_998, 10_000_000, 100_000_000])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available() or not dqn_ops.cuda_kernels_built():
        raise SystemExit("bench_optim.py needs a CUDA device and dqn_ops built with its CUDA kernels")
    bw = copy_bandwidth()
    print(f"device copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    rows = []
    for n in args.sizes:
        iters = 200 if n < 1_000_000 else 20
        for name, fn in make_cases(n):
            k = kernels_per_call(fn)
            eager = time_us(fn, iters, 5)
            graph = time_us(graphed(fn), iters, 5)
            achieved = BYTES_PER_PARAM * n / (graph * 1e-6)
            rows.append(dict(params=n, case=name, kernels=k, eager_us=round(eager, 2), graph_us=round(graph, 2),
                             dqn_ops_bytes_per_s=achieved, fraction_of_copy=achieved / bw))
            print(f"n={n:>11,}  {name:44s} kernels {k:3d}  eager {eager:9.1f} us  graph {graph:9.1f} us  "
                  f"({BYTES_PER_PARAM} B/param: {achieved / 1e12:.2f} TB/s, {achieved / bw:.0%} of copy)", flush=True)
    meta = run_meta(copy_bytes_per_s=bw, bytes_per_param=BYTES_PER_PARAM,
                    note="bytes/s counts the bytes dqn_ops must move (BYTES_PER_PARAM) over each row's graphed time")
    lines = [f"# Optimizer + EMA step — {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"Measured copy bandwidth {bw / 1e12:.2f} TB/s. Bytes/s = {BYTES_PER_PARAM} B/param "
             "(what dqn_ops must move) over the graphed time.", "",
             "| params | case | kernels | eager µs | graph µs | TB/s | of copy |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['params']:,} | {r['case']} | {r['kernels']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} | "
              f"{r['dqn_ops_bytes_per_s'] / 1e12:.2f} | {r['fraction_of_copy']:.0%} |" for r in rows]
    write_results(args.out, "optim", meta, rows, lines)


if __name__ == "__main__":
    main()

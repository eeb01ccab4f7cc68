"""Benchmark: spectral norm of every weight matrix, dqn_ops vs a PyTorch loop.

dqn_ops:  batched_spectral_norm (one cooperative launch for all matrices), and the same
          kernel launched once per matrix
PyTorch:  the loop of the anchor step (docs/design.md): per matrix v = normalize(W^T u),
          u = normalize(W v), sigma = u W v, W *= clamp(sigma_max / sigma, max=1)
          (+ the BF16 mirror copy dqn_ops also writes)

Cases: the reference network's 10 matrices (one power iteration, sigma_max = 1), and one
1024 x 4096 matrix. Eager and in a CUDA graph; kernels per call from the torch profiler.
Writes <out>/spectral.{json,md}.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import dqn_ops
from bench_common import graphed, kernels_per_call, run_meta, time_us, write_results

SIGMA_MAX = 1.0


def torch_loop(weights, us, mirror, flat):
    def step():
        with torch.no_grad():
            for w, u in zip(weights, us):
                v = F.normalize(w.t() @ u, dim=0)
                u.copy_(F.normalize(w @ v, dim=0))
                sigma = u @ w @ v
                w.mul_(torch.clamp(SIGMA_MAX / sigma, max=1.0))
            mirror.copy_(flat)
    return step


def cases_reference():
    net = dqn_ops.DuelingBranchQNet(device="cuda")
    sn = dqn_ops.SpectralNorm(net, SIGMA_MAX, 1)
    ref_net = dqn_ops.DuelingBranchQNet(device="cuda")
    ref_net.load_state_dict(net.state_dict())
    weights = list(ref_net.weight_matrices().values())
    us = [torch.nn.functional.normalize(torch.randn(w.shape[0], device="cuda"), dim=0) for w in weights]
    return [("dqn_ops batched_spectral_norm (1 launch)", lambda: sn()),
            ("dqn_ops, one launch per matrix", lambda: sn(one_launch_per_matrix=True)),
            ("PyTorch loop (+ mirror copy)", torch_loop(weights, us, ref_net.params_bf16, ref_net.flat_params.data))]


def cases_large(rows=1024, cols=4096):
    flat = torch.randn(rows * cols, device="cuda") / cols ** 0.5
    mirror = flat.to(torch.bfloat16)
    u = F.normalize(torch.randn(rows, device="cuda"), dim=0)
    v = F.normalize(torch.randn(cols, device="cuda"), dim=0)
    sigma = torch.empty(1, device="cuda")
    flat_ref = flat.clone()
    u_ref = u.clone()
    mirror_ref = mirror.clone()
    ours = lambda: dqn_ops.batched_spectral_norm(flat, mirror, u, v, sigma, [0, rows, cols], [SIGMA_MAX], 1)
    return [("dqn_ops batched_spectral_norm (1 launch)", ours),
            ("PyTorch loop (+ mirror copy)", torch_loop([flat_ref.view(rows, cols)], [u_ref], mirror_ref, flat_ref))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available() or not dqn_ops.cuda_kernels_built():
        raise SystemExit("bench_spectral.py needs a CUDA device and dqn_ops built with its CUDA kernels")
    rows = []
    for label, cases in [("reference network, 10 matrices", cases_reference()),
                         ("one 1024 x 4096 matrix", cases_large())]:
        for name, fn in cases:
            k = kernels_per_call(fn)
            eager = time_us(fn, 200, 5)
            graph = time_us(graphed(fn), 200, 5)
            rows.append(dict(matrices=label, case=name, kernels=k, eager_us=round(eager, 2), graph_us=round(graph, 2)))
            print(f"{label:32s} {name:42s} kernels {k:3d}  eager {eager:8.1f} us  graph {graph:8.1f} us", flush=True)
    meta = run_meta(sigma_max=SIGMA_MAX, n_power_iterations=1)
    lines = [f"# Spectral norm — {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             "One power iteration and the sigma clamp on every matrix, BF16 mirror written. "
             "Median over repeats of the mean time per call (CUDA events); kernels per call from the torch profiler.",
             "", "| matrices | case | kernels | eager µs | CUDA graph µs |", "|---|---|---|---|---|"]
    lines += [f"| {r['matrices']} | {r['case']} | {r['kernels']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} |"
              for r in rows]
    write_results(args.out, "spectral", meta, rows, lines)


if __name__ == "__main__":
    main()

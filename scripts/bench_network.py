"""Benchmark: the network ops (forward, backward) vs plain PyTorch nn.Linear, eager and in a
CUDA graph. Prints a table; writes bench/results/network.{json,md}.

    python3 scripts/bench_network.py                 # reference config, B = 256 and 4096
    python3 scripts/bench_network.py --batch 256 1024 4096 --out /tmp/results

Times are the median over --repeats runs of --iters back-to-back calls, measured with CUDA
events; graphed rows capture one call in a torch.cuda.CUDAGraph and time its replays.
"""
from __future__ import annotations

import argparse
import os
import platform

import torch

import dqn_ops
from bench_common import graphed, run_meta, time_us, write_results
from dqn_ops import DQNConfig, DuelingBranchQNet
from dqn_ops.rl.baseline import TorchDuelingBranchNet


def bench_batch(c, B, iters, repeats):
    dev = "cuda"
    rows = []
    net = DuelingBranchQNet(c).to(dev)
    layout = net._layout_ints
    params, mirror = net.flat_params.detach(), net.params_bf16
    s = torch.randn(B, c.state_dim, device=dev)
    gq = torch.randn(B, c.total_actions, c.atoms, device=dev)
    saved = dqn_ops.bf16_dueling_forward(s, params, mirror, layout)

    def ours_fwd():
        dqn_ops.bf16_dueling_forward(s, params, mirror, layout)

    def ours_bwd(precision):
        return lambda: dqn_ops.mixed_backward(gq, None, saved, params, mirror, layout, precision)

    def ours_step(precision):
        def f():
            out = dqn_ops.bf16_dueling_forward(s, params, mirror, layout)
            dqn_ops.mixed_backward(gq, None, out, params, mirror, layout, precision)
        return f

    cases = [("dqn_ops forward (BF16)", "forward", ours_fwd)]
    for p in ("tf32", "bf16", "fp32"):
        cases.append((f"dqn_ops mixed_backward ({p})", "backward", ours_bwd(p)))
    for p in ("tf32", "bf16"):
        cases.append((f"dqn_ops forward + backward ({p})", "forward+backward", ours_step(p)))

    torch_net = TorchDuelingBranchNet(c).to(dev)
    x = s.clone()

    def torch_fwd(amp):
        def f():
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                torch_net(x)[0]
        return f

    def torch_step(amp):
        def f():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                q = torch_net(x)[0]
            q.float().backward(gq)
        return f

    for amp, label in ((False, "F32"), (True, "autocast BF16")):
        cases.append((f"PyTorch nn.Linear forward ({label})", "forward", torch_fwd(amp)))
        cases.append((f"PyTorch nn.Linear forward + backward ({label})", "forward+backward", torch_step(amp)))

    for name, kind, fn in cases:
        eager = time_us(fn, iters, repeats)
        graph = time_us(graphed(fn), iters, repeats)
        rows.append(dict(batch=B, case=name, kind=kind, eager_us=round(eager, 2), graph_us=round(graph, 2)))
        print(f"B={B:6d}  {name:48s} eager {eager:9.1f} us   graph {graph:9.1f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available() or not dqn_ops.cuda_kernels_built():
        raise SystemExit("bench_network.py needs a CUDA device and dqn_ops built with its CUDA kernels")

    c = DQNConfig()
    torch.backends.cuda.matmul.allow_tf32 = False  # "F32" rows are true F32
    rows = []
    for B in args.batch:
        rows += bench_batch(c, B, args.iters, args.repeats)

    meta = run_meta(python=platform.python_version(), config=dict(c.__dict__), parameters=c.num_parameters,
                    iters=args.iters, repeats=args.repeats,
                    method="median over repeats of the mean time per call of iters back-to-back calls (CUDA events)")
    lines = [f"# Network ops vs PyTorch nn.Linear — {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"Reference config ({c.num_parameters:,} parameters). {meta['method']}.", "",
             "| B | case | eager µs | CUDA graph µs |", "|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['case']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} |" for r in rows]
    write_results(args.out, "network", meta, rows, lines)


if __name__ == "__main__":
    main()

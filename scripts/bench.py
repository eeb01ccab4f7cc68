"""The whole DQN training step, side by side: plain PyTorch against dqn_ops.

    python3 scripts/bench.py                       # a GPU: every mode at B = 256 ... 65536
    python3 scripts/bench.py --batches 256 4096 --modes dqn_ops_graph torch_graph_f32
    python3 scripts/bench.py --device cpu --batches 32 --modes torch_eager_f32 dqn_ops_eager --iters 3

Modes (reference config, the step of dqn_ops.Trainer / dqn_ops.rl.baseline.TorchTrainer: three
forwards, C51 loss, backward, clip, Adam, spectral norm, EMA):
  torch_eager_f32, torch_eager_bf16       plain PyTorch, F32 (TF32 off) / autocast BF16
  torch_graph_f32, torch_graph_bf16       the PyTorch step captured in one CUDA graph
  torch_compile_graph_f32, _bf16          torch.compile of the forward+loss and of the post-step
                                          updates, the whole step then in one CUDA graph
                                          (the anchor step's compile_graph_*, docs/design.md)
  torch_compile_reduce_overhead           torch.compile(mode="reduce-overhead") of the step
                                          (reported as failed, with the reason, if it fails)
  dqn_ops_eager, dqn_ops_graph            dqn_ops.Trainer without / with its CUDA graph

torch.compile recompiles for every batch size (tens of seconds each): on a time-limited GPU
machine, run the compile modes in a call of their own.

Also: a per-op table of dqn_ops at B = 256 and 4096 (each op graphed alone: the stages of the
step on the public ops and of the trainer's step on the internal ops, dqn_ops/step.py), kernels
per step (torch profiler), and at the large batches the achieved TFLOP/s against the cuBLAS BF16 rate
measured on the step's own GEMM shapes. Writes <out>/step.{json,md} and a
log-log plot step.png (time per step vs batch).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dqn_ops  # noqa: E402
from dqn_ops import DQNConfig, Trainer, TrainerConfig  # noqa: E402
from dqn_ops.rl.baseline import TorchTrainer  # noqa: E402
from dqn_ops.step import InternalOpsStep, PublicOpsStep  # noqa: E402

from bench_common import (graphed, headless_pyplot, kernels_per_call, run_meta, switches_note, time_us,  # noqa: E402
                          write_results)

MODES = ("torch_eager_f32", "torch_eager_bf16", "torch_graph_f32", "torch_graph_bf16", "torch_compile_graph_f32",
         "torch_compile_graph_bf16", "torch_compile_reduce_overhead", "dqn_ops_eager", "dqn_ops_graph")
BATCHES = (256, 1024, 4096, 16384, 65536)


def random_batch(c: DQNConfig, B: int, device):
    g = torch.Generator(device=device).manual_seed(B)
    return dict(states=torch.randn(B, c.state_dim, device=device, generator=g),
                next_states=torch.randn(B, c.state_dim, device=device, generator=g),
                actions=torch.stack([torch.randint(0, n, (B,), device=device, generator=g) for n in c.branches], 1),
                rewards=torch.randn(B, device=device, generator=g),
                dones=(torch.rand(B, device=device, generator=g) < 0.05).float(),
                indices=torch.randint(0, 1 << 20, (B,), device=device, generator=g))  # replay rows: bootstrap masks


def make_step(mode: str, c: DQNConfig, B: int, device, **trainer_kw):
    """A zero-argument function running one training step of `mode` on a fixed batch
    (trainer_kw: TrainerConfig fields, e.g. loss_type; without it the atoms pick it)."""
    graph = "graph" in mode
    cfg = TrainerConfig(batch_size=B, use_cuda_graph=graph, readback_interval=100, on_non_finite="flag",
                        **trainer_kw)
    if mode.startswith("dqn_ops"):
        trainer = Trainer(c, cfg, device=device, seed=0)
    else:
        # plain PyTorch throughout: IQN's fractions by torch.rand (not dqn_ops's iqn_fractions)
        trainer = TorchTrainer(c, cfg, device=device, seed=0, amp=mode.endswith("bf16"), fractions="torch")
        if "compile" in mode:
            # Each network and batch compiles afresh, as in a process that trains one network:
            # compiles of the same code for earlier networks would otherwise make the config's
            # ints dynamic and count toward the recompile limit (past it dynamo runs eager).
            torch.compiler.reset()
        if "compile" in mode and mode != "torch_compile_reduce_overhead":
            trainer.compile_parts()
    trainer.step(random_batch(c, B, device))
    if mode == "torch_compile_reduce_overhead":
        return torch.compile(trainer._step_body, mode="reduce-overhead")
    return trainer.step


def step_flops(c: DQNConfig, B: int) -> float:
    """GEMM FLOPs of one step: 3 forwards (online s, online s', target s') and the backward
    (dW and dX of every layer but the first layer's dX)."""
    from dqn_ops import ParamLayout

    mats = [shape for _, shape, _ in ParamLayout(c).weight_matrices()]
    fwd = sum(2 * B * o * i for o, i in mats)
    first_dx = 2 * B * mats[0][0] * mats[0][1]
    return 3 * fwd + 2 * fwd - first_dx


def cublas_floor_us(c: DQNConfig, B: int, device) -> float:
    """Time of the step's GEMMs alone, as BF16 torch.matmul (cuBLAS), each shape graphed."""
    from dqn_ops import ParamLayout

    total = 0.0
    for k, (_, (o, i), _) in enumerate(ParamLayout(c).weight_matrices()):
        x = torch.randn(B, i, device=device, dtype=torch.bfloat16)
        w = torch.randn(o, i, device=device, dtype=torch.bfloat16)
        dy = torch.randn(B, o, device=device, dtype=torch.bfloat16)
        gemms = [lambda: x @ w.t()] * 3 + [lambda: dy.t() @ x]  # 3 forwards, dW
        if k > 0:
            gemms.append(lambda: dy @ w)  # dX (none for the first layer: the states need no gradient)
        for fn in gemms:
            total += time_us(graphed(fn), 50, 3)
    return total


def per_op_rows(c: DQNConfig, B: int, device):
    """Each dqn_ops op of the step graphed alone: the stages of the public-ops step
    (dqn_ops.step.PublicOpsStep), those of the trainer's step on the internal ops
    (dqn_ops.step.InternalOpsStep, its forward in two passes and with the networks batched), then
    the optimizer, spectral norm and EMA. Each stage's inputs come from one eager call of the
    stage before it."""
    t = Trainer(c, TrainerConfig(batch_size=B, use_cuda_graph=False), device=device, seed=0)
    t.step(random_batch(c, B, device))
    net, tgt, x, cfg = t.online, t.target, t.inputs, t.config
    prec = cfg.backward_precision
    kw = dict(loss_type=t.loss_type, v_min=cfg.v_min, v_max=cfg.v_max, gamma=cfg.gamma, precision=prec)
    public = PublicOpsStep(net, tgt, **kw)
    internal = {bn: InternalOpsStep(net, tgt, batch_networks=bn, **kw) for bn in (False, True)}
    batch = (x["actions"], x["rewards"], x["dones"], x["weights"])
    loss_kind = "fused: dueling + loss + head grad" if t.uses_fused_path else "dueling + loss + head grad"
    labels = {"public ops": ("forward, online [s; s'] + target s'", f"loss ({t.loss_type} + grad)", "backward"),
              "internal ops": ("forward to logits, online [s; s'] + target s' (two passes)",
                               f"loss on logits ({loss_kind})", "backward from head")}
    ops = {}
    for (path, (fwd_label, loss_label, bwd_label)), step in zip(labels.items(), (public, internal[False])):
        fwd = step.forward(t._state_pairs)
        out = step.loss(fwd, *batch)
        ops[f"{path}: {fwd_label}"] = functools.partial(step.forward, t._state_pairs)
        ops[f"{path}: {loss_label}"] = functools.partial(step.loss, fwd, *batch)
        ops[f"{path}: {bwd_label} ({prec})"] = functools.partial(step.backward, fwd, out)
    ops["internal ops: forward to logits (networks batched)"] = functools.partial(internal[True].forward,
                                                                                 t._state_pairs)
    net.flat_params.grad = public(t._state_pairs, *batch).grad
    ops.update({
        "optimizer (clip + Adam + mirror)": lambda: t.optimizer.step(),
        "spectral norm (10 matrices)": lambda: t.spectral(),
        "EMA + target mirror": lambda: dqn_ops.ema_update(tgt.flat_params, tgt.params_bf16, net.flat_params, cfg.tau),
    })
    return [dict(batch=B, op=name, graph_us=round(time_us(graphed(fn), 200, 5), 2)) for name, fn in ops.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=0, help="steps per timing (default: by batch size)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and dqn_ops.cuda_kernels_built()):
        raise SystemExit("bench.py on cuda needs a CUDA device and dqn_ops built with its CUDA kernels")
    torch.backends.cuda.matmul.allow_tf32 = False  # the F32 baseline is F32
    c = DQNConfig()
    rows = []
    for B in args.batches:
        for mode in args.modes:
            if device.type != "cuda" and ("graph" in mode or "compile" in mode):
                rows.append(dict(batch=B, mode=mode, status="not run: needs CUDA"))
                continue
            iters = args.iters or (300 if B <= 4096 else 50)
            try:
                t0 = time.time()
                fn = make_step(mode, c, B, device)
                us = time_us(fn, iters, 3, device=device)
                k = kernels_per_call(fn) if device.type == "cuda" else None
                row = dict(batch=B, mode=mode, status="ok", step_us=round(us, 2), kernels=k,
                           setup_s=round(time.time() - t0, 1))
            except Exception as e:  # reported, the run goes on (torch.compile reduce-overhead may fail)
                row = dict(batch=B, mode=mode, status=f"failed: {type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(f"B={B:6d}  {mode:30s}  " + (f"{row['step_us']:10.1f} us/step  kernels {row['kernels']}"
                                                if row["status"] == "ok" else row["status"]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    flops_rows = []
    if device.type == "cuda":
        for B in [b for b in args.batches if b >= 4096]:
            floor = cublas_floor_us(c, B, device)
            f = step_flops(c, B)
            ours = next((r for r in rows if r["batch"] == B and r["mode"] == "dqn_ops_graph" and r["status"] == "ok"),
                        None)
            flops_rows.append(dict(batch=B, gflop=round(f / 1e9, 2), cublas_floor_us=round(floor, 1),
                                   cublas_tflops=round(f / floor / 1e6, 1),
                                   dqn_ops_us=ours["step_us"] if ours else None,
                                   dqn_ops_tflops=round(f / ours["step_us"] / 1e6, 1) if ours else None,
                                   ratio_to_floor=round(ours["step_us"] / floor, 2) if ours else None))
    op_rows = [r for B in (256, 4096) if device.type == "cuda" for r in per_op_rows(c, B, device)]

    meta = run_meta(device, config="reference (287,998 parameters)", tf32=False)
    lines = [f"# Training step, side by side — {meta['device']}, torch {meta['torch']}, {meta['date']}"
             + (f"; dqn_ops: {switches_note(meta['switches'])}" if "switches" in meta else ""), "",
             "µs per step (median of 3 timings of back-to-back steps); kernels per step from the torch profiler.", "",
             "| B | " + " | ".join(args.modes) + " |", "|---|" + "---|" * len(args.modes)]
    for B in args.batches:
        cells = []
        for m in args.modes:
            r = next(r for r in rows if r["batch"] == B and r["mode"] == m)
            cells.append(f"{r['step_us']:.0f} ({r['kernels']} k)" if r["status"] == "ok" else r["status"][:40])
        lines.append(f"| {B} | " + " | ".join(cells) + " |")
    if op_rows:
        lines += ["", "dqn_ops per op, each graphed alone (µs):", "", "| B | op | µs |", "|---|---|---|"]
        lines += [f"| {r['batch']} | {r['op']} | {r['graph_us']:.1f} |" for r in op_rows]
    if flops_rows:
        lines += ["", "| B | step GFLOP | cuBLAS BF16 floor µs (TFLOP/s) | dqn_ops graph µs (TFLOP/s) | x floor |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['gflop']} | {r['cublas_floor_us']} ({r['cublas_tflops']}) | "
                  f"{r['dqn_ops_us']} ({r['dqn_ops_tflops']}) | {r['ratio_to_floor']} |" for r in flops_rows]
    if device.type == "cuda":
        stem = write_results(args.out, "step", meta, dict(steps=rows, ops=op_rows, flops=flops_rows), lines)
        _plot(rows, args.modes, stem + ".png", meta)
    else:
        print("\n".join(lines))


def _plot(rows, modes, path, meta):
    plt = headless_pyplot("no plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for m in modes:
        pts = [(r["batch"], r["step_us"]) for r in rows if r["mode"] == m and r["status"] == "ok"]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=m, lw=2.5 if m.startswith("dqn_ops") else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("µs per training step")
    ax.set_title(f"DQN training step — {meta['device']}, torch {meta['torch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

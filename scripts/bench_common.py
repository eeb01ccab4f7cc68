"""Timing helpers shared by the benchmark scripts."""
import statistics

import torch


def time_us(fn, iters, repeats, warmup=5, device=None):
    """Median over `repeats` of the mean µs per call of `iters` back-to-back calls: CUDA events,
    or the wall clock when `device` is the CPU."""
    for _ in range(warmup):
        fn()
    if device is not None and torch.device(device).type == "cpu":
        import time

        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / iters)
        return statistics.median(samples)
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
    """fn captured once in a CUDA graph, as the trainer captures its step (dqn_ops.graphed.CapturedStep:
    warm-up on a side stream, then the capture); returns the graph's replay, which keeps fn alive,
    and so the tensors it closes over: the graph replays their addresses but does not own memory
    allocated outside its capture."""
    from dqn_ops.graphed import CapturedStep

    step = CapturedStep(fn, torch.device("cuda", torch.cuda.current_device()))
    while not step.graphed:
        step()

    def replay():
        step.graph.replay()

    return replay


def kernels_per_call(fn):
    """GPU kernels (and memcpy/memset) one eager call of fn runs, from the torch profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def code_path_switches() -> dict:
    """dqn_ops's run-time switches that change which CUDA code a step runs, as this process has
    them: the side streams (``dqn_ops.side_stream``, env DQN_OPS_SIDE_STREAM) and programmatic
    dependent launch (env DQN_OPS_PDL: "1", the default, or "0"), which keep every bit, and the dense layer
    kernel's mode (``dqn_ops.dense_kernel``, env DQN_OPS_DENSE_KERNEL: "auto", "on" or "off"),
    whose sums may round differently from cuBLAS's, its tile shape (env DQN_OPS_DENSE_TILE,
    "auto" unless forced) and which of its epilogues stage their stores (env DQN_OPS_DENSE_STORES,
    "all" unless "hidden" or "direct"), which keep every bit, and where its input gradients sum
    the bias gradients' columns (env DQN_OPS_EPILOGUE_COLUMN_SUMS: "auto", the default, "off" or
    "on"), whose sums round differently, and whether narrow output layers take its narrow tile
    (env DQN_OPS_NARROW_LOGITS: "0", the default, or "1"), whose sums round differently from
    cuBLAS's, whether the output bias + dueling kernel stages one-atom heads' rows (env
    DQN_OPS_STAGE_HEAD_ROWS: "0", the default, or "1") and whether the dense kernel forms IQN's
    cosines itself (env DQN_OPS_DENSE_COSINES: "0", the default, or "1"), both the same bits."""
    import os

    from dqn_ops import dense_kernel, side_stream

    def flag(var: str, unset: str) -> bool:  # an on / off switch: "0" or "1", `unset` where unset or empty
        return (os.environ.get(var) or unset) == "1"

    return dict(side_streams=side_stream.enabled(), pdl=flag("DQN_OPS_PDL", "1"),
                dense_kernel=dense_kernel.mode(), dense_tile=os.environ.get("DQN_OPS_DENSE_TILE") or "auto",
                dense_stores=os.environ.get("DQN_OPS_DENSE_STORES") or "all",
                epilogue_column_sums=os.environ.get("DQN_OPS_EPILOGUE_COLUMN_SUMS") or "auto",
                narrow_logits=flag("DQN_OPS_NARROW_LOGITS", "0"), staged_head_rows=flag("DQN_OPS_STAGE_HEAD_ROWS", "0"),
                dense_cosines=flag("DQN_OPS_DENSE_COSINES", "0"))


def switches_note(switches: dict) -> str:
    """The switches as a result file's markdown says them: "side streams on, PDL on, dense
    kernel auto" (files written before the dense kernel do not name it), a forced dense tile and
    the dense stores, the epilogue's column sums, the narrow logits, the staged head rows and the
    dense cosines where a file names them (it does since each switch came)."""
    on = lambda key: "on" if switches[key] else "off"  # noqa: E731
    note = f"side streams {on('side_streams')}, PDL {on('pdl')}"
    note += f", dense kernel {switches['dense_kernel']}" if "dense_kernel" in switches else ""
    note += f", dense tile {switches['dense_tile']}" if switches.get("dense_tile", "auto") != "auto" else ""
    note += f", dense stores {switches['dense_stores']}" if "dense_stores" in switches else ""
    sums = switches.get("epilogue_column_sums")
    note += f", epilogue column sums {sums}" if sums else ""
    for key in ("narrow_logits", "staged_head_rows", "dense_cosines"):
        note += f", {key.replace('_', ' ')} {on(key)}" if key in switches else ""
    return note


def run_meta(device="cuda", **extra):
    """What every result file records: date, device, torch and CUDA versions and dqn_ops's
    code-path switches, plus `extra` (on the CPU: date, "cpu", torch)."""
    import datetime

    date = datetime.date.today().isoformat()
    if torch.device(device).type == "cpu":
        return dict(date=date, device="cpu", torch=torch.__version__, **extra)
    return dict(date=date, device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                switches=code_path_switches(), **extra)


def result_path(out_dir, meta, name):
    """<out_dir>/<name>, the path every result file of the scripts gets: undated, so a run
    overwrites the previous one (git keeps the history); the date, device and versions are in
    the file's own meta (`run_meta`). `meta` is accepted for the callers' sake and not used in
    the name. The folder is created."""
    import os

    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, name)


def write_results(out_dir, kind, meta, rows, markdown_lines):
    """Writes <out_dir>/<kind>.json (meta + rows) and <out_dir>/<kind>.md, overwriting the
    previous run's; returns the path stem. The date and device are in `meta` (and in the
    markdown's title, which the caller writes)."""
    from dqn_ops.rl.results import dump_json  # strict JSON: a non-finite number as null

    stem = result_path(out_dir, meta, kind)
    with open(stem + ".json", "w") as f:
        dump_json(dict(meta=meta, rows=rows), f)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(markdown_lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return stem


def headless_pyplot(what):
    """matplotlib.pyplot on the Agg backend (no display needed), or None with a note on stderr
    that `what` is not drawn when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print(f"matplotlib not installed: {what}", file=sys.stderr)
        return None
    return plt

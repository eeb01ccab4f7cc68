import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dqn_ops  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and dqn_ops.cuda_kernels_built()
CUDA_SKIP_REASON = ("no CUDA device here" if not torch.cuda.is_available()
                    else "dqn_ops was built without its CUDA kernels")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_SKIP_REASON)

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

# ~50 ms of GPU clock: far longer than a warm op's launch on the host, and than the host's stalls
# while the suite's xdist workers (one a core) share the machine (behind_a_sleep fails a test
# whose launches outlast the sleep rather than let it pass unchecked).
SLEEP_CYCLES = 100_000_000


@contextlib.contextmanager
def behind_a_sleep(cycles: int = SLEEP_CYCLES):
    """The current stream sleeps, then the body's launches queue behind it. A stream test's
    power rests on the sleep outlasting the host's enqueueing: work launched on another stream
    would run at once, before what the body queued ahead of it. If the sleep had already ended
    when the body returned (a slow host, a first call's module load), the test could not have
    seen a wrong stream, so it fails here rather than pass unchecked."""
    torch.cuda._sleep(cycles)
    slept = torch.cuda.Event()
    slept.record()
    yield
    assert not slept.query(), (f"the host took longer than the {cycles}-cycle sleep to enqueue this test's launches: "
                               f"the test could not tell the streams apart (warm the ops up first)")


def warm_side_stream(warm_up):
    """A new stream with warm_up() run on it once, and warm_up's result. A stream's first launches
    allocate (the caching allocator keeps its blocks per stream; torch's cuBLAS takes a workspace
    per stream) for longer than a sleep need last, so a stream test that queues its ops behind a
    sleep on a side stream warms them on that stream first."""
    torch.cuda.synchronize()  # the inputs, written on the current stream, which `side` does not wait for
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = warm_up()
    torch.cuda.synchronize()
    return side, out


_XDIST_WORKER = False  # this process is an xdist worker (its reports also reach the controller)


def pytest_configure(config):
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")
    config.addinivalue_line("markers", "slow: long-running (training parity)")


def _test_shard() -> tuple[int, int] | None:
    """DQN_OPS_TEST_SHARD="i/n" (0 <= i < n): run the i-th of n interleaved parts of the
    collected tests (the GPU machine's calls have a time limit that the whole suite exceeds)."""
    spec = os.environ.get("DQN_OPS_TEST_SHARD", "")
    if not spec:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
        valid = 0 <= i < n
    except ValueError:
        valid = False
    if not valid:
        raise pytest.UsageError(f'DQN_OPS_TEST_SHARD must be "i/n" with 0 <= i < n, got {spec!r}')
    return i, n


def touches_cuda(item) -> bool:
    """Whether a collected test runs anything on a GPU: it carries a skip-unless-CUDA (or -GPUs)
    marker (requires_cuda, DEVICES' cuda parameter, a module's pytestmark, the multi-GPU marks),
    its id names cuda, or it is a README block (the README picks cuda when there is one)."""
    if "cuda" in item.nodeid.lower() or item.nodeid.startswith("tests/test_readme.py"):
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason or "GPU" in reason:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    deselected = []
    if os.environ.get("DQN_OPS_TEST_CUDA_ONLY") == "1":
        # The GPU machine's calls are short and CI runs every CPU test: there, only the tests
        # that touch CUDA.
        deselected += [item for item in items if not touches_cuda(item)]
        items[:] = [item for item in items if touches_cuda(item)]
    shard = _test_shard()
    if shard is not None:
        i, n = shard
        # Interleaved by position in the collection order (the same on every xdist worker), so
        # each part takes a share of every file.
        deselected += [item for k, item in enumerate(items) if k % n != i]
        items[:] = [item for k, item in enumerate(items) if k % n == i]
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def pytest_runtest_logreport(report):
    """DQN_OPS_FAILURE_LOG=<file>: each failing test's id (and phase) appended to the file as it
    fails, so that a run cut short by the GPU machine's time limit still names its failures
    (pytest prints them only in its final summary), each followed by the place and message of
    its error, every line of it indented. Under xdist the controller writes it, once (the
    workers' reports reach it)."""
    path = os.environ.get("DQN_OPS_FAILURE_LOG")
    if path and report.failed and not _XDIST_WORKER:
        crash = getattr(report.longrepr, "reprcrash", None)
        where = f"{crash.path}:{crash.lineno}: {crash.message}" if crash is not None else str(report.longrepr)
        detail = "\n".join("    " + line for line in where[:4000].splitlines())
        with open(path, "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n{detail}\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def loads_strict_json(text: str):
    """json.loads that rejects NaN / Infinity (not JSON), as strict parsers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def python_with_env(code: str, env_var: str, value, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c code *args` in a fresh interpreter, in this checkout's root (so `tests` is its
    tests/), with `env_var` set to `value` (None: unset) and this process's dqn_ops first on the
    path: dqn_ops's process-wide switches read their variable once, at their first use, so each
    setting needs an interpreter of its own. Returns the finished process (stdout and stderr as
    text)."""
    env = {k: v for k, v in os.environ.items() if k != env_var}
    if value is not None:
        env[env_var] = value
    root = os.path.dirname(os.path.dirname(os.path.abspath(dqn_ops.__file__)))  # where this process found dqn_ops
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this conftest's checkout
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=checkout, capture_output=True, text=True,
                          timeout=timeout)


def saved_with_env(code: str, env_var: str, value, path: str, *args: str):
    """What `code` saves to `path` (its first argument, a torch.save file; `args` after it) run by
    python_with_env."""
    r = python_with_env(code, env_var, value, path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(path)


def assert_same_bits(first: dict, other: dict, what) -> None:
    """Two runs' outputs, {name: [tensors]}, the same names and every tensor finite and the same
    bits (2- and 4-byte elements compared as integers)."""
    assert first.keys() == other.keys(), what
    for name in first:
        assert len(first[name]) == len(other[name]), (what, name)
        for i, (a, b) in enumerate(zip(first[name], other[name])):
            assert torch.isfinite(a.float()).all(), (what, name, i)
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits)), (what, name, i)


def first_forward_error(env_var: str, value: str) -> str:
    """The stderr of a fresh interpreter whose first CUDA forward (the default network, the dense
    kernel on every layer it can run) has `env_var` set to `value`, asserted to have failed: the
    switches read at their first launch refuse a bad value there."""
    code = textwrap.dedent("""
        import torch
        from dqn_ops import DQNConfig, DuelingBranchQNet, dense_kernel
        dense_kernel.set_mode("on")
        net = DuelingBranchQNet(DQNConfig()).to("cuda")
        net.forward_full(torch.randn(4, 96, device="cuda"))
    """)
    r = python_with_env(code, env_var, value, timeout=300)
    assert r.returncode != 0, (env_var, value, r.stdout[-2000:])
    return r.stderr


def switch_at_first_use(env_var: str, value, module: str, calls: str) -> list:
    """What a process-wide switch of dqn_ops makes of its environment variable: `calls` (a tuple of
    callables on dqn_ops.<module>, as Python source) run in a fresh interpreter with `env_var`
    set to `value` (None: unset), one line each, repr(result) or "RuntimeError: <message>". The
    variable is read at the switch's first use, not at the import, so the interpreter must be a
    new one."""
    code = textwrap.dedent(f"""
        from dqn_ops import {module}
        def attempt(f):
            try:
                return repr(f())
            except RuntimeError as e:
                return "RuntimeError: " + str(e)
        for f in ({calls}):
            print(attempt(f))
    """)
    r = python_with_env(code, env_var, value, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dqn_ops  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and dqn_ops.cuda_kernels_built()
CUDA_SKIP_REASON = ("no CUDA device here" if not torch.cuda.is_available()
                    else "dqn_ops was built without its CUDA kernels")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_SKIP_REASON)

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


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


def pytest_collection_modifyitems(config, items):
    shard = _test_shard()
    if shard is None:
        return
    i, n = shard
    # Interleaved by position in the collection order (the same on every xdist worker), so
    # each part takes a share of every file.
    keep = [item for k, item in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = keep


def pytest_runtest_logreport(report):
    """DQN_OPS_FAILURE_LOG=<file>: each failing test's id (and phase) appended to the file as it
    fails, so that a run cut short by the GPU machine's time limit still names its failures
    (pytest prints them only in its final summary). Under xdist the controller writes it, once
    (the workers' reports reach it)."""
    path = os.environ.get("DQN_OPS_FAILURE_LOG")
    if path and report.failed and not _XDIST_WORKER:
        with open(path, "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def loads_strict_json(text: str):
    """json.loads that rejects NaN / Infinity (not JSON), as strict parsers do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)

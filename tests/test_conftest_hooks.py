"""tests/conftest.py's hooks for the GPU machine's short calls: DQN_OPS_FAILURE_LOG (failing tests
named in a file as they fail, each with its error's place and message indented below it: a run
cut short prints no final summary), once each, with and without xdist; DQN_OPS_TEST_CUDA_ONLY
(only the tests that touch CUDA; CI runs the rest)."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_setup_fails(broken):
    pass
'''


def _demo_env(**settings):
    """The environment of a pytest run over a demo file: this one's, without the selection the
    outer run was given (a shard or the CUDA-only filter would drop the demo's tests), plus
    `settings`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DQN_OPS_TEST_SHARD", "DQN_OPS_TEST_CUDA_ONLY", "DQN_OPS_FAILURE_LOG")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(env, **settings)


@pytest.mark.parametrize("workers", [None, 2])
def test_failures_are_logged_as_they_happen(tmp_path, workers):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_demo.py").write_text(DEMO)
    log = tmp_path / "failures.log"
    env = _demo_env(DQN_OPS_FAILURE_LOG=str(log))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_demo.py"]
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed (the GPU runs use it)")
        args += ["-n", str(workers), "-p", "xdist"]
    run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    entries, name = {}, None  # each failure's line: the indented lines under it
    for line in log.read_text().splitlines():
        if line.startswith("    "):
            assert name is not None, log.read_text()
            entries[name].append(line.strip())
        else:
            name = line
            assert name not in entries, log.read_text()
            entries[name] = []
    assert sorted(entries) == ["test_demo.py::test_fails (call)", "test_demo.py::test_setup_fails (setup)"]
    fails, setup = entries["test_demo.py::test_fails (call)"], entries["test_demo.py::test_setup_fails (setup)"]
    assert "test_demo.py:" in fails[0] and "assert False" in fails[0], fails
    assert "test_demo.py:" in setup[0] and "RuntimeError: setup" in setup[0], setup


SELECTION_DEMO = '''
import pytest
from conftest import DEVICES, requires_cuda

def test_cpu_only():
    pass

@pytest.mark.parametrize("device", DEVICES)
def test_both(device):
    pass

@requires_cuda
def test_gpu_only():
    pass

@pytest.mark.skipif(True, reason="needs two CUDA devices and NCCL")
def test_two_gpus():
    pass

def test_refuses_cuda_tensors_named():
    pass
'''


def test_cuda_only_selection_keeps_what_touches_cuda(tmp_path):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_sel.py").write_text(SELECTION_DEMO)
    env = _demo_env(DQN_OPS_TEST_CUDA_ONLY="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "test_sel.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    collected = sorted(line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line)
    assert collected == ["test_both[cuda]", "test_gpu_only", "test_refuses_cuda_tensors_named", "test_two_gpus"]
    assert "4/6 tests collected (2 deselected)" in run.stdout

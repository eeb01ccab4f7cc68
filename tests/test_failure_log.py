"""tests/conftest.py's DQN_OPS_FAILURE_LOG: failing tests named in a file as they fail (a GPU run
cut short by the machine's time limit prints no final summary), once each, with and without xdist."""
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


@pytest.mark.parametrize("workers", [None, 2])
def test_failures_are_logged_as_they_happen(tmp_path, workers):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_demo.py").write_text(DEMO)
    log = tmp_path / "failures.log"
    env = dict(os.environ, DQN_OPS_FAILURE_LOG=str(log), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_demo.py"]
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed (the GPU runs use it)")
        args += ["-n", str(workers), "-p", "xdist"]
    run = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert sorted(log.read_text().splitlines()) == ["test_demo.py::test_fails (call)",
                                                    "test_demo.py::test_setup_fails (setup)"]

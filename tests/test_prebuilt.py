"""scripts/gpu_common.sh's use of a build made elsewhere (scripts/prebuild.sh): tree_stamp hashes
what a build depends on, and use_prebuilt takes a tree's .prebuilt only where its stamp is the
tree's and the module then imports with its CUDA kernels, else leaves nothing behind so that the
caller compiles. Run on copies of this tree's sources in a temporary folder, through bash as the
GPU scripts run them, with this interpreter as their $PY."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dqn_ops

ROOT = Path(__file__).resolve().parents[1]


def _bash(script: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    """`script` after sourcing gpu_common.sh (which cds to the repository root), $OUT in cwd."""
    full = dict(os.environ, PYTHON=sys.executable, OUT=str(cwd / "out"))
    full.pop("TORCH_CUDA_ARCH_LIST", None)  # gpu_common.sh's default unless a test sets it
    full.update(env)
    return subprocess.run(["bash", "-c", f"source {ROOT}/scripts/gpu_common.sh; {script}"], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=120)


def _tree(tmp_path: Path) -> Path:
    """A copy of the sources a build depends on, and the Python package without its build."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    shutil.copy(ROOT / "setup.py", tree / "setup.py")
    shutil.copytree(ROOT / "dqn_ops", tree / "dqn_ops",
                    ignore=shutil.ignore_patterns("*.so", "_build_info.py", "__pycache__"))
    return tree


def _stamp(tree: Path, **env) -> str:
    r = _bash(f"tree_stamp {tree}", tree, **env)
    assert r.returncode == 0 and len(r.stdout.strip()) == 64, r.stderr
    return r.stdout.strip()


def test_the_stamp_changes_with_a_source_setup_py_or_the_architectures(tmp_path):
    tree = _tree(tmp_path)
    first = _stamp(tree)
    assert _stamp(tree) == first
    kernel = tree / "csrc" / "cuda" / "dense_layer.cu"
    kernel.write_text(kernel.read_text() + "\n")
    after_source = _stamp(tree)
    (tree / "setup.py").write_text((tree / "setup.py").read_text() + "\n")
    after_setup = _stamp(tree)
    assert len({first, after_source, after_setup, _stamp(tree, TORCH_CUDA_ARCH_LIST="8.0")}) == 4


def _prebuilt(tree: Path, so: bytes, stamp: str) -> None:
    pre = tree / ".prebuilt"
    pre.mkdir()
    (pre / "_C.abi3.so").write_bytes(so)
    (pre / "_build_info.py").write_text("BUILD_INFO = {}\n")
    (pre / "stamp").write_text(stamp + "\n")


def test_no_prebuilt_build_or_another_trees_is_not_taken(tmp_path):
    tree = _tree(tmp_path)
    r = _bash(f"use_prebuilt {tree}", tree)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    _prebuilt(tree, b"not a module", "0" * 64)
    r = _bash(f"use_prebuilt {tree}", tree)
    assert r.returncode == 1 and "built from another tree or torch; building" in r.stdout, r.stdout
    assert not (tree / "dqn_ops" / "_C.abi3.so").exists()


def test_a_prebuilt_build_that_does_not_import_is_removed(tmp_path):
    tree = _tree(tmp_path)
    _prebuilt(tree, b"not a module", _stamp(tree))
    r = _bash(f"use_prebuilt {tree}", tree)
    assert r.returncode == 1 and "does not import here; building" in r.stdout, (r.stdout, r.stderr)
    assert not (tree / "dqn_ops" / "_C.abi3.so").exists() and not (tree / "dqn_ops" / "_build_info.py").exists()


def test_this_trees_own_build_is_taken_where_its_stamp_matches(tmp_path):
    if not dqn_ops.cuda_kernels_built():
        pytest.skip("this build of dqn_ops has no CUDA kernels (use_prebuilt asks for them)")
    tree = _tree(tmp_path)
    _prebuilt(tree, Path(dqn_ops._C.__file__).read_bytes(), _stamp(tree))
    r = _bash(f"use_prebuilt {tree}", tree)
    assert r.returncode == 0 and "taken" in r.stdout, (r.stdout, r.stderr)
    assert (tree / "dqn_ops" / "_C.abi3.so").read_bytes() == (tree / ".prebuilt" / "_C.abi3.so").read_bytes()

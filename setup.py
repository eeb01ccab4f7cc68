"""Build dqn_ops._C: CUDA + CPU kernels when torch has CUDA and a matching nvcc is found,
CPU kernels only otherwise. The op names are the same either way.

Environment:
  DQN_OPS_CPU_ONLY=1       force a CPU-only build
  TORCH_CUDA_ARCH_LIST     GPU targets (default "9.0", the H200/H100)
  CUDA_HOME                the CUDA toolkit to compile with
  MAX_JOBS                 parallel compile jobs (ninja)
"""
import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _nvcc_major(cuda_home):
    """The major CUDA version of CUDA_HOME's nvcc, or None when it cannot be run."""
    if not cuda_home:
        return None
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def _cublas_paths(cuda_home):
    """Include dir and shared-library file of cuBLAS.

    A full toolkit has them under CUDA_HOME; a machine with only nvcc has them in the
    nvidia-cublas wheel that a CUDA build of torch depends on (site-packages/nvidia/cu13)."""
    candidates = [(os.path.join(cuda_home, "include"), os.path.join(cuda_home, "lib64"))]
    for site in sys.path:
        for sub in glob.glob(os.path.join(site, "nvidia", "cu*")) + [os.path.join(site, "nvidia", "cublas")]:
            candidates.append((os.path.join(sub, "include"), os.path.join(sub, "lib")))
    for inc, lib in candidates:
        if os.path.exists(os.path.join(inc, "cublas_v2.h")):
            libs = sorted(glob.glob(os.path.join(lib, "libcublas.so*")))
            if libs:
                return inc, libs[0]
    return None, None


def _extension():
    cxx_flags = ["-O3", "-std=c++20"]
    # The ABI-stable Python C API is enough: _C only registers ops with the dispatcher.
    define = [("Py_LIMITED_API", "0x03090000")]
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))

    cuda_home = cpp_extension.CUDA_HOME
    why_not = None
    if os.environ.get("DQN_OPS_CPU_ONLY") == "1":
        why_not = "DQN_OPS_CPU_ONLY=1"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is a CPU build"
    else:
        major = _nvcc_major(cuda_home)
        if major is None:
            why_not = f"no nvcc found under CUDA_HOME={cuda_home!r}"
        elif major != int(torch.version.cuda.split(".")[0]):
            why_not = f"nvcc is CUDA {major}, torch was built with CUDA {torch.version.cuda}"
    if why_not is None:
        cublas_inc, cublas_lib = _cublas_paths(cuda_home)
        if cublas_inc is None:
            why_not = "cuBLAS headers/library not found (install nvidia-cublas or a full toolkit)"

    if why_not is not None:
        print(f"dqn_ops: building the CPU kernels only ({why_not})", file=sys.stderr)
        return cpp_extension.CppExtension(
            "dqn_ops._C",
            cpu_sources,
            extra_compile_args={"cxx": cxx_flags},
            define_macros=define,
            py_limited_api=True,
        )

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    print(
        f"dqn_ops: building CPU + CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"
        f" (nvcc from {cuda_home}, cuBLAS {cublas_lib})",
        file=sys.stderr,
    )
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    return cpp_extension.CUDAExtension(
        "dqn_ops._C",
        cpu_sources + cuda_sources,
        include_dirs=[os.path.join(ROOT, "csrc"), cublas_inc],
        extra_compile_args={
            "cxx": cxx_flags + ["-DDQN_OPS_WITH_CUDA"],
            "nvcc": ["-O3", "-std=c++20", "-DDQN_OPS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo"],
        },
        # Linking the versioned file records its SONAME (libcublas.so.13) as a dependency;
        # at run time it resolves to the copy torch itself loads.
        extra_link_args=[cublas_lib],
        define_macros=define,
        py_limited_api=True,
    )


setup(
    name="dqn_ops",
    version="0.1.0",
    description="BF16 tensor-core training step of a dueling, branching, distributional DQN as PyTorch ops",
    packages=find_packages(include=["dqn_ops", "dqn_ops.*"]),
    ext_modules=[_extension()],
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest", "hypothesis", "expecttest", "tqdm", "matplotlib"],
                    "train": ["tqdm", "matplotlib"]},
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.9",
)

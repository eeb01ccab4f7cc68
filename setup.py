"""Build dqn_ops._C: CUDA + CPU kernels when torch is a CUDA build and a CUDA toolkit that can
compile *and link* is found, CPU kernels only otherwise. The op names are the same either way.

Which toolkit: the first usable one of
  1. $CUDA_HOME (or $CUDA_PATH), when set (when it is not usable, the build line says why);
  2. the toolkit of the `nvcc` on the PATH: its real directory, as nvcc itself reports it
     (a wrapper script or a symlink on the PATH is followed to the toolkit it runs);
  3. /usr/local/cuda, /usr/local/cuda-*, /opt/cuda.
Usable: bin/nvcc runs and has torch's CUDA major version, include/cuda_runtime.h and the
libcudart.so that `-lcudart` links are there, and cuBLAS is found (the toolkit's, or the
nvidia-cublas wheel that a CUDA build of torch brings). setup.py prints one line saying what
it builds and why.

Environment:
  DQN_OPS_CPU_ONLY=1       force a CPU-only build
  TORCH_CUDA_ARCH_LIST     GPU targets (default: the GPUs with BF16 tensor cores that the toolkit's
                           nvcc can compile for, of 8.0 8.6 8.9 9.0 10.0 12.0, plus PTX of the
                           newest: DEFAULT_ARCHS below)
  CUDA_HOME / CUDA_PATH    the CUDA toolkit to compile with (default: found as above)
  MAX_JOBS                 parallel compile jobs (default: the CPU count, fewer when memory
                           is short: ~2.5 GiB per job)
"""
import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from setuptools import find_packages, setup

import torch

# torch logs "No CUDA runtime is found, using CUDA_HOME=<its guess>" on import on a machine
# without a GPU; the guess may not be the toolkit this file uses, so the line would mislead.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
# The GPUs a user is likely to have, every one with BF16 tensor cores (the kernels' floor), and
# the first nvcc release that compiles for each: A100 / A30 (8.0), RTX 30xx / A10 / A40 (8.6),
# RTX 40xx / L4 / L40 (8.9), H100 / H200 (9.0), B200 / GB200 (10.0), RTX 50xx / RTX PRO
# Blackwell (12.0). The newest one also gets PTX, which later GPUs compile at load time.
DEFAULT_ARCHS = (("8.0", (11, 0)), ("8.6", (11, 1)), ("8.9", (11, 8)), ("9.0", (11, 8)), ("10.0", (12, 8)),
                 ("12.0", (12, 8)))
BUILD_PLAN = [""]  # what _extension() decided, said again when the build starts
BUILD_INFO = os.path.join(ROOT, "dqn_ops", "_build_info.py")  # generated (git ignores it): dqn_ops.build_info()
GIB_PER_JOB = 2.5  # measured: nvcc's cicc peaks at ~1.5 GiB, cudafe++ at ~1.3, g++ at ~1.0 (one at a time)


def _say(msg, tty=True):
    """One line for the person installing: on stderr and, under pip (which hides the build's
    output unless -v), on the terminal when there is one."""
    line = f"dqn_ops: {msg}"
    print(line, file=sys.stderr, flush=True)
    if tty and not sys.stderr.isatty():
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(line + "\n")
        except OSError:
            pass


def _nvcc_version(nvcc):
    """(major, minor) of an nvcc binary, or None when it cannot be run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _nvcc_toolkit_dir(nvcc):
    """The toolkit directory of an nvcc on the PATH, which may be a wrapper script or a symlink:
    nvcc's dry run prints the directory of the real binary (`_HERE_=<toolkit>/bin`)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
        if m:
            return os.path.dirname(os.path.realpath(m.group(1).strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _toolkit_candidates():
    """(where it came from, directory), in the order of the module docstring."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        yield ("$CUDA_HOME" if os.environ.get("CUDA_HOME") else "$CUDA_PATH"), env
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield f"the nvcc on the PATH ({nvcc})", _nvcc_toolkit_dir(nvcc)
    for d in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True) + ["/opt/cuda"]:
        if os.path.isdir(d):
            yield d, d


def _cudart_dir(home):
    """The library directory torch links from (lib64, else lib), if it has libcudart.so."""
    for sub in ("lib64", "lib"):
        d = os.path.join(home, sub)
        if os.path.isdir(d):
            return d if os.path.exists(os.path.join(d, "libcudart.so")) else None
    return None


def _check_toolkit(home, torch_major):
    """None when `home` can build and link our CUDA kernels, else why not."""
    nvcc = os.path.join(home, "bin", "nvcc")
    version = _nvcc_version(nvcc)
    if version is None:
        return f"no working {nvcc}"
    if version[0] != torch_major:
        return f"its nvcc is CUDA {version[0]}.{version[1]}, torch {torch.__version__} was built with CUDA {torch.version.cuda}"
    if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return "no include/cuda_runtime.h (not a full toolkit)"
    if _cudart_dir(home) is None:
        return "no libcudart.so in lib64/ or lib/ (the link needs -lcudart)"
    return None


def _find_toolkit(torch_major):
    """(directory of the first usable toolkit or None, the candidates passed over and why)."""
    rejected, seen = [], set()
    for origin, home in _toolkit_candidates():
        real = os.path.realpath(home)
        if real in seen:
            continue
        seen.add(real)
        why = _check_toolkit(real, torch_major)
        if why is None:
            return real, rejected
        rejected.append(f"{home} (from {origin}): {why}" if origin != home else f"{home}: {why}")
    return None, rejected


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


def _default_jobs():
    """MAX_JOBS when unset: one job per CPU, fewer if memory would not hold them."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo") as f:
            avail_kib = int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1))
        by_memory = int(avail_kib / 2**20 / GIB_PER_JOB)
    except (OSError, AttributeError, ValueError):
        by_memory = cpus
    return max(1, min(cpus, by_memory))


def _write_build_info(**info):
    """What this build is (read by dqn_ops.build_info()): written before the compile, so that
    the package the build installs carries it."""
    with open(BUILD_INFO, "w") as f:
        f.write('"""Generated by setup.py: what this build of dqn_ops._C was built with."""\n')
        f.write(f"BUILD_INFO = {info!r}\n")


def default_arch_list(nvcc_version):
    """TORCH_CUDA_ARCH_LIST when unset: DEFAULT_ARCHS that this nvcc compiles for, "+PTX" on the last."""
    archs = [arch for arch, since in DEFAULT_ARCHS if nvcc_version >= since]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def _extension():
    # -DPy_LIMITED_API comes from py_limited_api=True (torch adds it; defining it here as well
    # redefines the macro in every translation unit).
    # -ffp-contract=off: the CPU kernels round each multiply and add on their own
    # (csrc/optim_math.h), which GCC's default contraction into FMAs breaks where the target has
    # them (aarch64; x86-64 builds have no FMA unless asked for one).
    cxx_flags = ["-O3", "-std=c++20", "-ffp-contract=off"]
    # at::parallel_for (the CPU kernels' loops over rows and samples) is OpenMP in torch's builds:
    # in an extension compiled without -fopenmp its pragma is ignored and the loop runs serially.
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    cxx_flags += openmp
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))

    why_not, cuda_home, passed_over = None, None, []
    if os.environ.get("DQN_OPS_CPU_ONLY") == "1":
        why_not = "DQN_OPS_CPU_ONLY=1"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is a CPU build"
    else:
        cuda_home, passed_over = _find_toolkit(int(torch.version.cuda.split(".")[0]))
        if cuda_home is None:
            why_not = ("no usable CUDA toolkit: " + "; ".join(passed_over) if passed_over else
                       "no CUDA toolkit found (no CUDA_HOME, no nvcc on the PATH, none in /usr/local/cuda*)")
    if why_not is None:
        cublas_inc, cublas_lib = _cublas_paths(cuda_home)
        if cublas_inc is None:
            why_not = f"cuBLAS headers/library not found in {cuda_home} nor in an nvidia-cublas wheel"

    if why_not is not None:
        BUILD_PLAN[0] = f"building the CPU kernels only ({why_not})"
        _say(BUILD_PLAN[0], tty=False)
        _write_build_info(cuda=False, reason=why_not, cuda_arch_list=None)
        return cpp_extension.CppExtension(
            "dqn_ops._C",
            cpu_sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=openmp,
            py_limited_api=True,
        )

    # torch.utils.cpp_extension reads its module-level CUDA_HOME (guessed at import from the
    # nvcc on the PATH: for a wrapper script, not the toolkit) for nvcc, includes and -L.
    cpp_extension.CUDA_HOME = cuda_home
    os.environ["CUDA_HOME"] = cuda_home
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list(_nvcc_version(os.path.join(cuda_home, "bin", "nvcc")))
    BUILD_PLAN[0] = (f"building the CPU + CUDA kernels for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"
                     f" (CUDA toolkit {cuda_home}, cuBLAS {cublas_lib})"
                     + (f"; passed over {'; '.join(passed_over)}" if passed_over else ""))
    _say(BUILD_PLAN[0], tty=False)
    _write_build_info(cuda=True, reason=f"CUDA toolkit {cuda_home}", cuda_arch_list=os.environ["TORCH_CUDA_ARCH_LIST"])
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
        extra_link_args=[cublas_lib] + openmp,
        py_limited_api=True,
    )


class _Progress(threading.Thread):
    """Says every 30 s how many of the extension's sources are compiled (object files written)."""

    def __init__(self, build_temp, total):
        super().__init__(daemon=True)
        self.build_temp, self.total, self.start_time = build_temp, total, time.time()
        self.done = threading.Event()

    def compiled(self):
        n = 0
        for path in glob.glob(os.path.join(self.build_temp, "**", "*.o"), recursive=True):
            try:
                n += os.path.getmtime(path) >= self.start_time - 1
            except OSError:
                pass
        return n

    def run(self):
        while not self.done.wait(30):
            _say(f"compiled {self.compiled()}/{self.total} sources, {time.time() - self.start_time:.0f} s")


class BuildExtension(cpp_extension.BuildExtension):
    def build_extensions(self):
        if "MAX_JOBS" not in os.environ:
            os.environ["MAX_JOBS"] = str(_default_jobs())
        if BUILD_PLAN[0]:
            _say(BUILD_PLAN[0])
        total = sum(len(e.sources) for e in self.extensions)
        has_cuda = any(s.endswith(".cu") for e in self.extensions for s in e.sources)
        _say(f"compiling {total} sources with MAX_JOBS={os.environ['MAX_JOBS']}"
             + (" (about 8 CPU-minutes for one GPU target, twice that for the default six)" if has_cuda else " (a few minutes with 2 cores)"))
        progress = _Progress(self.build_temp, total)
        progress.start()
        t0 = time.time()
        try:
            super().build_extensions()
        finally:
            progress.done.set()
        _say(f"built dqn_ops._C in {time.time() - t0:.0f} s")


setup(
    name="dqn_ops",
    version="0.1.0",
    description="BF16 tensor-core training step of a dueling, branching, distributional DQN as PyTorch ops",
    packages=find_packages(include=["dqn_ops", "dqn_ops.*"]),
    ext_modules=[_extension()],
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest", "hypothesis", "expecttest", "matplotlib"],
                    "train": ["matplotlib"]},
    cmdclass={"build_ext": BuildExtension},
    # torch's py_limited_api=True compiles against Python 3.10's stable ABI (Py_LIMITED_API=0x030A0000)
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    python_requires=">=3.10",
)

"""What the CPU is: its model name and its SIMD / matrix feature flags (x86 `/proc/cpuinfo`). Read by the dtype rule
(`models.loader.auto_dtype`) and recorded by every benchmark (`bench.run.machine_info`).

And one thing the CPU's thread pool needs: `release_openmp_threads`. PyTorch's CPU kernels run on OpenMP, and
OpenMP (libgomp, as PyTorch's wheels ship it) keeps one team of worker threads per thread that ever ran a parallel
kernel. The engine loads and warms its models on the caller's thread, then steps them on its own thread, so two
teams exist; once libgomp manages more threads than there are CPUs it stops spinning between parallel regions
and parks its workers on a futex after every kernel. A decode step runs about a thousand kernels: at one row on a
2-core machine the 1.5B target's step took 91-103 ms on the engine's thread against 58-64 ms on the thread that
loaded it (docs/performance.md). Releasing the caller's idle team before the engine's thread starts keeps one team
and the workers spinning."""

from __future__ import annotations

import ctypes
import platform

__all__ = ["cpu_flags", "cpu_model", "release_openmp_threads", "SIMD_PREFIXES"]

# the OpenMP runtimes that implement omp_pause_resource_all (OpenMP 5.0): GNU (PyTorch's Linux wheels), LLVM, Intel
OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp5")
OMP_PAUSE_HARD = 2

SIMD_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def cpu_flags() -> list[str]:
    """The CPU's SIMD / matrix feature flags (x86 /proc/cpuinfo), sorted; [] where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(x for x in line.split(":", 1)[1].split() if x.startswith(SIMD_PREFIXES))
    except OSError:
        pass
    return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _openmp_library() -> str | None:
    """The OpenMP runtime this process has loaded (the first of OPENMP_LIBRARIES in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ", 5)[-1].strip()
                name = path.rsplit("/", 1)[-1]
                if name.startswith(OPENMP_LIBRARIES) and ".so" in name:
                    return path
    except OSError:
        pass
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker team (omp_pause_resource_all(omp_pause_hard)): call it on a thread
    that hands its PyTorch work to another thread and will wait (module docstring). Harmless if the thread runs a
    parallel kernel again later (a new team is started then, and libgomp throttles again while two exist). Returns
    whether a runtime released it; False where no OpenMP runtime with the call is loaded (other platforms)."""
    path = _openmp_library()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_HARD) == 0

"""What the CPU is: its model name and its SIMD / matrix feature flags (x86 `/proc/cpuinfo`). Read by the dtype rule
(`models.loader.auto_dtype`) and recorded by every benchmark (`bench.run.machine_info`).

And one thing the CPU's thread pool needs: `release_openmp_threads`. PyTorch's CPU kernels run on OpenMP, and
OpenMP (libgomp, as PyTorch's wheels ship it) keeps one team of worker threads per thread that ever ran a parallel
kernel. The engine loads and warms its models on the caller's thread, then steps them on its own thread, so two
teams exist; once libgomp manages more threads than there are CPUs it stops spinning between parallel regions
and parks its workers on a futex after every kernel. A decode step runs about a thousand kernels: at one row on a
2-core machine the 1.5B target's step took 99.3 ms on a new thread beside the loading thread's idle team against
86.8 ms after releasing it (docs/performance.md, scripts/omp_threads.py). Releasing the caller's idle team before
the engine's thread starts keeps one team and the workers spinning.

Only GNU's runtime is released: there omp_pause_resource_all(omp_pause_hard) frees the calling thread's own pool
and nothing else. LLVM's and Intel's runtimes (libomp, libiomp5) shut the whole runtime down on a hard pause, so
with them nothing is released."""

from __future__ import annotations

import ctypes
import platform

__all__ = ["cpu_flags", "cpu_model", "release_openmp_threads", "SIMD_PREFIXES"]

# GNU's OpenMP runtime (PyTorch's Linux wheels), whose hard pause frees only the calling thread's pool
OPENMP_LIBRARY = "libgomp"
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


def _openmp_libraries() -> list[str]:
    """Every copy of GNU's OpenMP runtime this process has mapped (from /proc/self/maps; a wheel may vendor its
    own under another name, libgomp-<hash>.so.1), in the order first mapped; [] where none or unknown."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].removesuffix(" (deleted)")
                name = path.rsplit("/", 1)[-1]
                if name.startswith(OPENMP_LIBRARY) and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker team (omp_pause_resource_all(omp_pause_hard) in every libgomp the
    process has loaded): call it on a thread that hands its PyTorch work to another thread and will wait (module
    docstring). Harmless if the thread runs a parallel kernel again later (a new team is started then, and libgomp
    throttles again while two exist). Returns whether a runtime released it; False where no libgomp with the call
    is loaded (other runtimes and platforms: nothing is done)."""
    released = False
    for path in _openmp_libraries():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same handle
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(OMP_PAUSE_HARD) == 0 or released
    return released

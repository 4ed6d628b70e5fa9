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
with them nothing is released.

And one thing the C library's allocator needs: `keep_freed_memory`. PyTorch's CPU tensors come from malloc, and
glibc serves a block above its mmap threshold with fresh pages (the kernel zeroes and faults them in on first
touch) and hands the top of its heap back to the system once more than its trim threshold is free. Both start at
128 KiB; glibc raises them as mapped blocks are freed, but only to the largest block freed so far (and twice that),
so the activations of a prefill chunk (a 1,515-token chunk of Qwen2.5-Coder-1.5B: 27 MB per MLP intermediate, dozens
of them per forward) are faulted in again and again: that chunk took 3.42-4.41 s with glibc's defaults against
3.16-3.39 s with the thresholds fixed at the top (docs/bench/keep-memory-ab-qwen-b16.json), the MLP's silu and
product three to five times slower on fresh pages (docs/performance.md). Serving engines on CPUs preload tcmalloc
for the same reason; the engine sets glibc's own thresholds instead: blocks up to 32 MiB (glibc's largest mmap
threshold) come from the heap and up to 1 GiB of freed memory is kept at the top of each heap (per arena) for the
next forward. The cost is resident memory that is not returned after a peak, and blocks that would have been
mapped apart now share the heap (which can fragment it).

The trim threshold only holds in glibc's main arena. Every other thread that allocates gets an arena of its own,
made of mapped heaps of at most 64 MiB, and when a heap other than an arena's first is wholly free glibc unmaps it
unless the top pad (M_TOP_PAD) says to keep that much. The engine steps its models on its own thread
(runtime.engine), so a prefill's activations spilled into such heaps and some processes mapped them afresh at
every layer (28 new heaps and up to 550,000 page faults, 2.2 GB, in one 16-prompt prefill; docs/performance.md). A
thread's 24 MiB block, freed and taken again beside two others, was faulted in anew every time with the thresholds
alone, and once with glibc's defaults. So the call also sets the top pad to a whole heap (64 MiB): no heap of a
thread's arena is unmapped, and the main arena grows and trims its top by 64 MiB more than it would (address
space; pages are only resident once touched).

`ECHO_KEEP_FREED_MEMORY=0` leaves glibc's defaults. An allocator preloaded in glibc's place (tcmalloc, jemalloc)
ignores the call."""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["cpu_flags", "cpu_model", "heap_tokens", "keep_freed_memory", "release_openmp_threads", "SIMD_PREFIXES"]

# glibc's mallopt parameters and the values `keep_freed_memory` sets (the module docstring)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # a whole heap of a thread's arena (HEAP_MAX_SIZE on 64-bit); 0: glibc's (the A/B's control)
_kept: bool | None = None  # whether keep_freed_memory has set the thresholds (None: not asked yet)

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


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at the top and its top pad at a heap (module docstring), once per process;
    returns whether glibc accepted all three (what it accepted before one was refused stays). Nothing is done where
    the C library has no mallopt (other platforms, musl) or where the environment says ECHO_KEEP_FREED_MEMORY=0."""
    global _kept
    if _kept is None:
        _kept = False
        if os.environ.get("ECHO_KEEP_FREED_MEMORY", "1") != "0" and platform.system() == "Linux":
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 \
                and (TOP_PAD == 0 or mallopt(M_TOP_PAD, TOP_PAD) == 1)
    return _kept


def heap_tokens(row_bytes: int, most: int, least: int = 256) -> int:
    """Tokens a forward may take so that an activation of `row_bytes` a token stays within the heap's largest
    block (MMAP_THRESHOLD): a larger one is mapped afresh every time (module docstring; a 2,048-token prefill chunk
    of Qwen2.5-Coder-1.5B in bfloat16 has 37 MB MLP activations). At most `most`, at least min(least, most)."""
    if row_bytes < 1 or most < 1:
        raise ValueError(f"heap_tokens needs row_bytes >= 1 and most >= 1, got {row_bytes} and {most}")
    return max(min(most, MMAP_THRESHOLD // row_bytes), min(least, most))

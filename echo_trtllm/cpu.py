"""What the CPU is: its model name and its SIMD / matrix feature flags (x86 `/proc/cpuinfo`). Read by the dtype rule
(`models.loader.auto_dtype`) and recorded by every benchmark (`bench.run.machine_info`)."""

from __future__ import annotations

import platform

__all__ = ["cpu_flags", "cpu_model", "SIMD_PREFIXES"]

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

"""This process's host memory and CPU time, as the benchmarks measure and reset them (Linux
``/proc``)."""

from __future__ import annotations

import ctypes
import gc
import os
import resource

__all__ = ["cpu_seconds", "peak_rss_bytes", "reset_peak_rss", "rss_bytes", "trim_host_memory"]


def _status_kib(key: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_seconds() -> float:
    """CPU seconds this process has used so far: user + system, every thread."""
    t = os.times()
    return t.user + t.system


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (0 where not measurable)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size in bytes since start or the last ``reset_peak_rss()``."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def trim_host_memory() -> None:
    """``gc.collect()`` then glibc ``malloc_trim(0)``: hand freed heap memory back to the OS.

    Call between trials of every algorithm alike, so that each starts with the allocator
    in the same state: without it RSS after a freed trial creeps up (heap retention, not a
    leak) and the next trial reuses already-faulted pages. A no-op beyond ``gc`` where
    glibc is not the allocator.
    """
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass

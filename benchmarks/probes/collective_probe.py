"""What the gloo collective probes share: one timed, memory-marked run of a way, and the
table they print.

Imported by ``gloo_all_gather.py`` and ``gloo_reduce_scatter.py`` (run as scripts, their
directory is on ``sys.path``).
"""

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from flatzero.procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory


def measure(run: Callable[[], None]) -> tuple[float, int]:
    """``run()`` on every rank from a trimmed heap, after a barrier: the slowest rank's
    seconds, and this rank's resident-set high-water mark above the resident set before
    (bytes)."""
    trim_host_memory()
    dist.barrier()
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    run()
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    peak = peak_rss_bytes() - before
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), peak


def print_table(title: str, seconds: dict[str, list[float]], peaks: dict[str, list[int]]) -> None:
    """Per way: the median and every run's seconds, and the largest peak in MiB."""
    mib = 2**20
    print(title)
    print(f"{'way':<24} {'seconds (median)':>16} {'all':>28} {'peak RSS + MiB (max)':>21}")
    for name, runs in seconds.items():
        every = " ".join(f"{s:.3f}" for s in runs)
        print(
            f"{name:<24} {statistics.median(runs):>16.3f} {every:>28} "
            f"{max(peaks[name]) / mib:>21.0f}"
        )

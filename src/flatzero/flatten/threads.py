"""How many host threads a rank may use while flattening.

DeepSpeed issue #7677: eight ranks of a node each flattened on the CPU with every core,
2,244 CPU-minutes for a 19-minute init. A rank here never uses more than its share of
the cores, and the ``cpu`` tier uses one thread: its copies are bound by memory
bandwidth, which a second thread per rank barely raises (docs/benchmarks.md) while it
doubles the CPU time. The upload tiers fill pinned staging buffers that the GPU drains
at PCIe speed, several times one thread's memcpy, so they use the rank's whole share.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..comm import local_world_size
from ..config import FlattenConfig

__all__ = ["capped_threads", "cores_per_rank", "host_threads"]


def cores_per_rank() -> int:
    """This process's usable cores divided by the ranks on this node (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_world_size())


def host_threads(config: FlattenConfig, tier: str) -> int:
    """Intra-op threads for flattening in ``tier`` (``config.host_threads`` if set)."""
    if config.host_threads is not None:
        return config.host_threads
    return 1 if tier == "cpu" else cores_per_rank()


@contextmanager
def capped_threads(threads: int) -> Iterator[None]:
    """Run with at most ``threads`` intra-op threads, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""How many host threads a rank may use while flattening.

DeepSpeed issue #7677: eight ranks of a node each flattened on the CPU with every core,
2,244 CPU-minutes for a 19-minute init. A rank here never uses more than its share of
the cores (cores / ``LOCAL_WORLD_SIZE``), and uses all of that share: on the host, what
bounds a fresh bucket or master shard is the first touch of its pages (a page fault per
page), which spreads over threads, and the upload tiers fill pinned staging buffers that
the GPU drains faster than one thread's memcpy.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..comm import local_world_size
from ..config import FlattenConfig

__all__ = ["capped_threads", "cores_per_rank", "host_threads", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def cores_per_rank() -> int:
    """This process's usable cores divided by the ranks on this node (at least 1)."""
    return max(1, usable_cores() // local_world_size())


def host_threads(config: FlattenConfig) -> int:
    """Intra-op threads for flattening: ``config.host_threads`` if set, else the rank's
    share of the cores."""
    if config.host_threads is not None:
        return config.host_threads
    return cores_per_rank()


@contextmanager
def capped_threads(threads: int) -> Iterator[None]:
    """Run with at most ``threads`` intra-op threads, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)

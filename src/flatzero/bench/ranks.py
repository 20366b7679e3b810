"""Where a benchmark's rank runs: its device, its process group's backend, its share of
the cores."""

from __future__ import annotations

import torch

from ..devices import local_device_index
from .machine import usable_cores

__all__ = ["backend_for", "rank_device", "sync", "threads_per_rank"]


def rank_device(kind: str) -> torch.device:
    """This rank's device for ``kind`` (``"cuda"``: the rank's own GPU; else the CPU)."""
    if kind == "cuda":
        return torch.device("cuda", local_device_index("cuda"))
    return torch.device("cpu")


def backend_for(kind: str) -> str:
    """The process group backend for ranks on ``kind`` devices: nccl on CUDA, else gloo."""
    return "nccl" if kind == "cuda" else "gloo"


def threads_per_rank(world_size: int) -> int:
    """Cores per rank when ``world_size`` ranks share this process's usable cores (>= 1)."""
    return max(1, usable_cores() // world_size)


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Where a benchmark's rank runs: its device, its process group's backend, its share of
the cores."""

from __future__ import annotations

import torch

from flatzero import accel
from flatzero.devices import local_device_index
from flatzero_bench.common.machine import usable_cores

__all__ = ["backend_for", "device_or_default", "rank_device", "sync", "threads_per_rank"]


def device_or_default(device: str | None, without_gpu: str) -> str:
    """``device`` (a benchmark's ``--device``) when given, else ``"cuda"`` when torch sees a
    GPU and ``without_gpu`` when not (decided here, when the benchmark runs: its options
    import no torch)."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else without_gpu


def rank_device(kind: str) -> torch.device:
    """This rank's device for ``kind`` (an accelerator type: the rank's own device of that
    type; ``"cpu"``: the host)."""
    if accel.is_accelerator(kind):
        return torch.device(kind, local_device_index(kind))
    return torch.device("cpu")


def backend_for(kind: str) -> str:
    """The process group backend for ranks on ``kind`` devices: nccl on CUDA, else gloo."""
    return "nccl" if kind == "cuda" else "gloo"


def threads_per_rank(world_size: int) -> int:
    """Cores per rank when ``world_size`` ranks share this process's usable cores (>= 1)."""
    return max(1, usable_cores() // world_size)


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op for the host)."""
    accel.synchronize(device)

"""Free memory on a device or the host, and the errors for running out of it (the choice of
flatten tier on top of it: ``flatten.choice``)."""

from __future__ import annotations

import torch

from . import accel

__all__ = [
    "DeviceOutOfMemoryError",
    "free_bytes",
    "is_oom",
    "meminfo_bytes",
    "out_of_memory",
]


class DeviceOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """Out of accelerator memory, agreed by every rank: a ``torch.OutOfMemoryError`` (what
    Hugging Face's batch-size finder and users' retry loops catch) that is also a
    ``MemoryError`` (what flatzero raised before for every out-of-memory error)."""


def out_of_memory(message: str, device: torch.device) -> MemoryError:
    """The error to raise when ``device`` has no room: ``DeviceOutOfMemoryError`` for an
    accelerator, ``MemoryError`` for host memory."""
    if accel.is_accelerator(device):
        return DeviceOutOfMemoryError(message)
    return MemoryError(message)


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on ``device``.

    An accelerator: the runtime's free memory (``mem_get_info``: for CUDA the driver's,
    never nvidia-smi's) plus what the caching allocator has reserved but not handed out.
    The host: ``MemAvailable`` of /proc/meminfo.
    """
    if accel.is_accelerator(device):
        free, _total = accel.mem_get_info(device)
        cached = accel.memory_reserved(device) - accel.memory_allocated(device)
        return free + cached
    available = meminfo_bytes("MemAvailable")
    return 2**62 if available is None else available  # unknown: never block the CPU tier


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo (``"MemAvailable"``, ``"MemTotal"``) in bytes; None when
    it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_oom(error: BaseException) -> bool:
    """True for an out-of-memory error from CUDA or the CPU allocator."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )

"""The installed emulated device: its name, capacity and memory counters (bytes)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .pinning import HostRegistry

__all__ = [
    "PRIVATEUSE1",
    "Counters",
    "EmulatedDevice",
    "EmulationUnavailable",
    "index_of",
    "installed",
    "require",
    "set_installed",
]

PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1


class EmulationUnavailable(RuntimeError):
    """This torch cannot host the emulated accelerator (the reason is the message)."""


@dataclass
class Counters:
    """Memory accounting of one emulated device, in bytes."""

    capacity: int
    allocated: int = 0
    peak: int = 0
    allocations: int = 0


# [Note: one device per process]
# The emulated backend has one device per process, ``name:0``: torch's Python device guard
# places every tensor of a Python backend on index 0. Each rank sees one device, as under a
# launcher that gives each rank one GPU (``CUDA_VISIBLE_DEVICES`` per rank).


@dataclass
class EmulatedDevice:
    """The installed emulated accelerator: its name and memory counters per device (see
    [Note: one device per process]); ``deferred_streams``: [Note: deferred streams]
    (``streams``); ``host_registry``: [Note: emulated registration] (None: the device
    module has no ``cudart``)."""

    name: str
    device_count: int
    backend_name: str
    host_collectives: bool = True
    deferred_streams: bool = False
    host_registry: HostRegistry | None = None
    counters: list[Counters] = field(default_factory=list)
    current: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device(name, index)``; the current device when ``index`` is None."""
        return torch.device(self.name, self.current if index is None else index)

    def set_capacity(self, capacity_bytes: int, index: int | None = None) -> None:
        """Set the memory of device ``index`` (all devices when None) to ``capacity_bytes``."""
        targets = range(self.device_count) if index is None else [index]
        for i in targets:
            self.counters[i].capacity = int(capacity_bytes)

    def _charge(self, index: int, nbytes: int) -> None:
        """Count ``nbytes`` allocated on device ``index``; ``torch.OutOfMemoryError`` beyond
        its capacity."""
        with self.lock:
            c = self.counters[index]
            if c.allocated + nbytes > c.capacity:
                free = c.capacity - c.allocated
                raise torch.OutOfMemoryError(
                    f"{self.name}:{index} out of memory: tried to allocate {nbytes} bytes "
                    f"with {free} bytes free of {c.capacity} (emulated device)"
                )
            c.allocated += nbytes
            c.allocations += 1
            c.peak = max(c.peak, c.allocated)

    def _release(self, index: int, nbytes: int) -> None:
        """Count ``nbytes`` freed on device ``index``."""
        with self.lock:
            self.counters[index].allocated -= nbytes


_STATE: EmulatedDevice | None = None


def installed() -> EmulatedDevice | None:
    """The emulated device of this process, or None when ``install`` was not called."""
    return _STATE


def set_installed(state: EmulatedDevice | None) -> None:
    """Make ``state`` the emulated device of this process (None: none)."""
    global _STATE
    _STATE = state


def require() -> EmulatedDevice:
    """The emulated device of this process; RuntimeError when it is not installed."""
    if _STATE is None:
        raise RuntimeError("the emulated accelerator is not installed; call install() first")
    return _STATE


def index_of(device: torch.device | str | int | None) -> int:
    """The device index ``device`` names (the current device for None or no index)."""
    if device is None:
        return require().current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return require().current if device.index is None else device.index

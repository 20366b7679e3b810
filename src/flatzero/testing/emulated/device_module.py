"""``torch.<name>``: the device module of the emulated device, and torch's hooks and guard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .state import PRIVATEUSE1, Counters, index_of, require
from .streams import Event, Stream, current_stream, flush_all

__all__ = ["DeviceModule", "Guard", "Hooks"]


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int  # bytes


class DeviceModule:
    """``torch.<name>``: the device module torch and flatzero's seam call (memory figures as
    [Note: emulated memory] says)."""

    Stream = Stream
    Event = Event

    @property
    def cudart(self):
        """``cudart()``: the host registration calls ([Note: emulated registration]), only
        where ``install(host_registration=True)``."""
        registry = require().host_registry
        if registry is None:
            raise AttributeError("cudart")
        return lambda: registry

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return require().device_count

    def current_device(self) -> int:
        return require().current

    def set_device(self, device) -> None:
        index = index_of(device)
        if not 0 <= index < require().device_count:
            raise RuntimeError(f"invalid device ordinal {index} (emulated device)")
        require().current = index

    def synchronize(self, device=None) -> None:
        flush_all()

    def manual_seed_all(self, seed: int) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state() for _ in range(require().device_count)]

    def set_rng_state_all(self, states) -> None:
        if states:
            torch.set_rng_state(states[0])

    def current_stream(self, device=None) -> Stream:
        return current_stream(device)

    def default_stream(self, device=None) -> Stream:
        return self.current_stream(device)

    @contextlib.contextmanager
    def stream(self, stream: Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with stream:
            yield

    def _counters(self, device=None) -> Counters:
        return require().counters[index_of(device)]

    def mem_get_info(self, device=None) -> tuple[int, int]:
        c = self._counters(device)
        return c.capacity - c.allocated, c.capacity

    def memory_allocated(self, device=None) -> int:
        return self._counters(device).allocated

    def max_memory_allocated(self, device=None) -> int:
        return self._counters(device).peak

    def memory_reserved(self, device=None) -> int:
        return self._counters(device).allocated

    def max_memory_reserved(self, device=None) -> int:
        return self._counters(device).peak

    def reset_peak_memory_stats(self, device=None) -> None:
        c = self._counters(device)
        c.peak = c.allocated

    def empty_cache(self) -> None:
        return None

    def memory_stats(self, device=None) -> dict[str, int]:
        c = self._counters(device)
        return {
            "allocated_bytes.all.current": c.allocated,
            "allocated_bytes.all.peak": c.peak,
            "reserved_bytes.all.current": c.allocated,
            "num_alloc_retries": 0,
        }

    def get_device_name(self, device=None) -> str:
        return f"emulated accelerator ({require().name})"

    def get_device_properties(self, device=None):
        c = self._counters(device)
        return _Properties(name=self.get_device_name(device), total_memory=c.capacity)


class Hooks(torch._C._acc.PrivateUse1Hooks):
    """torch's PrivateUse1 hooks: the device is built, available and has a context."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class Guard(torch._C._acc.DeviceGuard):
    """torch's device guard for PrivateUse1 (see [Note: one device per process])."""

    def type_(self):
        return PRIVATEUSE1

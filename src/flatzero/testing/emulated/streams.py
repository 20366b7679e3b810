"""Streams and events of the emulated device: they exist and order nothing."""

from __future__ import annotations

import torch

from .state import PRIVATEUSE1, index_of

__all__ = ["Event", "Stream", "current_stream"]

# [Note: synchronous streams]
# Every emulated op runs synchronously, so streams and events exist (torch's type checks
# and flatzero's seam see real ``torch.Stream``/``torch.Event`` objects) and order nothing:
# a missing stream wait is never caught on the emulated device.


class Stream(torch.Stream):
    """A stream of the emulated device: real to torch's type checks, ordering nothing (see
    [Note: synchronous streams])."""

    _next_id = 1

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        index = index_of(device)
        stream_id = Stream._next_id
        Stream._next_id += 1
        return super().__new__(
            cls, stream_id=stream_id, device_index=index, device_type=int(PRIVATEUSE1)
        )

    def __init__(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __enter__(self):
        _STREAM_STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _STREAM_STACK.pop()


_DEFAULT_STREAMS: dict[int, Stream] = {}
_STREAM_STACK: list[Stream] = []


def current_stream(device=None) -> Stream:
    """The innermost stream entered, else the default stream of ``device``."""
    if _STREAM_STACK:
        return _STREAM_STACK[-1]
    index = index_of(device)
    if index not in _DEFAULT_STREAMS:
        _DEFAULT_STREAMS[index] = Stream(
            stream_id=0, device_index=index, device_type=int(PRIVATEUSE1)
        )
    return _DEFAULT_STREAMS[index]


class Event(torch.Event):
    """An event of the emulated device: recorded work is always complete."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls, device=torch.device("cpu"), enable_timing=enable_timing)

    def __init__(self, *args, **kwargs) -> None:
        self._recorded = False

    def record(self, stream=None) -> None:
        self._recorded = True

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event) -> float:
        return 0.0

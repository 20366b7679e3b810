"""Streams and events of the emulated device: synchronous, or deferred so that they order.

[Note: synchronous streams] is the default; ``install(deferred_streams=True)`` (or
``FLATZERO_EMU_STREAMS=deferred`` in the environment of the process that installs it)
turns on [Note: deferred streams].
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .state import PRIVATEUSE1, index_of, installed

__all__ = ["Event", "Stream", "before_op", "current_stream", "flush_all", "issue"]

# [Note: synchronous streams]
# By default every emulated op runs synchronously, so streams and events exist (torch's
# type checks and flatzero's seam see real ``torch.Stream``/``torch.Event`` objects) and
# order nothing: a missing stream wait is never caught.
#
# [Note: deferred streams]
# In the deferred mode a ``non_blocking`` copy issued while a stream other than the
# default one is current is not run: it is queued on that stream, and runs (reading its
# source then, writing its destination then) only when something orders it: the stream is
# synchronized or queried, an event recorded after it is synchronized, queried or waited
# on (``Event.wait``, ``Stream.wait_event``), another stream waits on its stream
# (``wait_stream``), the device is synchronized, or another op is issued on its stream
# (in-stream order). Until then its destination holds what it held before: code that
# reads a copy's destination without the wait CUDA needs reads stale values, and code
# that changes a copy's source before the copy was ordered writes into the copy. The
# default stream stays synchronous (every other op runs at once), so a missing
# ``side.wait_stream(current)`` before a side copy is not caught. A wait orders all of a
# stream's queue up to the event (more than CUDA promises, never less).


@dataclass
class _Queue:
    """The copies queued on one stream, oldest first; ``issued``: how many ever were."""

    pending: list[Callable[[], None]] = field(default_factory=list)
    issued: int = 0

    @property
    def done(self) -> int:
        return self.issued - len(self.pending)


_QUEUES: dict[tuple[int, int], _Queue] = {}
_LOCK = threading.RLock()
"""Held while a queue changes and while its copies run (in order, whichever thread waits)."""


def _deferred() -> bool:
    state = installed()
    return state is not None and state.deferred_streams


def _key(stream: torch.Stream) -> tuple[int, int]:
    return (int(stream.device_index), int(stream.stream_id))


def _flush(key: tuple[int, int], upto: int | None = None) -> None:
    """Run the copies queued on stream ``key``, up to its ``upto``-th issued (all: None)."""
    with _LOCK:
        queue = _QUEUES.get(key)
        while queue is not None and queue.pending and (upto is None or queue.done < upto):
            queue.pending.pop(0)()


def flush_all() -> None:
    """Run every queued copy of every stream (a device synchronize)."""
    with _LOCK:
        for key in list(_QUEUES):
            _flush(key)


def before_op() -> None:
    """An op is about to run on the current stream: what is queued there runs first."""
    if _deferred() and _QUEUES:
        _flush(_key(current_stream()))


def issue(run: Callable[[], None], *, asynchronous: bool) -> None:
    """Run the copy ``run`` in its stream's order: queued on the current stream when the
    mode is deferred, the copy ``asynchronous`` (``non_blocking``) and the current stream
    not the default one; else at once, after what is queued on the current stream."""
    stream = current_stream()
    if not (_deferred() and asynchronous and int(stream.stream_id) != 0):
        before_op()
        run()
        return
    with _LOCK:
        queue = _QUEUES.setdefault(_key(stream), _Queue())
        queue.pending.append(run)
        queue.issued += 1


def _issued(stream: torch.Stream) -> int:
    with _LOCK:
        queue = _QUEUES.get(_key(stream))
        return 0 if queue is None else queue.issued


class Stream(torch.Stream):
    """A stream of the emulated device (see [Note: synchronous streams] and
    [Note: deferred streams])."""

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
        _flush(_key(self))
        return True

    def synchronize(self) -> None:
        _flush(_key(self))

    def wait_event(self, event) -> None:
        event.synchronize()

    def wait_stream(self, stream) -> None:
        _flush(_key(stream))

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


_DEFAULT_STREAMS: dict[int, Stream] = {}
_CURRENT = threading.local()
"""Per thread, as CUDA's current stream is: the streams entered, innermost last."""


def _stack() -> list[Stream]:
    stack = getattr(_CURRENT, "stack", None)
    if stack is None:
        stack = _CURRENT.stack = []
    return stack


def current_stream(device=None) -> Stream:
    """The innermost stream this thread entered, else the default stream of ``device``."""
    stack = _stack()
    if stack:
        return stack[-1]
    index = index_of(device)
    if index not in _DEFAULT_STREAMS:
        _DEFAULT_STREAMS[index] = Stream(
            stream_id=0, device_index=index, device_type=int(PRIVATEUSE1)
        )
    return _DEFAULT_STREAMS[index]


class Event(torch.Event):
    """An event of the emulated device: it orders the copies queued before its record in
    the deferred mode ([Note: deferred streams]); else recorded work is always complete."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls, device=torch.device("cpu"), enable_timing=enable_timing)

    def __init__(self, *args, **kwargs) -> None:
        self._recorded = False
        self._at: tuple[tuple[int, int], int] | None = None

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else current_stream()
        self._recorded = True
        self._at = (_key(stream), _issued(stream))

    def wait(self, stream=None) -> None:
        self.synchronize()

    def query(self) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self._at is not None:
            _flush(*self._at)

    def elapsed_time(self, end_event) -> float:
        return 0.0

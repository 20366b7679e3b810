"""A slow link for tests and benchmarks: every collective of this process completes no
sooner than a link of a given bandwidth would let it.

``slow_link(bytes_per_s)`` wraps ``torch.distributed``'s collectives (``broadcast``,
``all_reduce``, ``reduce``, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``,
``reduce_scatter_tensor``) while it is entered, and the two that DeepSpeed's communication
backend keeps from its start (``deepspeed.comm``'s ``all_gather_function`` and
``reduce_scatter_function``) when DeepSpeed has one: both libraries' collectives go
through the same link. The link carries one collective at a time, in the order they are
issued: collective ``k`` of ``n`` bytes (its largest buffer: an all-gather's output, a
reduce-scatter's input, the tensor of an all-reduce, reduce or broadcast; a list counts
as its sum) is done at ``max(issued_k, done_{k-1}) + n / bytes_per_s``. A synchronous call
returns then; an asynchronous one returns at once with a work whose ``wait()`` returns then
(and after the real collective). So a wait that comes late costs nothing: what overlap
hides is visible in wall time on a CPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SlowLink", "slow_link"]

_WRAPPED = (
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
)
_DEEPSPEED_CACHED = {
    "all_gather_function": "all_gather_into_tensor",
    "reduce_scatter_function": "reduce_scatter_tensor",
}
"""Attributes of DeepSpeed's ``TorchBackend`` holding a ``torch.distributed`` collective,
and the collective each holds."""


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _payload_bytes(args: tuple, kwargs: dict[str, Any]) -> int:
    """The largest buffer among a collective's arguments, in bytes."""
    return max((_nbytes(v) for v in (*args, *kwargs.values())), default=0)


class _LateWork:
    """A work that completes at ``done_at`` (``time.perf_counter`` seconds) at the earliest."""

    def __init__(self, work: Any, done_at: float, link: SlowLink) -> None:
        self._work = work
        self._done_at = done_at
        self._link = link

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        self._link.sleep_until(self._done_at)
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self._done_at and (
            self._work is None or self._work.is_completed()
        )


class SlowLink:
    """The link's clock and counters.

    Attributes:
        bytes_per_s: the link's bandwidth (bytes per second).
        calls: collectives issued through it.
        waited_s: seconds callers spent sleeping for the link (beyond the real collective).
        bytes_by_name: bytes booked per collective name (``"all_reduce"``, ...).
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self.calls = 0
        self.waited_s = 0.0
        self.bytes_by_name: dict[str, int] = {}
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def book(self, nbytes: int, name: str = "") -> float:
        """Reserve the link for ``nbytes``; returns when they are through."""
        with self._lock:
            self.bytes_by_name[name] = self.bytes_by_name.get(name, 0) + nbytes
            start = max(time.perf_counter(), self._busy_until)
            self._busy_until = start + nbytes / self.bytes_per_s
            self.calls += 1
            return self._busy_until

    def sleep_until(self, done_at: float) -> None:
        """Sleep until ``done_at`` (no-op once it passed)."""
        left = done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited_s += left

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` (the collective ``name``) slowed by this link."""

        @functools.wraps(fn)
        def slowed(*args: Any, **kwargs: Any) -> Any:
            done_at = self.book(_payload_bytes(args, kwargs), name)
            work = fn(*args, **kwargs)
            if kwargs.get("async_op", False):
                return _LateWork(work, done_at, self)
            self.sleep_until(done_at)
            return work

        return slowed


@contextlib.contextmanager
def slow_link(bytes_per_s: float) -> Iterator[SlowLink]:
    """Slow every collective of this process to ``bytes_per_s`` while entered."""
    link = SlowLink(bytes_per_s)
    targets: list[tuple[Any, str, str]] = [(dist, name, name) for name in _WRAPPED]
    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if backend is not None:
        targets += [
            (backend, a, n) for a, n in _DEEPSPEED_CACHED.items() if getattr(backend, a, None)
        ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    for (owner, attr, fn), (_, _, label) in zip(saved, targets, strict=True):
        setattr(owner, attr, link.wrap(fn, label))
    try:
        yield link
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)

"""A slow link for tests and benchmarks: every collective of this process completes no
sooner than a link of a given bandwidth would let it.

``slow_link(bytes_per_s)`` wraps ``torch.distributed``'s collectives (``broadcast``,
``all_reduce``, ``reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) while
it is entered. The link carries one collective at a time, in the order they are issued:
collective ``k`` of ``n`` bytes (its first tensor) is done at
``max(issued_k, done_{k-1}) + n / bytes_per_s``. A synchronous call returns then; an
asynchronous one returns at once with a work whose ``wait()`` returns then (and after the
real collective). So a wait that comes late costs nothing: what overlap hides is visible
in wall time on a CPU machine.
"""

from __future__ import annotations

import contextlib
import functools
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
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


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
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self.calls = 0
        self.waited_s = 0.0
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def book(self, nbytes: int) -> float:
        """Reserve the link for ``nbytes``; returns when they are through."""
        with self._lock:
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

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a collective) slowed by this link."""

        @functools.wraps(fn)
        def slowed(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            done_at = self.book(tensor.numel() * tensor.element_size())
            work = fn(tensor, *args, **kwargs)
            if kwargs.get("async_op", False):
                return _LateWork(work, done_at, self)
            self.sleep_until(done_at)
            return work

        return slowed


@contextlib.contextmanager
def slow_link(bytes_per_s: float) -> Iterator[SlowLink]:
    """Slow every collective of this process to ``bytes_per_s`` while entered."""
    link = SlowLink(bytes_per_s)
    saved = {name: getattr(dist, name) for name in _WRAPPED}
    for name, fn in saved.items():
        setattr(dist, name, link.wrap(fn))
    try:
        yield link
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)

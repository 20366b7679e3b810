"""Host buffers backed by transparent huge pages.

A fresh host buffer costs a page fault per 4 KiB page on first touch; on a typical
Linux server that caps first writes at 1-3 GB/s, several times slower than memcpy.
Asking the kernel for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) before the first
touch cuts the faults 512-fold. PyTorch offers this only through the process-wide
``THP_MEM_ALLOC_ENABLE`` variable read at start-up; here it is done per buffer.

``HugePageFactories`` does the same for the tensors an optimizer makes for its state
(``torch.zeros_like`` of a host shard): a step reads and writes the whole of them, and
huge pages spare it TLB misses (measured: docs/benchmarks.md, "Figures behind the code's
docstrings").

Page-locked buffers (``page_locked``: staging slots, offload's gradient shards, the
asynchronous save's snapshot) are mappings of their own, registered by flatzero where the
accelerator's runtime can, so that releasing them gives back exactly those pages and never
empties the process's pinned cache (see [Note: page-locked host buffers, in one place]).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import accel

__all__ = [
    "HugePageFactories",
    "StagingBuffer",
    "empty_host",
    "mapped_host",
    "page_locked",
    "staging_buffer",
]

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 * 2**20
"""Bytes in a transparent huge page on x86-64 and arm64 Linux."""

_MADV_HUGEPAGE = 14
_MADV_DONTFORK = 10
_MIN_BYTES = 4 * _HUGE_PAGE
"""Smaller buffers are allocated plainly: rounding them to huge pages would waste memory."""


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_host(numel: int, dtype: torch.dtype, *, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialized 1-D host tensor, on huge pages when ``huge_pages`` and the OS
    allows (else ``torch.empty``).

    The result is a view starting on a 2 MiB boundary of a slightly larger buffer;
    it behaves like ``torch.empty(numel, dtype=dtype)`` in every other way. Whether huge
    pages are written faster the first time depends on the machine: they save 511 of 512
    page faults, and a VM may still write them slower (docs/benchmarks.md).
    ``flatzero info --measure`` measures both.
    """
    nbytes = numel * dtype.itemsize
    madvise = _madvise() if huge_pages else None
    if madvise is None or nbytes < _MIN_BYTES:
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    length = (nbytes + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    length = min(length, raw.numel() - start) // _HUGE_PAGE * _HUGE_PAGE
    madvise(raw.data_ptr() + start, length, _MADV_HUGEPAGE)  # advice only: failure is harmless
    return raw[start : start + nbytes].view(dtype)


def mapped_host(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A 1-D uint8 host tensor of ``nbytes`` bytes in a private anonymous mapping of its own
    (not torch's allocator: its pages stay with it, faulted in once, for as long as it
    lives; ``MADV_DONTFORK``: a forked child, a DataLoader worker, gets no copy of it, where
    page-locked pages would otherwise be copied at the fork), starting on a 2 MiB boundary
    and advised for huge pages (``huge_pages`` and ``nbytes`` of ``_MIN_BYTES`` or more).

    For a buffer that is filled again and again (an asynchronous save's snapshot): on huge
    pages a first copy into it faults 512 times fewer pages and an ``O_DIRECT`` write of it
    has the kernel pin 512 times fewer pages, with less of the training's compute lost
    meanwhile (measured: docs/benchmarks.md; docs/checkpoints.md)."""
    madvise = _madvise()
    huge = huge_pages and nbytes >= _MIN_BYTES and madvise is not None
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    length = max(1, nbytes + (_HUGE_PAGE if huge else 0))
    raw = torch.frombuffer(mmap.mmap(-1, length, flags=private), dtype=torch.uint8)
    if madvise is not None:  # advice only: failure is harmless
        madvise(raw.data_ptr(), length, _MADV_DONTFORK)
    if not huge:
        return raw[:nbytes]
    start = -raw.data_ptr() % _HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[start : start + nbytes]


_FILLS: dict[Callable[..., torch.Tensor], Callable[[torch.Tensor, tuple, dict], Any]] = {
    torch.zeros_like: lambda out, args, kwargs: out.zero_(),
    torch.full_like: lambda out, args, kwargs: out.fill_(
        args[1] if len(args) > 1 else kwargs["fill_value"]
    ),
    torch.empty_like: lambda out, args, kwargs: out,
}
"""The factories ``HugePageFactories`` redirects, and how each fills its new tensor."""

_SAME_LAYOUT = (None, torch.preserve_format, torch.contiguous_format)


def _redirectable(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` makes a large contiguous host tensor exactly like
    ``args[0]`` (no other dtype, device, layout or ``requires_grad`` asked for)."""
    if func not in _FILLS or not args or type(args[0]) not in (torch.Tensor, torch.nn.Parameter):
        return False  # a tensor subclass (DTensor, ...) makes its own
    if func is torch.full_like and len(args) < 2 and "fill_value" not in kwargs:
        return False  # torch's own error
    like = args[0]
    asked = {k: v for k, v in kwargs.items() if k != "fill_value"}
    return (
        like.device.type == "cpu"
        and like.layout == torch.strided
        and like.is_contiguous()
        and like.numel() * like.element_size() >= _MIN_BYTES
        and asked.pop("memory_format", None) in _SAME_LAYOUT
        and asked.pop("dtype", None) in (None, like.dtype)
        and asked.pop("device", None) in (None, like.device, like.device.type)
        and asked.pop("layout", None) in (None, torch.strided)
        and not asked.pop("requires_grad", False)
        and not asked
    )


class HugePageFactories(TorchFunctionMode):
    """Within it, ``torch.zeros_like``, ``torch.full_like`` and ``torch.empty_like`` of a
    large contiguous host tensor (``_MIN_BYTES`` or more) return ``empty_host`` memory (2 MiB
    pages where the OS allows), filled as the factory fills; every other call runs as it
    is. ``torch.optim``'s optimizers make most of their state with these factories (Adam,
    AdamW, fused SGD at their first step, Adagrad when built; foreach SGD clones the
    gradient instead), so building and stepping within it puts that state on huge
    pages."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _redirectable(func, args, kwargs):
            return func(*args, **kwargs)
        like = args[0]
        out = empty_host(like.numel(), like.dtype).view(like.shape)
        return _FILLS[func](out, args, kwargs)


@dataclass
class StagingBuffer:
    """A 1-D uint8 host buffer for copies between host memory and an accelerator.

    Attributes:
        data: the buffer.
        pinned: page-locked: a copy to or from the accelerator is an asynchronous DMA.
        registered: page-locked in place by flatzero (``accel.pin_host``) rather than
            taken from torch's pinned caching allocator; ``release`` unpins it, and so
            does dropping the last reference to this object (before its pages are unmapped).
        device: the device whose context registered it (None: the current one).
    """

    data: torch.Tensor
    pinned: bool
    registered: bool = False
    device: torch.device | None = None

    def __post_init__(self) -> None:
        self._unpin = weakref.finalize(
            self, _unpin, self.data, self.device, self.registered, os.getpid()
        )
        self._unpin.atexit = False  # the process's exit releases its pages anyway

    def release(self) -> None:
        """Unpin what flatzero pinned for this buffer, and nothing else of the process (a
        DataLoader's pinned batches stay as they are). Call it once no copy reads or
        writes the buffer any more, then drop it. A buffer from torch's pinned caching
        allocator goes back to that cache when dropped; the cache is never emptied here."""
        if self.registered:
            self.registered = False
            self._unpin()


def _unpin(data: torch.Tensor, device: torch.device | None, registered: bool, pid: int) -> None:
    """Unregister ``data``: after the device ran every copy queued before (a copy still in
    flight would read or write pages no longer page-locked, or soon unmapped), and only in
    the process that registered it (a forked child that drops its copy of the object must
    not touch the parent's runtime nor CUDA at all)."""
    if registered and os.getpid() == pid:
        with _context(device):
            accel.synchronize(device or torch.device(accel.accelerator_type()))
            accel.unpin_host(data)


def _context(device: torch.device | None) -> contextlib.AbstractContextManager[None]:
    """``device`` made current for the block (nothing when None): a registration is made in
    the context of the device its buffer serves, never in device 0's by default."""
    return contextlib.nullcontext() if device is None else accel.on_device(device)


# [Note: page-locked host buffers, in one place]
# Every long-lived host buffer flatzero page-locks (the staging ring's slots, optimizer
# offload's gradient shards, an asynchronous save's snapshot) comes from ``page_locked``: a
# private anonymous mapping of its own (``mapped_host``: no page shared with other memory,
# so no registration can collide with another; ``MADV_DONTFORK``: a forked DataLoader
# worker gets no copy of it, where Linux 5.9+ would copy every page-locked page into the
# child at the fork), registered in the context of the device it serves, unregistered by
# ``release`` or, at the latest, when its ``StagingBuffer`` is dropped, before the mapping
# goes. Memory from torch's pinned caching allocator (the fallback where the runtime cannot
# register) is torch's: it is neither marked nor unregistered here.


def page_locked(nbytes: int, *, device: torch.device | None = None) -> StagingBuffer:
    """A host buffer of ``nbytes`` bytes for copies to and from ``device`` (see
    [Note: page-locked host buffers, in one place]): registered in place where the
    runtime can, else from torch's pinned caching allocator, else pageable (its copies are
    then synchronous: slower, never wrong). Call ``release`` when done with it."""
    host = mapped_host(nbytes)
    with _context(device):
        if accel.pin_host(host):
            return StagingBuffer(host, pinned=True, registered=True, device=device)
        cached = accel.pinned_empty(nbytes)
    if cached is not None:
        return StagingBuffer(cached[:nbytes], pinned=True)
    return StagingBuffer(host, pinned=False)


def staging_buffer(nbytes: int, *, pin: bool, device: torch.device | None = None) -> StagingBuffer:
    """A host buffer of ``nbytes`` bytes for uploads to ``device``, page-locked if ``pin``
    and possible (``page_locked``), else pageable host memory.

    Page-locked (pinned) memory makes a host-to-device copy a true asynchronous DMA. Where
    the runtime cannot register host memory it comes from torch's pinned caching allocator,
    which rounds a request up to a power of two (callers ask for powers of two). Call
    ``release`` when done with it.
    """
    if not pin:
        return StagingBuffer(empty_host(nbytes, torch.uint8), pinned=False)
    return page_locked(nbytes, device=device)

"""Hardware limits, measured in the same run for the same bytes (``flatzero bench``'s
denominators and ``flatzero plan``'s calibration).

Every figure flatzero reports is a ratio against a limit measured alongside it:

- ``memcpy_seconds``: a plain host copy (``Tensor.copy_`` between two preallocated byte
  buffers, which torch runs as a parallel memcpy), with the thread count capped;
- ``first_touch_seconds``: a write of memory the process has never touched, page faults
  included (the cost of any new host buffer; on a virtual machine it includes the host
  backing the guest's pages, which can be an order of magnitude slower than memcpy);
- ``device_copy_seconds``: a device-to-device copy on CUDA, timed with CUDA events (on the
  CPU this is ``memcpy_seconds``);
- ``pinned_h2d_seconds``: pinned host memory to the device (``None`` without CUDA).

Each copy limit moves ``nbytes`` in chunks of at most ``chunk_bytes`` between two buffers of one
chunk each (so it never holds more than two chunks), warms up once (page faults, first-touch
and allocator effects are excluded), then reports the best of ``repeats`` passes over all
``nbytes``. The source is filled before the warm-up: copying untouched pages would read the
shared zero page and look faster than memory allows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import accel

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "CopyLimit",
    "device_copy_seconds",
    "first_touch_seconds",
    "memcpy_seconds",
    "pinned_h2d_seconds",
]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
"""Largest single copy in bytes (256 MiB); a measurement allocates two such buffers."""


@dataclass(frozen=True)
class CopyLimit:
    """One measured copy bandwidth.

    Attributes:
        kind: ``"memcpy"``, ``"first_touch"``, ``"device_copy"`` or ``"pinned_h2d"``.
        device: where the destination lives (``"cpu"``, ``"cuda:0"``, ...).
        nbytes: bytes copied per pass.
        seconds: best time of one pass over ``nbytes``, in seconds.
        threads: host threads used (``torch.get_num_threads()`` during the copy); ``None``
            for copies done by the device.
        chunk_bytes: bytes per single copy call.
        repeats: timed passes (after one warm-up pass).
        gbps: bandwidth in GB/s (1e9 bytes per second), ``nbytes / seconds / 1e9``.
    """

    kind: str
    device: str
    nbytes: int
    seconds: float
    threads: int | None
    chunk_bytes: int
    repeats: int
    gbps: float = field(init=False)

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"nbytes={self.nbytes} must be > 0")
        if self.seconds <= 0:
            raise ValueError(f"seconds={self.seconds} must be > 0 (timer resolution?)")
        object.__setattr__(self, "gbps", self.nbytes / self.seconds / 1e9)


def _validate(nbytes: int, repeats: int, chunk_bytes: int) -> None:
    if nbytes <= 0:
        raise ValueError(f"nbytes={nbytes} must be > 0")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be > 0")


def _chunks(nbytes: int, chunk: int) -> list[int]:
    full, rest = divmod(nbytes, chunk)
    return [chunk] * full + ([rest] if rest else [])


@contextmanager
def _num_threads(threads: int | None) -> Iterator[int]:
    """Cap torch's intra-op threads to ``threads`` inside the block; yields the count used."""
    before = torch.get_num_threads()
    if threads is None:
        yield before
        return
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (or None for torch's current count)")
    torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _best_of(run_pass: Callable[[], float], repeats: int) -> float:
    run_pass()  # warm-up
    return min(run_pass() for _ in range(repeats))


def memcpy_seconds(
    nbytes: int,
    threads: int | None = None,
    *,
    repeats: int = 3,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> CopyLimit:
    """Time a plain host copy of ``nbytes`` between two preallocated buffers.

    Args:
        nbytes: bytes to copy per pass.
        threads: cap on torch's intra-op threads during the copy (``None``: leave as is).
            Pass the cores per local rank to match what one rank may use.
        repeats: timed passes; the best is kept.
        chunk_bytes: bytes per copy call; at most two such buffers are allocated.

    Returns:
        The best pass in seconds, and GB/s in ``.gbps``.
    """
    _validate(nbytes, repeats, chunk_bytes)
    chunk = min(nbytes, chunk_bytes)
    chunks = _chunks(nbytes, chunk)
    src = torch.empty(chunk, dtype=torch.uint8)
    src.fill_(0x5A)
    run_pass = _host_pass(chunks, torch.empty(chunk, dtype=torch.uint8), src)
    with _num_threads(threads) as used:
        seconds = _best_of(run_pass, repeats)
    del src, run_pass
    result = CopyLimit("memcpy", "cpu", nbytes, seconds, used, chunk, repeats)
    logger.debug("memcpy %d B, %d threads: %.4f s, %.2f GB/s", nbytes, used, seconds, result.gbps)
    return result


SETTLE_SECONDS = 3.0
"""Seconds to wait before touching memory that must be cold: Linux's free page reporting
(virtio-balloon) hands pages freed by the guest back to the host 2 s after they are freed,
so a later first touch pays for the host backing them again, as at a job's start."""


def first_touch_seconds(
    nbytes: int,
    threads: int | None = None,
    *,
    repeats: int = 2,
    settle_s: float = SETTLE_SECONDS,
) -> CopyLimit:
    """Time writing ``nbytes`` into one newly allocated host buffer, page faults included.

    Every new host buffer (a flat bucket, an fp32 master copy) costs this on its first
    write: a page fault per page, the kernel zeroing it, and on a virtual machine the
    host backing the guest page. Before each pass the process sleeps ``settle_s`` so the
    memory freed by earlier work is cold again.

    Args:
        nbytes: bytes to write per pass (one buffer of this size is allocated per pass).
        threads: cap on torch's intra-op threads during the write (``None``: as is).
        repeats: passes, each on a new buffer after a settle; the best is kept.
        settle_s: seconds to sleep before each pass (0: memory freed just before may be
            reused warm, which measures the allocator rather than the machine).

    Returns:
        The best pass in seconds (kind ``"first_touch"``), and GB/s in ``.gbps``.
    """
    _validate(nbytes, repeats, nbytes)
    if settle_s < 0:
        raise ValueError(f"settle_s={settle_s} must be >= 0")
    times = []
    with _num_threads(threads) as used:
        for _ in range(repeats):
            time.sleep(settle_s)
            t0 = time.perf_counter()
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf.fill_(0x5A)
            times.append(time.perf_counter() - t0)
            del buf
    return CopyLimit("first_touch", "cpu", nbytes, min(times), used, nbytes, repeats)


def _host_pass(chunks: list[int], dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
    def one_pass() -> float:
        t0 = time.perf_counter()
        for n in chunks:
            dst[:n].copy_(src[:n])
        return time.perf_counter() - t0

    return one_pass


def _device_pass(
    dev: torch.device, chunks: list[int], dst: torch.Tensor, src: torch.Tensor
) -> Callable[[], float]:
    def one_pass() -> float:
        start = accel.new_timing_event(dev)
        end = accel.new_timing_event(dev)
        start.record()
        for n in chunks:
            dst[:n].copy_(src[:n], non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return one_pass


def _device_copy_seconds(
    kind: str, nbytes: int, dev: torch.device, repeats: int, chunk_bytes: int
) -> CopyLimit | None:
    """Time copies of ``nbytes`` into ``dev`` with the device's timing events, from a buffer
    on ``dev`` (``kind`` ``"device_copy"``) or in pinned host memory (``"pinned_h2d"``;
    None where the backend has no pinned memory)."""
    _validate(nbytes, repeats, chunk_bytes)
    chunk = min(nbytes, chunk_bytes)
    with accel.on_device(dev):
        if kind == "pinned_h2d":
            src = accel.pinned_empty(chunk)
            if src is None:
                return None
            src.fill_(0x5A)
        else:
            src = torch.full((chunk,), 0x5A, dtype=torch.uint8, device=dev)
        dst = torch.empty(chunk, dtype=torch.uint8, device=dev)
        seconds = _best_of(_device_pass(dev, _chunks(nbytes, chunk), dst, src), repeats)
        del src, dst
    return CopyLimit(kind, str(dev), nbytes, seconds, None, chunk, repeats)


def device_copy_seconds(
    nbytes: int,
    device: torch.device | str,
    *,
    repeats: int = 3,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
) -> CopyLimit:
    """Time a device-to-device copy of ``nbytes`` (the device's timing events); on a CPU
    device, a memcpy.

    Args:
        nbytes: bytes to copy per pass.
        device: the device; ``"cpu"`` measures ``memcpy_seconds(nbytes, threads)``.
        repeats: timed passes; the best is kept.
        chunk_bytes: bytes per copy call; at most two such buffers are allocated.
        threads: host thread cap, used only for a CPU device.

    Returns:
        The best pass in seconds, and GB/s in ``.gbps``.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return memcpy_seconds(nbytes, threads, repeats=repeats, chunk_bytes=chunk_bytes)
    if not accel.is_accelerator(dev):
        raise ValueError(f"device={dev} is not supported: use 'cpu' or an accelerator")
    limit = _device_copy_seconds("device_copy", nbytes, dev, repeats, chunk_bytes)
    assert limit is not None  # only a pinned source can be missing
    return limit


def pinned_h2d_seconds(
    nbytes: int,
    device: torch.device | str,
    *,
    repeats: int = 3,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> CopyLimit | None:
    """Time a pinned-host-to-device copy of ``nbytes`` (the device's timing events).

    Args:
        nbytes: bytes to copy per pass.
        device: the accelerator.
        repeats: timed passes; the best is kept.
        chunk_bytes: bytes per copy call; one pinned and one device buffer of this size.

    Returns:
        The best pass in seconds and GB/s, or ``None`` when ``device`` is not an
        accelerator of this process or its backend has no pinned host memory.
    """
    dev = torch.device(device)
    if not accel.is_accelerator(dev) or accel.accelerator_type() != dev.type:
        return None
    return _device_copy_seconds("pinned_h2d", nbytes, dev, repeats, chunk_bytes)

"""Asynchronous saves: a snapshot in reusable host memory, a background writer, a wait.

``save_checkpoint(..., asynchronous=True)`` lays what the rank writes out in one host
buffer per optimizer (``snapshot``: page-locked where an accelerator is present, so device
shards come over by DMA; allocated at the first asynchronous save, kept and reused by the
next ones, grown when the state grows), starts the copies into it and returns. Device
shards are copied on a side stream; host shards (the master and moments of a CPU run or of
optimizer offload) by the background thread. Until those copies have landed the optimizer
holds its next inner step (``Staging.fence``): the forward and backward passes of the next
step run meanwhile, and the checkpoint holds the state as it was at the call. The same
thread per rank then writes and fsyncs the rank file from the snapshot and reports to rank
0's thread through the c10d store (``reports``), which publishes as a synchronous save
does. The checkpoint appears, and ``latest`` moves, only once every rank's file is
complete: a kill during the background write leaves the previous checkpoint as it was.

The buffer and the pending save are the optimizer's ``checkpointer.Checkpointer``'s; the
next save, load or ``wait_for_save`` waits for the pending one there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from .. import accel
from ..storage.checksum import ChunkSums
from ..storage.image import PAGE, FileImage, checksums, lay_out, padded
from .atomic import fault_point
from .checkpointer import Checkpointer

__all__ = [
    "Hasher",
    "Staging",
    "lower_priority",
    "snapshot",
    "snapshot_nbytes",
]

logger = logging.getLogger(__name__)

WRITER_NICE = 19
"""The nice value of a save's CPU work (``Hasher``: the lowest priority), where ``SCHED_IDLE``
cannot be had: on a machine whose cores all run the training step, it takes only
time the step leaves idle; where a core is free (the step runs on accelerators), it runs at
full speed."""

_COPY_BYTES = 64 * 2**20
"""Bytes per ``memmove`` of the background thread's copies."""


def snapshot_nbytes(data_nbytes: Sequence[int]) -> int:
    """Bytes of the snapshot buffer for files of ``data_nbytes`` data bytes each: each
    file's data rounded up to the page (``image.padded``). ``flatzero plan`` shows it."""
    return sum(padded(n) for n in data_nbytes)


class Staging:
    """The copies of a snapshot that are still to land when ``save_checkpoint`` returns.

    Host tensors that only the optimizer's step or a load changes (its master and state
    shards) are copied by the background thread, before it writes, while training goes on
    (``copy_host``). Device tensors are copied on a side stream of their device, an event
    recorded after them (``device_events``). The next change of that state first runs
    ``fence`` (``FlatParams.hold_state_until``), so the snapshot holds the state as it was
    at the call; the forward and backward passes in between overlap the copies.

    The host copies are ``_COPY_BYTES`` chunks that either thread may take: the fence
    copies what the background thread has not yet (at the training thread's priority)
    rather than wait for it, so a busy machine never leaves the step waiting on a
    ``SCHED_IDLE`` thread.
    """

    def __init__(
        self,
        host_copies: list[tuple[torch.Tensor, torch.Tensor]],
        device_events: list[tuple[torch.device, Any]],
        device_sources: list[torch.Tensor],
    ) -> None:
        """Args:
        host_copies: (destination, source) pairs of contiguous host uint8 tensors.
        device_events: per device with streams, the event after its copies.
        device_sources: the device tensors being copied (kept alive until they landed:
            a temporary freed early could be reused by the next kernel)."""
        self.device_events = device_events
        self._device_sources = device_sources
        self._host = host_copies  # keeps the chunks' memory alive
        self._chunks = [
            (dst.data_ptr() + at, src.data_ptr() + at, min(_COPY_BYTES, src.numel() - at))
            for dst, src in host_copies
            for at in range(0, src.numel(), _COPY_BYTES)
        ]
        self._lock = threading.Lock()
        self._taken = 0
        self._copied = 0
        self.landed = threading.Event()
        """Set once every host chunk is copied (by whichever thread copied the last: the
        fence copies what the background thread never took, so it is set even when that
        thread failed before copying)."""
        if not self._chunks:
            self.landed.set()

    def copy_host(self) -> None:
        """Copy the host chunks no thread has taken yet, one ``memmove`` each (the GIL
        released): the background thread and the fence both call it."""
        while True:
            with self._lock:
                if self._taken == len(self._chunks):
                    return
                chunk = self._chunks[self._taken]
                self._taken += 1
            ctypes.memmove(*chunk)
            with self._lock:
                self._copied += 1
                if self._copied == len(self._chunks):
                    self.landed.set()

    def wait_device_copies(self) -> None:
        """Block the calling thread until the device copies have landed (each device made
        current for its wait: a thread of its own would otherwise talk to device 0)."""
        for device, event in self.device_events:
            with accel.on_device(device):
                event.synchronize()
        self._device_sources = []

    def fence(self) -> None:
        """(The training thread, before the state changes.) Queue the devices' next work
        after their copies (no host sync); copy the host chunks left and wait for the
        ones being copied."""
        for device, event in self.device_events:
            accel.current_stream(device).wait_event(event)
        self.copy_host()
        self.landed.wait()  # the chunks the background thread is copying


def _copy_from_device(
    device: torch.device,
    now: list[tuple[torch.Tensor, torch.Tensor]],
    later: list[tuple[torch.Tensor, torch.Tensor]],
    pinned: bool,
) -> Any:
    """Start ``now`` then ``later`` (host destination, ``device`` source pairs) on a side
    stream after the work queued so far; the device's next work is queued after ``now``
    (tensors the forward pass may change: no host sync). Returns the event recorded after
    all of them (None without streams: then the copies were synchronous)."""
    if not accel.has_streams(device):
        for dst, src in [*now, *later]:
            dst.copy_(src)
        return None
    stream = accel.new_stream(device)
    stream.wait_stream(accel.current_stream(device))
    with accel.use_stream(stream):
        for dst, src in now:
            dst.copy_(src, non_blocking=pinned)
        if now:
            now_event = accel.new_event(device)
            now_event.record(stream)
            accel.current_stream(device).wait_event(now_event)
        for dst, src in later:
            dst.copy_(src, non_blocking=pinned)
    event = accel.new_event(device, blocking=True)
    event.record(stream)
    return event


def snapshot(
    checkpointer: Checkpointer,
    files: Sequence[tuple[str, Sequence[tuple[str, torch.Tensor]], dict[str, str] | None]],
    *,
    deferrable: Sequence[bool | Collection[str]],
) -> tuple[list[FileImage], Staging]:
    """``files`` (per file: its name, its tensors in order and its metadata) laid out in
    ``checkpointer``'s reusable host buffer as the files' data (``image.lay_out``), and the
    copies into it that are still to land (``Staging``): device tensors' (on a side stream,
    into a page-locked buffer) and, for each file with ``deferrable`` true (tensors that
    only the optimizer's step or a load changes), host tensors'; ``deferrable`` may instead
    name a file's tensors that are (frozen params: no forward pass changes them). The other
    host tensors are copied now, and the device's next work waits for the other device
    tensors' copies. The buffer is allocated at the first call and kept; a larger state (or
    device tensors after host ones) allocates anew.

    Raises:
        RuntimeError / OSError: the buffer cannot be allocated (out of host memory).
    """
    sizes = [padded(sum(t.numel() * t.element_size() for _, t in ts)) for _, ts, _ in files]
    total = max(PAGE, sum(sizes))
    on_device = {t.device for _, ts, _ in files for _, t in ts if accel.is_accelerator(t.device)}
    buffer = checkpointer.buffer(
        total, pin=bool(on_device), device=min(on_device, key=str, default=None)
    )
    images = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    from_device: dict[torch.device, tuple[list, list]] = {}
    offset = 0
    for (name, tensors, metadata), size, defer_which in zip(files, sizes, deferrable, strict=True):
        image, copies = lay_out(name, tensors, metadata, buffer.data[offset : offset + size])
        images.append(image)
        offset += size
        defers = [  # per copy: lay_out copies the tensors with bytes, in order
            defer_which if isinstance(defer_which, bool) else n in defer_which
            for n, t in tensors
            if t.numel() * t.element_size()
        ]
        for (dst, src), defer in zip(copies, defers, strict=True):
            if accel.is_accelerator(src.device):
                now_and_later = from_device.setdefault(src.device, ([], []))
                now_and_later[1 if defer else 0].append((dst, src))
            elif defer:
                later.append((dst, src))
            else:
                dst.copy_(src)
    events = [(d, _copy_from_device(d, *c, buffer.pinned)) for d, c in from_device.items()]
    sources = [src for now, after in from_device.values() for _, src in (*now, *after)]
    return images, Staging(later, [(d, e) for d, e in events if e is not None], sources)


def lower_priority() -> None:
    """Make the calling thread yield the cores to the training threads.

    On Linux a thread's scheduling policy and nice value are its own (set through its
    thread id). ``SCHED_IDLE`` first: besides the lowest weight, its thread never preempts
    a running training thread when it wakes (each time a write completes), where a nice 19
    thread still may, stalling every thread of the step's parallel regions while it runs.
    Else nice ``WRITER_NICE``."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError) as error:  # not Linux, or not allowed
        logger.debug("the asynchronous save's thread is not SCHED_IDLE: %s", error)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
    except (AttributeError, OSError) as error:
        logger.debug("the asynchronous save's thread keeps its priority: %s", error)


class Hasher:
    """The CPU work of a background save, in a thread of its own at the lowest priority
    (``lower_priority``): it copies the snapshot's host chunks the next step's fence has
    not (``Staging.copy_host``), then computes the files' checksums from the snapshot
    (crc32c, about 0.45 CPU-s per 5.1 GB on the development VM). Meanwhile the writer
    thread, at the caller's priority, writes the files as soon as the snapshot is complete:
    where training keeps every core busy, an idle-priority thread would not even get to
    issue the writes, so the disk would sit idle until training stopped."""

    def __init__(
        self, images: Sequence[FileImage], staging: Staging, checksums_on: bool, rank: int
    ) -> None:
        self._images = images
        self._staging = staging
        self._checksums_on = checksums_on
        self._rank = rank
        self._sums: list[dict[str, ChunkSums | None]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="flatzero-checksums", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        try:
            fault_point("copying_snapshot", self._rank)
            self._staging.copy_host()
            self._staging.landed.wait()  # chunks the fence took
            self._staging.wait_device_copies()
            self._sums = [
                checksums(image)
                if self._checksums_on
                else dict.fromkeys(e.name for e in image.entries)
                for image in self._images
            ]
        except BaseException as error:
            self._error = error
            self._staging.copy_host()  # the writer waits for the snapshot: never in vain

    def sums(self, index: int) -> dict[str, ChunkSums | None]:
        """The checksums of image ``index`` (waits for the thread; raises its error)."""
        self.join()
        if self._error is not None:
            raise self._error
        return self._sums[index]

    def join(self) -> None:
        """Wait for the thread."""
        self._thread.join()

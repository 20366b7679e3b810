"""The flatten tiers: how one bucket's buffer gets filled.

A tier fills an already allocated bucket buffer and returns a ``Fill`` telling when
the copy has completed; the driver (``flatten.driver``) allocates, agrees with the other
ranks, rebinds params once their bucket is complete, and falls back to the next tier
down when memory runs out. Tiers never rebind a param to a partially filled bucket.
The tiers: [Note: the tiers' sources and paths]; their steps: [Note: a tier's steps per
bucket].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import accel
from ..comm import all_gather_into
from ..hostmem import StagingBuffer, empty_host, staging_buffer
from ..layout import GroupLayout
from ..report import ReportBuilder
from .source import ParamSource

__all__ = [
    "STAGING_CHUNK_BYTES",
    "Fill",
    "StagingRing",
    "Tier",
    "TierContext",
    "chunks",
    "copy_kind",
    "staging_slot_bytes",
]


@dataclass
class Fill:
    """A bucket whose copy has been issued.

    Attributes:
        buffer: the bucket buffer.
        done: an event recorded on the copy stream after the last copy into it, or None
            when the copy was synchronous or ordered on the current stream.
    """

    buffer: torch.Tensor
    done: Any = None

    def wait(self) -> None:
        """Block until the copy has completed and order the current stream after it."""
        if self.done is not None:
            self.done.synchronize()
            accel.current_stream(self.buffer.device).wait_event(self.done)

    def ready(self) -> bool:
        """True when the copy has completed (never blocks)."""
        return self.done is None or self.done.query()


STAGING_CHUNK_BYTES = 64 * 2**20
"""Largest staging slot (bytes): a bucket or slice larger than this is streamed through
the ring in chunks, so pinned memory per rank stays ``staging_buffers`` x 64 MiB at most
whatever the bucket size (a 152k x 2048 embedding alone in its bucket is 600 MiB)."""


def staging_slot_bytes(largest_staged_bytes: int) -> int:
    """Bytes of one staging slot for ranges of at most ``largest_staged_bytes``: the next
    power of two (what the pinned allocator hands out anyway), at most
    ``STAGING_CHUNK_BYTES``."""
    need = max(1, largest_staged_bytes)
    return min(STAGING_CHUNK_BYTES, 1 << (need - 1).bit_length())


def chunks(lo: int, hi: int, numel: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into consecutive ranges of at most ``numel`` elements."""
    return [(start, min(start + numel, hi)) for start in range(lo, hi, numel)]


@dataclass
class _Slot:
    staging: StagingBuffer  # uint8, viewed as the bucket dtype
    done: Any = None  # the device event of the upload reading the slot


class StagingRing:
    """A few host buffers that host fills and uploads take turns on.

    Pinned for uploads to an accelerator (so the upload is a true async DMA and the fill
    of one slot overlaps the upload of the others), pageable when pinning fails.

    Args:
        slots: number of buffers.
        nbytes: size of each buffer (bytes); see ``staging_slot_bytes``.
        pin: page-lock them (``hostmem.staging_buffer``).
        device: the device they upload to (registered in its context).
    """

    def __init__(
        self, slots: int, nbytes: int, *, pin: bool, device: torch.device | None = None
    ) -> None:
        self._slots = [_Slot(staging_buffer(nbytes, pin=pin, device=device)) for _ in range(slots)]
        self.pinned = pin and all(s.staging.pinned for s in self._slots)
        self.slot_bytes = nbytes
        self._next = 0

    @property
    def nbytes(self) -> int:
        """Host bytes the ring holds."""
        return self.slot_bytes * len(self._slots)

    def acquire(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, _Slot]:
        """The next slot, once its previous upload has completed, and its first
        ``numel`` elements viewed as ``dtype``; set ``slot.done`` after uploading from it."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.done is not None:
            slot.done.synchronize()
            slot.done = None
        nbytes = numel * dtype.itemsize
        assert nbytes <= self.slot_bytes, "a staged chunk is larger than a slot"
        return slot.staging.data[:nbytes].view(dtype), slot

    def release(self) -> None:
        """Wait until no upload reads from the ring any more, then unpin what was pinned
        for it (and nothing else of the process); the ring is not used afterwards."""
        for slot in self._slots:
            if slot.done is not None:
                slot.done.synchronize()
                slot.done = None
            slot.staging.release()


@dataclass
class TierContext:
    """What every tier of one ``flatten_parameters`` call shares.

    Attributes:
        device: the target device of the flat buffers.
        rank: this rank.
        world_size: ranks in ``group``.
        group: the process group (None at world size 1 without one).
        report: where bytes moved and events are counted.
        staging_slots: number of staging buffers for the upload tiers.
        largest_bucket_bytes: bytes of the largest bucket (what ``host`` stages).
        largest_slice_bytes: bytes of the largest rank slice (what ``sharded`` stages).
        huge_pages: host buffers (buckets, ``host_park`` images) on 2 MiB pages
            (``FlattenConfig.host_huge_pages``).
    """

    device: torch.device
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    report: ReportBuilder
    staging_slots: int
    largest_bucket_bytes: int
    largest_slice_bytes: int
    huge_pages: bool = True
    _rings: dict[int, StagingRing] = field(default_factory=dict, repr=False)
    _copy_stream: Any = field(default=None, repr=False)

    def ring(self, largest_staged_bytes: int) -> StagingRing:
        """A pinned staging ring whose slots take chunks of ranges up to
        ``largest_staged_bytes``, created on first use (one per slot size; the ``host`` and
        ``sharded`` tiers of one call may both stage)."""
        nbytes = staging_slot_bytes(largest_staged_bytes)
        ring = self._rings.get(nbytes)
        if ring is None:
            ring = StagingRing(self.staging_slots, nbytes, pin=True, device=self.device)
            self._rings[nbytes] = ring
        return ring

    @property
    def staging_bytes(self) -> int:
        """Host bytes held by the staging rings now."""
        return sum(r.nbytes for r in self._rings.values())

    @property
    def copy_stream(self) -> Any:
        """A side stream for host-to-device copies (None when buffers are on the host or
        the device has no streams: the copies are then synchronous)."""
        if self._copy_stream is None and _streamed(self.device):
            self._copy_stream = accel.new_stream(self.device)
        return self._copy_stream

    def close(self) -> None:
        """Wait for every upload, then release the staging memory: the pages flatzero
        pinned are unpinned, and no other pinned memory of the process is touched."""
        for ring in self._rings.values():
            ring.release()
        self._rings.clear()


def _streamed(device: torch.device) -> bool:
    """Whether uploads to ``device`` go through pinned staging on a copy stream: an
    accelerator with streams (a test seam: CPU tests run that path with the device seam's
    streams stubbed)."""
    return accel.is_accelerator(device) and accel.has_streams(device)


def copy_kind(src: torch.device, dst: torch.device) -> str:
    """The ``InitReport.bytes_moved`` key of a copy from ``src`` to ``dst``."""
    if src.type == "cpu":
        return "host_copy" if dst.type == "cpu" else "h2d"
    return "d2h" if dst.type == "cpu" else "device_copy"


def _zero_gaps(layout: GroupLayout, bucket: int, dest: torch.Tensor, lo: int, hi: int) -> None:
    """Zero the padding of bucket elements ``[lo, hi)``, held in ``dest`` from ``lo`` on."""
    gaps = [dest[s - lo : e - lo] for s, e in layout.gaps(bucket, lo, hi)]
    if gaps:
        torch._foreach_zero_(gaps)


# [Note: the tiers' sources and paths]
# | tier    | source of the bucket            | path                                          |
# |---------|---------------------------------|-----------------------------------------------|
# | device  | params on the target device     | ``_foreach_copy_`` into the bucket            |
# | cpu     | params in host memory, no GPU   | ``_foreach_copy_`` into a host bucket         |
# | host    | params in host memory, 1 rank   | host fill of staging chunks, async upload     |
# | sharded | params in host memory, N ranks  | upload of this rank's slice, all-gather       |
# | host_park | params on the device, no room | bucket by bucket: params to a host image, the |
# |           |                               | image uploaded as ``host`` does               |
#
# [Note: a tier's steps per bucket]
# A tier's steps per bucket: ``prepare`` (before allocation: ``host_park`` moves the bucket's
# params out of the way), then, when allocation still fails, ``make_room`` (``host_park``
# moves the next bucket's params out too), then ``fill``, and for ``sharded`` at world size
# > 1 ``gather`` (the all-gather), which the driver issues only once every rank filled its
# slice and the next bucket's upload is queued, so that the two overlap. Staging memory
# (pinned on an accelerator) is a few slots of at most 64 MiB, released when the flatten
# call ends (``close``).


class DirectTier:
    """``device`` and ``cpu``: copy every param of the bucket straight into it.

    Args:
        name: the tier's name.
        ctx: the flatten call's shared state.
        on_host: the buckets go to host memory whatever the target device (``cpu``).
    """

    def __init__(self, name: str, ctx: TierContext, *, on_host: bool) -> None:
        self.name = name
        self.ctx = ctx
        self.bucket_device = torch.device("cpu") if on_host else ctx.device

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Nothing to prepare."""

    def prepare(self, layout: GroupLayout, source: ParamSource, bucket: int) -> None:
        """Nothing to do before the bucket is allocated."""

    def make_room(self, layout: GroupLayout, source: ParamSource) -> bool:
        """Nothing can be moved out of the way: False."""
        return False

    def fill(self, layout: GroupLayout, source: ParamSource, bucket: int, buf: torch.Tensor):
        """Copy the bucket's params into ``buf`` on the current stream."""
        pieces = list(layout.bucket_pieces_all(bucket))
        _zero_gaps(layout, bucket, buf, 0, buf.numel())
        kind = copy_kind(source.device_of(pieces) or buf.device, buf.device)
        self.ctx.report.moved(kind, source.copy_into(pieces, buf, 0))
        return Fill(buf)


class UploadTier:
    """``host`` and ``sharded``: fill staging slots on the host, upload them asynchronously.

    ``sharded`` uploads only this rank's slice of each bucket and all-gathers the rest,
    so each rank moves 1/N of the model over PCIe; ``host`` uploads whole buckets. A range
    larger than a staging slot is streamed through the ring chunk by chunk.

    Args:
        name: the tier's name.
        ctx: the flatten call's shared state.
        own_slice: upload only this rank's slice and all-gather the rest (``sharded``).
    """

    def __init__(self, name: str, ctx: TierContext, *, own_slice: bool) -> None:
        self.name = name
        self.ctx = ctx
        self.bucket_device = ctx.device
        self.own_slice = own_slice

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Nothing to prepare."""

    def prepare(self, layout: GroupLayout, source: ParamSource, bucket: int) -> None:
        """Nothing to do before the bucket is allocated."""

    def make_room(self, layout: GroupLayout, source: ParamSource) -> bool:
        """Nothing can be moved out of the way: False."""
        return False

    def _range(self, layout: GroupLayout, bucket: int) -> tuple[int, int]:
        if self.own_slice:
            return layout.buckets[bucket].rank_range(self.ctx.rank)
        return 0, layout.buckets[bucket].numel

    def fill(self, layout: GroupLayout, source: ParamSource, bucket: int, buf: torch.Tensor):
        """Fill this rank's part of the bucket chunk by chunk: in place for host buffers; on
        an accelerator each chunk is staged in the pinned ring and uploaded asynchronously
        on the copy stream, ordered after ``buf``'s allocation (the copy stream waits for
        the current stream, which holds no all-gather of the previous bucket yet: the
        driver queues that only after this upload). ``sharded`` then needs ``gather``."""
        ctx = self.ctx
        lo, hi = self._range(layout, bucket)
        largest = ctx.largest_slice_bytes if self.own_slice else ctx.largest_bucket_bytes
        chunk_numel = staging_slot_bytes(largest) // buf.element_size()
        stream = ctx.copy_stream
        ring = ctx.ring(largest) if stream is not None else None
        if stream is not None:
            stream.wait_stream(accel.current_stream(buf.device))  # buf's allocation
            # Before any copy: if this fill fails half-way and buf is dropped, the caching
            # allocator still waits for the copies already queued before reusing it.
            buf.record_stream(stream)
        done = None
        for start, end in chunks(lo, hi, chunk_numel):
            # Host buffers are filled in place; a device bucket through a staging slot.
            stage, slot = (
                (buf[start:end], None) if ring is None else ring.acquire(end - start, buf.dtype)
            )
            _zero_gaps(layout, bucket, stage, start, end)
            pieces = list(layout.pieces_between(bucket, start, end))
            ctx.report.moved("host_copy", source.copy_into(pieces, stage, start))
            if stream is not None and slot is not None:
                with accel.use_stream(stream):
                    buf[start:end].copy_(stage, non_blocking=ring.pinned)
                    done = accel.new_event(buf.device)
                    done.record(stream)
                slot.done = done
                ctx.report.moved("h2d", stage.nbytes)
        return Fill(buf, done)

    def gather(self, layout: GroupLayout, bucket: int, fill: Fill) -> Fill:
        """All-gather the other ranks' slices into the bucket (``sharded`` at world size >
        1), once every rank filled its own: the current stream first waits for this
        rank's upload (``fill.done``), and the collective is ordered after the current
        stream. Returns ``fill`` (its event still tells when this rank's upload is done)."""
        buf = fill.buffer
        lo, hi = self._range(layout, bucket)
        if fill.done is not None:
            accel.current_stream(buf.device).wait_event(fill.done)
        all_gather_into(buf, buf[lo:hi], self.ctx.group)
        self.ctx.report.moved("all_gather", buf.nbytes - buf[lo:hi].nbytes)
        return fill


class HostParkTier(UploadTier):
    """``host_park``: params on a full device make room for their own bucket (not optimizer
    offload: nothing here outlives init).

    Before a bucket is allocated, its params move to a host image laid out like the
    bucket and are rebound to it (their device memory is freed, their values kept); the
    image is then uploaded like the ``host`` tier does, through the pinned staging ring,
    and freed once the bucket is complete. One bucket's image is on the host at a time;
    when freeing one bucket's params is not enough room (they shared allocator blocks with
    other params), ``make_room`` moves the next bucket's params out too.
    """

    def __init__(self, name: str, ctx: TierContext) -> None:
        super().__init__(name, ctx, own_slice=False)
        self._moved: set[int] = set()
        self._ahead: list[int] = []

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Remember which buckets are still to come (``make_room`` takes from them)."""
        self._ahead = list(buckets)

    def prepare(self, layout: GroupLayout, source: ParamSource, bucket: int) -> None:
        """Move the bucket's params to a host image, releasing their device memory."""
        if bucket in self._ahead:
            self._ahead.remove(bucket)
        if bucket not in self._moved:
            self._park(layout, source, bucket)

    def make_room(self, layout: GroupLayout, source: ParamSource) -> bool:
        """Park the next bucket still on the device; False when none is left."""
        while self._ahead:
            bucket = self._ahead.pop(0)
            if bucket not in self._moved:
                self._park(layout, source, bucket)
                return True
        return False

    def _park(self, layout: GroupLayout, source: ParamSource, bucket: int) -> None:
        numel = layout.buckets[bucket].numel
        image = empty_host(numel, getattr(torch, layout.dtype), huge_pages=self.ctx.huge_pages)
        pieces = list(layout.bucket_pieces_all(bucket))
        _zero_gaps(layout, bucket, image, 0, numel)
        kind = copy_kind(source.device_of(pieces) or image.device, image.device)
        self.ctx.report.moved(kind, source.copy_into(pieces, image, 0))
        source.rebind_bucket(bucket, image)
        self._moved.add(bucket)


Tier = DirectTier | UploadTier | HostParkTier
"""Any tier object."""

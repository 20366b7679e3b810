"""The flatten tiers: how one bucket's buffer gets filled.

A tier fills an already allocated bucket buffer and returns a ``Fill`` telling when
the copy has completed; the driver (``flatten.api``) allocates, agrees with the other
ranks, rebinds params once their bucket is complete, and falls back to the next tier
down when memory runs out. Tiers never rebind a param to a partially filled bucket.

| tier    | source of the bucket            | path                                          |
|---------|---------------------------------|-----------------------------------------------|
| device  | params on the target device     | ``_foreach_copy_`` into the bucket            |
| cpu     | params in host memory, no GPU   | ``_foreach_copy_`` into a host bucket         |
| host    | params in host memory, 1 rank   | host fill of a staging slot, async upload     |
| sharded | params in host memory, N ranks  | upload of this rank's slice, all-gather       |
| offload | params on the device, no room   | params to pinned host images, then upload     |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import all_gather_into
from ..hostmem import empty_host
from ..layout import GroupLayout
from ..report import ReportBuilder
from .source import ParamSource

__all__ = ["Fill", "StagingRing", "Tier", "TierContext", "copy_kind", "make_tier"]


@dataclass
class Fill:
    """A bucket whose copy has been issued.

    Attributes:
        buffer: the bucket buffer.
        done: a CUDA event recorded after the last copy into it, or None when the copy
            was synchronous or ordered on the current stream.
    """

    buffer: torch.Tensor
    done: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Block until the copy has completed and order the current stream after it."""
        if self.done is not None:
            self.done.synchronize()
            torch.cuda.current_stream(self.buffer.device).wait_event(self.done)

    def ready(self) -> bool:
        """True when the copy has completed (never blocks)."""
        return self.done is None or self.done.query()


@dataclass
class _Slot:
    buffer: torch.Tensor  # uint8, viewed as the bucket dtype
    done: torch.cuda.Event | None = None


class StagingRing:
    """A few host buffers that host fills and uploads take turns on.

    Pinned when the target is a CUDA device, so the upload is a true async DMA; the
    fill of one slot overlaps the upload of the others.

    Args:
        slots: number of buffers.
        nbytes: size of each buffer (bytes): the largest bucket (or slice) to stage.
        pin: allocate page-locked memory.
    """

    def __init__(self, slots: int, nbytes: int, *, pin: bool) -> None:
        self._slots = [
            _Slot(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)) for _ in range(slots)
        ]
        self._next = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, _Slot]:
        """The next slot, once its previous upload has completed, and its first
        ``numel`` elements viewed as ``dtype``; set ``slot.done`` after uploading from it."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.done is not None:
            slot.done.synchronize()
            slot.done = None
        nbytes = numel * dtype.itemsize
        return slot.buffer[:nbytes].view(dtype), slot


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
        staging_bytes: size of each staging buffer (bytes).
    """

    device: torch.device
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    report: ReportBuilder
    staging_slots: int
    staging_bytes: int
    _ring: StagingRing | None = field(default=None, repr=False)
    _copy_stream: torch.cuda.Stream | None = field(default=None, repr=False)

    @property
    def ring(self) -> StagingRing:
        """The staging ring, created on first use."""
        if self._ring is None:
            pin = self.device.type == "cuda"
            self._ring = StagingRing(self.staging_slots, self.staging_bytes, pin=pin)
        return self._ring

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """A side stream for host-to-device copies (None on CPU)."""
        if self.device.type == "cuda" and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream


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


class DirectTier:
    """``device`` and ``cpu``: copy every param of the bucket straight into it."""

    collective = False
    """Whether ``fill`` runs a collective (every rank must fill the same bucket)."""

    def __init__(self, name: str, ctx: TierContext) -> None:
        self.name = name
        self.ctx = ctx
        self.bucket_device = ctx.device if name == "device" else torch.device("cpu")

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Nothing to prepare."""

    def fill(self, layout: GroupLayout, source: ParamSource, bucket: int, buf: torch.Tensor):
        """Copy the bucket's params into ``buf`` on the current stream."""
        pieces = list(layout.bucket_pieces_all(bucket))
        _zero_gaps(layout, bucket, buf, 0, buf.numel())
        kind = copy_kind(source.device_of(pieces) or buf.device, buf.device)
        self.ctx.report.moved(kind, source.copy_into(pieces, buf, 0))
        return Fill(buf)


class UploadTier:
    """``host`` and ``sharded``: fill a staging slot on the host, upload it asynchronously.

    ``sharded`` uploads only this rank's slice of each bucket and all-gathers the rest,
    so each rank moves 1/N of the model over PCIe; ``host`` uploads whole buckets.
    """

    def __init__(self, name: str, ctx: TierContext) -> None:
        self.name = name
        self.ctx = ctx
        self.bucket_device = ctx.device
        self.own_slice = name == "sharded" and ctx.world_size > 1
        self.collective = self.own_slice  # the all-gather of the other ranks' slices

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Nothing to prepare."""

    def _range(self, layout: GroupLayout, bucket: int) -> tuple[int, int]:
        if self.own_slice:
            return layout.buckets[bucket].rank_range(self.ctx.rank)
        return 0, layout.buckets[bucket].numel

    def fill(self, layout: GroupLayout, source: ParamSource, bucket: int, buf: torch.Tensor):
        """Stage this rank's part of the bucket, upload it, all-gather when sharded."""
        ctx = self.ctx
        lo, hi = self._range(layout, bucket)
        if self.own_slice:
            pieces = list(layout.bucket_pieces(bucket, ctx.rank))
        else:
            pieces = list(layout.bucket_pieces_all(bucket))
        target = buf[lo:hi]
        done = None
        stream = ctx.copy_stream
        if stream is None:  # host buffers: fill the bucket itself, no staging needed
            _zero_gaps(layout, bucket, target, lo, hi)
            ctx.report.moved("host_copy", source.copy_into(pieces, target, lo))
        else:
            stage, ring_slot = ctx.ring.acquire(hi - lo, buf.dtype)
            _zero_gaps(layout, bucket, stage, lo, hi)
            ctx.report.moved("host_copy", source.copy_into(pieces, stage, lo))
            stream.wait_stream(torch.cuda.current_stream(buf.device))
            with torch.cuda.stream(stream):
                target.copy_(stage, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            buf.record_stream(stream)
            ring_slot.done = done
            ctx.report.moved("h2d", stage.nbytes)
        if self.own_slice:
            if done is not None:
                torch.cuda.current_stream(buf.device).wait_event(done)
            all_gather_into(buf, target, ctx.group)
            ctx.report.moved("all_gather", buf.nbytes - target.nbytes)
        return Fill(buf, done)


class OffloadTier(UploadTier):
    """``offload``: params on a full device go to pinned host images, then upload.

    ``begin`` copies the remaining buckets' params into host images laid out exactly
    like their buckets and rebinds the params to them (their device memory is freed,
    their values kept); ``fill`` then uploads each image with one copy.
    """

    def __init__(self, name: str, ctx: TierContext) -> None:
        super().__init__("host", ctx)
        self.name = name
        self.images: dict[int, torch.Tensor] = {}

    def begin(self, layout: GroupLayout, source: ParamSource, buckets: range) -> None:
        """Move every param of ``buckets`` into a host image of its bucket."""
        pin = self.ctx.device.type == "cuda"
        dtype = getattr(torch, layout.dtype)
        for bucket in buckets:
            numel = layout.buckets[bucket].numel
            if pin:
                image = torch.empty(numel, dtype=dtype, pin_memory=True)
            else:
                image = empty_host(numel, dtype)
            pieces = list(layout.bucket_pieces_all(bucket))
            _zero_gaps(layout, bucket, image, 0, numel)
            kind = copy_kind(source.device_of(pieces) or image.device, image.device)
            self.ctx.report.moved(kind, source.copy_into(pieces, image, 0))
            if pin:
                torch.cuda.current_stream(self.ctx.device).synchronize()
            source.rebind_bucket(bucket, image)
            self.images[bucket] = image

    def fill(self, layout: GroupLayout, source: ParamSource, bucket: int, buf: torch.Tensor):
        """Upload the bucket's host image in one copy."""
        image = self.images.pop(bucket)
        done = None
        stream = self.ctx.copy_stream
        if stream is None:
            buf.copy_(image)
        else:
            stream.wait_stream(torch.cuda.current_stream(buf.device))
            with torch.cuda.stream(stream):
                buf.copy_(image, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            buf.record_stream(stream)
        self.ctx.report.moved("h2d" if buf.device.type == "cuda" else "host_copy", image.nbytes)
        return Fill(buf, done)


Tier = DirectTier | UploadTier | OffloadTier
"""Any tier object."""


def make_tier(name: str, ctx: TierContext) -> Tier:
    """The tier object for ``name``."""
    if name in ("device", "cpu"):
        return DirectTier(name, ctx)
    if name in ("host", "sharded"):
        return UploadTier(name, ctx)
    if name == "offload":
        return OffloadTier(name, ctx)
    raise ValueError(f"unknown tier {name!r}")

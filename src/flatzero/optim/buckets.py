"""Run-time bookkeeping of buckets during backward, and the staging buffer pool."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..flatten.alloc import empty
from ..flatten.buffers import FlatGroup

__all__ = ["BucketState", "StagingEntry", "StagingPool", "bucket_states", "empty_buffer"]

logger = logging.getLogger(__name__)


def empty_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D buffer (on huge pages in host memory): ``flatten.alloc.empty``,
    under the name the optimizer's tests replace."""
    return empty(numel, dtype, device)


@dataclass(eq=False)
class BucketState:
    """One bucket of one group, with the state of the backward pass in progress.

    Attributes:
        index: position of the bucket in the default launch order (all groups, in layout
            order, then buckets in layout order).
        group: index of its group in ``FlatParams.groups``.
        bucket: index of the bucket within its group layout.
        numel: padded length of the bucket, in elements.
        param_ranges: ``(start, end)`` of each param of the group's layout slots that lies
            in this bucket, keyed by slot index.
        gaps: ``(start, end)`` runs of padding inside the bucket.
        shard_view: this bucket's part of the group's fp32 gradient shard.
        buffer: where gradients of the current backward pass are written (a staging buffer,
            or ``shard_view`` itself at world size 1); ``None`` until the first arrives.
        entry: the staging entry holding ``buffer`` (None at world size 1).
        add: gradients are added into ``buffer`` instead of copied (world size 1, after the
            first backward pass of an accumulation window).
        arrived: slots whose gradient was written in the current backward pass.
        complete: every param of the bucket has its gradient in ``buffer``.
        launched: its reduction was started in the current backward pass.
        valid: ``shard_view`` holds gradients of the current accumulation window; when
            False, the next reduction overwrites it instead of adding to it.
    """

    index: int
    group: int
    bucket: int
    numel: int
    param_ranges: dict[int, tuple[int, int]]
    gaps: list[tuple[int, int]]
    shard_view: torch.Tensor
    buffer: torch.Tensor | None = None
    entry: StagingEntry | None = None
    add: bool = False
    arrived: set[int] = field(default_factory=set)
    complete: bool = False
    launched: bool = False
    valid: bool = False

    @property
    def slice_numel(self) -> int:
        """Elements of the bucket each rank owns."""
        return self.shard_view.numel()

    def reset_backward(self) -> None:
        """Forget the backward pass in progress (its buffer goes back to the pool first)."""
        self.buffer = None
        self.entry = None
        self.add = False
        self.arrived.clear()
        self.complete = False
        self.launched = False

    def missing_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``buffer`` at the params that got no gradient in this backward pass."""
        return [
            buffer[start:end]
            for slot, (start, end) in self.param_ranges.items()
            if slot not in self.arrived and end > start
        ]


def bucket_states(groups: list[FlatGroup], grads: list[torch.Tensor]) -> list[BucketState]:
    """One ``BucketState`` per bucket of every group, in the default launch order."""
    states = []
    for gi, (group, grad) in enumerate(zip(groups, grads, strict=True)):
        layout = group.layout
        for b, bucket in enumerate(layout.buckets):
            ranges = {i: (layout.slots[i].offset, layout.slots[i].end) for i in bucket.slots}
            states.append(
                BucketState(
                    index=len(states),
                    group=gi,
                    bucket=b,
                    numel=bucket.numel,
                    param_ranges=ranges,
                    gaps=layout.gaps(b),
                    shard_view=grad[bucket.shard_offset : bucket.shard_offset + bucket.slice_numel],
                )
            )
    return states


@dataclass(eq=False)
class StagingEntry:
    """A staging buffer for one bucket and the buffer its reduced slice lands in.

    Attributes:
        stage: ``max bucket numel`` elements: a bucket's full gradient before reduction.
        out: ``max slice numel`` elements: this rank's reduced slice, when it cannot land
            in the gradient shard directly.
    """

    stage: torch.Tensor
    out: torch.Tensor
    _gap_views: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def gap_views(self, bucket: BucketState) -> list[torch.Tensor]:
        """Views of ``stage`` at ``bucket``'s padding (cached per bucket)."""
        views = self._gap_views.get(bucket.index)
        if views is None:
            views = [self.stage[s:e] for s, e in bucket.gaps]
            self._gap_views[bucket.index] = views
        return views


@dataclass(eq=False)
class InFlight:
    """A started reduction: its work handle and what to do when it is done.

    Attributes:
        bucket: the bucket being reduced.
        work: the async collective's handle (None when it already ran).
        entry: the staging entry it uses (returned to the pool when done).
        out: where the reduced slice lands.
        mode: ``"done"`` (landed in the shard), ``"copy"`` or ``"add"`` (``out`` is copied
            or added into the bucket's shard view afterwards).
    """

    bucket: BucketState
    work: Any
    entry: StagingEntry | None
    out: torch.Tensor
    mode: str


class StagingPool:
    """Staging entries, a queue of reductions in flight, and the rule for reusing entries.

    Entries are created lazily up to ``size``; when none is free, the oldest reduction in
    flight is finished to free one; when nothing is in flight (every entry is held by a
    bucket still waiting for gradients), one more is allocated for this backward pass and
    released again by ``trim``.

    Args:
        size: entries kept between backward passes.
        stage_numel: elements of each entry's ``stage`` buffer.
        out_numel: elements of each entry's ``out`` buffer.
        dtype: dtype of both buffers.
        device: where they live.
        finish: called with the oldest ``InFlight`` to complete it (wait, land the slice).
    """

    def __init__(
        self,
        size: int,
        stage_numel: int,
        out_numel: int,
        dtype: torch.dtype,
        device: torch.device,
        finish: Callable[[InFlight], None],
    ) -> None:
        self.size = size
        self.stage_numel = stage_numel
        self.out_numel = out_numel
        self.dtype = dtype
        self.device = device
        self._finish = finish
        self.free: list[StagingEntry] = []
        self.created = 0
        self.peak = 0
        self.inflight: deque[InFlight] = deque()
        self.quiet = True
        """Growing is expected before the launch order is learned: log it at debug level."""
        self._warned = False

    def _new_entry(self) -> StagingEntry:
        self.created += 1
        self.peak = max(self.peak, self.created)
        return StagingEntry(
            empty_buffer(self.stage_numel, self.dtype, self.device),
            empty_buffer(self.out_numel, self.dtype, self.device),
        )

    def acquire(self) -> StagingEntry:
        """A free entry (see the class docstring for the rule)."""
        if self.free:
            return self.free.pop()
        if self.created < self.size:
            return self._new_entry()
        if self.inflight:
            self._finish(self.inflight.popleft())
            if self.free:
                return self.free.pop()
        if self.quiet:
            logger.debug("staging pool grows to %d entries", self.created + 1)
        elif not self._warned:
            self._warned = True
            logger.warning(
                "flatzero stage 2: all %d staging buffers are held by buckets still waiting "
                "for gradients (a param got no gradient in this backward pass, or gradients "
                "arrive in another order than the layout's); allocating more for this pass. "
                "Raise ZeroConfig.staging_buffers to keep them",
                self.created,
            )
        return self._new_entry()

    def release(self, entry: StagingEntry) -> None:
        """Give ``entry`` back."""
        self.free.append(entry)

    def finish_all(self) -> None:
        """Complete every reduction in flight, oldest first."""
        while self.inflight:
            self._finish(self.inflight.popleft())

    def trim(self) -> None:
        """Free the entries allocated beyond ``size`` (all must be free)."""
        while self.created > self.size and self.free:
            self.free.pop()
            self.created -= 1

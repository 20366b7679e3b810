"""The geometry of gradient reduction (buckets, chunks) and the bounded staging pool.

A bucket's gradient is reduced in *chunks*: contiguous runs of at most ``chunk_numel``
elements that lie inside one rank's slice of the bucket, each summed onto that rank
(``reduce`` to its owner). A chunk is complete as soon as the params that overlap it have
their gradients, so chunks can be staged and reduced one by one during backward, and the
staging memory is a fixed number of chunk-sized slots whatever the bucket size (a param
larger than a chunk is reduced in several). ``staging_geometry`` turns
``ZeroConfig.reduce_staging_bytes`` into the chunk size and the number of slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..flatten.alloc import empty
from ..flatten.buffers import FlatGroup
from ..layout import ParamSlot

__all__ = [
    "BackwardPass",
    "BucketState",
    "InFlight",
    "ReduceChunk",
    "StagingPool",
    "bucket_chunks",
    "bucket_states",
    "empty_buffer",
    "staging_geometry",
]

CHUNK_ALIGNMENT = 64
"""Chunk sizes are rounded down to a multiple of this many elements (vectorized copies)."""


def empty_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D buffer (on huge pages in host memory): ``flatten.alloc.empty``,
    under the name the optimizer's tests replace."""
    return empty(numel, dtype, device)


@dataclass(frozen=True)
class BucketState:
    """One bucket of one group, as the reducers see it.

    Attributes:
        index: position of the bucket in the layout order (all groups in layout order,
            then buckets in layout order).
        group: index of its group in ``FlatParams.groups``.
        bucket: index of the bucket within its group layout.
        numel: padded length of the bucket, in elements.
        shard_view: this bucket's part of the group's fp32 gradient shard.
    """

    index: int
    group: int
    bucket: int
    numel: int
    shard_view: torch.Tensor

    @property
    def slice_numel(self) -> int:
        """Elements of the bucket each rank owns."""
        return self.shard_view.numel()


def bucket_states(groups: list[FlatGroup], grads: list[torch.Tensor]) -> list[BucketState]:
    """One ``BucketState`` per bucket of every group, in layout order."""
    states = []
    for gi, (group, grad) in enumerate(zip(groups, grads, strict=True)):
        for b, bucket in enumerate(group.layout.buckets):
            start = bucket.shard_offset
            view = grad[start : start + bucket.slice_numel]
            states.append(BucketState(len(states), gi, b, bucket.numel, view))
    return states


@dataclass(frozen=True)
class ReduceChunk:
    """A run of one bucket inside one rank's slice: the unit of a reduction.

    Attributes:
        bucket: ``BucketState.index`` of its bucket.
        owner: the rank whose slice holds it (the rank its sum goes to).
        start: first element in the bucket.
        end: one past the last element in the bucket.
        shard_start: where it starts in the bucket's ``shard_view`` (on ``owner``).
        params: ``(param id, first element in the param, offset in the chunk, numel)`` of
            every param run inside the chunk, in offset order.
        gaps: ``(start, end)`` runs of padding, relative to ``start``.
    """

    bucket: int
    owner: int
    start: int
    end: int
    shard_start: int
    params: tuple[tuple[int, int, int, int], ...]
    gaps: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        """Elements in the chunk."""
        return self.end - self.start


def staging_geometry(
    max_slice_numel: int, budget_bytes: int, buffers: int, itemsize: int
) -> tuple[int, int]:
    """``(chunk_numel, slots)`` for a staging budget.

    A chunk is at most a rank's slice of the largest bucket and at most
    ``budget_bytes / buffers`` (so ``buffers`` chunks can be in flight at once), rounded
    down to a multiple of ``CHUNK_ALIGNMENT`` elements; the pool has as many chunk-sized
    slots as fit in the budget. ``slots * chunk_numel * itemsize <= budget_bytes``.

    Args:
        max_slice_numel: elements of the largest bucket that one rank owns.
        budget_bytes: ``ZeroConfig.reduce_staging_bytes``.
        buffers: ``ZeroConfig.staging_buffers``.
        itemsize: bytes per element of ``ZeroConfig.reduce_dtype``.
    """
    per_buffer = budget_bytes // (buffers * itemsize)
    chunk = min(max_slice_numel, per_buffer // CHUNK_ALIGNMENT * CHUNK_ALIGNMENT)
    return chunk, budget_bytes // (chunk * itemsize)


def _gaps(runs: list[tuple[int, int, int, int]], numel: int) -> tuple[tuple[int, int], ...]:
    """The padding of a chunk of ``numel`` elements around its param ``runs``."""
    out, cursor = [], 0
    for _, _, offset, length in runs:
        if offset > cursor:
            out.append((cursor, offset))
        cursor = offset + length
    if cursor < numel:
        out.append((cursor, numel))
    return tuple(out)


def bucket_chunks(
    state: BucketState,
    slots: Sequence[ParamSlot],
    members: Sequence[int],
    first_param: int,
    world_size: int,
    chunk_numel: int,
) -> list[ReduceChunk]:
    """The chunks of a bucket, in layout order (params are laid out in reverse
    registration order: the order backward usually produces their gradients in).

    Args:
        state: the bucket.
        slots: its group's ``GroupLayout.slots``.
        members: indices into ``slots`` of the bucket's params, in offset order.
        first_param: the param id of ``slots[0]`` (ids run over all groups).
        world_size: ranks the bucket is sliced for.
        chunk_numel: the most elements of a chunk.
    """
    row = state.numel // world_size
    per_row = -(-row // chunk_numel)
    bounds = [
        (r * row + k * chunk_numel, min(r * row + (k + 1) * chunk_numel, (r + 1) * row))
        for r in range(world_size)
        for k in range(per_row)
    ]
    runs: list[list[tuple[int, int, int, int]]] = [[] for _ in bounds]
    for index in members:
        slot = slots[index]
        pos = slot.offset
        while pos < slot.end:
            j = (pos // row) * per_row + (pos % row) // chunk_numel
            lo, hi = bounds[j]
            end = min(slot.end, hi)
            runs[j].append((first_param + index, pos - slot.offset, pos - lo, end - pos))
            pos = end
    return [
        ReduceChunk(
            bucket=state.index,
            owner=j // per_row,
            start=lo,
            end=hi,
            shard_start=lo - (j // per_row) * row,
            params=tuple(found),
            gaps=_gaps(found, hi - lo),
        )
        for j, ((lo, hi), found) in enumerate(zip(bounds, runs, strict=True))
    ]


@dataclass(eq=False)
class BackwardPass:
    """What one stage 2 backward pass has seen so far (a new one for every pass).

    Attributes:
        pending: per chunk in launch order, the params overlapping it whose gradient is
            still expected.
        unstaged: per param id, its chunks not staged yet.
        held: gradients that arrived (flat, autograd's own tensors), by param id, until
            all their chunks are staged.
        arrived: params whose gradient arrived.
        unused: params the pass will not reach: their gradient counts as zero.
        tentative: params the pass's graph does not reach at its start, in a pass that may
            still see a backward inside backward (the first): counted as zero only once a
            whole bucket's gradients wait behind them (``Stage2Reducer._pump``).
        late: in the first pass, gradients that arrived after some of their param's
            chunks were reduced without them (a param counted as zero, or a gradient
            delivered once more): per param, each such flat gradient and how many of the
            param's chunks (the first, in launch order) went without it
            (``Stage2Reducer._reduce_late``).
        deliveries: how often the gradient of each param delivered more than once, or
            expected more than once (``Stage2Reducer.repeats``), arrived in this pass.
        missing: per bucket, its params whose gradient has not arrived.
        complete: buckets whose every gradient arrived, in arrival order.
        cursor: position of the next chunk to launch.
        task: the autograd graph task the pass started in.
        nested: a gradient arrived from another graph task (a backward inside backward).
        held_bytes: bytes of ``held``.
    """

    pending: list[int]
    unstaged: list[int]
    held: dict[int, torch.Tensor] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    unused: set[int] = field(default_factory=set)
    tentative: set[int] = field(default_factory=set)
    late: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    deliveries: dict[int, int] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    complete: list[int] = field(default_factory=list)
    cursor: int = 0
    task: int = -1
    nested: bool = False
    held_bytes: int = 0

    def hold(self, param: int, grad: torch.Tensor) -> None:
        """Keep ``param``'s flat gradient until its chunks are staged."""
        self.held[param] = grad
        self.held_bytes += grad.numel() * grad.element_size()

    def keep_late(self, param: int, grad: torch.Tensor, reduced: int, held: bool) -> None:
        """Keep a late gradient of ``param`` (see ``late``); ``held``: it is also in
        ``held`` (counted there)."""
        self.late.setdefault(param, []).append((grad, reduced))
        if not held:
            self.held_bytes += grad.numel() * grad.element_size()

    def add_held(self, param: int, grad: torch.Tensor) -> None:
        """Add another delivery of ``param``'s flat gradient to the one held (out of place:
        the held one may be autograd's own tensor)."""
        self.held[param] = self.held[param] + grad

    def release(self, param: int) -> None:
        """Drop ``param``'s gradient (all its chunks are staged), if it was held."""
        grad = self.held.pop(param, None)
        if grad is not None:
            self.held_bytes -= grad.numel() * grad.element_size()


class InFlight(NamedTuple):
    """A started reduction: its work handle and what to do when it is done (state that
    crosses streams: the collective's stream writes ``slot``/``src``, the current stream
    reads them once ``work`` is waited for).

    Attributes:
        work: the async collective's handle (None when it already ran).
        slot: the staging slot it uses (returned to the pool when done), if any.
        dst: where the result lands on this rank (None: it lands nowhere here, or the
            collective wrote it in place).
        src: the result to land in ``dst``.
        add: add ``src`` into ``dst`` instead of copying it.
        bucket: the bucket whose gradient shard ``dst`` is part of (-1: none).
    """

    work: Any
    slot: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    src: torch.Tensor | None = None
    add: bool = False
    bucket: int = -1


class StagingPool:
    """A fixed number of chunk-sized staging slots and the reductions in flight.

    Slots are allocated when first needed, up to ``slots``, and never more: when every
    slot is in use, the oldest reduction in flight is finished to free one. Only
    reductions in flight hold slots, so there always is one to finish.

    Args:
        slots: the most slots.
        slot_numel: elements of each slot.
        dtype: their dtype.
        device: where they live.
        finish: called with the oldest ``InFlight`` to complete it (wait, land, release).
    """

    def __init__(
        self,
        slots: int,
        slot_numel: int,
        dtype: torch.dtype,
        device: torch.device,
        finish: Callable[[InFlight], None],
    ) -> None:
        self.slots = slots
        self.slot_numel = slot_numel
        self.dtype = dtype
        self.device = device
        self._finish = finish
        self.free: list[torch.Tensor] = []
        self.allocated = 0
        self.inflight: deque[InFlight] = deque()

    @property
    def nbytes(self) -> int:
        """Bytes of the slots allocated (they are kept until the optimizer is freed)."""
        return self.allocated * self.slot_numel * self.dtype.itemsize

    def acquire(self) -> torch.Tensor:
        """A free slot (see the class docstring for the rule)."""
        if not self.free and self.allocated < self.slots:
            self.allocated += 1
            return empty_buffer(self.slot_numel, self.dtype, self.device)
        while not self.free:  # the oldest reductions first (some may hold no slot)
            self._finish(self.inflight.popleft())
        return self.free.pop()

    def release(self, slot: torch.Tensor) -> None:
        """Give ``slot`` back."""
        self.free.append(slot)

    def finish_all(self) -> None:
        """Complete every reduction in flight, oldest first."""
        while self.inflight:
            self._finish(self.inflight.popleft())

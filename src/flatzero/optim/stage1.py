"""The ZeRO stage 1 reducer: full flat gradient buffers, reduce-scattered at the step."""

from __future__ import annotations

import enum

import torch
from torch import nn

from ..comm import on_host_gloo, reduce_scatter_into
from ..flatten.alloc import allocate_agreed
from ..flatten.buffers import FlatParams
from ..own_groups import control_group
from ..roll_call import raise_naming_ranks
from .buckets import BucketState, InFlight, empty_buffer
from .config import ZeroConfig
from .reducers import GradReducer

__all__ = ["BufferState", "Stage1Reducer"]


class BufferState(enum.Enum):
    """Where ``Stage1Reducer``'s flat gradient buffers stand.

    ``CLEAN`` -(a gradient arrives)-> ``DIRTY`` -(``finish``: reduce-scattered)->
    ``REDUCED`` -(a gradient arrives)-> ``DIRTY``; a window reset goes back to ``CLEAN``
    (zeroing the buffers unless they are ``CLEAN`` already).
    """

    CLEAN = "clean"
    """No gradient since the window began: the buffers are zero."""
    DIRTY = "dirty"
    """Gradients arrived since the last reduce-scatter."""
    REDUCED = "reduced"
    """Every gradient that arrived is reduce-scattered into the shards."""


class Stage1Reducer(GradReducer):
    """ZeRO stage 1: one flat gradient buffer per group, in ``config.accumulation_dtype``.

    When that is the params' dtype, their ``.grad`` are views of the buffer and autograd
    accumulates into them in place over the window's backward passes; the hooks only note
    that a backward pass happened and re-attach the view when autograd or the user
    replaced ``.grad`` by another tensor (its values are copied in). Otherwise (fp32
    accumulation of bf16/fp16 params) the hooks add each gradient into the buffer as it
    arrives and free ``.grad``. ``finish()`` reduce-scatters each bucket of the flat buffer
    into the fp32 gradient shard (fp32 straight from the buffer, except on gloo in host
    memory; the others chunk by chunk through the staging slots, summed onto each owner).

    At world size 1 a flat buffer in fp32 *is* its group's gradient shard (same layout),
    so there is nothing to copy.
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        self._aliased: set[int] = set()
        self.flat_grads: list[torch.Tensor] = []
        self.bucket_grads: dict[int, torch.Tensor] = {}
        self.views: list[list[torch.Tensor]] = []
        dtypes = [config.accumulation_dtype(g.dtype) for g in flat.groups]
        self._moved = {gi for gi, g in enumerate(flat.groups) if dtypes[gi] != g.dtype}
        """Groups whose gradients the hooks add into the buffer (no ``.grad`` views)."""
        own = [
            gi
            for gi in range(len(flat.groups))
            if not (self.world_size == 1 and dtypes[gi] == torch.float32)
        ]
        # Full-size gradient buffers: one rank out of memory must not leave the others
        # waiting in the first reduce-scatter.
        buffers = dict(
            zip(
                own,
                allocate_agreed(
                    [
                        lambda g=flat.groups[gi], dtype=dtypes[gi]: empty_buffer(
                            g.layout.numel, dtype, g.device
                        )
                        for gi in own
                    ],
                    flat.groups[0].device,
                    control_group(flat.deciders),
                    what="the stage 1 gradient buffers",
                    nbytes=sum(flat.groups[gi].layout.numel * dtypes[gi].itemsize for gi in own),
                    after="the params keep their values",
                ),
                strict=True,
            )
        )
        for gi, group in enumerate(flat.groups):
            layout = group.layout
            if gi not in buffers:
                # The shard has the buckets' layout: use it in place (autograd adds into it).
                buffer = grads[gi].zero_()
                self._aliased.add(gi)
            else:
                buffer = buffers[gi].zero_()
            starts, cursor = [], 0
            for bucket in layout.buckets:
                starts.append(cursor)
                cursor += bucket.numel
            self.flat_grads.append(buffer)
            self.views.append(
                [
                    buffer[starts[s.bucket] + s.offset : starts[s.bucket] + s.end].view(
                        s.spec.shape
                    )
                    for s in layout.slots
                ]
            )
            for state in self.buckets:
                if state.group == gi:
                    start = starts[state.bucket]
                    self.bucket_grads[state.index] = buffer[start : start + state.numel]
        self._attach()
        self._detached = False
        self.buffer_state = BufferState.CLEAN
        self._scatter_in_place = not on_host_gloo(flat.groups[0].device, self.pg)
        """fp32 buckets reduce-scatter straight from the buffer, except on gloo in host
        memory, whose reduce-scatter copies the whole bucket into a temporary first: there
        they go through the staging slots like the others."""
        self._register(self._hook_args)

    def _attach(self) -> None:
        for gi, (group, views) in enumerate(zip(self.flat.groups, self.views, strict=True)):
            if gi in self._moved:
                continue
            for param, view in zip(group.params, views, strict=True):
                grad = param.grad
                if grad is None or grad.data_ptr() != view.data_ptr():
                    param.grad = view

    def _hook_args(self, gi: int, slot_index: int, state: BucketState) -> tuple:
        return (self.views[gi][slot_index], gi in self._moved)

    def _hook(self, view: torch.Tensor, moved: bool, param: nn.Parameter) -> None:
        grad = param.grad
        if moved:
            if grad is not None:
                view.add_(grad)  # summed in the buffer's (higher) precision
                param.grad = None
        elif grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view
            self._detached = True
        self.buffer_state = BufferState.DIRTY

    @property
    def backward_seen(self) -> bool:
        return self.buffer_state is not BufferState.CLEAN

    def finish(self) -> None:
        if self.buffer_state is not BufferState.DIRTY:
            return
        self.buffer_state = BufferState.REDUCED
        self.generation += 1
        if self.world_size == 1:
            copies = [b for b in self.buckets if b.group not in self._aliased]
            if copies:
                torch._foreach_copy_(
                    [b.shard_view for b in copies], [self.bucket_grads[b.index] for b in copies]
                )
            return
        for index in self.order:
            src = self.bucket_grads[index]
            if (
                self._scatter_in_place
                and src.dtype == torch.float32
                and self.pool.dtype == torch.float32
            ):
                shard = self.buckets[index].shard_view
                if self.check is not None:
                    for chunk in self._chunks_by_bucket[index]:
                        self.check.local(chunk, src[chunk.start : chunk.end], add=False)
                try:
                    work = reduce_scatter_into(shard, src, self.pg, async_op=True)
                except RuntimeError as error:  # [Note: nothing on the happy path]
                    raise_naming_ranks(error, self.pg, self._doing())
                self.pool.inflight.append(InFlight(work))
                continue
            for chunk in self._chunks_by_bucket[index]:
                slot = self.pool.acquire()
                staged = slot[: chunk.numel]
                staged.copy_(src[chunk.start : chunk.end])
                self._reduce_chunk(chunk, slot, staged, add=False)
        self.pool.finish_all()
        self._check_landed()

    def reset_window(self) -> None:
        self.pool.finish_all()
        if self.buffer_state is not BufferState.CLEAN:
            torch._foreach_zero_(self.flat_grads)
        self.buffer_state = BufferState.CLEAN
        self._check_reset()
        if self._detached:  # something replaced .grad: put every view back
            self._attach()
            self._detached = False
        self.generation += 1

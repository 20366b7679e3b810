"""Gradient reduction into this rank's fp32 gradient shards: ZeRO stage 1 and stage 2.

Both reducers own one fp32 gradient shard per group (``grads``), in the layout of the
group's master shard. After ``finish()``, ``grads[g]`` holds the *sum* over ranks and over
the backward passes of the accumulation window of the (loss-scaled) gradients; the
optimizer divides by the world size and the loss scale at the step.

Collectives are launched in one order agreed by all ranks (``order``), never in the
order gradients happen to arrive on a rank: with params that get no gradient on some
ranks (unused experts, conditional branches) arrival orders differ between ranks, and
collectives issued in different orders would mismatch or hang.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from ..comm import rank_of, reduce_scatter_into, world_size_of
from ..control import control_group
from ..devices import collective_device
from ..flatten.alloc import allocate_agreed
from ..flatten.buffers import FlatParams
from .buckets import BucketState, InFlight, StagingPool, bucket_states, empty_buffer
from .config import ZeroConfig

__all__ = [
    "GradReducer",
    "Stage1Reducer",
    "Stage2Reducer",
    "check_unclaimed",
    "make_reducer",
]

logger = logging.getLogger(__name__)

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""``id(param)`` -> (param, reducer whose hooks are on it), both weakly: two optimizers
hooking one param would steal each other's gradients."""


def check_unclaimed(params: Iterable[nn.Parameter]) -> None:
    """Raise ``ValueError`` if a live, open ``ZeroOptimizer`` already manages a param."""
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]
    for param in params:
        entry = _OWNERS.get(id(param))
        if entry is not None and entry[0]() is param:
            raise ValueError(
                "a param is already managed by another ZeroOptimizer, whose gradient hooks "
                "would take its gradients; call close() on the old optimizer (or drop every "
                "reference to it) before building a new one over the same params"
            )


def _weak_hook(owner: weakref.ref, method: str, args: tuple) -> Callable[[nn.Parameter], None]:
    """A hook calling ``owner().method(*args, param)`` that does not keep ``owner`` alive."""

    def hook(param: nn.Parameter) -> None:
        target = owner()
        if target is not None:
            with torch.no_grad():
                getattr(target, method)(*args, param)

    return hook


def _remove_handles(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class GradReducer:
    """What the optimizer needs from a reducer; see ``Stage1Reducer`` and ``Stage2Reducer``.

    Attributes:
        grads: one fp32 gradient shard per group (``layout.shard_numel`` elements).
        buckets: every bucket, in the default launch order.
        order: bucket indices in the order reductions are launched (the same on all ranks).
        backward_seen: a backward pass reached the params since the window began.
        generation: bumped by every backward pass and window reset (caches key on it).
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        self.flat = flat
        self.grads = grads
        self.config = config
        self.pg = flat.process_group
        self.world_size = world_size_of(self.pg)
        self.rank = rank_of(self.pg)
        self.buckets = bucket_states(flat.groups, grads)
        self.order = [b.index for b in self.buckets]
        self.backward_seen = False
        self.generation = 0
        self._handles: list[RemovableHandle] = []
        device = flat.groups[0].device
        self.pool = StagingPool(
            config.staging_buffers,
            max(b.numel for b in self.buckets),
            max(b.slice_numel for b in self.buckets),
            config.reduce_dtype,
            device,
            self._finish,
        )

    def _register(self, args_for: Callable[[int, int, BucketState], tuple]) -> None:
        """Hook ``self._hook(*args_for(group, slot, bucket_state), param)`` on every
        flattened param. The hooks hold this reducer weakly and are removed when it is
        closed or collected; the params are claimed (see ``check_unclaimed``)."""
        by_key = {(b.group, b.bucket): b for b in self.buckets}
        owner = weakref.ref(self)
        for gi, group in enumerate(self.flat.groups):
            for slot_index, (slot, param) in enumerate(
                zip(group.layout.slots, group.params, strict=True)
            ):
                args = args_for(gi, slot_index, by_key[(gi, slot.bucket)])
                hook = _weak_hook(owner, "_hook", args)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
                _OWNERS[id(param)] = (weakref.ref(param), owner)
        weakref.finalize(self, _remove_handles, self._handles)

    def _finish(self, item: InFlight) -> None:
        """Complete a reduction: wait for it and land the slice in the gradient shard."""
        if item.work is not None:
            item.work.wait()
        if item.mode == "copy":
            item.bucket.shard_view.copy_(item.out)
        elif item.mode == "add":
            item.bucket.shard_view.add_(item.out)
        if item.entry is not None:
            self.pool.release(item.entry)

    def finish(self) -> None:
        """Make ``grads`` hold the reduced gradients of the window so far."""
        raise NotImplementedError

    def reset_window(self) -> None:
        """Start a new accumulation window: gradients so far count as zero."""
        raise NotImplementedError

    def agree_order(self) -> None:
        """Called at every step before anything else; may change ``order`` (collectively)."""

    def set_order(self, order: list[int] | None) -> None:
        """Adopt a launch order agreed earlier (from a state dict); ignored unless it is a
        permutation of the buckets. Every rank must pass the same order."""
        if order is not None and sorted(order) == list(range(len(self.buckets))):
            self.order = [int(i) for i in order]

    def close(self) -> None:
        """Remove the hooks from the params and release them."""
        _remove_handles(self._handles)
        for group in self.flat.groups:
            for param in group.params:
                entry = _OWNERS.get(id(param))
                if entry is not None and entry[1]() is self:
                    del _OWNERS[id(param)]

    @property
    def staging_peak(self) -> int:
        """Most staging entries alive at once so far."""
        return self.pool.peak


class Stage2Reducer(GradReducer):
    """ZeRO stage 2: per-param hooks stage gradients bucket by bucket and free ``.grad``.

    Each backward pass reduces every bucket exactly once: a bucket is reduce-scattered as
    soon as all its params have their gradient and every bucket before it in ``order`` was
    launched; the end-of-backward callback zero-fills params that got no gradient and
    launches the rest. Under reentrant activation checkpointing (``use_reentrant=True``)
    each checkpointed segment runs its own backward pass inside the outer one; the
    callback runs at the end of the outer one only (a param used in two segments gets two
    gradients in one backward pass: an error, as in DeepSpeed's ZeRO-2).

    At world size 1 there is nothing to reduce: gradients are written straight into the
    fp32 gradient shard (copied in the window's first backward pass, added afterwards).
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        self.direct = self.world_size == 1
        self.next_pos = 0
        self._callback_queued = False
        self._recording = config.learn_bucket_order and not self.direct
        self._order_agreed = not self._recording
        self.pool.quiet = self._recording
        self.recorded: list[int] = []
        self._register(self._hook_args)

    def _hook_args(self, gi: int, slot_index: int, state: BucketState) -> tuple:
        slot = self.flat.groups[gi].layout.slots[slot_index]
        return (state, slot_index, slot.offset, slot.end, slot.spec.shape)

    def _hook(
        self,
        bucket: BucketState,
        slot: int,
        start: int,
        end: int,
        shape: tuple[int, ...],
        param: nn.Parameter,
    ) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if slot in bucket.arrived or bucket.launched:
            raise RuntimeError(
                "a gradient arrived twice for one param in one backward pass: an earlier "
                "backward pass did not finish (it raised?), or the param is used in two "
                "segments of reentrant activation checkpointing (use_reentrant=True: each "
                "segment delivers its own gradient; use use_reentrant=False or ZeRO stage 1). "
                "Call ZeroOptimizer.zero_grad() before the next backward pass"
            )
        buffer = bucket.buffer if bucket.buffer is not None else self._acquire(bucket)
        dst = buffer[start:end].view(shape)
        if bucket.add:
            dst.add_(grad)
        else:
            dst.copy_(grad)
        param.grad = None
        bucket.arrived.add(slot)
        if len(bucket.arrived) == len(bucket.param_ranges):
            self._complete(bucket)

    def _acquire(self, bucket: BucketState) -> torch.Tensor:
        if self.direct:
            bucket.buffer = bucket.shard_view
            bucket.add = bucket.valid
        else:
            entry = self.pool.acquire()
            bucket.entry = entry
            bucket.buffer = entry.stage[: bucket.numel]
        return bucket.buffer

    def _complete(self, bucket: BucketState) -> None:
        bucket.complete = True
        if self._recording:
            self.recorded.append(bucket.index)
        self._launch_ready()

    def _launch_ready(self) -> None:
        order, buckets = self.order, self.buckets
        while self.next_pos < len(order) and buckets[order[self.next_pos]].complete:
            self._launch(buckets[order[self.next_pos]])
            self.next_pos += 1

    def _launch(self, bucket: BucketState) -> None:
        bucket.launched = True
        if self.direct:
            bucket.valid = True
            return
        entry = bucket.entry
        assert entry is not None and bucket.buffer is not None
        gaps = entry.gap_views(bucket)
        if gaps:
            torch._foreach_zero_(gaps)
        if not bucket.valid and self.pool.dtype == torch.float32:
            out, mode = bucket.shard_view, "done"
        else:
            out, mode = entry.out[: bucket.slice_numel], ("add" if bucket.valid else "copy")
        work = reduce_scatter_into(out, bucket.buffer, self.pg, async_op=True)
        bucket.valid = True
        self.pool.inflight.append(InFlight(bucket, work, entry, out, mode))

    def _end_of_backward(self) -> None:
        """Flush: zero-fill what got no gradient, launch every bucket not yet launched.

        At the end of a backward pass run inside another one's node (reentrant activation
        checkpointing), defer to the end of the outer pass: flushing here would reduce every
        bucket once per checkpointed segment.
        """
        node = torch._C._current_autograd_node()
        if node is not None:
            node.register_hook(self._queue_on_outer_backward)
            return
        self._callback_queued = False
        for pos in range(self.next_pos, len(self.order)):
            bucket = self.buckets[self.order[pos]]
            if not bucket.complete:
                if bucket.buffer is None:
                    self._acquire(bucket)
                    if not bucket.add:
                        bucket.buffer.zero_()
                elif not bucket.add:
                    missing = bucket.missing_views(bucket.buffer)
                    if missing:
                        torch._foreach_zero_(missing)
                self._complete(bucket)
        assert self.next_pos == len(self.order)
        for bucket in self.buckets:
            bucket.reset_backward()
        self.next_pos = 0
        self._recording = False
        self.backward_seen = True
        self.generation += 1

    def _queue_on_outer_backward(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of the node whose inner backward pass just ended: queue the flush on
        the backward pass running that node."""
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def set_order(self, order: list[int] | None) -> None:
        super().set_order(order)
        if order is not None and self.order == list(order):
            self._order_agreed = True
            self._recording = False
            self.pool.quiet = False

    def agree_order(self) -> None:
        """At the first step, adopt rank 0's completion order of the first backward pass."""
        if self._order_agreed:
            return
        self._order_agreed = True
        self._recording = False
        self.pool.quiet = False
        n = len(self.buckets)
        device = collective_device(self.pg, self.flat.groups[0].device)
        if self.rank == 0:
            # Rank 0's first complete backward pass; the current order if none was seen.
            valid = sorted(self.recorded) == list(range(n))
            order = torch.tensor(self.recorded if valid else self.order, dtype=torch.int64)
            order = order.to(device)
        else:
            order = torch.empty(n, dtype=torch.int64, device=device)
        src = 0 if self.pg is None else dist.get_global_rank(self.pg, 0)
        dist.broadcast(order, src=src, group=self.pg)
        self.order = order.tolist()
        logger.debug("stage 2 bucket launch order: %s", self.order)

    def finish(self) -> None:
        if any(b.buffer is not None for b in self.buckets):
            raise RuntimeError(
                "a backward pass is still in progress or did not finish (it raised?); "
                "step() needs completed backward passes. After a failed backward pass call "
                "ZeroOptimizer.zero_grad() and run it again"
            )
        self.pool.finish_all()
        self.pool.trim()

    def reset_window(self) -> None:
        self.pool.finish_all()
        for bucket in self.buckets:
            if bucket.entry is not None:
                self.pool.release(bucket.entry)
            bucket.reset_backward()
            bucket.valid = False
        self.pool.trim()
        if self._recording:
            self.recorded.clear()  # a failed first pass: record the next one
        self.next_pos = 0
        self._callback_queued = False
        self.backward_seen = False
        self.generation += 1


class Stage1Reducer(GradReducer):
    """ZeRO stage 1: one flat gradient buffer per group, in ``config.accumulation_dtype``.

    When that is the params' dtype, their ``.grad`` are views of the buffer and autograd
    accumulates into them in place over the window's backward passes; the hooks only note
    that a backward pass happened and re-attach the view when autograd or the user
    replaced ``.grad`` by another tensor (its values are copied in). Otherwise (fp32
    accumulation of bf16/fp16 params) the hooks add each gradient into the buffer as it
    arrives and free ``.grad``. ``finish()`` reduce-scatters each bucket of the flat buffer
    into the fp32 gradient shard.

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
        self._dirty = False
        self._clean = True
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
        self.backward_seen = True
        self._dirty = True
        self._clean = False

    def finish(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self.generation += 1
        if self.world_size == 1:
            copies = [b for b in self.buckets if b.group not in self._aliased]
            if copies:
                torch._foreach_copy_(
                    [b.shard_view for b in copies], [self.bucket_grads[b.index] for b in copies]
                )
            return
        for index in self.order:
            bucket = self.buckets[index]
            src = self.bucket_grads[index]
            entry = None
            if src.dtype != self.pool.dtype:
                entry = self.pool.acquire()
                entry.stage[: bucket.numel].copy_(src)
                src = entry.stage[: bucket.numel]
            if self.pool.dtype == torch.float32:
                out, mode = bucket.shard_view, "done"
            else:
                if entry is None:
                    entry = self.pool.acquire()
                out, mode = entry.out[: bucket.slice_numel], "copy"
            work = reduce_scatter_into(out, src, self.pg, async_op=True)
            self.pool.inflight.append(InFlight(bucket, work, entry, out, mode))
        self.pool.finish_all()

    def reset_window(self) -> None:
        self.pool.finish_all()
        if not self._clean:
            torch._foreach_zero_(self.flat_grads)
            self._clean = True
        if self._detached:  # something replaced .grad: put every view back
            self._attach()
            self._detached = False
        self._dirty = False
        self.backward_seen = False
        self.generation += 1


def make_reducer(flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> GradReducer:
    """The reducer of ``config.stage``."""
    cls = Stage1Reducer if config.stage == 1 else Stage2Reducer
    return cls(flat, grads, config)

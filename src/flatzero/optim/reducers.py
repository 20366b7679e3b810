"""Gradient reduction into this rank's fp32 gradient shards: ZeRO stage 1 and stage 2.

Every reducer owns one fp32 gradient shard per group (``grads``), in the layout of the
group's master shard. After ``finish()``, ``grads[g]`` holds the *sum* over ranks and over
the backward passes of the accumulation window of the (loss-scaled) gradients; the
optimizer divides by the world size and the loss scale at the step.

Gradients are reduced in chunks (``buckets.ReduceChunk``: a run of one rank's slice of a
bucket, summed onto that rank) staged in a fixed pool of slots, so staging memory is
bounded by ``ZeroConfig.reduce_staging_bytes`` whatever the bucket sizes. Collectives are
launched in one order agreed by all ranks (``order``, then each bucket's chunks in
layout order), never in the order gradients happen to arrive on a rank: with params that get no
gradient on some ranks (unused experts, conditional branches) arrival orders differ
between ranks, and collectives issued in different orders would mismatch or hang.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from ..comm import on_host_gloo, rank_of, reduce_scatter_into, world_size_of
from ..control import control_group
from ..devices import collective_device
from ..flatten.alloc import allocate_agreed
from ..flatten.buffers import FlatParams
from .buckets import (
    BackwardPass,
    BucketState,
    InFlight,
    ReduceChunk,
    StagingPool,
    bucket_chunks,
    bucket_states,
    empty_buffer,
    staging_geometry,
)
from .config import ZeroConfig

__all__ = [
    "GradReducer",
    "LocalStage2Reducer",
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


_TWICE = (
    "a gradient arrived twice for one param in one backward pass: an earlier backward pass "
    "did not finish (it raised?), or the param is used in two segments of reentrant "
    "activation checkpointing (use_reentrant=True: each segment delivers its own gradient; "
    "use use_reentrant=False or ZeRO stage 1). Call ZeroOptimizer.zero_grad() before the "
    "next backward pass"
)
_UNFINISHED = (
    "a backward pass is still in progress or did not finish (it raised?); step() needs "
    "completed backward passes. After a failed backward pass call ZeroOptimizer.zero_grad() "
    "and run it again"
)
_LATE = (
    "flatzero stage 2: a gradient arrived for a param that this backward pass had counted as "
    "unused and already reduced as zero. A backward pass ran inside this one (reentrant "
    "activation checkpointing, use_reentrant=True) that the first backward pass did not "
    "show. Use torch.utils.checkpoint with use_reentrant=False, or turn reentrant "
    "checkpointing on before the first backward pass"
)


class GradReducer:
    """What the optimizer needs from a reducer; see ``Stage1Reducer`` and ``Stage2Reducer``.

    Attributes:
        grads: one fp32 gradient shard per group (``layout.shard_numel`` elements).
        buckets: every bucket, in layout order.
        order: bucket indices in the order reductions are launched (the same on all
            ranks); by default the layout order, which puts each group's params in reverse
            registration order, the order backward usually produces their gradients in.
        chunk_numel: the most elements of a reduction chunk (``staging_geometry``).
        pool: the staging slots and the reductions in flight.
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
        self._first_param = [0]
        for group in flat.groups:
            self._first_param.append(self._first_param[-1] + len(group.params))
        self.chunk_numel, slots = staging_geometry(
            max(b.slice_numel for b in self.buckets),
            config.reduce_staging_bytes,
            config.staging_buffers,
            config.reduce_dtype.itemsize,
        )
        self.pool = StagingPool(
            slots, self.chunk_numel, config.reduce_dtype, flat.groups[0].device, self._finish
        )
        self._chunks_by_bucket = (
            [self._bucket_chunks(b) for b in self.buckets] if self.world_size > 1 else []
        )
        self.on_chunk_landed: Callable[[int, bool], None] | None = None
        """Called as ``(bucket, complete)`` after a chunk of a bucket's gradient shard
        landed, ``complete`` when it was the last of the bucket's chunks in a backward pass
        (stage 2 over several ranks: optimizer offload starts that bucket's copy to the host
        then). Other reducers never call it."""

    def _bucket_chunks(self, bucket: BucketState) -> list[ReduceChunk]:
        """``bucket``'s reduction chunks, in layout order."""
        layout = self.flat.groups[bucket.group].layout
        return bucket_chunks(
            bucket,
            layout.slots,
            layout.buckets[bucket.bucket].slots,
            self._first_param[bucket.group],
            self.world_size,
            self.chunk_numel,
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

    def _reduce_chunk(
        self, chunk: ReduceChunk, slot: torch.Tensor, staged: torch.Tensor, add: bool
    ) -> None:
        """Start summing ``staged`` (``chunk`` of this rank's gradient, in ``slot``) onto the
        chunk's owner, which lands it in its gradient shard (added when ``add``)."""
        work = dist.reduce(staged, group_dst=chunk.owner, group=self.pg, async_op=True)
        if chunk.owner != self.rank:
            self.pool.inflight.append(InFlight(work, slot))
            return
        view = self.buckets[chunk.bucket].shard_view
        dst = view[chunk.shard_start : chunk.shard_start + chunk.numel]
        self.pool.inflight.append(InFlight(work, slot, dst, staged, add, chunk.bucket))

    def _finish(self, item: InFlight) -> None:
        """Complete a reduction: wait for it, land its result, free its slot."""
        if item.work is not None:
            item.work.wait()
        if item.dst is not None:
            if item.add:
                item.dst.add_(item.src)
            else:
                item.dst.copy_(item.src)
        if item.slot is not None:
            self.pool.release(item.slot)
        if item.bucket >= 0:
            self._landed_chunk(item.bucket)

    def _landed_chunk(self, bucket: int) -> None:
        """Note that one chunk of ``bucket``'s gradient shard landed (see
        ``on_chunk_landed``)."""

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
    def staging_bytes(self) -> int:
        """Bytes of staging slots allocated (at most ``ZeroConfig.reduce_staging_bytes``)."""
        return self.pool.nbytes


class LocalStage2Reducer(GradReducer):
    """ZeRO stage 2 at world size 1: nothing to reduce and nothing to stage.

    Each hook writes its gradient straight into the fp32 gradient shard (copied in the
    window's first backward pass, added afterwards) and frees ``.grad``; the end of the
    window's first backward pass zero-fills the params that got no gradient.
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        self._views = [
            grad[b.shard_offset + s.offset : b.shard_offset + s.end].view(s.spec.shape)
            for group, grad in zip(flat.groups, grads, strict=True)
            for s in group.layout.slots
            for b in (group.layout.buckets[s.bucket],)
        ]
        self._arrived: set[int] = set()
        self._callback_queued = False
        self._landed = False
        self._register(lambda gi, slot, _: (self._first_param[gi] + slot,))

    def _hook(self, pid: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        if pid in self._arrived:
            raise RuntimeError(_TWICE)
        self._arrived.add(pid)
        if self._landed:
            self._views[pid].add_(grad)
        else:
            self._views[pid].copy_(grad)
        param.grad = None

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self._landed:
            missing = [
                v for pid, v in enumerate(self._views) if pid not in self._arrived and v.numel()
            ]
            if missing:
                torch._foreach_zero_(missing)
        self._arrived.clear()
        self._landed = True
        self.backward_seen = True
        self.generation += 1

    def finish(self) -> None:
        if self._callback_queued:
            raise RuntimeError(_UNFINISHED)

    def reset_window(self) -> None:
        self._arrived.clear()
        self._callback_queued = False
        self._landed = False
        self.backward_seen = False
        self.generation += 1


class Stage2Reducer(GradReducer):
    """ZeRO stage 2 over several ranks: hooks stage gradients chunk by chunk, free ``.grad``.

    The chunks are launched in one order on every rank (``order``'s buckets, each bucket's
    chunks in layout order). A gradient that arrives is held (autograd's own tensor, nothing
    copied) until every chunk it overlaps comes up: a chunk is launched as soon as every
    param overlapping it got its gradient or will get none, and every chunk before it was
    launched. Launching copies the chunk into a staging slot and reduces it onto its owner.
    The end-of-backward callback (``queue_callback``) counts the params that got no
    gradient as zero and launches every chunk left.

    Params this backward pass will not reach (an expert no token was routed to, a branch
    not taken) are known from autograd's graph at the pass's first gradient
    (``torch._C._will_engine_execute_node`` on each param's ``AccumulateGrad`` node) and
    count as zero at once, so they hold nothing up, on each rank its own. That is only
    sound when every gradient comes from the graph the pass started in: the first backward
    pass does not use it and watches for gradients from another graph task (reentrant
    activation checkpointing runs a backward inside backward); once any was seen, never
    again. A gradient that arrives after its chunk was reduced without it raises
    ``RuntimeError``.
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        params = [p for g in flat.groups for p in g.params]
        self._nodes = [get_gradient_edge(p).node for p in params]
        """Each param's ``AccumulateGrad`` node (held, as DDP does, so it stays the one)."""
        self._bucket_of = [0] * len(params)
        for chunks in self._chunks_by_bucket:
            for chunk in chunks:
                for pid, *_ in chunk.params:
                    self._bucket_of[pid] = chunk.bucket
        self._schedule()
        self._callback_queued = False
        self._landed = False
        """A backward pass of this window landed (the next one adds into the shard)."""
        self._recording = config.learn_bucket_order
        self._order_agreed = not self._recording
        self._last_arrival: dict[int, int] = {}
        self.recorded: list[int] = []
        self.skip_unused = False
        """Count unreached params as zero at a pass's start (see the class docstring)."""
        self._nested_seen = False
        self.held_peak = 0
        """Most bytes of gradients held at once, waiting for their chunks."""
        self._own_chunks = [
            sum(1 for c in chunks if c.owner == self.rank) for chunks in self._chunks_by_bucket
        ]
        """Per bucket: its chunks that land in this rank's gradient shard in every pass."""
        self._chunks_landed = [0] * len(self.buckets)
        self._pass = self._new_pass()
        self._register(lambda gi, slot, _: (self._first_param[gi] + slot,))

    def _schedule(self) -> None:
        """The chunks in launch order, and where each param's chunks are in it."""
        self.chunks = [c for b in self.order for c in self._chunks_by_bucket[b]]
        self._chunks_of: list[list[int]] = [[] for _ in self._nodes]
        for pos, chunk in enumerate(self.chunks):
            for pid, *_ in chunk.params:
                self._chunks_of[pid].append(pos)
        self._expected = [len(c.params) for c in self.chunks]

    def _new_pass(self) -> BackwardPass:
        return BackwardPass(list(self._expected), [len(c) for c in self._chunks_of])

    def _hook(self, pid: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        state = self._pass
        if not self._callback_queued:
            self._begin(state)
        elif torch._C._current_graph_task_id() != state.task:
            state.nested = True
        if pid in state.arrived:
            raise RuntimeError(_TWICE)
        state.arrived.add(pid)
        param.grad = None
        positions = self._chunks_of[pid]
        if not positions:
            return
        if pid in state.unused:
            if state.unstaged[pid] < len(positions):
                raise RuntimeError(_LATE)
            state.unused.discard(pid)  # its chunks still wait: it counts after all
            state.nested = True
        else:
            for pos in positions:
                state.pending[pos] -= 1
        state.hold(pid, grad.reshape(-1))
        self.held_peak = max(self.held_peak, state.held_bytes)
        if self._recording:
            self._last_arrival[self._bucket_of[pid]] = len(state.arrived)
        self._pump(state)

    def _begin(self, state: BackwardPass) -> None:
        """The pass's first gradient: queue its end, note its graph task, and (unless a
        backward inside backward was seen) count the params it will not reach as zero."""
        Variable._execution_engine.queue_callback(self._end_of_backward)
        self._callback_queued = True
        state.task = torch._C._current_graph_task_id()
        if not self.skip_unused:
            return
        will_run = torch._C._will_engine_execute_node
        for pid, node in enumerate(self._nodes):
            if self._chunks_of[pid] and not will_run(node):
                state.unused.add(pid)
                for pos in self._chunks_of[pid]:
                    state.pending[pos] -= 1

    def _pump(self, state: BackwardPass) -> None:
        """Launch chunks, in order, while the next one has all it waits for."""
        while state.cursor < len(self.chunks) and state.pending[state.cursor] == 0:
            self._launch(state, self.chunks[state.cursor])
            state.cursor += 1

    def _launch(self, state: BackwardPass, chunk: ReduceChunk) -> None:
        """Stage ``chunk`` from the held gradients (zeros where there are none) and start
        its reduction."""
        slot = self.pool.acquire()
        staged = slot[: chunk.numel]
        zeros = [staged[start:end] for start, end in chunk.gaps]
        dsts, srcs = [], []
        for pid, first, offset, numel in chunk.params:
            view = staged[offset : offset + numel]
            grad = state.held.get(pid)
            if grad is None:
                zeros.append(view)
            else:
                dsts.append(view)
                srcs.append(grad[first : first + numel])
            state.unstaged[pid] -= 1
        if zeros:
            torch._foreach_zero_(zeros)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        for pid, *_ in chunk.params:
            if state.unstaged[pid] == 0:
                state.release(pid)
        self._reduce_chunk(chunk, slot, staged, self._landed)

    def _landed_chunk(self, bucket: int) -> None:
        count = self._chunks_landed[bucket] + 1
        self._chunks_landed[bucket] = count % self._own_chunks[bucket]
        if self.on_chunk_landed is not None:
            self.on_chunk_landed(bucket, count == self._own_chunks[bucket])

    def _end_of_backward(self) -> None:
        """Count what got no gradient as zero, launch every chunk left.

        At the end of a backward pass run inside another one's node (reentrant activation
        checkpointing), defer to the end of the outer pass: ending here would reduce every
        bucket once per checkpointed segment.
        """
        node = torch._C._current_autograd_node()
        if node is not None:
            node.register_hook(self._queue_on_outer_backward)
            return
        state = self._pass
        self._callback_queued = False
        for pos in range(state.cursor, len(self.chunks)):
            state.pending[pos] = 0
        self._pump(state)
        if self._recording:
            self._learn_order()
        self._nested_seen |= state.nested
        self.skip_unused = not self._nested_seen
        self._pass = self._new_pass()
        self._landed = True
        self.backward_seen = True
        self.generation += 1

    def _queue_on_outer_backward(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of the node whose inner backward pass just ended: queue the end of the
        pass on the backward pass running that node."""
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _learn_order(self) -> None:
        """The buckets in the order their last gradient arrived; one that got none stays
        right after the bucket before it in the current order."""
        key, previous = {}, -1
        for b in self.order:
            previous = key[b] = self._last_arrival.get(b, previous)
        self.recorded = sorted(self.order, key=key.__getitem__)
        self._recording = False

    def _adopt(self, order: list[int]) -> None:
        """Launch in ``order`` from the next backward pass on (between passes only)."""
        self.order = order
        self._schedule()
        self._pass = self._new_pass()
        self._order_agreed = True
        self._recording = False

    def set_order(self, order: list[int] | None) -> None:
        super().set_order(order)
        if order is not None and self.order == list(order):
            self._adopt(self.order)

    def agree_order(self) -> None:
        """At the first step, adopt rank 0's order of the first backward pass (one
        broadcast, and one host read of it, once)."""
        if self._order_agreed:
            return
        n = len(self.buckets)
        device = collective_device(self.pg, self.flat.groups[0].device)
        if self.rank == 0:
            order = torch.tensor(self.recorded or self.order, dtype=torch.int64).to(device)
        else:
            order = torch.empty(n, dtype=torch.int64, device=device)
        src = 0 if self.pg is None else dist.get_global_rank(self.pg, 0)
        dist.broadcast(order, src=src, group=self.pg)
        self._adopt(order.tolist())
        logger.debug("stage 2 bucket launch order: %s", self.order)

    def finish(self) -> None:
        if self._callback_queued:
            raise RuntimeError(_UNFINISHED)
        self.pool.finish_all()

    def reset_window(self) -> None:
        self.pool.finish_all()
        self._chunks_landed = [0] * len(self.buckets)  # a failed pass launched only some
        self._pass = self._new_pass()
        self._callback_queued = False
        self._landed = False
        if self._recording:
            self._last_arrival.clear()  # a failed first pass: record the next one
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
        self._dirty = False
        self._clean = True
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
            src = self.bucket_grads[index]
            if (
                self._scatter_in_place
                and src.dtype == torch.float32
                and self.pool.dtype == torch.float32
            ):
                shard = self.buckets[index].shard_view
                work = reduce_scatter_into(shard, src, self.pg, async_op=True)
                self.pool.inflight.append(InFlight(work))
                continue
            for chunk in self._chunks_by_bucket[index]:
                slot = self.pool.acquire()
                staged = slot[: chunk.numel]
                staged.copy_(src[chunk.start : chunk.end])
                self._reduce_chunk(chunk, slot, staged, add=False)
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
    """The reducer of ``config.stage`` (and, for stage 2, of the world size)."""
    if config.stage == 1:
        return Stage1Reducer(flat, grads, config)
    if world_size_of(flat.process_group) == 1:
        return LocalStage2Reducer(flat, grads, config)
    return Stage2Reducer(flat, grads, config)

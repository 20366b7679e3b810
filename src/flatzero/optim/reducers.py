"""Gradient reduction into this rank's fp32 gradient shards: what every reducer shares.

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

The reducers: ``stage1.Stage1Reducer``, ``stage2.Stage2Reducer`` and
``stage2.LocalStage2Reducer`` (``prepare.make_reducer`` picks one).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..comm import rank_of, world_size_of
from ..flatten.buffers import FlatParams
from ..own_groups import collective_group
from ..roll_call import raise_naming_ranks
from .buckets import (
    BucketState,
    InFlight,
    ReduceChunk,
    StagingPool,
    bucket_chunks,
    bucket_states,
    staging_geometry,
)
from .config import ZeroConfig
from .grad_check import GradCheck
from .norm import global_sq_norm_with

__all__ = ["GradReducer", "WindowState", "check_unclaimed"]

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
                "would take its gradients; call close() on the old optimizer (engine.destroy() "
                "on an engine from flatzero.initialize or deepspeed.initialize), or drop every "
                "reference to it, before building a new one over the same params"
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


AGAIN = (
    "flatzero stage 2: the gradient of {name} arrived {count} times in this backward pass, "
    "after some of its chunks were reduced without the last one; no backward pass before "
    "delivered it more than {most} time(s). The first backward pass must show every reuse of "
    "a param (one reentrant activation-checkpointing segment per use, use_reentrant=True): "
    "run it with every segment that will ever share the param, or use use_reentrant=False "
    "(one delivery per pass) or ZeRO stage 1. Or an earlier backward pass did not finish (it "
    "raised?): call ZeroOptimizer.zero_grad() before the next backward pass"
)
UNFINISHED = (
    "a backward pass is still in progress or did not finish (it raised?); step() needs "
    "completed backward passes. After a failed backward pass call ZeroOptimizer.zero_grad() "
    "and run it again"
)
LATE = (
    "flatzero stage 2: a gradient arrived for a param that this backward pass had counted as "
    "unused and already reduced as zero. A backward pass ran inside this one (reentrant "
    "activation checkpointing, use_reentrant=True) that the first backward pass did not "
    "show. Use torch.utils.checkpoint with use_reentrant=False, or turn reentrant "
    "checkpointing on before the first backward pass"
)


class WindowState(enum.Enum):
    """Where a stage 2 reducer's accumulation window stands.

    ``EMPTY`` -(a pass's first gradient: ``begin``)-> ``FIRST_PASS`` -(its end: ``end``)->
    ``LANDED`` -(``begin``)-> ``NEXT_PASS`` -(``end``)-> ``LANDED``; a window reset goes
    back to ``EMPTY`` from any state (a failed pass included).
    """

    EMPTY = "empty"
    """No backward pass reached the params since the window began."""
    FIRST_PASS = "first pass"
    """The window's first backward pass runs: its gradients are written into the shard."""
    LANDED = "landed"
    """A backward pass of the window finished, none runs."""
    NEXT_PASS = "next pass"
    """A later backward pass runs: its gradients are added into the shard."""

    @property
    def running(self) -> bool:
        """A backward pass runs (its end-of-backward callback is queued)."""
        return self in (WindowState.FIRST_PASS, WindowState.NEXT_PASS)

    @property
    def landed(self) -> bool:
        """A backward pass of this window finished: the shard holds gradients to add to."""
        return self in (WindowState.LANDED, WindowState.NEXT_PASS)

    def begin(self) -> WindowState:
        """The state once a backward pass starts."""
        return WindowState.NEXT_PASS if self is WindowState.LANDED else WindowState.FIRST_PASS

    def end(self) -> WindowState:
        """The state once the running backward pass ends."""
        return WindowState.LANDED


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
        self.pg = collective_group(flat.process_group)
        """flatzero's own group over the process group's ranks (``own_groups.collective_group``):
        a user's collective inside backward never meets one of these reductions."""
        self.world_size = world_size_of(self.pg)
        self.rank = rank_of(self.pg)
        self.buckets = bucket_states(flat.groups, grads)
        self.order = [b.index for b in self.buckets]
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
        self.check = self._grad_check() if config.check_gradients and self.world_size > 1 else None
        """The gradient check (``ZeroConfig.check_gradients``), over several ranks."""
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

    def _grad_check(self) -> GradCheck:
        names = [s.spec.name for g in self.flat.groups for s in g.layout.slots]
        labels = [f"bucket {b.bucket} of group {b.group}" for b in self.buckets]
        chunks = [c for chunks in self._chunks_by_bucket for c in chunks]
        return GradCheck(
            chunks,
            self.buckets,
            names,
            labels,
            self.rank,
            self.world_size,
            self.pg,
            self.chunk_numel,
            self.config.reduce_dtype,
        )

    def _check_landed(self) -> None:
        """Project the window's reductions so far (after they all landed); the comparison
        waits for the step's norm all-reduce or ``settle_check``."""
        if self.check is not None:
            self.check.land()

    # [Note: the check rides on the norm] The check's table (a few float64 scalars per
    # chunk and rank) needs one all-reduce per step. When the step computes the gradient
    # norm anyway (clipping, fp16's inf/nan verdict, the DeepSpeed door's norm), the table
    # is packed into the norm's float64 all-reduce: no collective of its own, no extra
    # wait. Without one, ``settle_check`` makes it before the update.
    def sq_norm(self, grads: list[torch.Tensor], pg: dist.ProcessGroup | None) -> torch.Tensor:
        """``norm.global_sq_norm`` of ``grads``, the check's waiting table riding in the same
        all-reduce and compared (raises ``GradientMismatch``)."""
        check = self.check
        sq, summed = global_sq_norm_with(grads, pg, None if check is None else check.take())
        if summed is not None and check is not None:
            check.compare(summed)
        return sq

    def settle_check(self) -> None:
        """Compare what the gradient check still holds, with an all-reduce of its own
        (collective; nothing to do when the norm's all-reduce carried it)."""
        if self.check is not None:
            self.check.settle()

    def _check_reset(self) -> None:
        """A new window for the gradient check."""
        if self.check is not None:
            self.check.reset()

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
        if self.check is not None:
            self.check.local(chunk, staged, add)
        try:
            work = dist.reduce(staged, group_dst=chunk.owner, group=self.pg, async_op=True)
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, self.pg, self._doing())
        if chunk.owner != self.rank:
            self.pool.inflight.append(InFlight(work, slot))
            return
        view = self.buckets[chunk.bucket].shard_view
        dst = view[chunk.shard_start : chunk.shard_start + chunk.numel]
        self.pool.inflight.append(InFlight(work, slot, dst, staged, add, chunk.bucket))

    def _finish(self, item: InFlight) -> None:
        """Complete a reduction: wait for it, land its result, free its slot."""
        if item.work is not None:
            try:
                item.work.wait()
            except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
                raise_naming_ranks(error, self.pg, self._doing())
        if item.dst is not None:
            if item.add:
                item.dst.add_(item.src)
            else:
                item.dst.copy_(item.src)
        if item.slot is not None:
            self.pool.release(item.slot)
        if item.bucket >= 0:
            self._landed_chunk(item.bucket)

    def _doing(self) -> str:
        """What this reducer's failed collective was part of (``raise_naming_ranks``)."""
        return "waiting for the gradient reductions (step, zero_grad or reduce_gradients)"

    def _landed_chunk(self, bucket: int) -> None:
        """Note that one chunk of ``bucket``'s gradient shard landed (see
        ``on_chunk_landed``)."""

    @property
    def backward_seen(self) -> bool:
        """A backward pass reached the params since the window began."""
        raise NotImplementedError

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

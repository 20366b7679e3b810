"""The bucket loop of one param group: allocate, fill, agree, gather, rebind, fall back."""

from __future__ import annotations

import logging
from typing import NoReturn

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..comm import all_reduce_max, all_reduce_max_each, rank_of, world_size_of
from ..layout import GroupLayout
from ..memory import out_of_memory
from .alloc import allocate_or_oom
from .faults import allocate_bucket
from .registry import REGISTRY, chain, make_tier, next_tier_down, spec
from .source import ParamSource
from .tiers import Fill, Tier, TierContext, UploadTier

__all__ = ["BucketFillError", "GroupFlattener"]

logger = logging.getLogger(__name__)


_UNFILLED = 1 + max(s.level for s in REGISTRY.values())
"""The level of a bucket that no tier could allocate, below every tier."""

_FILLED, _NO_ROOM, _FILL_FAILED = 0, 1, 2
"""What a rank reports of a bucket of a collective tier before its all-gather (the
maximum over ranks wins: a failed fill ends the flatten, no room falls back a tier)."""


class BucketFillError(RuntimeError):
    """Reading or copying a bucket's values failed on some rank (a checkpoint read error,
    say). Raised on every rank with the same message, naming each rank that failed and its
    error (the cause, on those ranks), before any rank waits in a collective the others
    will not join; every parameter still holds its data."""


class GroupFlattener:
    """Flattens the buckets of one group, falling back a tier when memory runs out.

    Every rank must end with each bucket in the same tier (the optimizer's collectives
    run bucket by bucket, on the bucket's device). A tier whose fill is a collective
    (``sharded``: the all-gather) agrees with the other ranks on every allocation before
    filling. The other tiers fill locally, so a rank falls back on its own and the ranks
    agree once, after the last bucket: a bucket that went lower on any rank goes to that
    tier everywhere. That saves a round trip per bucket (hundreds on a large model), and
    out-of-memory stays an exception rather than the rule.

    A bucket's tier is compared across ranks by its registry ``level``: every chain starts
    at the tier all ranks agreed on, so the highest level over ranks is the lowest tier
    any rank reached.
    """

    def __init__(
        self,
        layout: GroupLayout,
        source: ParamSource,
        ctx: TierContext,
        control: dist.ProcessGroup | None,
        first_ordinal: int,
        progress: tqdm,
    ) -> None:
        self.layout = layout
        self.source = source
        self.ctx = ctx
        self.control = control
        self.first_ordinal = first_ordinal
        self.progress = progress
        self.buffers: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self.bucket_tiers: list[str] = [""] * len(layout.buckets)
        self._pending: list[tuple[int, Fill]] = []
        self._held: tuple[int, UploadTier, Fill] | None = None
        self._failure: tuple[int, Exception] | None = None
        self._chain: tuple[str, ...] = ()

    def run(self, tier_name: str) -> None:
        """Flatten every bucket of the group, starting in tier ``tier_name``.

        Raises:
            MemoryError: on every rank, when a bucket fits in no tier on some rank (a
                ``torch.OutOfMemoryError`` too when the buffers are on an accelerator).
            BucketFillError: on every rank, when filling a bucket failed on some rank.
        """
        self._chain = chain(tier_name, self.ctx.device)
        tier = make_tier(tier_name, self.ctx)
        tier.begin(self.layout, self.source, range(len(self.layout.buckets)))
        no_room: MemoryError | None = None
        for bucket in range(len(self.layout.buckets)):
            try:
                tier, fill = self._fill_agreed(tier, bucket)
            except MemoryError as error:  # the last tier, on this rank alone
                no_room = error
                break
            if fill is None:  # a local fill failed on this rank: agreed after the loop
                break
            self.bucket_tiers[bucket] = tier.name
            self._queue(bucket, tier, fill)
            self._complete(block=False)
            self.progress.update(1)
        self._gather_held()
        self._complete(block=True)
        self._agree_on_tiers(no_room)

    def _fill_agreed(self, tier: Tier, bucket: int) -> tuple[Tier, Fill | None]:
        """The bucket allocated and filled in ``tier`` or, after running out of memory, a
        lower one. The fill is None when it failed on this rank in a tier that fills
        locally (``_failure``; the ranks agree on it after the group's last bucket).

        A collective tier agrees with every rank, in one all-reduce per bucket, on both
        the allocation and the fill of this rank's slice before the all-gather: a rank that
        could not allocate or read must not leave the others waiting in it.

        Raises:
            MemoryError: this rank's last tier could not allocate (a local tier), or every
                rank's (a collective one).
            BucketFillError: on every rank, when a collective tier's fill failed on one.
        """
        tier.prepare(self.layout, self.source, bucket)
        while True:
            buf, error = self._allocate(tier, bucket)
            while buf is None and tier.make_room(self.layout, self.source):
                buf, error = self._allocate(tier, bucket)
            fill = None if buf is None else self._try_fill(tier, bucket, buf)
            if spec(tier.name).fill_is_collective(self.ctx.world_size):
                outcome = all_reduce_max(self._outcome(buf), self.control)
                if outcome == _FILL_FAILED:
                    self._raise_fill_error()
                if outcome == _FILLED:
                    return tier, fill
            elif buf is not None:
                return tier, fill
            tier = self._fall_back(tier, bucket, error)

    def _try_fill(self, tier: Tier, bucket: int, buf: torch.Tensor) -> Fill | None:
        """``tier.fill`` of the bucket, or None when it raised (kept in ``_failure``)."""
        try:
            return tier.fill(self.layout, self.source, bucket, buf)
        except Exception as error:  # any rank's error must reach every rank, never hang
            self._failure = (bucket, error)
            return None

    def _outcome(self, buf: torch.Tensor | None) -> int:
        """What this rank reports of a collective tier's bucket."""
        if self._failure is not None:
            return _FILL_FAILED
        return _NO_ROOM if buf is None else _FILLED

    def _queue(self, bucket: int, tier: Tier, fill: Fill) -> None:
        """Queue a filled bucket for rebinding. A collective tier's bucket is held and
        all-gathered after the next bucket's upload was queued (so that the copy stream
        uploads bucket k + 1 while bucket k is all-gathered); the bucket held before it is
        all-gathered now."""
        if not spec(tier.name).fill_is_collective(self.ctx.world_size):
            self._pending.append((bucket, fill))
            return
        assert isinstance(tier, UploadTier)
        self._gather_held()
        self._held = (bucket, tier, fill)

    def _gather_held(self) -> None:
        """All-gather the held bucket, which every rank allocated and filled its slice of,
        and queue it for rebinding."""
        if self._held is None:
            return
        bucket, tier, fill = self._held
        self._held = None
        self._pending.append((bucket, tier.gather(self.layout, bucket, fill)))

    def _raise_fill_error(self) -> NoReturn:
        """Raise the same ``BucketFillError`` on every rank (collective: every rank calls
        it once the ranks agreed that some rank's fill failed). A held bucket is dropped
        unfilled: its params keep their storage; complete buckets are rebound."""
        self._held = None
        self._complete(block=True)
        mine = None
        if self._failure is not None:
            bucket, error = self._failure
            mine = (
                f"rank {rank_of(self.control)} at bucket {bucket} ({type(error).__name__}: {error})"
            )
        texts = [mine]
        if world_size_of(self.control) > 1:
            texts = [None] * world_size_of(self.control)
            dist.all_gather_object(texts, mine, group=self.control)
        failed = "; ".join(t for t in texts if t is not None)
        raise BucketFillError(
            f"filling the buckets of group {self.layout.group_index} ({self.layout.dtype}) "
            f"failed on {failed}; every parameter still holds its data"
        ) from (None if self._failure is None else self._failure[1])

    def _agree_on_tiers(self, no_room: MemoryError | None) -> None:
        """Make every rank hold each bucket in the lowest tier any rank used for it.

        The same all-reduce tells whether a local fill failed on some rank.

        Raises:
            MemoryError: on every rank, when some rank could not allocate a bucket even in
                the last tier (every parameter still holds its data).
            BucketFillError: on every rank, when a fill failed on some rank.
        """
        mine = [spec(t).level if t else _UNFILLED for t in self.bucket_tiers]
        *agreed, failed = all_reduce_max_each([*mine, int(self._failure is not None)], self.control)
        if failed:
            self._raise_fill_error()
        if no_room is not None:
            raise no_room
        if max(agreed) == _UNFILLED:
            bucket = agreed.index(_UNFILLED)
            raise self._last_tier_error("on another rank", bucket, "the last tier")
        followed = [b for b, (m, a) in enumerate(zip(mine, agreed, strict=True)) if a > m]
        by_level = {spec(t).level: t for t in self._chain}
        for bucket in followed:
            # Only the label changes: a GPU's chain ends at host_park (on the device, like
            # device), and host buffers are in host memory whatever their tier.
            self.bucket_tiers[bucket] = by_level[agreed[bucket]]
        if followed:
            self._warn(
                f"buckets {followed[0]}..{followed[-1]} of group {self.layout.group_index} "
                f"({self.layout.dtype}) follow another rank, which ran out of memory, into "
                f"tier(s) {sorted({self.bucket_tiers[b] for b in followed})}"
            )

    def _allocate(
        self, tier: Tier, bucket: int
    ) -> tuple[torch.Tensor | None, BaseException | None]:
        """The bucket's buffer on the tier's device, or the out-of-memory error (on a GPU,
        after emptying the allocator's cache and trying once more)."""
        numel = self.layout.buckets[bucket].numel
        dtype = getattr(torch, self.layout.dtype)
        ordinal = self.first_ordinal + bucket
        return allocate_or_oom(
            lambda: allocate_bucket(
                numel,
                dtype,
                tier.bucket_device,
                ordinal=ordinal,
                tier=tier.name,
                huge_pages=self.ctx.huge_pages,
            ),
            tier.bucket_device,
        )

    def _fall_back(self, tier: Tier, bucket: int, error: BaseException | None) -> Tier:
        """Switch this rank's remaining buckets to the next tier down.

        Raises:
            MemoryError: ``tier`` is the last one.
        """
        self._gather_held()  # every rank filled it: all of them gather it, then fall back
        self._complete(block=True)
        lower = next_tier_down(tier.name, self.ctx.device)
        where = f"on rank {rank_of(self.control)}" if error is not None else "on another rank"
        if lower is None:
            last = f"tier {tier.name!r}, the last tier"
            raise self._last_tier_error(where, bucket, last) from error
        self._warn(
            f"out of memory {where} at bucket {bucket} of group {self.layout.group_index} "
            f"({self.layout.dtype}) in tier {tier.name!r}; buckets {bucket}.. continue in "
            f"tier {lower!r}"
        )
        new_tier = make_tier(lower, self.ctx)
        new_tier.begin(self.layout, self.source, range(bucket, len(self.layout.buckets)))
        new_tier.prepare(self.layout, self.source, bucket)
        return new_tier

    def _last_tier_error(self, where: str, bucket: int, tier_text: str) -> MemoryError:
        """The error of a bucket that not even the last tier could allocate."""
        return out_of_memory(
            f"out of memory {where} at bucket {bucket} of group {self.layout.group_index} "
            f"({self.layout.dtype}) in {tier_text}; every parameter still holds its data. "
            "Free memory, use more ranks, or a smaller bucket_numel"
            + (
                ""
                if self.ctx.device.type == "cpu"
                else " (on an accelerator the buffers never fall back to host memory: the "
                "optimizer needs every bucket on the device)"
            ),
            self.ctx.device,
        )

    def _warn(self, message: str) -> None:
        """Log a fallback and record it in the init report."""
        logger.warning("%s", message)
        self.ctx.report.events.append(message)

    def _complete(self, *, block: bool) -> None:
        """Rebind the params of every bucket whose copy has finished."""
        still = []
        for bucket, fill in self._pending:
            if block or fill.ready():
                fill.wait()
                self._rebind(bucket, fill.buffer)
            else:
                still.append((bucket, fill))
        self._pending = still

    def _rebind(self, bucket: int, buf: torch.Tensor) -> None:
        self.source.rebind_bucket(bucket, buf)
        self.buffers[bucket] = buf

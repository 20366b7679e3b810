"""Resharding plans: which elements of which saved shard fill a new rank's shard (pure).

Resharding works in the *param-element space*. A saved checkpoint is indexed as, per
param name, the runs of its flat elements and where each run lies (``Segment``: a source
tensor, e.g. old rank 2's shard of old group 0, and the offset in it). A new rank walks
its new shard pieces (``GroupLayout.shard_pieces``: param, element range, shard offset),
looks each param up by name and emits ``Copy`` operations: new shard offset <- source,
offset, count. Consecutive copies contiguous on both sides are merged, so a reshard of
the same model at another world size reads a few long runs per source. Elements that no
copy covers are padding (zero).

Nothing here reads a file: ``execute`` takes a ``fetch(source, start, numel)`` callback.
The same plans serve flatzero checkpoints (``index_layout``) and DeepSpeed checkpoints
(``flatzero.deepspeed.reader`` builds its own index).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..layout import GroupLayout, Layout

__all__ = [
    "Copy",
    "GroupReadPlan",
    "ParamIndex",
    "ParamRecord",
    "Segment",
    "execute",
    "index_layout",
    "plan_group_reads",
    "plan_reads",
]


@dataclass(frozen=True)
class Segment:
    """Param elements ``[param_start, param_end)`` stored at ``offset..`` of ``source``.

    Attributes:
        param_start: first flat element of the param in the run.
        param_end: one past the last.
        source: which saved tensor holds the run (for flatzero: ``(old_rank, old_group)``).
        offset: element offset of ``param_start`` inside that tensor.
    """

    param_start: int
    param_end: int
    source: Hashable
    offset: int


@dataclass(frozen=True)
class ParamRecord:
    """One saved param: its shape, dtype, source group and where its elements are.

    Attributes:
        name: the param's name in the checkpoint.
        shape: its shape.
        dtype: its dtype name (``"bfloat16"``); master and states are fp32 regardless.
        group: index of the saved optimizer group holding it.
        segments: runs covering ``[0, numel)`` exactly once, in param order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int
    segments: tuple[Segment, ...]
    _starts: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(s.param_start for s in self.segments))

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def runs(self, start: int, end: int) -> Iterable[tuple[Segment, int, int]]:
        """``(segment, lo, hi)`` for every segment overlapping elements ``[start, end)``."""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self.segments):
            seg = self.segments[i]
            if seg.param_start >= end:
                break
            lo, hi = max(start, seg.param_start), min(end, seg.param_end)
            if lo < hi:
                yield seg, lo, hi
            i += 1


ParamIndex = Mapping[str, ParamRecord]
"""Saved params by name."""


def index_layout(layout: Layout) -> dict[str, ParamRecord]:
    """Where every param of a flatzero ``layout`` lies: sources are ``(rank, group)``."""
    out: dict[str, ParamRecord] = {}
    for gi, gl in enumerate(layout.groups):
        for slot in gl.slots:
            b = gl.buckets[slot.bucket]
            width = b.slice_numel
            segs = []
            if slot.numel:
                for rank in range(slot.offset // width, (slot.end - 1) // width + 1):
                    lo, hi = max(slot.offset, rank * width), min(slot.end, (rank + 1) * width)
                    segs.append(
                        Segment(
                            lo - slot.offset,
                            hi - slot.offset,
                            (rank, gi),
                            b.shard_offset + lo - rank * width,
                        )
                    )
            out[slot.spec.name] = ParamRecord(
                slot.spec.name, slot.spec.shape, slot.spec.dtype, gi, tuple(segs)
            )
    return out


@dataclass(frozen=True)
class Copy:
    """Copy ``numel`` elements from ``source`` at ``src_start`` to the new shard at
    ``dst_start``."""

    dst_start: int
    source: Hashable
    src_start: int
    numel: int


@dataclass(frozen=True)
class GroupReadPlan:
    """How to fill one rank's shard of one new layout group.

    Attributes:
        group: index of the new layout group.
        shard_numel: length of the new shard.
        copies: the copies, in new-shard order; uncovered elements stay zero.
        source_groups: saved groups the copies read from (sorted).
        params: the new group's param names with their checkpoint names.
        missing: new params (this rank's part of them) with no saved counterpart (only
            with ``strict=False``): ``(name, dst_start, numel)`` runs left to the caller.
    """

    group: int
    shard_numel: int
    copies: tuple[Copy, ...]
    source_groups: tuple[int, ...]
    missing: tuple[tuple[str, int, int], ...] = ()

    @property
    def sources(self) -> set[Hashable]:
        """Every source the copies read from."""
        return {c.source for c in self.copies}


def _resolve(name: str, rename: Callable[[str], str] | Mapping[str, str] | None) -> str:
    if rename is None:
        return name
    if callable(rename):
        return rename(name)
    return rename.get(name, name)


def _append_merged(copies: list[Copy], copy: Copy) -> None:
    """Append ``copy``, merged into the last one when both are contiguous on both sides."""
    last = copies[-1] if copies else None
    if (
        last is not None
        and last.source == copy.source
        and last.dst_start + last.numel == copy.dst_start
        and last.src_start + last.numel == copy.src_start
    ):
        copies[-1] = Copy(last.dst_start, last.source, last.src_start, last.numel + copy.numel)
    else:
        copies.append(copy)


def plan_group_reads(
    index: ParamIndex,
    group: GroupLayout,
    group_index: int,
    rank: int,
    *,
    rename: Callable[[str], str] | Mapping[str, str] | None = None,
    strict: bool = True,
    where: str = "the checkpoint",
) -> GroupReadPlan:
    """Plan the reads that fill rank ``rank``'s shard of new layout group ``group``.

    Args:
        index: the saved params by name.
        group: the new group layout; ``group_index`` is its index in the new layout.
        rank: the new rank.
        rename: maps a new param name to its name in the checkpoint (a function or dict).
        strict: a new param with no saved counterpart is an error; else it is reported in
            ``missing``.
        where: how to name the checkpoint in error messages.

    Raises:
        ValueError: a param is missing (strict) or has another shape in the checkpoint.
    """
    copies: list[Copy] = []
    missing: list[tuple[str, int, int]] = []
    groups: set[int] = set()
    for piece in group.shard_pieces(rank):
        spec = group.slots[piece.slot].spec
        saved_name = _resolve(spec.name, rename)
        record = index.get(saved_name)
        if record is None:
            if strict:
                raise ValueError(
                    f"param {spec.name!r}"
                    + (f" (looked up as {saved_name!r})" if saved_name != spec.name else "")
                    + f" is not in {where}; it was saved from another model, or names differ:"
                    " pass a name mapping (rename=...) or strict=False to keep its current "
                    "value"
                )
            missing.append((spec.name, piece.shard_start, piece.numel))
            continue
        if record.shape != spec.shape:
            raise ValueError(
                f"param {spec.name!r} has shape {spec.shape} in the model but "
                f"{record.shape} in {where} (as {saved_name!r}); build the model with the "
                "config it was saved with"
            )
        groups.add(record.group)
        for seg, lo, hi in record.runs(piece.param_start, piece.param_end):
            dst = piece.shard_start + lo - piece.param_start
            _append_merged(
                copies, Copy(dst, seg.source, seg.offset + lo - seg.param_start, hi - lo)
            )
    return GroupReadPlan(
        group_index, group.shard_numel, tuple(copies), tuple(sorted(groups)), tuple(missing)
    )


def plan_reads(
    index: ParamIndex,
    layout: Layout,
    rank: int,
    *,
    rename: Callable[[str], str] | Mapping[str, str] | None = None,
    strict: bool = True,
    where: str = "the checkpoint",
) -> list[GroupReadPlan]:
    """``plan_group_reads`` for every group of ``layout``; with ``strict``, saved params
    that no new param takes are an error too (a checkpoint of another model)."""
    plans = [
        plan_group_reads(index, g, i, rank, rename=rename, strict=strict, where=where)
        for i, g in enumerate(layout.groups)
    ]
    if strict:
        taken = {_resolve(s.spec.name, rename) for g in layout.groups for s in g.slots}
        extra = sorted(set(index) - taken)
        if extra:
            raise ValueError(
                f"{where} has {len(extra)} params the model does not have (e.g. "
                + ", ".join(repr(n) for n in extra[:5])
                + "); it was saved from another model, some params are frozen now, or names "
                "differ: pass a name mapping (rename=...) or strict=False to ignore them"
            )
    return plans


def execute(
    plan: GroupReadPlan,
    out: torch.Tensor,
    fetch: Callable[[Hashable, int, int], torch.Tensor],
) -> int:
    """Run ``plan``'s copies into ``out`` (1-D, ``plan.shard_numel`` long); returns elements
    copied. ``fetch(source, start, numel)`` returns that run of a saved tensor."""
    if out.numel() != plan.shard_numel:
        raise ValueError(f"out has {out.numel()} elements, the shard {plan.shard_numel}")
    total = 0
    for c in plan.copies:
        out[c.dst_start : c.dst_start + c.numel].copy_(fetch(c.source, c.src_start, c.numel))
        total += c.numel
    return total

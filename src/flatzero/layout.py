"""The flat, sharded layout of a model's parameters: pure metadata.

Nothing here allocates a tensor or talks to a process group, so every rank can
compute the same layout from the same inputs and the layout can be tested (and
stored in a checkpoint) on its own.

Terms, all counted in elements of the group's dtype:

- A *group layout* is one (param group, dtype) pair: its params, in reverse
  registration order, packed into *buckets*.
- Each param starts at a multiple of ``alignment`` elements inside its bucket;
  a param never spans two buckets; a param bigger than ``bucket_numel`` gets a
  bucket of its own.
- Each bucket is padded to a multiple of ``world_size * alignment``; rank ``r``
  owns the ``r``-th equal *slice* of every bucket.
- A rank's *shard* of a group is the concatenation of its slices of every
  bucket, in bucket order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from .owners import newton_schulz_cost, place_whole

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUCKET_NUMEL",
    "BucketLayout",
    "GroupLayout",
    "Layout",
    "ParamSlot",
    "ParamSpec",
    "ShardPiece",
    "plan_layout",
]

DEFAULT_ALIGNMENT = 64
"""Every param starts on a multiple of this many elements (128 bytes in bf16)."""

DEFAULT_BUCKET_NUMEL = 2**26
"""Default bucket size: 64 Mi elements (128 MiB in bf16)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one trainable parameter.

    Attributes:
        name: the parameter's fully qualified name (``model.named_parameters()``).
        shape: its shape.
        dtype: its dtype as a string without the ``torch.`` prefix, e.g. ``"bfloat16"``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int = field(init=False, repr=False, compare=False)
    """Number of elements (derived from ``shape``)."""

    def __post_init__(self) -> None:
        shape = tuple(map(int, self.shape))
        if shape and min(shape) < 0:
            raise ValueError(f"param {self.name!r} has a negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", math.prod(shape))


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's buckets.

    Attributes:
        spec: the parameter.
        registration_index: its position among the group's params as the user gave them.
        bucket: index of its bucket within the group layout.
        offset: first element of the param inside its bucket (a multiple of the alignment).
    """

    spec: ParamSpec
    registration_index: int
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.spec.numel

    @property
    def end(self) -> int:
        """One past the param's last element inside its bucket."""
        return self.offset + self.spec.numel


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: a contiguous run of params, padded to a multiple of ``world * alignment``.

    Attributes:
        index: position of the bucket within its group layout.
        numel: padded length in elements (a multiple of ``world_size * alignment``).
        slots: indices into ``GroupLayout.slots`` of the params it holds, in offset order.
        used: elements up to the end of the last param (``numel - used`` is tail padding).
        shard_offset: where this bucket's slice starts inside every rank's shard.
        world_size: number of ranks the bucket is sliced for.
    """

    index: int
    numel: int
    slots: tuple[int, ...]
    used: int
    shard_offset: int
    world_size: int

    @property
    def slice_numel(self) -> int:
        """Elements of this bucket that each rank owns."""
        return self.numel // self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s slice inside this bucket."""
        start = rank * self.slice_numel
        return start, start + self.slice_numel


@dataclass(frozen=True)
class ShardPiece:
    """A run of one param's flat elements that lies in one rank's shard.

    Param elements ``[param_start, param_end)`` live at shard elements
    ``[shard_start, shard_start + param_end - param_start)`` of that rank.

    Attributes:
        slot: index into ``GroupLayout.slots``.
        param_start: first flat element of the param in this piece.
        param_end: one past the last flat element of the param in this piece.
        shard_start: where the piece starts in the rank's shard.
        bucket: the bucket the piece lies in.
        bucket_start: where the piece starts in its bucket.
    """

    slot: int
    param_start: int
    param_end: int
    shard_start: int
    bucket: int
    bucket_start: int

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.param_end - self.param_start


@dataclass(frozen=True)
class GroupLayout:
    """The layout of one (param group, dtype) pair.

    Attributes:
        group_index: index of the user's param group this layout belongs to.
        dtype: dtype of its params as a string, e.g. ``"bfloat16"``.
        slots: the params in layout (reverse registration) order.
        buckets: the buckets, in layout order.
        world_size: number of ranks.
        alignment: params start on multiples of this many elements.
        whole: every param lies whole inside one rank's slice (``owners``), for an
            optimizer that steps whole tensors.
    """

    group_index: int
    dtype: str
    slots: tuple[ParamSlot, ...]
    buckets: tuple[BucketLayout, ...]
    world_size: int
    alignment: int
    whole: bool = False

    @property
    def numel(self) -> int:
        """Total padded elements over all buckets."""
        return sum(b.numel for b in self.buckets)

    @property
    def param_numel(self) -> int:
        """Total elements of the params themselves."""
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        """Elements spent on alignment and tail padding."""
        return self.numel - self.param_numel

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's shard (the same on every rank)."""
        return self.numel // self.world_size

    def bucket_slots(self, bucket: int) -> tuple[ParamSlot, ...]:
        """The params of bucket ``bucket``, in offset order."""
        return tuple(self.slots[i] for i in self.buckets[bucket].slots)

    def bucket_pieces(self, bucket: int, rank: int) -> Iterator[ShardPiece]:
        """The pieces of params that lie in rank ``rank``'s slice of bucket ``bucket``."""
        self._check_rank(rank)
        b = self.buckets[bucket]
        lo, hi = b.rank_range(rank)
        return self._pieces_in(bucket, lo, hi)

    def bucket_pieces_all(self, bucket: int) -> Iterator[ShardPiece]:
        """Every param of bucket ``bucket`` as one whole piece (``shard_start`` is -1)."""
        b = self.buckets[bucket]
        for i in b.slots:
            slot = self.slots[i]
            if slot.numel:
                yield ShardPiece(i, 0, slot.numel, -1, bucket, slot.offset)

    def pieces_between(self, bucket: int, lo: int, hi: int) -> Iterator[ShardPiece]:
        """The pieces of params between bucket elements ``lo`` and ``hi`` (any range, e.g.
        a chunk of a staged slice; ``shard_start`` is -1)."""
        for piece in self._pieces_in(bucket, lo, hi):
            yield dataclasses.replace(piece, shard_start=-1)

    def _pieces_in(self, bucket: int, lo: int, hi: int) -> Iterator[ShardPiece]:
        b = self.buckets[bucket]
        for i in b.slots:
            slot = self.slots[i]
            start, end = max(slot.offset, lo), min(slot.end, hi)
            if start < end:
                yield ShardPiece(
                    slot=i,
                    param_start=start - slot.offset,
                    param_end=end - slot.offset,
                    shard_start=b.shard_offset + start - lo,
                    bucket=bucket,
                    bucket_start=start,
                )

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """Every piece of every param in rank ``rank``'s shard, in shard order."""
        self._check_rank(rank)
        return [p for b in range(len(self.buckets)) for p in self.bucket_pieces(b, rank)]

    def param_pieces(self, slot: int) -> list[tuple[int, ShardPiece]]:
        """``(rank, piece)`` for every rank holding part of param ``slot``, in param order."""
        s = self.slots[slot]
        b = self.buckets[s.bucket]
        if s.numel == 0:
            return []
        first, last = s.offset // b.slice_numel, (s.end - 1) // b.slice_numel
        out = []
        for rank in range(first, last + 1):
            out.extend((rank, p) for p in self.bucket_pieces(s.bucket, rank) if p.slot == slot)
        return out

    def gaps(self, bucket: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` runs of padding inside ``[lo, hi)`` of bucket ``bucket``.

        Padding is zero and stays zero; flattening writes zeros exactly here.
        """
        b = self.buckets[bucket]
        hi = b.numel if hi is None else hi
        out = []
        cursor = lo
        for i in b.slots:
            slot = self.slots[i]
            if slot.numel == 0:
                continue
            if slot.offset >= hi:
                break
            if slot.offset > cursor:
                out.append((cursor, slot.offset))
            cursor = max(cursor, slot.end)
        if cursor < hi:
            out.append((cursor, hi))
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")


@dataclass(frozen=True)
class Layout:
    """The layouts of every (param group, dtype) pair of a model.

    Attributes:
        groups: one ``GroupLayout`` per (param group, dtype), ordered by group, then dtype
            in order of first appearance.
        world_size: number of ranks.
        bucket_numel: target bucket size in elements.
        alignment: params start on multiples of this many elements.
    """

    groups: tuple[GroupLayout, ...]
    world_size: int
    bucket_numel: int
    alignment: int = DEFAULT_ALIGNMENT
    _digest: str = field(default="", compare=False, repr=False)

    @property
    def param_numel(self) -> int:
        """Elements of all params together."""
        return sum(g.param_numel for g in self.groups)

    @property
    def num_params(self) -> int:
        """Number of params over all groups."""
        return sum(len(g.slots) for g in self.groups)

    def to_dict(self) -> dict:
        """A JSON-serializable description (stored in checkpoints)."""
        return {
            "format": 1,
            "world_size": self.world_size,
            "bucket_numel": self.bucket_numel,
            "alignment": self.alignment,
            "groups": [
                {
                    "group_index": g.group_index,
                    "dtype": g.dtype,
                    **({"whole": True} if g.whole else {}),
                    "params": [
                        {
                            "name": s.spec.name,
                            "shape": list(s.spec.shape),
                            "registration_index": s.registration_index,
                            "bucket": s.bucket,
                            "offset": s.offset,
                        }
                        for s in g.slots
                    ],
                    "buckets": [
                        {
                            "index": b.index,
                            "numel": b.numel,
                            "slots": list(b.slots),
                            "used": b.used,
                            "shard_offset": b.shard_offset,
                        }
                        for b in g.buckets
                    ],
                }
                for g in self.groups
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Layout:
        """Rebuild a layout written by ``to_dict``."""
        if data.get("format") != 1:
            raise ValueError(f"unknown layout format {data.get('format')!r}; expected 1")
        ws = int(data["world_size"])
        groups = []
        for g in data["groups"]:
            slots = tuple(
                ParamSlot(
                    spec=ParamSpec(p["name"], tuple(p["shape"]), g["dtype"]),
                    registration_index=p["registration_index"],
                    bucket=p["bucket"],
                    offset=p["offset"],
                )
                for p in g["params"]
            )
            buckets = tuple(
                BucketLayout(
                    index=b["index"],
                    numel=b["numel"],
                    slots=tuple(b["slots"]),
                    used=b["used"],
                    shard_offset=b["shard_offset"],
                    world_size=ws,
                )
                for b in g["buckets"]
            )
            groups.append(
                GroupLayout(
                    g["group_index"],
                    g["dtype"],
                    slots,
                    buckets,
                    ws,
                    data["alignment"],
                    whole=bool(g.get("whole", False)),
                )
            )
        return cls(tuple(groups), ws, int(data["bucket_numel"]), int(data["alignment"]))

    def digest(self) -> str:
        """A stable SHA-256 of the layout; equal on every rank that planned the same layout."""
        if not self._digest:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_digest", hashlib.sha256(text.encode()).hexdigest())
        return self._digest


def _plan_group(
    group_index: int,
    dtype: str,
    specs: Sequence[tuple[int, ParamSpec]],
    world_size: int,
    bucket_numel: int,
    alignment: int,
) -> GroupLayout:
    """Pack ``(registration_index, spec)`` pairs (already in layout order) into buckets."""
    slots: list[ParamSlot] = []
    bucket_members: list[list[int]] = [[]]
    fill = 0  # elements used in the open bucket, up to the end of its last param
    for reg_index, spec in specs:
        offset = _round_up(fill, alignment)
        if bucket_members[-1] and offset + spec.numel > bucket_numel:
            bucket_members.append([])
            offset = 0
        slots.append(ParamSlot(spec, reg_index, len(bucket_members) - 1, offset))
        bucket_members[-1].append(len(slots) - 1)
        fill = offset + spec.numel
    if not bucket_members[-1]:
        bucket_members.pop()

    granule = world_size * alignment
    buckets = _bucket_layouts(
        slots, bucket_members, world_size, lambda _, used: max(granule, _round_up(used, granule))
    )
    return GroupLayout(group_index, dtype, tuple(slots), buckets, world_size, alignment)


def _bucket_layouts(
    slots: Sequence[ParamSlot],
    bucket_members: Sequence[Sequence[int]],
    world_size: int,
    numel_of: Callable[[int, int], int],
) -> tuple[BucketLayout, ...]:
    """The buckets holding ``bucket_members`` (indices into ``slots``, in offset order),
    each ``numel_of(index, used)`` elements long, their slices one after another in every
    rank's shard."""
    buckets = []
    shard_offset = 0
    for index, members in enumerate(bucket_members):
        used = max(slots[i].end for i in members)
        numel = numel_of(index, used)
        buckets.append(BucketLayout(index, numel, tuple(members), used, shard_offset, world_size))
        shard_offset += numel // world_size
    return tuple(buckets)


def _plan_whole_group(
    group_index: int,
    dtype: str,
    specs: Sequence[tuple[int, ParamSpec]],
    world_size: int,
    bucket_numel: int,
    alignment: int,
) -> GroupLayout:
    """Like ``_plan_group``, but every param lies whole inside one rank's slice
    (``owners.place_whole``)."""
    placement = place_whole(
        [spec.numel for _, spec in specs],
        [newton_schulz_cost(spec.shape) for _, spec in specs],
        world_size=world_size,
        bucket_numel=bucket_numel,
        alignment=alignment,
    )
    bucket_of = {i: b for b, members in enumerate(placement.buckets) for i in members}
    slots = tuple(
        ParamSlot(spec, reg_index, bucket_of[i], placement.offsets[i])
        for i, (reg_index, spec) in enumerate(specs)
    )
    slices = placement.slice_numels
    buckets = _bucket_layouts(
        slots, placement.buckets, world_size, lambda index, _: slices[index] * world_size
    )
    return GroupLayout(group_index, dtype, slots, buckets, world_size, alignment, whole=True)


def plan_layout(
    groups: Sequence[Sequence[ParamSpec]],
    *,
    world_size: int,
    bucket_numel: int,
    alignment: int = DEFAULT_ALIGNMENT,
    whole_params: bool | Collection[int] = False,
) -> Layout:
    """Plan the flat, sharded layout of ``groups`` of trainable, deduplicated params.

    Args:
        groups: the param groups, each a sequence of ``ParamSpec`` in registration order.
        world_size: number of ranks the buckets are sliced for (>= 1).
        bucket_numel: target bucket size in elements (>= 1); a bigger param gets its own bucket.
        alignment: params start on multiples of this many elements (>= 1).
        whole_params: every param lies whole inside one rank's slice, for optimizers that
            step whole tensors (``owners``); buckets may pad more to balance the ranks.
            ``True``: in every group; indices into ``groups``: in those groups only.

    Returns:
        One ``GroupLayout`` per (param group, dtype); groups without params produce none.
    """
    for name, value in (
        ("world_size", world_size),
        ("bucket_numel", bucket_numel),
        ("alignment", alignment),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    seen: dict[str, int] = {}
    layouts = []
    for group_index, specs in enumerate(groups):
        by_dtype: dict[str, list[tuple[int, ParamSpec]]] = {}
        for reg_index, spec in enumerate(specs):
            if spec.name in seen:
                raise ValueError(
                    f"param {spec.name!r} appears in param groups {seen[spec.name]} and "
                    f"{group_index}; a param may belong to one group only: remove the duplicate"
                )
            seen[spec.name] = group_index
            by_dtype.setdefault(spec.dtype, []).append((reg_index, spec))
        for dtype, members in by_dtype.items():
            whole = whole_params is True or (
                not isinstance(whole_params, bool) and group_index in whole_params
            )
            plan_group = _plan_whole_group if whole else _plan_group
            layouts.append(
                plan_group(
                    group_index,
                    dtype,
                    list(reversed(members)),
                    world_size,
                    bucket_numel,
                    alignment,
                )
            )
    return Layout(tuple(layouts), world_size, bucket_numel, alignment)

"""DeepSpeed's ZeRO-1/2 flat partitions as a flatzero ``Layout`` (pure metadata).

The only home of DeepSpeed's padding and partition rule (``padded_numel``,
``partition_range``) and of its checkpoint's file names: the checkpoint reader and writer,
``measure``'s baselines and ``plan`` all use them from here.

DeepSpeed 0.19 (``runtime/zero/stage_1_and_2.py``) flattens every optimizer group into
one buffer: the group's trainable params with at least one element, in the group's order
(reordered round-robin over the ranks with ``round_robin_gradients``), each followed by
its alignment padding (``parameter_alignment``: zeros up to a multiple of 16 bytes, none
after the last param), the whole padded with zeros to a multiple of ``2 * world_size``
elements (its ``nccl_start_alignment_factor`` is 2) and cut into ``world_size`` equal
partitions; rank ``r`` owns the ``r``-th, its fp32 master partition and optimizer state
have that length. ``zero_to_fp32.py`` reconstructs the same.

That is a flatzero ``GroupLayout`` with one bucket, alignment 1 and DeepSpeed's offsets,
so ``reshard.index_layout`` and ``reshard.plan_reads`` map between DeepSpeed's partitions
and flatzero's shards in both directions, element run by element run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..layout import BucketLayout, GroupLayout, Layout, ParamSlot, ParamSpec

__all__ = [
    "ALIGNMENT_FACTOR",
    "MODEL_STATES",
    "alignment_paddings",
    "deepspeed_layout",
    "group_padding",
    "optim_file_name",
    "padded_numel",
    "partition_range",
    "round_robin_order",
]

ALIGNMENT_FACTOR = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: a group is padded to a multiple of this
times the world size (elements), so that every partition starts 4-byte aligned for fp16."""


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of DeepSpeed's flat buffer for ``numel`` elements at ``world_size``."""
    alignment = ALIGNMENT_FACTOR * world_size
    return -(-numel // alignment) * alignment


def partition_range(total_numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, numel)`` of ``rank``'s partition of a flat buffer, as DeepSpeed cuts it."""
    base, remainder = divmod(total_numel, world_size)
    start = rank * base + min(rank, remainder)
    return start, base + (1 if rank < remainder else 0)


def round_robin_order(count: int, world_size: int) -> list[int]:
    """The order ``round_robin_gradients`` flattens a group's ``count`` params in: those at
    positions ``0, ws, 2 ws, ...`` first, then ``1, ws + 1, ...``, and so on."""
    return [i for start in range(min(count, world_size)) for i in range(start, count, world_size)]


def alignment_paddings(specs: Sequence[ParamSpec], element_size: int) -> list[int]:
    """Zeros after each param with ``parameter_alignment`` (to a multiple of 16 bytes of
    ``element_size``-byte elements; none after the last param)."""
    align = 16 // math.gcd(16, element_size)
    out, offset = [], 0
    for index, spec in enumerate(specs):
        offset += spec.numel
        pad = 0 if index == len(specs) - 1 else (-offset) % align
        out.append(pad)
        offset += pad
    return out


def _group(
    group_index: int, specs: Sequence[ParamSpec], paddings: Sequence[int], world_size: int
) -> GroupLayout:
    slots, offset = [], 0
    for index, (spec, pad) in enumerate(zip(specs, paddings, strict=True)):
        slots.append(ParamSlot(spec, index, 0, offset))
        offset += spec.numel + pad
    numel = padded_numel(offset, world_size)
    bucket = BucketLayout(0, numel, tuple(range(len(slots))), offset, 0, world_size)
    dtype = specs[0].dtype if specs else "float32"
    return GroupLayout(group_index, dtype, tuple(slots), (bucket,), world_size, 1)


def deepspeed_layout(
    groups: Sequence[Sequence[ParamSpec]],
    world_size: int,
    paddings: Sequence[Sequence[int]] | None = None,
) -> Layout:
    """DeepSpeed's flat layout of ``groups`` at ``world_size`` ranks.

    Args:
        groups: per optimizer group, its params in DeepSpeed's flat order (round-robin
            order already applied; params without elements left out).
        world_size: data-parallel ranks (>= 1).
        paddings: per group, the zeros after each param (``param_alignment_paddings``);
            default none.

    Returns:
        A ``Layout`` whose group ``i`` is DeepSpeed's group ``i``: one bucket, rank ``r``'s
        shard is DeepSpeed's partition ``r`` (``shard_numel`` elements).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    pads = paddings if paddings is not None else [[0] * len(g) for g in groups]
    layouts = tuple(
        _group(i, specs, pad, world_size)
        for i, (specs, pad) in enumerate(zip(groups, pads, strict=True))
    )
    bucket_numel = max((g.buckets[0].numel for g in layouts), default=1)
    return Layout(layouts, world_size, max(1, bucket_numel), 1)


def group_padding(group: GroupLayout, rank: int) -> int:
    """DeepSpeed's ``groups_padding`` of ``group`` on ``rank``: the elements at the end of
    its partition that lie past the params (stripped from the saved fp32 partition)."""
    width = group.shard_numel
    used = group.buckets[0].used
    return min(width, max(0, (rank + 1) * width - used))


MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's model-states file of a data-parallel ZeRO-1/2 run."""


def optim_file_name(rank: int, dtype: torch.dtype) -> str:
    """Rank ``rank``'s optimizer-state file (``bf16_``-prefixed when training in bf16, as
    DeepSpeed names and looks for it)."""
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

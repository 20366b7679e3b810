"""Whole-param placement: which rank owns each whole param of a group, and where it sits.

An optimizer that needs whole tensors (Muon orthogonalizes each 2-D update; Adafactor
factors each matrix's second moment) cannot step a flat slice that cuts a matrix. In a
*whole-param group* every param lies inside one rank's slice of its bucket, so the rank
that owns the slice owns the whole matrix: the reductions already sum each slice onto its
owner, the owner steps the matrix, and the usual all-gather spreads the new values. Each
matrix is stepped exactly once per step over all ranks.

Pure arithmetic on element counts: ``layout.plan_layout`` turns the placement into slots
and buckets. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WholePlacement", "newton_schulz_cost", "place_whole"]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Relative cost of orthogonalizing a param of ``shape`` (multiply-adds of one
    Newton-Schulz iteration, ~ ``m * n * min(m, n)``). As DeepSpeed's Muon orthogonalizes
    them: a 3-D param (fused MoE experts) is a batch of ``shape[0]`` matrices, a 4-D one
    (a convolution) one ``shape[0]`` by ``prod(shape[1:])`` matrix; a param of another rank
    costs its element count (an elementwise update)."""
    dims = [int(d) for d in shape]
    if len(dims) == 4:
        dims = [dims[0], math.prod(dims[1:])]
    if len(dims) in (2, 3):
        m, n = dims[-2], dims[-1]
        return math.prod(dims[:-2]) * m * n * min(m, n)
    return math.prod(dims)


@dataclass(frozen=True)
class WholePlacement:
    """Where the params of one whole-param group go.

    Attributes:
        buckets: per bucket, the indices (into the group's params, in layout order) of its
            params, in offset order.
        offsets: per param, its first element inside its bucket.
        slice_numels: per bucket, the elements of every rank's slice (a multiple of the
            alignment); the bucket holds ``world_size`` of them.
        owners: per param, the rank whose slice holds it whole.
    """

    buckets: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    slice_numels: tuple[int, ...]
    owners: tuple[int, ...]


def _windows(numels: Sequence[int], world_size: int, bucket_numel: int, alignment: int):
    """Split params (in layout order) into bucket windows of about ``bucket_numel``
    elements. A window grows to ``world_size`` times its largest param so that a param
    bigger than a bucket does not leave the other ranks' slices of its bucket empty."""
    window: list[int] = []
    total = largest = 0
    for i, numel in enumerate(numels):
        size = _round_up(numel, alignment)
        limit = max(bucket_numel, world_size * max(largest, size))
        if window and total + size > limit:
            yield window
            window, total, largest = [], 0, 0
        window.append(i)
        total += size
        largest = max(largest, size)
    if window:
        yield window


def place_whole(
    numels: Sequence[int],
    costs: Sequence[int],
    *,
    world_size: int,
    bucket_numel: int,
    alignment: int,
) -> WholePlacement:
    """Place whole params (in layout order) on owner ranks, bucket by bucket.

    Inside a bucket the params go largest first to the rank with the fewest elements in
    that bucket (the slice is as long as the fullest rank's: less padding), ties to the
    rank with the least cost so far over all buckets (``newton_schulz_cost``: the step's
    work per rank balances over the whole model), then the lowest rank.

    Args:
        numels: each param's element count.
        costs: each param's step cost (``newton_schulz_cost``).
        world_size: ranks (>= 1).
        bucket_numel: target bucket size in elements.
        alignment: params start on multiples of this many elements.
    """
    offsets = [0] * len(numels)
    owners = [0] * len(numels)
    load = [0] * world_size  # cost placed on each rank so far, over all buckets
    buckets, slices = [], []
    for window in _windows(numels, world_size, bucket_numel, alignment):
        fill = [0] * world_size
        mine: list[list[int]] = [[] for _ in range(world_size)]
        for i in sorted(window, key=lambda i: (-numels[i], -costs[i], i)):
            rank = min(range(world_size), key=lambda r: (fill[r], load[r], r))
            owners[i] = rank
            mine[rank].append(i)
            fill[rank] += _round_up(numels[i], alignment)
            load[rank] += costs[i]
        slice_numel = max(alignment, max(fill))
        members = []
        for rank, params in enumerate(mine):
            cursor = rank * slice_numel
            for i in sorted(params):  # layout order inside a rank's slice
                offsets[i] = cursor
                cursor += _round_up(numels[i], alignment)
                members.append(i)
        buckets.append(tuple(members))
        slices.append(slice_numel)
    return WholePlacement(tuple(buckets), tuple(offsets), tuple(slices), tuple(owners))

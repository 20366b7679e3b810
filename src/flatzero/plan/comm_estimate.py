"""Exposed data-parallel communication of one step: the seconds a rank waits on the link
instead of computing, without and with overlap (issue 42).

Without overlap nothing is assumed hidden: every bucket's all-gather after the step and
every bucket's reduce-scatter (stage 2: one per micro-batch). With overlap (stage 2's
reductions during backward, the gathers during the next forward) what stays exposed is
the last bucket's reduction of a backward and the first bucket's gather of a forward;
the largest bucket is taken for both. Seconds are bytes received at the plan's collective
bus bandwidth (``Rates.collective_gbps``: the intra-node link, or the network's share
across nodes), as ``time_model.step_comm`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..layout import Layout
from .memory_model import itemsize
from .rates import Rates

__all__ = ["ExposedComm", "exposed_comm", "plan_exposed_comm"]


@dataclass(frozen=True)
class ExposedComm:
    """Data-parallel communication a step leaves exposed, per rank.

    Attributes:
        buckets: buckets over all groups.
        without_overlap_s: every bucket's all-gather and reduce-scatter, in seconds.
        with_overlap_s: one bucket's all-gather + one bucket's reduce-scatter (the largest
            bucket; stage 2: one reduce-scatter per micro-batch), in seconds.
    """

    buckets: int
    without_overlap_s: float
    with_overlap_s: float


def exposed_comm(
    buckets: Sequence[tuple[int, int]],
    *,
    stage: int,
    grad_accum: int,
    seconds: Callable[[int], float],
) -> ExposedComm:
    """The exposed communication of a step.

    Args:
        buckets: per bucket, (bytes its all-gather receives, bytes its reduce-scatter
            receives) on one rank.
        stage: ZeRO stage, 1 or 2 (stage 2 reduces once per micro-batch).
        grad_accum: micro-batches per step (>= 1).
        seconds: seconds to receive a number of bytes over the link.
    """
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    if not buckets:
        return ExposedComm(0, 0.0, 0.0)
    reductions = grad_accum if stage == 2 else 1
    gathered = sum(g for g, _ in buckets)
    reduced = sum(r for _, r in buckets) * reductions
    largest_gather = max(g for g, _ in buckets)
    largest_reduce = max(r for _, r in buckets) * reductions
    return ExposedComm(
        buckets=len(buckets),
        without_overlap_s=seconds(gathered + reduced),
        with_overlap_s=seconds(largest_gather + largest_reduce),
    )


def plan_exposed_comm(
    layout: Layout, *, reduce_dtype: str, stage: int, grad_accum: int, rates: Rates
) -> ExposedComm:
    """``exposed_comm`` of ``layout``'s buckets at ``rates``' collective bandwidth: each
    bucket's gather receives the other ranks' slices in the params' dtype, its
    reduce-scatter the same elements in ``reduce_dtype``."""
    buckets = [
        (
            (b.numel - b.slice_numel) * itemsize(g.dtype),
            (b.numel - b.slice_numel) * itemsize(reduce_dtype),
        )
        for g in layout.groups
        for b in g.buckets
    ]
    return exposed_comm(
        buckets,
        stage=stage,
        grad_accum=grad_accum,
        seconds=lambda n: rates.seconds(n, "collective"),
    )

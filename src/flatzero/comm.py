"""Thin helpers over ``torch.distributed`` that also work with no process group."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .devices import backend_of, collective_device, device_backends

__all__ = [
    "all_gather_buckets_from_own_slices",
    "all_gather_into",
    "all_reduce_max",
    "all_reduce_max_each",
    "all_reduce_min",
    "check_same_everywhere",
    "describe_differences",
    "on_host_gloo",
    "rank_of",
    "reduce_scatter_into",
    "world_size_of",
]

# torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_distributed(group: dist.ProcessGroup | None) -> bool:
    """True when a process group is in use (given, or the default one is initialized)."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def world_size_of(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 without any process group."""
    return dist.get_world_size(group) if is_distributed(group) else 1


def rank_of(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without any process group."""
    return dist.get_rank(group) if is_distributed(group) else 0


def _all_reduce_ints(
    values: list[int], op: dist.ReduceOp, group: dist.ProcessGroup | None
) -> list[int]:
    if world_size_of(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def _all_reduce_int(value: int, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> int:
    return _all_reduce_ints([value], op, group)[0]


def all_reduce_min(value: int, group: dist.ProcessGroup | None) -> int:
    """Minimum of an integer over all ranks."""
    return _all_reduce_int(value, dist.ReduceOp.MIN, group)


def all_reduce_max(value: int, group: dist.ProcessGroup | None) -> int:
    """Maximum of an integer over all ranks."""
    return _all_reduce_int(value, dist.ReduceOp.MAX, group)


def all_reduce_max_each(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Element-wise maximum of a list of integers (the same length everywhere) over all
    ranks, in one collective."""
    return _all_reduce_ints(values, dist.ReduceOp.MAX, group)


_SAME_PARAMS_FIX = (
    "Every rank must pass the same parameters (names, shapes, dtypes, requires_grad, "
    "groups) in the same order and the same config"
)
"""What to do about a difference ``check_same_everywhere`` finds, unless the caller says."""


def check_same_everywhere(
    what: str,
    fields: Mapping[str, str],
    group: dist.ProcessGroup | None,
    *,
    fix: str = _SAME_PARAMS_FIX,
) -> None:
    """Raise ``ValueError`` on every rank if any of ``fields`` differs between ranks.

    ``fields`` maps a name (``"FlattenConfig"``, ``"layout digest"``, ...) to a text that
    must be the same everywhere: what a setting means, never text that differs by rank
    for the same meaning (a device index, a path). Every rank takes part in one small
    all-reduce of a hash of all fields (its maximum and the maximum of its negation tell
    whether all ranks agree), so a mismatch is an error on all ranks at once rather than a
    later hang; only then are the values gathered, and the error names each differing
    field with every rank's value.
    """
    if world_size_of(group) == 1:
        return
    text = json.dumps(dict(fields), sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    high, neg_low = _all_reduce_ints([digest, -digest], dist.ReduceOp.MAX, group)
    if high == -neg_low:
        return
    values: list[Any] = [None] * world_size_of(group)
    dist.all_gather_object(values, dict(fields), group=group)
    raise ValueError(f"{what} differs between ranks: {describe_differences(values)}. {fix}")


def describe_differences(values: Sequence[Mapping[str, str]], limit: int = 300) -> str:
    """Each field whose value differs between ranks, with every rank's value (values
    longer than ``limit`` characters are cut around where they first differ)."""
    lines = []
    for name in sorted({k for v in values for k in v}):
        per_rank = [v.get(name, "<missing>") for v in values]
        if len(set(per_rank)) == 1:
            continue
        start = _first_difference(per_rank)
        shown = []
        for rank, value in enumerate(per_rank):
            if len(value) > limit:
                lo = max(0, start - limit // 3)
                value = ("..." if lo else "") + value[lo : lo + limit] + "..."
            shown.append(f"rank {rank}: {value!r}")
        lines.append(f"{name} ({'; '.join(shown)})")
    return "; ".join(lines)


def _first_difference(values: Sequence[str]) -> int:
    for i, chars in enumerate(zip(*values, strict=False)):
        if len(set(chars)) > 1:
            return i
    return min(len(v) for v in values)


class _Works:
    """Several collectives' works, waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def on_host_gloo(device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether gloo runs ``group``'s collectives of tensors on ``device``: host memory on a
    group whose host backend is gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...:
    ``devices.device_backends``). gloo's all-gather and reduce-scatter stage the whole
    tensor in temporaries of their own; flatzero broadcasts and reduces in place there."""
    return device.type == "cpu" and device_backends(backend_of(group)).get("cpu") == "gloo"


def _all_gather_by_broadcasts(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> _Works | None:
    """All-gather on gloo in host memory as one broadcast per rank, each rank's slice of
    ``output`` in place: gloo's all-gather receives into a temporary as large as
    ``output`` and then copies it out, so every call costs one more ``output`` of host
    memory (two in flight on gloo's two threads) and a copy of it; the broadcasts move
    the same bytes with neither (``benchmarks/probes/gloo_all_gather.py``)."""
    pieces = output.view(world_size_of(group), -1).unbind(0)
    own = pieces[rank_of(group)]
    if shard.data_ptr() != own.data_ptr():
        own.copy_(shard.reshape(-1))
    works = [
        dist.broadcast(piece, group_src=src, group=group, async_op=True)
        for src, piece in enumerate(pieces)
    ]
    if async_op:
        return _Works(works)
    _Works(works).wait()
    return None


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, async_op=False
):
    """All-gather equal ``shard``s into ``output`` (``shard`` may be a view of ``output``'s
    own slice): rank ``r``'s ``shard`` lands in the ``r``-th ``shard.numel()`` elements.
    With ``async_op``, returns a work with ``wait()`` (None at world size 1).

    Host tensors on gloo are gathered by in-place broadcasts (``_all_gather_by_broadcasts``)
    when ``output`` and ``shard`` are contiguous and of one dtype, else by torch's
    all-gather, as device tensors always are.

    Raises:
        ValueError: ``output`` does not hold exactly world size ``shard``s.
    """
    world = world_size_of(group)
    if world == 1:
        if shard.data_ptr() != output.data_ptr():
            output.copy_(shard)
        return None
    if world > 1 and output.numel() != world * shard.numel():
        raise ValueError(
            f"all_gather_into: the output holds {output.numel()} elements, not {world} ranks "
            f"x {shard.numel()} (the shard): every rank must pass equal shards"
        )
    if (
        world > 1
        and shard.numel() > 0
        and output.is_contiguous()
        and shard.is_contiguous()
        and shard.dtype == output.dtype
        and on_host_gloo(output.device, group)
    ):
        return _all_gather_by_broadcasts(output, shard, group, async_op)
    return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, async_op=False
):
    """Sum ``full`` over ranks and leave this rank's equal slice of the result in ``output``."""
    if world_size_of(group) == 1:
        output.copy_(full)
        return None
    return _reduce_scatter_single(output, full, group=group, async_op=async_op)


def all_gather_buckets_from_own_slices(
    buckets: Sequence[torch.Tensor],
    own_slices: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    sources: Sequence[torch.Tensor] | None = None,
) -> None:
    """Fill every bucket from every rank's slice of it: the all-gather that ends init, a
    step and a load.

    ``own_slices[i]`` is this rank's slice of ``buckets[i]`` (a view of it). With
    ``sources``, each rank first copies ``sources[i]`` into its slice (cast to the
    bucket's dtype); then every bucket is all-gathered, asynchronously, bucket ``i``
    launched right after its copy, and all are waited for at the end. Collective: every
    rank passes the same buckets in the same order.
    """
    copies = sources if sources is not None else [None] * len(own_slices)
    works = []
    for bucket, own, source in zip(buckets, own_slices, copies, strict=True):
        if source is not None:
            own.copy_(source)
        works.append(all_gather_into(bucket, own, group, async_op=True))
    for work in works:
        if work is not None:
            work.wait()

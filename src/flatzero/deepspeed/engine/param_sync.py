"""Making every rank's initial weights the same (``flatzero.param_sync``), and putting the
rest of the model (frozen params, buffers) on the device in the training dtype, as
DeepSpeed's engine does."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import all_gather_buckets_from_own_slices, world_size_of
from ...devices import collective_device
from ...dtypes import int_of_width
from ...flatten import FlatParams
from ...flatten.registry import spec

__all__ = ["bitwise_sum", "place_rest", "sync_params"]

_CHECKSUM_CHUNK = 2**24
"""Elements summed at a time by ``bitwise_sum`` (its scratch is 128 MiB of int64 at most)."""


def bitwise_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s elements read as integers of the same width (an int64 scalar on
    ``t``'s device): equal on two ranks when their bits are, and computed chunk by chunk,
    never as a widened copy of the whole bucket."""
    words = t.view(int_of_width(t.itemsize))
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), _CHECKSUM_CHUNK):
        total += words[lo : lo + _CHECKSUM_CHUNK].sum(dtype=torch.int64)
    return total


def _check_equal(flat: FlatParams, group: Any) -> str:
    """``param_sync="check"``: raise on every rank if any rank's weights differ."""
    sums = torch.stack([bitwise_sum(b) for g in flat.groups for b in g.buckets]).to(
        collective_device(group, flat.groups[0].device)
    )
    gathered = [torch.empty_like(sums) for _ in range(world_size_of(group))]
    dist.all_gather(gathered, sums, group=group)
    if any(not torch.equal(gathered[0], s) for s in gathered[1:]):
        raise ValueError(
            "the model's initial weights differ between ranks (flatzero.param_sync='check'); "
            "build the model with the same seed on every rank, or use param_sync='gather'"
        )
    return "check (equal on all ranks)"


def _broadcast_from_rank0(flat: FlatParams, group: Any) -> str:
    """Stage 0 (every rank holds every bucket and a one-rank master): rank 0's weights."""
    works = [
        dist.broadcast(b, src=0, group=group, async_op=True) for g in flat.groups for b in g.buckets
    ]
    for work in works:
        work.wait()
    for g in flat.groups:  # the one-rank master is the whole bucket
        if g.master is not None:
            for b in range(len(g.buckets)):
                g.master_slice(b).copy_(g.bucket_shard(b))
    return "broadcast from rank 0"


@torch.no_grad()
def sync_params(flat: FlatParams, mode: str, group: Any, replicated: bool) -> str:
    """Make every rank's initial weights equal (``mode``: ``gather``, ``check`` or ``none``;
    ``replicated``: stage 0 broadcasts from rank 0); returns what was done."""
    if world_size_of(group) == 1 or mode == "none":
        return "nothing (one rank)" if world_size_of(group) == 1 else "none"
    if mode == "check":
        return _check_equal(flat, group)
    if replicated:
        return _broadcast_from_rank0(flat, group)
    tiers = {t for g in flat.report.groups for t in g.bucket_tiers}
    if all(spec(t).fill_is_collective(world_size_of(group)) for t in tiers):
        return f"the {'/'.join(sorted(tiers))} tier's all-gather"
    all_gather_buckets_from_own_slices(
        [b for g in flat.groups for b in g.buckets],
        [g.bucket_shard(b) for g in flat.groups for b in range(len(g.buckets))],
        group,
    )
    return "gather (each rank's slice of every bucket)"


def _to_target(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` on ``device``, and in ``dtype`` when it is floating (itself when it already is)."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    if t.device != device or t.dtype != target:
        return t.to(device=device, dtype=target)
    return t


@torch.no_grad()
def place_rest(
    model: nn.Module,
    flat: FlatParams,
    dtype: torch.dtype | None,
    group: Any,
    broadcast: bool,
    buffer_dtype: torch.dtype | None = None,
) -> None:
    """Frozen params and buffers to the buckets' device, as DeepSpeed's engine moves the
    module: floating frozen params in ``dtype`` (the training dtype), floating buffers in
    ``buffer_dtype`` when given, else in their own (DeepSpeed 0.19 keeps fp32 buffers such
    as a rotary ``inv_freq`` fp32); with ``broadcast``, rank 0's values win."""
    device = flat.groups[0].device
    flattened = {id(p) for g in flat.groups for p in g.params}
    tensors = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in flattened:
                moved = _to_target(p.data, device, dtype)
                if moved is not p.data:
                    p.data = moved
                tensors.append(p.data)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b = _to_target(b, device, buffer_dtype)
                tensors.append(b)
    if broadcast and world_size_of(group) > 1:
        for t in tensors:
            dist.broadcast(t, src=0, group=group)
